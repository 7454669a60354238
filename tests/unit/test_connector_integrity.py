"""The integrity checks in the vLLM plugin, through vLLM's real classes without an engine (vLLM 0.32 and 0.33): the
setting, the refusal of vLLM's own connector, the identities the scheduler hands out, failed keys becoming misses,
the worker metadata, and the tiering layout's trailer, including blocks written without one by vLLM's own worker
code (loaded unchecked under "verify", failed under "require"). docs/integrity.md."""

from __future__ import annotations

import contextlib
import re
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="needs vLLM >= 0.32 with its tiering package")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.kv_offload.file_mapper import FileMapper  # noqa: E402
from vllm_configs import ctx, finished, key, offloading_config, submit_load  # noqa: E402

import triton_offload.connector as plugin  # noqa: E402
from triton_offload import integrity  # noqa: E402
from triton_offload.connector import load_errors, preflight  # noqa: E402
from triton_offload.connector.config import TritonOffloadConfig  # noqa: E402
from triton_offload.connector.manager import TritonOffloadingManager  # noqa: E402
from triton_offload.connector.tiering import INTEGRITY_NAMESPACE, IdentifiedChunks, trailer_bytes  # noqa: E402
from triton_offload.connector.tiering_config import TritonTieringConfig  # noqa: E402
from triton_offload.manager import OffloadManager  # noqa: E402
from triton_offload.plan import Direction  # noqa: E402

pytestmark = pytest.mark.vllm
plugin.register()


@contextlib.contextmanager
def built_by_our_connector():
    """What TritonOffloadingConnector does around vLLM's construction of its spec."""
    token = load_errors._REPORTING.set(True)
    try:
        yield
    finally:
        load_errors._REPORTING.reset(token)


def test_the_setting_is_checked_in_both_specs():
    packed = TritonOffloadConfig.from_extra_config({"cpu_bytes_to_use": 1 << 20}, blocks_per_host_block=1)
    assert packed.integrity == "off"
    checked = {"cpu_bytes_to_use": 1 << 20, "integrity": "Require"}
    assert TritonOffloadConfig.from_extra_config(checked, blocks_per_host_block=1).integrity == "require"
    verify = TritonOffloadConfig.from_extra_config({**checked, "integrity": "verify"}, blocks_per_host_block=1)
    assert (verify.integrity, verify.checks, packed.checks) == ("verify", "require", "off")
    assert TritonTieringConfig.from_extra_config({**checked, "integrity": "verify"}).integrity == "verify"
    for parse in (
        lambda e: TritonOffloadConfig.from_extra_config(e, blocks_per_host_block=1),
        TritonTieringConfig.from_extra_config,
    ):
        with pytest.raises(ValueError, match=re.escape("integrity = 'on' is not one of ['off', 'require', 'verify']")):
            parse({"cpu_bytes_to_use": 1 << 20, "integrity": "on"})


