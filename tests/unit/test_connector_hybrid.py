"""Hybrid models at full capacity: TritonOffloadingSpec's host rows for 1, 2 and 4 KV-cache groups, overlaid (vLLM's
HMA) and on bytes of their own, of equal and unequal sizes, and packed slabs (DeepSeek-V4's path), with vLLM 0.33's
own connector code: ``build_offloading_config`` (wrapped by the plugin, as vLLM's plugin loading does), the worker
role's ``register_kv_caches`` over caches laid out by vLLM's ``create_kv_cache_views``, and its store and load jobs.

For each layout: the keys that fit times the host bytes each occupies are >= 95 % of ``cpu_bytes_to_use`` (vLLM's
bytes per block gave 1/G of that for G groups on separate bytes: its #56871), every key's bytes round-trip, and a
key never writes another group's bytes, on the GPU or in a host row. The budget and pages are those of the review's
table (races-hybrid-review-2026-11-26.md: 262144 bytes, f = 2, 1024-byte pages).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid

import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.base", reason="needs vLLM >= 0.32 (pip install 'triton-offload[vllm]')")
from vllm_configs import ctx, key, worker_role_missing  # noqa: E402

if reason := worker_role_missing():
    pytest.skip(reason, allow_module_level=True)
from vllm.distributed.kv_transfer.kv_connector.v1 import offloading_connector  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker  # noqa: E402
from vllm.v1.kv_offload.base import GPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm_hybrid import Case, HybridKV, full, mamba, sliding, vllm_config  # noqa: E402

import triton_offload.connector as plugin  # noqa: E402
from triton_offload.connector import geometry  # noqa: E402

pytestmark = pytest.mark.vllm
plugin.register()  # what vLLM's plugin loading does in every engine process: wraps build_offloading_config

BUDGET, F, SENTINEL = 262144, 2, 0x5A

CASES = {
    "1-group": Case(((full(), 2),), "overlaid"),
    # Sliding window next to full attention: by default vLLM stores a sliding-window group's keys only at a
    # request's boundaries, so its keys borrow the full-attention region.
    "2-overlaid-full-sw": Case(((full(), 2), (sliding(), 2)), "overlaid"),
    "2-overlaid-full-full": Case(((full(), 2), (full(), 2)), "overlaid"),
    "2-disjoint": Case(((full(), 2), (full(), 2)), "disjoint"),
    "4-disjoint": Case(((full(), 2),) * 4, "disjoint"),
    "4-overlaid-full-3sw": Case(((full(), 2),) + ((sliding(), 2),) * 3, "overlaid"),
    "unequal-dense": Case(((full(), 2), (full(512, padded=1024), 2)), "overlaid"),
    # The review's row E: a Mamba-like state of 300 bytes per layer padded to overlay 1024-byte pages.
    "unequal-mamba": Case(((full(), 2), (mamba(), 2)), "overlaid"),
    "packed-slab": Case(((full(), 1), (full(512), 1), (full(512), 1)), "packed"),
}


def _spec(kv: HybridKV, extra=None, *, wrapped=True, retention_interval=0):
    """The spec as vLLM's connector builds it: ``build_offloading_config`` (our wrapper around it, unless not
    ``wrapped``: as without the plugin's entry point), then the factory."""
    extra = {"spec_name": plugin.SPEC_NAME, "cpu_bytes_to_use": BUDGET, "block_size": F * 16, **(extra or {})}
    build = offloading_connector.build_offloading_config
    if not wrapped:
        build = build.__wrapped__
    config = build(vllm_config(extra, retention_interval=retention_interval), kv.config)
    return config, OffloadingSpecFactory.create_spec(config)


def _worker_role(kv: HybridKV, spec):
    role = OffloadingConnectorWorker(spec, vllm_config({}), kv.config)
    role.register_kv_caches(dict(kv.views))
    return role


def _run(role, store=None, load=None):
    """One step of vLLM's worker role: a store (deferred to the next step, as vLLM does) or a sync load."""
    if store is not None:
        role.prepare_store_kv(OffloadingConnectorMetadata(load_jobs={}, store_jobs=store))
        role.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
    if load is not None:
        role.start_kv_transfers(OffloadingConnectorMetadata(load_jobs=load, store_jobs={}))
    role.worker.wait(set(range(1000)))
    role.get_finished(set())


