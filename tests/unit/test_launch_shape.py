"""The kernel's launch shape (issue 38, section 3): "fixed" launches num_ctas programs (or the default's), "size-aware"
picks them from the caches' page runs, never above num_ctas and never above the launch's tiles. Either way the same
bytes move; the GPU run's launch-shape stage measures whether it pays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import triton_offload as to
from triton_offload.engine import TransferEngine
from triton_offload.issuers.launcher import CopyLauncher
from triton_offload.kernels import copy_blocks, shapes

from kv_factory import make_caches

SMALL = dict(block_size=8, heads=2, head_dim=64)  # 2 KiB K and V runs: 32 rows per 64 KiB tile
LARGE = dict(block_size=16, heads=2, head_dim=128)  # 8 KiB K and V runs


@pytest.fixture
def launches(monkeypatch):
    """The programs of every kernel launch, recorded on their way to Triton."""
    seen: list[int] = []
    real = copy_blocks.launch

    def record(programs, args, num_warps, cuda):
        seen.append(programs)
        return real(programs, args, num_warps, cuda)

    monkeypatch.setattr(copy_blocks, "launch", record)
    return seen


def _spec(page, num_layers=4, num_blocks=96, layout="kv_first", seed=0):
    return to.KVCacheSpec(make_caches(layout, num_layers, num_blocks, page, torch.bfloat16, seed=seed), layout)


def _host(spec, rows):
    return torch.full((rows, spec.host_block_bytes(1)), 0xA5, dtype=torch.uint8)


def test_programs_follow_the_page_runs_and_never_exceed_num_ctas():
    ctas = shapes.size_aware_ctas
    assert [ctas(b) for b in (32, 1024, 4095, 4096, 8191, 8192, 72 * 1024)] == [16, 16, 16, 8, 8, 4, 4]
    assert [ctas(1024, n) for n in (1, 4, 8, 16, 32)] == [1, 4, 8, 16, 16]
    assert ctas(16 * 1024, 2) == 2 and ctas(16 * 1024, 32) == shapes.DEFAULT_NUM_CTAS
    small, large = _spec(SMALL, num_blocks=2), _spec(LARGE, num_blocks=2)
    host_s, host_l = _host(small, 2), _host(large, 2)
    assert CopyLauncher(small, host_s, 1).segment_bytes == 2048
    assert CopyLauncher(large, host_l, 1).segment_bytes == 8192
    assert CopyLauncher(small, host_s, 1).ctas(None, "size-aware") == 16
    assert CopyLauncher(small, host_s, 1).ctas(None, "fixed") is None  # the kernel's default, as before
    assert CopyLauncher(small, host_s, 1).ctas(6, "fixed") == 6
    assert CopyLauncher(large, host_l, 1).ctas(None, "size-aware") == shapes.DEFAULT_NUM_CTAS


@pytest.mark.parametrize("num_ctas,want", [(None, 16), (8, 8), (2, 2)])
def test_a_size_aware_launch_moves_the_same_bytes_with_its_programs(launches, num_ctas, want):
    spec = _spec(SMALL)  # 96 blocks x 8 runs = 768 rows, 24 tiles of 32 rows: more tiles than any shape's programs
    rng = np.random.default_rng(1)
    g = rng.permutation(spec.num_blocks)[:80]
    h = rng.permutation(100)[:80]
    fixed, sized = _host(spec, 100), _host(spec, 100)
    to.gather_blocks(spec, g, fixed, h, num_ctas=num_ctas)
    to.gather_blocks(spec, g, sized, h, num_ctas=num_ctas, launch_shape="size-aware")
    assert launches == [num_ctas or shapes.DEFAULT_NUM_CTAS, want]
    assert torch.equal(fixed, sized)
    back = _spec(SMALL, seed=9)  # other bytes, same geometry: the load must overwrite exactly the stored blocks
    to.scatter_blocks(sized, h, back, g, num_ctas=num_ctas, launch_shape="size-aware")
    assert launches[-1] == want
    for mine, theirs in zip(back.kv_caches, spec.kv_caches):  # as bits: random bf16 patterns hold NaNs
        assert torch.equal(mine.view(torch.int16)[:, g], theirs.view(torch.int16)[:, g])


def test_a_launch_never_has_more_programs_than_tiles(launches):
    spec = _spec(SMALL, num_blocks=8)  # 3 blocks x 8 runs of 2 KiB: one tile
    host = _host(spec, 4)
    to.gather_blocks(spec, [1, 5, 2], host, [0, 3, 1], launch_shape="size-aware")
    assert launches == [1]


def test_the_engine_launches_with_its_shape_both_ways(launches, make_host_cache):
    spec = _spec(SMALL, num_blocks=160)  # 80 of them moved: 640 rows, 20 tiles
    cache = make_host_cache(spec.host_block_bytes(1), 100 * spec.host_block_bytes(1), pin=False)
    engine = TransferEngine(spec, cache.buffer, launch_shape="size-aware", path="kernel")
    originals = [t.view(torch.int16).clone() for t in spec.kv_caches]  # as bits: random bf16 patterns hold NaNs
    g, h = np.arange(0, 160, 2), np.arange(80)
    engine.submit_store(1, g, h)
    assert [r.ok for r in engine.get_finished()] == [True]
    for t in spec.kv_caches:
        t.zero_()
    engine.submit_load(2, g, h)
    assert [r.ok for r in engine.get_finished()] == [True]
    assert launches == [16, 16]
    for t, o in zip(spec.kv_caches, originals):
        assert torch.equal(t.view(torch.int16)[:, g], o[:, g]) and not t.view(torch.int16)[:, 1::2].any()
    engine.shutdown()
    assert TransferEngine(spec, cache.buffer, path="kernel").launch_shape == "fixed"  # the default


def test_an_unknown_launch_shape_is_refused_with_nothing_written(make_host_cache):
    spec = _spec(SMALL, num_blocks=8)
    host = _host(spec, 4)
    before = host.clone()
    with pytest.raises(ValueError, match=r"launch_shape = 'adaptive' must be one of 'fixed', 'size-aware'"):
        to.gather_blocks(spec, [1, 2], host, [0, 1], launch_shape="adaptive")
    assert torch.equal(host, before)
    cache = make_host_cache(spec.host_block_bytes(1), 4 * spec.host_block_bytes(1), pin=False)
    with pytest.raises(ValueError, match=r"launch_shape = None must be one of"):
        TransferEngine(spec, cache.buffer, launch_shape=None, path="kernel")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["kv_first", "block_first"])
def test_on_a_gpu_the_size_aware_launch_moves_the_bytes_the_fixed_one_does(layout):
    """Compiled, on pinned memory, at the size-aware shape's own case (2 KiB runs: 16 programs; 1024 blocks of 32
    layers)."""
    from kv_factory import host_buffer

    page = dict(block_size=8, heads=1, head_dim=64) if layout == "block_first" else SMALL
    caches = make_caches(layout, 32, 1100, page, torch.bfloat16, device="cuda", seed=3)
    spec = to.KVCacheSpec(caches, layout)
    rng = np.random.default_rng(3)
    g, h = rng.permutation(1100)[:1024], rng.permutation(1030)[:1024]
    fixed, sized = host_buffer(spec, 1030, 1, pin=True), host_buffer(spec, 1030, 1, pin=True)
    to.gather_blocks(spec, g, fixed, h)
    to.gather_blocks(spec, g, sized, h, launch_shape="size-aware")
    torch.cuda.synchronize()
    assert torch.equal(fixed, sized)
    back = to.KVCacheSpec(make_caches(layout, 32, 1100, page, torch.bfloat16, device="cuda", seed=4), layout)
    engine = TransferEngine(back, sized, launch_shape="size-aware", path="kernel")
    engine.submit_load(1, g, h)
    engine.wait([1])
    assert [r.ok for r in engine.get_finished()] == [True]
    for mine, theirs in zip(back.kv_caches, spec.kv_caches):
        block = 0 if layout == "block_first" else 1
        assert torch.equal(mine.view(torch.int16).index_select(block, torch.from_numpy(g).cuda()),
                           theirs.view(torch.int16).index_select(block, torch.from_numpy(g).cuda()))  # fmt: skip
    engine.shutdown()
