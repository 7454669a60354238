"""TritonOffloadingSpec through vLLM's real classes, without an engine (runs against vLLM 0.32 and 0.33).

The configuration is built by hand as vLLM's connector would build it; the manager is driven the way vLLM's
scheduler drives it and the worker the way vLLM's worker does, on CPU tensors (kernels under the interpreter) and,
with -m gpu, on CUDA tensors (compiled kernels, pinned host cache).
"""

from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.base", reason="needs vLLM >= 0.32 (pip install 'triton-offload[vllm]')")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm_configs import ctx, finished, key, offloading_config, submit_load  # noqa: E402

import triton_offload.connector as plugin  # noqa: E402
from triton_offload.connector.manager import (  # noqa: E402
    VLLM_TRANSFER_COUNTERS,
    HostBlocksSpec,
    TritonOffloadingManager,
)
from triton_offload.connector.spec import TritonOffloadingSpec  # noqa: E402
from triton_offload.engine import JobResult as EngineResult  # noqa: E402

pytestmark = pytest.mark.vllm
# What vLLM's plugin loader does in each of its processes: every test resolves the spec by name, whichever runs first.
plugin.register()

SENTINEL = 0x5A


def make_config(extra, *, groups=((0, 1),), worker_bytes=1024, f=2, tokens=16, world_size=1, rank=0, events=False):
    """An OffloadingConfig as vLLM's connector builds it: one group config per KV-cache group."""
    return offloading_config(
        {"spec_name": plugin.SPEC_NAME, **extra},
        groups=groups,
        worker_bytes=worker_bytes,
        f=f,
        tokens=tokens,
        world_size=world_size,
        rank=rank,
        events=events,
    )


# -- registration and sizing -----------------------------------------------------------------------------------------


def test_under_multiconnector_the_spec_needs_vllm_033():
    """In the engine processes too (where the front end's check did not run, e.g. without ``vllm serve``): vLLM's
    own MultiConnector building our spec as a child refuses vLLM < 0.33 (vLLM #46951), and builds on 0.33."""
    import vllm
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm_hybrid import Case, HybridKV, full, vllm_config

    kv = HybridKV(Case(((full(), 2),), "overlaid"), 16, views=False)
    extra = {"spec_name": plugin.SPEC_NAME, "cpu_bytes_to_use": 1 << 20}
    config = vllm_config(extra)
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        engine_id="test",
        kv_connector_extra_config={
            "connectors": [
                {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
            ]
        },
    )
    config.scheduler_config = type("SchedulerConfig", (), {"disable_hybrid_kv_cache_manager": False})()
    if vllm.__version__.startswith("0.32"):
        with pytest.raises(ValueError, match=r"needs vLLM >= 0.33; this is vLLM 0.32"):
            MultiConnector(config, KVConnectorRole.SCHEDULER, kv.config)
    else:
        connector = MultiConnector(config, KVConnectorRole.SCHEDULER, kv.config)
        (child,) = connector._connectors
        assert child.connector_scheduler.manager is not None


