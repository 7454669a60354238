"""The integrity checks (docs/integrity.md) on CPU, through the engine (the kernel under Triton's interpreter, and the
copy-engine path's memmove stand-in followed by the checksum-only launch): what a store writes beside each block is
the reference checksum (triton_offload/integrity.py) whatever the tiles and programs; a load finds every corrupted,
misplaced, truncated or stale block, for every layout, factor and skip, and flags nothing else.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import triton_offload as to
from triton_offload import integrity
from triton_offload.checksums import Checksums
from triton_offload.engine import TransferEngine
from triton_offload.issuers import CopyLauncher, KernelIssuer
from triton_offload.kernels import shapes, tables
from triton_offload.kernels.reference import checksums_ref
from triton_offload.layouts import HostSlots
from triton_offload.plan import Direction, TransferPlanner

from kv_factory import host_buffer, make_caches

PAGES = {
    "kv_first": (dict(block_size=3, heads=2, head_dim=4), torch.bfloat16),
    "block_first": (dict(block_size=2, heads=1, head_dim=6), torch.float32),
    "mla": (dict(block_size=2, latent=5), torch.float16),  # 20-byte pages: 4-byte words
    "canonical": (dict(page_bytes=13, pad=3), torch.int8),  # 13-byte pages: 1-byte words
}
# Each layout with the packed host format; canonical pages also in vLLM's worker slots (with a page of padding each
# and a region no entry uses), two KV-cache groups, and two groups in host regions of their own (a row holds a key of
# each: a marker and f checksums per region).
FORMATS = [*PAGES, "canonical-slots", "kv_first-groups", "kv_first-regions"]


def make_spec(fmt: str, seed: int = 0, num_blocks: int = 14) -> to.KVCacheSpec:
    layout = fmt.split("-")[0]
    page, dtype = PAGES[layout]
    caches = make_caches(layout, 3, num_blocks, page, dtype, seed=seed)
    if fmt.endswith("-slots"):
        pages = [page["page_bytes"] + 3, 24, page["page_bytes"] + 3, page["page_bytes"] + 3]
        return to.KVCacheSpec(caches, layout, host_slots=HostSlots(tuple(pages), (0, 2, 3)))
    if fmt.endswith("-groups"):
        return to.KVCacheSpec(caches, layout, groups=[[0, 2], [1]])
    if fmt.endswith("-regions"):
        return to.KVCacheSpec(caches, layout, groups=[[0, 2], [1]], group_regions=(0, 1))
    return to.KVCacheSpec(caches, layout)


def make_engine(spec, f, rows, integrity_setting="verify", path="kernel", num_ctas=None):
    host = host_buffer(spec, rows, f)
    checks = Checksums.allocate(integrity_setting, rows, f, pin=False, regions=spec.num_regions)
    engine = TransferEngine(spec, host, blocks_per_host_block=f, path=path, checksums=checks, num_ctas=num_ctas)
    return engine, host, checks.table


def block_columns(spec: to.KVCacheSpec, f: int, sub: int, group: int = 0) -> np.ndarray:
    """The host row's byte columns holding a block's moved bytes at sub-block ``sub`` (its word stream, in order)."""
    cols = [
        f * s.host_region + sub * s.host_stride + s.host_offset + np.arange(s.nbytes)
        for s in spec.group_segments[group]
    ]
    return np.concatenate(cols)


def group_layout(spec, n):
    """Group sizes of n blocks (split over the groups) or None, and the group of each block."""
    if spec.num_groups == 1:
        return None, np.zeros(n, dtype=np.int64)
    sizes = [n - n // 2, n // 2]
    return sizes, np.repeat(np.arange(2), sizes)


def positions(n, f, skip, sizes):
    """(index into the host ids, sub-block) of each of n blocks, group by group (the position rule)."""
    sizes = [n] if sizes is None else sizes
    skips = [skip] * len(sizes)
    idx, sub, h0 = [], [], 0
    for k, s in zip(sizes, skips):
        p = s + np.arange(k)
        idx.append(h0 + p // f)
        sub.append(p % f)
        h0 += -(-(s + k) // f) if k else 0
    return np.concatenate(idx), np.concatenate(sub), h0


def finished(engine, job_id):
    (result,) = [r for r in engine.get_finished() if r.job_id == job_id]
    assert result.ok, result.error
    return result


def load(engine, job_id, g, h, skip, sizes, identities):
    """(positions of the failed blocks, blocks loaded unchecked); each failed block is named by the result as the
    position rule names it: its GPU block, the host block it came from, the identity it was loaded under."""
    engine.submit_load(job_id, g, h, skip=skip, group_sizes=sizes, identities=identities)
    failed, unchecked = engine.load_failures(finished(engine, job_id))
    idx, _, _ = positions(len(g), engine.blocks_per_host_block, skip, sizes)
    at = failed.positions
    assert failed.gpu_ids.tolist() == np.asarray(g)[at].tolist()
    assert failed.host_ids.tolist() == np.asarray(h)[idx[at]].tolist()
    named = np.asarray(h) if identities is None else np.asarray(identities)
    assert failed.identities.tolist() == named[idx[at]].tolist()
    group_of = np.repeat(np.arange(len(sizes or [len(g)])), sizes or [len(g)])
    assert failed.groups.tolist() == group_of[at].tolist()
    return sorted(at.tolist()), unchecked


CASES = [
    pytest.param(fmt, f, skip, id=f"{fmt}-f{f}-skip{skip}") for fmt in FORMATS for f in (1, 2, 3) for skip in range(f)
]


@pytest.mark.parametrize("fmt,f,skip", CASES)
def test_a_load_finds_every_corrupted_misplaced_truncated_or_stale_block(fmt, f, skip):
    """Six blocks stored with random identities, then loaded back four times: intact (nothing flagged, every byte
    loaded); with one bit flipped in block 0 (a random bit of its bytes), block 2's bytes over block 3's, block
    4's second half zeroed (a truncated block) -- exactly blocks 0, 3 and 4 fail; with a host row and its checksums
    copied over another row, and a row holding what an earlier store of other blocks left (bytes and checksums:
    stale) -- exactly those rows' blocks fail; and with a row's marker cleared (stored without checksums): loaded
    unchecked under "verify", failed under "require"."""
    spec = make_spec(fmt, seed=10 * f + skip)
    n = 6
    sizes, group_of = group_layout(spec, n)
    idx, sub, m = positions(n, f, skip, sizes)
    rows = m + 3
    engine, host, table = make_engine(spec, f, rows)
    rng = np.random.default_rng(f * 100 + skip)
    g = rng.permutation(spec.num_blocks)[:n]
    h = rng.permutation(rows)[:m]
    ident = rng.integers(-(2**63), 2**63 - 1, size=m, dtype=np.int64)
    engine.submit_store(1, g, h, skip=skip, group_sizes=sizes, identities=ident)
    finished(engine, 1)

    # What was written is the reference checksum of each block, under its row's marker.
    cfg = engine._launcher.config(Direction.STORE)
    word, group = cfg.elem, cfg.vec
    kw = dict(word_bytes=word, group_words=group, blocks_per_host_block=f, skip=skip, groups=spec.groups,
              group_sizes=sizes)  # fmt: skip
    rr, cols, rc = checksums_ref(spec.kv_caches, spec.layout, g, h, identities=ident, group_regions=spec.group_regions,
                                 **kw)  # fmt: skip
    assert torch.equal(table[rr, cols], torch.from_numpy(rc))
    marks = table[:, :: 1 + f]  # each row's marker per region
    assert set(marks.flatten().tolist()) == {0, integrity.marker(f, word, group)}
    assert {tuple(x) for x in np.argwhere(marks.numpy())} == set(zip(rr.tolist(), (cols // (1 + f)).tolist()))

    free = np.setdiff1d(np.arange(spec.num_blocks), g)
    dst = rng.permutation(free)[:n]  # the loads write other GPU blocks
    before = [t.clone() for t in spec.kv_caches]
    assert load(engine, 2, dst, h, skip, sizes, ident) == ([], 0)
    for i in range(n):  # loaded exactly: block i's layers (its group's) are block g[i]'s
        for layer in spec.groups[group_of[i]]:
            assert torch.equal(index_block(spec, spec.kv_caches[layer], dst[i]), index_block(spec, before[layer], g[i]))

    # Per-block damage in one load: a flipped bit, a block's bytes over another's, a truncated block.
    pristine_host, pristine_table = host.clone(), table.clone()
    cols = [block_columns(spec, f, int(sub[i]), int(group_of[i])) for i in range(n)]
    row = [int(h[idx[i]]) for i in range(n)]
    bit = int(rng.integers(0, 8 * cols[0].size))
    host[row[0], cols[0][bit // 8]] ^= 1 << (bit % 8)
    same_group = [i for i in range(n) if group_of[i] == group_of[3] and i != 3]
    src = same_group[0]
    host[row[3], cols[3]] = host[row[src], cols[src]]
    half = cols[4][cols[4].size // 2 :]
    host[row[4], half] = 0
    if torch.equal(host[row[4], half], pristine_host[row[4], half]):  # already zero: truncate to ones instead
        host[row[4], half] = 0xFF
    assert load(engine, 3, dst, h, skip, sizes, ident) == ([0, 3, 4], 0)

    # Whole rows: one copied with its checksums over another (the identity differs), one left stale.
    host.copy_(pristine_host)
    table.copy_(pristine_table)
    # Two rows holding keys of one group (of one host region: with regions, a row of another group's key has no
    # checksums in this one's region, and its blocks would be absent rather than failed).
    pairs = [sorted({row[i] for i in range(n) if group_of[i] == gi}) for gi in range(spec.num_groups)]
    pair = next((p[:2] for p in pairs if len(p) >= 2), None)
    if pair is not None:
        a, b = pair
        host[b], table[b] = host[a].clone(), table[a].clone()
        expect = [i for i in range(n) if row[i] == b]
        assert load(engine, 4, dst, h, skip, sizes, ident) == (expect, 0)
        host.copy_(pristine_host)
        table.copy_(pristine_table)
    # Stale: an earlier store of other blocks under other identities, into the same rows; the current store's
    # bytes and checksums never arrived (its rows still hold the earlier ones).
    other = rng.permutation(free)[:n]
    engine.submit_store(5, other, h, skip=skip, group_sizes=sizes, identities=ident ^ 0x5A5A)
    finished(engine, 5)
    assert load(engine, 6, dst, h, skip, sizes, ident) == (list(range(n)), 0)

    # Stored without checksums (a marker that is not ours): unchecked under verify, failed under require.
    host.copy_(pristine_host)
    table.copy_(pristine_table)
    table[row[0], 0] = 0
    absent = [i for i in range(n) if row[i] == row[0]]
    assert load(engine, 7, dst, h, skip, sizes, ident) == ([], len(absent))
    engine.checksums = dataclasses.replace(engine.checksums, setting=integrity.REQUIRE)  # the same table, required
    assert load(engine, 8, dst, h, skip, sizes, ident) == (absent, 0)
    engine.shutdown()


def index_block(spec, t, b):
    """Block b's bytes (compared as bytes: random bits include NaN patterns)."""
    block = t[:, int(b)] if spec.layout is to.Layout.KV_FIRST else t[int(b)]
    return block.contiguous().view(torch.uint8)


