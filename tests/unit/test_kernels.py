"""Gather/scatter kernels against the reference, byte for byte, on CPU under the Triton interpreter."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import triton_offload as to
from triton_offload.kernels.reference import gather_blocks_ref, scatter_blocks_ref

from kv_factory import (
    SENTINEL,
    assert_loaded_exactly,
    host_buffer,
    make_caches,
    random_transfer,
    sentinel_like,
    snapshot,
    storage_bytes,
)

# Small shapes: the interpreter is slow. Each layout's page is not a power of two where it can help find bugs.
PAGES = {
    "kv_first": dict(block_size=3, heads=2, head_dim=4),
    "block_first": dict(block_size=2, heads=1, head_dim=6),
    "mla": dict(block_size=2, latent=10),
    "canonical": dict(page_bytes=40, pad=24),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


def round_trip(caches, layout, *, f, skip, n, num_host=None, seed=0, num_ctas=None):
    """Gathers n random blocks, checks the host bytes against the reference and the sentinel, scatters them back
    into sentinel caches and checks that exactly the addressed blocks changed. Returns the host buffer."""
    rng = np.random.default_rng(seed)
    spec = to.KVCacheSpec(caches, layout)
    num_host = num_host or (skip + n) // f + 3
    g, h = random_transfer(rng, spec.num_blocks, num_host, n, f, skip)
    before = snapshot(caches)

    host = host_buffer(spec, num_host, f)
    expected = host.clone()
    to.gather_blocks(caches, g, host, h, layout=layout, blocks_per_host_block=f, skip=skip, num_ctas=num_ctas)
    gather_blocks_ref(caches, layout, g, expected, h, blocks_per_host_block=f, skip=skip)
    assert torch.equal(host, expected), "host bytes differ from the reference"
    # Independent of the reference: sub-blocks before `skip` and rows not addressed keep the sentinel.
    sub = spec.bytes_per_block
    assert bool((host[h[0], : skip * sub] == SENTINEL).all())
    untouched = np.setdiff1d(np.arange(num_host), h)
    assert bool((host[untouched] == SENTINEL).all())
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(caches))), "gather changed its source"

    out = [sentinel_like(t) for t in caches]
    host_before = host.clone()
    to.scatter_blocks(host, h, out, g, layout=layout, blocks_per_host_block=f, skip=skip, num_ctas=num_ctas)
    assert_loaded_exactly(out, caches, layout, g, "scatter")
    assert torch.equal(host, host_before), "scatter changed its source"
    ref_out = [sentinel_like(t) for t in caches]
    scatter_blocks_ref(host, h, ref_out, layout, g, blocks_per_host_block=f, skip=skip)
    assert all(torch.equal(storage_bytes(a), storage_bytes(b)) for a, b in zip(out, ref_out))
    return host


CASES = [
    pytest.param(layout, dtype, f, skip, id=f"{layout}-{dtype}-f{f}-skip{skip}")
    for layout in PAGES
    for dtype in DTYPES
    for f in (1, 2, 4)
    for skip in range(f)
    if layout != "canonical" or dtype == "fp8"  # canonical views are int8 by definition
]


@pytest.mark.parametrize("layout,dtype,f,skip", CASES)
def test_round_trip(layout, dtype, f, skip):
    dt = torch.int8 if layout == "canonical" else DTYPES[dtype]
    caches = make_caches(layout, num_layers=2, num_blocks=11, page=PAGES[layout], dtype=dt, seed=f * 10 + skip)
    round_trip(caches, layout, f=f, skip=skip, n=5, seed=skip)


@pytest.mark.parametrize(
    "layout,page,dtype,layers",
    [
        pytest.param("mla", dict(block_size=1, latent=1), torch.float16, 3, id="page-2-bytes"),
        pytest.param("mla", dict(block_size=1, latent=1), torch.int8, 2, id="page-1-byte"),
        pytest.param("kv_first", dict(block_size=1, heads=1, head_dim=3), torch.bfloat16, 1, id="heads1-one-layer"),
        pytest.param("block_first", dict(block_size=3, heads=1, head_dim=5), torch.float16, 61, id="61-layers-odd"),
        pytest.param("mla", dict(block_size=3, latent=7), torch.float32, 2, id="page-84-bytes"),
        pytest.param("canonical", dict(page_bytes=13, pad=3), torch.int8, 3, id="canonical-odd-pad"),
        pytest.param("canonical", dict(page_bytes=64, pad=64), torch.int8, 2, id="canonical-aligned-pad"),
    ],
)
@pytest.mark.parametrize("n", [1, 7])
def test_odd_sizes(layout, page, dtype, layers, n):
    caches = make_caches(layout, num_layers=layers, num_blocks=9, page=page, dtype=dtype, seed=n)
    round_trip(caches, layout, f=2, skip=1, n=n, seed=n)


def test_mixed_page_sizes_across_layers():
    """Hybrid models: layers of one layout with different page sizes (and dtypes) in one launch."""
    caches = make_caches("block_first", 2, 8, dict(block_size=2, heads=2, head_dim=8), torch.bfloat16, seed=1)
    caches += make_caches("block_first", 1, 8, dict(block_size=2, heads=1, head_dim=3), torch.float32, seed=2)
    caches += make_caches("block_first", 1, 8, dict(block_size=2, heads=4, head_dim=16), torch.int8, seed=3)
    round_trip(caches, "block_first", f=4, skip=2, n=6)


def test_permuted_block_dims_move_in_memory_order():
    """An engine storing heads before tokens: the block is still one byte run, copied as it lies in memory."""
    base = make_caches("block_first", 2, 6, dict(block_size=4, heads=2, head_dim=8), torch.float16, seed=4)
    caches = [t.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4) for t in base]
    assert not caches[0].is_contiguous()
    round_trip(caches, "block_first", f=1, skip=0, n=4)


def test_many_blocks_few_ctas_multiple_tiles():
    """More tiles than programs: the persistent loop must visit every tile exactly once."""
    caches = make_caches("kv_first", 2, 40, dict(block_size=2, heads=1, head_dim=4), torch.float32, seed=5)
    round_trip(caches, "kv_first", f=1, skip=0, n=33, num_ctas=3)


def test_large_pages_span_several_chunks():
    """Pages larger than one tile's chunk are streamed in several steps, the last one partial."""
    caches = make_caches("mla", 2, 5, dict(block_size=4, latent=2600), torch.float16, seed=6)  # 20800-byte pages
    round_trip(caches, "mla", f=2, skip=1, n=3)


