"""Plain-PyTorch reference of the FP8 host format (triton_offload/host_format.py, docs/design.md "The FP8 host
format"), written for clarity: per head, a power-of-two fp32 scale, the smallest with ``amax / scale <= 448`` (amax
over finite elements; 1 for a head with none but zeros), values ``x / scale`` converted by torch's own
``.to(torch.float8_e4m3fn)`` (round to nearest even), NaN and Inf stored as 0x7F; restored as ``code * scale``,
clamped to the cache dtype's finite range, converted by torch. It indexes the layer tensors as a reader thinks of
them and derives the host placement from the shapes alone, so it checks the kernel's arithmetic independently.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from triton_offload.kernels.reference import _ids
from triton_offload.layouts import Layout, resolve_layout

__all__ = [
    "quantize_head", "dequantize_head", "block_bytes_ref", "gather_fp8_ref", "scatter_fp8_ref", "fp8_streams_ref",
]  # fmt: skip

NAN_CODE = 0x7F
FP8_MAX = 448.0


def _align16(n: int) -> int:
    return -(-n // 16) * 16


def head_exponent(amax: float) -> int:
    """The scale's exponent: the smallest e with ``amax <= 448 * 2**e`` (at least -126, so the scale and its inverse
    are normal fp32); 0 when amax is 0."""
    if amax == 0:
        return 0
    e = math.frexp(amax)[1] - 10
    while amax > FP8_MAX * 2.0**e:
        e += 1
    return max(e, -126)


def quantize_head(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(uint8 E4M3 codes of ``x``'s shape, fp32 scale) of one head's elements (bf16 / fp16)."""
    x = x.double()
    finite = torch.isfinite(x)
    amax = float(torch.where(finite, x.abs(), 0).max()) if x.numel() else 0.0
    e = head_exponent(amax)
    y = (x * 2.0**-e).float()  # exact: a power of two
    assert not bool((y[finite].abs() > FP8_MAX).any()), "a power-of-two scale never saturates"
    codes = torch.where(finite, y, 0).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(finite, codes, NAN_CODE).to(torch.uint8), 2.0**e


def dequantize_head(codes: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The cache dtype's values of one head's codes and scale."""
    v = codes.view(torch.float8_e4m3fn).float() * torch.tensor(scale, dtype=torch.float32)
    limit = torch.finfo(dtype).max
    return torch.where(v.isnan(), v, v.clamp(-limit, limit)).to(dtype)


def _parts(t: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """One layer's runs in packed order (K then V, or the latent), block dim first, in their logical dims: (blocks,
    tokens, heads, head_dim) or (blocks, tokens, latent), whatever their order in memory."""
    if layout is Layout.KV_FIRST:
        return [t[0], t[1]]
    if layout is Layout.BLOCK_FIRST:
        return [t[:, 0], t[:, 1]]
    return [t]


def _memory_order(block: torch.Tensor) -> list[int]:
    """A block's dims, outermost in memory first (the order its elements lie in)."""
    return sorted(range(block.dim()), key=lambda d: (-block.stride(d), d))


def _heads(block: torch.Tensor) -> list[torch.Tensor]:
    """A run's heads as views: (tokens, heads, head_dim) -> each (tokens, head_dim); MLA's (tokens, latent) is one."""
    return [block[:, h] for h in range(block.shape[1])] if block.dim() == 3 else [block]


def block_bytes_ref(kv_caches, layout, layers, g: int) -> list[tuple[int, torch.Tensor]]:
    """One GPU block's FP8 sub-block of ``layers`` (in order) as (offset, uint8 bytes) pieces: per run, its codes in
    the run's memory order padded to 16 bytes, then its heads' fp32 scales padded to 16 bytes (the padding is not
    written)."""
    out, at = [], 0
    for i in layers:
        for part in _parts(kv_caches[i], resolve_layout(layout)):
            block = part[g]
            codes = torch.empty(block.shape, dtype=torch.uint8)
            scales = []
            for h, head in enumerate(_heads(block)):
                c, s = quantize_head(head)
                (codes[:, h] if block.dim() == 3 else codes).copy_(c)
                scales.append(s)
            values = codes.permute(_memory_order(block)).flatten()
            out.append((at, values))
            at += _align16(values.numel())
            s = torch.tensor(scales, dtype=torch.float32).view(torch.uint8)
            out.append((at, s))
            at += _align16(s.numel())
    return out