@pytest.mark.parametrize("fmt", ["block_first", "canonical-slots", "kv_first-groups", "kv_first-regions"])
def test_the_copy_engine_path_checks_as_the_kernel_does(fmt):
    """path="dma": the copies (replayed by memmove on CPU), then a checksum-only launch over the GPU side on the
    same stream. A store writes the same checksums as the kernel path; a load finds the same corrupted blocks, and a
    block stored by one path loads checked by the other."""
    spec = make_spec(fmt, seed=3)
    f, skip, n = 2, 1, 5
    sizes, group_of = group_layout(spec, n)
    idx, sub, m = positions(n, f, skip, sizes)
    rows = m + 1
    kernel, k_host, k_table = make_engine(spec, f, rows, path="kernel")
    dma, d_host, d_table = make_engine(spec, f, rows, path="dma")
    g, h = np.arange(n) * 2, np.arange(m)[::-1].copy()
    ident = np.arange(m, dtype=np.int64) * 977 + 5
    for e in (kernel, dma):
        e.submit_store(1, g, h, skip=skip, group_sizes=sizes, identities=ident)
        finished(e, 1)
    assert torch.equal(k_host, d_host) and torch.equal(k_table, d_table)
    cfg = kernel._launcher.config(Direction.STORE)
    assert int(k_table[int(h[0]), 0]) == integrity.marker(f, cfg.elem, cfg.vec)

    dst = np.arange(n) * 2 + 1
    cols = block_columns(spec, f, int(sub[2]), int(group_of[2]))
    d_host[int(h[idx[2]]), cols[-1]] ^= 0x80
    assert load(dma, 2, dst, h, skip, sizes, ident) == ([2], 0)
    # The kernel path checks what the copy-engine path stored, and the other way round.
    k_host.copy_(d_host)
    assert load(kernel, 2, dst, h, skip, sizes, ident) == ([2], 0)
    d_host[int(h[idx[2]]), cols[-1]] ^= 0x80
    assert load(dma, 3, dst, h, skip, sizes, ident) == ([], 0)
    kernel.shutdown()
    dma.shutdown()