@pytest.mark.parametrize("name", list(CASES))
def test_keys_times_their_bytes_fill_the_budget(name):
    """Keys that fit x host bytes per key >= 95 % of cpu_bytes_to_use, the worker's rows are the scheduler's, and a
    key of a group with a region of its own occupies exactly its group's bytes."""
    kv = HybridKV(CASES[name], 16)
    config, spec = _spec(kv)
    manager = spec.get_manager()
    role = _worker_role(kv, spec)
    worker = role.worker
    rows, regions = spec.num_host_blocks, spec.num_regions
    assert worker.host_cache.num_blocks == rows and worker.kv.host_block_bytes(F) == spec.budget_block_bytes
    assert manager.counters["host_keys"] == rows * regions
    key_bytes = worker.kv.key_bytes(F)
    group_regions = worker.kv.group_regions or (0,) * len(key_bytes)
    filled = sum(rows * max(b for b, r in zip(key_bytes, group_regions) if r == k) for k in range(regions))
    assert filled == worker.host_cache.nbytes >= 0.95 * BUDGET
    for g, (region, nbytes) in enumerate(zip(group_regions, worker.kv.group_bytes)):
        if list(group_regions).count(region) == 1:
            assert key_bytes[g] == F * nbytes, "a key with a region of its own costs its group's bytes"
    role.shutdown()


@pytest.mark.parametrize(
    "name, before_keys, after_keys",
    [("2-disjoint", 32, 64), ("4-disjoint", 16, 64), ("unequal-dense", 64, 84), ("packed-slab", 64, 192)],
)
def test_before_and_after(name, before_keys, after_keys):
    """The keys the budget holds sized as before (vLLM's bytes per block: no entry point, so no group bytes) and now.
    Before, groups on bytes of their own left 1/G of the budget unallocated; a packed slab's key took the slab."""
    kv = HybridKV(CASES[name], 16)
    _, old = _spec(kv, wrapped=False)
    _, new = _spec(kv)
    assert old.num_host_blocks * old.num_regions == before_keys
    assert new.num_host_blocks * new.num_regions == after_keys


def test_unequal_mamba_per_group_regions_give_the_state_its_own_bytes():
    """The review's row E with ``host_regions = "per_group"``: 49 rows of 2 x (2048 + 600) bytes, 98 keys, 99 % of
    the budget; "auto" (the default) lets the state's few keys borrow the attention region instead (64 rows)."""
    kv = HybridKV(CASES["unequal-mamba"], 16)
    _, auto = _spec(kv)
    assert auto.group_regions is None and auto.num_host_blocks == 64
    _, per_group = _spec(kv, {"host_regions": "per_group"})
    assert per_group.group_regions == (0, 1) and per_group.region_bytes == (2048, 600)
    assert per_group.num_host_blocks == 49 and 49 * per_group.budget_block_bytes >= 0.95 * BUDGET
    role = _worker_role(kv, per_group)
    assert role.worker.kv.key_bytes(F) == (4096, 1200)
    role.shutdown()


def test_dense_sliding_window_checkpoints_get_a_region_of_their_own():
    """With dense sliding-window checkpoints (``prefix_cache_retention_interval`` None; vLLM's default is 0) the
    sliding-window group stores a key per chunk like full attention, so it gets a region of its own."""
    kv = HybridKV(CASES["2-overlaid-full-sw"], 16)
    _, sparse = _spec(kv)
    _, dense = _spec(kv, retention_interval=None)
    assert sparse.group_regions is None and dense.group_regions == (0, 1)
    assert sparse.num_host_blocks * sparse.num_regions == dense.num_host_blocks * dense.num_regions == 64


