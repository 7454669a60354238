"""The FP8 host format's kernel and its thin launch: one Triton kernel quantizes bf16 / fp16 KV blocks of all layers
into packed host rows of FP8 E4M3 values and per-head fp32 scales (a store) or restores them (a load), in one launch
as the copy kernel does (:mod:`.copy_blocks`, whose position rule and id buffer it shares). A work item is one head of
one run (layer, K/V half) of one GPU block: its scale needs the head's absolute maximum before any value is written,
so a store reads the head twice (the second read mostly from L2). Rounding and conversions are integer bit operations,
identical compiled and interpreted (Triton's interpreter rounds its FP8 and bf16 casts otherwise than the hardware);
docs/design.md ("The FP8 host format") states the numerics, :mod:`.reference_fp8` is their plain-PyTorch reference.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from triton_offload.kernels._triton_compat import interpreted_copy
from triton_offload.kernels.copy_blocks import NO_INTEGRITY
from triton_offload.kernels.integrity_parts import (
    _finish_program,
    _flush_block,
    _head_terms,
    _scale_terms,
    interpreted_helpers,
)
from triton_offload.layouts import KVCacheSpec
from triton_offload.plan import TransferPlan

__all__ = [
    "fp8_vec", "fp8_config", "build_fp8_table", "fp8_word_bytes", "fp8_stream_bytes", "fp8_arguments", "fp8_launch",
]  # fmt: skip

# Elements one program holds per step (a head's tokens x head_dim, padded to powers of two), and its warps: at most
# MAX_WARPS, fewer for small heads, so a thread holds 16 elements (32 bytes of bf16 read or written, 16 bytes of FP8
# on the wire) where the head allows it. Not yet tuned on a GPU (issue 63's GPU stage).
TILE_ELEMS = 4096
MAX_WARPS = 4
# Programs per launch: a program moves one head per step (8 KiB of bf16 at 16 tokens x 128), much less in flight
# than the copy kernel's 64 KiB tiles, so more programs than its 4. Unmeasured.
DEFAULT_PROGRAMS = 16
_N_COLS = 10  # the table's columns (build_fp8_table)
_COLS = tl.constexpr(_N_COLS)


def _max_combine_fn(a, b):
    return tl.maximum(a, b)


def _encode_e4m3_fn(y):
    """FP8 E4M3 (fn) bytes of fp32 ``y`` whose finite values are at most 448 in magnitude, rounded to nearest even;
    NaN and Inf give 0x7F (E4M3 has no Inf). As int32 in [0, 255]."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal E4M3 (|y| >= 2**-6): keep 3 mantissa bits, ties to even, then rebias the exponent (127 -> 7).
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal E4M3 (multiples of 2**-9): an fp32 add at 2**14, whose ulp is 2**-9, rounds to nearest even.
    sub = ((mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True)) - 0x46800000
    code = tl.where(mag < 0x3C800000, sub, normal) | sign
    return tl.where(mag < 0x7F800000, code, 0x7F)


def _decode_e4m3_fn(code):
    """fp32 values of E4M3 (fn) bytes ``code`` (int32 in [0, 255]): exact; 0x7F and 0xFF are NaN."""
    mag = code & 0x7F
    normal = ((mag + (120 << 3)) << 20).to(tl.float32, bitcast=True)
    sub = mag.to(tl.float32) * 0.001953125  # 2**-9: exact
    bits = tl.where(mag >= 8, normal, sub).to(tl.int32, bitcast=True) | ((code & 0x80) << 24)
    return tl.where(mag == 0x7F, float("nan"), bits.to(tl.float32, bitcast=True))


def _widen_fn(x, BF16: tl.constexpr):
    """fp32 of bf16 / fp16 ``x``, exactly: bf16 by its bits (Triton's interpreter widens bf16 subnormals wrongly)."""
    if BF16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


