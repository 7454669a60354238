"""Public gather/scatter API: validate a transfer completely, then launch one kernel for all blocks and layers.

Validation is vectorised (NumPy on the id arrays, no Python loop over blocks or layers) and happens before anything
is launched, so a bad call raises and writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from triton_offload.kernels.copy_blocks import launch_copy_blocks
from triton_offload.layouts import KVCacheSpec, Layout, prepare_kv

__all__ = ["gather_blocks", "scatter_blocks", "host_block_bytes", "check_transfer", "TransferPlan", "BlockIds"]

BlockIds = Sequence[int] | np.ndarray | torch.Tensor


def _as_ids(ids: BlockIds, name: str) -> np.ndarray:
    """Block ids as a 1-D int64 array; floats, bools and n-D arrays are a TypeError."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got a tensor of {ids.dtype}")
        arr = ids.detach().cpu().numpy()
    else:
        arr = np.asarray(ids)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got {arr.dtype} ({str(ids)[:60]})")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    return arr.astype(np.int64, copy=False)


def _check_range(ids: np.ndarray, name: str, limit: int) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= limit):
        bad = int(np.flatnonzero((ids < 0) | (ids >= limit))[0])
        raise ValueError(f"{name}[{bad}] = {int(ids[bad])} is out of range [0, {limit})")


def _check_unique(ids: np.ndarray, name: str) -> None:
    if ids.size > 1:
        s = np.sort(ids)
        dup = s[1:][s[1:] == s[:-1]]
        if dup.size:
            raise ValueError(
                f"{name} holds destination id {int(dup[0])} more than once: each destination is written once"
            )


