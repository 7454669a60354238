"""The kernel suite at realistic sizes on CUDA (pinned host memory, compiled kernels). Run with -m gpu."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import triton_offload as to
from triton_offload.kernels.reference import gather_blocks_ref, scatter_blocks_ref

from kv_factory import host_buffer, make_caches, sentinel_like, storage_bytes

pytestmark = pytest.mark.gpu

# 32 layers x 64 KiB pages x 512 blocks: Llama-3-8B's page (bf16, block 16, 8 KV heads of 128).
REALISTIC = [
    pytest.param("block_first", dict(block_size=16, heads=8, head_dim=128), 32, 1, 0, id="block_first-64KiB-f1"),
    pytest.param("kv_first", dict(block_size=16, heads=8, head_dim=128), 32, 4, 3, id="kv_first-64KiB-f4-skip3"),
    pytest.param("mla", dict(block_size=64, latent=576), 61, 2, 1, id="mla-72KiB-f2-skip1"),
    pytest.param("kv_first", dict(block_size=16, heads=1, head_dim=128), 80, 1, 0, id="kv_first-8KiB-80layers"),
    pytest.param("canonical", dict(page_bytes=2048 + 2, pad=62), 32, 4, 1, id="canonical-2050B-padded"),
]


@pytest.mark.parametrize("layout,page,layers,f,skip", REALISTIC)
def test_round_trip_realistic(layout, page, layers, f, skip):
    n, num_blocks = 512, 700
    dtype = torch.int8 if layout == "canonical" else torch.bfloat16
    caches = make_caches(layout, layers, num_blocks, page, dtype, device="cuda", seed=f)
    spec = to.KVCacheSpec(caches, layout)
    rng = np.random.default_rng(f)
    m = math.ceil((skip + n) / f)
    g, h = rng.permutation(num_blocks)[:n], rng.permutation(m + 5)[:m]
    host = host_buffer(spec, m + 5, f, pin=True)
    want = host.clone()
    to.gather_blocks(spec, g, host, h, blocks_per_host_block=f, skip=skip)
    torch.cuda.synchronize()
    gather_blocks_ref(caches, layout, g, want, h, blocks_per_host_block=f, skip=skip)
    assert torch.equal(host, want)

    out, ref = [sentinel_like(c) for c in caches], [sentinel_like(c) for c in caches]
    to.scatter_blocks(host, h, out, g, layout=layout, blocks_per_host_block=f, skip=skip)
    scatter_blocks_ref(host, h, ref, layout, g, blocks_per_host_block=f, skip=skip)
    torch.cuda.synchronize()
    assert all(torch.equal(storage_bytes(a), storage_bytes(b)) for a, b in zip(out, ref))


def test_pageable_host_buffer_is_rejected():
    caches = make_caches("mla", 2, 8, dict(block_size=4, latent=16), torch.float16, device="cuda")
    spec = to.KVCacheSpec(caches, "mla")
    host = host_buffer(spec, 4, 1, pin=False)
    with pytest.raises(ValueError, match="must be pinned"):
        to.gather_blocks(spec, [0, 1], host, [0, 1])
    with pytest.raises(ValueError, match="host memory, got a tensor on cuda"):
        to.gather_blocks(spec, [0, 1], host.cuda(), [0, 1])


@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_one_kernel_launch_per_call(direction):
    """80 layers x 2 segments x 64 blocks: exactly one kernel runs on the GPU for the whole call."""
    caches = make_caches("kv_first", 80, 128, dict(block_size=16, heads=1, head_dim=128), torch.bfloat16, "cuda")
    spec = to.KVCacheSpec(caches, "kv_first")
    host = host_buffer(spec, 64, 1, pin=True)
    g, h = list(range(0, 128, 2)), list(range(64))
    call = {
        "gather": lambda: to.gather_blocks(spec, g, host, h),
        "scatter": lambda: to.scatter_blocks(host, h, spec, g),
    }[direction]
    call()  # compile outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = [
        e.name
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and "memcpy" not in e.name.lower()
        and "memset" not in e.name.lower()
    ]
    assert kernels == ["_copy_blocks_kernel"], kernels