def _to_bf16_fn(v):
    """bf16 of fp32 ``v`` rounded to nearest even (NaN stays NaN: its payload's top bits are set)."""
    bits = v.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(v != v, bits >> 16, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


def _restore_fn(anchor_ptr, host_ptr, gpu_off, host_off, scale, tokens, head_dim, token_stride, n_tchunks,
                acc_a, acc_b, word0, ts_w, TOK: tl.constexpr, DIM: tl.constexpr, BF16: tl.constexpr,
                INTEGRITY: tl.constexpr, W: tl.constexpr):  # fmt: skip
    """Restores one head in fp32: decode, times the scale, clamped to the cache dtype's finite range, converted.
    With the checks, adds the lane terms of the bytes read to ``acc_a``, ``acc_b`` (:func:`_head_terms`)."""
    toks = tl.arange(0, TOK)[:, None]
    dims = tl.arange(0, DIM)[None, :]
    for k in range(0, n_tchunks):
        el = (k * TOK + toks) * token_stride + dims
        m = ((k * TOK + toks) < tokens) & (dims < head_dim)
        code = tl.load(host_ptr + host_off + el, mask=m, other=0).to(tl.int32)
        v = _decode_e4m3(code) * scale
        limit = 3.3895313892515355e38 if BF16 else 65504.0  # the cache dtype's largest finite value
        v = tl.where(v > limit, limit, tl.where(v < -limit, -limit, v))  # NaN passes (compares false)
        tl.store(anchor_ptr + gpu_off + el, _to_bf16(v) if BF16 else v.to(tl.float16), mask=m)
        if INTEGRITY:
            acc_a, acc_b = _head_terms(acc_a, acc_b, code, k, word0, ts_w, tokens, head_dim, TOK, DIM, W)
    return acc_a, acc_b


def _load_head_fn(anchor_ptr, host_ptr, gpu_off, host_off, scale, tokens, head_dim, token_stride, n_tchunks,
                  acc_a, acc_b, word0, ts_w, TOK: tl.constexpr, DIM: tl.constexpr, BF16: tl.constexpr,
                  INTEGRITY: tl.constexpr, W: tl.constexpr):  # fmt: skip
    """Restores one head. A bf16 head whose scale 2**e keeps every value a normal bf16 (-110 <= e <= 119: all but
    extreme heads) takes integer arithmetic: a normal code's bf16 bits are the code's with e added to its exponent,
    a subnormal code's an exact fp32 product; the same values as the fp32 path, in about half the instructions.
    Returns ``acc_a``, ``acc_b`` with the checks' terms of the bytes read (as :func:`_restore`)."""
    e = (scale.to(tl.int32, bitcast=True) >> 23) - 127
    if BF16:
        if (e >= -110) & (e <= 119):
            toks = tl.arange(0, TOK)[:, None]
            dims = tl.arange(0, DIM)[None, :]
            bias = (120 + e) * 8  # E4M3's exponent bias 7 -> bf16's 127, plus e
            sub_scale = ((e - 9 + 127) << 23).to(tl.float32, bitcast=True)  # a subnormal code m is m * 2**-9
            for k in range(0, n_tchunks):
                el = (k * TOK + toks) * token_stride + dims
                m = ((k * TOK + toks) < tokens) & (dims < head_dim)
                code = tl.load(host_ptr + host_off + el, mask=m, other=0).to(tl.int32)
                mag = code & 0x7F
                sub = (mag.to(tl.float32) * sub_scale).to(tl.int32, bitcast=True) >> 16
                bits = tl.where(mag >= 8, (mag + bias) << 4, sub) | ((code & 0x80) << 8)
                bits = tl.where(mag == 0x7F, 0x7FC0, bits)
                tl.store(anchor_ptr + gpu_off + el, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=m)
                if INTEGRITY:
                    acc_a, acc_b = _head_terms(acc_a, acc_b, code, k, word0, ts_w, tokens, head_dim, TOK, DIM, W)
        else:
            acc_a, acc_b = _restore(anchor_ptr, host_ptr, gpu_off, host_off, scale, tokens, head_dim, token_stride,
                                    n_tchunks, acc_a, acc_b, word0, ts_w, TOK, DIM, BF16, INTEGRITY, W)  # fmt: skip
    else:
        acc_a, acc_b = _restore(anchor_ptr, host_ptr, gpu_off, host_off, scale, tokens, head_dim, token_stride,
                                n_tchunks, acc_a, acc_b, word0, ts_w, TOK, DIM, BF16, INTEGRITY, W)  # fmt: skip
    return acc_a, acc_b


def _store_head_fn(anchor_ptr, host_ptr, scale_ptr, gpu_off, host_off, scale_at, live, toks, dims, tokens, head_dim,
                   token_stride, n_tchunks, acc_a, acc_b, word0, ts_w, TOK: tl.constexpr, DIM: tl.constexpr,
                   BF16: tl.constexpr, INTEGRITY: tl.constexpr, W: tl.constexpr):  # fmt: skip
    """Stores one head: its largest finite magnitude (NaN and Inf do not count: they would void the scale), a
    power-of-two scale, the smallest with amax / scale <= 448 (scaling is then exact both ways), and the values.
    Returns ``acc_a``, ``acc_b`` with the checks' terms of the bytes written, and the scale's bits."""
    amax = tl.full([], 0.0, tl.float32)
    for k in range(0, n_tchunks):
        el = (k * TOK + toks) * token_stride + dims
        m = ((k * TOK + toks) < tokens) & (dims < head_dim)
        a = tl.abs(_widen(tl.load(anchor_ptr + gpu_off + el, mask=m, other=0.0), BF16))
        a = tl.where(a <= 3.4028234663852886e38, a, 0.0)
        amax = tl.maximum(amax, tl.reduce(tl.reduce(a, 1, _max_combine), 0, _max_combine))
    bits = amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) - 135 + tl.where((bits & 0x7FFFFF) > 0x600000, 1, 0)
    e = tl.where(amax == 0.0, 0, tl.maximum(e, -126))
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    tl.store(scale_ptr + scale_at, ((e + 127) << 23).to(tl.float32, bitcast=True), mask=live)
    for k in range(0, n_tchunks):
        el = (k * TOK + toks) * token_stride + dims
        m = ((k * TOK + toks) < tokens) & (dims < head_dim)
        x = _widen(tl.load(anchor_ptr + gpu_off + el, mask=m, other=0.0), BF16)
        code = _encode_e4m3(x * inv)
        tl.store(host_ptr + host_off + el, code.to(tl.uint8), mask=m)
        if INTEGRITY:
            acc_a, acc_b = _head_terms(acc_a, acc_b, code, k, word0, ts_w, tokens, head_dim, TOK, DIM, W)
    return acc_a, acc_b, (e + 127) << 23