def test_prepared_spec_and_id_kinds():
    """A KVCacheSpec built once; ids as lists, numpy arrays and tensors give the same bytes."""
    caches = make_caches("kv_first", 3, 10, PAGES["kv_first"], torch.bfloat16, seed=7)
    spec = to.KVCacheSpec(caches, "kv_first")
    assert spec.bytes_per_block == to.host_block_bytes(caches, "kv_first") == 3 * 2 * 3 * 2 * 4 * 2
    g, h = [4, 0, 9], [2, 0, 5]
    outs = []
    for kind in (list, np.array, torch.tensor):
        host = host_buffer(spec, 6, 1)
        to.gather_blocks(spec, kind(g), host, kind(h))
        outs.append(host)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert not bool((outs[0][2] == SENTINEL).all())


def test_empty_transfer_writes_nothing():
    caches = make_caches("mla", 1, 4, PAGES["mla"], torch.float16)
    host = host_buffer(to.KVCacheSpec(caches, "mla"), 2, 1)
    to.gather_blocks(caches, [], host, [], layout="mla")
    assert bool((host == SENTINEL).all())


def test_alignment_picks_widest_safe_access():
    """16-byte pages get 16-byte accesses; a 2-byte page, 2-byte accesses; a host buffer slice can lower it."""
    from triton_offload.kernels.tables import access_width

    wide = to.KVCacheSpec(make_caches("mla", 1, 4, dict(block_size=2, latent=8), torch.float16), "mla")
    narrow = to.KVCacheSpec(make_caches("mla", 1, 4, dict(block_size=1, latent=1), torch.float16), "mla")
    host = torch.zeros(4, wide.bytes_per_block + 16, dtype=torch.uint8)  # 48-byte rows
    assert access_width(wide, host[:, : wide.bytes_per_block]) == 16
    assert access_width(wide, host[:, 8:40]) == 8
    assert access_width(narrow, torch.zeros(4, 2, dtype=torch.uint8)) == 2


