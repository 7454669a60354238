"""Plain-PyTorch reference of the gather/scatter contract, written for clarity, not speed: it indexes the layer
tensors the way a reader thinks of them (``t[0][g]`` is the K of block ``g`` in kv_first) and never touches addresses,
so it checks the kernels' address arithmetic independently (the tests, the benchmark's CPU check and the direct
launch's canary use it). It assumes valid input: validation is the public API's job.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from triton_offload.layouts import HostSlots, Layout, resolve_layout


def _parts(t: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """One layer's parts in packed order (K then V, or the single latent/page), each with the block dim first."""
    if layout is Layout.KV_FIRST:
        parts = [t[0], t[1]]
    elif layout is Layout.BLOCK_FIRST:
        parts = [t[:, 0], t[:, 1]]
    else:
        parts = [t]
    # A block's bytes are stored in memory order; permute its dims (outermost stride first) so indexing and
    # reshaping see them in that order. For ordinary contiguous caches this is the identity.
    return [p.permute(0, *sorted(range(1, p.dim()), key=lambda d: (-p.stride(d), d))) for p in parts]


def _ids(ids) -> torch.Tensor:
    return torch.as_tensor(np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids), dtype=torch.int64)


def _slots(n: int, host_block_ids, blocks_per_host_block: int, skip: int, device):
    """Host block and sub-block of each GPU block: position skip + i (docs/design.md, "Block-size factor and skip")."""
    pos = skip + torch.arange(n)
    return _ids(host_block_ids)[pos // blocks_per_host_block].to(device), (pos % blocks_per_host_block).to(device)


def _host_view(host_buffer: torch.Tensor, blocks_per_host_block: int) -> torch.Tensor:
    """(num_host_blocks, f, bytes_per_gpu_block) byte view of the host buffer."""
    return host_buffer.view(torch.uint8).unflatten(1, (blocks_per_host_block, -1))


def _slot_view(host_buffer: torch.Tensor, f: int, slots: HostSlots, region: int) -> torch.Tensor:
    """(num_host_blocks, f, pages[region]) byte view of one region of vLLM's worker slots: the region follows f pages
    of every earlier region in the row."""
    start = f * sum(slots.pages[:region])
    page = slots.pages[region]
    return host_buffer.view(torch.uint8)[:, start : start + f * page].unflatten(1, (f, page))


def _block_bytes(kv_caches, layers, layout: Layout) -> int:
    """Bytes one GPU block of ``layers`` holds (every part of every layer)."""
    return sum(p[0].numel() * p.element_size() for i in layers for p in _parts(kv_caches[i], layout))


def _group_region_view(host_buffer, f: int, kv_caches, groups, gi: int, layout: Layout, regions) -> torch.Tensor:
    """(num_host_blocks, f, region bytes) byte view of group ``gi``'s region in rows with host regions: a region's
    sub-block is the largest of its groups' blocks, and it follows f sub-blocks of every earlier region."""
    sizes = [_block_bytes(kv_caches, layers, layout) for layers in groups]
    count = max(regions) + 1
    region_bytes = [max(b for b, r in zip(sizes, regions) if r == k) for k in range(count)]
    r = regions[gi]
    start = f * sum(region_bytes[:r])
    return host_buffer.view(torch.uint8)[:, start : start + f * region_bytes[r]].unflatten(1, (f, region_bytes[r]))


def _destinations(layers, host_buffer, f, slots: HostSlots | None, region: torch.Tensor | None = None):
    """Per group: where each layer's bytes of a block go, as (layer indices, host view) pairs; each host view is
    (num_host_blocks, f, bytes) and the layers' bytes are laid side by side at its start. Packed: all the group's
    layers share the packed sub-block (``region``: the group's region of the row). Worker slots: each layer
    starts its own region's sub-block."""
    if region is not None:
        return [(list(layers), region)]
    if slots is None:
        return [(list(layers), _host_view(host_buffer, f))]
    return [([i], _slot_view(host_buffer, f, slots, slots.regions[i])) for i in layers]


def _per_group(kv_caches, gpu_block_ids, host_block_ids, f, skip, groups, group_sizes, device):
    """Splits a (possibly grouped) transfer into one ungrouped transfer per group that moves blocks:
    (group index, its layer indices, GPU ids, host block and sub-block of each GPU block)."""
    g_all, h_all = _ids(gpu_block_ids), _ids(host_block_ids)
    if groups is None:
        groups, group_sizes, skip = [range(len(kv_caches))], [g_all.numel()], [skip]
    skips = [skip] * len(groups) if isinstance(skip, int) else list(skip)
    g0 = h0 = 0
    for gi, (layers, n, s) in enumerate(zip(groups, group_sizes, skips)):
        m = -(-(s + n) // f) if n else 0
        if n:
            rows, subs = _slots(n, h_all[h0 : h0 + m], f, int(s), device)
            yield gi, list(layers), g_all[g0 : g0 + n], rows, subs
        g0, h0 = g0 + n, h0 + m


def _region(host_buffer, f, kv_caches, groups, gi, layout, group_regions):
    """Group ``gi``'s region of the rows with host regions (``group_regions``, one region number per group), else
    None (the plain packed format)."""
    if group_regions is None or groups is None or set(group_regions) == {0}:
        return None
    return _group_region_view(host_buffer, f, kv_caches, groups, gi, layout, list(group_regions))


def gather_blocks_ref(
    kv_caches: Sequence[torch.Tensor],
    layout: str | Layout,
    gpu_block_ids: Sequence[int],
    host_buffer: torch.Tensor,
    host_block_ids: Sequence[int],
    *,
    blocks_per_host_block: int = 1,
    skip: int | Sequence[int] = 0,
    groups: Sequence[Sequence[int]] | None = None,
    group_sizes: Sequence[int] | None = None,
    host_slots: HostSlots | None = None,
    group_regions: Sequence[int] | None = None,
) -> None:
    """Reference of :func:`triton_offload.gather_blocks` (``groups``, ``host_slots`` and ``group_regions`` as in
    :class:`KVCacheSpec`)."""
    layout = resolve_layout(layout)
    f = blocks_per_host_block
    parts = _per_group(kv_caches, gpu_block_ids, host_block_ids, f, skip, groups, group_sizes, host_buffer.device)
    for gi, layers, g, rows, subs in parts:
        n = g.numel()
        region = _region(host_buffer, f, kv_caches, groups, gi, layout, group_regions)
        for dest_layers, host_view in _destinations(layers, host_buffer, f, host_slots, region):
            # (n, bytes): each block's parts side by side, in layer order.
            blocks = torch.cat(
                [
                    p[g.to(p.device)].reshape(n, -1).view(torch.uint8)
                    for i in dest_layers
                    for p in _parts(kv_caches[i], layout)
                ],
                dim=1,
            )
            host_view[rows, subs, : blocks.shape[1]] = blocks.to(host_buffer.device)


def scatter_blocks_ref(
    host_buffer: torch.Tensor,
    host_block_ids: Sequence[int],
    kv_caches: Sequence[torch.Tensor],
    layout: str | Layout,
    gpu_block_ids: Sequence[int],
    *,
    blocks_per_host_block: int = 1,
    skip: int | Sequence[int] = 0,
    groups: Sequence[Sequence[int]] | None = None,
    group_sizes: Sequence[int] | None = None,
    host_slots: HostSlots | None = None,
    group_regions: Sequence[int] | None = None,
) -> None:
    """Reference of :func:`triton_offload.scatter_blocks` (``groups``, ``host_slots`` and ``group_regions`` as in
    :class:`KVCacheSpec`)."""
    layout = resolve_layout(layout)
    f = blocks_per_host_block
    parts = _per_group(kv_caches, gpu_block_ids, host_block_ids, f, skip, groups, group_sizes, host_buffer.device)
    for gi, layers, g, rows, subs in parts:
        n = g.numel()
        region = _region(host_buffer, f, kv_caches, groups, gi, layout, group_regions)
        for dest_layers, host_view in _destinations(layers, host_buffer, f, host_slots, region):
            blocks = host_view[rows, subs]  # (n, bytes), a copy
            offset = 0
            for i in dest_layers:
                for p in _parts(kv_caches[i], layout):
                    nbytes = p[0].numel() * p.element_size()
                    chunk = blocks[:, offset : offset + nbytes].contiguous().to(p.device)
                    p[g.to(p.device)] = chunk.view(p.dtype).view(n, *p.shape[1:])
                    offset += nbytes