def _restore_block(sub: torch.Tensor, kv_caches, layout: Layout, layers, g: int) -> None:
    """Writes one sub-block's restored values into block ``g`` of ``layers``."""
    at = 0
    for i in layers:
        for part in _parts(kv_caches[i], layout):
            block = part[g]
            n, heads = block.numel(), (block.shape[1] if block.dim() == 3 else 1)
            order = _memory_order(block)
            in_memory = sub[at : at + n].view([block.shape[d] for d in order])
            codes = in_memory.permute([order.index(d) for d in range(block.dim())])  # back to the logical dims
            at += _align16(n)
            scales = sub[at : at + 4 * heads].view(torch.float32)
            at += _align16(4 * heads)
            for h in range(heads):
                dst, c = (block[:, h], codes[:, h]) if block.dim() == 3 else (block, codes)
                dst.copy_(dequantize_head(c, float(scales[h]), block.dtype))


def _positions(gpu_ids, host_ids, f: int, skip: int):
    h = _ids(host_ids)
    return [(int(g), int(h[(skip + i) // f]), (skip + i) % f) for i, g in enumerate(_ids(gpu_ids))]


def _sub_bytes(kv_caches, layout, groups) -> int:
    """A sub-block's host bytes: the largest group's."""
    return max(_align16(sum(_align16(p.numel()) for _, p in block_bytes_ref(kv_caches, layout, layers, 0)))
               for layers in groups)  # fmt: skip


def gather_fp8_ref(kv_caches, layout, gpu_ids, host_buffer, host_ids, *, blocks_per_host_block=1, skip=0, groups=None):
    """Stores blocks into ``host_buffer`` (rows of f sub-blocks of the largest group's FP8 bytes) as the kernel
    should. With ``groups``: (layers, gpu ids, host ids, skip) per group."""
    groups = groups or [(list(range(len(kv_caches))), gpu_ids, host_ids, skip)]
    sub = _sub_bytes(kv_caches, layout, [g[0] for g in groups])
    rows = host_buffer.view(torch.uint8)
    for layers, g_ids, h_ids, s in groups:
        for g, h, j in _positions(g_ids, h_ids, blocks_per_host_block, s):
            for at, piece in block_bytes_ref(kv_caches, layout, layers, g):
                rows[h, j * sub + at : j * sub + at + piece.numel()] = piece


def scatter_fp8_ref(host_buffer, host_ids, kv_caches, layout, gpu_ids, *, blocks_per_host_block=1, skip=0, groups=None):
    """Loads blocks from ``host_buffer`` into ``kv_caches`` as the kernel should (``groups`` as for
    :func:`gather_fp8_ref`)."""
    layout = resolve_layout(layout)
    groups = groups or [(list(range(len(kv_caches))), gpu_ids, host_ids, skip)]
    sub = _sub_bytes(kv_caches, layout, [g[0] for g in groups])
    rows = host_buffer.view(torch.uint8)
    for layers, g_ids, h_ids, s in groups:
        for g, h, j in _positions(g_ids, h_ids, blocks_per_host_block, s):
            _restore_block(rows[h, j * sub : (j + 1) * sub], kv_caches, layout, layers, g)


def fp8_streams_ref(kv_caches, layout, gpu_ids, *, groups=None, group_sizes=None) -> list:
    """Each GPU block's word stream of the integrity checks under the FP8 format: the bytes a store writes for it, its
    group's layers in order, per run its values then its scales (:func:`block_bytes_ref`'s pieces side by side, the
    16-byte padding left out), as a (blocks, bytes) uint8 array per group (ids concatenated group by group): what
    :func:`triton_offload.kernels.reference.checksums_ref` takes as ``streams``."""
    g_all = _ids(gpu_ids)
    groups = [range(len(kv_caches))] if groups is None else groups
    group_sizes = [g_all.numel()] if group_sizes is None else group_sizes
    out, start = [], 0
    for layers, n in zip(groups, group_sizes):
        rows = [torch.cat([p for _, p in block_bytes_ref(kv_caches, layout, list(layers), int(g))])
                for g in g_all[start : start + n]]  # fmt: skip
        out.append(torch.stack(rows).numpy() if rows else np.zeros((0, 0), dtype=np.uint8))
        start += n
    return out