def grouped_round_trip(caches, layout, groups, group_sizes, skips, f, seed=0):
    """A grouped transfer (vLLM's KV-cache groups) against the reference, in both directions."""
    rng = np.random.default_rng(seed)
    spec = to.KVCacheSpec(caches, layout, groups=groups)
    n = sum(group_sizes)
    m = sum(math.ceil((s + k) / f) if k else 0 for s, k in zip(skips, group_sizes))
    g, h = rng.permutation(spec.num_blocks)[:n], rng.permutation(m + 2)[:m]
    host, want = host_buffer(spec, m + 2, f), host_buffer(spec, m + 2, f)
    kw = dict(blocks_per_host_block=f, skip=skips, group_sizes=group_sizes)
    to.gather_blocks(spec, g, host, h, **kw)
    gather_blocks_ref(caches, layout, g, want, h, groups=groups, **kw)
    assert torch.equal(host, want)
    assert not torch.equal(host, host_buffer(spec, m + 2, f)), "nothing was written"
    out, ref = [sentinel_like(t) for t in caches], [sentinel_like(t) for t in caches]
    to.scatter_blocks(host, h, to.KVCacheSpec(out, layout, groups=groups), g, **kw)
    scatter_blocks_ref(host, h, ref, layout, g, groups=groups, **kw)
    assert all(torch.equal(storage_bytes(a), storage_bytes(b)) for a, b in zip(out, ref))
    return spec, host


@pytest.mark.parametrize("f,skips", [(1, [0, 0]), (2, [1, 0]), (4, [3, 2])], ids=["f1", "f2-skips-1-0", "f4-skips-3-2"])
def test_groups_in_one_launch(f, skips):
    """Two KV-cache groups of different layers and page sizes; each block packs only its group's layers."""
    caches = make_caches("canonical", 2, 12, dict(page_bytes=96, pad=32), torch.int8, seed=1)
    caches += make_caches("canonical", 1, 12, dict(page_bytes=40), torch.int8, seed=2)
    spec, host = grouped_round_trip(caches, "canonical", [[0, 2], [1]], [4, 3], skips, f, seed=f)
    assert spec.group_bytes == (136, 96) and spec.bytes_per_block == 136


def test_groups_with_an_empty_group_and_a_shared_layer():
    """A group that moves nothing takes no host ids; a layer may belong to two groups (packed layouts)."""
    caches = make_caches("mla", 3, 10, dict(block_size=2, latent=6), torch.bfloat16, seed=3)
    grouped_round_trip(caches, "mla", [[0, 1], [2], [1]], [3, 0, 2], [1, 0, 1], 2)


def test_groups_match_separate_single_group_transfers():
    """The grouped launch writes exactly what one ungrouped transfer per group would."""
    caches = make_caches("block_first", 3, 9, dict(block_size=2, heads=1, head_dim=4), torch.float16, seed=4)
    groups, sizes, skips, f = [[2, 0], [1]], [3, 2], [1, 0], 2
    spec, host = grouped_round_trip(caches, "block_first", groups, sizes, skips, f, seed=5)
    rng = np.random.default_rng(5)
    g = rng.permutation(spec.num_blocks)[:5]
    h = rng.permutation(3 + 2)[:3]
    separate = host_buffer(spec, 5, f)
    for layers, gi, hi, s in (([caches[2], caches[0]], g[:3], h[:2], 1), ([caches[1]], g[3:], h[2:], 0)):
        sub = to.KVCacheSpec(layers, "block_first")
        tmp = host_buffer(sub, 5, f)
        to.gather_blocks(sub, gi, tmp, hi, blocks_per_host_block=f, skip=s)
        for j in range(f):
            separate.view(5, f, -1)[hi, j, : sub.bytes_per_block] = tmp.view(5, f, -1)[hi, j]
    assert torch.equal(host, separate)


