"""bench/accuracy/fp8_codec.py, the accuracy harness's vectorised FP8 codec for CPU runs: it must write the same
bytes as the FP8 kernel (under Triton's interpreter) for every layout, the factor with skips, groups, and the format's
edge cases; its cross-check must catch a codec that differs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import triton_offload as to
from bench.accuracy import fp8_codec
from triton_offload.issuers import factory

from kv_factory import host_buffer, random_transfer, sentinel_like

FP8 = "fp8_e4m3"
SHAPES = {
    "kv_first": lambda nb: (2, nb, 3, 2, 6),
    "block_first": lambda nb: (nb, 2, 3, 2, 8),
    "mla": lambda nb: (nb, 3, 10),
}


def caches(layout: str, dtype: torch.dtype, seed: int, layers: int = 2) -> list[torch.Tensor]:
    """Values whose magnitude varies per block by up to 2**+-12, with zeros, NaN, +-Inf, elements far below their
    neighbours (E4M3 subnormals after scaling) and the dtype's largest value."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        x = torch.randn(SHAPES[layout](8), generator=gen, dtype=torch.float64)
        flat = x.view(-1)
        flat.mul_(2.0 ** torch.randint(-12, 13, (), generator=gen))
        flat[:7] = 0.0
        flat[7], flat[8], flat[9] = float("nan"), float("inf"), float("-inf")
        flat[10:20] *= 2.0**-14
        flat[20] = torch.finfo(dtype).max
        out.append(x.to(dtype))
    return out


def moved(layout, dtype, f, skip, codec: bool, monkeypatch, seed=0):
    """(host bytes after a store, caches after a load) of 6 random blocks, by the kernel or by the codec alone."""
    with monkeypatch.context() as m:
        if codec:
            m.setattr(fp8_codec, "CROSS_CHECKS", 0)
            m.setattr(factory, "Fp8Launcher", fp8_codec.TorchFp8Launcher)
        rng = np.random.default_rng(seed)
        kv = caches(layout, dtype, seed)
        spec = to.KVCacheSpec(kv, layout, host_format=FP8)
        num_host = (skip + 6) // f + 2
        g, h = random_transfer(rng, spec.num_blocks, num_host, 6, f, skip)
        host = host_buffer(spec, num_host, f)
        to.gather_blocks(spec, g, host, h, blocks_per_host_block=f, skip=skip)
        out = [sentinel_like(t) for t in kv]
        to.scatter_blocks(host, h, out, g, layout=layout, blocks_per_host_block=f, skip=skip, host_format=FP8)
    return host, out


@pytest.mark.parametrize("layout", list(SHAPES))
@pytest.mark.parametrize("dtype,f,skip", [(torch.bfloat16, 1, 0), (torch.float16, 3, 2)], ids=["bf16-f1", "fp16-f3"])
def test_the_codec_writes_the_kernels_bytes(layout, dtype, f, skip, monkeypatch):
    host_k, out_k = moved(layout, dtype, f, skip, False, monkeypatch)
    host_c, out_c = moved(layout, dtype, f, skip, True, monkeypatch)
    assert torch.equal(host_k, host_c), f"{int((host_k != host_c).sum())} host bytes differ"
    for a, b in zip(out_k, out_c):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "restored caches differ"


def test_groups_with_their_own_skips(monkeypatch):
    """Two KV-cache groups of different heads, each at its own skip in its own host blocks, both ways."""
    gen = torch.Generator().manual_seed(5)
    kv = [torch.randn(8, 2, 2, h, 8, generator=gen).to(torch.float16) for h in (2, 2, 1)]
    results = []
    for codec in (False, True):
        with monkeypatch.context() as m:
            if codec:
                m.setattr(fp8_codec, "CROSS_CHECKS", 0)
                m.setattr(factory, "Fp8Launcher", fp8_codec.TorchFp8Launcher)
            spec = to.KVCacheSpec(kv, "block_first", groups=[[0, 1], [2]], host_format=FP8)
            host = host_buffer(spec, 6, 2)
            transfer = dict(blocks_per_host_block=2, skip=[1, 0], group_sizes=[3, 2])
            to.gather_blocks(spec, [3, 5, 0, 7, 2], host, [4, 1, 2], **transfer)
            out = [sentinel_like(t) for t in kv]
            spec_out = to.KVCacheSpec(out, "block_first", groups=[[0, 1], [2]], host_format=FP8)
            to.scatter_blocks(host, [4, 1, 2], spec_out, [3, 5, 0, 7, 2], **transfer)
            results.append((host, out))
    (host_k, out_k), (host_c, out_c) = results
    assert torch.equal(host_k, host_c)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(out_k, out_c))


def test_the_cross_check_fails_a_codec_that_differs(monkeypatch):
    """The first launches run the kernel too: a codec writing other bytes stops the run."""
    monkeypatch.setattr(fp8_codec, "_checked", {d: 0 for d in fp8_codec._checked})
    monkeypatch.setattr(factory, "Fp8Launcher", fp8_codec.TorchFp8Launcher)
    real = fp8_codec.quantize
    monkeypatch.setattr(fp8_codec, "quantize", lambda x: (real(x)[0] ^ 1, real(x)[1]))
    kv = caches("block_first", torch.bfloat16, 1)
    spec = to.KVCacheSpec(kv, "block_first", host_format=FP8)
    with pytest.raises(RuntimeError, match="different bytes"):
        to.gather_blocks(spec, [1, 2], host_buffer(spec, 3, 1), [0, 2])
    monkeypatch.setattr(fp8_codec, "quantize", real)
    to.gather_blocks(spec, [1, 2], host_buffer(spec, 3, 1), [0, 2])
    assert fp8_codec.cross_checked()["store"] == 1
