"""The integrity checks' hand-off between programs (issue 59): every program adds its rows' partial sums with relaxed
atomics, counts itself done with an acquire-release atomic, and the last one finalises (store) or verifies (load)
every block. Many blocks across many tiles and programs, repeated, each store's checksums compared with the NumPy
reference and each load found intact: a missing fence or a relaxed counter shows as a wrong or failed block in some
repeat. Compiled with -m gpu (~1000 blocks, 8-32 programs, 100 repeats); the same test runs small under Triton's
interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import triton_offload as to
from triton_offload.checksums import Checksums
from triton_offload.engine import TransferEngine
from triton_offload.kernels.reference import checksums_ref
from triton_offload.plan import Direction

from kv_factory import host_buffer, make_caches

PAGE = dict(block_size=16, heads=1, head_dim=64)  # 2 KiB K and V pages: many rows a tile, many tiles a launch


def _ok(engine, job):
    engine.wait([job])
    (result,) = [r for r in engine.get_finished() if r.job_id == job]
    assert result.ok, result.error
    return result


def hand_off(device: str, n: int, programs: int, repeats: int, host=None) -> None:
    """``repeats`` stores of ``n`` blocks (f = 2, skip 1, random identities) by ``programs`` programs, each store's
    checksum table equal to the reference, each load of them back flagging nothing and restoring every byte."""
    caches = make_caches("block_first", 4, 2 * n + 2, PAGE, torch.bfloat16, seed=programs, device=device)
    spec = to.KVCacheSpec(caches, "block_first")
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
    rows, cols, want = checksums_ref(cpu, "block_first", g, h, identities=ident, **kw)
    want = torch.from_numpy(want)
    for r in range(repeats):
        checks.table.zero_()
        engine.submit_store(2 * r, g, h, skip=skip, identities=ident)
        _ok(engine, 2 * r)
        assert torch.equal(checks.table[rows, cols], want), f"repeat {r}: a store's checksums differ"
        for t in caches:
            t[torch.as_tensor(dst, device=device)] = 0
        engine.submit_load(2 * r + 1, dst, h, skip=skip, identities=ident)
        failed, unchecked = engine.load_failures(_ok(engine, 2 * r + 1))
        assert (failed.positions.tolist(), unchecked) == ([], 0), f"repeat {r}: an intact load failed"
        for t in caches:  # compared as bits: random pages hold NaNs
            bits = t.view(torch.int16)
            assert torch.equal(bits[torch.as_tensor(dst, device=device)], bits[torch.as_tensor(g, device=device)])
    engine.shutdown()


@pytest.mark.parametrize("programs", [1, 3])
def test_the_hand_off_under_the_interpreter(programs):
    """Small: 24 blocks, 2 repeats (the rows of the store and the load split over 1 and 3 programs)."""
    hand_off("cpu", 24, programs, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [8, 16, 32])
def test_on_a_gpu_the_hand_off_holds_over_many_programs_and_repeats(make_host_cache, programs):
    """1000 blocks of 4 layers (8000 rows of 2 KiB), 100 repeats of a store and a load."""

    def pinned(spec, m, f):
        cache = make_host_cache(
            spec.host_block_bytes(f), num_blocks=m, pin=True, integrity="require", checksum_blocks=f
        )
        return cache.buffer, cache.checksums

    hand_off("cuda", 1000, programs, 100, host=pinned)