@pytest.mark.parametrize("name", list(CASES))
def test_every_key_round_trips_and_touches_no_other_group(name):
    """The cache filled with keys of every group (each region's pool full), stored group by group through vLLM's
    worker role: each store leaves every byte outside its keys' regions as it was; then all keys are loaded into
    other GPU blocks in one sync load: each block gets exactly its source's bytes, no other block changes."""
    case = CASES[name]
    groups = len(case.groups)
    kv = HybridKV(case, 1)  # sizes only
    _, probe = _spec(kv)
    rows, group_regions = probe.num_host_blocks, probe.group_regions or (0,) * groups
    # Each region's rows shared out among its groups: group g stores counts[g] keys of F blocks.
    counts = [0] * groups
    for region in range(probe.num_regions):
        members = [g for g in range(groups) if group_regions[g] == region]
        for i, g in enumerate(members):
            counts[g] = rows // len(members) + (1 if i < rows % len(members) else 0)
    # Overlaid groups share GPU blocks (a block belongs to one group at a time): every group's blocks are distinct.
    need = sum(2 * F * c for c in counts)
    kv = HybridKV(case, need, seed=3)
    _, spec = _spec(kv)
    manager, role = spec.get_manager(), _worker_role(kv, spec)
    host = role.worker.host_cache.buffer
    host.fill_(SENTINEL)
    region_bytes = role.worker.kv.region_bytes
    starts = [F * sum(region_bytes[:r]) for r in range(len(region_bytes))]
    before = kv.raw.clone()
    rc = ctx()
    next_block, jobs = 0, 0
    loads = []  # (group, keys, src blocks, dst blocks)
    for g in range(groups):
        keys = [key(i, g) for i in range(counts[g])]
        src = list(range(next_block, next_block + F * counts[g]))
        dst = list(range(next_block + F * counts[g], next_block + 2 * F * counts[g]))
        next_block += 2 * F * counts[g]
        out = manager.prepare_store(keys, rc)
        assert out is not None and len(out.keys_to_store) == counts[g], "the region's pool holds them all"
        sizes = [0] * groups
        sizes[g] = len(src)
        host_before = host.clone()
        job = TransferJob("r", GPULoadStoreSpec(src, sizes, [0] * groups), out.store_spec)
        _run(role, store={jobs: job})
        jobs += 1
        manager.complete_store(keys, rc)
        r = group_regions[g]
        width = F * region_bytes[r]
        changed = (host != host_before).any(dim=0)
        assert not changed[: starts[r]].any() and not changed[starts[r] + width :].any(), (
            "a store wrote outside its group's region of the rows"
        )
        rows_written = sorted(set(out.store_spec.block_ids.tolist()))
        assert (host[[i for i in range(host.shape[0]) if i not in rows_written]] == host_before[
            [i for i in range(host.shape[0]) if i not in rows_written]
        ]).all(), "a store wrote rows of no key of its"  # fmt: skip
        loads.append((g, keys, src, dst))
    # One sync load of every key of every group: one launch for all groups.
    all_keys = [k for _, keys, _, _ in loads for k in keys]
    spec_load = manager.prepare_load(all_keys, rc)
    dst_ids = [b for _, _, _, dst in loads for b in dst]
    sizes = [len(dst) for _, _, _, dst in loads]
    _run(role, load={jobs: TransferJob("r", spec_load, GPULoadStoreSpec(dst_ids, sizes, [0] * groups), sync=True)})
    manager.complete_load(all_keys, rc)
    # What the allocation must hold now: the sources' pages copied to the destinations through vLLM's own views,
    # every other byte (padding, other groups' blocks, blocks never addressed) as it was.
    actual = kv.raw.clone()
    kv.raw.copy_(before)
    for g, _, src, dst in loads:
        for name in kv.names[g]:
            kv.views[name][dst] = kv.views[name][src].clone()
    assert torch.equal(actual, kv.raw), "a loaded block differs from its source, or a load wrote other bytes"
    role.shutdown()


def test_packed_slab_keys_move_only_their_groups_part(caplog):
    """DeepSeek-V4's path: vLLM's worker role hands every group the whole packed block; with the KV-cache groups'
    placement from vLLM's config each group moves only its layers' pages (1024, 512, 512 bytes of the 2048-byte
    block), and a job's reported bytes are those."""
    kv = HybridKV(CASES["packed-slab"], 24, seed=5)
    _, spec = _spec(kv)
    manager, role = spec.get_manager(), _worker_role(kv, spec)
    assert role.worker.kv.group_bytes == (1024, 512, 512)
    assert [tuple(t.shape) for t in role.worker.kv.kv_caches] == [(24, 1024), (24, 512), (24, 512)]
    rc = ctx()
    keys = [key(0, 0), key(0, 1), key(0, 2)]
    out = manager.prepare_store(keys, rc)
    role.prepare_store_kv(
        OffloadingConnectorMetadata(
            load_jobs={}, store_jobs={0: TransferJob("r", GPULoadStoreSpec([1, 2, 3, 4, 5, 6], [2, 2, 2], [0] * 3),
                                                     out.store_spec)}
        )
    )  # fmt: skip
    role.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
    role.worker.wait({0})
    role.get_finished(set())
    stats = role.build_connector_worker_meta().transfer_stats
    assert stats.store.bytes == F * (1024 + 512 + 512), "each key moved only its group's pages, not the slab"
    role.shutdown()