def test_register_is_idempotent_and_resolves_by_name():
    plugin.register()
    plugin.register()  # vLLM may call plugins again in the same process: must not raise
    assert OffloadingSpecFactory.get_spec_cls({"spec_name": plugin.SPEC_NAME}) is TritonOffloadingSpec
    by_path = {"spec_name": plugin.SPEC_NAME, "spec_module_path": "triton_offload.connector"}
    assert OffloadingSpecFactory.get_spec_cls(by_path) is TritonOffloadingSpec


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    values = [ep.value for ep in entry_points(group="vllm.general_plugins") if ep.name == "triton_offload"]
    assert values == ["triton_offload.connector:register"], "reinstall the package: pip install -e ."


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_host_blocks_are_the_same_on_every_rank(world_size):
    """The scheduler (rank 0) and each worker compute the block count alone, from the same inputs."""
    extra = {"cpu_bytes_to_use": "1MiB"}
    counts = {
        rank: OffloadingSpecFactory.create_spec(make_config(extra, world_size=world_size, rank=rank)).num_host_blocks
        for rank in range(world_size)
    }
    assert set(counts.values()) == {(1 << 20) // world_size // (1024 * 2)}


def test_manager_from_spec_publishes_the_declared_info_labels():
    """vLLM 0.33 reads config_info() once and keeps only the labels config_info_keys() declared."""
    spec = OffloadingSpecFactory.create_spec(make_config({"cpu_bytes_to_use": "1MiB", "eviction_policy": "arc"}))
    (info,) = spec.get_manager().config_info()
    assert set(info) == set(TritonOffloadingSpec.config_info_keys({}))
    assert sorted(info.values(), key=str) == sorted([512, 2, "arc", "native", 512 * 2 * 16, 512], key=str)


@pytest.mark.parametrize(
    ("extra", "worker_bytes", "match"),
    [
        pytest.param({}, 1024, "needs 'cpu_bytes_to_use'", id="missing-budget"),
        pytest.param({"cpu_bytes_to_use": "1KiB"}, 1024, "less than one host block of 2048 bytes", id="too-small"),
        pytest.param({"cpu_bytes_to_use": "1MiB", "eviction_policy": "mru"}, 1024, "accepted: arc, lru", id="policy"),
        pytest.param({"cpu_bytes_to_use": "1MiB", "block_size": 16}, 1024, "block_size = 16", id="block-size"),
        pytest.param({"cpu_bytes_to_use": "1MiB"}, 0, "no KV cache to offload", id="no-kv"),
    ],
)
def test_spec_rejects_bad_config(extra, worker_bytes, match):
    with pytest.raises(ValueError, match=match):
        OffloadingSpecFactory.create_spec(make_config(extra, worker_bytes=worker_bytes))


# -- scheduler side: the manager adapter -----------------------------------------------------------------------------


def test_lookup_states_follow_the_store():
    m = TritonOffloadingManager(4)
    rc = ctx()
    m.on_new_request(rc)
    assert m.lookup(key(0), rc) is LookupResult.MISS
    out = m.prepare_store([key(0), key(1)], rc)
    assert m.lookup(key(0), rc) is LookupResult.HIT_PENDING, "a store in flight is pending, not a miss"
    m.complete_store({key(1)}, rc)
    assert (m.lookup(key(0), rc), m.lookup(key(1), rc)) == (LookupResult.HIT_PENDING, LookupResult.HIT)
    m.complete_store([key(0)], rc, success=False)
    assert m.lookup(key(0), rc) is LookupResult.MISS
    assert out.keys_to_store == [key(0), key(1)]


def test_ids_follow_the_order_of_the_keys():
    """Store and load specs carry one host id per key, in the order of the keys vLLM passed."""
    m = TritonOffloadingManager(8)
    rc = ctx()
    first = m.prepare_store([key(5), key(6)], rc)
    m.complete_store(first.keys_to_store, rc)
    out = m.prepare_store([key(5), key(7), key(6), key(8)], rc)  # cached keys are left out, order kept
    assert out.keys_to_store == [key(7), key(8)] and out.evicted_keys == []
    assert isinstance(out.store_spec, HostBlocksSpec) and out.store_spec.block_ids.dtype == np.int32
    m.complete_store(out.keys_to_store, rc)
    where = dict(zip(first.keys_to_store + out.keys_to_store, [*first.store_spec.block_ids, *out.store_spec.block_ids]))
    order = [key(8), key(5), key(7), key(6)]
    assert m.prepare_load(order, rc).block_ids.tolist() == [where[k] for k in order]
    assert len(set(where.values())) == 4


def test_prepare_store_returns_none_when_nothing_can_be_evicted():
    m = TritonOffloadingManager(2)
    rc = ctx()
    m.complete_store(m.prepare_store([key(0)], rc).keys_to_store, rc)
    m.prepare_load([key(0)], rc)  # pinned by a load in flight
    assert m.prepare_store([key(1)], rc) is not None  # the free block; its store stays in flight
    assert m.prepare_store([key(2)], rc) is None
    assert m.lookup(key(2), rc) is LookupResult.MISS


def test_events_become_vllm_offloading_events():
    m = TritonOffloadingManager(1, enable_events=True)
    rc = ctx()
    m.complete_store(m.prepare_store([key(0)], rc).keys_to_store, rc)
    out = m.prepare_store([key(1)], rc)
    assert out.evicted_keys == [key(0)]
    m.complete_store(out.keys_to_store, rc)
    events = list(m.take_events())
    assert events == [
        OffloadingEvent(keys=[key(0)], medium=Medium.CPU, removed=False),
        OffloadingEvent(keys=[key(0)], medium=Medium.CPU, removed=True),
        OffloadingEvent(keys=[key(1)], medium=Medium.CPU, removed=False),
    ]
    assert list(m.take_events()) == []
    quiet = TritonOffloadingManager(1)
    quiet.complete_store(quiet.prepare_store([key(0)], rc).keys_to_store, rc)
    assert list(quiet.take_events()) == []


def test_a_load_protects_the_request_head_from_its_own_stores():
    """Seen in the e2e run: vLLM never calls touch(), so a load must count as a use, or the request that loads a
    prefix head and stores its tail would evict its own head (the least recently stored) instead of older data."""
    m = TritonOffloadingManager(4)
    a, b = ctx("a"), ctx("b")
    m.complete_store(m.prepare_store([key(0), key(1)], a).keys_to_store, a)  # a's prefix
    m.complete_store(m.prepare_store([key(10), key(11)], b).keys_to_store, b)  # b, stored later
    m.prepare_load([key(0)], a)  # a comes back: its head is loaded...
    m.complete_load([key(0)], a)
    out = m.prepare_store([key(2), key(3)], a)  # ...and its tail stored, which needs two blocks
    # LRU order was 1, 0, 11, 10 (a call's first key is its most recent); the load moved 0 to the end.
    assert out.evicted_keys == [key(1), key(11)], "a's unused tail, then b's tail; not a's head just loaded"
    m.complete_store(out.keys_to_store, a)
    m.on_request_finished(a)
    assert m.lookup(key(0), a) is LookupResult.HIT


def test_complete_store_restores_prefix_order_from_positions():
    """vLLM completes a job's keys as a set; the recorded end positions put the head last in line for eviction."""
    keys = [key(i) for i in range(3)]
    m = TritonOffloadingManager(3)
    rc = ctx(positions={k: 16 * (i + 1) for i, k in enumerate(keys)})
    m.prepare_store(keys, rc)
    m.complete_store(list(reversed(keys)), rc)  # the worst order a set could come in
    out = m.prepare_store([key(9)], rc)
    assert out.evicted_keys == [key(2)], "the tail goes first, the head stays"


def test_reset_drops_everything_in_flight_too():
    """vLLM never completes jobs in flight at a reset, so pinned and storing keys must not survive it."""
    m = TritonOffloadingManager(3)
    rc = ctx()
    m.complete_store(m.prepare_store([key(0)], rc).keys_to_store, rc)
    m.prepare_load([key(0)], rc)
    m.prepare_store([key(1)], rc)
    m.reset_cache()
    assert [m.lookup(key(i), rc) for i in range(2)] == [LookupResult.MISS] * 2
    out = m.prepare_store([key(2), key(3), key(4)], rc)
    assert sorted(out.store_spec.block_ids.tolist()) == [0, 1, 2] and out.evicted_keys == []


def test_stats_report_deltas_and_counters_survive_reset():
    m = TritonOffloadingManager(2, info={"triton_offload_host_blocks": 2})
    rc = ctx()
    m.complete_store(m.prepare_store([key(0), key(1)], rc).keys_to_store, rc)
    m.prepare_load([key(0)], rc)
    first = m.get_stats().reduce()
    zeros = dict.fromkeys(VLLM_TRANSFER_COUNTERS, 0)
    assert first == {
        "vllm:triton_offload_hit_blocks": 1,
        "vllm:triton_offload_stored_blocks": 2,
        "vllm:triton_offload_evicted_blocks": 0,
        "vllm:triton_offload_cached_blocks": 2,
        **zeros,
    }, "the first report names every counter, at zero where nothing happened yet"
    assert m.get_stats().reduce() == {"vllm:triton_offload_cached_blocks": 2}, "counters are reported as deltas"
    m.reset_cache()
    assert m.counters == {
        "hit_blocks": 1,
        "stored_blocks": 2,
        "evicted_blocks": 0,
        "cached_blocks": 0,
        "host_blocks": 2,
        "host_keys": 2,
    }
    assert m.config_info() == [{"triton_offload_host_blocks": 2}]
    assert set(TritonOffloadingSpec.build_metric_definitions({})) >= set(first) - set(zeros)


def test_the_first_stats_report_names_every_counter_at_zero():
    """vLLM creates a metric's series only when a stats report names it: without this, /metrics would show no hit,
    eviction or load-bytes series until the first hit, eviction or load. Every name reported must be one vLLM's
    metrics declare for this spec (an undeclared one fails an assertion in vLLM's front end)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import get_connector_metric_definitions

    first = TritonOffloadingManager(4).get_stats().reduce()
    declared = {**TritonOffloadingSpec.build_metric_definitions({}), **get_connector_metric_definitions()}
    assert set(first) <= set(declared)
    assert {k: v for k, v in first.items() if k != "vllm:triton_offload_cached_blocks"} == {
        "vllm:triton_offload_hit_blocks": 0,
        "vllm:triton_offload_stored_blocks": 0,
        "vllm:triton_offload_evicted_blocks": 0,
        **dict.fromkeys(VLLM_TRANSFER_COUNTERS, 0),
    }


def test_hits_are_labelled_as_host_memory():
    """vLLM's prompt_tokens_cached_by_source asks the manager where each loaded key came from."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    assert TritonOffloadingManager(1).get_load_source(key(0), ctx()) is CacheHitSource.HOST


def test_host_spec_survives_pickling():
    """Load/store specs travel to the workers pickled inside vLLM's connector metadata."""
    spec = pickle.loads(pickle.dumps(HostBlocksSpec([7, 3, 5])))
    assert isinstance(spec, HostBlocksSpec) and spec.block_ids.tolist() == [7, 3, 5]


# -- worker side: canonical KV caches through the spec's worker ------------------------------------------------------


def canonical(num_blocks: int, pages: list[int], pad: int = 0, seed: int = 0, device: str = "cpu"):
    """vLLM's layout: one backing allocation, layer-major, one (num_blocks, page + pad) int8 view per layer; pages
    that differ (hybrid models) get a backing allocation each."""
    gen = torch.Generator().manual_seed(seed)
    if len(set(pages)) == 1:
        stride = pages[0] + pad
        backing = torch.randint(-128, 128, (len(pages) * num_blocks, stride), dtype=torch.int8, generator=gen)
        backing = backing.to(device)
        views = [backing[i * num_blocks : (i + 1) * num_blocks] for i in range(len(pages))]
    else:
        views = [torch.randint(-128, 128, (num_blocks, p + pad), dtype=torch.int8, generator=gen) for p in pages]
        views = [v.to(device) for v in views]
    return [CanonicalKVCacheTensor(v, v.shape[1]) for v in views]


def spec_and_worker(kv: CanonicalKVCaches, *, f: int, worker_bytes: int, num_groups: int = 1, blocks=64, **extra):
    groups = tuple((gi,) for gi in range(num_groups))
    extra = {"cpu_bytes_to_use": blocks * worker_bytes * f, **extra}
    config = make_config(extra, groups=groups, worker_bytes=worker_bytes, f=f)
    spec = OffloadingSpecFactory.create_spec(config)
    return spec, spec.get_manager(), spec.get_worker(kv)


def _no_host_cache(*args, **kwargs):
    raise AssertionError("a host cache was allocated: the memory check must refuse the budget first")


@pytest.mark.parametrize(
    "world_size, available, fits",
    [(1, 600 << 10, False), (2, 600 << 10, True), (2, 400 << 10, False)],
    ids=["1rank-1MiB-in-600KiB", "2ranks-512KiB-each-in-600KiB", "2ranks-512KiB-each-in-400KiB"],
)
def test_worker_refuses_a_budget_beyond_available_memory(monkeypatch, world_size, available, fits):
    """cpu_bytes_to_use is for the whole instance: each rank checks its own share against MemAvailable before it
    allocates, and a share that does not fit is a ValueError naming the key, the bytes asked and the bytes
    available, with nothing allocated."""
    import triton_offload.connector.worker as worker_module
    from triton_offload.host import budget

    monkeypatch.setattr(budget, "available_host_bytes", lambda: available)
    kv = CanonicalKVCaches(canonical(16, [512, 512]), [[CanonicalKVCacheRef(0, 512), CanonicalKVCacheRef(1, 512)]])
    config = make_config({"cpu_bytes_to_use": "1MiB"}, worker_bytes=1024, f=2, world_size=world_size)
    spec = OffloadingSpecFactory.create_spec(config)
    asked = (1 << 20) // world_size
    if fits:
        spec.get_worker(kv).shutdown()
        return
    monkeypatch.setattr(worker_module, "HostCache", _no_host_cache)
    with pytest.raises(ValueError, match=rf"cpu_bytes_to_use = 1048576 bytes .* asks for {asked} bytes .* {available}"):
        spec.get_worker(kv)


def test_a_budget_beyond_the_machine_is_refused_before_allocating(monkeypatch):
    """The README's "40GiB" on a smaller machine: four times MemTotal, refused by the real MemAvailable check (the
    host cache is replaced by a tripwire, so this test allocates nothing even if the check were missing)."""
    import triton_offload.connector.worker as worker_module

    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    monkeypatch.setattr(worker_module, "HostCache", _no_host_cache)
    kv = CanonicalKVCaches(canonical(16, [512, 512]), [[CanonicalKVCacheRef(0, 512), CanonicalKVCacheRef(1, 512)]])
    spec = OffloadingSpecFactory.create_spec(make_config({"cpu_bytes_to_use": 4 * total}, worker_bytes=1024, f=2))
    with pytest.raises(ValueError, match=rf"cpu_bytes_to_use = {4 * total} bytes .* asks for .* are available"):
        spec.get_worker(kv)


@pytest.mark.parametrize("path", [None, "kernel", "dma"], ids=["default", "kernel", "dma"])
def test_store_f2_then_load_with_skip_into_other_blocks(path, device):
    """6 GPU blocks stored into 3 host blocks (f=2); the load skips the first one (the device holds it) and writes
    5 other blocks. Source and unaddressed blocks stay as they were. The same through the copy-engine path
    (``transfer_path``: on CPU its descriptors are replayed by memmove)."""
    tensors = canonical(16, [512, 512], device=device)
    kv = CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(0, 512), CanonicalKVCacheRef(1, 512)]])
    extra = {} if path is None else {"transfer_path": path}
    spec, mgr, worker = spec_and_worker(kv, f=2, worker_bytes=1024, **extra)
    assert worker.engine.path == (path or ("auto" if device == "cuda" else "kernel"))  # the engine's default
    assert worker.kv.num_groups == 1 and worker.kv.bytes_per_block == 1024
    before = [t.tensor.clone() for t in tensors]
    rc = ctx()
    mgr.on_new_request(rc)
    keys = [key(c) for c in range(3)]
    out = mgr.prepare_store(keys, rc)
    src = [3, 7, 1, 9, 4, 12]
    assert worker.submit_store(0, GPULoadStoreSpec(src, [6], [0]), out.store_spec)
    stores = finished(worker)
    assert [(r.job_id, r.success, r.transfer_size) for r in stores] == [(0, True, 6 * 1024)]
    assert stores[0].transfer_time >= 0
    mgr.complete_store(keys, rc)
    dst = [13, 14, 15, 0, 2]
    submit_load(worker, 1, mgr.prepare_load(keys, rc), GPULoadStoreSpec(dst, [5], [1]), expedited=True)
    assert [(r.job_id, r.success, r.transfer_size) for r in finished(worker)] == [(1, True, 5 * 1024)]
    assert finished(worker) == [], "every job is reported exactly once"
    mgr.complete_load(keys, rc)
    for t, old in zip(tensors, before):
        expect = old.clone()
        expect[dst] = old[src[1:]]
        assert torch.equal(t.tensor, expect)
    worker.shutdown()


