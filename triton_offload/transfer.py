"""Public gather/scatter API: each call is validated completely (:mod:`triton_offload.plan`), then moved by one kernel
launch for all blocks and layers (:mod:`triton_offload.issuers.kernel`), so a bad call raises and writes nothing. What
does not change between calls (planners, pinned id slots) is kept per spec and dropped with it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping, Sequence

import torch

from triton_offload._checks import int_in_range
from triton_offload._checks import launch_shape as check_launch_shape
from triton_offload.issuers.base import IssuerContext
from triton_offload.issuers.factory import build_kernel, kernel_launcher
from triton_offload.kernels.shapes import LaunchTuning
from triton_offload.layouts import KVCacheSpec, Layout, prepare_kv
from triton_offload.plan import BlockIds, Direction, TransferPlan, TransferPlanner, check_host_buffer
from triton_offload.staging import IdStager

__all__ = [
    "gather_blocks",
    "scatter_blocks",
    "transfer_blocks",
    "host_block_bytes",
    "plan_transfer",
    "planner_for",
]


class _PublicState:
    """What the public calls keep per spec, built on first use and dropped with the spec: a planner per host buffer
    size and f, and (CUDA) the pinned id staging slots."""

    def __init__(self, spec: KVCacheSpec):
        self.planners: dict[tuple[int, int], TransferPlanner] = {}
        self.stager = IdStager(spec.device) if spec.device.type == "cuda" else None


_PUBLIC: weakref.WeakKeyDictionary[KVCacheSpec, _PublicState] = weakref.WeakKeyDictionary()
_ON_ITS_DEVICE = contextlib.nullcontext()


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


def plan_transfer(
    spec: KVCacheSpec,
    host_buffer: torch.Tensor,
    gpu_block_ids: BlockIds,
    host_block_ids: BlockIds,
    *,
    direction: Direction,
    blocks_per_host_block: int,
    skip: int | Sequence[int],
    group_sizes: Sequence[int] | None = None,
) -> TransferPlan:
    """Validates one transfer without moving anything: the host buffer (:func:`~triton_offload.plan.
    check_host_buffer`), then the ids, skips and group sizes (:meth:`~triton_offload.plan.TransferPlanner.plan`,
    which says what is raised). Raises TypeError or ValueError naming the bad value."""
    f = int_in_range(blocks_per_host_block, "blocks_per_host_block", 1)
    check_host_buffer(spec, host_buffer, f)
    planner = planner_for(spec, host_buffer.shape[0], f)
    return planner.plan(gpu_block_ids, host_block_ids, direction=direction, skip=skip, group_sizes=group_sizes)


def transfer_blocks(
    spec: KVCacheSpec,
    host_buffer: torch.Tensor,
    gpu_block_ids: BlockIds,
    host_block_ids: BlockIds,
    *,
    direction: Direction,
    blocks_per_host_block: int = 1,
    skip: int | Sequence[int] = 0,
    num_ctas: int | None = None,
    group_sizes: Sequence[int] | None = None,
    tunings: Mapping[Direction, LaunchTuning] | None = None,
    launch_shape: str = "fixed",
) -> None:
    """:func:`gather_blocks` (a store) or :func:`scatter_blocks` (a load) of a prepared spec, by direction, with the
    launch tuning as a value (``tunings``, per direction; None for the measured defaults: bench/micro/tune.py passes its
    variants here). Asynchronous on CUDA, on the current stream of the spec's device (made the current device for the
    call)."""
    if num_ctas is not None:
        int_in_range(num_ctas, "num_ctas", 1)
    check_launch_shape(launch_shape)
    f = int_in_range(blocks_per_host_block, "blocks_per_host_block", 1)
    check_host_buffer(spec, host_buffer, f)
    planner = planner_for(spec, host_buffer.shape[0], f)
    plan = planner.plan(gpu_block_ids, host_block_ids, direction=direction, skip=skip, group_sizes=group_sizes)
    if plan.n_blocks == 0:
        return
    cuda = spec.device.type == "cuda"
    # On the caches' device, whichever is current: Triton launches on the current device's stream, and the slot's
    # guard must follow the launch on the stream that runs it. (Switched only when needed: it costs per call.)
    on_device = (
        torch.cuda.device(spec.device.index) if cuda and torch.cuda.current_device() != spec.device.index else None
    )
    with on_device or _ON_ITS_DEVICE:
        # The direct launch is proven once per compiled variant, then a lookup (CUDA only).
        kernel = kernel_launcher(spec, host_buffer, f, direction=direction, tunings=tunings, num_ctas=num_ctas,
                                 launch_shape=launch_shape)  # fmt: skip
        issuer = build_kernel(IssuerContext(spec, host_buffer, f, kernel.launcher, _public_state(spec).stager,
                                            kernel.num_ctas))  # fmt: skip
        if not cuda:
            issuer.issue(plan)
            return
        # The ids are packed straight into a pinned staging slot, so their upload is truly asynchronous (a copy from
        # pageable memory may synchronise with the stream) and no pinned memory is allocated per call.
        slot = issuer.issue(plan)
        # Reused once the launch has read the ids: the event follows it on the stream that runs it.
        slot.event.record(torch.cuda.current_stream(spec.device))
        issuer.release(slot, slot.event)


def gather_blocks(
    kv_caches: Sequence[torch.Tensor] | KVCacheSpec,
    gpu_block_ids: BlockIds,
    host_buffer: torch.Tensor,
    host_block_ids: BlockIds,
    *,
    layout: str | Layout | None = None,
    blocks_per_host_block: int = 1,
    skip: int | Sequence[int] = 0,
    num_ctas: int | None = None,
    group_sizes: Sequence[int] | None = None,
    launch_shape: str = "fixed",
    host_format: str | None = None,
) -> None:
    """Copies GPU blocks of every layer into packed host blocks, in one kernel launch (a store).

    ``gather_blocks(spec, gpu_block_ids, host_buffer, host_block_ids)`` with a prepared :class:`KVCacheSpec`, or
    with raw tensors and ``layout=``.

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
        launch_shape: ``"fixed"`` (``num_ctas`` programs, or the default's) or ``"size-aware"`` (by the caches' page
            runs, never above ``num_ctas``; :mod:`triton_offload.kernels.copy_blocks` explains both).
        group_sizes: with KV-cache groups (``KVCacheSpec(..., groups=...)``), GPU ids per group; the ids are then
            concatenated group by group and ``skip`` may be one per group (see :func:`plan_transfer`).
        host_format: with raw tensors, what the host rows hold (:mod:`triton_offload.host_format`): None or
            ``"native"``, the caches' bytes; ``"fp8_e4m3"``, FP8 values and per-head scales of bf16 / fp16 caches.
            With a prepared spec, None or the spec's own.
    """
    transfer_blocks(
        prepare_kv(kv_caches, layout, host_format),
        host_buffer,
        gpu_block_ids,
        host_block_ids,
        direction=Direction.STORE,
        blocks_per_host_block=blocks_per_host_block,
        skip=skip,
        num_ctas=num_ctas,
        group_sizes=group_sizes,
        launch_shape=launch_shape,
    )


def scatter_blocks(
    host_buffer: torch.Tensor,
    host_block_ids: BlockIds,
    kv_caches: Sequence[torch.Tensor] | KVCacheSpec,
    gpu_block_ids: BlockIds,
    *,
    layout: str | Layout | None = None,
    blocks_per_host_block: int = 1,
    skip: int | Sequence[int] = 0,
    num_ctas: int | None = None,
    group_sizes: Sequence[int] | None = None,
    launch_shape: str = "fixed",
    host_format: str | None = None,
) -> None:
    """Copies packed host blocks back into GPU blocks of every layer, in one kernel launch (a load).

    ``scatter_blocks(host_buffer, host_block_ids, spec, gpu_block_ids)``, or with raw tensors and ``layout=``. The
    inverse of :func:`gather_blocks`, with the same position rule: GPU block ``gpu_block_ids[i]`` reads position
    ``skip + i``. GPU ids are destinations and must be distinct; host ids may repeat.
    """
    transfer_blocks(
        prepare_kv(kv_caches, layout, host_format),
        host_buffer,
        gpu_block_ids,
        host_block_ids,
        direction=Direction.LOAD,
        blocks_per_host_block=blocks_per_host_block,
        skip=skip,
        num_ctas=num_ctas,
        group_sizes=group_sizes,
        launch_shape=launch_shape,
    )


def host_block_bytes(
    kv_caches: Sequence[torch.Tensor] | KVCacheSpec,
    layout: str | Layout | None = None,
    blocks_per_host_block: int = 1,
    host_format: str | None = None,
) -> int:
    """Bytes of one packed host block: ``blocks_per_host_block`` GPU blocks of all layers, in ``host_format``."""
    f = int_in_range(blocks_per_host_block, "blocks_per_host_block", 1)
    return prepare_kv(kv_caches, layout, host_format).host_block_bytes(f)