def test_without_the_entry_point_rows_are_sized_as_before_with_a_warning(caplog):
    kv = HybridKV(CASES["2-disjoint"], 8)
    with caplog.at_level(logging.WARNING, logger="triton_offload"):
        _, spec = _spec(kv, wrapped=False)
    assert spec.geometry is None and spec.num_host_blocks == 32
    assert "may hold 1/2 of the keys the budget allows" in caplog.text


def test_a_budget_that_whole_rows_cannot_use_is_warned(caplog):
    """1.9 rows: one row is allocated, 53 % of the budget; the scheduler says so, naming the sizes."""
    kv = HybridKV(CASES["2-disjoint"], 8)
    _, spec = _spec(kv, {"cpu_bytes_to_use": int(1.9 * 8192)})
    with caplog.at_level(logging.WARNING, logger="triton_offload"):
        spec.get_manager()
    assert spec.num_host_blocks == 1
    assert "only 1 rows of 8192 bytes fit (8192 bytes, 52.6 %)" in caplog.text


def test_the_geometry_is_read_from_vllms_config():
    kv = HybridKV(CASES["unequal-mamba"], 4)
    config, spec = _spec(kv)
    g = geometry.geometry_for(config)
    assert g is spec.geometry
    assert [(x.group_id, x.kind, x.dense, x.nbytes) for x in g.groups] == [
        (0, "FullAttentionSpec", True, 2048),
        (1, "MambaSpec", False, 600),
    ]
    assert [layer.page for layer in g.groups[1].layers] == [300, 300]
    assert geometry.host_regions(g, "auto") == (0, 0) and geometry.host_regions(g, "per_group") == (0, 1)
    with pytest.raises(ValueError, match="host_regions = 'bogus'"):
        geometry.host_regions(g, "bogus")


# -- the tiering spec ----------------------------------------------------------------------------------------------


def _tiering(kv: HybridKV, layout: str, budget: int = BUDGET):
    extra = {"spec_name": plugin.TIERING_SPEC_NAME, "cpu_bytes_to_use": budget, "block_size": F * 16}
    if layout != "worker_slots":
        extra["host_layout"] = layout
    config = offloading_connector.build_offloading_config(vllm_config(extra), kv.config)
    # A region name of its own per test: vLLM names it after the engine id.
    config = dataclasses.replace(config, engine_id=f"hybrid-{layout}-{uuid.uuid4().hex[:10]}")
    geometry.remember(config, kv.config)
    return OffloadingSpecFactory.create_spec(config)


def test_tiering_worker_slots_reserve_every_group_and_packed_rows_do_not():
    """vLLM's worker-slot rows (the tiering spec's default, byte-compatible with vLLM's own worker) reserve every
    canonical tensor's page for each key: vLLM's #56871 exactly, 1/G of the keys for G groups on bytes of their own.
    host_layout = "packed" sizes a row for the largest group, and names what the secondary tiers persist apart."""
    from vllm.v1.kv_offload.file_mapper import FileMapper

    from triton_offload.connector.tiering import PACKED_NAMESPACE

    for name, slots_keys, packed_keys in (("2-disjoint", 32, 64), ("4-disjoint", 16, 64), ("1-group", 64, 64)):
        kv = HybridKV(CASES[name], 4)
        slots, packed = _tiering(kv, "worker_slots"), _tiering(kv, "packed")
        assert (slots.num_chunks, packed.num_chunks) == (slots_keys, packed_keys), name
        assert packed.num_chunks * packed.kv_bytes_per_chunk >= 0.95 * BUDGET
        assert packed.config.model.name == "tiny" + packed.fingerprint.namespace + PACKED_NAMESPACE
        roots = [FileMapper.from_offloading_spec("/kv", s).base_path for s in (slots, packed)]
        assert roots[0] != roots[1], "packed rows must never be read as vLLM's worker slots"