# The kernel (grouped and padded tables included) and the copy-engine path, each pinned: auto, the CUDA default,
# would let a calibration decide which of them these transfers exercise.
BOTH_PATHS = pytest.mark.parametrize("path", ["kernel", "dma"])


@BOTH_PATHS
def test_two_groups_with_different_layers_and_pages(path, device):
    """HMA: group 0 has layers 0 and 1 (512-byte pages), group 1 layer 2 (256 bytes); one job moves both groups,
    each with its own skip, in one submission."""
    tensors = canonical(16, [512, 512, 256], device=device)
    kv = CanonicalKVCaches(
        tensors,
        [[CanonicalKVCacheRef(0, 512), CanonicalKVCacheRef(1, 512)], [CanonicalKVCacheRef(2, 256)]],
    )
    spec, mgr, worker = spec_and_worker(kv, f=2, worker_bytes=1280, num_groups=2, transfer_path=path)
    assert worker.kv.groups == ((0, 1), (2,)) and worker.kv.bytes_per_block == 1024
    before = [t.tensor.clone() for t in tensors]
    rc = ctx()
    g0, g1 = [key(c, 0) for c in range(2)], [key(c, 1) for c in range(2)]
    out = mgr.prepare_store(g0 + g1, rc)
    src0, src1 = [1, 2, 3, 4], [5, 6, 7]  # group 1's first block is null: it starts at block index 1 (skip 1)
    assert worker.submit_store(0, GPULoadStoreSpec(src0 + src1, [4, 3], [0, 1]), out.store_spec)
    assert [r.transfer_size for r in finished(worker)] == [4 * 1024 + 3 * 256]
    mgr.complete_store(g0 + g1, rc)
    dst0, dst1 = [10, 11, 12], [13, 14]  # the device holds group 0's first block and group 1's first two
    load = mgr.prepare_load([g0[0], g0[1], g1[1]], rc)
    submit_load(worker, 1, load, GPULoadStoreSpec(dst0 + dst1, [3, 2], [1, 2]), expedited=True)
    assert [r.transfer_size for r in finished(worker)] == [3 * 1024 + 2 * 256]
    expect = [b.clone() for b in before]
    for layer in (0, 1):
        expect[layer][dst0] = before[layer][src0[1:]]
    expect[2][dst1] = before[2][src1[1:]]
    for t, e in zip(tensors, expect):
        assert torch.equal(t.tensor, e)
    worker.shutdown()


