"""The copy kernel and everything it reads: one Triton kernel gathers GPU KV blocks of all layers into packed host
blocks (a store) or scatters them back (a load), and this module owns its interface: the segment table, the packed
ids of a :class:`TransferPlan`, the launch shapes, and the launcher.

Work is a flat list of *items*, one per (GPU block, segment) pair, ordered block-major so that consecutive items are
consecutive host bytes. A persistent grid of ``num_ctas`` programs walks tiles of ``ROWS`` items; each tile moves
``ROWS x CHUNK`` elements per step, so small pages are batched many to a tile and large pages are streamed in chunks.
Addresses are element offsets from two base pointers: the host buffer, and the segment table itself (the *anchor*),
from which every KV tensor's address is stored as a difference. All address arithmetic is int64. With KV-cache
groups (``MULTI_GROUP``), each block reads its group, and the group's skip and first host id, from the id buffer,
and its segments from the group's rows of the table; one launch still moves every group. docs/design.md explains
the decomposition and the performance model behind the constants.

The table also places each segment on the host: sub-block ``j`` of a host row holds the segment's bytes at
``j * host stride + host offset``. The packed format gives every segment the packed sub-block as its stride (one GPU
block's segments are contiguous); vLLM's worker-slot layout (``HostSlots``, docs/tiering.md) gives each segment its
tensor's page as the stride and its tensor's region in the row as the offset. One kernel serves both.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from triton_offload.kernels._triton_compat import compile_variant, launch_hooks_idle
from triton_offload.layouts import KVCacheSpec

__all__ = [
    "DEFAULT_NUM_CTAS",
    "TransferPlan",
    "pack_ids",
    "packed_size",
    "LaunchConfig",
    "launch_config",
    "access_width",
    "CopyLauncher",
]

# Tuned constants, measured on an NVIDIA H100 80GB HBM3 (PCIe Gen5 x16, driver 580.159.04, Triton 3.6), 2026-11-22,
# by bench/tune.py over six cases (1 KiB to 72 KiB segments, 128 and 1024 blocks, f=1) against the same run's
# contiguous pinned peak (~55 GB/s): bench/results/nvidia-h100-80gb-hbm3-2026-11-22-tune*.json.
# - 64 KiB tiles with 16 warps (128 bytes, eight 16-byte accesses, per thread per step) reach ~50-51 GB/s in both
#   directions, 91-104 % of each case's peak in two runs, with only 4 programs; 16-32 KiB tiles need 8 programs for
#   that, and with 64 KiB tiles 8 programs made loads worse, not better (too many host reads in flight).
# - 2 programs reach only ~35 GB/s (stores) and ~30 GB/s (loads): SM-driven host reads plateau per SM.
DEFAULT_NUM_CTAS = 4
# Bytes one program moves per step, and its warps: the bytes a program has in flight (same for both directions).
STORE_TILE_BYTES, LOAD_TILE_BYTES = 64 * 1024, 64 * 1024
STORE_NUM_WARPS, LOAD_NUM_WARPS = 16, 16
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
# The packed ids: the kernel's id buffer
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)  # slots: built on every call, and twice as fast to build
class TransferPlan:
    """A validated transfer, packed for one launch (built by :func:`triton_offload.transfer.plan_transfer`).

    Attributes:
        store: True for GPU -> host, False for host -> GPU.
        ids: int64, the kernel's id buffer: the n GPU ids, the host ids and, for a spec with several KV-cache groups,
            each GPU block's group and, per group, (index of its first GPU block, skip, index of its first host id).
        n_blocks: GPU blocks moved.
        n_host: host block ids.
        skip: the skip of a spec with one group (several groups carry theirs in ``ids``).
        num_bytes: bytes moved (each group's blocks times that group's bytes per block).
    """

    store: bool
    ids: np.ndarray
    n_blocks: int
    n_host: int
    skip: int
    num_bytes: int


def packed_size(num_groups: int, n_blocks: int, n_host: int) -> int:
    """Elements of the kernel's id buffer for a transfer of ``n_blocks`` GPU ids and ``n_host`` host ids."""
    return n_blocks + n_host if num_groups == 1 else 2 * n_blocks + n_host + 3 * num_groups