PACKED = {"spec_name": "TritonOffloadingSpec", "cpu_bytes_to_use": 1 << 20}
TIERING = {"spec_name": "TritonTieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20}


@pytest.mark.parametrize("extra", [PACKED, TIERING], ids=["packed", "tiering"])
def test_vllms_own_connector_is_refused_with_the_checks_and_ours_is_named(extra):
    """vLLM's OffloadingConnector asserts every transfer succeeds: with the checks on, a spec it built refuses to
    start (scheduler side and worker side), and so does the check before the model loads, naming our connector."""
    config = offloading_config({**extra, "integrity": "verify"}, groups=((0,),), worker_bytes=4096, f=1)
    spec = OffloadingSpecFactory.create_spec(config)
    message = re.escape('integrity = \'verify\' needs "kv_connector": "TritonOffloadingConnector"')
    with pytest.raises(ValueError, match=message):
        spec.get_manager()
    with pytest.raises(ValueError, match=message):
        spec.get_worker(None)
    with built_by_our_connector():
        assert OffloadingSpecFactory.create_spec(config).reports_load_errors
    off = OffloadingSpecFactory.create_spec(offloading_config(extra, groups=((0,),), worker_bytes=4096, f=1))
    assert not off.reports_load_errors and off.get_manager() is not None

    def vllm_config(connector):
        ktc = SimpleNamespace(kv_connector=connector, kv_connector_extra_config={**extra, "integrity": "verify"})
        return SimpleNamespace(
            kv_transfer_config=ktc,
            cache_config=SimpleNamespace(block_size=16, kv_cache_memory_bytes=32 << 20, gpu_memory_utilization=0.9),
            model_config=SimpleNamespace(is_hybrid=False),
            parallel_config=SimpleNamespace(decode_context_parallel_size=1, nnodes=1, data_parallel_size=1),
        )

    with pytest.raises(ValueError, match=message):
        preflight.check_vllm_config(vllm_config("OffloadingConnector"))
    preflight.check_vllm_config(vllm_config("TritonOffloadingConnector"))


def test_our_connector_is_registered_with_vllm():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    cls = KVConnectorFactory._registry[plugin.CONNECTOR_NAME]()
    assert cls is load_errors.TritonOffloadingConnector and issubclass(cls, OffloadingConnector)


def test_the_scheduler_names_each_host_block_by_its_key_and_failed_keys_become_misses():
    """Stores and loads carry each key's identity, in vLLM's order of the keys; a host block that failed its check
    on a worker (reported while its load is in flight) drops its key once that load completes, and a key pinned by
    two loads only after both; the rest stay cached."""
    m = TritonOffloadingManager(8, identities=True)
    keys = [key(i) for i in range(4)]
    out = m.prepare_store(keys, ctx("a"))
    assert np.array_equal(out.store_spec.identities, integrity.identities_of_keys(out.keys_to_store))
    m.complete_store(keys, ctx("a"))
    order = [keys[2], keys[0], keys[3]]
    spec = m.prepare_load(order, ctx("b"))
    assert np.array_equal(spec.identities, integrity.identities_of_keys(order))
    second = m.prepare_load([keys[0]], ctx("c"))  # another request loads key 0 too
    host = dict(zip(spec.block_ids.tolist(), order))
    bad = [h for h, k in host.items() if k in (keys[0], keys[3])]
    assert sorted(map(bytes, m.discard_failed(bad + [99]))) == sorted([keys[0], keys[3]])
    m.complete_load(order, ctx("b"))
    assert m.lookup(keys[3], ctx("d")) == LookupResult.MISS and m.lookup(keys[2], ctx("d")) == LookupResult.HIT
    assert m.lookup(keys[0], ctx("d")) == LookupResult.HIT, "still pinned by the other load"
    m.complete_load([keys[0]], ctx("c"))
    assert m.lookup(keys[0], ctx("d")) == LookupResult.MISS
    assert second.block_ids.tolist() == [k for k, v in host.items() if v == keys[0]]
    assert m.occupancy == {"cached": 2, "storing": 0, "free": 6, "pinned": 0}
    assert TritonOffloadingManager(8).prepare_load([], ctx()).identities is None, "no identities without the checks"


def test_with_host_regions_a_failed_key_is_named_by_its_region_and_block():
    """Host regions (a block pool per region, connector/geometry.py): block id 0 of pool 0 and block id 0 of pool 1
    are two keys of one row. The workers name a failed key by its slot (region x rows + block), and only that key
    is dropped, its block returned to its own pool."""
    m = TritonOffloadingManager(4, identities=True, pools=2, pool_of=lambda k: int.from_bytes(k[-4:], "big"))
    a, b = key(1, group=0), key(1, group=1)
    out = m.prepare_store([a, b], ctx("s"))
    assert out.store_spec.block_ids.tolist() == [0, 0], "one id in two pools: one row holds both keys"
    m.complete_store([a, b], ctx("s"))
    spec = m.prepare_load([a, b], ctx("l"))
    assert m.key_slots([a, b], spec.block_ids) == [0, 4]
    assert m.discard_failed([4]) == [b]
    m.complete_load([a, b], ctx("l"))
    assert m.lookup(a, ctx()) == LookupResult.HIT and m.lookup(b, ctx()) == LookupResult.MISS
    again = m.prepare_store([b], ctx("s2"))
    assert again.keys_to_store == [b] and again.store_spec.block_ids.tolist() == [0], "its block went back to pool 1"


@pytest.mark.parametrize("pools, policy", [(1, "lru"), (2, "arc"), (3, "lru")])
def test_loads_read_the_identities_their_stores_gave_each_slot(pools, policy):
    """Loads hand out the identities the stores computed, kept per key slot rather than hashed again: after random
    stores (some failed), evictions, a block reused by another key, discarded keys and resets, with one or several
    host regions, every load's identities are its keys' (identities_of_keys), in vLLM's order of the keys."""
    import random

    rng = random.Random(pools * 7 + len(policy))
    m = TritonOffloadingManager(
        5, policy, identities=True, pools=pools, pool_of=lambda k: int.from_bytes(k[-4:], "big")
    )
    universe = [key(i, group=g) for i in range(12) for g in range(pools)]
    storing: list = []
    loading: list = []
    checked = 0
    for step in range(400):
        op = rng.random()
        if op < 0.35:
            out = m.prepare_store(rng.sample(universe, rng.randint(1, 4)), ctx(f"s{step}"))
            if out is not None:
                want = integrity.identities_of_keys(out.keys_to_store)
                assert np.array_equal(out.store_spec.identities, want) and type(out.store_spec.identity_bytes) is bytes
                storing.append(out.keys_to_store)
        elif op < 0.55 and storing:
            m.complete_store(storing.pop(rng.randrange(len(storing))), ctx(), success=rng.random() < 0.85)
        elif op < 0.8:
            ready = [k for k in universe if m.lookup(k, ctx()) == LookupResult.HIT]
            if ready:
                keys = rng.sample(ready, rng.randint(1, min(4, len(ready))))
                spec = m.prepare_load(keys, ctx(f"l{step}"))
                assert np.array_equal(spec.identities, integrity.identities_of_keys(keys))
                assert type(spec.identity_bytes) is bytes and spec.identities.dtype == np.int64, "a copy, not the table"
                loading.append((keys, spec))
                checked += len(keys)
        elif op < 0.93 and loading:
            keys, spec = loading.pop(rng.randrange(len(loading)))
            if rng.random() < 0.3:  # a worker failed one of its blocks: that key becomes a miss, its block free
                m.discard_failed(m.key_slots(keys[:1], spec.block_ids[:1]))
            m.complete_load(keys, ctx())
        elif op > 0.98:
            m.reset_cache()
            storing.clear()
            loading.clear()
    assert checked > 150 and m.counters["evicted_blocks"] >= 10


def test_a_failed_block_in_a_host_region_is_reported_by_its_key_slot(caplog):
    """The connector reports the scheduler's names of the failed keys (LoadError.key_slots) and logs the region."""
    from triton_offload.connector.worker import LoadError

    error = LoadError(3, (5,), (2,), (11,), "host cache", regions=(1,), key_slots=(1 * 8 + 2,))
    c = connector_worker_side(1, [error], {3: "req-1"})
    with caplog.at_level("WARNING"):
        c.get_finished(set())
    assert c.build_connector_worker_meta().failed_host_blocks == {3: [10]}
    assert "GPU block 5 from host cache block 2 region 1 (key identity" in caplog.text


def test_the_worker_checks_each_host_region_of_a_row_on_its_own():
    """TritonOffloadingWorker with host regions (a region per group): keys of both groups stored in one row by two
    jobs both load intact; a byte changed in group 1's region fails only that block, named by its region and by the
    scheduler's key slot (region x rows + row)."""
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    from triton_offload.connector.manager import HostBlocksSpec
    from triton_offload.connector.worker import TritonOffloadingWorker

    gen = torch.Generator().manual_seed(5)
    tensors = [CanonicalKVCacheTensor(torch.randint(-128, 128, (10, p), dtype=torch.int8, generator=gen), p)
               for p in PAGES]  # fmt: skip
    kv = CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(0, PAGES[0])], [CanonicalKVCacheRef(1, PAGES[1])]])
    worker = TritonOffloadingWorker(
        kv, num_host_blocks=4, blocks_per_host_block=1, group_regions=(0, 1), integrity="verify", numa_node="off"
    )
    try:
        assert worker.host_cache.checksums.table.shape == (4, 2 * 2), "a marker and a checksum per region of each row"
        ident = integrity.identities_of_keys([key(1, 0), key(1, 1)])
        assert worker.submit_store(0, GPULoadStoreSpec([1], [1, 0], [0, 0]), HostBlocksSpec([2], ident[:1]))
        assert worker.submit_store(1, GPULoadStoreSpec([2], [0, 1], [0, 0]), HostBlocksSpec([2], ident[1:]))
        assert all(r.success for r in finished(worker))
        both = HostBlocksSpec([2, 2], ident)
        submit_load(worker, 2, both, GPULoadStoreSpec([5, 6], [1, 1], [0, 0]), expedited=False)
        assert finished(worker)[0].success and worker.take_load_errors() == ([], 0)
        assert torch.equal(tensors[0].tensor[5], tensors[0].tensor[1])
        assert torch.equal(tensors[1].tensor[6], tensors[1].tensor[2])
        worker.host_cache.buffer[2, PAGES[0] + 7] ^= 0x40  # a byte of group 1's region of row 2
        submit_load(worker, 3, both, GPULoadStoreSpec([5, 6], [1, 1], [0, 0]), expedited=False)
        assert finished(worker)[0].success
        (error,), _ = worker.take_load_errors()
        assert (error.gpu_block_ids, error.host_block_ids, error.regions, error.key_slots) == ((6,), (2,), (1,), (6,))
    finally:
        worker.shutdown()


