"""The integrity checks with the FP8 host format (host_format="fp8_e4m3"; docs/integrity.md) on CPU, through the engine
(the FP8 kernel under Triton's interpreter): a store writes beside each block the reference checksum of the bytes it
stored (its FP8 values and scales: kernels/reference_fp8.py's stream, triton_offload/integrity.py's checksum) whatever
the programs, and changes no stored byte; a load finds exactly the blocks whose stored values, scales or row marker
changed, or that were stored under another identity, and flags nothing else (the unwritten padding is not covered).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_kernels_fp8 import assert_same_values, make

import triton_offload as to
from triton_offload import integrity
from triton_offload.checksums import Checksums
from triton_offload.engine import TransferEngine
from triton_offload.kernels import fp8_blocks
from triton_offload.kernels.reference import checksums_ref
from triton_offload.kernels.reference_fp8 import fp8_streams_ref, gather_fp8_ref, scatter_fp8_ref

from kv_factory import SENTINEL, host_buffer, sentinel_like

FP8 = "fp8_e4m3"
N = 5  # blocks per transfer: stored from blocks 0..4 of a permutation, loaded into others


def spec_of(case: str, seed: int) -> tuple[to.KVCacheSpec, list, str]:
    """(spec, caches, layout) of a case: a layout and dtype (words of 4 or 2 bytes: the test shapes' head_dim 8, 6,
    10), MLA's latent of 5 (1-byte words), or two KV-cache groups, in one region or a region each."""
    layout, _, kind = case.partition("-")
    dtype = torch.float16 if kind == "fp16" else torch.bfloat16
    if kind == "w1":
        gen = torch.Generator().manual_seed(seed)
        caches = [(torch.randn(12, 3, 5, generator=gen) * 2.0 ** (4 * i)).to(dtype) for i in range(2)]
    else:
        caches = make(layout, 12, dtype, seed=seed, layers=3 if kind in ("groups", "regions") else 2)
    kw = {}
    if kind in ("groups", "regions"):
        kw = dict(groups=[[0, 2], [1]], group_regions=(0, 1) if kind == "regions" else None)
    return to.KVCacheSpec(caches, layout, host_format=FP8, **kw), caches, layout


