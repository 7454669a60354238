"""The transfer engine on CPU: round trips by job id, completions once each, wait, failures, shutdown."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import triton_offload as to
from triton_offload.engine import JobResult, TransferEngine
from triton_offload.issuers.launcher import CopyLauncher
from triton_offload.kernels import tables

from kv_factory import SENTINEL, assert_loaded_exactly, make_caches, snapshot

PAGE = dict(block_size=2, heads=2, head_dim=4)


@pytest.fixture
def make_engine(make_host_cache):
    def make(f=1, layout="block_first", num_blocks=16, host_blocks=12, dtype=torch.bfloat16, seed=0):
        caches = make_caches(layout, 3, num_blocks, PAGE, dtype, seed=seed)
        spec = to.KVCacheSpec(caches, layout)
        cache = make_host_cache(spec.host_block_bytes(f), host_blocks * spec.host_block_bytes(f), pin=False)
        return caches, spec, TransferEngine(spec, cache.buffer, blocks_per_host_block=f), cache

    return make


@pytest.mark.parametrize("f,skip", [(1, 0), (2, 1), (4, 0), (4, 3)], ids=lambda v: str(v))
def test_store_then_load_round_trip(f, skip, make_engine):
    caches, spec, eng, _ = make_engine(f=f)
    rng = np.random.default_rng(f + skip)
    n = 7
    g = rng.permutation(spec.num_blocks)[:n]
    h = rng.permutation(12)[: math.ceil((skip + n) / f)]
    eng.submit_store(11, g, h, skip=skip)
    (res,) = eng.get_finished()
    assert res == JobResult(11, True, "store", n * spec.bytes_per_block, res.seconds) and res.seconds >= 0

    originals = [c.clone() for c in caches]
    for c in caches:
        c.untyped_storage().fill_(SENTINEL)
    eng.submit_load(12, g, h, skip=skip)
    (res,) = eng.get_finished()
    assert (res.job_id, res.ok, res.direction) == (12, True, "load")
    assert_loaded_exactly(caches, originals, "block_first", g)
    assert eng.get_finished() == []
    assert eng.shutdown() == []


def test_each_completion_reported_once_in_order(make_engine):
    _, _, eng, _ = make_engine()
    for job in range(5):
        eng.submit_store(job, [job], [job])
    eng.submit_load(100, [3], [0])
    results = eng.get_finished()
    assert [r.job_id for r in results] == [0, 1, 2, 3, 4, 100]
    assert all(r.ok for r in results)
    assert eng.get_finished() == []


def test_wait_on_unknown_or_finished_ids_is_harmless(make_engine):
    _, _, eng, _ = make_engine()
    eng.wait([42])
    eng.submit_store(1, [0, 1], [0, 1])
    eng.wait([1, 42])
    assert [r.job_id for r in eng.get_finished()] == [1]
    eng.wait([1])
    assert eng.get_finished() == []


def test_empty_job_completes_with_zero_bytes(make_engine):
    _, _, eng, _ = make_engine()
    eng.submit_store(5, [], [])
    assert eng.get_finished() == [JobResult(5, True, "store", 0, 0.0)]


def test_bad_ids_raise_at_submit_and_queue_nothing(make_engine):
    _, _, eng, cache = make_engine()
    before = cache.buffer.clone()
    with pytest.raises(ValueError, match=r"host_block_ids\[0\] = 99 is out of range"):
        eng.submit_store(1, [0], [99])
    assert eng.num_pending == 0 and eng.get_finished() == []
    assert torch.equal(before, cache.buffer)


def test_a_pending_job_id_is_refused_at_submit_and_queues_nothing(make_engine):
    """A job id names one result: while a job is pending (submitted, not yet returned by get_finished), a second job
    under its id (either direction) is refused before anything is queued or written; once reported, it may be
    reused."""
    caches, _, eng, cache = make_engine()
    eng.submit_store(7, [0, 1], [0, 1])
    before_host, before_kv = cache.buffer.clone(), snapshot(caches)
    with pytest.raises(ValueError, match=r"job_id = 7 is still pending"):
        eng.submit_store(7, [2], [2])
    with pytest.raises(ValueError, match=r"job_id = 7 is still pending"):
        eng.submit_load(7, [3], [0])
    assert eng.num_pending == 1
    assert torch.equal(before_host, cache.buffer) and all(map(torch.equal, before_kv, snapshot(caches)))
    (done,) = eng.get_finished()
    assert (done.job_id, done.direction, done.num_bytes) == (7, "store", 2 * eng.kv.bytes_per_block)
    eng.submit_load(7, [3], [0])  # reported: the id is free again
    assert [(r.job_id, r.direction, r.ok) for r in eng.get_finished()] == [(7, "load", True)]
    with pytest.raises(TypeError, match="job_id must be an int"):
        eng.submit_store("8", [0], [0])
    assert eng.num_pending == 0


def test_failed_launch_marks_job_failed_and_shutdown_reraises(monkeypatch, make_engine):
    _, _, eng, _ = make_engine()
    eng.submit_store(1, [0], [0])

    def broken(*args, **kwargs):
        raise RuntimeError("launch failed: out of resources")

    monkeypatch.setattr(CopyLauncher, "launch", broken)
    eng.submit_store(2, [1], [1])
    eng.submit_load(3, [2], [0])
    results = {r.job_id: r for r in eng.get_finished()}
    assert results[1].ok and not results[2].ok and not results[3].ok
    assert "out of resources" in results[2].error
    with pytest.raises(RuntimeError, match="a KV transfer failed") as info:
        eng.shutdown()
    assert "out of resources" in str(info.value.__cause__)


def test_shutdown_drains_unreported_work_and_refuses_more(make_engine):
    _, _, eng, _ = make_engine()
    eng.submit_store(1, [0], [0])
    eng.submit_load(2, [1], [0])
    assert [r.job_id for r in eng.shutdown()] == [1, 2]
    with pytest.raises(RuntimeError, match="shut down"):
        eng.submit_store(3, [0], [0])


def test_grouped_jobs_round_trip_and_report_group_bytes(make_host_cache):
    """One job spanning two KV-cache groups (vLLM HMA): bytes counted per group, data back where it came from."""
    caches = make_caches("canonical", 3, 10, dict(page_bytes=64, pad=16), torch.int8, seed=3)
    spec = to.KVCacheSpec(caches, "canonical", groups=[[0, 1], [2]])
    cache = make_host_cache(spec.host_block_bytes(2), 8 * spec.host_block_bytes(2), pin=False)
    eng = TransferEngine(spec, cache.buffer, blocks_per_host_block=2)
    eng.submit_store(1, [4, 7, 1, 9], [5, 2, 6], skip=[1, 0], group_sizes=[3, 1])
    (res,) = eng.get_finished()
    assert res.ok and res.num_bytes == 3 * 128 + 1 * 64
    originals = [c.clone() for c in caches]
    eng.submit_load(2, [0, 2, 3, 8], [5, 2, 6], skip=[1, 0], group_sizes=[3, 1])
    assert eng.get_finished()[0].ok
    for layer, (c, o) in enumerate(zip(caches, originals)):
        src, dst = ([4, 7, 1], [0, 2, 3]) if layer < 2 else ([9], [8])
        assert torch.equal(c[dst], o[src])
    assert torch.equal(caches[0][[5, 6, 8]], originals[0][[5, 6, 8]])
    assert torch.equal(caches[2][[0, 2, 3]], originals[2][[0, 2, 3]]), "group 1's load must not touch layer 2"


def test_kernel_tables_are_built_with_the_engine(make_engine, monkeypatch):
    """The segment table is built when the engine is created, not by the first job on whichever side stream it runs
    (the other direction's stream would read it unordered): no job builds one."""
    built = []
    real = tables.build_segment_table
    monkeypatch.setattr(tables, "build_segment_table", lambda *a: built.append(a) or real(*a))
    caches, spec, eng, _ = make_engine(f=2)
    assert built, "the engine built no segment table"
    at_creation = len(built)
    eng.submit_store(1, [0, 1, 2], [0, 1])
    eng.submit_load(2, [3, 4, 5], [0, 1])
    assert [r.ok for r in eng.get_finished()] == [True, True]
    assert len(built) == at_creation, "a job built a segment table"
