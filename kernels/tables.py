"""What the copy kernel reads that is fixed per spec: the access width its buffers allow, the segment table (per
KV-cache group and segment, where the bytes are on the GPU and in a packed host row) and the integrity checks' table
(where each segment starts in its block's word stream). Built synchronously, once per spec, by
:class:`~triton_offload.issuers.launcher.CopyLauncher`.
"""

from __future__ import annotations

import torch

from triton_offload.layouts import KVCacheSpec

__all__ = ["access_width", "table_key", "build_segment_table", "build_integrity_table"]


def access_width(spec: KVCacheSpec, host_buffer: torch.Tensor) -> int:
    """Widest access (bytes, a power of two <= 16) that every address, stride and size in a transfer allows."""
    align = spec.alignment
    for v in (host_buffer.data_ptr(), host_buffer.stride(0) * host_buffer.element_size()):
        while v % align:
            align //= 2
    return align


def table_key(spec: KVCacheSpec, blocks_per_host_block: int) -> int:
    """The f a segment table depends on: only worker slots and host regions (``group_regions``) place a region after
    f sub-blocks of the earlier ones, so the plain packed format's table is the same for every f (key 1)."""
    return blocks_per_host_block if spec.host_slots is not None or spec.group_regions is not None else 1


def build_segment_table(spec: KVCacheSpec, elem: int, blocks_per_host_block: int = 1) -> torch.Tensor:
    """The kernel's int64 table on the spec's device, (num_groups * segments_per_group, 5): GPU offset from the
    table's own address, block stride, bytes, host stride between sub-blocks, host offset of sub-block 0 in a host
    row -- all in units of ``elem`` bytes. Groups with fewer segments are padded with zero-length rows, which the
    kernel masks out entirely.

    Built synchronously: once this returns, a launch on any stream may read it without further ordering.
    """
    f = blocks_per_host_block
    width = spec.segments_per_group
    rows = []
    for segs in spec.group_segments:
        rows += [[s.base, s.block_stride, s.nbytes, s.host_stride, f * s.host_region + s.host_offset] for s in segs]
        rows += [[spec.segments[0].base, 0, 0, 0, 0]] * (width - len(segs))
    table = torch.empty((len(rows), 5), dtype=torch.int64, device=spec.device)
    # GPU addresses are stored relative to the table itself, which the kernel receives as its anchor pointer: Triton
    # then needs no integer-to-pointer cast, and the interpreter sees plain addresses.
    anchor = table.data_ptr()
    assert anchor % elem == 0, "torch allocations are at least 64-byte aligned"
    values = torch.tensor(rows, dtype=torch.int64)
    values[:, 0] -= anchor
    values //= elem
    table.copy_(values)
    if spec.device.type == "cuda":
        # Finished before any stream reads it (the engine's store and load streams are not ordered against the
        # stream that happened to build it).
        torch.cuda.current_stream(spec.device).synchronize()
    return table


def build_integrity_table(spec: KVCacheSpec, elem: int, stream_bytes=None) -> torch.Tensor:
    """The integrity checks' int64 table on the spec's device, (num_groups * segments_per_group, 3): per segment of a
    group, the word at which its bytes start in the block's word stream (the group's segments in order), the group's
    words per block, and the group's host region (``spec.group_regions``; 0 without: a row of the checksum table
    holds a marker and f checksums per region); words of ``elem`` bytes. ``stream_bytes(segment)``: the bytes of a
    segment the stream holds (None: all it moves; the FP8 format's: what it stores,
    :func:`~.fp8_blocks.fp8_stream_bytes`). Padding rows repeat their group's words and region. Built synchronously,
    like :func:`build_segment_table`."""
    width = spec.segments_per_group
    regions = spec.group_regions or (0,) * spec.num_groups
    rows = []
    for segs, nbytes, region in zip(spec.group_segments, spec.group_bytes, regions):
        sizes = [s.nbytes if stream_bytes is None else stream_bytes(s) for s in segs]
        nbytes = nbytes if stream_bytes is None else sum(sizes)
        start = 0
        for size in sizes:
            rows.append([start // elem, nbytes // elem, region])
            start += size
        rows += [[0, nbytes // elem, region]] * (width - len(segs))
    table = torch.tensor(rows, dtype=torch.int64).to(spec.device)
    if spec.device.type == "cuda":
        torch.cuda.current_stream(spec.device).synchronize()
    return table