def test_tiering_packed_rows_round_trip_through_the_shared_region():
    """The packed layout's worker in vLLM's shared region: keys of both groups stored and loaded back by vLLM's
    worker role, each block's bytes as they were; the region's file is gone after shutdown."""
    import os

    kv = HybridKV(CASES["2-disjoint"], 16, seed=9)
    spec = _tiering(kv, "packed", budget=8 * F * 2048)
    role = _worker_role(kv, spec)
    worker = role.worker
    assert worker.kv.host_slots is None and worker.kv.host_block_bytes(F) == F * 2048
    region = worker.name.paths[0]
    before = kv.raw.clone()
    src, dst = [1, 2, 3, 4], [9, 10, 11, 12]  # group 0: blocks 1, 2 (chunk 0); group 1: blocks 3, 4 (chunk 1)
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    store = TransferJob("r", GPULoadStoreSpec(src, [2, 2], [0, 0]), CPULoadStoreSpec([0, 1]))
    _run(role, store={0: store})
    load = TransferJob("r", CPULoadStoreSpec([0, 1]), GPULoadStoreSpec(dst, [2, 2], [0, 0]), sync=True)
    _run(role, load={1: load})
    loaded = [kv.block_bytes(g, d) for g, d in enumerate((dst[:2], dst[2:]))]
    kv.raw.copy_(before)
    for g, s in enumerate((src[:2], src[2:])):
        assert torch.equal(loaded[g], kv.block_bytes(g, s)), f"group {g}"
    role.shutdown()
    assert not os.path.exists(region)


def test_tiering_packed_rows_with_the_integrity_checks_carry_a_trailer():
    """host_layout = "packed" with integrity = "verify" (issue 41 beside issue 44): the trailer follows the packed
    slot's pages (the CPU tier keeps its chunk count), the secondary tiers get both namespaces' suffixes, the keys of
    both groups load checked, and a changed byte is a load error naming its CPU tier chunk."""
    from vllm.v1.kv_offload.file_mapper import FileMapper

    from triton_offload import integrity
    from triton_offload.connector import load_errors
    from triton_offload.connector.tiering import INTEGRITY_NAMESPACE, PACKED_NAMESPACE, IdentifiedChunks, trailer_bytes

    kv = HybridKV(CASES["2-disjoint"], 16, seed=4)
    budget = 8 * F * 2048
    plain = _tiering(kv, "packed", budget=budget)
    token = load_errors._REPORTING.set(True)  # what TritonOffloadingConnector does around vLLM's construction
    try:
        extra = {"spec_name": plugin.TIERING_SPEC_NAME, "cpu_bytes_to_use": budget, "block_size": F * 16,
                 "host_layout": "packed", "integrity": "verify"}  # fmt: skip
        config = offloading_connector.build_offloading_config(vllm_config(extra), kv.config)
        config = dataclasses.replace(config, engine_id=f"hybrid-checked-{uuid.uuid4().hex[:10]}")
        geometry.remember(config, kv.config)
        spec = OffloadingSpecFactory.create_spec(config)
        assert spec.cpu_page_size_per_worker == plain.cpu_page_size_per_worker + trailer_bytes(F)
        assert spec.num_chunks == plain.num_chunks, "the checks cost no chunk its place"
        assert spec.config.model.name == "tiny" + spec.fingerprint.namespace + PACKED_NAMESPACE + INTEGRITY_NAMESPACE
        roots = [FileMapper.from_offloading_spec("/kv", s).base_path for s in (plain, spec)]
        assert roots[0] != roots[1]
        role = _worker_role(kv, spec)
    finally:
        load_errors._REPORTING.reset(token)
    worker = role.worker
    try:
        ident = integrity.identities_of_keys([key(1, 0), key(1, 1)])
        chunks = IdentifiedChunks([0, 1], ident)
        assert worker.submit_store(0, GPULoadStoreSpec([1, 2, 3, 4], [2, 2], [0, 0]), chunks)
        worker.wait({0})
        assert all(r.success for r in worker.get_finished())
        assert worker.submit_load(1, chunks, GPULoadStoreSpec([9, 10, 11, 12], [2, 2], [0, 0]))
        worker.wait({1})
        assert all(r.success for r in worker.get_finished()) and worker.take_load_errors() == ([], 0)
        worker.host[1, 5] ^= 0x01  # chunk 1 (group 1's key), its first block
        assert worker.submit_load(2, chunks, GPULoadStoreSpec([9, 10, 11, 12], [2, 2], [0, 0]))
        worker.wait({2})
        assert all(r.success for r in worker.get_finished())
        (error,), _ = worker.take_load_errors()
        assert (error.gpu_block_ids, error.host_block_ids, error.tier) == ((11,), (1,), "CPU tier")
    finally:
        role.shutdown()
