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


def block_streams_ref(
    kv_caches: Sequence[torch.Tensor],
    layout: str | Layout,
    gpu_block_ids: Sequence[int],
    *,
    groups: Sequence[Sequence[int]] | None = None,
    group_sizes: Sequence[int] | None = None,
) -> list[np.ndarray]:
    """Each GPU block's *word stream* of the integrity checks (triton_offload/integrity.py): the bytes a transfer moves
    for it, its group's layers in order, K before V, as a (blocks, bytes) uint8 array per group (ids concatenated
    group by group, as for the transfers). Built by gathering into a packed host buffer of one block per row, so the
    stream is exactly a packed sub-block."""
    g_all = _ids(gpu_block_ids)
    groups = [range(len(kv_caches))] if groups is None else groups
    group_sizes = [g_all.numel()] if group_sizes is None else group_sizes
    out, start = [], 0
    for layers, n in zip(groups, group_sizes):
        ids = g_all[start : start + n]
        start += n
        layers = list(layers)
        nbytes = sum(
            sum(p[0].numel() * p.element_size() for p in _parts(kv_caches[i], resolve_layout(layout))) for i in layers
        )
        host = torch.zeros((max(n, 1), nbytes), dtype=torch.uint8)
        if n:
            gather_blocks_ref([kv_caches[i] for i in layers], layout, ids, host, list(range(n)))
        out.append(host[:n].numpy())
    return out


def checksums_ref(
    kv_caches: Sequence[torch.Tensor],
    layout: str | Layout,
    gpu_block_ids: Sequence[int],
    host_block_ids: Sequence[int],
    *,
    word_bytes: int,
    group_words: int = 1,
    blocks_per_host_block: int = 1,
    skip: int | Sequence[int] = 0,
    groups: Sequence[Sequence[int]] | None = None,
    group_sizes: Sequence[int] | None = None,
    identities: Sequence[int] | None = None,
    group_regions: Sequence[int] | None = None,
    streams: Sequence[np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reference of what a store with the integrity checks writes: for each GPU block (ids concatenated group by
    group), (its host block id, the column of its checksum in the checksum table, its checksum), the checksum of its
    word stream with the identity of its host block (``identities``, one per host id; default: the host id) and its
    sub-block index. A table row holds, per host region (``group_regions``, as in :class:`KVCacheSpec`; one region
    without), a marker then f checksums: the column is ``region x (1 + f) + 1 + sub-block``, and the marker's
    ``column - column % (1 + f)``. ``streams``: each group's word streams, (blocks, bytes) uint8, in the place of
    :func:`block_streams_ref`'s (the FP8 format's stored bytes, :func:`.reference_fp8.fp8_streams_ref`)."""
    from triton_offload.integrity import block_checksums

    f = blocks_per_host_block
    h_all = _ids(host_block_ids).numpy()
    ident_all = h_all if identities is None else np.asarray(identities, dtype=np.int64)
    g_all = _ids(gpu_block_ids)
    groups = [range(len(kv_caches))] if groups is None else groups
    group_sizes = [g_all.numel()] if group_sizes is None else group_sizes
    regions = [0] * len(groups) if group_regions is None else list(group_regions)
    skips = [skip] * len(groups) if isinstance(skip, int) else list(skip)
    if streams is None:
        streams = block_streams_ref(kv_caches, layout, g_all, groups=groups, group_sizes=group_sizes)
    rows, cols, sums = [], [], []
    h0 = 0
    for stream, n, s, region in zip(streams, group_sizes, skips, regions):
        m = -(-(s + n) // f) if n else 0
        pos = s + np.arange(n)
        idx = h0 + pos // f
        rows.append(h_all[idx])
        cols.append(region * (1 + f) + 1 + pos % f)
        sums.append(
            block_checksums(stream, word_bytes, ident_all[idx], pos % f, group_words) if n else np.zeros(0, np.int64)
        )
        h0 += m
    return np.concatenate(rows), np.concatenate(cols), np.concatenate(sums)
