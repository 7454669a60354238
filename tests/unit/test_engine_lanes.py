"""The transfer engine's lanes on CPU, with the job tracker's CUDA calls replaced by stand-ins (as
tests/unit/test_jobs.py does): an expedited load has a stream of its own and completes while an earlier load is held
back; and the ordering invariant between the store and load lanes, shown broken and guarded.

The invariant (triton_offload/engine.py, where the lanes are made): a GPU block a pending store still reads is not
overwritten before that store completes. vLLM keeps it (it flushes and waits for such a store before it submits the
step's transfers); the engine also orders a load after a pending store of the same blocks. The last test runs both
lanes on a small stream simulator in the order a GPU may run them, and shows the stored bytes corrupted without that
ordering and intact with it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sim_cuda import SimEngine, lane_stream
from test_jobs import FakeCuda

from triton_offload.engine import EXPEDITED, LANES, LOAD, STORE, TransferEngine
from triton_offload.jobs import JobTracker

from kv_factory import make_caches


def _engine(make_host_cache, cuda=None, simulated=False):
    """A CPU engine (kernel path) whose tracker runs on a CUDA stand-in (the engine's ``tracker=``): jobs stay
    pending until the test says. ``simulated``: on the stream simulator instead, its issuers' work deferred until
    their stream runs (tests/unit/sim_cuda.py); the engine's ``sim``."""
    caches = make_caches("canonical", 2, 16, dict(page_bytes=32), torch.int8, seed=1)
    from triton_offload.layouts import KVCacheSpec

    spec = KVCacheSpec(caches, "canonical")
    host = make_host_cache(spec.host_block_bytes(1), num_blocks=8, pin=False)
    if simulated:
        eng = SimEngine(spec, host.buffer, path="kernel", fast_launch=False)
        return eng, eng.sim, caches, host.buffer
    cuda = cuda or FakeCuda()
    tracker = JobTracker(torch.device("cuda", 0), LANES, name="the transfer engine", cuda=cuda)
    eng = TransferEngine(spec, host.buffer, path="kernel", fast_launch=False, tracker=tracker)
    return eng, cuda, caches, host.buffer


def _job(eng, job_id):
    return next(j for q in eng._tracker._pending.values() for j in q if j.job_id == job_id)


def test_an_expedited_load_completes_while_an_earlier_load_is_held_back(make_host_cache):
    """vLLM 0.33 waits only for its synchronous (expedited) loads before the forward pass. On the load lane, one
    would complete only after every earlier asynchronous load (one stream, in order); on its own lane it completes,
    and is waited for, while they are held back."""
    eng, sim, caches, host = _engine(make_host_cache, simulated=True)
    host[:3] = torch.arange(3 * host.shape[1], dtype=torch.int64).view(3, -1).to(torch.uint8)
    sim.held.add(lane_stream(eng, LOAD).name)  # asynchronous loads are slow
    eng.submit_load(1, [3], [0])
    eng.submit_load(2, [4], [1], expedited=True)
    eng.submit_load(3, [5], [2])
    assert lane_stream(eng, EXPEDITED) is not lane_stream(eng, LOAD)
    eng.wait([2])  # what vLLM's worker does for its synchronous loads: the simulator fails it if it would block
    assert torch.equal(torch.cat([c[4] for c in caches]).view(torch.uint8), host[1]), "the expedited load ran"
    assert not torch.equal(torch.cat([c[3] for c in caches]).view(torch.uint8), host[0]), "job 1 is held back"
    assert [r.job_id for r in eng.get_finished()] == [2]
    sim.held.clear()
    eng.wait([1, 3])
    assert [r.job_id for r in eng.get_finished()] == [1, 3]
    assert set(LANES) == {STORE, LOAD, EXPEDITED}


def test_a_load_into_blocks_a_pending_store_reads_waits_for_that_store(make_host_cache, caplog):
    """The guard: a load overwriting a GPU block that a pending store reads makes its stream wait for that store's
    end (and says so); a load into other blocks, or after the store was reported, does not wait."""
    eng, cuda, *_ = _engine(make_host_cache)
    eng.submit_store(1, [5, 6], [0, 1])
    store_end = _job(eng, 1).end.name
    since = len(cuda.log)
    eng.submit_load(2, [7, 8], [2, 3])
    assert ("wait", store_end, "side1") not in cuda.log[since:], "an unrelated load must not wait for the store"
    since = len(cuda.log)
    eng.submit_load(3, [9, 6], [2, 3], expedited=True)
    waits = [ev for ev in cuda.log[since:] if ev[0] == "wait"]
    assert waits[-1] == ("wait", store_end, "side2"), "the load must follow the store that reads block 6"
    assert eng.ordered_loads == 1 and "store job 1 still reads" in caplog.text
    for j in (1, 2, 3):
        _job(eng, j).end.done = True
    eng.get_finished()
    since = len(cuda.log)
    eng.submit_load(4, [6], [0])
    assert ("wait", store_end, "side1") not in cuda.log[since:], "the store was reported complete: nothing to wait for"


def test_a_store_waited_for_as_vllm_flushes_it_needs_no_ordering(make_host_cache, caplog):
    """vLLM's own order: a block whose store is pending is handed out again only after the store is flushed and
    waited for (jobs_to_flush, then wait), and the load follows in the same step, before any get_finished: no
    device wait is added and nothing is logged."""
    eng, cuda, *_ = _engine(make_host_cache)
    eng.submit_store(1, [5, 6], [0, 1])
    eng.wait([1])
    since = len(cuda.log)
    eng.submit_load(2, [6], [2])
    assert [ev for ev in cuda.log[since:] if ev[0] == "wait"] == [("wait", "e1", "side1")], "only the compute fence"
    assert eng.ordered_loads == 0 and "still reads" not in caplog.text


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_a_load_overtaking_a_pending_store_of_its_block_corrupts_the_stored_bytes(make_host_cache, guarded):
    """Block 5 holds A; a store of block 5 into host row 0 is pending when a load of host row 1 (B) into block 5 is
    submitted, and the device runs the load lane first. Unguarded (the invariant broken: nothing orders the lanes),
    the store then reads B: host row 0 holds the wrong request's KV. Guarded, the load waits for the store."""
    eng, sim, caches, host = _engine(make_host_cache, simulated=True)
    if not guarded:
        eng._stores_reading = lambda ids: ()
    a = [c[5].clone() for c in caches]
    host[1] = torch.arange(host.shape[1], dtype=torch.uint8)  # B: what the load brings
    eng.submit_store(1, [5], [0])
    eng.submit_load(2, [5], [1])
    sim.run(sim.compute)
    load_stream, store_stream = lane_stream(eng, LOAD), lane_stream(eng, STORE)
    sim.run(load_stream)
    ran_first = not load_stream.ops
    sim.run(store_stream)
    sim.run(load_stream)
    stored = host[0].view(2, 32)
    if guarded:
        assert not ran_first, "the load must wait for the store on the device"
        assert all(torch.equal(stored[i], a[i].view(torch.uint8)) for i in range(2)), "the store saved A"
    else:
        assert ran_first
        assert torch.equal(stored.reshape(-1), host[1]), "the store read the load's bytes: corrupted"
    assert np.array_equal(torch.cat([c[5] for c in caches]).view(torch.uint8).numpy(), host[1].numpy())
