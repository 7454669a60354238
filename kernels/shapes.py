"""The copy kernel's launch shapes: how many programs a launch takes (``DEFAULT_NUM_CTAS``, or by the caches' page
runs under the "size-aware" shape) and the compile-time shape of its tiles (:class:`LaunchConfig`) from a direction's
:class:`LaunchTuning`, with the measurements the constants come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch
import triton

from triton_offload.layouts import KVCacheSpec
from triton_offload.plan import Direction

__all__ = [
    "DEFAULT_NUM_CTAS",
    "SIZE_AWARE_PROGRAMS",
    "size_aware_ctas",
    "LaunchTuning",
    "DEFAULT_TUNINGS",
    "MAX_ROWS",
    "LaunchConfig",
    "launch_config",
]

# Tuned constants, measured on an NVIDIA H100 80GB HBM3 (PCIe Gen5 x16, driver 580.159.04, Triton 3.6), 2026-11-22,
# by bench/micro/tune.py over six cases (1 KiB to 72 KiB segments, 128 and 1024 blocks, f=1) against the same run's
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
    ``num_ctas`` where one is given. A launch never exceeds its tiles either
    (:func:`~triton_offload.kernels.copy_blocks.arguments`)."""
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
# A tile holds tile_bytes / 4 elements whatever their size, and at most one row per thread: narrow pages (2- and 1-byte
# words, segments of a few words) otherwise got 2048-8192 rows and 32-64 elements per thread in a tile and spilled
# 1-7 KiB per thread (docs/compiler.md). Pages of 4-byte words or wider are unchanged.
_TILE_ELEM_BYTES = 4
# Rows a thread of a checked launch moves per step (its tile: 4 x 512 B per warp of 16-byte pages). The sm_90 SASS
# (Triton 3.9) of the 64 KiB page, integrity v3: 4 rows, 100 registers and 21.75 instructions per 16 B; 8 rows spill
# 120 bytes (22.0 per 16 B: nothing gained).
CHECKED_ROWS_PER_THREAD = 4
_ELEM_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


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


def launch_config(spec: KVCacheSpec, width: int, tuning: LaunchTuning, checked: bool = False) -> LaunchConfig:
    """The launch shape for a spec, an access width and a direction's tuning (pure). ``checked``: the shape of the
    launches with the integrity checks, whose rows are at most one warp wide (a step moves one access per thread and
    row), so each row's lane sums reduce within its warp, without a barrier; the tile keeps its bytes."""
    elem = min(width, 4)
    vec = width // elem
    max_seg = spec.max_segment_bytes // elem
    tile = tuning.tile_bytes // _TILE_ELEM_BYTES
    if checked:
        # One access per thread and row per step (a row is at most one warp wide), CHECKED_ROWS_PER_THREAD rows.
        chunk = max(vec, min(32 * vec, _next_pow2(max_seg), tile))
        rows = max(1, min(tile // chunk, CHECKED_ROWS_PER_THREAD * 32 * vec // chunk * tuning.num_warps))
    else:
        # Small pages share a tile (many rows), large ones stream through it (few rows, several chunks).
        chunk = _chunk_elems(max_seg, tile)
        rows = max(1, min(tile // chunk, 32 * tuning.num_warps))
    return LaunchConfig(elem, vec, rows, chunk, triton.cdiv(max_seg, chunk), tuning.num_warps)