def _check_int(value, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value >= high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{name} = {value} must be {bounds}")
    return int(value)


def check_host_buffer(spec: KVCacheSpec, host_buffer: torch.Tensor, blocks_per_host_block: int) -> None:
    """Checks the host buffer's type, shape, row layout and memory kind against the KV caches."""
    if not isinstance(host_buffer, torch.Tensor):
        raise TypeError(f"host_buffer must be a torch.Tensor, got {type(host_buffer).__name__}")
    if host_buffer.dtype not in (torch.uint8, torch.int8):
        raise ValueError(f"host_buffer must be uint8 or int8, got {host_buffer.dtype}")
    want = spec.host_block_bytes(blocks_per_host_block)
    if host_buffer.dim() != 2 or host_buffer.shape[1] != want:
        raise ValueError(
            f"host_buffer must be (num_host_blocks, {want}) for {blocks_per_host_block} block(s) of "
            f"{spec.bytes_per_block} bytes, got shape {tuple(host_buffer.shape)}"
        )
    if host_buffer.stride(1) != 1 or (host_buffer.shape[0] > 1 and host_buffer.stride(0) < want):
        raise ValueError(f"host_buffer rows must be contiguous and disjoint, got strides {host_buffer.stride()}")
    if host_buffer.device.type != "cpu":
        raise ValueError(f"host_buffer must be host memory, got a tensor on {host_buffer.device}")
    if spec.device.type == "cuda" and not host_buffer.is_pinned():
        # The kernel reads and writes host memory directly (zero-copy); pageable memory cannot be mapped.
        raise ValueError("host_buffer must be pinned (page-locked) memory when the KV caches are on CUDA")


@dataclass(frozen=True)
class TransferPlan:
    """A validated transfer, ready for one launch.

    Attributes:
        ids: int64, packed for the kernel: GPU ids, host ids and, when ``grouped``, each GPU block's group and per
            group (index of its first GPU block, skip, index of its first host id).
        n_blocks: GPU blocks moved.
        n_host: host block ids.
        skip: the skip of an ungrouped transfer.
        grouped: whether ``ids`` carries groups.
        num_bytes: bytes moved (each group's blocks times that group's bytes per block).
    """

    ids: np.ndarray
    n_blocks: int
    n_host: int
    skip: int
    grouped: bool
    num_bytes: int


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
        skips = [_check_int(skip, "skip", 0, f)] * len(sizes)
    else:
        skips = _as_ids(skip, "skip").tolist()
        if len(skips) != len(sizes):
            raise ValueError(f"len(skip) = {len(skips)}, expected one per KV-cache group = {len(sizes)}")
        for gi, s in enumerate(skips):
            _check_int(s, f"skip[{gi}]", 0, f)
    return sizes, skips


def check_transfer(
    spec: KVCacheSpec,
    host_buffer: torch.Tensor,
    gpu_block_ids: BlockIds,
    host_block_ids: BlockIds,
    *,
    blocks_per_host_block: int,
    skip: int | Sequence[int],
    gather: bool,
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
    f = _check_int(blocks_per_host_block, "blocks_per_host_block", 1)
    check_host_buffer(spec, host_buffer, f)
    g = _as_ids(gpu_block_ids, "gpu_block_ids")
    h = _as_ids(host_block_ids, "host_block_ids")
    sizes, skips = _group_layout(spec, g.size, skip, group_sizes, f)
    need = [-(-(s + k) // f) if k else 0 for s, k in zip(skips, sizes)]
    if h.size != sum(need):
        if len(sizes) == 1:
            expect = f"ceil((skip + n) / f) = ceil(({skips[0]} + {g.size}) / {f}) = {need[0]}"
        else:
            expect = f"per group ceil((skip + n) / f) = {need}, {sum(need)} in all"
        raise ValueError(f"len(host_block_ids) = {h.size}, expected {expect}")
    _check_range(g, "gpu_block_ids", spec.num_blocks)
    _check_range(h, "host_block_ids", host_buffer.shape[0])
    # Sources may repeat; destinations may not (two writers of one block would race).
    _check_unique(h if gather else g, "host_block_ids" if gather else "gpu_block_ids")
    if spec.num_groups == 1:
        return TransferPlan(np.concatenate([g, h]), g.size, h.size, skips[0], False, g.size * spec.bytes_per_block)
    num_bytes = sum(k * b for k, b in zip(sizes, spec.group_bytes))
    block_group = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    first_block = np.cumsum(sizes) - sizes
    first_host = np.cumsum(need) - need
    groups = np.stack([first_block, skips, first_host], axis=1).reshape(-1)
    return TransferPlan(np.concatenate([g, h, block_group, groups]), g.size, h.size, 0, True, num_bytes)


def _transfer(spec, host_buffer, gpu_block_ids, host_block_ids, f, skip, group_sizes, num_ctas, gather):
    if num_ctas is not None:
        _check_int(num_ctas, "num_ctas", 1)
    plan = check_transfer(
        spec,
        host_buffer,
        gpu_block_ids,
        host_block_ids,
        blocks_per_host_block=f,
        skip=skip,
        gather=gather,
        group_sizes=group_sizes,
    )
    if plan.n_blocks == 0:
        return
    ids = torch.from_numpy(plan.ids)
    if spec.device.type == "cuda":
        # Staged in pinned memory so the upload is truly asynchronous: a copy from pageable memory may synchronise
        # with the stream. The caching host allocator keeps the pinned block until the copy has completed.
        ids = ids.pin_memory().to(spec.device, non_blocking=True)
    launch_copy_blocks(
        spec,
        host_buffer,
        ids,
        plan.n_blocks,
        plan.n_host,
        skip=plan.skip,
        blocks_per_host_block=f,
        gather=gather,
        grouped=plan.grouped,
        num_ctas=num_ctas,
    )


def gather_blocks(
    kv_caches: Sequence[torch.Tensor] | KVCacheSpec,
    layout: str | Layout | None,
    gpu_block_ids: BlockIds,
    host_buffer: torch.Tensor,
    host_block_ids: BlockIds,
    *,
    blocks_per_host_block: int = 1,
    skip: int | Sequence[int] = 0,
    num_ctas: int | None = None,
    group_sizes: Sequence[int] | None = None,
) -> None:
    """Copies GPU blocks of every layer into packed host blocks, in one kernel launch (a store).

    GPU block ``gpu_block_ids[i]`` lands at position ``p = skip + i``: host block ``host_block_ids[p // f]``,
    sub-block ``p % f``, where ``f = blocks_per_host_block``. The launch is asynchronous on CUDA (current stream).

    Args:
        kv_caches: per layer, a tensor of ``layout``'s shape, e.g. block_first
            ``(num_blocks, 2, block_size, num_kv_heads, head_dim)``; or a :class:`KVCacheSpec` built once.
        layout: ``"kv_first"``, ``"block_first"``, ``"mla"``, ``"canonical"`` or a :class:`Layout`; may be None
            with a prepared spec.
        gpu_block_ids: n source block ids (may repeat).
        host_buffer: (num_host_blocks, host_block_bytes) uint8/int8, pinned when the caches are on CUDA.
        host_block_ids: ``ceil((skip + n) / f)`` distinct destination host block ids.
        blocks_per_host_block: f, GPU blocks per host block.
        skip: sub-blocks of the first host block left untouched (``0 <= skip < f``).
        num_ctas: programs (SMs) the launch may occupy; None for the tuned default.
        group_sizes: with KV-cache groups (``KVCacheSpec(..., groups=...)``), GPU ids per group; the ids are then
            concatenated group by group and ``skip`` may be one per group (see :func:`check_transfer`).
    """
    spec = prepare_kv(kv_caches, layout)
    _transfer(
        spec, host_buffer, gpu_block_ids, host_block_ids, blocks_per_host_block, skip, group_sizes, num_ctas, True
    )


def scatter_blocks(
    host_buffer: torch.Tensor,
    host_block_ids: BlockIds,
    kv_caches: Sequence[torch.Tensor] | KVCacheSpec,
    layout: str | Layout | None,
    gpu_block_ids: BlockIds,
    *,
    blocks_per_host_block: int = 1,
    skip: int | Sequence[int] = 0,
    num_ctas: int | None = None,
    group_sizes: Sequence[int] | None = None,
) -> None:
    """Copies packed host blocks back into GPU blocks of every layer, in one kernel launch (a load).

    The inverse of :func:`gather_blocks`, with the same position rule: GPU block ``gpu_block_ids[i]`` reads
    position ``skip + i``. GPU ids are destinations and must be distinct; host ids may repeat.
    """
    spec = prepare_kv(kv_caches, layout)
    _transfer(
        spec, host_buffer, gpu_block_ids, host_block_ids, blocks_per_host_block, skip, group_sizes, num_ctas, False
    )


def host_block_bytes(
    kv_caches: Sequence[torch.Tensor] | KVCacheSpec, layout: str | Layout | None, blocks_per_host_block: int = 1
) -> int:
    """Bytes of one packed host block: ``blocks_per_host_block`` GPU blocks of all layers."""
    return prepare_kv(kv_caches, layout).host_block_bytes(_check_int(blocks_per_host_block, "blocks_per_host_block", 1))