@pytest.mark.parametrize("setting", ["verify", "require"])
def test_a_zeroed_marker_fails_the_load_under_the_specs_setting(setting):
    """TritonOffloadingSpec checks with "require" semantics whichever setting turned the checks on: within one process
    every row is stored with its checksums, so a row whose marker was zeroed (or garbled) is a failed block, never a
    block loaded unchecked."""
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    from triton_offload.connector.manager import HostBlocksSpec
    from triton_offload.connector.worker import TritonOffloadingWorker

    cfg = TritonOffloadConfig.from_extra_config(
        {"cpu_bytes_to_use": 1 << 20, "integrity": setting}, blocks_per_host_block=1
    )
    assert (cfg.integrity, cfg.checks) == (setting, "require")
    gen = torch.Generator().manual_seed(6)
    tensor = CanonicalKVCacheTensor(torch.randint(-128, 128, (10, 32), dtype=torch.int8, generator=gen), 32)
    kv = CanonicalKVCaches([tensor], [[CanonicalKVCacheRef(0, 32)]])
    worker = TritonOffloadingWorker(
        kv, num_host_blocks=4, blocks_per_host_block=1, integrity=cfg.checks, numa_node="off"
    )
    try:
        ident = integrity.identities_of_keys([key(7, 0)])
        assert worker.submit_store(0, GPULoadStoreSpec([3], [1], [0]), HostBlocksSpec([1], ident))
        assert all(r.success for r in finished(worker))
        for marker in (0, 0x1234):  # zeroed, then garbled
            worker.host_cache.checksums.table[1, 0] = marker
            submit_load(
                worker, 1 + marker, HostBlocksSpec([1], ident), GPULoadStoreSpec([5], [1], [0]), expedited=False
            )
            assert finished(worker)[0].success
            errors, unchecked = worker.take_load_errors()
            assert ([e.gpu_block_ids for e in errors], unchecked) == ([(5,)], 0), marker
    finally:
        worker.shutdown()