@pytest.mark.parametrize("path", ["kernel", "dma"])
@pytest.mark.parametrize("f", [1, 2])
def test_the_keys_of_one_row_in_two_host_regions_keep_their_own_checksums(f, path):
    """Host regions (KVCacheSpec(group_regions=...)): a host id names one key per region, so group 0's key and group
    1's key may share a row (the manager keeps a block pool per region). Stored by separate jobs, as two requests
    would, each keeps its own marker and checksums: both load intact; a bit flipped in one region's bytes of the row
    fails that key's blocks only."""
    spec = make_spec("kv_first-regions", seed=7 + f)
    engine, host, table = make_engine(spec, f, 5, path=path)
    n0, n1 = 2 * f, f  # group 0 fills rows 3 and 1, group 1 row 3
    h0, h1 = np.array([3, 1]), np.array([3])
    i0, i1 = np.array([101, 102], dtype=np.int64), np.array([-7], dtype=np.int64)  # their keys' identities
    g0, g1 = np.arange(n0), n0 + np.arange(n1)
    engine.submit_store(1, g0, h0, group_sizes=[n0, 0], identities=i0)
    finished(engine, 1)
    engine.submit_store(2, g1, h1, group_sizes=[0, n1], identities=i1)  # the same row, the other region
    finished(engine, 2)
    cfg = engine._launcher.config(Direction.STORE)
    assert table[3, 0] == table[3, 1 + f] == integrity.marker(f, cfg.elem, cfg.vec) and table[1, 1 + f] == 0
    dst0, dst1 = 8 + np.arange(n0), 8 + n0 + np.arange(n1)
    assert load(engine, 3, dst0, h0, 0, [n0, 0], i0) == ([], 0)
    assert load(engine, 4, dst1, h1, 0, [0, n1], i1) == ([], 0)
    for layer in spec.groups[1]:  # the second store did not disturb the first key's bytes either
        t = spec.kv_caches[layer]
        assert all(torch.equal(index_block(spec, t, d), index_block(spec, t, s)) for d, s in zip(dst1, g1))
    pristine = host.clone()
    host[3, block_columns(spec, f, f - 1, 1)[5]] ^= 0x10  # group 1's last sub-block in row 3
    assert load(engine, 5, dst0, h0, 0, [n0, 0], i0) == ([], 0)
    assert load(engine, 6, dst1, h1, 0, [0, n1], i1) == ([f - 1], 0)
    host.copy_(pristine)
    host[3, block_columns(spec, f, 0, 0)[0]] ^= 0x01  # group 0's first sub-block in row 3
    assert load(engine, 7, dst0, h0, 0, [n0, 0], i0) == ([0], 0)
    assert load(engine, 8, dst1, h1, 0, [0, n1], i1) == ([], 0)
    engine.shutdown()