def _position_fn(ids_ptr, blk, seg, live, n_blocks, n_host, n_segs, skip, f32, MULTI_GROUP: tl.constexpr):
    """(position, index of its host id, run's table row) of segment ``seg`` of block ``blk``: the copy kernel's
    position rule, with each group's first block, skip and first host id from the id buffer (kernels/packing.py)."""
    if MULTI_GROUP:
        group = tl.load(ids_ptr + n_blocks + n_host + blk, mask=live, other=0).to(tl.int32)
        group_row = ids_ptr + 2 * n_blocks + n_host + group * 3
        pos = blk - tl.load(group_row, mask=live, other=0).to(tl.int32)
        pos += tl.load(group_row + 1, mask=live, other=0).to(tl.int32)
        host_idx = tl.load(group_row + 2, mask=live, other=0).to(tl.int32) + pos // f32
        run = group * n_segs.to(tl.int32) + seg
    else:
        pos = blk + skip.to(tl.int32)
        host_idx = pos // f32
        run = seg
    return pos, host_idx, run


def _fp8_blocks_kernel(
    anchor_ptr,  # bf16* / fp16*: the table's own storage; GPU addresses are element offsets from it
    host_ptr,  # uint8*: the packed host buffer (values)
    scale_ptr,  # fp32*: the same buffer (scales)
    table_ptr,  # int64* (groups * n_segs, 10): build_fp8_table
    ids_ptr,  # int64*: the copy kernel's id buffer (kernels/packing.py)
    n_blocks: tl.int64, n_host: tl.int64, n_segs: tl.int64, n_heads: tl.int64, items_per_program: tl.int64,
    skip: tl.int64, blocks_per_host_block: tl.int64, host_row_stride: tl.int64, n_tchunks: tl.int64,
    # The integrity checks, as the copy kernel's (kernels/copy_blocks.py; the table's first column is the run's first
    # word in the block's stream of stored bytes); all None without INTEGRITY, which Triton compiles out.
    ck_ptr, ident_ptr, sums_ptr, res_ptr, tab_ptr, tab_row: tl.int64, mark: tl.int64,
    STORE: tl.constexpr, MULTI_GROUP: tl.constexpr, TOK: tl.constexpr, DIM: tl.constexpr, BF16: tl.constexpr,
    VEC: tl.constexpr,  # every offset, stride and head_dim is a multiple of VEC elements: enables 16-byte accesses
    INTEGRITY: tl.constexpr,  # also checksum the stored bytes of every block (stores: write it; loads: check it)
    W: tl.constexpr,  # the checks' word: bytes, 1, 2 or 4, dividing every head_dim and stride (fp8_word_bytes)
):  # fmt: skip
    """Moves every (GPU block, run, head) item of one transfer; program ``pid`` takes items ``pid, pid + nprog, ...``
    (with the checks, ``pid * items_per_program ..``, contiguous; the copy kernel's position rule: docs/design.md,
    "Block-size factor and skip")."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    toks = tl.arange(0, TOK)[:, None]
    dims = tl.arange(0, DIM)[None, :]
    f32 = blocks_per_host_block.to(tl.int32)
    n_items = (n_blocks * n_segs * n_heads).to(tl.int32)
    if INTEGRITY:  # a program's sums of its current block: per thread, then per scale; added when the block changes
        acc_a = tl.full([TOK, DIM // W], 0, tl.uint32)
        acc_b = tl.full([TOK, DIM // W], 0, tl.uint32)
        sc_a = tl.full([], 0, tl.uint32)
        sc_b = tl.full([], 0, tl.uint32)
    else:
        acc_a, acc_b = tl.full([], 0, tl.uint32), tl.full([], 0, tl.uint32)  # unused: compiled out
    for i in range(0, items_per_program):
        if INTEGRITY:  # contiguous items: a program holds all of most of its blocks' (the copy kernel's tiles)
            item = (pid * items_per_program + i).to(tl.int32)
        else:
            item = (pid + i * nprog).to(tl.int32)
        live = item < n_items
        head = item % n_heads.to(tl.int32)
        blk = item // n_heads.to(tl.int32) // n_segs.to(tl.int32)
        seg = item // n_heads.to(tl.int32) - blk * n_segs.to(tl.int32)
        gpu_id = tl.load(ids_ptr + blk, mask=live, other=0)
        pos, host_idx, run = _position(ids_ptr, blk, seg, live, n_blocks, n_host, n_segs, skip, f32, MULTI_GROUP)
        row = table_ptr + run * _COLS
        host_id = tl.load(ids_ptr + n_blocks + host_idx, mask=live, other=0)
        heads = tl.load(row + 3, mask=live, other=0)
        live = live & (head < heads)  # padding heads and rows move nothing
        tokens = tl.load(row + 2, mask=live, other=0)
        head_dim = tl.multiple_of(tl.load(row + 4, mask=live, other=0).to(tl.int32), VEC)
        token_stride = tl.multiple_of(tl.load(row + 5, mask=live, other=0), VEC)
        in_run = head * tl.load(row + 6, mask=live, other=0)  # the head's first element in the run
        gpu_off = tl.load(row, mask=live, other=0) + gpu_id * tl.load(row + 1, mask=live, other=0) + in_run
        gpu_off = tl.multiple_of(gpu_off, VEC)
        sub = host_id * host_row_stride + (pos % f32).to(tl.int64) * tl.load(row + 7, mask=live, other=0)
        host_off = tl.multiple_of(sub + tl.load(row + 8, mask=live, other=0) + in_run, VEC)
        scale_at = (sub + tl.load(row + 9, mask=live, other=0)) // 4 + head
        word0, ts_w = 0, 0
        if INTEGRITY:  # stream words: the run's values (tokens x heads x head_dim bytes), then its heads' scales
            run_word = tl.load(ck_ptr + run * 3, mask=live, other=0).to(tl.uint32)
            word0 = run_word + (in_run // W).to(tl.uint32)
            ts_w = (token_stride // W).to(tl.uint32)
            scale_word = run_word + ((tokens * heads * head_dim + 4 * head) // W).to(tl.uint32)
        if STORE:
            acc_a, acc_b, scale_bits = _store_head(anchor_ptr, host_ptr, scale_ptr, gpu_off, host_off, scale_at, live,
                                                   toks, dims, tokens, head_dim, token_stride, n_tchunks, acc_a,
                                                   acc_b, word0, ts_w, TOK, DIM, BF16, INTEGRITY, W)  # fmt: skip
        else:
            scale = tl.load(scale_ptr + scale_at, mask=live, other=0.0)
            acc_a, acc_b = _load_head(anchor_ptr, host_ptr, gpu_off, host_off, scale, tokens, head_dim, token_stride,
                                      n_tchunks, acc_a, acc_b, word0, ts_w, TOK, DIM, BF16, INTEGRITY, W)  # fmt: skip
            scale_bits = scale.to(tl.int32, bitcast=True)
        if INTEGRITY:
            s_a, s_b = _scale_terms(scale_bits.to(tl.uint32), scale_word, live, W)
            next_blk = (item + 1) // n_heads.to(tl.int32) // n_segs.to(tl.int32)
            acc_a, acc_b, sc_a, sc_b = _flush_block(sums_ptr, acc_a, acc_b, sc_a + s_a, sc_b + s_b, blk, next_blk,
                                                    i == items_per_program - 1, n_blocks, TOK, DIM, VEC, W)  # fmt: skip
    if INTEGRITY:  # the copy kernel's end; blocks a step: about one a thread (a thread holds 16 elements of a tile)
        _finish_program(ids_ptr, ck_ptr, ident_ptr, sums_ptr, res_ptr, tab_ptr, tab_row, mark, n_blocks, n_host, n_segs,
                        skip, blocks_per_host_block, pid * items_per_program, items_per_program, n_segs * n_heads,
                        STORE, MULTI_GROUP, TOK * DIM // 16 if TOK * DIM > 512 else 32)  # fmt: skip


_max_combine = JITFunction(_max_combine_fn)
_encode_e4m3 = JITFunction(_encode_e4m3_fn)
_decode_e4m3 = JITFunction(_decode_e4m3_fn)
_to_bf16 = JITFunction(_to_bf16_fn)
_widen = JITFunction(_widen_fn)
_restore = JITFunction(_restore_fn)
_load_head = JITFunction(_load_head_fn)
_store_head = JITFunction(_store_head_fn)
_position = JITFunction(_position_fn)
# The helpers' plain functions, for the interpreted kernel (tl.reduce's combine stays a JITFunction: the interpreter
# calls its .fn).
_HELPERS = {
    "_encode_e4m3": _encode_e4m3_fn,
    "_decode_e4m3": _decode_e4m3_fn,
    "_to_bf16": _to_bf16_fn,
    "_widen": _widen_fn,
    "_restore": _restore_fn,
    "_load_head": _load_head_fn,
    "_store_head": _store_head_fn,
    "_position": _position_fn,
}
_NOT_SPECIALIZED = [
    "n_blocks", "n_host", "n_segs", "n_heads", "items_per_program", "skip", "blocks_per_host_block",
    "host_row_stride", "n_tchunks", "tab_row", "mark",
]  # fmt: skip
# As the copy kernel's: the id and table buffers, and the integrity checks' (kernels/copy_blocks.py).
_ALIGNMENT_NOT_SPECIALIZED = ["table_ptr", "ids_ptr", "ck_ptr", "ident_ptr", "sums_ptr", "res_ptr", "tab_ptr"]
_jit_kernel = triton.jit(
    _fp8_blocks_kernel, do_not_specialize=_NOT_SPECIALIZED, do_not_specialize_on_alignment=_ALIGNMENT_NOT_SPECIALIZED
)
_interpreted = None


def _interpreted_kernel():
    """The kernel through Triton's interpreter, for CPU tensors (as :mod:`.copy_blocks` does it)."""
    global _interpreted
    if _interpreted is None:
        from triton.runtime.interpreter import InterpretedFunction

        from triton_offload.kernels._triton_compat import patch_interpreter_scalar_index

        patch_interpreter_scalar_index()
        plain = {"_COLS": _N_COLS, "_max_combine": _max_combine, **interpreted_helpers(), **_HELPERS}
        for _ in range(2):  # twice: a helper's copy sees the others' copies
            plain.update({name: interpreted_copy(fn, **plain) for name, fn in _HELPERS.items()})
        _interpreted = InterpretedFunction(interpreted_copy(_fp8_blocks_kernel, **plain))
    return _interpreted


