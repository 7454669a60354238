"""One Triton kernel that gathers GPU KV blocks of all layers into packed host blocks, or scatters them back.

Work is a flat list of *items*, one per (GPU block, segment) pair, ordered block-major so that consecutive items are
consecutive host bytes. A persistent grid of ``num_ctas`` programs walks tiles of ``ROWS`` items; each tile moves
``ROWS x CHUNK`` elements per step, so small pages are batched many to a tile and large pages are streamed in chunks.
Addresses are element offsets from two base pointers: the host buffer, and the segment table itself (the *anchor*),
from which every KV tensor's address is stored as a difference. All address arithmetic is int64. With KV-cache
groups (``MULTI_GROUP``), each block reads its group, and the group's skip and first host id, from the id buffer,
and its segments from the group's rows of the table; one launch still moves every group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from triton_offload.kernels._triton_compat import patch_interpreter_scalar_index
from triton_offload.layouts import KVCacheSpec

# Tuned constants. NOT YET MEASURED ON A GPU: chosen from the published H100 figures in DESIGN.md (PCIe reads need
# roughly bandwidth x latency ~ 55 GB/s x 2 us ~ 110 KB in flight; 8 programs x 16-32 KiB tiles give 128-256 KB).
# The benchmark (bench/bench_transfer.py) sweeps num_ctas; update these with the device and date it was measured on.
DEFAULT_NUM_CTAS = 8
# Bytes one program moves per step. Loads (host -> GPU) read over PCIe, whose latency wants more bytes in flight.
TILE_BYTES = {True: 16 * 1024, False: 32 * 1024}  # keyed by GATHER
NUM_WARPS = {True: 4, False: 8}
# Widest access: 16 bytes per thread (one 128-bit load/store) when every address and size allows it.
MAX_ACCESS_BYTES = 16
_ELEM_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def _copy_blocks_kernel(
    anchor_ptr,  # ELEM*: the segment table's own storage; GPU addresses are element offsets from it
    host_ptr,  # ELEM*: packed host buffer
    table_ptr,  # int64* (groups * n_segs, 4): gpu offset, block stride, length, offset in a sub-block (elements)
    ids_ptr,  # int64*: GPU ids [n_blocks], host ids [n_host]; if MULTI_GROUP also group of each block [n_blocks]
    # and per group (first block, skip, first host id)
    n_blocks,
    n_host,
    n_segs,  # segments per group
    tiles_per_program,  # ceil(tiles / programs): the last round is partly masked
    skip,  # single group only; MULTI_GROUP reads each group's skip from ids_ptr
    blocks_per_host_block,
    host_row_stride,  # elements between host blocks
    block_elems,  # elements of one packed sub-block (host stride between a host block's GPU blocks)
    n_chunks,  # CHUNK-sized steps of the longest segment; shorter ones are masked
    GATHER: tl.constexpr,  # True: GPU -> host (store); False: host -> GPU (load)
    MULTI_GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    VEC: tl.constexpr,  # every offset and length is a multiple of VEC elements: enables 16-byte accesses
):
    # int64 from the start: the loop variable inherits it, so item indices never wrap.
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0)
    rows = tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, CHUNK)
    n_items = n_blocks.to(tl.int64) * n_segs
    # A fixed trip count rather than range(pid, n_tiles, nprog): older Triton interpreters cannot take a program id
    # as a Python range bound, and a round past the last tile is simply all masked.
    for i in range(0, tiles_per_program):
        tile = pid + i * nprog
        item = tile * ROWS + rows
        live = item < n_items
        blk = item // n_segs
        seg = item - blk * n_segs
        gpu_id = tl.load(ids_ptr + blk, mask=live, other=0)
        if MULTI_GROUP:
            group = tl.load(ids_ptr + n_blocks + n_host + blk, mask=live, other=0)
            group_row = ids_ptr + 2 * n_blocks + n_host + group * 3
            first_block = tl.load(group_row, mask=live, other=0)
            pos = blk - first_block + tl.load(group_row + 1, mask=live, other=0)
            host_idx = tl.load(group_row + 2, mask=live, other=0) + pos // blocks_per_host_block
            seg_row = table_ptr + (group * n_segs + seg) * 4
        else:
            pos = blk + skip
            host_idx = pos // blocks_per_host_block
            seg_row = table_ptr + seg * 4
        host_id = tl.load(ids_ptr + n_blocks + host_idx, mask=live, other=0)
        seg_base = tl.load(seg_row, mask=live, other=0)
        seg_stride = tl.load(seg_row + 1, mask=live, other=0)
        seg_len = tl.load(seg_row + 2, mask=live, other=0)  # dead rows and padding get length 0: fully masked
        seg_host = tl.load(seg_row + 3, mask=live, other=0)
        gpu_off = tl.multiple_of(seg_base + gpu_id * seg_stride, VEC)
        host_off = tl.multiple_of(
            host_id * host_row_stride + (pos % blocks_per_host_block) * block_elems + seg_host, VEC
        )
        seg_len = tl.multiple_of(seg_len, VEC)
        for k in range(0, n_chunks):
            col = k * CHUNK + cols
            mask = col[None, :] < seg_len[:, None]
            if GATHER:
                vals = tl.load(anchor_ptr + gpu_off[:, None] + col[None, :], mask=mask)
                tl.store(host_ptr + host_off[:, None] + col[None, :], vals, mask=mask)
            else:
                vals = tl.load(host_ptr + host_off[:, None] + col[None, :], mask=mask)
                tl.store(anchor_ptr + gpu_off[:, None] + col[None, :], vals, mask=mask)


_NOT_SPECIALIZED = [
    "n_blocks",
    "n_host",
    "n_segs",
    "tiles_per_program",
    "skip",
    "blocks_per_host_block",
    "host_row_stride",
    "block_elems",
    "n_chunks",
]
_jit_kernel = triton.jit(_copy_blocks_kernel, do_not_specialize=_NOT_SPECIALIZED)
# CPU tensors run the same kernel through Triton's interpreter, whatever TRITON_INTERPRET says: that is how the
# kernels are tested without a GPU and how the vLLM CPU platform moves its KV cache. Without TRITON_INTERPRET=1 at
# import time, Triton's @jit standard-library helpers (tl.max, tl.cdiv, ...) are not interpretable, so the kernel
# uses builtins only and gets the loop bound of its segments as an argument.
_interpreted_kernel = InterpretedFunction(_copy_blocks_kernel)
patch_interpreter_scalar_index()


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def access_width(spec: KVCacheSpec, host_buffer: torch.Tensor) -> int:
    """Widest access (bytes, a power of two <= 16) that every address, stride and size in a transfer allows."""
    align = spec.alignment
    for v in (host_buffer.data_ptr(), host_buffer.stride(0) * host_buffer.element_size()):
        while v % align:
            align //= 2
    return align


@dataclass(frozen=True)
class LaunchConfig:
    """Compile-time shape of one launch: element type, vector width, tile geometry, warps.

    Attributes:
        elem: bytes per element the kernel moves (1, 2 or 4).
        vec: elements per widest access (``elem * vec`` bytes, at most 16).
        rows: items (block segments) per tile.
        chunk: elements per item per step.
        n_chunks: steps to cover the longest segment.
        num_warps: warps per program.
    """

    elem: int
    vec: int
    rows: int
    chunk: int
    n_chunks: int
    num_warps: int

    @property
    def dtype(self) -> torch.dtype:
        return _ELEM_DTYPES[self.elem]


# A tile batches at most this many segments (rows): each row costs its own id and table loads.
MAX_ROWS = 32


def _chunk_elems(max_seg: int, tile: int) -> int:
    """Elements one row moves per step: the power of two that pads the longest segment least, the largest such on a
    tie, between the tile (or the segment rounded up, if smaller) and tile / MAX_ROWS (segments smaller than that
    take one chunk each). A segment then splits into whole chunks wherever a power of two allows it: the 72 KiB MLA
    page is 9 chunks of 8 KiB, not 3 of 32 KiB with the last a quarter full."""
    top = min(_next_pow2(max_seg), tile)
    floor = min(top, max(1, tile // MAX_ROWS))
    candidates = [top >> i for i in range(top.bit_length()) if top >> i >= floor]
    return min(candidates, key=lambda c: (triton.cdiv(max_seg, c) * c, -c))


def launch_config(spec: KVCacheSpec, width: int, gather: bool) -> LaunchConfig:
    """The launch shape for a spec and access width, cached on the spec (the hot path does no per-layer work)."""
    key = (width, gather)
    config = spec.launch_configs.get(key)
    if config is None:
        elem = min(width, 4)
        max_seg = spec.max_segment_bytes // elem
        tile = TILE_BYTES[gather] // elem
        # Small pages share a tile (many rows), large ones stream through it (few rows, several chunks).
        chunk = _chunk_elems(max_seg, tile)
        config = LaunchConfig(elem, width // elem, tile // chunk, chunk, triton.cdiv(max_seg, chunk), NUM_WARPS[gather])
        spec.launch_configs[key] = config
    return config


def launch_copy_blocks(
    spec: KVCacheSpec,
    host_buffer: torch.Tensor,
    ids: torch.Tensor,
    n_blocks: int,
    n_host: int,
    *,
    skip: int,
    blocks_per_host_block: int,
    gather: bool,
    grouped: bool,
    num_ctas: int | None,
) -> None:
    """Launches one copy of ``n_blocks`` GPU blocks (all layers, all groups) to or from packed host blocks.

    Inputs are validated by the public API (:mod:`triton_offload.transfer`); only internal invariants are asserted.

    Args:
        spec: the prepared KV caches.
        host_buffer: (num_host_blocks, host_block_bytes) uint8/int8, row stride may exceed the row.
        ids: int64 on ``spec.device``: the n GPU block ids, then the host block ids; when ``grouped``, then each
            GPU block's group and, per group, (index of its first GPU block, skip, index of its first host id).
        n_blocks: number of GPU blocks.
        n_host: number of host block ids.
        skip: position of the first GPU block inside the first host block (ungrouped).
        blocks_per_host_block: GPU blocks per host block.
        gather: True for GPU -> host, False for host -> GPU.
        grouped: the ids carry per-block groups (a spec with several KV-cache groups).
        num_ctas: programs to launch at most (the SMs it occupies); None for :data:`DEFAULT_NUM_CTAS`.
    """
    assert ids.dtype == torch.int64 and ids.device == spec.device
    assert grouped or spec.num_groups == 1
    cfg = launch_config(spec, access_width(spec, host_buffer), gather)
    table = spec.segment_table(cfg.elem)
    n_segs = spec.segments_per_group
    n_tiles = triton.cdiv(n_blocks * n_segs, cfg.rows)
    programs = max(1, min(num_ctas or DEFAULT_NUM_CTAS, n_tiles))
    if spec.device.type == "cpu":
        kernel = _interpreted_kernel
    else:
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            raise RuntimeError("TRITON_INTERPRET=1 is set, which cannot run kernels on CUDA tensors: unset it")
        kernel = _jit_kernel
    kernel[(programs,)](
        table.view(cfg.dtype),
        host_buffer.view(cfg.dtype),
        table,
        ids,
        n_blocks,
        n_host,
        n_segs,
        triton.cdiv(n_tiles, programs),
        skip,
        blocks_per_host_block,
        host_buffer.stride(0) * host_buffer.element_size() // cfg.elem,
        spec.bytes_per_block // cfg.elem,
        cfg.n_chunks,
        GATHER=gather,
        MULTI_GROUP=grouped,
        ROWS=cfg.rows,
        CHUNK=cfg.chunk,
        VEC=cfg.vec,
        num_warps=cfg.num_warps,
    )