@pytest.mark.parametrize("fmt", ["kv_first", "canonical-slots", "kv_first-groups", "kv_first-regions"])
def test_the_direct_launch_of_the_checked_variants_is_proven_on_the_canary(fmt):
    """The direct launch's proof (triton_offload/fast_launch.py) covers the checks: the canary's checksum table after
    a store and a load's per-block results (one corrupted block, one key without checksums) must be the reference's,
    per host region of a row too. A runner that drops work is refused. On CPU the runners launch the interpreted
    kernel (tests/unit/test_fast_launch.py)."""
    from test_fast_launch import interpreter_runner

    from triton_offload import fast_launch

    def runners(corrupt=False):
        make = interpreter_runner(corrupt)
        return lambda launcher, direction, copy=True: make(launcher, direction)  # either variant: the same kernel

    spec = make_spec(fmt, seed=1)
    host = host_buffer(spec, 10, 2)
    checks = Checksums.allocate("verify", 10, 2, pin=False, regions=spec.num_regions)
    launcher = CopyLauncher(spec, host, 2, checksums=checks)
    assert fast_launch.enable_fast_launch(launcher, make_runner=runners()) == {d: "direct" for d in Direction}
    for d in Direction:  # the copy-engine path's checksum-only launch too
        assert fast_launch.prove_direct(launcher, d, runners()(launcher, d), copy=False) is None
    refused = CopyLauncher(make_spec(fmt, seed=2), host, 2, checksums=checks)
    verdicts = fast_launch.enable_fast_launch(refused, make_runner=runners(corrupt=True))
    assert all(v != "direct" for v in verdicts.values()), verdicts


@pytest.mark.parametrize("fmt", FORMATS)
def test_checksums_do_not_depend_on_tiles_or_programs(fmt):
    """The same store with tiles of 64 bytes to 4 KiB (so blocks split across tiles, or share them) and 1 to 5
    programs: every launch writes the reference checksums, and the bytes are the same."""
    spec = make_spec(fmt, seed=5)
    f, skip, n = 2, 1, 7
    sizes, _ = group_layout(spec, n)
    _, _, m = positions(n, f, skip, sizes)
    rows = m
    g, h = np.array([9, 2, 11, 0, 5, 3, 13]), np.arange(m)
    ident = np.arange(m, dtype=np.int64) - 3
    planner = TransferPlanner(spec, rows, f)
    plan = planner.plan(g, h, direction=Direction.STORE, skip=skip, group_sizes=sizes, identities=ident)
    results = []
    width = tables.access_width(spec, host_buffer(spec, rows, f))
    # The checked launches' own shapes, and the plain copy's (any shape must give the same sums).
    for tile, ctas, checked in [(64, 1, True), (256, 5, False), (1024, 2, True), (4096, 3, False), (128, 4, True)]:
        host = host_buffer(spec, rows, f)
        checks = Checksums.allocate("verify", rows, f, pin=False, regions=spec.num_regions)
        table = checks.table
        cfg = shapes.launch_config(spec, width, shapes.LaunchTuning(tile, 4), checked)
        launcher = CopyLauncher(spec, host, f, Direction.STORE, configs={Direction.STORE: cfg}, checksums=checks)
        KernelIssuer(launcher, None, ctas).issue(plan)
        results.append((host, table, launcher.config(Direction.STORE)))
    word, group = results[0][2].elem, results[0][2].vec
    assert {(cfg.elem, cfg.vec) for _, _, cfg in results} == {(word, group)}
    assert len({(cfg.rows, cfg.chunk) for _, _, cfg in results}) > 2, "the tilings should differ"
    kw = dict(word_bytes=word, group_words=group, blocks_per_host_block=f, skip=skip, groups=spec.groups,
              group_sizes=sizes)  # fmt: skip
    rr, cols, rc = checksums_ref(spec.kv_caches, spec.layout, g, h, identities=ident, group_regions=spec.group_regions,
                                 **kw)  # fmt: skip
    for host, table, _ in results:
        assert torch.equal(host, results[0][0])
        assert torch.equal(table[rr, cols], torch.from_numpy(rc))