def transfer(spec, n, f, skip, rng):
    """(sizes, skips, GPU ids stored, GPU ids loaded into, host ids, identities, host rows) of n blocks."""
    sizes = None if spec.num_groups == 1 else [n - n // 2, n // 2]
    skips = [skip] * (1 if sizes is None else 2)
    m = sum(-(-(s + k) // f) for s, k in zip(skips, sizes or [n]))
    rows = m + 2
    order = rng.permutation(spec.num_blocks)
    h = rng.permutation(rows)[:m]
    ident = rng.integers(-(2**63), 2**63 - 1, size=m, dtype=np.int64)
    return sizes, skips, order[:n], order[n : 2 * n], h, ident, rows


def reference_table(spec, caches, layout, g, h, f, skips, sizes, ident, word):
    """(rows, columns, checksums) of what a store of ``g`` into ``h`` writes, by the reference."""
    groups = [list(x) for x in spec.groups] if spec.num_groups > 1 else None
    streams = fp8_streams_ref(caches, layout, g, groups=groups, group_sizes=sizes)
    skip = skips if sizes else skips[0]
    return checksums_ref(caches, layout, g, h, word_bytes=word, blocks_per_host_block=f, skip=skip, groups=groups,
                         group_sizes=sizes, identities=ident, group_regions=spec.group_regions,
                         streams=streams)  # fmt: skip


CASES = [
    pytest.param("block_first", 2, 1, id="block_first-w4-f2-skip1"),
    pytest.param("kv_first-fp16", 1, 0, id="kv_first-fp16-w2-f1"),
    pytest.param("mla", 3, 2, id="mla-w2-f3-skip2"),
    pytest.param("mla-w1", 2, 0, id="mla-w1-f2"),
    pytest.param("block_first-groups", 2, 1, id="block_first-groups-f2-skip1"),
    pytest.param("block_first-regions", 2, 0, id="block_first-regions-f2"),
]


@pytest.mark.parametrize("case,f,skip", CASES)
def test_a_store_writes_the_reference_checksums_of_the_stored_bytes(case, f, skip):
    """For 16 programs (many blocks a program), 1 and 3: each block's checksum and its row's marker are the
    reference's, and the stored bytes are the unchecked kernel's reference bytes (the checks change none)."""
    spec, caches, layout = spec_of(case, seed=f + skip)
    sizes, skips, g, _, h, ident, rows = transfer(spec, N, f, skip, np.random.default_rng(f * 10 + skip))
    word = fp8_blocks.fp8_word_bytes(spec)
    assert word == {"block_first": 4, "kv_first": 2, "mla": 2}.get(case.split("-")[0]) or case == "mla-w1" and word == 1
    r, c, want = reference_table(spec, caches, layout, g, h, f, skips, sizes, ident, word)
    groups = [list(x) for x in spec.groups] if spec.num_groups > 1 else None
    expected = host_buffer(spec, rows, f)
    if groups is None:
        gather_fp8_ref(caches, layout, g, expected, h, blocks_per_host_block=f, skip=skip)
    for ctas in (None, 1, 3):
        host = host_buffer(spec, rows, f)
        checks = Checksums.allocate("require", rows, f, pin=False, regions=spec.num_regions)
        engine = TransferEngine(spec, host, blocks_per_host_block=f, checksums=checks, num_ctas=ctas)
        engine.submit_store(1, g, h, skip=skips if sizes else skip, group_sizes=sizes, identities=ident)
        assert [x.ok for x in engine.get_finished()] == [True]
        table = checks.table.numpy()
        assert table[r, c].tolist() == want.tolist(), ctas
        assert set(table[r, c - c % (1 + f)].tolist()) == {integrity.marker(f, word, 1)}
        if groups is None:
            assert torch.equal(host, expected)
        untouched = np.setdiff1d(np.arange(rows), h)
        assert not table[untouched].any() and bool((host[untouched] == SENTINEL).all())


def block_bytes(spec, f, sub, group=0):
    """A block's host byte columns at sub-block ``sub``: (its stored values, its stored scales, the padding)."""
    values, scales, padding = [], [], []
    for s in spec.group_segments[group]:
        r = spec.quant[s.layer]
        at = f * s.host_region + sub * s.host_stride + s.host_offset
        n = r.tokens * r.heads * r.head_dim
        values.append(at + np.arange(n))
        scales.append(at + r.value_bytes + np.arange(4 * r.heads))
        pad = np.r_[at + n : at + r.value_bytes, at + r.value_bytes + 4 * r.heads : at + r.host_bytes]
        padding.append(pad.astype(np.int64))
    return np.concatenate(values), np.concatenate(scales), np.concatenate(padding)


def positions(spec, n, f, skips, sizes):
    """Per block (index of its host id, sub-block, group), by the position rule."""
    out, h0 = [], 0
    for gi, (k, s) in enumerate(zip(sizes or [n], skips)):
        out += [(h0 + (s + i) // f, (s + i) % f, gi) for i in range(k)]
        h0 += -(-(s + k) // f)
    return out


@pytest.mark.parametrize("case,f,skip", CASES)
def test_a_load_fails_exactly_the_blocks_whose_stored_bytes_changed(case, f, skip):
    """Stored with identities, then loaded back: intact, nothing flagged and the values are the reference's; a bit
    flipped in one block's values, then in another's scale, fails exactly that block; a changed padding byte fails
    none; a zeroed marker fails the blocks of its row and region under "require" and loads them unchecked under
    "verify"; other identities (a stale row) fail every block."""
    spec, caches, layout = spec_of(case, seed=7 * f + skip)
    rng = np.random.default_rng(100 + 10 * f + skip)
    sizes, skips, g, dst, h, ident, rows = transfer(spec, N, f, skip, rng)
    host = host_buffer(spec, rows, f)
    checks = Checksums.allocate("require", rows, f, pin=False, regions=spec.num_regions)
    engine = TransferEngine(spec, host, blocks_per_host_block=f, checksums=checks)
    verify = TransferEngine(spec, host, blocks_per_host_block=f,
                            checksums=Checksums("verify", checks.table, f, spec.num_regions))  # fmt: skip
    kw = dict(skip=skips if sizes else skip, group_sizes=sizes)
    engine.submit_store(1, g, h, identities=ident, **kw)
    assert [x.ok for x in engine.get_finished()] == [True]
    jobs = iter(range(2, 100))

    def failed(eng=engine, ids=ident):
        job = next(jobs)
        eng.submit_load(job, dst, h, identities=ids, **kw)
        (result,) = eng.get_finished()
        assert result.ok, result.error
        refs, unchecked = eng.load_failures(result)
        return sorted(refs.positions.tolist()), unchecked

    assert failed() == ([], 0)
    if sizes is None:  # the loaded values are the unchecked reference's
        ref = [sentinel_like(t) for t in caches]
        for t, r in zip(caches, ref):
            r.copy_(t)
        scatter_fp8_ref(host, h, ref, layout, dst, blocks_per_host_block=f, skip=skip)
        for t, r in zip(caches, ref):
            assert_same_values(t, r)
    where = positions(spec, N, f, skips, sizes)
    for victim, part in ((1, 0), (3, 1)):  # a value byte of block 1, a scale byte of block 3
        idx, sub, gi = where[victim]
        cols = block_bytes(spec, f, sub, gi)[part]
        col, bit = int(rng.choice(cols)), int(rng.integers(8))
        host[h[idx], col] ^= 1 << bit
        assert failed() == ([victim], 0), (part, col, bit)
        host[h[idx], col] ^= 1 << bit
    padding = block_bytes(spec, f, where[2][1], where[2][2])[2]
    if padding.size:
        host[h[where[2][0]], int(padding[0])] ^= 0xFF
        assert failed() == ([], 0), "the padding is not stored, so not covered"
    idx, _, gi = where[4]
    region = spec.group_regions[gi] if spec.group_regions else 0
    mark_col = region * (1 + f)
    mark = int(checks.table[h[idx], mark_col])
    checks.table[h[idx], mark_col] = 0
    same_row = [i for i, (j, _, gj) in enumerate(where) if j == idx and (spec.group_regions or [0, 0])[gj] == region]
    assert failed() == (same_row, 0)
    assert failed(verify) == ([], len(same_row))
    checks.table[h[idx], mark_col] = mark
    assert failed() == ([], 0)
    assert failed(ids=ident ^ 1) == (list(range(N)), 0)
