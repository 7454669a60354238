"""The copy kernel and its thin launch: one Triton kernel gathers GPU KV blocks of all layers into packed host blocks
(a store) or scatters them back (a load), with the integrity checks' @jit helpers of :mod:`.integrity_parts`, the
launch shape of a :class:`LaunchTuning` and the launch itself. What it reads is built by :mod:`.tables` (per spec)
and :mod:`.packing` (per plan); docs/design.md (section 5) explains the decomposition, the addressing and the
performance model behind the constants; :mod:`triton_offload.issuers` derives all of it once per spec and issues
plans."""

from __future__ import annotations

from typing import Any, NamedTuple

import triton
import triton.language as tl

from triton_offload.kernels._triton_compat import SUM_COMBINE as _SUM  # noqa: F401 (the mutation tests' import)
from triton_offload.kernels._triton_compat import compile_variant as _compile_variant
from triton_offload.kernels.integrity_parts import (  # noqa: F401
    FIN,
    _finish_program,
    _index_terms,
    _lane_step,
    _next_step,
    interpreted_helpers,
)
from triton_offload.kernels.shapes import DEFAULT_NUM_CTAS, LaunchConfig
from triton_offload.plan import TransferPlan

__all__ = [
    "IntegrityArgs",
    "arguments",
    "launch",
    "compile_variant",
]


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
    # The integrity checks (docs/integrity.md); without INTEGRITY the pointers are None, which Triton drops from the
    # compiled signature, and the two scalars 0 (NO_INTEGRITY): the kernel without checks never reads them.
    ck_ptr,  # int64* (groups * n_segs, 3): per (group, segment) the segment's first word in its block's word stream,
    # the group's words per block, and the host region of the group's keys (its marker and checksums in the table)
    ident_ptr,  # int64*: the identity of each host id of the plan (ids order)
    sums_ptr,  # int64*, zeroed: two lane sums and a counter per GPU block of the plan, then the programs-done counter
    # and a load's two totals (kernels/packing.py)
    res_ptr,  # int64* (host memory): a load's number of failed and of absent blocks, then each block's status
    tab_ptr,  # int64* (host memory): the checksum table, per host row and region a marker then f checksums
    tab_row: tl.int64,  # elements between the table's rows
    mark: tl.int64,  # the row marker (triton_offload/integrity.py: version, f, word size)
    STORE: tl.constexpr,  # True: GPU -> host (a store, gather_blocks); False: host -> GPU (a load, scatter_blocks)
    MULTI_GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    VEC: tl.constexpr,  # every offset and length is a multiple of VEC elements: enables 16-byte accesses
    INTEGRITY: tl.constexpr,  # also checksum every block moved (stores: write it; loads: check it)
    COPY: tl.constexpr,  # False: move nothing, only checksum the GPU side (the copy-engine path's check)
):
    """Moves every (GPU block, segment) item of one transfer; a program walks tiles ``pid, pid + nprog, ...``
    (with the checks, ``pid * tiles_per_program ..``, contiguous).

    Position rule (docs/design.md, "The packed host format"): GPU block ``i`` of a group lands at position
    ``p = skip + i``, i.e. host block ``host_ids[first_host + p // blocks_per_host_block]``, sub-block
    ``p % blocks_per_host_block``; segment ``s`` of sub-block ``j`` starts at ``j * host stride + host offset``
    from its table row (the packed format: the stride is the packed sub-block).
    """
    # The row indices (item, block, segment, position, host index) are int32: the planner refuses a transfer of
    # 2**31 rows or more (plan.MAX_ROWS), and 32-bit division and registers are what small pages' tiles spend most on
    # (docs/compiler.md). Addresses and offsets in elements stay int64.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, CHUNK)
    n_segs32 = n_segs.to(tl.int32)
    f32 = blocks_per_host_block.to(tl.int32)
    n_items = (n_blocks * n_segs).to(tl.int32)
    # A fixed trip count rather than range(pid, n_tiles, nprog): older Triton interpreters cannot take a program id
    # as a Python range bound, and a round past the last tile is simply all masked.
    for i in range(0, tiles_per_program):
        if INTEGRITY:  # contiguous tiles: a program holds all of most of its blocks' items (_finish_program)
            tile = (pid * tiles_per_program + i).to(tl.int32)
        else:
            tile = (pid + i * nprog).to(tl.int32)  # i is int64 compiled (its bound is), a Python int interpreted
        item = tile * ROWS + rows  # [ROWS]
        live = item < n_items  # [ROWS]
        blk = item // n_segs32
        seg = item - blk * n_segs32
        gpu_id = tl.load(ids_ptr + blk, mask=live, other=0)
        if MULTI_GROUP:
            group = tl.load(ids_ptr + n_blocks + n_host + blk, mask=live, other=0).to(tl.int32)
            group_row = ids_ptr + 2 * n_blocks + n_host + group * 3
            first_block = tl.load(group_row, mask=live, other=0).to(tl.int32)
            pos = blk - first_block + tl.load(group_row + 1, mask=live, other=0).to(tl.int32)
            host_idx = tl.load(group_row + 2, mask=live, other=0).to(tl.int32) + pos // f32
            seg_row = table_ptr + (group * n_segs32 + seg) * 5
        else:
            pos = blk + skip.to(tl.int32)
            host_idx = pos // f32
            seg_row = table_ptr + seg * 5
        host_id = tl.load(ids_ptr + n_blocks + host_idx, mask=live, other=0)
        seg_base = tl.load(seg_row, mask=live, other=0)
        seg_stride = tl.load(seg_row + 1, mask=live, other=0)
        seg_len = tl.load(seg_row + 2, mask=live, other=0)  # dead rows and padding get length 0: fully masked
        seg_host_stride = tl.load(seg_row + 3, mask=live, other=0)
        seg_host = tl.load(seg_row + 4, mask=live, other=0)
        gpu_off = tl.multiple_of(seg_base + gpu_id * seg_stride, VEC)  # [ROWS], elements from the anchor
        host_off = tl.multiple_of(  # [ROWS], elements from the host buffer's start
            host_id * host_row_stride + (pos % f32).to(tl.int64) * seg_host_stride + seg_host, VEC
        )
        seg_len = tl.multiple_of(seg_len.to(tl.int32), VEC)  # a segment is < 2**31 elements (the planner checks)
        if INTEGRITY:
            # Word positions in the block's stream are 32-bit (a block of 16 GiB would wrap them).
            if MULTI_GROUP:
                seg_word = tl.load(ck_ptr + (group * n_segs32 + seg) * 3, mask=live, other=0).to(tl.uint32)
            else:
                seg_word = tl.load(ck_ptr + seg * 3, mask=live, other=0).to(tl.uint32)
            # Per thread, its VEC words of a step fold into one term per lane (no exchange between threads), so the
            # running sums take VEC times fewer registers than the tile.
            acc_a = tl.full([ROWS, CHUNK // VEC], 0, tl.uint32)
            acc_b = tl.full([ROWS, CHUNK // VEC], 0, tl.uint32)
            index_terms = _index_terms(seg_word, ROWS, CHUNK, VEC)
            step_terms = tl.full([], 0, tl.uint32)  # the index terms' part of the step: CHUNK // VEC groups more each
        if INTEGRITY and COPY and not STORE:
            # A checked load: each step's host words are read a step before they are written and summed, two steps
            # a trip (no register copies between trips). Reads of host memory wait a PCIe round trip, and a checked
            # step holds half a plain step's bytes (rows at most a warp wide): read one step at a time, a program
            # kept half the plain kernel's bytes in flight (docs/integrity.md). Steps past the longest segment (an
            # odd count's last) are fully masked: they read nothing and sum to 0.
            vals_a = tl.load(host_ptr + host_off[:, None] + cols[None, :], mask=cols[None, :] < seg_len[:, None])
            for t in range(0, (n_chunks + 1) // 2):
                # Masks recomputed from the trip's first column rather than carried: carried, they cost register
                # moves and predicate spills each trip (sm_90 SASS).
                col_a = tl.cast(t * (2 * CHUNK), tl.int32) + cols
                col_b = col_a + CHUNK
                col_c = col_b + CHUNK
                mask_a = col_a[None, :] < seg_len[:, None]
                mask_b = col_b[None, :] < seg_len[:, None]
                vals_b = tl.load(host_ptr + host_off[:, None] + col_b[None, :], mask=mask_b)
                tl.store(anchor_ptr + gpu_off[:, None] + col_a[None, :], vals_a, mask=mask_a)
                step_a, step_b = _lane_step(vals_a, mask_a, index_terms + step_terms, ROWS, CHUNK, VEC)
                step_terms = _next_step(step_terms, CHUNK, VEC)
                acc_a += step_a
                acc_b += step_b
                vals_a = tl.load(host_ptr + host_off[:, None] + col_c[None, :], mask=col_c[None, :] < seg_len[:, None])
                tl.store(anchor_ptr + gpu_off[:, None] + col_b[None, :], vals_b, mask=mask_b)
                step_a, step_b = _lane_step(vals_b, mask_b, index_terms + step_terms, ROWS, CHUNK, VEC)
                step_terms = _next_step(step_terms, CHUNK, VEC)
                acc_a += step_a
                acc_b += step_b
        else:  # one step at a time: stores (GPU reads are near), plain loads, the checksum-only launch
            for k in range(0, n_chunks):
                if INTEGRITY:  # 32-bit columns: fewer registers and compares for the checks' tiles of many rows
                    col0 = tl.cast(k * CHUNK, tl.int32)
                    col = col0 + cols
                else:
                    col = k * CHUNK + cols  # [CHUNK]
                mask = col[None, :] < seg_len[:, None]  # [ROWS, CHUNK]
                if not COPY:  # only read the GPU side: the copy engines moved (or will move) the bytes
                    vals = tl.load(anchor_ptr + gpu_off[:, None] + col[None, :], mask=mask)
                elif STORE:
                    vals = tl.load(anchor_ptr + gpu_off[:, None] + col[None, :], mask=mask)  # [ROWS, CHUNK]
                    tl.store(host_ptr + host_off[:, None] + col[None, :], vals, mask=mask)
                else:
                    vals = tl.load(host_ptr + host_off[:, None] + col[None, :], mask=mask)
                    tl.store(anchor_ptr + gpu_off[:, None] + col[None, :], vals, mask=mask)
                if INTEGRITY:
                    step_a, step_b = _lane_step(vals, mask, index_terms + step_terms, ROWS, CHUNK, VEC)
                    step_terms = _next_step(step_terms, CHUNK, VEC)
                    acc_a += step_a
                    acc_b += step_b
        if INTEGRITY:
            # Sums mod 2**32 are associative and commutative: tiles and programs add their parts in any order. The
            # adds are relaxed (no fence per row and tile): a program's count into a shared block's counter orders
            # them (_finish_program). With the checked launch shape (a row per warp, shapes.launch_config) the
            # reduction stays within a warp.
            part_a = tl.reduce(acc_a, 1, _SUM).to(tl.int64)
            part_b = tl.reduce(acc_b, 1, _SUM).to(tl.int64)
            # Added from the sums' own [ROWS, CHUNK // VEC] layout, first column only: pointers contiguous along the
            # columns and only 1-aligned (odd) keep the compiler from moving them into another layout through shared
            # memory with barriers (Triton 3.6 did, with a [ROWS] atomic or pointers constant along the columns).
            grp = tl.arange(0, CHUNK // VEC)[None, :]
            odd = (2 * blk + 1)[:, None] + grp  # column 0: lane b's address; the other columns are masked off
            once = live[:, None] & (grp == 0)
            tl.atomic_add(sums_ptr + odd - 1, part_a[:, None], mask=once, sem="relaxed", scope="gpu")
            tl.atomic_add(sums_ptr + odd, part_b[:, None], mask=once, sem="relaxed", scope="gpu")
    if INTEGRITY:
        # Each program finalises the blocks it holds all of and the shared ones it adds to last
        # (integrity_parts.py); the barriers there are the only ones of a checked launch outside its reductions.
        _finish_program(ids_ptr, ck_ptr, ident_ptr, sums_ptr, res_ptr, tab_ptr, tab_row, mark, n_blocks, n_host,
                        n_segs, skip, blocks_per_host_block, pid * tiles_per_program * ROWS, tiles_per_program * ROWS,
                        n_segs, STORE, MULTI_GROUP, FIN)  # fmt: skip


_NOT_SPECIALIZED = [
    "n_blocks",
    "n_host",
    "n_segs",
    "tiles_per_program",
    "skip",
    "blocks_per_host_block",
    "host_row_stride",
    "n_chunks",
    "tab_row",
    "mark",
]
# Pointers whose alignment the compiled code must not assume: the ids are gathered row by row (no vector access to
# gain), and their buffer changes between calls; so are the integrity buffers (sub-views of the id buffer, the
# results, the checksum table). The KV anchor and the host buffer keep their alignment specialisation (it enables the
# 16-byte accesses); both are fixed for a launcher.
_ALIGNMENT_NOT_SPECIALIZED = ["table_ptr", "ids_ptr", "ck_ptr", "ident_ptr", "sums_ptr", "res_ptr", "tab_ptr"]
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

        from triton_offload.kernels._triton_compat import interpreted_copy, patch_interpreter_scalar_index

        patch_interpreter_scalar_index()
        # The kernel and its helpers see each other, and the sum's combine function, as the interpreter can call them.
        plain = interpreted_helpers()
        _interpreted = InterpretedFunction(interpreted_copy(_copy_blocks_kernel, **plain))
    return _interpreted


# ---------------------------------------------------------------------------------------------------------------
# The launch
# ---------------------------------------------------------------------------------------------------------------


class IntegrityArgs(NamedTuple):
    """The integrity checks' arguments of one launch (docs/integrity.md): tensors, or device addresses for a direct
    launch.

    Attributes:
        ck: the spec's integrity table (:func:`~triton_offload.kernels.tables.build_integrity_table`), on its
            device.
        ident: the identity of each host id of the plan (the id buffer's part,
            :func:`~triton_offload.kernels.packing.integrity_offsets`).
        sums: the zeroed lane sums and counter (the id buffer's part).
        res: a load's results, ``result_size(plan)`` int64 in host memory (a store writes none: may be anything).
        tab: the checksum table, int64 in host memory, one row of ``regions x (1 + f)`` per host block.
        tab_row: elements between the table's rows.
        mark: the row marker (:func:`triton_offload.integrity.marker`).
    """

    ck: Any
    ident: Any
    sums: Any
    res: Any
    tab: Any
    tab_row: int
    mark: int


# Without the checks: the pointers None (Triton drops them from the compiled signature), the two int64-typed scalars 0
# (a typed parameter stays in the signature whatever its value, and Triton's compiled launcher cannot convert None
# to an integer: it raised TypeError on every launch of the 11-28 H200 run).
NO_INTEGRITY = IntegrityArgs(None, None, None, None, None, 0, 0)


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
    checks: IntegrityArgs | None = None,
    copy: bool = True,
) -> tuple[int, tuple]:
    """(programs, every kernel argument in signature order, constexprs included) of one launch moving ``plan``, as
    Triton's dispatch hands them to the compiled kernel's launcher. The pointers are tensors, or device addresses
    for a direct launch; ``host_row`` is the host buffer's row stride in elements. With ``checks``, the launch also
    checksums every block (``copy`` False: only that, over the GPU side); without, :data:`NO_INTEGRITY` (the pointers
    None, which Triton compiles out)."""
    n_tiles = triton.cdiv(plan.n_blocks * n_segs, cfg.rows)
    programs = max(1, min(num_ctas or DEFAULT_NUM_CTAS, n_tiles))
    multi_group = len(plan.sizes) > 1
    assert copy or checks is not None, "a launch that moves nothing must check something"
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
        *(NO_INTEGRITY if checks is None else checks),
        store,
        multi_group,
        cfg.rows,
        cfg.chunk,
        cfg.vec,
        checks is not None,
        copy,
    )
    return programs, args


_CONSTEXPRS = ("STORE", "MULTI_GROUP", "ROWS", "CHUNK", "VEC", "INTEGRITY", "COPY")
_N_CONST = len(_CONSTEXPRS)


def _constexprs(args: tuple) -> dict:
    """The kernel's constexpr arguments (the last ones of :func:`arguments`) by name."""
    return dict(zip(_CONSTEXPRS, args[-_N_CONST:]))


def launch(programs: int, args: tuple, num_warps: int, cuda: bool) -> None:
    """One launch through Triton's dispatch, asynchronously on the current stream; on CPU tensors through the
    interpreter."""
    kernel = _jit_kernel if cuda else _interpreted_kernel()
    kernel[(programs,)](*args[:-_N_CONST], **_constexprs(args), num_warps=num_warps)


def compile_variant(args: tuple, num_warps: int):
    """The compiled kernel a launch with ``args`` uses (compiled now if Triton's cache does not hold it); CUDA only."""
    return _compile_variant(_jit_kernel, args[:-_N_CONST], _constexprs(args), num_warps)