def pack_ids(
    spec: KVCacheSpec,
    store: bool,
    gpu_ids: np.ndarray,
    host_ids: np.ndarray,
    sizes: Sequence[int],
    skips: Sequence[int],
    host_counts: Sequence[int],
    stage=None,
) -> TransferPlan:
    """Packs validated ids into the kernel's id buffer: per group, ``sizes[g]`` GPU ids starting at ``skips[g]``
    and ``host_counts[g]`` host ids, concatenated group by group.

    Args:
        stage: ``stage(size)`` returns a 1-D int64 array of at least ``size`` elements to pack into (a pinned
            staging buffer, so the ids need no further copy before their upload); None allocates one.
    """
    n, m = gpu_ids.size, host_ids.size
    one_group = spec.num_groups == 1
    size = n + m if one_group else packed_size(spec.num_groups, n, m)
    out = np.empty(size, dtype=np.int64) if stage is None else stage(size)[:size]
    out[:n] = gpu_ids
    out[n : n + m] = host_ids
    if one_group:
        return TransferPlan(store, out, n, m, skips[0], n * spec.bytes_per_block)
    num_bytes = sum(k * b for k, b in zip(sizes, spec.group_bytes))
    out[n + m : 2 * n + m] = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    first_block = np.cumsum(sizes) - sizes
    first_host = np.cumsum(host_counts) - host_counts
    out[2 * n + m :] = np.stack([first_block, skips, first_host], axis=1).reshape(-1)
    return TransferPlan(store, out, n, m, 0, num_bytes)


# ---------------------------------------------------------------------------------------------------------------
# Launch shapes and the segment table, built once per spec
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


def tile_bytes(store: bool) -> int:
    return STORE_TILE_BYTES if store else LOAD_TILE_BYTES