def test_discard_is_not_an_eviction_and_ignores_what_is_not_cached():
    """OffloadManager.discard: a ready key goes at once (a "removed" event, no eviction counted, its block free),
    a pinned one when its last load completes, a storing or unknown key is left alone."""
    m = OffloadManager(4, enable_events=True)
    m.prepare_store(["a", "b", "c"])
    m.complete_store(["a", "b"])
    m.take_events()
    m.prepare_load(["b"])
    assert m.discard(["a", "b", "c", "zz"]) == ["a"]
    assert m.key_state("a") is None and m.key_state("b") == "ready" and m.key_state("c") == "storing"
    m.complete_load(["b"])
    assert m.key_state("b") is None and m.num_free == 3 and m.stats.evictions == 0
    assert [(e.kind, e.keys) for e in m.take_events()] == [("removed", ["a"]), ("removed", ["b"])]


def test_worker_metadata_adds_up_across_workers():
    a = load_errors.IntegrityWorkerMetadata(
        completed_jobs={1: 1}, failed_host_blocks={1: [3, 4]}, failed_blocks=2, unchecked_blocks=1
    )
    b = load_errors.IntegrityWorkerMetadata(
        completed_jobs={1: 1, 2: 1}, failed_host_blocks={1: [4, 5]}, failed_blocks=2
    )
    merged = a.aggregate(b).aggregate(OffloadingWorkerMetadata(completed_jobs={2: 1}))
    assert isinstance(merged, load_errors.IntegrityWorkerMetadata)
    assert merged.completed_jobs == {1: 2, 2: 2}
    assert merged.failed_host_blocks == {1: [3, 4, 5]} and merged.failed_blocks == 4 and merged.unchecked_blocks == 1