@BOTH_PATHS
def test_padded_pages_move_only_the_unpadded_bytes(path, device):
    """stride(0) exceeds the page: the refs name 384 un-padded bytes of 512-byte rows; padding is never moved."""
    tensors = canonical(8, [384, 384], pad=128, device=device)
    kv = CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(0, 384), CanonicalKVCacheRef(1, 384)]])
    spec, mgr, worker = spec_and_worker(kv, f=1, worker_bytes=1024, transfer_path=path)
    assert worker.kv.bytes_per_block == 768
    rc = ctx()
    out = mgr.prepare_store([key(0), key(1)], rc)
    src = torch.stack([t.tensor[[2, 5]].clone() for t in tensors])
    assert worker.submit_store(0, GPULoadStoreSpec([2, 5], [2], [0]), out.store_spec)
    finished(worker)
    mgr.complete_store([key(0), key(1)], rc)
    for t in tensors:
        t.tensor[[6, 7]] = SENTINEL
    submit_load(worker, 1, mgr.prepare_load([key(0), key(1)], rc), GPULoadStoreSpec([6, 7], [2], [0]), expedited=True)
    assert [r.transfer_size for r in finished(worker)] == [2 * 768]
    for t, s in zip(tensors, src):
        assert torch.equal(t.tensor[[6, 7], :384], s[:, :384])
        assert bool((t.tensor[[6, 7], 384:] == SENTINEL).all()), "padding bytes must not be written"
    worker.shutdown()


