"""Stream orderings and pooling of the transfer engine on CUDA. Run with -m gpu."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import triton_offload as to
from triton_offload.engine import LOAD, STORE, TransferEngine
from triton_offload.kernels.reference import gather_blocks_ref

from kv_factory import SENTINEL, make_caches

pytestmark = pytest.mark.gpu

PAGE = dict(block_size=16, heads=8, head_dim=128)  # 64 KiB pages
SLEEP_CYCLES = 200_000_000  # ~0.1 s at 2 GHz: long enough that an unordered transfer would overtake it


def warm_up(eng: TransferEngine, block: int, host_block: int) -> None:
    """One store and one load, waited for: on the kernel path, compiles both kernel variants. A cold compile takes
    longer than the tests' sleeps, which would then be over before the transfer is launched and test no ordering."""
    eng.submit_store(-1, [block], [host_block])
    eng.submit_load(-2, [block], [host_block])
    eng.wait([-1, -2])
    assert all(r.ok for r in eng.get_finished())


@pytest.fixture(params=["kernel", "dma"])
def make(request, make_host_cache):
    """Engines of each path, pinned: the orderings hold for both, and auto (the CUDA default) would let a
    calibration decide which one a test exercises."""

    def build(layers=4, num_blocks=64, host_blocks=64):
        caches = make_caches("block_first", layers, num_blocks, PAGE, torch.bfloat16, device="cuda")
        spec = to.KVCacheSpec(caches, "block_first")
        cache = make_host_cache(spec.host_block_bytes(1), host_blocks * spec.host_block_bytes(1))
        eng = TransferEngine(spec, cache.buffer, path=request.param)
        warm_up(eng, num_blocks - 1, host_blocks - 1)
        return caches, spec, cache, eng

    return build


def test_store_waits_for_the_compute_stream(make):
    """The model's last write to a block (queued behind a long kernel) is what the store reads."""
    caches, spec, cache, eng = make()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    for c in caches:
        c[5].fill_(3.0)
    eng.submit_store(1, [5], [9])
    eng.wait([1])
    (res,) = eng.get_finished()
    assert res.ok
    want = torch.cat([c[5].contiguous().view(-1).view(torch.uint8).cpu() for c in caches])
    assert torch.equal(cache.buffer[9], want)
    assert bool((want.view(torch.bfloat16) == 3.0).all())


def test_load_waits_for_compute_and_loads_stay_in_order(make):
    """A load lands after the compute stream's earlier writes to its blocks, and a later load is not overtaken."""
    caches, spec, cache, eng = make()
    cache.buffer[0].fill_(0x11)
    cache.buffer[1].fill_(0x22)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    for c in caches:
        c[7].fill_(0.0)  # queued behind the sleep: the loads must not land before it
    eng.submit_load(1, [7], [0])
    eng.submit_load(2, [7], [1])  # same destination: must land last
    eng.wait([1, 2])
    assert [r.job_id for r in eng.get_finished()] == [1, 2]
    for c in caches:
        assert bool((c[7].view(torch.uint8) == 0x22).all())


def test_get_finished_does_not_block_on_a_long_transfer(make):
    caches, spec, cache, eng = make()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES * 5)  # the store cannot start before this ends
    eng.submit_store(1, list(range(64)), list(range(64)))
    assert eng.get_finished() == []  # returned while the job is still queued
    assert eng.num_pending == 1
    eng.wait([1])
    assert [r.job_id for r in eng.get_finished()] == [1]


