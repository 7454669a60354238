"""The FP8 kernel without the integrity checks (as at commit bf08ada, kernels/fp8_blocks.py: the kernel and the two
load helpers it changed since): the kernel without checks must compile to the same PTX
(tests/unit/test_kernel_static_fp8.py). A change to the kernel's data path changes both on purpose: update this copy
with it, in the same commit."""

import triton.language as tl
from triton.runtime.jit import JITFunction

from triton_offload.kernels.fp8_blocks import _COLS, _decode_e4m3, _encode_e4m3, _max_combine, _to_bf16, _widen  # noqa


def _restore_fn(anchor_ptr, host_ptr, gpu_off, host_off, scale, tokens, head_dim, token_stride, n_tchunks,
                TOK: tl.constexpr, DIM: tl.constexpr, BF16: tl.constexpr):  # fmt: skip
    """Restores one head in fp32: decode, times the scale, clamped to the cache dtype's finite range, converted."""
    toks = tl.arange(0, TOK)[:, None]
    dims = tl.arange(0, DIM)[None, :]
    for k in range(0, n_tchunks):
        el = (k * TOK + toks) * token_stride + dims
        m = ((k * TOK + toks) < tokens) & (dims < head_dim)
        v = _decode_e4m3(tl.load(host_ptr + host_off + el, mask=m, other=0).to(tl.int32)) * scale
        limit = 3.3895313892515355e38 if BF16 else 65504.0  # the cache dtype's largest finite value
        v = tl.where(v > limit, limit, tl.where(v < -limit, -limit, v))  # NaN passes (compares false)
        tl.store(anchor_ptr + gpu_off + el, _to_bf16(v) if BF16 else v.to(tl.float16), mask=m)


def _load_head_fn(anchor_ptr, host_ptr, gpu_off, host_off, scale, tokens, head_dim, token_stride, n_tchunks,
                  TOK: tl.constexpr, DIM: tl.constexpr, BF16: tl.constexpr):  # fmt: skip
    """Restores one head. A bf16 head whose scale 2**e keeps every value a normal bf16 (-110 <= e <= 119: all but
    extreme heads) takes integer arithmetic: a normal code's bf16 bits are the code's with e added to its exponent,
    a subnormal code's an exact fp32 product; the same values as the fp32 path, in about half the instructions."""
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
        else:
            _restore(anchor_ptr, host_ptr, gpu_off, host_off, scale, tokens, head_dim, token_stride, n_tchunks,
                     TOK, DIM, BF16)  # fmt: skip
    else:
        _restore(anchor_ptr, host_ptr, gpu_off, host_off, scale, tokens, head_dim, token_stride, n_tchunks,
                 TOK, DIM, BF16)  # fmt: skip


