"""The FP8 host format's compiled kernel on CUDA against kernels/reference_fp8.py, bit for bit (the interpreter tests
check the same code through Triton's interpreter; this checks what sm_90 runs: cvt.f32.bf16, mul.f32 on subnormals,
the integer paths). Run with -m gpu."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import triton_offload as to
from triton_offload.kernels.reference_fp8 import gather_fp8_ref, scatter_fp8_ref

from kv_factory import host_buffer, sentinel_like

pytestmark = pytest.mark.gpu

PAGES = [
    pytest.param("kv_first", (16, 8, 128), 1, 0, id="kv_first-8x128-f1"),
    pytest.param("block_first", (16, 1, 128), 4, 3, id="block_first-1x128-f4-skip3"),
    pytest.param("mla", (64, 576), 2, 1, id="mla-576-f2-skip1"),
]


def caches_with_edges(layout, inner, dtype, num_blocks=80, layers=4, seed=0):
    """Per-head magnitudes over 2**+-40 (bf16) or 2**+-8 (fp16), zero heads, NaN, Inf, subnormal inputs, the dtype's
    largest value."""
    gen = torch.Generator().manual_seed(seed)
    span = 40 if dtype is torch.bfloat16 else 8
    out = []
    for _ in range(layers):
        shape = {"kv_first": (2, num_blocks), "block_first": (num_blocks, 2), "mla": (num_blocks,)}[layout] + inner
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        heads = x.unsqueeze(-2) if layout == "mla" else x
        heads.mul_(2.0 ** torch.randint(-span, span + 1, heads.shape[:-3] + (1, heads.shape[-2], 1), generator=gen))
        flat = heads.reshape(-1, *heads.shape[-3:])
        flat[0, :, 0] = 0.0
        flat[1, 0, 0, 0], flat[1, 1, 0, 1], flat[1, 2, 0, 2] = float("nan"), float("inf"), float("-inf")
        flat[2, :, 0] *= 2.0**-130 if dtype is torch.bfloat16 else 2.0**-16  # subnormal inputs
        flat[3, 0, 0, 0] = torch.finfo(dtype).max
        out.append(x.to(dtype).cuda())
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout,inner,f,skip", PAGES)
def test_compiled_fp8_matches_the_reference(layout, inner, f, skip, dtype):
    caches = caches_with_edges(layout, inner, dtype)
    spec = to.KVCacheSpec(caches, layout, host_format="fp8_e4m3")
    rng = np.random.default_rng(f)
    n = 64
    m = -(-(skip + n) // f)
    g = np.r_[0:4, rng.permutation(np.arange(4, spec.num_blocks))[: n - 4]]
    h = rng.permutation(m + 3)[:m]
    host = host_buffer(spec, m + 3, f, pin=True)
    want = host.clone()
    to.gather_blocks(spec, g, host, h, blocks_per_host_block=f, skip=skip)
    torch.cuda.synchronize()
    cpu = [c.cpu() for c in caches]
    gather_fp8_ref(cpu, layout, g, want, h, blocks_per_host_block=f, skip=skip)
    assert torch.equal(host, want), f"{int((host != want).sum())} host bytes differ from the reference"
    out = [sentinel_like(c) for c in caches]
    to.scatter_blocks(host, h, out, g, layout=layout, blocks_per_host_block=f, skip=skip, host_format="fp8_e4m3")
    torch.cuda.synchronize()
    ref = [sentinel_like(c) for c in cpu]
    scatter_fp8_ref(host, h, ref, layout, g, blocks_per_host_block=f, skip=skip)
    for a, b in zip(out, ref):
        a = a.cpu()
        nan = a.isnan()
        assert torch.equal(nan, b.isnan())
        assert torch.equal(torch.where(nan, 0, a).view(torch.int16), torch.where(nan, 0, b).view(torch.int16))