@BOTH_PATHS
def test_aliased_refs_are_moved_once(path, device):
    """Two layers of group 0 alias tensor 0 (moved once, the larger page wins); group 1 overlays the same tensor,
    as vLLM's packed layouts do (one ref per group to tensor 0)."""
    tensors = canonical(8, [512, 256], device=device)
    kv = CanonicalKVCaches(
        tensors,
        [
            [CanonicalKVCacheRef(0, 256), CanonicalKVCacheRef(0, 512), CanonicalKVCacheRef(1, 256)],
            [CanonicalKVCacheRef(0, 512)],
        ],
    )
    spec, mgr, worker = spec_and_worker(kv, f=1, worker_bytes=1024, num_groups=2, transfer_path=path)
    assert worker.kv.num_layers == 2 and worker.kv.groups == ((0, 1), (0,))
    assert worker.kv.group_bytes == (768, 512)
    before = [t.tensor.clone() for t in tensors]
    rc = ctx()
    out = mgr.prepare_store([key(0, 0), key(0, 1)], rc)
    assert worker.submit_store(0, GPULoadStoreSpec([1, 2], [1, 1], [0, 0]), out.store_spec)
    finished(worker)
    mgr.complete_store([key(0, 0), key(0, 1)], rc)
    submit_load(
        worker,
        1,
        mgr.prepare_load([key(0, 0), key(0, 1)], rc),
        GPULoadStoreSpec([5, 6], [1, 1], [0, 0]),
        expedited=True,
    )
    assert [r.transfer_size for r in finished(worker)] == [768 + 512]
    expect = [b.clone() for b in before]
    expect[0][5], expect[1][5], expect[0][6] = before[0][1], before[1][1], before[0][2]
    for t, e in zip(tensors, expect):
        assert torch.equal(t.tensor, e)
    worker.shutdown()