@pytest.mark.parametrize("group", [1, 2, 4])
def test_the_checksum_covers_every_word_position_and_identity(group):
    """The reference itself: changing any one word of a block changes its checksum (a group's terms are a bijection
    of its 64-bit fold, which any one word moves), as does swapping two different words (in one group or two),
    another identity, sub-block index, length, word size or group size; identical blocks at two positions differ."""
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, size=(1, 64), dtype=np.uint8)

    def checksum(b, ident=7, sub=1, word=4, g=group):
        return integrity.block_checksums(b, word, ident, sub, g)[0]

    base = checksum(block)
    for word in range(16):
        for flip in (1, 0x80000000, 0xFFFFFFFF):
            b = block.copy()
            b.view("<u4")[0, word] ^= flip
            assert checksum(b) != base
    for i, j in [(3, 9), (0, 1), (4, 7)]:
        swapped = block.copy()
        swapped.view("<u4")[0, [i, j]] = swapped.view("<u4")[0, [j, i]]
        assert checksum(swapped) != base
    assert checksum(block, ident=8) != base and checksum(block, sub=0) != base and checksum(block[:, :48]) != base
    zero = np.zeros((2, 64), dtype=np.uint8)
    a, b = integrity.block_checksums(zero, 4, [7, 7], [0, 1], group)
    assert a != b, "identical blocks at two positions must differ"
    assert checksum(block, word=2) != base, "the word size is part of the definition"
    assert checksum(block, g=2 if group != 2 else 4) != base, "so is the group size"


def test_any_one_to_three_flipped_bits_of_one_group_change_its_fold():
    """Certain detection within a group of 4 words (16 bytes): a change of one group is missed only if its 64-bit
    fold ``sum_v GROUP_MUL[v] * delta_v`` is 0 mod 2**64. No pattern of 1, 2 or 3 flipped bits (either direction:
    each delta is +-2**bit) does that, so none is ever missed, whatever the data."""
    mod = 1 << 64
    terms = np.array([(m << b) % mod for m in integrity.GROUP_MUL for b in range(32)], dtype=object)
    values = {int(t) for t in terms} | {int(-t % mod) for t in terms}
    assert 0 not in values
    signed = np.concatenate([terms, (-terms) % mod]).astype(np.uint64)  # +-2**b * m, mod 2**64
    n = len(terms)
    idx = np.arange(2 * n)
    with np.errstate(over="ignore"):  # uint64 sums wrap mod 2**64, as the fold does
        for i in range(2 * n):  # pairs, then triples of distinct bits
            other = idx[(idx % n) > (i % n)]
            pair = signed[i] + signed[other]
            assert not (pair == 0).any(), (i, other[pair == 0])
            for j in other:
                rest = idx[(idx % n) > (j % n)]
                assert not (signed[i] + signed[j] + signed[rest] == 0).any(), (i, j)


def test_two_flipped_sign_bits_in_two_groups_are_caught():
    """Why each lane mixes its group's fold rather than summing words times constants: in a sum mod 2**32, bit 31
    flipped in two words cancels whatever their multipliers (2**31 * odd + 2**31 * odd = 0). Here, over many random
    blocks, the same flips (the sign bits of two float32 words, or of two bf16 halves) always change the checksum."""
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(4000, 256), dtype=np.uint8)
    for group in (1, 4):
        base = integrity.block_checksums(blocks, 4, 7, 0, group)
        for i, j, bit in [(0, 5, 31), (3, 40, 31), (17, 18, 15), (2, 63, 31)]:
            flipped = blocks.copy()
            w = flipped.view("<u4")
            w[:, i] ^= np.uint32(1 << bit)
            w[:, j] ^= np.uint32(1 << bit)
            assert (integrity.block_checksums(flipped, 4, 7, 0, group) != base).all(), (group, i, j, bit)