def _fp8_blocks_kernel(
    anchor_ptr,  # bf16* / fp16*: the table's own storage; GPU addresses are element offsets from it
    host_ptr,  # uint8*: the packed host buffer (values)
    scale_ptr,  # fp32*: the same buffer (scales)
    table_ptr,  # int64* (groups * n_segs, 10): build_fp8_table
    ids_ptr,  # int64*: the copy kernel's id buffer (kernels/packing.py)
    n_blocks: tl.int64, n_host: tl.int64, n_segs: tl.int64, n_heads: tl.int64, items_per_program: tl.int64,
    skip: tl.int64, blocks_per_host_block: tl.int64, host_row_stride: tl.int64, n_tchunks: tl.int64,
    STORE: tl.constexpr, MULTI_GROUP: tl.constexpr, TOK: tl.constexpr, DIM: tl.constexpr, BF16: tl.constexpr,
    VEC: tl.constexpr,  # every offset, stride and head_dim is a multiple of VEC elements: enables 16-byte accesses
):  # fmt: skip
    """Moves every (GPU block, run, head) item of one transfer; program ``pid`` takes items ``pid, pid + nprog, ...``
    (the copy kernel's position rule: docs/design.md, "Block-size factor and skip")."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    toks = tl.arange(0, TOK)[:, None]
    dims = tl.arange(0, DIM)[None, :]
    f32 = blocks_per_host_block.to(tl.int32)
    n_items = (n_blocks * n_segs * n_heads).to(tl.int32)
    for i in range(0, items_per_program):
        item = (pid + i * nprog).to(tl.int32)
        live = item < n_items
        head = item % n_heads.to(tl.int32)
        blk = item // n_heads.to(tl.int32) // n_segs.to(tl.int32)
        seg = item // n_heads.to(tl.int32) - blk * n_segs.to(tl.int32)
        gpu_id = tl.load(ids_ptr + blk, mask=live, other=0)
        if MULTI_GROUP:
            group = tl.load(ids_ptr + n_blocks + n_host + blk, mask=live, other=0).to(tl.int32)
            group_row = ids_ptr + 2 * n_blocks + n_host + group * 3
            pos = blk - tl.load(group_row, mask=live, other=0).to(tl.int32)
            pos += tl.load(group_row + 1, mask=live, other=0).to(tl.int32)
            host_idx = tl.load(group_row + 2, mask=live, other=0).to(tl.int32) + pos // f32
            row = table_ptr + (group * n_segs.to(tl.int32) + seg) * _COLS
        else:
            pos = blk + skip.to(tl.int32)
            host_idx = pos // f32
            row = table_ptr + seg * _COLS
        host_id = tl.load(ids_ptr + n_blocks + host_idx, mask=live, other=0)
        live = live & (head < tl.load(row + 3, mask=live, other=0))  # padding heads and rows move nothing
        tokens = tl.load(row + 2, mask=live, other=0)
        head_dim = tl.multiple_of(tl.load(row + 4, mask=live, other=0).to(tl.int32), VEC)
        token_stride = tl.multiple_of(tl.load(row + 5, mask=live, other=0), VEC)
        in_run = head * tl.load(row + 6, mask=live, other=0)  # the head's first element in the run
        gpu_off = tl.load(row, mask=live, other=0) + gpu_id * tl.load(row + 1, mask=live, other=0) + in_run
        gpu_off = tl.multiple_of(gpu_off, VEC)
        sub = host_id * host_row_stride + (pos % f32).to(tl.int64) * tl.load(row + 7, mask=live, other=0)
        host_off = tl.multiple_of(sub + tl.load(row + 8, mask=live, other=0) + in_run, VEC)
        scale_at = (sub + tl.load(row + 9, mask=live, other=0)) // 4 + head
        if STORE:
            # The head's largest finite magnitude (NaN and Inf do not count: they would void the scale).
            amax = tl.full([], 0.0, tl.float32)
            for k in range(0, n_tchunks):
                el = (k * TOK + toks) * token_stride + dims
                m = ((k * TOK + toks) < tokens) & (dims < head_dim)
                a = tl.abs(_widen(tl.load(anchor_ptr + gpu_off + el, mask=m, other=0.0), BF16))
                a = tl.where(a <= 3.4028234663852886e38, a, 0.0)
                amax = tl.maximum(amax, tl.reduce(tl.reduce(a, 1, _max_combine), 0, _max_combine))
            # A power-of-two scale, the smallest with amax / scale <= 448: scaling is then exact both ways.
            bits = amax.to(tl.int32, bitcast=True)
            e = (bits >> 23) - 135 + tl.where((bits & 0x7FFFFF) > 0x600000, 1, 0)
            e = tl.where(amax == 0.0, 0, tl.maximum(e, -126))
            inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
            tl.store(scale_ptr + scale_at, ((e + 127) << 23).to(tl.float32, bitcast=True), mask=live)
            for k in range(0, n_tchunks):
                el = (k * TOK + toks) * token_stride + dims
                m = ((k * TOK + toks) < tokens) & (dims < head_dim)
                x = _widen(tl.load(anchor_ptr + gpu_off + el, mask=m, other=0.0), BF16)
                tl.store(host_ptr + host_off + el, _encode_e4m3(x * inv).to(tl.uint8), mask=m)
        else:
            scale = tl.load(scale_ptr + scale_at, mask=live, other=0.0)
            _load_head(anchor_ptr, host_ptr, gpu_off, host_off, scale, tokens, head_dim, token_stride, n_tchunks,
                       TOK, DIM, BF16)  # fmt: skip


_restore = JITFunction(_restore_fn)
_load_head = JITFunction(_load_head_fn)