def test_pooled_events_and_id_buffers_are_reused(make):
    caches, spec, cache, eng = make()  # the warm-up ran one store and one load at once
    for job in range(50):
        eng.submit_store(job, [job % 64], [job % 64])
        eng.wait([job])
        eng.get_finished()
    assert len(eng._tracker._events) == 4
    # The kernel's id slots, one per direction (the copy engines read descriptors built on the host: no slot).
    stagers = {d: eng._issuers[d]["kernel"].stager for d in (STORE, LOAD)} if eng.path == "kernel" else None
    if stagers:
        assert [len(stagers[d]._free) for d in (STORE, LOAD)] == [1, 1]
        pooled = stagers[LOAD]._free[0]
    eng.submit_load(99, [1, 2, 3], [1, 2, 3])
    eng.wait([99])
    (res,) = eng.get_finished()
    assert res.ok and res.num_bytes == 3 * spec.bytes_per_block and res.seconds > 0
    assert len(eng._tracker._events) == 4
    if stagers:
        assert list(stagers[LOAD]._free) == [pooled]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_public_calls_run_on_the_caches_device_whichever_is_current():
    """Caches on cuda:1 while cuda:0 is current: 32 gathers queue behind a long sleep on cuda:1's stream, each with
    other ids. Their launches and slot guards must be on cuda:1's stream (a guard on cuda:0's would let a slot be
    reused while its launch still waits), so every host block holds what its own call asked for."""
    caches = make_caches("block_first", 2, 64, PAGE, torch.bfloat16, device="cuda:1")
    spec = to.KVCacheSpec(caches, "block_first")
    host = torch.full((96, spec.host_block_bytes(1)), SENTINEL, dtype=torch.uint8).pin_memory()
    rng = np.random.default_rng(4)
    calls = [(rng.permutation(64)[:3], np.arange(3 * i, 3 * i + 3)) for i in range(32)]
    with torch.cuda.device(0):
        to.gather_blocks(spec, [0], host, [95])  # compiles outside the sleep
        torch.cuda.synchronize(1)
        with torch.cuda.device(1):
            torch.cuda._sleep(SLEEP_CYCLES)
        for g, h in calls:
            to.gather_blocks(spec, g, host, h)
        assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)
    want = torch.full_like(host, SENTINEL)
    gather_blocks_ref(caches, "block_first", [0], want, [95])
    for g, h in calls:
        gather_blocks_ref(caches, "block_first", g, want, h)
    assert torch.equal(host, want)


def test_public_calls_do_not_block_on_a_busy_stream():
    """gather_blocks / scatter_blocks stage their ids in pinned memory: a copy from pageable memory may wait for the
    stream, which here is busy for ~0.5 s, so the calls must return long before it drains."""
    caches = make_caches("block_first", 4, 64, PAGE, torch.bfloat16, device="cuda")
    spec = to.KVCacheSpec(caches, "block_first")
    host = torch.empty((8, spec.host_block_bytes(1)), dtype=torch.uint8, pin_memory=True)
    # The same calls first: once to compile both variants, then again behind a short sleep, so that the second
    # call finds the first one's pinned staging slot still in use and takes a slot of its own. The timed calls then
    # reuse those two slots and allocate nothing.
    for busy in (False, True):
        if busy:
            torch.cuda._sleep(SLEEP_CYCLES // 10)
        to.gather_blocks(spec, [3, 4], host, [1, 2])
        to.scatter_blocks(host, [1, 2], spec, [5, 6])
        torch.cuda.synchronize()
    done = torch.cuda.Event()
    torch.cuda._sleep(SLEEP_CYCLES * 5)
    to.gather_blocks(spec, [3, 4], host, [1, 2])
    to.scatter_blocks(host, [1, 2], spec, [5, 6])
    done.record()
    assert not done.query(), "a call waited for the stream"
    torch.cuda.synchronize()
    for c in caches:  # bytes, not values: the caches are random bytes, NaN patterns included
        assert torch.equal(c[[5, 6]].view(torch.uint8), c[[3, 4]].view(torch.uint8))


def test_kernel_reaches_every_registration_chunk(monkeypatch, make_host_cache):
    """The kernel addresses the host cache from its base, across separately registered chunks: that holds only if
    registered memory is mapped at its host address (unified addressing). Stores and loads hit blocks in each chunk."""
    from triton_offload.host import registration

    monkeypatch.setattr(registration, "REGISTER_CHUNK_BYTES", 1 << 20)
    caches = make_caches("block_first", 4, 64, PAGE, torch.bfloat16, device="cuda")  # 256 KiB host blocks
    spec = to.KVCacheSpec(caches, "block_first")
    cache = make_host_cache(spec.host_block_bytes(1), num_blocks=32)  # 8 MiB: 8 chunks of 4 blocks
    assert len(cache._registered) == 8
    eng = TransferEngine(spec, cache.buffer, path="kernel")  # the kernel's addressing is what is tested
    hosts = list(range(31, -1, -1))
    eng.submit_store(1, list(range(32)), hosts)
    eng.wait([1])
    want = torch.cat([c[:32].reshape(32, -1).view(torch.uint8) for c in caches], dim=1).cpu()
    assert torch.equal(cache.buffer[hosts], want)
    eng.submit_load(2, list(range(32, 64)), hosts)
    eng.wait([2])
    assert all(r.ok for r in eng.get_finished())
    for c in caches:
        assert torch.equal(c[32:64].view(torch.uint8), c[:32].view(torch.uint8))
    eng.shutdown()