def _chunk_elems(max_seg: int, tile: int) -> int:
    """Elements one row moves per step: the power of two that pads the longest segment least, the largest such on a
    tie, between the tile (or the segment rounded up, if smaller) and tile / MAX_ROWS (segments smaller than that
    take one chunk each). A segment then splits into whole chunks wherever a power of two allows it: the 72 KiB MLA
    page is 9 chunks of 8 KiB, not 3 of 32 KiB with the last a quarter full."""
    top = min(_next_pow2(max_seg), tile)
    floor = min(top, max(1, tile // MAX_ROWS))
    candidates = [top >> i for i in range(top.bit_length()) if top >> i >= floor]
    return min(candidates, key=lambda c: (triton.cdiv(max_seg, c) * c, -c))


def launch_config(spec: KVCacheSpec, width: int, store: bool) -> LaunchConfig:
    """The launch shape for a spec, an access width and a direction (pure; :class:`CopyLauncher` caches it)."""
    elem = min(width, 4)
    max_seg = spec.max_segment_bytes // elem
    tile = tile_bytes(store) // elem
    # Small pages share a tile (many rows), large ones stream through it (few rows, several chunks).
    chunk = _chunk_elems(max_seg, tile)
    num_warps = STORE_NUM_WARPS if store else LOAD_NUM_WARPS
    return LaunchConfig(elem, width // elem, tile // chunk, chunk, triton.cdiv(max_seg, chunk), num_warps)


def table_key(spec: KVCacheSpec, blocks_per_host_block: int) -> int:
    """The f a segment table depends on: only worker slots place a region after f pages of the earlier ones, so the
    packed format's table is the same for every f (key 1)."""
    return blocks_per_host_block if spec.host_slots is not None else 1


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


class _SpecKernelState:
    """What the kernel derives from one spec, built at most once: tables per element size (and f, for worker
    slots), shapes per launch."""

    def __init__(self) -> None:
        self.tables: dict[tuple[int, int], torch.Tensor] = {}
        self.configs: dict[tuple[int, bool], LaunchConfig] = {}
        # Direct launchers of compiled variants (triton_offload/fast_launch.py), by CopyLauncher.variant_key; a str
        # says why that variant keeps Triton's launch.
        self.direct: dict[tuple, object] = {}


# Keyed by the spec, held weakly: the spec stays a plain description of the caches, and its kernel state goes with it.
_STATE: weakref.WeakKeyDictionary[KVCacheSpec, _SpecKernelState] = weakref.WeakKeyDictionary()


class CopyLauncher:
    """Launches the copy kernel between one spec's KV caches and one host buffer.

    Everything the kernel reads that does not change per transfer (access width, launch shapes, segment tables,
    host strides) is derived here, once; tables and shapes are shared by every launcher of the same spec. Inputs are
    validated by :mod:`triton_offload.transfer`; only internal invariants are asserted here.

    A launch goes through Triton's dispatch (``kernel[grid](...)``) unless a direct launcher of the compiled variant
    was installed for its direction (:meth:`set_direct`, done by :mod:`triton_offload.fast_launch` once proven).

    Args:
        spec: the prepared KV caches.
        host_buffer: (num_host_blocks, host_block_bytes) uint8/int8, row stride may exceed the row (checked by
            :func:`triton_offload.transfer.check_host_buffer`).
        blocks_per_host_block: GPU blocks per host block.
        store: the one direction this launcher serves (a single public call); None for both (an engine).
        configs: launch shapes to use instead of the spec's own, per direction (a canary launcher takes its live
            launcher's, so both launch the same compiled variant).
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        host_buffer: torch.Tensor,
        blocks_per_host_block: int,
        store: bool | None = None,
        configs: dict[bool, LaunchConfig] | None = None,
    ):
        self.spec, self.host_buffer, self.blocks_per_host_block = spec, host_buffer, blocks_per_host_block
        self.cuda = spec.device.type == "cuda"
        if self.cuda and os.environ.get("TRITON_INTERPRET", "0") == "1":
            raise RuntimeError("TRITON_INTERPRET=1 is set, which cannot run kernels on CUDA tensors: unset it")
        state = _STATE.get(spec)
        if state is None:
            state = _STATE[spec] = _SpecKernelState()
        width = access_width(spec, host_buffer)
        self.directions = (True, False) if store is None else (store,)
        self._launch_args = {}
        self._direct: dict[bool, object] = {}
        for d in self.directions:  # True: a store
            cfg = None if configs is None else configs[d]
            if cfg is None:
                cfg = state.configs.get((width, d))
            if cfg is None:
                cfg = state.configs[(width, d)] = launch_config(spec, width, d)
            assert cfg.elem * cfg.vec <= width, "a launch shape may not access wider than the buffers allow"
            key = (cfg.elem, table_key(spec, blocks_per_host_block))
            table = state.tables.get(key)
            if table is None:
                table = state.tables[key] = build_segment_table(spec, cfg.elem, key[1])
            host_row = host_buffer.stride(0) * host_buffer.element_size() // cfg.elem
            # The anchor (the table's storage as the element type) and the host view are made once, not per launch.
            anchor, host = table.view(cfg.dtype), host_buffer.view(cfg.dtype)
            # A direct launch passes device addresses as ints (the launcher then skips data_ptr and the driver's
            # pointer lookup); the host buffer stays a tensor, so the launcher translates it as Triton's launch does.
            self._launch_args[d] = (cfg, (anchor, host, table), (anchor.data_ptr(), host, table.data_ptr()), host_row)
        self._current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def config(self, store: bool) -> LaunchConfig:
        return self._launch_args[store][0]

    def variant_key(self, store: bool) -> tuple:
        """What selects the compiled variant of this launcher's launches in one direction: the launch shape and the
        alignment class of the two data pointers (the only arguments Triton specialises); the spec's state keeps
        one direct launcher per key."""
        cfg, (anchor, host, _), _, _ = self._launch_args[store]
        return (cfg, store, self.spec.num_groups > 1, anchor.data_ptr() % 16 == 0, host.data_ptr() % 16 == 0)

    def arguments(self, plan: TransferPlan, ids, num_ctas: int | None = None, direct: bool = False):
        """(programs, every kernel argument in signature order, constexprs included) of one launch, as Triton's
        dispatch hands them to the compiled kernel's launcher. ``ids`` is the device id buffer (or, ``direct``, its
        address; the KV anchor and the table are then passed as addresses too)."""
        spec = self.spec
        cfg, pointers, addresses, host_row = self._launch_args[plan.store]
        anchor, host, table = addresses if direct else pointers
        n_segs = spec.segments_per_group
        n_tiles = triton.cdiv(plan.n_blocks * n_segs, cfg.rows)
        programs = max(1, min(num_ctas or DEFAULT_NUM_CTAS, n_tiles))
        args = (
            anchor,
            host,
            table,
            ids,
            plan.n_blocks,
            plan.n_host,
            n_segs,
            triton.cdiv(n_tiles, programs),
            plan.skip,
            self.blocks_per_host_block,
            host_row,
            cfg.n_chunks,
            plan.store,
            spec.num_groups > 1,
            cfg.rows,
            cfg.chunk,
            cfg.vec,
        )
        return programs, args

    def compile_variant(self, store: bool):
        """The compiled kernel this launcher's launches in one direction use (compiled now if Triton's cache does
        not hold it yet); CUDA only."""
        cfg = self.config(store)
        ids = torch.zeros(1, dtype=torch.int64, device=self.spec.device)
        plan = TransferPlan(store, np.zeros(1, dtype=np.int64), 1, 1, 0, 0)
        _, args = self.arguments(plan, ids)
        return compile_variant(_jit_kernel, args[:-5], _constexprs(args), cfg.num_warps)

    def set_direct(self, store: bool, runner) -> None:
        """Launches in direction ``store`` call ``runner(programs, stream, args)`` instead of Triton's dispatch
        (None: back to the dispatch)."""
        if runner is None:
            self._direct.pop(store, None)
        else:
            self._direct[store] = runner

    def direct(self, store: bool):
        """The direct runner of direction ``store``, or None when its launches go through Triton's dispatch."""
        return self._direct.get(store)

    def launch(self, plan: TransferPlan, ids: torch.Tensor, num_ctas: int | None = None) -> None:
        """One launch moving ``plan``'s blocks (all layers, all groups), asynchronously on the current stream.

        Args:
            plan: the validated transfer.
            ids: ``plan.ids`` as int64 on the spec's device.
            num_ctas: programs to launch at most (the SMs it occupies); None for :data:`DEFAULT_NUM_CTAS`.
        """
        assert ids.dtype == torch.int64 and ids.device == self.spec.device
        runner = self._direct.get(plan.store)
        if runner is not None and launch_hooks_idle():  # a profiler's launch hooks need Triton's own path
            if self.cuda:
                programs, args = self.arguments(plan, ids.data_ptr(), num_ctas, direct=True)
                runner(programs, self._current_stream(self.spec.device.index), args)
            else:  # a runner under test, on the interpreter: it needs tensors
                programs, args = self.arguments(plan, ids, num_ctas)
                runner(programs, 0, args)
            return
        programs, args = self.arguments(plan, ids, num_ctas)
        kernel = _jit_kernel if self.cuda else _interpreted_kernel()
        kernel[(programs,)](*args[:-5], **_constexprs(args), num_warps=self.config(plan.store).num_warps)


_CONSTEXPRS = ("STORE", "MULTI_GROUP", "ROWS", "CHUNK", "VEC")


def _constexprs(args: tuple) -> dict:
    """The kernel's constexpr arguments (the last five of :meth:`CopyLauncher.arguments`) by name."""
    return dict(zip(_CONSTEXPRS, args[-5:]))