def test_settings_and_markers():
    assert integrity.integrity_setting("VERIFY") == "verify"
    with pytest.raises(ValueError, match=r"integrity = 'on' is not one of \['off', 'require', 'verify'\]"):
        integrity.integrity_setting("on")
    mark = integrity.marker(3, 4, 4)
    fields = {"version": integrity.VERSION, "blocks_per_host_block": 3, "group": 4, "word": 4}
    assert integrity.parse_marker(mark) == fields and integrity.VERSION == 3
    older = mark - (1 << 24)  # the same row's version 2 marker: not this one, so its row is "absent"
    assert integrity.parse_marker(older)["version"] == 2 and older != mark
    assert integrity.parse_marker(0) is None
    assert len({mark, integrity.marker(3, 2, 4), integrity.marker(2, 4, 4), integrity.marker(3, 4, 1)}) == 4
    with pytest.raises(ValueError, match="group_words = 3, expected 1, 2 or 4"):
        integrity.marker(3, 4, 3)
    k = b"\x01" * 32 + (7).to_bytes(4, "little")
    assert integrity.key_identity(k) == integrity.key_identity(bytes(k)) != integrity.key_identity(k[:-1] + b"\x08")
    # The definition (docs/integrity.md): the key's 8-byte BLAKE2b digest, little-endian; keys of mixed lengths.
    keys = [k, b"", b"\x00", k[:5]]
    want = [int.from_bytes(hashlib.blake2b(x, digest_size=8).digest(), "little", signed=True) for x in keys]
    assert integrity.identities_of_keys(keys).tolist() == want and integrity.identities_of_keys([]).size == 0


@pytest.mark.parametrize("n", [0, 1, 3, 8, 9, 40])
def test_a_store_keeps_each_digest_at_its_slot(n):
    """keep_digests (a store's identities, kept for its loads) returns what digests_of_keys and identities_of_keys
    give, and writes each key's digest at its slot, in the loop of small calls and the NumPy put of larger ones."""
    from triton_offload.policies.slots import long_array

    rng = np.random.default_rng(n)
    keys = [rng.bytes(int(rng.integers(0, 40))) for _ in range(n)]
    slots = rng.choice(100, n, replace=False).tolist()
    table = long_array(100)
    for person in (b"", b"\x07" * 16):
        digests = integrity.keep_digests(keys, slots, table.cast("B"), person)
        ident = integrity.identities_of_keys(keys, person)
        assert digests == integrity.digests_of_keys(keys, person) == ident.tobytes()
        assert [table[s] for s in slots] == ident.tolist()


def test_the_checks_are_one_value_checked_once_and_identities_are_checked_per_call():
    spec = make_spec("mla")
    host = host_buffer(spec, 4, 1)
    table = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(TypeError, match="checksums must be a triton_offload.checksums.Checksums or None"):
        TransferEngine(spec, host, path="kernel", checksums=table)
    with pytest.raises(ValueError, match="integrity = 'off' has no checksums: pass checksums=None"):
        Checksums("off", table, 1)
    with pytest.raises(ValueError, match="is not one of"):
        Checksums("strict", table, 1)
    with pytest.raises(ValueError, match=r"the checksum table must be int64 of shape \(host blocks, 3\)"):
        Checksums("verify", table, 2)
    with pytest.raises(ValueError, match="the checksum table has 3 rows, the host buffer 4"):
        TransferEngine(spec, host, path="kernel", checksums=Checksums("verify", table[:3], 1))
    assert Checksums("VERIFY", table, 1).setting == "verify" and Checksums("require", table, 1).require
    engine, _, _ = make_engine(spec, 1, 4)
    with pytest.raises(ValueError, match=r"identities has shape \(3,\), expected one per host block id: \(2,\)"):
        engine.submit_store(1, [0, 1], [0, 1], identities=[1, 2, 3])
    with pytest.raises(TypeError, match="identities must hold integers"):
        engine.submit_store(1, [0, 1], [0, 1], identities=[1.5, 2.0])
    assert engine.num_pending == 0
    engine.shutdown()


@st.composite
def intact_transfers(draw):
    fmt = draw(st.sampled_from(FORMATS))
    f = draw(st.integers(1, 4))
    skip = draw(st.integers(0, f - 1))
    n = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**31))
    ctas = draw(st.integers(1, 4))
    path = draw(st.sampled_from(["kernel", "dma"]))
    return fmt, f, skip, n, seed, ctas, path


@settings(max_examples=25, deadline=None)
@given(intact_transfers())
def test_intact_blocks_are_never_flagged(case):
    """Any layout, factor, skip, ids, identities, program count and path: what was stored loads back checked, with
    no block flagged or unchecked, and the loaded bytes are the stored ones."""
    fmt, f, skip, n, seed, ctas, path = case
    spec = make_spec(fmt, seed=seed % 1000, num_blocks=2 * n + 1)
    sizes, _ = group_layout(spec, n)
    _, _, m = positions(n, f, skip, sizes)
    rng = np.random.default_rng(seed)
    rows = m + int(rng.integers(0, 3))
    engine, _, table = make_engine(spec, f, rows, path=path, num_ctas=ctas)
    g = rng.permutation(spec.num_blocks)[:n]
    h = rng.permutation(rows)[:m]
    ident = rng.integers(-(2**63), 2**63 - 1, size=m, dtype=np.int64)
    engine.submit_store(1, g, h, skip=skip, group_sizes=sizes, identities=ident)
    finished(engine, 1)
    dst = np.setdiff1d(np.arange(spec.num_blocks), g)[:n]
    assert load(engine, 2, dst, h, skip, sizes, ident) == ([], 0)
    _, group_of = group_layout(spec, n)
    for i in range(n):
        for layer in spec.groups[group_of[i]]:
            t = spec.kv_caches[layer]
            assert torch.equal(index_block(spec, t, dst[i]), index_block(spec, t, g[i]))
    engine.shutdown()