# -- the tiering layout ----------------------------------------------------------------------------------------------

PAGES = [512, 256]


def tiering_kv(num_blocks=10, seed=0):
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    gen = torch.Generator().manual_seed(seed)
    tensors = [
        CanonicalKVCacheTensor(torch.randint(-128, 128, (num_blocks, p), dtype=torch.int8, generator=gen), p)
        for p in PAGES
    ]
    return CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(0, 512), CanonicalKVCacheRef(1, 256)]])


def tiering_spec(setting: str, f: int):
    config = offloading_config(
        {**TIERING, "cpu_bytes_to_use": 6 * 4096 * f, "integrity": setting},
        groups=((0,),),
        worker_bytes=sum(PAGES),
        f=f,
        engine_id=f"integrity-{uuid.uuid4().hex[:12]}",
    )
    with built_by_our_connector():
        return config, OffloadingSpecFactory.create_spec(config)


@pytest.mark.parametrize("f", [1, 3, 16])
def test_the_checked_layout_adds_a_trailer_to_each_slot_and_its_own_namespace(f):
    """Version 1 of the layout: each worker slot is vLLM's pages (rounded to 16 bytes) plus a trailer of the row
    marker and f checksums, the rows padded to the page size as vLLM pads them; the tiers name files, objects and
    peers under the model name with a suffix, so this layout never mixes with vLLM's. The CPU tier holds as many
    chunks as without the checks (no intact chunk loses its place to them): where the trailer pushes a row over a
    memory page (f = 16: 3 pages of KV, 4 with it), the region grows instead."""
    config, off = tiering_spec("off", f)
    _, on = tiering_spec("verify", f)
    assert off.trailer_bytes == 0 and on.trailer_bytes == trailer_bytes(f) == -(-8 * (1 + f) // 16) * 16
    assert on.cpu_page_size_per_worker == off.cpu_page_size_per_worker + on.trailer_bytes
    assert on.kv_bytes_per_chunk % 4096 == 0 and on.kv_bytes_per_chunk >= on.cpu_page_size_per_worker
    assert off.num_chunks == config.extra_config["cpu_bytes_to_use"] // off.kv_bytes_per_chunk
    assert on.num_chunks == off.num_chunks
    grown = on.kv_bytes_per_chunk - off.kv_bytes_per_chunk
    assert grown == (4096 if f == 16 else 0) and grown <= 4096 + trailer_bytes(f)
    assert on.config.model.name == "tiny" + on.fingerprint.namespace + INTEGRITY_NAMESPACE
    assert off.config.model.name == "tiny" + off.fingerprint.namespace
    paths = [FileMapper.from_offloading_spec("/r", s).get_file_name(key(1)) for s in (off, on)]
    assert paths[0] != paths[1] and INTEGRITY_NAMESPACE in paths[1]


@pytest.mark.parametrize("setting", ["verify", "require"])
def test_blocks_written_without_a_trailer_load_unchecked_under_verify_and_fail_under_require(setting):
    """Our worker's store fills the slot's trailer (marker and checksums), and its loads check it: intact blocks pass,
    a changed byte fails. Chunks whose pages were written through vLLM's own region views (as vLLM's worker writes
    them: no trailer) load unchecked under "verify" -- every byte loaded -- and fail under "require"."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    f = 2
    config, spec = tiering_spec(setting, f)
    kv = tiering_kv(seed=4)
    worker = spec.get_worker(kv)
    region = SharedOffloadRegion(
        engine_id=config.engine_id,
        num_chunks=spec.num_chunks,
        rank=0,
        kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
        cpu_page_size=spec.cpu_page_size_per_worker,
    )
    views = [region.create_next_worker_view(p * f) for p in PAGES]
    ident = integrity.identities_of_keys([key(7), key(8)])
    try:
        assert worker.submit_store(0, GPULoadStoreSpec([1, 2, 3], [3], [0]), IdentifiedChunks([4, 1], ident))
        assert all(r.success for r in finished(worker))
        cfg = worker.engine._launcher.config(Direction.STORE)
        mark = integrity.marker(f, cfg.elem, cfg.vec)
        assert worker.checksums.table[4, 0].item() == worker.checksums.table[1, 0].item() == mark
        submit_load(worker, 1, IdentifiedChunks([4, 1], ident), GPULoadStoreSpec([5, 6, 7], [3], [0]), expedited=False)
        assert finished(worker)[0].success
        assert worker.take_load_errors() == ([], 0)
        for t in kv.tensors:
            assert torch.equal(t.tensor[5:8], t.tensor[1:4])

        # Chunk 2 and 3 through vLLM's views, as vLLM's own worker writes them: pages only, the trailer left as is.
        gen = torch.Generator().manual_seed(9)
        for v in views:
            v[2:4] = torch.randint(-128, 128, v[2:4].shape, dtype=torch.int8, generator=gen)
        worker.checksums.table[2:4] = 0
        other = integrity.identities_of_keys([key(9), key(10)])
        submit_load(worker, 2, IdentifiedChunks([2, 3], other), GPULoadStoreSpec([0, 8, 9], [3], [1]), expedited=False)
        assert finished(worker)[0].success
        errors, unchecked = worker.take_load_errors()
        if setting == "verify":
            assert errors == [] and unchecked == 3
        else:
            assert unchecked == 0 and [(e.gpu_block_ids, e.host_block_ids) for e in errors] == [((0, 8, 9), (2, 3, 3))]
            assert errors[0].tier == "CPU tier"
        # Loaded either way: what vLLM's view holds (sub-blocks 1 of chunk 2, then 0 and 1 of chunk 3).
        for t, v, p in zip(kv.tensors, views, PAGES):
            for dst, (row, sub) in zip([0, 8, 9], [(2, 1), (3, 0), (3, 1)]):
                assert torch.equal(t.tensor[dst], v[row, sub * p : (sub + 1) * p])
    finally:
        worker.shutdown()
        del views
        region.cleanup()


class _FakeVllmWorker:
    """vLLM's OffloadingConnectorWorker, as far as our connector's worker side uses it: its load jobs' requests,
    the worker's results and its metadata."""

    def __init__(self, worker, jobs):
        self.worker, self._load_jobs = worker, jobs

    def get_finished(self, finished_req_ids):
        self._load_jobs.clear()  # vLLM forgets the jobs it reports
        return set(), {"req-1"}

    def build_connector_worker_meta(self):
        return OffloadingWorkerMetadata(completed_jobs={3: 1})


class _FakeOurWorker:
    def __init__(self, errors, unchecked=0):
        self.errors, self.unchecked = errors, unchecked

    def take_load_errors(self):
        out, self.errors = (self.errors, self.unchecked), []
        return out


def connector_worker_side(groups: int, errors, jobs):
    """Our connector's worker side over stand-ins (no engine): what vLLM's connector calls on it each step."""
    c = load_errors.TritonOffloadingConnector.__new__(load_errors.TritonOffloadingConnector)
    c.connector_worker = _FakeVllmWorker(_FakeOurWorker(errors, unchecked=2), jobs)
    c.connector_scheduler = None
    c._connector_metadata = OffloadingConnectorMetadata(load_jobs={}, store_jobs={})  # the step's, bound by vLLM
    c._failure_policy, c._by_request = "recompute", groups > 1
    c._invalid, c._failed_requests, c._failed_host_blocks = set(), set(), {}
    c._failed = c._unchecked = 0
    return c


def _error(job=3, gpu=(5, 6), host=(2, 2)):
    from triton_offload.connector.worker import LoadError

    return LoadError(job, gpu, host, (11, 11), "host cache")


def test_one_group_reports_the_failed_gpu_blocks_in_the_step_the_load_is_reported(caplog):
    c = connector_worker_side(1, [_error()], {3: "req-1"})
    with caplog.at_level("WARNING"):
        assert c.get_finished(set()) == (set(), {"req-1"})
    assert c.get_block_ids_with_load_errors() == {5, 6} and c.get_block_ids_with_load_errors() == set()
    meta = c.build_connector_worker_meta()
    assert meta.completed_jobs == {3: 1} and meta.failed_host_blocks == {3: [2]}
    assert (meta.failed_blocks, meta.unchecked_blocks) == (2, 2)
    assert "request req-1 (load job 3): 2 block(s) loaded from the host cache" in caplog.text
    assert not isinstance(c.build_connector_worker_meta(), load_errors.IntegrityWorkerMetadata), "reported once"


def test_several_groups_report_the_request_and_a_sync_load_stops_the_engine():
    """vLLM takes no block ids with several KV-cache groups: the request goes into failed_recving with its
    finished_recving; a synchronous (expedited) load has no request to name, so the engine stops."""
    c = connector_worker_side(2, [_error()], {3: "req-1"})
    results = c.get_transfer_results(set())
    assert results.failed_recving == {"req-1"} and c.get_block_ids_with_load_errors() == set()
    c = connector_worker_side(2, [_error()], {3: None})
    with pytest.raises(RuntimeError, match="a synchronous load's failed blocks cannot be reported"):
        c.get_finished(set())


class _FakeTieringManager:
    """vLLM's tiering manager as far as attach_identities wraps it: every key is a hit in chunk = its index."""

    def __init__(self):
        self.stored: set = set()

    def lookup(self, key, req_context):
        return LookupResult.HIT

    def prepare_load(self, keys, req_context):
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        return CPULoadStoreSpec([int.from_bytes(k[:4], "big") for k in keys])

    def get_load_source(self, key, req_context):
        return SimpleNamespace(value="disk")

    def prepare_store(self, keys, req_context):
        from vllm.v1.kv_offload.base import PrepareStoreOutput
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        new = [k for k in keys if k not in self.stored]
        self.stored.update(new)
        return PrepareStoreOutput(new, CPULoadStoreSpec(list(range(len(new)))), [])


def test_the_tiering_manager_hands_out_identities_and_a_failed_chunk_misses_until_stored_anew():
    from triton_offload.connector.tiering import attach_identities

    m = _FakeTieringManager()
    attach_identities(m)
    keys = [key(3), key(5)]
    spec = m.prepare_load(keys, ctx())
    assert isinstance(spec, IdentifiedChunks) and spec.block_ids.tolist() == [3, 5]
    assert np.array_equal(spec.identities, integrity.identities_of_keys(keys))
    assert m.chunk_sources[5] == (key(5), "disk")
    assert m.discard_failed([5, 77]) == [key(5)]
    assert m.lookup(key(5), ctx()) == LookupResult.MISS and m.lookup(key(3), ctx()) == LookupResult.HIT
    m.stored.add(key(3))
    out = m.prepare_store([key(3), key(5)], ctx())  # key 5's bad chunk was evicted: it is stored anew
    assert out.keys_to_store == [key(5)] and np.array_equal(
        out.store_spec.identities, integrity.identities_of_keys([key(5)])
    )
    assert m.lookup(key(5), ctx()) == LookupResult.HIT


def test_tiering_loads_hash_only_keys_their_chunks_did_not_get_from_a_store(monkeypatch):
    """attach_identities keeps each stored chunk's key digest: loading it hashes nothing; a chunk vLLM filled itself
    (promoted from a secondary tier) or that another key took since is hashed, and every load's identities are its
    keys', personalised."""
    from vllm.v1.kv_offload.base import PrepareStoreOutput
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from triton_offload.connector import tiering

    chunk_of: dict = {}

    class Chunks(_FakeTieringManager):  # chunks as the test places them
        def prepare_load(self, keys, req_context):
            return CPULoadStoreSpec([chunk_of[k] for k in keys])

        def prepare_store(self, keys, req_context):
            return PrepareStoreOutput(list(keys), CPULoadStoreSpec([chunk_of[k] for k in keys]), [])

    hashed: list = []
    real = tiering.digests_of_keys
    monkeypatch.setattr(tiering, "digests_of_keys", lambda keys, person: hashed.extend(keys) or real(keys, person))
    person = b"p" * 16
    m = Chunks()
    tiering.attach_identities(m, person)
    a, b, c = key(1), key(2), key(3)
    chunk_of.update({a: 0, b: 1, c: 2})
    m.prepare_store([a, b], ctx())
    hashed.clear()
    for keys in ([a], [b, a], [a, b, c]):  # c's chunk was promoted: never stored through this manager
        spec = m.prepare_load(keys, ctx())
        assert np.array_equal(spec.identities, integrity.identities_of_keys(keys, person))
    assert hashed == [c], "only the promoted chunk's key is hashed, once"
    chunk_of[c] = 0  # chunk 0 now holds c (a was evicted), filled by a promotion
    spec = m.prepare_load([c, b], ctx())
    assert np.array_equal(spec.identities, integrity.identities_of_keys([c, b], person))
    assert m.chunk_digests[0][0] == c and len(m.chunk_digests) == 3


def test_specs_carry_identities_as_their_digests():
    """HostBlocksSpec and IdentifiedChunks keep the identities as bytes (what pickles cheaply to the workers) and
    hand them out as int64; any integers go in (uint64 keeps its bits), anything else is refused."""
    import pickle

    from triton_offload.connector.manager import HostBlocksSpec

    keys = [key(1), key(2)]
    ident = integrity.identities_of_keys(keys)
    for spec in (HostBlocksSpec([3, 4], ident), IdentifiedChunks([3, 4], integrity.digests_of_keys(keys))):
        assert spec.identity_bytes == integrity.digests_of_keys(keys) == ident.tobytes()
        back = pickle.loads(pickle.dumps(spec))
        assert np.array_equal(back.identities, ident) and back.identities.dtype == np.int64
        assert back.block_ids.tolist() == [3, 4] and type(back) is type(spec)
    assert HostBlocksSpec([1], [2**64 - 1]).identities.tolist() == [-1]
    assert HostBlocksSpec([1], [-5]).identities.tolist() == [-5] and HostBlocksSpec([1]).identities is None
    with pytest.raises(TypeError, match="identities must hold integers, got float64"):
        HostBlocksSpec([1], [0.5])
