"""What a transfer is, checked once: its :class:`Direction` and a :class:`TransferPlan` of per-group ids, skips and
sizes, built and validated by :class:`TransferPlanner` before anything moves, so a bad call raises and writes nothing.
Issuers (:mod:`triton_offload.issuers.base`) take plans as they are; the kernel packs its own id buffer from them.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator, Sequence
from numbers import Integral
from typing import NamedTuple

import numpy as np
import torch

from triton_offload._checks import AUTO, DMA, KERNEL, int_in_range
from triton_offload.layouts import KVCacheSpec

__all__ = ["Direction", "BlockIds", "TransferPlan", "TransferPlanner", "check_host_buffer"]

BlockIds = Sequence[int] | np.ndarray | torch.Tensor
_INT64_MAX = int(np.iinfo(np.int64).max)
# Rows (GPU block x segment) one transfer may move: the copy kernel indexes them in 32 bits.
MAX_ROWS = 2**31 - 1


class Direction(str, enum.Enum):
    """Which way a transfer moves: a *store* (GPU -> host, what ``gather_blocks`` does) or a *load* (host -> GPU,
    ``scatter_blocks``). A ``str``: it compares equal to, and prints as, ``"store"`` / ``"load"``."""

    STORE = "store"
    LOAD = "load"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    __hash__ = str.__hash__  # Enum's own hashes the name in Python: a dict keyed by direction is read per call


_STORE = Direction.STORE  # a module global is read faster than the class attribute, on every call


class TransferPath(str, enum.Enum):
    """How a transfer moves: the Triton kernel, the copy engines, or per call the one ``auto``'s calibration predicts
    cheaper (triton_offload/path_choice.py). A ``str``, as :class:`Direction` is: it compares equal to, and prints
    as, its name; a path added to :data:`triton_offload.issuers.factory.PATHS` is named by a plain ``str``."""

    AUTO = AUTO
    KERNEL = KERNEL
    DMA = DMA

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    __hash__ = str.__hash__  # the engine's issuers are keyed by path


# A NamedTuple: immutable, and built on every call several times faster than a frozen dataclass.
class TransferPlan(NamedTuple):
    """A validated transfer (built by :meth:`TransferPlanner.plan`).

    Attributes:
        direction: store or load.
        gpu_ids: int64, the GPU block ids of every group, concatenated group by group.
        host_ids: int64, the host block ids of every group, concatenated group by group.
        n_blocks: GPU blocks moved (``gpu_ids.size``).
        n_host: host block ids (``host_ids.size``).
        sizes: GPU ids per KV-cache group.
        skips: per group, the position of its first GPU block in its first host block.
        host_counts: host ids per group, ``ceil((skip + size) / f)`` (0 for a group that moves nothing).
        num_bytes: bytes moved (each group's blocks times that group's bytes per block).
        identities: int64, one per host id, naming each host block's content for the integrity checks (a key's
            hash, triton_offload/integrity.py); None: each host block is named by its id.
    """

    direction: Direction
    gpu_ids: np.ndarray
    host_ids: np.ndarray
    n_blocks: int
    n_host: int
    sizes: tuple[int, ...]
    skips: tuple[int, ...]
    host_counts: tuple[int, ...]
    num_bytes: int
    identities: np.ndarray | None = None

    def host_index(self, blocks_per_host_block: int) -> np.ndarray:
        """For each GPU block (group by group), the index in ``host_ids`` of the host block it is in: the position
        rule (block ``i`` of a group at position ``skip + i``, host id ``first + (skip + i) // f`` of its group)."""
        f = blocks_per_host_block
        if len(self.sizes) == 1:
            return (self.skips[0] + np.arange(self.n_blocks, dtype=np.int64)) // f
        out, first = [], 0
        for size, skip, count in zip(self.sizes, self.skips, self.host_counts):
            out.append(first + (skip + np.arange(size, dtype=np.int64)) // f)
            first += count
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def groups(self) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
        """(GPU ids, host ids, skip) of each KV-cache group, in order."""
        if len(self.sizes) == 1:
            yield self.gpu_ids, self.host_ids, self.skips[0]
            return
        g = h = 0
        for size, skip, count in zip(self.sizes, self.skips, self.host_counts):
            yield self.gpu_ids[g : g + size], self.host_ids[h : h + count], skip
            g, h = g + size, h + count


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


def _as_identities(identities: BlockIds, m: int) -> np.ndarray:
    """Identities as a 1-D int64 array of one per host id; uint64 values keep their bits."""
    if type(identities) is np.ndarray and identities.dtype == np.int64 and identities.shape == (m,):
        return identities
    if isinstance(identities, torch.Tensor):
        identities = identities.detach().cpu().numpy()
    arr = np.asarray(identities)
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"identities must hold integers, got {arr.dtype}")
    if arr.shape != (m,):
        raise ValueError(f"identities has shape {arr.shape}, expected one per host block id: ({m},)")
    return arr.astype(np.uint64 if arr.dtype.kind == "u" else np.int64, copy=False).view(np.int64)


def _check_range(ids: np.ndarray, name: str, limit: int) -> None:
    # One reduction for both bounds: as unsigned, a negative id is larger than any limit.
    if ids.size and ids.view(np.uint64).max() >= limit:
        bad = int(np.flatnonzero((ids < 0) | (ids >= limit))[0])
        raise ValueError(f"{name}[{bad}] = {int(ids[bad])} is out of range [0, {limit})")


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


def _group_layout(spec, n, skip, group_sizes, f) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-group sizes and skips as short tuples (groups are few: plain Python is cheaper than NumPy here), checked
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
    return tuple(sizes), tuple(skips)


class TransferPlanner:
    """Validates the ids of transfers between one spec and a host buffer of ``num_host_blocks`` blocks of
    ``blocks_per_host_block`` GPU blocks, for callers that checked the host buffer once (:func:`check_host_buffer`).

    Every check is vectorised and O(n): one unsigned reduction for the bounds of both arrays, and duplicated
    destinations found by scattering each id's position into a mark array kept between calls (an id written twice
    keeps only its last position), not by sorting. The marks are shared state, used under a lock, so one planner may
    serve several threads.
    """

    def __init__(self, spec: KVCacheSpec, num_host_blocks: int, blocks_per_host_block: int):
        self.spec = spec
        self.num_host_blocks = int_in_range(num_host_blocks, "num_host_blocks", 0)
        self.blocks_per_host_block = int_in_range(blocks_per_host_block, "blocks_per_host_block", 1)
        # Per destination kind (by its id limit: GPU blocks for loads, host blocks for stores), one int32 per id,
        # allocated on first use.
        self._marks: dict[int, np.ndarray] = {}
        self._ramp = np.arange(1024, dtype=np.int32)
        self._scratch = np.empty(2048, dtype=np.int64)  # a call's GPU and host ids side by side (under the lock)
        self._bounds = np.zeros(2, dtype=np.intp)  # [0, n]: where each starts in the scratch
        self._lock = threading.Lock()
        # The kernel indexes a transfer's rows (block x segment) in 32 bits.
        self.max_blocks = MAX_ROWS // max(1, spec.segments_per_group)

    def plan(
        self,
        gpu_block_ids: BlockIds,
        host_block_ids: BlockIds,
        *,
        direction: Direction,
        skip: int | Sequence[int] = 0,
        group_sizes: Sequence[int] | None = None,
        identities: BlockIds | None = None,
    ) -> TransferPlan:
        """Checks one transfer's ids, skips and group sizes (and identities, where given).

        With several KV-cache groups, ``gpu_block_ids`` and ``host_block_ids`` are concatenated group by group:
        ``group_sizes[g]`` GPU ids and ``ceil((skip[g] + group_sizes[g]) / f)`` host ids for group g (none when it
        moves no block), and ``skip`` is an int or one skip per group. ``identities``: one 64-bit value per host id
        naming its content for the integrity checks (int64, or uint64 taken bit for bit).

        Raises:
            TypeError: ids that are not integers.
            ValueError: more than :attr:`max_blocks` blocks, any id out of range, a duplicated destination, a host
                id count other than ``ceil((skip + n) / blocks_per_host_block)`` (per group), ``skip >=
                blocks_per_host_block``, or group sizes that do not match the spec or the ids. The message names the
                value.
        """
        spec, f = self.spec, self.blocks_per_host_block
        g = _as_ids(gpu_block_ids, "gpu_block_ids", spec.num_blocks)
        if g.size > self.max_blocks:
            raise ValueError(
                f"len(gpu_block_ids) = {g.size} is more than one transfer moves: at most {self.max_blocks} blocks of "
                f"{spec.segments_per_group} segments ({MAX_ROWS} rows); split it"
            )
        h = _as_ids(host_block_ids, "host_block_ids", self.num_host_blocks)
        if group_sizes is None and spec.num_groups == 1 and type(skip) is int:
            # The call every single-group engine makes, kept free of the per-group tuples' work (this path is held
            # to a 10 us budget at 1024 blocks).
            if not 0 <= skip < f:
                int_in_range(skip, "skip", 0, f)
            sizes, skips, need = (g.size,), (skip,), (-(-(skip + g.size) // f) if g.size else 0,)
        else:
            sizes, skips = _group_layout(spec, g.size, skip, group_sizes, f)
            need = tuple(-(-(k + n) // f) if n else 0 for k, n in zip(skips, sizes))  # host ids per group
        if h.size != (need[0] if len(need) == 1 else sum(need)):
            if len(sizes) == 1:
                expect = f"ceil((skip + n) / f) = ceil(({skips[0]} + {g.size}) / {f}) = {need[0]}"
            else:
                expect = f"per group ceil((skip + n) / f) = {list(need)}, {sum(need)} in all"
            raise ValueError(f"len(host_block_ids) = {h.size}, expected {expect}")
        if identities is not None:
            identities = _as_identities(identities, h.size)
        if g.size:
            self._check_ids(direction, g, h, sizes, need)
        if spec.num_groups == 1:
            num_bytes = g.size * spec.bytes_per_block
        else:
            num_bytes = sum(k * b for k, b in zip(sizes, spec.group_bytes))
        return TransferPlan(direction, g, h, g.size, h.size, sizes, skips, need, num_bytes, identities)

    def _check_ids(self, direction: Direction, g: np.ndarray, h: np.ndarray, sizes, host_counts) -> None:
        """Ranges of both arrays, and distinct destinations (sources may repeat; two writers of one block would
        race). With host regions (``spec.group_regions``), host ids are distinct per region."""
        n, m = g.size, h.size
        with self._lock:
            # Both arrays side by side in a scratch buffer kept between calls: one reduction then takes both maxima,
            # cheaper than a reduction call per array, and the duplicate check indexes contiguous ids. Read as
            # unsigned, a negative id is larger than any limit.
            if self._scratch.size < n + m:
                self._scratch = np.empty(max(n + m, 2 * self._scratch.size), dtype=np.int64)
            both = self._scratch[: n + m]
            both[:n] = g
            both[n:] = h
            self._bounds[1] = n
            top = np.maximum.reduceat(both.view(np.uint64), self._bounds)
            if top[0] >= self.spec.num_blocks:
                _check_range(g, "gpu_block_ids", self.spec.num_blocks)
            if top[1] >= self.num_host_blocks:
                _check_range(h, "host_block_ids", self.num_host_blocks)
            if direction is _STORE:
                regions = self.spec.group_regions
                if regions is not None:
                    # A row holds one key per region: an id repeated in two regions names two keys. Per region,
                    # destinations are distinct: offset each group's ids into a range of its region's.
                    limit = self.num_host_blocks * self.spec.num_regions
                    owner = np.repeat(np.asarray(regions, dtype=np.int64) * self.num_host_blocks, host_counts)
                    self._check_unique(both[n:] + owner, "host_block_ids", limit, self.num_host_blocks)
                else:
                    self._check_unique(both[n:], "host_block_ids", self.num_host_blocks)
            else:
                self._check_unique(both[:n], "gpu_block_ids", self.spec.num_blocks)

    def _check_unique(self, ids: np.ndarray, name: str, limit: int, modulo: int | None = None) -> None:
        """Raises if ``ids`` (in range) repeats an id (named modulo ``modulo`` where ids were offset per group).
        Called under the lock."""
        n = ids.size
        if n < 2:
            return
        marks = self._marks.get(limit)
        if marks is None:
            marks = self._marks[limit] = np.empty(limit, dtype=np.int32)
        if self._ramp.size < n:
            self._ramp = np.arange(max(n, 2 * self._ramp.size), dtype=np.int32)
        ramp = self._ramp[:n]
        marks[ids] = ramp  # a repeated id keeps the position of its last occurrence
        seen = marks.take(ids)  # so its earlier occurrences read another position than their own
        # Compared as bytes: a memcmp, several times cheaper than an elementwise comparison and a reduction.
        if seen.tobytes() != ramp.tobytes():
            dup = int(ids[int(np.argmax(seen != ramp))])
            where = ""
            if modulo is not None:
                dup, where = dup % modulo, f" in host region {dup // modulo}"
            raise ValueError(
                f"{name} holds destination id {dup} more than once{where}: each destination is written once"
            )
