"""The serving loop's FP8 host format (``triton_fp8``): a :class:`~bench.serving.loop.Setup` over the same GPU caches,
model and rings whose target is a spec with ``host_format="fp8_e4m3"`` and a host cache of its own, sized for the FP8
rows (:func:`fp8_setup`). Its cached prefixes are valid FP8 rows: random finite bf16 KV stored once through the
library's FP8 engine, which must write exactly :class:`Fp8Rows`' reference bytes (else the set-up fails). The checks
keep their meaning, byte for byte: a store must write the reference quantization of its GPU blocks (``store_rows``),
a load must restore the reference dequantization of its prefix (the prefixes' expected GPU bytes). The reference is
bench/accuracy/fp8_codec.py's whole-tensor PyTorch codec (docs/design.md, "The FP8 host format"), run on the device.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

import triton_offload as to
from bench.accuracy.fp8_codec import dequantize, quantize
from bench.common.case import OffloadTarget
from bench.common.verify import SENTINEL
from bench.serving.check import pages_per_block, row_sums
from bench.serving.config import PREFIXES
from triton_offload.engine import TransferEngine
from triton_offload.host.cache import HostCache
from triton_offload.host_format import FP8_E4M3
from triton_offload.layouts import resolve_layout

__all__ = ["Fp8Rows", "fp8_setup"]


class Fp8Rows:
    """The reference FP8 host rows of a spec's GPU blocks, and their restored values, computed on the device.

    Args:
        spec: a spec with ``host_format="fp8_e4m3"`` over bf16 / fp16 K/V caches whose blocks are (tokens, heads,
            head_dim) in memory order (the serving loop's caches), one group, one host region.
    """

    def __init__(self, spec: to.KVCacheSpec):
        kv_dim = resolve_layout(spec.layout).dims.kv_dim
        if spec.quant is None or kv_dim is None or spec.num_groups != 1 or spec.num_regions != 1:
            raise ValueError(f"the serving loop's FP8 rows need one group of quantized K/V layers, got {spec!r}")
        self.spec, self.row_bytes = spec, spec.host_block_bytes(1)
        self.runs = []  # (host offset, geometry, (blocks, tokens, heads, head_dim) view), in packed order
        for s, half in zip(spec.segments, [h for _ in spec.kv_caches for h in (0, 1)]):
            r, view = spec.quant[s.layer], spec.kv_caches[s.layer].select(kv_dim, half)
            if (r.token_stride, r.head_stride) != (r.heads * r.head_dim, r.head_dim):
                raise ValueError(f"layer {s.layer}: the serving loop's FP8 rows need (tokens, heads, head_dim) blocks")
            self.runs.append((s.host_offset, r, view))

    def _ids(self, gpu_ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(gpu_ids, dtype=np.int64)).to(self.spec.device)

    def rows(self, gpu_ids: np.ndarray) -> torch.Tensor:
        """(n, row bytes) uint8 on the device: the host rows a store of ``gpu_ids`` writes (values, then scales; the
        16-byte padding, which no store writes, holds the sentinel)."""
        g = self._ids(gpu_ids)
        out = torch.full((g.numel(), self.row_bytes), SENTINEL, dtype=torch.uint8, device=self.spec.device)
        for at, r, view in self.runs:
            codes, scales = quantize(view[g])
            n_values = r.tokens * r.heads * r.head_dim
            out[:, at : at + n_values] = codes.reshape(g.numel(), n_values)
            out[:, at + r.value_bytes : at + r.value_bytes + 4 * r.heads] = scales.contiguous().view(torch.uint8)
        return out

    def restored(self, gpu_ids: np.ndarray) -> torch.Tensor:
        """(n, bytes_per_block) uint8 on the device: the packed GPU bytes a load of those rows writes back (the
        reference dequantization of their quantization)."""
        g = self._ids(gpu_ids)
        parts = []
        for _, _, view in self.runs:
            codes, scales = quantize(view[g])
            parts.append(dequantize(codes, scales, view.dtype).reshape(g.numel(), -1).view(torch.uint8))
        return torch.cat(parts, dim=1)


def _fill_random(spec: to.KVCacheSpec, gpu_ids: np.ndarray, gen: torch.Generator) -> None:
    """Random finite values into the GPU blocks ``gpu_ids`` of every layer: normal, each token of each head times a
    power of two from 2**-4 to 2**4, so a head's scale is set by a few of its tokens and the others use fewer bits."""
    block_dim = resolve_layout(spec.layout).dims.block_dim
    g = torch.from_numpy(gpu_ids).to(spec.device)
    for t in spec.kv_caches:
        blocks = t.index_select(block_dim, g)
        x = torch.randn(blocks.shape, generator=gen, device=spec.device) * 2.0 ** torch.randint(
            -4, 5, blocks.shape[:-1] + (1,), generator=gen, device=spec.device
        )
        t.index_copy_(block_dim, g, x.to(t.dtype))


def fp8_setup(setup):
    """``setup`` (a :class:`~bench.serving.loop.Setup`) with the FP8 host format: the same GPU caches, model and
    rings, a spec over them with ``host_format="fp8_e4m3"``, its own host cache of ``sizes.host_blocks`` FP8 rows, and
    its cached prefixes stored once by the library's FP8 engine (path ``kernel``) from random GPU blocks (the first
    load region's: every run resets it), each checked against :class:`Fp8Rows`' reference bytes.

    Raises:
        RuntimeError: the library's stored rows differ from the reference's (nothing could be checked).
    """
    sizes, base = setup.sizes, setup.spec
    spec = to.KVCacheSpec(base.kv_caches, base.layout, host_format=FP8_E4M3)
    ref = Fp8Rows(spec)
    cuda = spec.device.type == "cuda"
    cache = HostCache(spec.host_block_bytes(1), num_blocks=sizes.host_blocks, pin=cuda)
    cache.buffer.fill_(SENTINEL)
    engine = TransferEngine(spec, cache.buffer, path="kernel")
    gen = torch.Generator(device=spec.device).manual_seed(setup.seed + 2)
    region = np.arange(sizes.gpu_ring, sizes.gpu_ring + sizes.prefix_blocks, dtype=np.int64)
    restored = []
    try:
        for p in range(PREFIXES):
            host_ids = sizes.host_ring + p * sizes.prefix_blocks + np.arange(sizes.prefix_blocks, dtype=np.int64)
            _fill_random(spec, region, gen)
            engine.submit_store(p, region, host_ids)
            engine.wait([p])
            failed = [r.error for r in engine.get_finished() if not r.ok]
            if failed:
                raise RuntimeError(f"the FP8 prefixes' store failed: {failed[0]}")
            got = cache.buffer[torch.from_numpy(host_ids)].to(spec.device)
            if not torch.equal(got, ref.rows(region)):
                raise RuntimeError(f"prefix {p}: the library's FP8 rows differ from the reference's in "
                                   f"{int((got != ref.rows(region)).sum())} bytes")  # fmt: skip
            restored.append(ref.restored(region))
    except BaseException:
        cache.close()
        raise
    finally:
        engine.shutdown()
    prefix_dev = torch.cat(restored)
    prefixes = cache.buffer[sizes.host_ring :]
    pages = pages_per_block(spec.bytes_per_block, spec.num_layers)
    return dataclasses.replace(
        setup,
        target=OffloadTarget(spec, cache, setup.target.env),
        prefix_sums=prefixes.sum(dim=1, dtype=torch.int64),
        prefix_pages=row_sums(prefix_dev, pages),
        prefix_dev=prefix_dev,
        store_rows=ref.rows,
    )
