"""Stream orderings and pooling of the transfer engine on CUDA. Run with -m gpu."""

from __future__ import annotations

import pytest
import torch

import triton_offload as to
from triton_offload.engine import TransferEngine
from triton_offload.host_cache import HostCache

from kv_factory import make_caches

pytestmark = pytest.mark.gpu

PAGE = dict(block_size=16, heads=8, head_dim=128)  # 64 KiB pages
SLEEP_CYCLES = 200_000_000  # ~0.1 s at 2 GHz: long enough that an unordered transfer would overtake it


def make(layers=4, num_blocks=64, host_blocks=64):
    caches = make_caches("block_first", layers, num_blocks, PAGE, torch.bfloat16, device="cuda")
    spec = to.KVCacheSpec(caches, "block_first")
    cache = HostCache(spec.host_block_bytes(1), host_blocks * spec.host_block_bytes(1))
    return caches, spec, cache, TransferEngine(spec, cache.buffer)


def test_store_waits_for_the_compute_stream():
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


def test_load_waits_for_compute_and_loads_stay_in_order():
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


def test_get_finished_does_not_block_on_a_long_transfer():
    caches, spec, cache, eng = make()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES * 5)  # the store cannot start before this ends
    eng.submit_store(1, list(range(64)), list(range(64)))
    assert eng.get_finished() == []  # returned while the job is still queued
    assert eng.num_pending == 1
    eng.wait([1])
    assert [r.job_id for r in eng.get_finished()] == [1]


def test_pooled_events_and_id_buffers_are_reused():
    caches, spec, cache, eng = make()
    for job in range(50):
        eng.submit_store(job, [job % 64], [job % 64])
        eng.wait([job])
        eng.get_finished()
    assert len(eng._id_pool) == 1 and len(eng._events) == 2
    pooled = eng._id_pool[0]
    eng.submit_load(99, [1, 2, 3], [1, 2, 3])
    eng.wait([99])
    (res,) = eng.get_finished()
    assert res.ok and res.num_bytes == 3 * spec.bytes_per_block and res.seconds > 0
    assert eng._id_pool == [pooled]


def test_kernel_reaches_every_registration_chunk(monkeypatch):
    """The kernel addresses the host cache from its base, across separately registered chunks: that holds only if
    registered memory is mapped at its host address (unified addressing). Stores and loads hit blocks in each chunk."""
    from triton_offload import host_cache

    monkeypatch.setattr(host_cache, "REGISTER_CHUNK_BYTES", 1 << 20)
    caches = make_caches("block_first", 4, 64, PAGE, torch.bfloat16, device="cuda")  # 256 KiB host blocks
    spec = to.KVCacheSpec(caches, "block_first")
    cache = HostCache(spec.host_block_bytes(1), num_blocks=32)  # 8 MiB: 8 chunks of 4 blocks
    assert len(cache._registered) == 8
    eng = TransferEngine(spec, cache.buffer)
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
    cache.close()