@settings(max_examples=30, deadline=None)
@given(intact_transfers(), st.integers(0, 2**62))
def test_one_flipped_bit_anywhere_in_the_host_rows_fails_exactly_its_block(case, where):
    """Any layout, factor, skip, ids, identities, program count and path: one bit flipped anywhere in the host rows a
    load reads fails exactly the block whose bytes hold it; in a byte no block of the load moves (a skipped
    sub-block, a slot's padding) it flags nothing."""
    fmt, f, skip, n, seed, ctas, path = case
    spec = make_spec(fmt, seed=seed % 1000, num_blocks=2 * n + 1)
    sizes, group_of = group_layout(spec, n)
    idx, sub, m = positions(n, f, skip, sizes)
    rng = np.random.default_rng(seed)
    engine, host, _ = make_engine(spec, f, m + 1, path=path, num_ctas=ctas)
    g = rng.permutation(spec.num_blocks)[:n]
    h = rng.permutation(m + 1)[:m]
    ident = rng.integers(-(2**63), 2**63 - 1, size=m, dtype=np.int64)
    engine.submit_store(1, g, h, skip=skip, group_sizes=sizes, identities=ident)
    finished(engine, 1)
    owner = {}
    for i in range(n):
        for col in block_columns(spec, f, int(sub[i]), int(group_of[i])).tolist():
            owner[int(h[idx[i]]), col] = i
    bit = where % (8 * m * host.shape[1])
    row, col = int(h[bit // (8 * host.shape[1])]), (bit // 8) % host.shape[1]
    host[row, col] ^= 1 << (bit % 8)
    dst = np.setdiff1d(np.arange(spec.num_blocks), g)[:n]
    expect = [owner[row, col]] if (row, col) in owner else []
    assert load(engine, 2, dst, h, skip, sizes, ident) == (expect, 0), (row, col, bit % 8)
    engine.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["kernel", "dma"])
@pytest.mark.parametrize("fmt", ["block_first", "kv_first-groups", "canonical-slots"])
def test_on_a_gpu_the_compiled_checks_agree_with_the_reference(make_host_cache, fmt, path):
    """Compiled (sm_90 on the lease's H100): the checksums a store writes equal the NumPy reference (so the
    interpreter's), the direct launch of the checked variants was proven on the canary, an intact load passes and a
    flipped bit fails exactly its block, on both paths."""
    from triton_offload.cuda_driver import CudaError

    cpu = make_spec(fmt, seed=11, num_blocks=40)
    layout = cpu.layout
    caches = [t.cuda() for t in cpu.kv_caches]
    if fmt.endswith("-slots"):
        spec = to.KVCacheSpec(caches, layout, host_slots=cpu.host_slots)
    else:
        spec = to.KVCacheSpec(caches, layout, groups=cpu.groups)
    f, skip, n = 2, 1, 16
    sizes, group_of = group_layout(spec, n)
    idx, sub, m = positions(n, f, skip, sizes)
    cache = make_host_cache(spec.host_block_bytes(f), num_blocks=m + 2, pin=True, integrity="verify", checksum_blocks=f)
    try:
        engine = TransferEngine(spec, cache.buffer, blocks_per_host_block=f, path=path, checksums=cache.checksums)
    except ValueError as e:  # the copy engines need cuMemcpyBatchAsync (CUDA >= 12.8)
        if path == "dma" and isinstance(e.__cause__, CudaError):
            pytest.skip(str(e))
        raise
    assert set(engine.launch_paths.values()) == {"direct"}, engine.launch_paths
    rng = np.random.default_rng(3)
    g = rng.permutation(spec.num_blocks // 2)[:n]
    h = rng.permutation(m + 2)[:m]
    ident = rng.integers(-(2**63), 2**63 - 1, size=m, dtype=np.int64)
    engine.submit_store(1, g, h, skip=skip, group_sizes=sizes, identities=ident)
    engine.wait([1])
    finished(engine, 1)
    cfg = engine._launcher.config(Direction.STORE)
    kw = dict(word_bytes=cfg.elem, group_words=cfg.vec, blocks_per_host_block=f, skip=skip, groups=spec.groups,
              group_sizes=sizes)  # fmt: skip
    rr, cols, rc = checksums_ref([t.cpu() for t in caches], layout, g, h, identities=ident, **kw)
    assert torch.equal(cache.checksums.table[rr, cols], torch.from_numpy(rc))
    dst = spec.num_blocks // 2 + rng.permutation(spec.num_blocks // 2)[:n]

    def checked_load(job):
        engine.submit_load(job, dst, h, skip=skip, group_sizes=sizes, identities=ident)
        engine.wait([job])
        failed, unchecked = engine.load_failures(finished(engine, job))
        return sorted(failed.positions.tolist()), unchecked

    assert checked_load(2) == ([], 0)
    cols = block_columns(spec, f, int(sub[5]), int(group_of[5]))
    cache.buffer[int(h[idx[5]]), cols[len(cols) // 2]] ^= 0x04
    assert checked_load(3) == ([5], 0)
    engine.shutdown()


def test_a_plan_names_the_host_block_of_each_gpu_block_by_the_position_rule():
    """TransferPlan.host_index, which a failed load's blocks are named by: two groups, 3 blocks from sub-block 1 of
    f=2 (host ids 0, 1), then 2 blocks from sub-block 0 (host id 2); a group that moves nothing has no host id."""
    from triton_offload.plan import TransferPlan

    def zeros(n):
        return np.zeros(n, dtype=np.int64)

    plan = TransferPlan(Direction.LOAD, zeros(5), zeros(3), 5, 3, (3, 2), (1, 0), (2, 1), 0)
    assert plan.host_index(2).tolist() == [0, 1, 1, 2, 2]
    assert TransferPlan(Direction.LOAD, zeros(2), zeros(1), 2, 1, (0, 2), (0, 1), (0, 1), 0).host_index(3).tolist() == [
        0,
        0,
    ]
    assert TransferPlan(Direction.LOAD, zeros(4), zeros(2), 4, 2, (4,), (3,), (2,), 0).host_index(4).tolist() == [
        0,
        1,
        1,
        1,
    ]


# 1.5 KiB segments: several steps a tile at the checked shapes, odd and even counts.
LONG_PAGE = dict(block_size=16, heads=3, head_dim=16)


@pytest.mark.parametrize("groups", [None, [[0, 2], [1]]], ids=["1group", "groups"])
def test_a_checked_load_reads_ahead_over_any_number_of_steps(groups):
    """A checked load reads each step's host words a step before it writes and sums them, two steps a trip
    (kernels/copy_blocks.py): with 1 to 24 steps a segment (odd counts leave a trip's second step empty) and 1 to 5
    programs, an intact load passes with the stored bytes, and a bit flipped in a block's last step fails it alone."""
    spec = to.KVCacheSpec(make_caches("kv_first", 3, 12, LONG_PAGE, torch.bfloat16, seed=3), "kv_first", groups=groups)
    f, skip, n = 2, 1, 5
    sizes, group_of = group_layout(spec, n)
    idx, sub, m = positions(n, f, skip, sizes)
    g, dst, h = np.array([9, 2, 11, 0, 5]), np.array([1, 3, 4, 6, 7]), np.arange(m)
    ident = np.arange(m, dtype=np.int64) + 7
    host = host_buffer(spec, m, f)
    checks = Checksums.allocate("verify", m, f, pin=False, regions=spec.num_regions)
    planner = TransferPlanner(spec, m, f)
    store = planner.plan(g, h, direction=Direction.STORE, skip=skip, group_sizes=sizes, identities=ident)
    KernelIssuer(CopyLauncher(spec, host, f, Direction.STORE, checksums=checks), None, 2).issue(store)
    plan = planner.plan(dst, h, direction=Direction.LOAD, skip=skip, group_sizes=sizes, identities=ident)
    width = tables.access_width(spec, host)
    steps = []
    for tile, ctas in [(64, 1), (128, 5), (512, 2), (2048, 3), (64 * 1024, 4)]:
        cfg = shapes.launch_config(spec, width, shapes.LaunchTuning(tile, 4), True)
        steps.append(cfg.n_chunks)
        launcher = CopyLauncher(spec, host, f, Direction.LOAD, configs={Direction.LOAD: cfg}, checksums=checks)
        issuer = KernelIssuer(launcher, None, ctas)

        def checked_load(issuer=issuer) -> list[int]:
            for t in spec.kv_caches:  # kv_first: (K/V, blocks, ...)
                t[:, dst] = 0
            keep = issuer.issue(plan)
            check = issuer.outcome(keep)
            issuer.release(keep)
            assert check.absent.size == 0
            return check.failed.tolist()

        assert checked_load() == [], cfg
        for i in range(n):
            for layer in spec.groups[group_of[i]]:
                t = spec.kv_caches[layer]
                assert torch.equal(index_block(spec, t, dst[i]), index_block(spec, t, g[i])), (cfg, i)
        row, col = int(h[idx[3]]), int(block_columns(spec, f, int(sub[3]), int(group_of[3]))[-1])
        host[row, col] ^= 0x10
        assert checked_load() == [3], cfg
        host[row, col] ^= 0x10
    assert max(steps) >= 4 and any(s > 1 and s % 2 for s in steps), steps
