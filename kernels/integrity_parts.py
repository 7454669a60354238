"""The integrity checks' parts of the kernels (docs/integrity.md; triton_offload/integrity.py is their NumPy
reference), shared by the copy kernel (:mod:`.copy_blocks`) and the FP8 kernel (:mod:`.fp8_blocks`): the lane terms of
the word groups a step moved, and each program's finalisation of its share of the blocks (a block's checksum from
its lane sums, identity, sub-block and length: a store writes it into the checksum table, a load compares). @jit
helpers of the kernels (inlined when compiled), JITFunction objects whatever TRITON_INTERPRET says, so a compiled
kernel can call them; :data:`HELPERS` holds their plain functions for the interpreted kernels
(:func:`interpreted_helpers`).
"""

from __future__ import annotations

import triton.language as tl
from triton.runtime.jit import JITFunction

from triton_offload.kernels._triton_compat import SUM_COMBINE as _SUM

__all__ = ["FIN", "HELPERS", "interpreted_helpers"]

# Blocks a program finalises per step of the integrity checks: one per thread at 16 warps (each step waits on a few
# dependent reads, some from host memory; a program finalises its share of a launch's blocks, mostly in one step).
FIN = tl.constexpr(512)


# ---------------------------------------------------------------------------------------------------------------
# The integrity checks' parts of the kernel (docs/integrity.md; triton_offload/integrity.py is their NumPy
# reference): the per-step lane sums of the words a tile moved, and each program's finalisation of its blocks.
# @jit helpers of the kernel (inlined when compiled); JITFunction objects whatever TRITON_INTERPRET says, so a
# compiled kernel can call them, and replaced by plain copies of themselves in the interpreted kernel.
# ---------------------------------------------------------------------------------------------------------------


