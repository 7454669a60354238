"""The copy kernel and its thin launch: one Triton kernel gathers GPU KV blocks of all layers into packed host blocks
(a store) or scatters them back (a load), with what it reads built here: the segment table, the id buffer packed from
a :class:`~triton_offload.plan.TransferPlan`, and the launch shape of a :class:`LaunchTuning`. docs/design.md
(section 5) explains the decomposition, the addressing and the performance model behind the constants;
:mod:`triton_offload.kernel_issuer` derives all of it once per spec and issues plans.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch
import triton
import triton.language as tl

from triton_offload.kernels._triton_compat import compile_variant as _compile_variant
from triton_offload.layouts import KVCacheSpec
from triton_offload.plan import Direction, TransferPlan

__all__ = [
    "DEFAULT_NUM_CTAS",
    "SIZE_AWARE_PROGRAMS",
    "size_aware_ctas",
    "LaunchTuning",
    "DEFAULT_TUNINGS",
    "LaunchConfig",
    "launch_config",
    "access_width",
    "build_segment_table",
    "packed_size",
    "pack_ids",
    "arguments",
    "launch",
    "compile_variant",
]

# Tuned constants, measured on an NVIDIA H100 80GB HBM3 (PCIe Gen5 x16, driver 580.159.04, Triton 3.6), 2026-11-22,
# by bench/tune.py over six cases (1 KiB to 72 KiB segments, 128 and 1024 blocks, f=1) against the same run's
# contiguous pinned peak (~55 GB/s): bench/results/nvidia-h100-80gb-hbm3-2026-11-22-tune*.json.
# - 64 KiB tiles with 16 warps (128 bytes, eight 16-byte accesses, per thread per step) reach ~50-51 GB/s in both
#   directions, 91-104 % of each case's peak in two runs, with only 4 programs; 16-32 KiB tiles need 8 programs for
#   that, and with 64 KiB tiles 8 programs made loads worse, not better (too many host reads in flight).
# - 2 programs reach only ~35 GB/s (stores) and ~30 GB/s (loads): SM-driven host reads plateau per SM.
DEFAULT_NUM_CTAS = 4

# How a launch's program count is chosen (``launch_shape`` of TransferEngine, gather_blocks and scatter_blocks;
# triton_offload._checks.LAUNCH_SHAPES):
# - "fixed": ``num_ctas``, or DEFAULT_NUM_CTAS where it is None; what every release so far did, and the default.
# - "size-aware": by the spec's mean segment (page run) bytes, from SIZE_AWARE_PROGRAMS, never above ``num_ctas``.
#   In the 2026-11-22 sweep (bench/results/nvidia-h100-80gb-hbm3-2026-11-22-full-*.json) only small pages lost
#   bandwidth at 4 programs: 128 blocks of 2 KiB pages (block_first, f=1/skip=1) loaded at 0.75 of the peak with 4
#   programs, 0.81 with 8 and 0.85 with 16, and 32 programs lost again in several cases (0.52-0.60); pages of 8 KiB
#   and more were within noise of their best at 4. Each row costs its own id and table loads and a short access, so
#   small rows need more programs in flight for the same bytes. Tiles stay the tuned 64 KiB (one compiled variant
#   whatever the shape). Whether it pays is the GPU run's launch-shape stage to show (issue 38, section 3): it becomes
#   the default only if it gains >= 5 points there without raising the serving benchmark's step slowdown.
# (segment bytes below which, programs), first match; larger segments keep DEFAULT_NUM_CTAS.
SIZE_AWARE_PROGRAMS = ((4 * 1024, 16), (8 * 1024, 8))


def size_aware_ctas(segment_bytes: float, num_ctas: int | None = None) -> int:
    """Programs the "size-aware" shape launches for segments of ``segment_bytes`` (a spec's mean), at most
    ``num_ctas`` where one is given. A launch never exceeds its tiles either (:func:`arguments`)."""
    programs = next((p for limit, p in SIZE_AWARE_PROGRAMS if segment_bytes < limit), DEFAULT_NUM_CTAS)
    return programs if num_ctas is None else min(programs, num_ctas)


@dataclass(frozen=True)
class LaunchTuning:
    """What tuning sets per direction: the bytes one program moves per step (the bytes it has in flight) and its
    warps."""

    tile_bytes: int
    num_warps: int


# Per direction (the same for both, measured above); read-only: a different tuning is passed as a value.
DEFAULT_TUNINGS = MappingProxyType(
    {Direction.STORE: LaunchTuning(64 * 1024, 16), Direction.LOAD: LaunchTuning(64 * 1024, 16)}
)
# A tile batches at most this many segments (rows) of tile / MAX_ROWS bytes or more (each row costs its own id and
# table loads); shorter segments take one chunk each, so a 64 KiB tile holds 64 rows of 1 KiB.
MAX_ROWS = 32
_ELEM_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def _copy_blocks_kernel(
    anchor_ptr,  # ELEM*: the segment table's own storage; GPU addresses are element offsets from it
    host_ptr,  # ELEM*: packed host buffer
    table_ptr,  # int64* (groups * n_segs, 5): gpu offset, block stride, length, host stride between sub-blocks,
    # host offset of sub-block 0 in a host row (elements)
    ids_ptr,  # int64*: GPU ids [n_blocks], host ids [n_host]; if MULTI_GROUP also group of each block [n_blocks]
    # and per group (first block, skip, first host id)
    # The scalars are typed int64 and never specialised (see _NOT_SPECIALIZED): one compiled variant serves every
    # value, which the direct launch (triton_offload/fast_launch.py) relies on.
    n_blocks: tl.int64,
    n_host: tl.int64,
    n_segs: tl.int64,  # segments per group
    tiles_per_program: tl.int64,  # ceil(tiles / programs): the last round is partly masked
    skip: tl.int64,  # single group only; MULTI_GROUP reads each group's skip from ids_ptr
    blocks_per_host_block: tl.int64,
    host_row_stride: tl.int64,  # elements between host blocks
    n_chunks: tl.int64,  # CHUNK-sized steps of the longest segment; shorter ones are masked
    STORE: tl.constexpr,  # True: GPU -> host (a store, gather_blocks); False: host -> GPU (a load, scatter_blocks)
    MULTI_GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    VEC: tl.constexpr,  # every offset and length is a multiple of VEC elements: enables 16-byte accesses
):
    """Moves every (GPU block, segment) item of one transfer; a program walks tiles ``pid, pid + nprog, ...``.

    Position rule (docs/design.md, "The packed host format"): GPU block ``i`` of a group lands at position
    ``p = skip + i``, i.e. host block ``host_ids[first_host + p // blocks_per_host_block]``, sub-block
    ``p % blocks_per_host_block``; segment ``s`` of sub-block ``j`` starts at ``j * host stride + host offset``
    from its table row (the packed format: the stride is the packed sub-block).
    """
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
        item = tile * ROWS + rows  # [ROWS]
        live = item < n_items  # [ROWS]
        blk = item // n_segs
        seg = item - blk * n_segs
        gpu_id = tl.load(ids_ptr + blk, mask=live, other=0)
        if MULTI_GROUP:
            group = tl.load(ids_ptr + n_blocks + n_host + blk, mask=live, other=0)
            group_row = ids_ptr + 2 * n_blocks + n_host + group * 3
            first_block = tl.load(group_row, mask=live, other=0)
            pos = blk - first_block + tl.load(group_row + 1, mask=live, other=0)
            host_idx = tl.load(group_row + 2, mask=live, other=0) + pos // blocks_per_host_block
            seg_row = table_ptr + (group * n_segs + seg) * 5
        else:
            pos = blk + skip
            host_idx = pos // blocks_per_host_block
            seg_row = table_ptr + seg * 5
        host_id = tl.load(ids_ptr + n_blocks + host_idx, mask=live, other=0)
        seg_base = tl.load(seg_row, mask=live, other=0)
        seg_stride = tl.load(seg_row + 1, mask=live, other=0)
        seg_len = tl.load(seg_row + 2, mask=live, other=0)  # dead rows and padding get length 0: fully masked
        seg_host_stride = tl.load(seg_row + 3, mask=live, other=0)
        seg_host = tl.load(seg_row + 4, mask=live, other=0)
        gpu_off = tl.multiple_of(seg_base + gpu_id * seg_stride, VEC)  # [ROWS], elements from the anchor
        host_off = tl.multiple_of(  # [ROWS], elements from the host buffer's start
            host_id * host_row_stride + (pos % blocks_per_host_block) * seg_host_stride + seg_host, VEC
        )
        seg_len = tl.multiple_of(seg_len, VEC)
        for k in range(0, n_chunks):
            col = k * CHUNK + cols  # [CHUNK]
            mask = col[None, :] < seg_len[:, None]  # [ROWS, CHUNK]
            if STORE:
                vals = tl.load(anchor_ptr + gpu_off[:, None] + col[None, :], mask=mask)  # [ROWS, CHUNK]
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
    "n_chunks",
]
# Pointers whose alignment the compiled code must not assume: the ids are gathered row by row (no vector access to
# gain), and their buffer changes between calls. The KV anchor and the host buffer keep their alignment
# specialisation (it enables the 16-byte accesses); both are fixed for a launcher.
_ALIGNMENT_NOT_SPECIALIZED = ["table_ptr", "ids_ptr"]
_JIT_OPTIONS = dict(do_not_specialize=_NOT_SPECIALIZED, do_not_specialize_on_alignment=_ALIGNMENT_NOT_SPECIALIZED)
_jit_kernel = triton.jit(_copy_blocks_kernel, **_JIT_OPTIONS)
_interpreted = None


def _interpreted_kernel():
    """The same kernel through Triton's interpreter, for CPU tensors whatever TRITON_INTERPRET says: that is how the
    kernels are tested without a GPU and how the vLLM CPU platform moves its KV cache. Built, and the old
    interpreter's scalar conversion patched, on the first CPU launch rather than at import. Without
    TRITON_INTERPRET=1 at import time, Triton's @jit standard-library helpers (tl.max, tl.cdiv, ...) are not
    interpretable, so the kernel uses builtins only and gets the loop bound of its segments as an argument."""
    global _interpreted
    if _interpreted is None:
        from triton.runtime.interpreter import InterpretedFunction

        from triton_offload.kernels._triton_compat import patch_interpreter_scalar_index

        patch_interpreter_scalar_index()
        _interpreted = InterpretedFunction(_copy_blocks_kernel)
    return _interpreted


# ---------------------------------------------------------------------------------------------------------------
# The id buffer: the kernel's view of a plan
# ---------------------------------------------------------------------------------------------------------------


def packed_size(plan: TransferPlan) -> int:
    """Elements of the kernel's id buffer for ``plan``."""
    n, m = plan.n_blocks, plan.n_host
    return n + m if len(plan.sizes) == 1 else 2 * n + m + 3 * len(plan.sizes)


def pack_ids(plan: TransferPlan, out: np.ndarray | None = None) -> np.ndarray:
    """The kernel's id buffer of ``plan``, in ``out`` (a 1-D int64 array of at least :func:`packed_size` elements,
    e.g. a pinned staging slot) or a new array: the n GPU ids, the m host ids and, with several KV-cache groups, each
    GPU block's group and, per group, (index of its first GPU block, skip, index of its first host id). Returns the
    packed prefix of ``out``."""
    n, m, sizes = plan.n_blocks, plan.n_host, plan.sizes
    size = n + m if len(sizes) == 1 else 2 * n + m + 3 * len(sizes)  # packed_size, inlined: it runs per call
    out = np.empty(size, dtype=np.int64) if out is None else out[:size]
    out[:n] = plan.gpu_ids
    out[n : n + m] = plan.host_ids
    if len(sizes) > 1:
        out[n + m : 2 * n + m] = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
        first_block = np.cumsum(sizes) - sizes
        first_host = np.cumsum(plan.host_counts) - plan.host_counts
        out[2 * n + m :] = np.stack([first_block, plan.skips, first_host], axis=1).reshape(-1)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Launch shapes and the segment table
# ---------------------------------------------------------------------------------------------------------------


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


def _chunk_elems(max_seg: int, tile: int) -> int:
    """Elements one row moves per step: the power of two that pads the longest segment least, the largest such on a
    tie, between the tile (or the segment rounded up, if smaller) and tile / MAX_ROWS (segments smaller than that
    take one chunk each). A segment then splits into whole chunks wherever a power of two allows it: the 72 KiB MLA
    page is 9 chunks of 8 KiB, not 3 of 32 KiB with the last a quarter full."""
    top = min(_next_pow2(max_seg), tile)
    floor = min(top, max(1, tile // MAX_ROWS))
    candidates = [top >> i for i in range(top.bit_length()) if top >> i >= floor]
    return min(candidates, key=lambda c: (triton.cdiv(max_seg, c) * c, -c))


def launch_config(spec: KVCacheSpec, width: int, tuning: LaunchTuning) -> LaunchConfig:
    """The launch shape for a spec, an access width and a direction's tuning (pure)."""
    elem = min(width, 4)
    max_seg = spec.max_segment_bytes // elem
    tile = tuning.tile_bytes // elem
    # Small pages share a tile (many rows), large ones stream through it (few rows, several chunks).
    chunk = _chunk_elems(max_seg, tile)
    return LaunchConfig(elem, width // elem, tile // chunk, chunk, triton.cdiv(max_seg, chunk), tuning.num_warps)


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


# ---------------------------------------------------------------------------------------------------------------
# The launch
# ---------------------------------------------------------------------------------------------------------------


def arguments(
    cfg: LaunchConfig,
    anchor,
    host,
    table,
    ids,
    plan: TransferPlan,
    n_segs: int,
    blocks_per_host_block: int,
    host_row: int,
    store: bool,
    num_ctas: int | None,
) -> tuple[int, tuple]:
    """(programs, every kernel argument in signature order, constexprs included) of one launch moving ``plan``, as
    Triton's dispatch hands them to the compiled kernel's launcher. The pointers are tensors, or device addresses
    for a direct launch; ``host_row`` is the host buffer's row stride in elements."""
    n_tiles = triton.cdiv(plan.n_blocks * n_segs, cfg.rows)
    programs = max(1, min(num_ctas or DEFAULT_NUM_CTAS, n_tiles))
    multi_group = len(plan.sizes) > 1
    args = (
        anchor,
        host,
        table,
        ids,
        plan.n_blocks,
        plan.n_host,
        n_segs,
        triton.cdiv(n_tiles, programs),
        0 if multi_group else plan.skips[0],
        blocks_per_host_block,
        host_row,
        cfg.n_chunks,
        store,
        multi_group,
        cfg.rows,
        cfg.chunk,
        cfg.vec,
    )
    return programs, args


_CONSTEXPRS = ("STORE", "MULTI_GROUP", "ROWS", "CHUNK", "VEC")


def _constexprs(args: tuple) -> dict:
    """The kernel's constexpr arguments (the last five of :func:`arguments`) by name."""
    return dict(zip(_CONSTEXPRS, args[-5:]))


def launch(programs: int, args: tuple, num_warps: int, cuda: bool) -> None:
    """One launch through Triton's dispatch, asynchronously on the current stream; on CPU tensors through the
    interpreter."""
    kernel = _jit_kernel if cuda else _interpreted_kernel()
    kernel[(programs,)](*args[:-5], **_constexprs(args), num_warps=num_warps)


def compile_variant(args: tuple, num_warps: int):
    """The compiled kernel a launch with ``args`` uses (compiled now if Triton's cache does not hold it); CUDA only."""
    return _compile_variant(_jit_kernel, args[:-5], _constexprs(args), num_warps)