# ---------------------------------------------------------------------------------------------------------------
# The launch
# ---------------------------------------------------------------------------------------------------------------


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def fp8_vec(spec: KVCacheSpec, host_row: int) -> int:
    """The largest power of two <= 16 dividing every element offset and stride both sides use (the host's bytes are
    the elements' offsets in their run), every head_dim, and the host row stride: 16 gives 16-byte host accesses and
    two 16-byte GPU accesses (bf16) per thread and step. The table's own address is 64-byte aligned."""
    esize = spec.kv_caches[0].element_size()
    values = [host_row]
    for s in spec.segments:
        r = spec.quant[s.layer]
        values += [r.head_dim, r.token_stride, r.head_stride, s.base // esize, s.block_stride // esize]
        values += [s.base % esize, s.block_stride % esize]  # not whole elements: no vector access
    return math.gcd(16, *values) or 16


def fp8_config(spec: KVCacheSpec, host_row: int) -> tuple[int, int, int, int, bool, int, int]:
    """(TOK, DIM, token chunks, heads per run at most, bf16, VEC, warps) for a quantizing spec and a host row
    stride (bytes): a step holds TOK tokens of one head, DIM (the widest head, a power of two) elements each, at most
    TILE_ELEMS in all, 16 per thread where they fill a warp."""
    runs = spec.quant
    dim = _pow2(max(r.head_dim for r in runs))
    tokens = max(r.tokens for r in runs)
    tok = min(_pow2(tokens), max(1, TILE_ELEMS // dim))
    bf16 = spec.kv_caches[0].dtype == torch.bfloat16
    warps = max(1, min(MAX_WARPS, tok * dim // (32 * 16)))
    return tok, dim, triton.cdiv(tokens, tok), max(r.heads for r in runs), bf16, fp8_vec(spec, host_row), warps


def build_fp8_table(spec: KVCacheSpec, blocks_per_host_block: int) -> torch.Tensor:
    """The kernel's int64 table on the spec's device, (groups * segments_per_group, 10): per run, the GPU offset from
    the table's own address and the block stride (elements), tokens, heads, head_dim, token and head strides
    (elements), the host stride between sub-blocks, the host offset of the values and of the scales in a row
    (bytes). Padding rows have no heads. Built synchronously."""
    f = blocks_per_host_block
    esize = spec.kv_caches[0].element_size()
    rows = []
    for segs in spec.group_segments:
        for s in segs:
            r = spec.quant[s.layer]
            host = f * s.host_region + s.host_offset
            geometry = [r.tokens, r.heads, r.head_dim, r.token_stride, r.head_stride]
            rows.append([s.base, s.block_stride, *geometry, s.host_stride, host, host + r.value_bytes])
        rows += [[spec.segments[0].base, 0, 0, 0, 0, 0, 0, 0, 0, 0]] * (spec.segments_per_group - len(segs))
    table = torch.empty((len(rows), _N_COLS), dtype=torch.int64, device=spec.device)
    values = torch.tensor(rows, dtype=torch.int64)
    values[:, :2] -= torch.tensor([table.data_ptr(), 0])
    values[:, :2] //= esize
    table.copy_(values)
    if spec.device.type == "cuda":
        torch.cuda.current_stream(spec.device).synchronize()
    return table


def fp8_word_bytes(spec: KVCacheSpec) -> int:
    """The integrity checks' word (bytes): the largest of 4, 2, 1 dividing every run's head_dim and strides, so a word
    of the stored values never straddles two heads, and the fp32 scales are whole words."""
    values = [v for r in spec.quant for v in (r.head_dim, r.token_stride, r.head_stride)]
    return math.gcd(4, *values)


def fp8_stream_bytes(run) -> int:
    """The bytes of one run the integrity checks cover: its values and its scales, as stored (not the padding)."""
    return run.tokens * run.heads * run.head_dim + 4 * run.heads


def fp8_arguments(cfg, anchor, host, scales, table, ids, plan: TransferPlan, n_segs, f, host_row, num_ctas,
                  checks=None, word: int = 1):  # fmt: skip
    """(programs, every kernel argument in signature order, constexprs last) of one launch moving ``plan``;
    ``host_row`` is the host buffer's row stride in bytes. With ``checks`` (the copy kernel's
    :class:`~.copy_blocks.IntegrityArgs`; ``word``: :func:`fp8_word_bytes`), the launch also checksums the stored
    bytes of every block; without, the integrity pointers are None, which Triton compiles out
    (:data:`~.copy_blocks.NO_INTEGRITY`)."""
    tok, dim, n_tchunks, heads, bf16, vec, _ = cfg
    n_items = plan.n_blocks * n_segs * heads
    if n_items >= 2**31:  # the kernel counts items in 32 bits
        raise ValueError(f"{plan.n_blocks} blocks x {n_segs} runs x {heads} heads is too many heads for one transfer")
    programs = max(1, min(num_ctas or DEFAULT_PROGRAMS, n_items))
    multi_group = len(plan.sizes) > 1
    args = (
        anchor, host, scales, table, ids, plan.n_blocks, plan.n_host, n_segs, heads, triton.cdiv(n_items, programs),
        0 if multi_group else plan.skips[0], f, host_row, n_tchunks, *(NO_INTEGRITY if checks is None else checks),
        plan.direction == "store", multi_group, tok, dim, bf16, vec, checks is not None, word if checks else 1,
    )  # fmt: skip
    return programs, args


_CONSTEXPRS = ("STORE", "MULTI_GROUP", "TOK", "DIM", "BF16", "VEC", "INTEGRITY", "W")


def fp8_launch(programs: int, args: tuple, num_warps: int, cuda: bool) -> None:
    """One launch through Triton's dispatch, asynchronously on the current stream; on CPU through the interpreter."""
    kernel = _jit_kernel if cuda else _interpreted_kernel()
    n = len(_CONSTEXPRS)
    kernel[(programs,)](*args[:-n], **dict(zip(_CONSTEXPRS, args[-n:])), num_warps=num_warps)