def _first_of_groups_fn(x, ROWS: tl.constexpr, CHUNK: tl.constexpr, VEC: tl.constexpr):
    """[ROWS, CHUNK] as [ROWS, CHUNK // VEC, VEC] split into its VEC columns (word 0 of each group first), by
    register moves: a group is one thread's access."""
    if VEC == 4:
        even, odd = tl.split(tl.reshape(x, [ROWS, CHUNK // VEC, 2, 2]))  # words 0, 2 and 1, 3
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        return x0, x1, x2, x3
    elif VEC == 2:
        x0, x1 = tl.split(tl.reshape(x, [ROWS, CHUNK // VEC, 2]))
        return x0, x1, x0, x1
    else:
        return x, x, x, x


def _index_terms_fn(seg_word, ROWS: tl.constexpr, CHUNK: tl.constexpr, VEC: tl.constexpr):
    """``j * POS_MUL`` mod 2**32 of each group a tile row's step 0 moves (``seg_word``: each row's first word in its
    block's stream), [ROWS, CHUNK // VEC] uint32 in the layout of the step's groups (made from the tile's as they
    are); a later step adds its own (:func:`_lane_step`)."""
    col = tl.arange(0, CHUNK).to(tl.uint32)
    terms = ((seg_word // VEC)[:, None] + (col // VEC)[None, :]) * 0x165667B1
    first, _t1, _t2, _t3 = _first_of_groups(terms, ROWS, CHUNK, VEC)
    return first


def _next_step_fn(step_terms, CHUNK: tl.constexpr, VEC: tl.constexpr):
    """The index terms' part of the next step (uint32): CHUNK // VEC groups on, ``+ CHUNK // VEC * POS_MUL``. Carried
    from step to step: one add per step, where ``(col0 // VEC) * POS_MUL`` took a shift and a multiply (written with
    POS_MUL, the compiler also folds it back into each group's multiply)."""
    return step_terms + ((CHUNK // VEC * 0x165667B1) & 0xFFFFFFFF)


def _lane_step_fn(vals, mask, index_terms, ROWS: tl.constexpr, CHUNK: tl.constexpr, VEC: tl.constexpr):
    """The two 32-bit lane terms of the word groups one step moved (``vals`` [ROWS, CHUNK], loaded where ``mask``;
    ``index_terms``: :func:`_index_terms` plus the step's part): a group is a thread's VEC words of one access, folded
    into 64 bits, its index added to the low half, then mixed (triton_offload/integrity.py, version 3). Groups past a
    segment's end (the load's own predicate) give 0: [ROWS, CHUNK // VEC] each."""
    if vals.dtype == tl.int8:
        w = vals.to(tl.uint8, bitcast=True).to(tl.uint32)
    elif vals.dtype == tl.int16:
        w = vals.to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        w = vals.to(tl.uint32, bitcast=True)
    w0, w1, w2, w3 = _first_of_groups(w, ROWS, CHUNK, VEC)
    t = w0.to(tl.uint64) * 0x9E3779B1  # 32 x 32 -> 64-bit multiply-adds, exact
    if VEC >= 2:
        t = t + w1.to(tl.uint64) * 0x85EBCA77
    if VEC == 4:
        t = t + w2.to(tl.uint64) * 0xC2B2AE3D
        t = t + w3.to(tl.uint64) * 0x27D4EB2F
    a, b = _group_terms(t, index_terms)
    live, _l1, _l2, _l3 = _first_of_groups(mask, ROWS, CHUNK, VEC)  # the load's predicate: no compare of its own
    return tl.where(live, a, 0), tl.where(live, b, 0)


def _group_terms_fn(t, index_term):
    """The two lane terms of groups folded into ``t`` (uint64) whose index terms are ``index_term`` (uint32, ``j *
    POS_MUL`` mod 2**32): the index joins the fold's low half; one funnel shift, shared by both lanes, takes the high
    half's low bits into the low half's top ones (triton_offload/integrity.py, version 3)."""
    lo = t.to(tl.uint32) + index_term
    hi = (t >> 32).to(tl.uint32)
    z = lo ^ ((lo >> 16) | (hi << 16))
    return z * 0x7FEB352D, (z ^ hi) * 0x846CA68B


def _mix64_fn(z):
    """SplitMix64's finaliser (a bijection of uint64)."""
    z = z ^ (z >> 30)
    z = z * 0xBF58476D1CE4E5B9
    z = z ^ (z >> 27)
    z = z * 0x94D049BB133111EB
    return z ^ (z >> 31)


def _finalize_checksums_fn(
    ids_ptr, ck_ptr, ident_ptr, sums_ptr, res_ptr, tab_ptr, tab_row, mark, n_blocks, n_host, n_segs, skip,
    blocks_per_host_block, first, last, first_ok, last_ok, STORE: tl.constexpr, MULTI_GROUP: tl.constexpr,
    STEP: tl.constexpr,
):  # fmt: skip
    """The checksums of blocks ``first`` to ``last`` (``first`` only where ``first_ok``, ``last`` where ``last_ok``)
    from their lane sums, identity, sub-block and length: a store writes each (and its row's marker) into the checksum
    table, a load compares it with the table's and writes its status. ``STEP`` blocks at a time (a power of two):
    FIN, one per thread at the copy kernel's 16 warps, or fewer for a kernel of fewer threads. Returns a load's
    numbers of failed and of absent blocks among them (0 for a store)."""
    fins = tl.arange(0, STEP).to(tl.int64)
    n_fail = tl.full([STEP], 0, tl.int64)
    n_absent = tl.full([STEP], 0, tl.int64)
    for i in range(0, (last - first + STEP) // STEP):
        fblk = first + i * STEP + fins
        # (!= 0: the interpreter's & of a block's and a scalar's int1 is int32, which its masks refuse)
        flive = ((fblk <= last) & ((fblk != first) | first_ok) & ((fblk != last) | last_ok)) != 0
        # Read through the atomics' own path (L2), never a cache line of this program's.
        lane_a = tl.atomic_add(sums_ptr + 2 * fblk, 0, mask=flive, sem="acq_rel", scope="gpu")
        lane_b = tl.atomic_add(sums_ptr + 2 * fblk + 1, 0, mask=flive, sem="acq_rel", scope="gpu")
        lane_a = lane_a.to(tl.uint64) & 0xFFFFFFFF
        lane_b = lane_b.to(tl.uint64) & 0xFFFFFFFF
        if MULTI_GROUP:
            fgroup = tl.load(ids_ptr + n_blocks + n_host + fblk, mask=flive, other=0)
            fgroup_row = ids_ptr + 2 * n_blocks + n_host + fgroup * 3
            ffirst = tl.load(fgroup_row, mask=flive, other=0)
            fpos = fblk - ffirst + tl.load(fgroup_row + 1, mask=flive, other=0)
            fhost_idx = tl.load(fgroup_row + 2, mask=flive, other=0) + fpos // blocks_per_host_block
            words = tl.load(ck_ptr + fgroup * n_segs * 3 + 1, mask=flive, other=0)
            # A row holds one key per host region: the group's region has a marker and f checksums of its own.
            fregion = tl.load(ck_ptr + fgroup * n_segs * 3 + 2, mask=flive, other=0)
        else:
            fpos = fblk + skip
            fhost_idx = fpos // blocks_per_host_block
            words = tl.load(ck_ptr + 1 + 0 * fblk, mask=flive, other=0)
            fregion = 0 * fblk
        fhost_id = tl.load(ids_ptr + n_blocks + fhost_idx, mask=flive, other=0)
        ident = tl.load(ident_ptr + fhost_idx, mask=flive, other=0).to(tl.uint64, bitcast=True)
        sub = (fpos % blocks_per_host_block).to(tl.uint64)
        # h = mix64(ident ^ mix64(sub * SUB_MUL ^ words * LEN_MUL)); checksum = mix64(h ^ lanes)
        z = _mix64((sub * 0x9E3779B97F4A7C15) ^ (words.to(tl.uint64) * 0xC2B2AE3D27D4EB4F))
        z = _mix64(ident ^ z)
        checksum = _mix64(z ^ ((lane_b << 32) | lane_a)).to(tl.int64, bitcast=True)
        row = tab_ptr + fhost_id * tab_row + fregion * (1 + blocks_per_host_block)
        if STORE:
            tl.store(row + 1 + fpos % blocks_per_host_block, checksum, mask=flive)
            tl.store(row + 0 * fblk, mark + 0 * fblk, mask=flive)  # the same value from each block of a row
        else:
            present = tl.load(row + 0 * fblk, mask=flive, other=0) == mark
            expected = tl.load(row + 1 + fpos % blocks_per_host_block, mask=flive, other=0)
            status = tl.where(present, tl.where(expected == checksum, 0, 1), 2).to(tl.int64)
            tl.store(res_ptr + 2 + fblk, status, mask=flive)
            n_fail += tl.where(flive & (status == 1), 1, 0)
            n_absent += tl.where(flive & (status == 2), 1, 0)
    return tl.reduce(n_fail, 0, _SUM), tl.reduce(n_absent, 0, _SUM)


def _last_to_add_fn(counts_ptr, blk, lo, hi, span, per_block, count):
    """Whether this program, whose items are ``lo .. hi - 1`` of programs of ``span`` items each, finalises block
    ``blk`` (items ``blk * per_block ..``): it does where it holds all of the block's items, and where it shares them,
    if it is the last of the block's programs to count itself in its counter (an acquire-release atomic at GPU scope,
    after the barrier that follows every thread's sums: so the last sees every program's sums). ``count`` False:
    counts nothing (the block was counted by this program already)."""
    b_lo = blk * per_block
    b_hi = b_lo + per_block
    shared = (b_lo < lo) | (b_hi > hi)
    before = tl.full([], -1, tl.int64)
    if shared & count:
        before = tl.atomic_add(counts_ptr + blk, 1, sem="acq_rel", scope="gpu")
    sharers = (b_hi - 1) // span - b_lo // span + 1  # the programs whose items meet the block's
    return (~shared) | (before == sharers - 1)


def _finish_program_fn(
    ids_ptr, ck_ptr, ident_ptr, sums_ptr, res_ptr, tab_ptr, tab_row, mark, n_blocks, n_host, n_segs, skip,
    blocks_per_host_block, lo, span, per_block, STORE: tl.constexpr, MULTI_GROUP: tl.constexpr, STEP: tl.constexpr,
):  # fmt: skip
    """A program's end of the integrity checks, once it has added its sums (relaxed atomics, any order): it walked
    items ``lo .. lo + span - 1`` (contiguous; a block's are ``per_block`` items) and finalises the blocks whose items
    it holds all of, and the shared ones (at most its first and last) it is the last to count itself into
    (:func:`_last_to_add`): every program finalises its share, at the same time. A load's last program to count
    itself done (acquire-release, GPU scope) writes the launch's numbers of failed and absent blocks, which the
    programs add up in device memory. The id buffer's sums part: two lane sums per block, a counter per block, the
    programs-done counter, the two numbers (kernels/packing.py)."""
    tl.debug_barrier()  # every thread's sums added before the program counts itself in or reads them back
    n_items = n_blocks * per_block
    hi = tl.minimum(lo + span, n_items)
    n_fail = tl.full([], 0, tl.int64)
    n_absent = tl.full([], 0, tl.int64)
    if lo < hi:  # a program past the last item holds no block
        first = lo // per_block
        last = (hi - 1) // per_block
        counts = sums_ptr + 2 * n_blocks
        first_ok = _last_to_add(counts, first, lo, hi, span, per_block, True)
        last_ok = _last_to_add(counts, last, lo, hi, span, per_block, last != first)
        last_ok = tl.where(last == first, first_ok, last_ok)
        n_fail, n_absent = _finalize_checksums(ids_ptr, ck_ptr, ident_ptr, sums_ptr, res_ptr, tab_ptr, tab_row, mark,
                                               n_blocks, n_host, n_segs, skip, blocks_per_host_block, first, last,
                                               first_ok, last_ok, STORE, MULTI_GROUP, STEP)  # fmt: skip
    if not STORE:
        totals = sums_ptr + 3 * n_blocks + 1
        tl.atomic_add(totals, n_fail, sem="relaxed", scope="gpu")
        tl.atomic_add(totals + 1, n_absent, sem="relaxed", scope="gpu")
        tl.debug_barrier()
        done = tl.atomic_add(sums_ptr + 3 * n_blocks, 1, sem="acq_rel", scope="gpu")  # the programs-done counter
        if done == tl.num_programs(0) - 1:
            tl.store(res_ptr, tl.atomic_add(totals, 0, sem="acq_rel", scope="gpu"))
            tl.store(res_ptr + 1, tl.atomic_add(totals + 1, 0, sem="acq_rel", scope="gpu"))


_first_of_groups = JITFunction(_first_of_groups_fn)
_index_terms = JITFunction(_index_terms_fn)
_lane_step = JITFunction(_lane_step_fn)
_group_terms = JITFunction(_group_terms_fn)
_next_step = JITFunction(_next_step_fn)
_mix64 = JITFunction(_mix64_fn)
_finalize_checksums = JITFunction(_finalize_checksums_fn)
_last_to_add = JITFunction(_last_to_add_fn)
_finish_program = JITFunction(_finish_program_fn)
# The helpers' plain functions by the names the kernel (and each other) call them, for the interpreted kernel.
HELPERS = {
    "_first_of_groups": _first_of_groups_fn,
    "_index_terms": _index_terms_fn,
    "_lane_step": _lane_step_fn,
    "_group_terms": _group_terms_fn,
    "_next_step": _next_step_fn,
    "_mix64": _mix64_fn,
    "_finalize_checksums": _finalize_checksums_fn,
    "_last_to_add": _last_to_add_fn,
    "_finish_program": _finish_program_fn,
}


# ---------------------------------------------------------------------------------------------------------------
# The FP8 kernel's terms: groups of one word (G = 1) of W bytes, W <= 4 (triton_offload/integrity.py, version 3)
# ---------------------------------------------------------------------------------------------------------------


def _word_terms_fn(w, index, live):
    """The two 32-bit lane terms of one-word groups: words ``w`` (uint32) at word ``index`` (uint32) of their
    block's stream, 0 where not ``live`` (any shapes that broadcast, scalars too)."""
    a, b = _group_terms(w.to(tl.uint64) * 0x9E3779B1, index * 0x165667B1)  # a 32 x 32 -> 64-bit product
    return tl.where(live, a, 0), tl.where(live, b, 0)


def _byte_words_fn(codes, TOK: tl.constexpr, DIM: tl.constexpr, W: tl.constexpr):
    """[TOK, DIM] bytes (int32 in [0, 255]) as [TOK, DIM // W] little-endian words of W bytes (uint32): a thread's
    consecutive bytes, so no exchange between threads where it holds W or more."""
    if W == 1:
        return codes.to(tl.uint32)
    shift = (tl.arange(0, W) * 8).to(tl.uint32)
    parts = tl.reshape(codes.to(tl.uint32), [TOK, DIM // W, W]) << shift[None, None, :]
    return tl.reduce(parts, 2, _SUM)  # disjoint bits: the sum is the bytes side by side


def _scale_terms_fn(bits, index, live, W: tl.constexpr):
    """The lane terms of one fp32 scale (``bits``, its uint32 bits; word ``index`` of the stream): one word at W = 4,
    two or four at W = 2 or 1, each its own group. Scalars only: no tensor, so no exchange between threads."""
    if W == 4:
        a, b = _word_terms(bits, index, live)
    elif W == 2:
        a, b = _word_terms(bits & 0xFFFF, index, live)
        a1, b1 = _word_terms(bits >> 16, index + 1, live)
        a, b = a + a1, b + b1
    else:
        a, b = _word_terms(bits & 0xFF, index, live)
        for v in tl.static_range(1, 4):
            av, bv = _word_terms((bits >> (8 * v)) & 0xFF, index + v, live)
            a, b = a + av, b + bv
    return a, b


_word_terms = JITFunction(_word_terms_fn)
_byte_words = JITFunction(_byte_words_fn)
_scale_terms = JITFunction(_scale_terms_fn)
HELPERS.update({"_word_terms": _word_terms_fn, "_byte_words": _byte_words_fn, "_scale_terms": _scale_terms_fn})


def interpreted_helpers() -> dict:
    """The helpers' plain functions by the names the kernels call them, each seeing the others' and the sum's combine
    function as the interpreter can call them (it unwraps a kernel's constexpr globals itself, not those of the
    helpers it calls): the globals an interpreted kernel takes."""
    from triton_offload.kernels._triton_compat import INTERPRETED_SUM_COMBINE, interpreted_copy

    plain: dict = {"_SUM": INTERPRETED_SUM_COMBINE, "FIN": FIN.value}
    plain.update({name: interpreted_copy(fn, **plain) for name, fn in HELPERS.items()})
    for _ in range(2):  # more passes: each helper's copy sees the others' copies, two calls deep
        for name, fn in HELPERS.items():
            plain[name] = interpreted_copy(fn, **plain)
    return plain


def _head_terms_fn(acc_a, acc_b, codes, k, word0, ts_w, tokens, head_dim, TOK: tl.constexpr, DIM: tl.constexpr,
                   W: tl.constexpr):  # fmt: skip
    """``acc_a``, ``acc_b`` ([TOK, DIM // W] uint32) plus the terms of one step over a head's FP8 bytes: ``codes``
    [TOK, DIM] (int32 bytes) of the head's tokens ``k * TOK ..``, whose word 0 is word ``word0`` of the block's stream
    and whose tokens are ``ts_w`` words apart; only the ``tokens`` x ``head_dim`` bytes stored count."""
    tok = (k * TOK + tl.arange(0, TOK)).to(tl.int32)[:, None]
    col = tl.arange(0, DIM // W)[None, :]
    index = word0 + tok.to(tl.uint32) * ts_w + col.to(tl.uint32)
    a, b = _word_terms(_byte_words(codes, TOK, DIM, W), index, (tok < tokens) & (col * W < head_dim))
    return acc_a + a, acc_b + b


def _flush_block_fn(sums_ptr, acc_a, acc_b, sc_a, sc_b, blk, next_blk, last, n_blocks, TOK: tl.constexpr,
                    DIM: tl.constexpr, VEC: tl.constexpr, W: tl.constexpr):  # fmt: skip
    """Adds a program's sums of block ``blk`` (``acc_*`` per thread, ``sc_*`` its scales') to the block's two cells
    once the program's next item is another block's or it has none (``last``), and returns them zeroed then. Each
    thread first adds its own words (a step's VEC bytes of a row: one access); the row's threads then add theirs
    within their warp where a row's accesses fit in one (DIM // VEC <= 32), a relaxed atomic per row and lane, else
    each thread adds its own: no exchange between warps, so no barrier."""
    flush = (next_blk != blk) | last
    g: tl.constexpr = VEC if VEC > W else W
    own_a = tl.reduce(tl.reshape(acc_a, [TOK, DIM // g, g // W]), 2, _SUM)  # [TOK, DIM // g]: a thread's own
    own_b = tl.reduce(tl.reshape(acc_b, [TOK, DIM // g, g // W]), 2, _SUM)
    row = tl.arange(0, TOK)[:, None]
    grp = tl.arange(0, DIM // g)[None, :]
    ok = (row * 0 + grp * 0 + tl.where(flush & (blk < n_blocks), 1, 0)) != 0  # a tensor: scalar masks do not interpret
    if DIM // g <= 32:
        part_a = tl.reduce(own_a, 1, _SUM) + tl.where(tl.arange(0, TOK) == 0, sc_a, 0)
        part_b = tl.reduce(own_b, 1, _SUM) + tl.where(tl.arange(0, TOK) == 0, sc_b, 0)
        part_a, part_b = part_a.to(tl.int64)[:, None], part_b.to(tl.int64)[:, None]
        ok = ok & (grp == 0)  # first column only, as the copy kernel adds its rows' sums
    else:
        first = (row == 0) & (grp == 0)
        part_a = (own_a + tl.where(first, sc_a, 0)).to(tl.int64)
        part_b = (own_b + tl.where(first, sc_b, 0)).to(tl.int64)
    # Pointers contiguous along the columns and only 1-aligned (odd), as the copy kernel's: the atomics stay in the
    # sums' own layout, with no move through shared memory.
    odd = (2 * blk + 1) + grp + 0 * row
    tl.atomic_add(sums_ptr + odd - 1, part_a, mask=ok, sem="relaxed", scope="gpu")
    tl.atomic_add(sums_ptr + odd, part_b, mask=ok, sem="relaxed", scope="gpu")
    keep = tl.where(flush, 0, 1).to(tl.uint32)
    return acc_a * keep, acc_b * keep, sc_a * keep, sc_b * keep


_head_terms = JITFunction(_head_terms_fn)
_flush_block = JITFunction(_flush_block_fn)
HELPERS.update({"_head_terms": _head_terms_fn, "_flush_block": _flush_block_fn})