class _NoWalk(tuple):
    """A tuple that refuses iteration: stands in for per-layer data the per-call path must not walk."""

    def __iter__(self):
        raise AssertionError("the per-call path walked a per-layer sequence")


def test_per_call_path_does_not_walk_layers():
    """With a prepared spec, a call's Python work is independent of the layer count (it must not loop over layers):
    after the first call has built the cached table and launch shape, per-layer data is never touched again."""
    caches = make_caches("kv_first", 61, 6, dict(block_size=1, heads=1, head_dim=4), torch.float16, seed=8)
    spec = to.KVCacheSpec(caches, "kv_first", groups=[list(range(61))])
    host = host_buffer(spec, 4, 2)
    to.gather_blocks(spec, [1, 2, 3], host, [0, 3], blocks_per_host_block=2, skip=1)
    to.scatter_blocks(host, [0, 3], spec, [4, 5, 0], blocks_per_host_block=2, skip=1)
    want = [c.clone() for c in caches]
    for name in ("segments", "group_segments", "kv_caches", "groups", "group_bytes"):
        setattr(spec, name, _NoWalk(getattr(spec, name)))
    host2 = host_buffer(spec, 4, 2)
    to.gather_blocks(spec, [1, 2, 3], host2, [0, 3], blocks_per_host_block=2, skip=1)
    to.scatter_blocks(host2, [0, 3], spec, [4, 5, 0], blocks_per_host_block=2, skip=1)
    assert torch.equal(host, host2)
    assert all(torch.equal(storage_bytes(a), storage_bytes(b)) for a, b in zip(caches, want))


def test_every_call_form_moves_the_same_bytes():
    """A prepared spec without a layout and raw tensors with ``layout=`` move the same bytes; the 0.1 positional form
    (layout second) is gone: a TypeError, nothing written; raw tensors without a layout are a ValueError."""
    caches = make_caches("kv_first", 2, 6, PAGES["kv_first"], torch.bfloat16)
    spec = to.KVCacheSpec(caches, "kv_first")
    hosts = [host_buffer(spec, 4, 2) for _ in range(3)]
    to.gather_blocks(spec, [5, 1, 3], hosts[0], [2, 0], blocks_per_host_block=2, skip=1)
    to.gather_blocks(caches, [5, 1, 3], hosts[1], [2, 0], layout="kv_first", blocks_per_host_block=2, skip=1)
    assert not bool((hosts[0] == SENTINEL).all())
    assert torch.equal(hosts[0], hosts[1])
    outs = [[sentinel_like(t) for t in caches] for _ in range(2)]
    to.scatter_blocks(hosts[0], [2, 0], to.KVCacheSpec(outs[0], "kv_first"), [0, 2, 4], blocks_per_host_block=2, skip=1)
    to.scatter_blocks(hosts[0], [2, 0], outs[1], [0, 2, 4], layout="kv_first", blocks_per_host_block=2, skip=1)
    assert all(torch.equal(storage_bytes(a), storage_bytes(b)) for a, b in zip(outs[0], outs[1]))
    with pytest.raises(TypeError):
        to.gather_blocks(caches, "kv_first", [5, 1, 3], hosts[2], [2, 0], blocks_per_host_block=2, skip=1)
    assert bool((hosts[2] == SENTINEL).all())
    with pytest.raises(ValueError, match="a layout is required"):
        to.gather_blocks(caches, [5], hosts[0], [2])