def test_worker_reports_a_failed_job_loudly(caplog):
    """vLLM asserts success; reporting a failure as success would feed the model garbage. So: log and raise."""
    tensors = canonical(4, [256])
    _, _, worker = spec_and_worker(CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(0, 256)]]), f=1, worker_bytes=256)
    worker.engine.get_finished = lambda: [EngineResult(7, False, "load", 256, 0.0, "CUDA error: illegal address")]
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError, match="load job 7 failed: CUDA error"):
        worker.get_finished()
    assert "load job 7 failed" in caplog.text


def test_worker_rejects_foreign_specs_and_tolerates_unknown_waits():
    tensors = canonical(4, [256])
    _, _, worker = spec_and_worker(CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(0, 256)]]), f=1, worker_bytes=256)
    worker.wait({123, 456})  # vLLM may wait on ids this worker never saw
    with pytest.raises(TypeError, match="expected the host block ids"):
        worker.submit_store(0, GPULoadStoreSpec([1], [1], [0]), GPULoadStoreSpec([2], [1], [0]))
    with pytest.raises(ValueError, match="out of range"):
        worker.submit_store(1, GPULoadStoreSpec([1], [1], [0]), HostBlocksSpec([10**6]))
    assert finished(worker) == []
    worker.shutdown()
