"""The host format: what a packed host row holds for each GPU block run. ``"native"`` (the default) is the cache's
own bytes, moved unchanged. ``"fp8_e4m3"`` stores bf16 / fp16 caches as FP8 E4M3 values plus one fp32 scale per
(GPU block, layer, K/V half, KV head) -- per (block, layer) over the latent for MLA: a run's host bytes are its
values, one byte per element in the cache's memory order, padded to 16 bytes, then its heads' scales, padded to 16
bytes, so a sub-block stays one contiguous run. Caches already in an 8-bit format move as bytes whatever the format
says. :func:`quant_runs` derives and checks the per-run geometry the FP8 kernel (``kernels/fp8_blocks.py``) reads;
docs/design.md ("The FP8 host format") gives the numerics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from triton_offload._checks import FORMAT_VERSIONS, HOST_FORMATS, host_format_setting

__all__ = [
    "NATIVE",
    "FP8_E4M3",
    "HOST_FORMATS",
    "FORMAT_VERSIONS",
    "QuantRun",
    "check_host_format",
    "quant_runs",
    "host_run_bytes",
]

NATIVE, FP8_E4M3 = HOST_FORMATS
# Caches the FP8 format quantizes; 8-bit caches (vLLM's kv_cache_dtype="fp8" in any of its views) move as bytes.
QUANTIZABLE = (torch.bfloat16, torch.float16)
ONE_BYTE = (torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
_ALIGN = 16


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class QuantRun:
    """The geometry of one run (a layer's K or V half, or its latent) of one GPU block, in elements.

    Attributes:
        tokens: tokens per block.
        heads: KV heads (1 for MLA: the latent is one head).
        head_dim: elements per head and token (the latent for MLA); contiguous in memory.
        token_stride: elements between tokens.
        head_stride: elements between heads (0 for MLA).
    """

    tokens: int
    heads: int
    head_dim: int
    token_stride: int
    head_stride: int

    @property
    def value_bytes(self) -> int:
        """The run's FP8 values on the host, padded to 16 bytes (its scales follow)."""
        return _align(self.tokens * self.heads * self.head_dim)

    @property
    def host_bytes(self) -> int:
        """The run's host bytes: values, then one fp32 scale per head, each part padded to 16 bytes."""
        return self.value_bytes + _align(4 * self.heads)


def check_host_format(host_format: str) -> str:
    """The format's name; an unknown one raises ValueError listing the supported ones."""
    return host_format_setting(host_format)


def _run_geometry(t: torch.Tensor, i: int, label: str) -> QuantRun:
    """One layer's run geometry: kv layouts (.., block_size, num_kv_heads, head_dim), MLA (.., block_size, latent)."""
    if t.dim() == 5:
        tokens, heads, dim = t.shape[2], t.shape[3], t.shape[4]
        token_stride, head_stride, dim_stride = t.stride(2), t.stride(3), t.stride(4)
    else:
        tokens, heads, dim = t.shape[1], 1, t.shape[2]
        token_stride, head_stride, dim_stride = t.stride(1), 0, t.stride(2)
    if dim_stride != 1 and dim != 1:
        raise ValueError(
            f"layer {i}: host_format {FP8_E4M3!r} needs each head's elements contiguous ({label} head_dim stride 1), "
            f"got strides {t.stride()}"
        )
    return QuantRun(tokens, heads, dim, token_stride, head_stride)


def quant_runs(kv_caches: Sequence[torch.Tensor], label: str, host_format: str) -> list[QuantRun] | None:
    """Per layer, the geometry of its runs (K and V share it) under ``host_format``; None where the bytes move
    unchanged (``"native"``, or a cache already in 8 bits).

    Raises:
        ValueError: the format cannot apply: a dtype other than bf16 / fp16 / 8-bit, layers of different dtypes, or
            a layout whose element dtype and head geometry are unknown (canonical int8 pages).
    """
    check_host_format(host_format)
    if host_format == NATIVE:
        return None
    dtypes = {t.dtype for t in kv_caches}
    if len(dtypes) != 1:
        raise ValueError(f"host_format {host_format!r} needs one dtype for every layer, got {sorted(map(str, dtypes))}")
    (dtype,) = dtypes
    if label == "canonical":
        raise ValueError(
            f"host_format {host_format!r} needs the element dtype and head geometry, which canonical int8 pages do "
            "not carry: give typed per-layer tensors (kv_first, block_first or mla)"
        )
    if dtype in ONE_BYTE:
        return None  # already 8 bits per element: moved as bytes
    if dtype not in QUANTIZABLE:
        raise ValueError(f"host_format {host_format!r} quantizes bf16 or fp16 caches, got {dtype}")
    return [_run_geometry(t, i, label) for i, t in enumerate(kv_caches)]


def host_run_bytes(runs: list[QuantRun] | None, pages: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per layer, the host bytes of each of its runs: the GPU bytes (``pages``) without quantization."""
    if runs is None:
        return [list(p) for p in pages]
    return [[r.host_bytes] * len(p) for r, p in zip(runs, pages)]
