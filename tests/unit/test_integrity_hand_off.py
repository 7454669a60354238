"""The integrity checks' hand-off between programs (issue 59): every program adds its rows' partial sums with relaxed
atomics over contiguous tiles, finalises (store) or verifies (load) the blocks it holds all of, and counts itself into
the counter of each block it shares with an acquire-release atomic, the last to count finalising it; a load's last
program to count itself done writes the totals. Many blocks across many tiles and programs, repeated, each store's
checksums compared with the NumPy reference and each load found intact: a missing fence or a relaxed counter shows as
a wrong or failed block in some repeat. Compiled with -m gpu (~1000 blocks, 8-32 programs, 100 repeats); the same
test runs small under Triton's interpreter, with blocks shared by two and by three programs and a program past the
last item."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import triton_offload as to
from triton_offload.checksums import Checksums
from triton_offload.engine import TransferEngine
from triton_offload.issuers import kernel as kernel_issuer
from triton_offload.kernels.reference import checksums_ref
from triton_offload.plan import Direction

from kv_factory import host_buffer, make_caches

PAGE = dict(block_size=16, heads=1, head_dim=64)  # 2 KiB K and V pages: many rows a tile, many tiles a launch


def _ok(engine, job):
    engine.wait([job])
    (result,) = [r for r in engine.get_finished() if r.job_id == job]
    assert result.ok, result.error
    return result


def hand_off(device: str, n: int, programs: int, repeats: int, host=None, layout="block_first", layers=4):
    """``repeats`` stores of ``n`` blocks (f = 2, skip 1, random identities) by ``programs`` programs, each store's
    checksum table equal to the reference, each load of them back flagging nothing and restoring every byte. Returns
    the launch's :func:`geometry`, then the engine (shut down), the checksum table's cells of the blocks and the
    loads' arguments, for a caller's further load."""
    caches = make_caches(layout, layers, 2 * n + 2, PAGE, torch.bfloat16, seed=programs, device=device)
    spec = to.KVCacheSpec(caches, layout)
    f, skip = 2, 1
    m = -(-(n + skip) // f)
    if host is None:
        host = host_buffer(spec, m, f)
        checks = Checksums.allocate("require", m, f, pin=False)
    else:
        host, checks = host(spec, m, f)
    engine = TransferEngine(spec, host, blocks_per_host_block=f, path="kernel", checksums=checks, num_ctas=programs)
    rng = np.random.default_rng(programs)
    g, dst = np.split(rng.permutation(2 * n), 2)
    h = rng.permutation(m)
    ident = rng.integers(-(2**63), 2**63 - 1, size=m, dtype=np.int64)
    cfg = engine._launcher.config(Direction.STORE)
    cpu = [t.cpu() for t in caches]
    kw = dict(word_bytes=cfg.elem, group_words=cfg.vec, blocks_per_host_block=f, skip=skip)
    rows, cols, want = checksums_ref(cpu, layout, g, h, identities=ident, **kw)
    want = torch.from_numpy(want)
    for r in range(repeats):
        checks.table.zero_()
        engine.submit_store(2 * r, g, h, skip=skip, identities=ident)
        _ok(engine, 2 * r)
        assert torch.equal(checks.table[rows, cols], want), f"repeat {r}: a store's checksums differ"
        by_block = [t.transpose(0, 1) if layout == "kv_first" else t for t in caches]  # views: blocks first
        for t in by_block:
            t[torch.as_tensor(dst, device=device)] = 0
        engine.submit_load(2 * r + 1, dst, h, skip=skip, identities=ident)
        failed, unchecked = engine.load_failures(_ok(engine, 2 * r + 1))
        assert (failed.positions.tolist(), unchecked) == ([], 0), f"repeat {r}: an intact load failed"
        for t in by_block:  # compared as bits: random pages hold NaNs
            bits = t.view(torch.int16)
            assert torch.equal(bits[torch.as_tensor(dst, device=device)], bits[torch.as_tensor(g, device=device)])
    engine.shutdown()
    shape = geometry(n * len(spec.segments), len(spec.segments), cfg.rows, programs)
    return shape, (spec, host, checks, (rows, cols), (dst, h, dict(skip=skip, identities=ident)))


def geometry(n_items: int, per_block: int, rows: int, programs: int) -> tuple[int, int, list[int]]:
    """(most programs sharing a block, programs holding no item, the blocks programs share) of a checked launch:
    contiguous tiles of ``rows`` items, as many a program as the launch's arguments say (kernels/copy_blocks.py)."""
    n_tiles = -(-n_items // rows)
    programs = max(1, min(programs, n_tiles))
    span = -(-n_tiles // programs) * rows
    sharers = [(b * per_block + per_block - 1) // span - b * per_block // span + 1 for b in range(n_items // per_block)]
    idle = sum(1 for p in range(programs) if p * span >= n_items)
    return max(sharers), idle, [b for b, k in enumerate(sharers) if k > 1]


@pytest.mark.parametrize("programs", [1, 3])
def test_the_hand_off_under_the_interpreter(programs):
    """Small: 24 blocks, 2 repeats (the rows of the store and the load split over 1 and 3 programs)."""
    (_, idle, shared), _ = hand_off("cpu", 24, programs, 2)
    assert (idle, shared) == (0, [])  # 8 blocks of 8 rows a 64-row tile: the shared blocks' case is below


@pytest.mark.parametrize(
    "layers,n,programs,want",
    [(3, 50, 4, (2, 1)), (65, 2, 5, (3, 0))],
    ids=["shared-by-two-and-an-idle-program", "shared-by-three"],
)
def test_a_shared_block_is_finalised_once_by_the_last_program_to_add_to_it(monkeypatch, layers, n, programs, want):
    """Blocks of 2 x layers rows (KV-first): 6 rows, whose 50 blocks' 64-row tiles fall mid-block, over 4 programs of
    two tiles each (the fourth past the last item); 130 rows, each block over three programs of one tile. Then each
    shared block's stored checksum is changed: a load fails exactly those, and the launch's totals (which the host
    reads first) count each once."""
    (sharers, idle, shared), state = hand_off("cpu", n, programs, 1, layout="kv_first", layers=layers)
    assert (sharers, idle) == want and shared
    load_with_shared_blocks_changed(monkeypatch, programs, shared, state)


def load_with_shared_blocks_changed(monkeypatch, programs: int, shared: list[int], state) -> None:
    """Each shared block's stored checksum changed (``state``: what :func:`hand_off` returned after its geometry): a
    load fails exactly those, and the launch's totals (which the host reads first) count each once."""
    spec, host, checks, (rows, cols), (dst, h, kw) = state
    totals = []
    real = kernel_issuer.load_check
    monkeypatch.setattr(kernel_issuer, "load_check", lambda keep: totals.append(keep.res[:2].tolist()) or real(keep))
    checks.table[rows[shared], cols[shared]] ^= 1
    engine = TransferEngine(spec, host, blocks_per_host_block=2, path="kernel", checksums=checks, num_ctas=programs)
    engine.submit_load(1, dst, h, **kw)
    failed, unchecked = engine.load_failures(_ok(engine, 1))
    engine.shutdown()
    assert (failed.positions.tolist(), unchecked, totals) == (shared, 0, [[len(shared), 0]])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "layout,layers,n,programs,sharers",
    [("block_first", 3, 1100, 8, 2), ("block_first", 3, 1100, 16, 2), ("block_first", 3, 1100, 32, 2),
     ("kv_first", 65, 15, 32, 3)],
    ids=["1100x3-8", "1100x3-16", "1100x3-32", "15x65-32"],
)  # fmt: skip
def test_on_a_gpu_the_hand_off_holds_over_many_programs_and_repeats(
    monkeypatch, make_host_cache, layout, layers, n, programs, sharers
):
    """1100 blocks of 3 layers (6600 rows of 2 KiB; 6 rows a block, so programs' tiles end mid-block), and 15
    blocks of 130 rows each over three programs: 100 repeats of a store and a load, then a load with each shared
    block's checksum changed."""

    def pinned(spec, m, f):
        cache = make_host_cache(
            spec.host_block_bytes(f), num_blocks=m, pin=True, integrity="require", checksum_blocks=f
        )
        return cache.buffer, cache.checksums

    (most, _, shared), state = hand_off("cuda", n, programs, 100, host=pinned, layout=layout, layers=layers)
    assert most >= sharers and shared
    load_with_shared_blocks_changed(monkeypatch, programs, shared, state)
