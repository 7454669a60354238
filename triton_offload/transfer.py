"""Public gather/scatter API: validate a transfer completely, then launch one kernel for all blocks and layers.

Validation is vectorised (NumPy on the id arrays, no Python loop over blocks or layers) and happens before anything
is launched, so a bad call raises and writes nothing. Direction is spoken of as *store* (GPU -> host, what
:func:`gather_blocks` does) and *load* (host -> GPU, :func:`scatter_blocks`) everywhere below.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from numbers import Integral

import numpy as np
import torch

from triton_offload._checks import int_in_range
from triton_offload.fast_launch import enable_fast_launch, fast_launch_default
from triton_offload.kernels.copy_blocks import CopyLauncher, TransferPlan, pack_ids
from triton_offload.layouts import KVCacheSpec, Layout, prepare_kv
from triton_offload.staging import IdStager

__all__ = [
    "gather_blocks",
    "scatter_blocks",
    "host_block_bytes",
    "plan_transfer",
    "plan_ids",
    "TransferPlanner",
    "planner_for",
    "check_transfer",
    "check_host_buffer",
    "TransferPlan",
    "BlockIds",
]

BlockIds = Sequence[int] | np.ndarray | torch.Tensor
_INT64_MAX = int(np.iinfo(np.int64).max)


def _as_ids(ids: BlockIds, name: str, limit: int | None = None) -> np.ndarray:
    """Block ids as a 1-D int64 array; floats, bools and n-D arrays are a TypeError.

    An id int64 cannot hold (a uint64 >= 2**63, a Python int beyond int64) is a ValueError naming it as given, not
    wrapped to a negative number; ``limit`` (the ids' upper bound, when known) goes into the message.
    """
    if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1:
        return ids  # what the engines pass: nothing to convert or check
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got a tensor of {ids.dtype}")
        arr = ids.detach().cpu().numpy()
    else:
        arr = np.asarray(ids)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            # NumPy turns a list with an int beyond int64 into floats or objects: keep the ints exact for the message.
            if arr.ndim != 1 or not all(isinstance(v, Integral) and not isinstance(v, (bool, np.bool_)) for v in ids):
                raise TypeError(f"{name} must hold integers, got {arr.dtype} ({str(ids)[:60]})")
            arr = np.array([int(v) for v in ids], dtype=object)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind == "O" or (arr.dtype == np.uint64 and arr.size and arr.max() > _INT64_MAX):
        wide = [int(v) for v in arr]
        bad = [i for i, v in enumerate(wide) if not -_INT64_MAX - 1 <= v <= _INT64_MAX]
        if bad:
            bounds = f"[0, {limit})" if limit is not None else "(beyond int64)"
            raise ValueError(f"{name}[{bad[0]}] = {wide[bad[0]]} is out of range {bounds}")
    return arr.astype(np.int64, copy=False)


def _check_range(ids: np.ndarray, name: str, limit: int) -> None:
    # One reduction for both bounds: as unsigned, a negative id is larger than any limit.
    if ids.size and ids.view(np.uint64).max() >= limit:
        bad = int(np.flatnonzero((ids < 0) | (ids >= limit))[0])
        raise ValueError(f"{name}[{bad}] = {int(ids[bad])} is out of range [0, {limit})")


def _duplicate_error(name: str, dup: int) -> ValueError:
    return ValueError(f"{name} holds destination id {dup} more than once: each destination is written once")


def check_host_buffer(spec: KVCacheSpec, host_buffer: torch.Tensor, blocks_per_host_block: int) -> None:
    """Checks the host buffer's type, shape, row layout and memory kind against the KV caches.

    These never change for an engine, which checks them once at construction; the public calls check them per call.
    """
    if not isinstance(host_buffer, torch.Tensor):
        raise TypeError(f"host_buffer must be a torch.Tensor, got {type(host_buffer).__name__}")
    if host_buffer.dtype not in (torch.uint8, torch.int8):
        raise ValueError(f"host_buffer must be uint8 or int8, got {host_buffer.dtype}")
    want = spec.host_block_bytes(blocks_per_host_block)
    if host_buffer.dim() != 2 or host_buffer.shape[1] != want:
        raise ValueError(
            f"host_buffer must be (num_host_blocks, {want}) for {blocks_per_host_block} block(s) of "
            f"{spec.host_block_bytes(1)} bytes, got shape {tuple(host_buffer.shape)}"
        )
    if host_buffer.stride(1) != 1 or (host_buffer.shape[0] > 1 and host_buffer.stride(0) < want):
        raise ValueError(f"host_buffer rows must be contiguous and disjoint, got strides {host_buffer.stride()}")
    if host_buffer.device.type != "cpu":
        raise ValueError(f"host_buffer must be host memory, got a tensor on {host_buffer.device}")
    if spec.device.type == "cuda" and not host_buffer.is_pinned():
        # The kernel reads and writes host memory directly (zero-copy); pageable memory cannot be mapped.
        raise ValueError("host_buffer must be pinned (page-locked) memory when the KV caches are on CUDA")


def _group_layout(spec, n, skip, group_sizes, f) -> tuple[list[int], list[int]]:
    """Per-group sizes and skips as short lists (groups are few: plain Python is cheaper than NumPy here), checked
    against the spec's groups and n."""
    if group_sizes is None:
        if spec.num_groups != 1:
            raise ValueError(f"group_sizes is required: the KV caches have {spec.num_groups} groups")
        sizes = [n]
    else:
        sizes = _as_ids(group_sizes, "group_sizes").tolist()
        if len(sizes) != spec.num_groups:
            raise ValueError(f"len(group_sizes) = {len(sizes)}, expected one per KV-cache group = {spec.num_groups}")
        if sizes and min(sizes) < 0:
            raise ValueError(f"group_sizes = {sizes} must be >= 0")
        if sum(sizes) != n:
            raise ValueError(f"group_sizes = {sizes} sum to {sum(sizes)}, but there are {n} GPU ids")
    if isinstance(skip, (int, np.integer)) and not isinstance(skip, bool):
        skips = [int_in_range(skip, "skip", 0, f)] * len(sizes)
    else:
        skips = _as_ids(skip, "skip", f).tolist()
        if len(skips) != len(sizes):
            raise ValueError(f"len(skip) = {len(skips)}, expected one per KV-cache group = {len(sizes)}")
        for gi, s in enumerate(skips):
            int_in_range(s, f"skip[{gi}]", 0, f)
    return sizes, skips


class TransferPlanner:
    """Validates and packs the ids of transfers between one spec and a host buffer of ``num_host_blocks`` blocks of
    ``blocks_per_host_block`` GPU blocks: the per-call half of :func:`plan_transfer`, for callers that checked the
    host buffer once (the engines, and the public calls through :func:`planner_for`).

    Every check is vectorised and O(n): the ids are packed first, the ranges of both arrays take one reduction over
    the packed copy, and duplicated destinations are found by scattering each id's position into a mark array kept
    between calls (an id written twice keeps only its last position), not by sorting. The marks are shared state,
    used under a lock, so one planner may serve several threads. A call that raises may have written into its
    ``stage`` array, never anywhere else.
    """

    def __init__(self, spec: KVCacheSpec, num_host_blocks: int, blocks_per_host_block: int):
        self.spec = spec
        self.num_host_blocks = int_in_range(num_host_blocks, "num_host_blocks", 0)
        self.blocks_per_host_block = int_in_range(blocks_per_host_block, "blocks_per_host_block", 1)
        self._marks: dict[bool, np.ndarray] = {}  # store? -> one int32 per destination id, allocated on first use
        self._ramp = np.arange(1024, dtype=np.int32)
        self._bounds = np.zeros(2, dtype=np.intp)  # [0, n]: where the GPU and host ids start in the packed ids
        self._lock = threading.Lock()

    def plan(
        self,
        gpu_block_ids: BlockIds,
        host_block_ids: BlockIds,
        *,
        skip: int | Sequence[int] = 0,
        store: bool,
        group_sizes: Sequence[int] | None = None,
        stage: Callable[[int], np.ndarray] | None = None,
    ) -> TransferPlan:
        """Checks one transfer's ids, skips and group sizes and packs them (:func:`plan_transfer` says what is
        checked and raised). ``stage(size)``, if given, returns the array to pack into (see
        :func:`~triton_offload.kernels.copy_blocks.pack_ids`); it is the only thing a call that raises may have
        written."""
        spec, f = self.spec, self.blocks_per_host_block
        g = _as_ids(gpu_block_ids, "gpu_block_ids", spec.num_blocks)
        h = _as_ids(host_block_ids, "host_block_ids", self.num_host_blocks)
        if group_sizes is None and spec.num_groups == 1 and type(skip) is int:
            # The call every single-group engine makes, kept free of the per-group lists' work (this path is held
            # to a 10 us budget at 1024 blocks).
            if not 0 <= skip < f:
                int_in_range(skip, "skip", 0, f)
            sizes, skips, need = (g.size,), (skip,), (-(-(skip + g.size) // f) if g.size else 0,)
        else:
            sizes, skips = _group_layout(spec, g.size, skip, group_sizes, f)
            need = [-(-(k + n) // f) if n else 0 for k, n in zip(skips, sizes)]  # host ids per group
        if h.size != (need[0] if len(need) == 1 else sum(need)):
            if len(sizes) == 1:
                expect = f"ceil((skip + n) / f) = ceil(({skips[0]} + {g.size}) / {f}) = {need[0]}"
            else:
                expect = f"per group ceil((skip + n) / f) = {list(need)}, {sum(need)} in all"
            raise ValueError(f"len(host_block_ids) = {h.size}, expected {expect}")
        # Packed first (into the caller's staging, which nobody reads before this returns), then checked there: the
        # ranges of both id arrays take one reduction over the packed copy.
        plan = pack_ids(spec, store, g, h, sizes, skips, need, stage)
        self._check_ids(plan, g, h)
        return plan

    def _check_ids(self, plan: TransferPlan, g: np.ndarray, h: np.ndarray) -> None:
        """Ranges of both arrays, and distinct destinations (sources may repeat; two writers of one block would
        race), on the packed ids; the messages name the caller's arrays."""
        n, m = plan.n_blocks, plan.n_host
        if n == 0:
            return
        ids = plan.ids
        with self._lock:
            self._bounds[1] = n
            top = np.maximum.reduceat(ids[: n + m].view(np.uint64), self._bounds)  # unsigned: negatives are huge
            if top[0] >= self.spec.num_blocks:
                _check_range(g, "gpu_block_ids", self.spec.num_blocks)
            if top[1] >= self.num_host_blocks:
                _check_range(h, "host_block_ids", self.num_host_blocks)
            if plan.store:
                self._check_unique(ids[n : n + m], h, "host_block_ids", True, self.num_host_blocks)
            else:
                self._check_unique(ids[:n], g, "gpu_block_ids", False, self.spec.num_blocks)

    def _check_unique(self, ids: np.ndarray, given: np.ndarray, name: str, store: bool, limit: int) -> None:
        """Raises if ``ids`` (in range, contiguous) repeats an id; ``given`` is the caller's array, for the message.
        Called under the lock."""
        n = ids.size
        if n < 2:
            return
        marks = self._marks.get(store)
        if marks is None:
            marks = self._marks[store] = np.empty(limit, dtype=np.int32)
        if self._ramp.size < n:
            self._ramp = np.arange(max(n, 2 * self._ramp.size), dtype=np.int32)
        ramp = self._ramp[:n]
        marks[ids] = ramp  # a repeated id keeps the position of its last occurrence
        seen = marks.take(ids)  # so its earlier occurrences read another position than their own
        # Compared as bytes: a memcmp, several times cheaper than an elementwise comparison and a reduction.
        if seen.tobytes() != ramp.tobytes():
            raise _duplicate_error(name, int(given[int(np.argmax(seen != ramp))]))


class _PublicState:
    """What the public calls keep per spec, built on first use and dropped with the spec: a planner per host buffer
    size and f, and (CUDA) the pinned id staging slots."""

    def __init__(self, spec: KVCacheSpec):
        self.planners: dict[tuple[int, int], TransferPlanner] = {}
        self.stager = IdStager(spec.device) if spec.device.type == "cuda" else None


_PUBLIC: weakref.WeakKeyDictionary[KVCacheSpec, _PublicState] = weakref.WeakKeyDictionary()


def _public_state(spec: KVCacheSpec) -> _PublicState:
    state = _PUBLIC.get(spec)
    if state is None:
        state = _PUBLIC[spec] = _PublicState(spec)
    return state


def planner_for(spec: KVCacheSpec, num_host_blocks: int, blocks_per_host_block: int) -> TransferPlanner:
    """The shared :class:`TransferPlanner` of ``spec`` for a host buffer of ``num_host_blocks`` blocks (kept as long
    as the spec lives)."""
    planners = _public_state(spec).planners
    key = (num_host_blocks, blocks_per_host_block)
    planner = planners.get(key)
    if planner is None:
        planner = planners[key] = TransferPlanner(spec, num_host_blocks, blocks_per_host_block)
    return planner


def plan_ids(
    spec: KVCacheSpec,
    num_host_blocks: int,
    blocks_per_host_block: int,
    gpu_block_ids: BlockIds,
    host_block_ids: BlockIds,
    *,
    skip: int | Sequence[int],
    store: bool,
    group_sizes: Sequence[int] | None = None,
) -> TransferPlan:
    """Validates a transfer's ids against a host buffer already checked (:func:`check_host_buffer`) and packs them.

    This is :func:`plan_transfer` without the host-buffer checks, for callers that checked the buffer once. Raises as
    :func:`plan_transfer` does for the ids, skips and group sizes.
    """
    planner = planner_for(spec, num_host_blocks, blocks_per_host_block)
    return planner.plan(gpu_block_ids, host_block_ids, skip=skip, store=store, group_sizes=group_sizes)


def plan_transfer(
    spec: KVCacheSpec,
    host_buffer: torch.Tensor,
    gpu_block_ids: BlockIds,
    host_block_ids: BlockIds,
    *,
    blocks_per_host_block: int,
    skip: int | Sequence[int],
    store: bool,
    group_sizes: Sequence[int] | None = None,
) -> TransferPlan:
    """Validates one transfer and packs its ids for the kernel.

    With several KV-cache groups, ``gpu_block_ids`` and ``host_block_ids`` are concatenated group by group:
    ``group_sizes[g]`` GPU ids and ``ceil((skip[g] + group_sizes[g]) / f)`` host ids for group g (none when it moves
    no block), and ``skip`` is an int or one skip per group.

    Raises:
        TypeError: ids that are not integers, a host buffer that is not a tensor.
        ValueError: any id out of range, a duplicated destination, a host id count other than
            ``ceil((skip + n) / blocks_per_host_block)`` (per group), ``skip >= blocks_per_host_block``, group sizes
            that do not match the spec or the ids, or a host buffer of the wrong shape, dtype, device or memory
            kind. The message names the value.
    """
    f = int_in_range(blocks_per_host_block, "blocks_per_host_block", 1)
    check_host_buffer(spec, host_buffer, f)
    return plan_ids(
        spec, host_buffer.shape[0], f, gpu_block_ids, host_block_ids, skip=skip, store=store, group_sizes=group_sizes
    )


def check_transfer(spec, host_buffer, gpu_block_ids, host_block_ids, *, gather: bool, **kwargs) -> TransferPlan:
    """The former name of :func:`plan_transfer` (``gather=True`` is ``store=True``), kept for callers of 0.1."""
    return plan_transfer(spec, host_buffer, gpu_block_ids, host_block_ids, store=gather, **kwargs)


def _transfer(
    spec: KVCacheSpec,
    host_buffer: torch.Tensor,
    gpu_block_ids: BlockIds,
    host_block_ids: BlockIds,
    *,
    store: bool,
    blocks_per_host_block: int,
    skip: int | Sequence[int],
    num_ctas: int | None,
    group_sizes: Sequence[int] | None,
) -> None:
    if num_ctas is not None:
        int_in_range(num_ctas, "num_ctas", 1)
    f = int_in_range(blocks_per_host_block, "blocks_per_host_block", 1)
    check_host_buffer(spec, host_buffer, f)
    planner = planner_for(spec, host_buffer.shape[0], f)
    kw = dict(skip=skip, store=store, group_sizes=group_sizes)
    if spec.device.type != "cuda":
        plan = planner.plan(gpu_block_ids, host_block_ids, **kw)
        if plan.n_blocks:
            CopyLauncher(spec, host_buffer, f, store).launch(plan, torch.from_numpy(plan.ids), num_ctas)
        return
    # The ids are packed straight into a pinned staging slot, so their upload is truly asynchronous (a copy from
    # pageable memory may synchronise with the stream) and no pinned memory is allocated per call.
    stager = _public_state(spec).stager
    plan, slot = stager.staged(lambda stage: planner.plan(gpu_block_ids, host_block_ids, **kw, stage=stage))
    if plan.n_blocks == 0:
        stager.give_back(slot)
        return
    launcher = CopyLauncher(spec, host_buffer, f, store)
    if fast_launch_default():
        enable_fast_launch(launcher, num_ctas)  # proven once per compiled variant, then a lookup
    launcher.launch(plan, slot.upload(plan.ids.size), num_ctas)
    # Reused once the launch has read the ids: the event follows it on the current stream.
    slot.event.record()
    stager.give_back(slot, slot.event)


def _is_layout(value) -> bool:
    return value is None or isinstance(value, (str, Layout))


def gather_blocks(
    kv_caches: Sequence[torch.Tensor] | KVCacheSpec,
    gpu_block_ids: BlockIds,
    host_buffer: torch.Tensor,
    host_block_ids: BlockIds,
    *legacy,
    layout: str | Layout | None = None,
    blocks_per_host_block: int = 1,
    skip: int | Sequence[int] = 0,
    num_ctas: int | None = None,
    group_sizes: Sequence[int] | None = None,
) -> None:
    """Copies GPU blocks of every layer into packed host blocks, in one kernel launch (a store).

    ``gather_blocks(spec, gpu_block_ids, host_buffer, host_block_ids)`` with a prepared :class:`KVCacheSpec`, or
    with raw tensors and ``layout=``. The 0.1 form ``gather_blocks(kv_caches, layout, gpu_block_ids, host_buffer,
    host_block_ids)`` (``layout`` None with a prepared spec) still works.

    GPU block ``gpu_block_ids[i]`` lands at position ``p = skip + i``: host block ``host_block_ids[p // f]``,
    sub-block ``p % f``, where ``f = blocks_per_host_block``. The launch is asynchronous on CUDA (current stream).

    Args:
        kv_caches: a :class:`KVCacheSpec` built once, or per layer a tensor of ``layout``'s shape, e.g. block_first
            ``(num_blocks, 2, block_size, num_kv_heads, head_dim)``.
        gpu_block_ids: n source block ids (may repeat).
        host_buffer: (num_host_blocks, host_block_bytes) uint8/int8, pinned when the caches are on CUDA.
        host_block_ids: ``ceil((skip + n) / f)`` distinct destination host block ids.
        layout: ``"kv_first"``, ``"block_first"``, ``"mla"``, ``"canonical"`` or a :class:`Layout`, for raw tensors.
        blocks_per_host_block: f, GPU blocks per host block.
        skip: sub-blocks of the first host block left untouched (``0 <= skip < f``).
        num_ctas: programs (SMs) the launch may occupy; None for the tuned default.
        group_sizes: with KV-cache groups (``KVCacheSpec(..., groups=...)``), GPU ids per group; the ids are then
            concatenated group by group and ``skip`` may be one per group (see :func:`plan_transfer`).
    """
    if legacy:  # (kv_caches, layout, gpu_block_ids, host_buffer, host_block_ids)
        if len(legacy) != 1 or not _is_layout(gpu_block_ids) or layout is not None:
            raise TypeError("gather_blocks takes (spec, gpu_block_ids, host_buffer, host_block_ids)")
        layout, gpu_block_ids, host_buffer, host_block_ids = gpu_block_ids, host_buffer, host_block_ids, legacy[0]
    _transfer(
        prepare_kv(kv_caches, layout),
        host_buffer,
        gpu_block_ids,
        host_block_ids,
        store=True,
        blocks_per_host_block=blocks_per_host_block,
        skip=skip,
        num_ctas=num_ctas,
        group_sizes=group_sizes,
    )


def scatter_blocks(
    host_buffer: torch.Tensor,
    host_block_ids: BlockIds,
    kv_caches: Sequence[torch.Tensor] | KVCacheSpec,
    gpu_block_ids: BlockIds,
    *legacy,
    layout: str | Layout | None = None,
    blocks_per_host_block: int = 1,
    skip: int | Sequence[int] = 0,
    num_ctas: int | None = None,
    group_sizes: Sequence[int] | None = None,
) -> None:
    """Copies packed host blocks back into GPU blocks of every layer, in one kernel launch (a load).

    ``scatter_blocks(host_buffer, host_block_ids, spec, gpu_block_ids)``, or with raw tensors and ``layout=``; the
    0.1 form ``scatter_blocks(host_buffer, host_block_ids, kv_caches, layout, gpu_block_ids)`` still works. The
    inverse of :func:`gather_blocks`, with the same position rule: GPU block ``gpu_block_ids[i]`` reads position
    ``skip + i``. GPU ids are destinations and must be distinct; host ids may repeat.
    """
    if legacy:  # (host_buffer, host_block_ids, kv_caches, layout, gpu_block_ids)
        if len(legacy) != 1 or not _is_layout(gpu_block_ids) or layout is not None:
            raise TypeError("scatter_blocks takes (host_buffer, host_block_ids, spec, gpu_block_ids)")
        layout, gpu_block_ids = gpu_block_ids, legacy[0]
    _transfer(
        prepare_kv(kv_caches, layout),
        host_buffer,
        gpu_block_ids,
        host_block_ids,
        store=False,
        blocks_per_host_block=blocks_per_host_block,
        skip=skip,
        num_ctas=num_ctas,
        group_sizes=group_sizes,
    )


def host_block_bytes(
    kv_caches: Sequence[torch.Tensor] | KVCacheSpec, layout: str | Layout | None = None, blocks_per_host_block: int = 1
) -> int:
    """Bytes of one packed host block: ``blocks_per_host_block`` GPU blocks of all layers."""
    f = int_in_range(blocks_per_host_block, "blocks_per_host_block", 1)
    return prepare_kv(kv_caches, layout).host_block_bytes(f)
