"""Property test: random layouts, shapes, ids, factors and skips against the reference."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import triton_offload as to
from triton_offload.kernels.reference import gather_blocks_ref, scatter_blocks_ref

from kv_factory import host_buffer, make_caches, sentinel_like, storage_bytes

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


@st.composite
def transfers(draw):
    layout = draw(st.sampled_from(["kv_first", "block_first", "mla", "canonical"]))
    if layout == "canonical":
        page, dtype = dict(page_bytes=draw(st.integers(1, 48)), pad=draw(st.integers(0, 16))), torch.int8
    elif layout == "mla":
        page, dtype = (
            dict(block_size=draw(st.integers(1, 4)), latent=draw(st.integers(1, 12))),
            draw(st.sampled_from(DTYPES)),
        )
    else:
        page = dict(block_size=draw(st.integers(1, 3)), heads=draw(st.integers(1, 3)), head_dim=draw(st.integers(1, 6)))
        dtype = draw(st.sampled_from(DTYPES))
    layers = draw(st.integers(1, 4))
    num_blocks = draw(st.integers(1, 12))
    f = draw(st.integers(1, 4))
    skip = draw(st.integers(0, f - 1))
    n = draw(st.integers(0, num_blocks))
    seed = draw(st.integers(0, 2**31))
    return layout, page, dtype, layers, num_blocks, f, skip, n, seed


@settings(max_examples=60, deadline=None)
@given(transfers())
def test_matches_reference(t):
    layout, page, dtype, layers, num_blocks, f, skip, n, seed = t
    rng = np.random.default_rng(seed)
    caches = make_caches(layout, layers, num_blocks, page, dtype, seed=seed)
    spec = to.KVCacheSpec(caches, layout)
    m = math.ceil((skip + n) / f) if n else 0
    num_host = m + int(rng.integers(0, 3))
    g = rng.permutation(num_blocks)[:n]
    h = rng.permutation(num_host)[:m]

    host, want = host_buffer(spec, num_host, f), host_buffer(spec, num_host, f)
    to.gather_blocks(caches, g, host, h, layout=layout, blocks_per_host_block=f, skip=skip)
    gather_blocks_ref(caches, layout, g, want, h, blocks_per_host_block=f, skip=skip)
    assert torch.equal(host, want)

    out, ref = [sentinel_like(c) for c in caches], [sentinel_like(c) for c in caches]
    to.scatter_blocks(host, h, out, g, layout=layout, blocks_per_host_block=f, skip=skip)
    scatter_blocks_ref(host, h, ref, layout, g, blocks_per_host_block=f, skip=skip)
    assert all(torch.equal(storage_bytes(a), storage_bytes(b)) for a, b in zip(out, ref))


@st.composite
def grouped_transfers(draw):
    layout, page, dtype, layers, num_blocks, f, _, n, seed = draw(transfers())
    num_groups = draw(st.integers(1, 3))
    groups = [
        draw(st.permutations(range(layers)).map(lambda p: list(p[: max(1, len(p) // 2 + 1)])))
        for _ in range(num_groups)
    ]
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=num_groups - 1, max_size=num_groups - 1)))
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    skips = [draw(st.integers(0, f - 1)) for _ in range(num_groups)]
    return layout, page, dtype, layers, num_blocks, f, skips, sizes, groups, seed


@settings(max_examples=40, deadline=None)
@given(grouped_transfers())
def test_grouped_matches_reference(t):
    """KV-cache groups (vLLM HMA): random layer subsets per group, group sizes (zeros included) and skips."""
    layout, page, dtype, layers, num_blocks, f, skips, sizes, groups, seed = t
    rng = np.random.default_rng(seed)
    caches = make_caches(layout, layers, num_blocks, page, dtype, seed=seed)
    spec = to.KVCacheSpec(caches, layout, groups=groups)
    m = sum(math.ceil((s + k) / f) if k else 0 for s, k in zip(skips, sizes))
    num_host = m + int(rng.integers(0, 3))
    g = rng.permutation(num_blocks)[: sum(sizes)]
    h = rng.permutation(num_host)[:m]
    kw = dict(blocks_per_host_block=f, skip=skips, group_sizes=sizes)

    host, want = host_buffer(spec, num_host, f), host_buffer(spec, num_host, f)
    to.gather_blocks(spec, g, host, h, **kw)
    gather_blocks_ref(caches, layout, g, want, h, groups=groups, **kw)
    assert torch.equal(host, want)

    out, ref = [sentinel_like(c) for c in caches], [sentinel_like(c) for c in caches]
    to.scatter_blocks(host, h, to.KVCacheSpec(out, layout, groups=groups), g, **kw)
    scatter_blocks_ref(host, h, ref, layout, g, groups=groups, **kw)
    assert all(torch.equal(storage_bytes(a), storage_bytes(b)) for a, b in zip(out, ref))
