"""TritonTieringOffloadingSpec through vLLM's real classes, without an engine (vLLM 0.32 and 0.33).

The point is byte compatibility with vLLM's own tiering worker: what our worker writes into the shared region must
be exactly what vLLM's ``CPUOffloadingWorker`` would write, because secondary tiers (fs, obj) persist whole region
rows under names that do not say which worker wrote them. vLLM's worker needs CUDA, so the expected bytes are built
here through vLLM's own region views (``SharedOffloadRegion.create_next_worker_view``, one per canonical tensor, as
its worker takes them) with vLLM's placement rule: sub-block j of chunk c of tensor t at ``view_t[c, j * page_t:]``,
``page_t`` the tensor's full (padded) page, of which the ref's un-padded bytes are copied.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="needs vLLM >= 0.32 with its tiering package")

from permissions import exposed_below  # noqa: E402
from tiering_factory import (  # noqa: E402
    PAGES,
    SENTINEL,
    expected_store,
    kv_caches,
    make_config,
    positions,
    region_file,
    vllm_views,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm_configs import finished, submit_load  # noqa: E402
from vllm_harness import free_port  # noqa: E402

import triton_offload.connector as plugin  # noqa: E402
from triton_offload.connector.tiering import TritonTieringOffloadingSpec  # noqa: E402
from triton_offload.connector.tiering_config import TritonTieringConfig  # noqa: E402

pytestmark = pytest.mark.vllm
plugin.register()  # what vLLM's plugin loader does in each of its processes

LAYOUTS = [
    pytest.param(1, 0, False, id="1worker"),
    pytest.param(2, 1, False, id="rank1of2"),
    pytest.param(2, 1, True, id="replicated-rank1"),
]


@pytest.mark.parametrize("f", [1, 2, 3], ids=lambda f: f"f{f}")
@pytest.mark.parametrize("world_size,rank,replicated", LAYOUTS)
def test_store_lands_where_vllm_views_say_and_loads_back(f, world_size, rank, replicated):
    """Random GPU blocks, chunk ids and skips, two KV-cache groups: our worker's store equals, over the whole
    region (other workers' slots and page padding included), what vLLM's worker writes through its views; a load
    reads the bytes back exactly, into other GPU blocks, touching nothing else."""
    rng = np.random.default_rng(f * 10 + rank + 5 * replicated)
    kv = kv_caches(seed=f)
    config = make_config(
        {"cpu_bytes_to_use": 16 * 4096 * f * world_size},  # rows are 1408 x f x copies, rounded up to 4 KiB
        num_groups=2,
        worker_bytes=sum(PAGES),
        f=f,
        world_size=world_size,
        rank=rank,
        replicated=replicated,
    )
    spec = OffloadingSpecFactory.create_spec(config)
    assert type(spec) is TritonTieringOffloadingSpec
    slot_rank = 0 if replicated else rank
    worker = spec.get_worker(kv)
    region, views = vllm_views(config, spec, slot_rank)
    try:
        whole = region.base_tensor
        whole.view(torch.uint8).fill_(SENTINEL)
        before = whole.clone()
        # Group 0: 5 blocks from position skip0; group 1: 3 blocks from skip1 (vLLM's block_indices % f).
        sizes = [5, 3]
        firsts = [int(rng.integers(0, 4)) * f + int(rng.integers(0, f)) for _ in sizes]
        need = [-(-(b % f + n) // f) for b, n in zip(firsts, sizes)]
        gpu = rng.permutation(12)[: sum(sizes)].tolist()
        chunks = rng.permutation(spec.num_chunks)[: sum(need)].tolist()
        assert worker.submit_store(0, GPULoadStoreSpec(gpu, sizes, firsts), CPULoadStoreSpec(chunks))
        (res,) = finished(worker)
        assert res.success and res.transfer_size == 5 * (384 + 384) + 3 * (256 + 320)
        want = expected_store(before, views, kv, gpu, sizes, firsts, chunks, f)
        assert torch.equal(whole, want), "bytes differ from vLLM's worker-slot layout"
        assert not torch.equal(whole, before)

        sources = [t.tensor.clone() for t in kv.tensors]
        for t in kv.tensors:
            t.tensor.view(torch.uint8).fill_(SENTINEL)
        dst = rng.permutation(12)[: sum(sizes)].tolist()
        submit_load(worker, 1, CPULoadStoreSpec(chunks), GPULoadStoreSpec(dst, sizes, firsts), expedited=False)
        (res,) = finished(worker)
        assert res.success
        assert torch.equal(whole, want), "a load changed the region"
        expect = [torch.full_like(s, SENTINEL) for s in sources]
        g0 = 0
        for g, n in enumerate(sizes):
            for ref in kv.group_data_refs[g]:
                e, s = expect[ref.tensor_idx], sources[ref.tensor_idx]
                for i in range(n):
                    e[dst[g0 + i], : ref.page_size_bytes] = s[gpu[g0 + i], : ref.page_size_bytes]
            g0 += n
        for t, e in zip(kv.tensors, expect):
            assert torch.equal(t.tensor, e), "the load wrote other bytes than the refs' pages of its blocks"
    finally:
        worker.shutdown()
        del views, whole
        region.cleanup()
    assert not os.path.exists(region_file(config.engine_id))


def test_clean_shutdown_unmaps_the_region(caplog):
    """After jobs ran through the interpreter, shutdown leaves no view of the mapping behind: vLLM's cleanup can
    close it (it logs a warning and keeps the memory mapped when a buffer is still exported)."""
    kv = kv_caches(seed=5)
    config = make_config({"cpu_bytes_to_use": 8 * 4096}, num_groups=2, worker_bytes=sum(PAGES), f=2)
    worker = OffloadingSpecFactory.create_spec(config).get_worker(kv)
    assert worker.submit_store(0, GPULoadStoreSpec([4, 9, 2], [2, 1], [0, 0]), CPULoadStoreSpec([2, 3]))
    submit_load(worker, 1, CPULoadStoreSpec([2]), GPULoadStoreSpec([7, 8], [2, 0], [0, 0]), expedited=False)
    assert all(r.success for r in finished(worker))
    with caplog.at_level("WARNING"):
        worker.shutdown()
    assert not [r.getMessage() for r in caplog.records if "close" in r.getMessage()]
    assert not os.path.exists(region_file(config.engine_id))


@pytest.mark.parametrize("f", [1, 2], ids=lambda f: f"f{f}")
def test_loads_blocks_written_through_vllm_views(f):
    """The other direction: chunks filled through vLLM's views as vLLM's worker lays them out (random bytes in every
    page, padding included) are loaded by our kernel into exactly the refs' un-padded bytes."""
    kv = kv_caches(seed=7)
    config = make_config({"cpu_bytes_to_use": 8 * 4096 * f}, num_groups=2, worker_bytes=sum(PAGES), f=f)
    spec = OffloadingSpecFactory.create_spec(config)
    worker = spec.get_worker(kv)
    region, views = vllm_views(config, spec, 0)
    try:
        gen = torch.Generator().manual_seed(f)
        for v in views:
            v.copy_(torch.randint(-128, 128, v.shape, dtype=torch.int8, generator=gen))
        sizes, firsts = [2 * f - 1, 1], [1, f]  # group 0 starts at sub-block 1 % f
        chunks = [6, 2, 5, 0][: sum(-(-(b % f + n) // f) for b, n in zip(firsts, sizes))]
        dst = [3, 8, 1, 10, 5, 0][: sum(sizes)]
        submit_load(worker, 7, CPULoadStoreSpec(chunks), GPULoadStoreSpec(dst, sizes, firsts), expedited=False)
        assert finished(worker)[0].success
        for g, j, row, sub in positions(sizes, firsts, chunks, f):
            for ref in kv.group_data_refs[g]:
                page = PAGES[ref.tensor_idx]
                want = views[ref.tensor_idx][row, sub * page : sub * page + ref.page_size_bytes]
                got = kv.tensors[ref.tensor_idx].tensor[dst[j], : ref.page_size_bytes]
                assert torch.equal(got, want), f"group {g}, tensor {ref.tensor_idx}, block {j}"
    finally:
        worker.shutdown()
        del views
        region.cleanup()


def test_scheduler_view_sees_the_worker_bytes_and_drops_the_name():
    """The scheduler's memoryview (what the fs/obj tiers persist) holds, for chunk c, exactly the row our worker
    filled; once the scheduler has mapped the region its /dev/shm name is gone, and transfers still work."""
    kv = kv_caches(seed=3)
    config = make_config({"cpu_bytes_to_use": 8 * 4096}, num_groups=2, worker_bytes=sum(PAGES), f=1)
    spec = OffloadingSpecFactory.create_spec(config)
    worker = spec.get_worker(kv)
    assert os.path.exists(region_file(config.engine_id)), "workers map the region by name first"
    manager = spec.get_manager()
    try:
        assert not os.path.exists(region_file(config.engine_id)), "the name outlived the last process that needed it"
        view = manager.primary_tier.get_kv_memoryview()
        assert worker.submit_store(0, GPULoadStoreSpec([4, 9], [1, 1], [0, 0]), CPULoadStoreSpec([2, 3]))
        assert finished(worker)[0].success
        rows = np.array(view, copy=True).view(np.int8)  # (num_chunks, row bytes), as the tiers address it
        assert rows.shape == (spec.num_chunks, spec.kv_bytes_per_chunk)
        t0, t1 = (kv.tensors[i].tensor[4].numpy() for i in (0, 1))
        assert (rows[2, :384] == t0[:384]).all() and (rows[2, 512 : 512 + 384] == t1[:384]).all()
        # Group 1's block: tensor 2 after 2 x 512 bytes, and tensor 0's first 320 bytes at the row's start.
        assert (rows[3, 1024 : 1024 + 256] == kv.tensors[2].tensor[9].numpy()).all()
        assert (rows[3, :320] == kv.tensors[0].tensor[9, :320].numpy()).all()
    finally:
        worker.shutdown()
        manager.shutdown()


# -- the /dev/shm name on every exit path ------------------------------------------------------------------------------

_KILLED_WORKER = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from tiering_factory import PAGES, kv_caches, make_config
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
config = make_config({{"cpu_bytes_to_use": 4 * sum(PAGES)}}, num_groups=2, worker_bytes=sum(PAGES), f=1,
                     engine_id={engine_id!r})
worker = OffloadingSpecFactory.create_spec(config).get_worker(kv_caches())
print("MAPPED", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_killed_worker_leaves_no_region_file():
    """A worker killed before the scheduler mapped the region (SIGKILL: no cleanup code runs) leaves no file."""
    engine_id = f"tiertest-kill-{uuid.uuid4().hex[:8]}"
    path = region_file(engine_id)
    script = _KILLED_WORKER.format(tests=os.path.dirname(os.path.dirname(__file__)), engine_id=engine_id)  # tests/
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert "MAPPED" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(path), f"{path} left behind by a killed worker"


def test_region_beyond_available_memory_is_refused_naming_the_key(monkeypatch):
    """The region (the whole instance's CPU tier, one /dev/shm file in RAM) is checked against MemAvailable by the
    worker that creates it, before the file is sized: a ValueError naming cpu_bytes_to_use and both sizes, and no
    file left."""
    from triton_offload.host import budget

    monkeypatch.setattr(budget, "available_host_bytes", lambda: 64 << 10)
    config = make_config({"cpu_bytes_to_use": "1MiB"}, num_groups=2, worker_bytes=sum(PAGES), f=1)
    spec = OffloadingSpecFactory.create_spec(config)
    region_bytes = spec.num_chunks * spec.kv_bytes_per_chunk
    with pytest.raises(
        ValueError, match=rf"cpu_bytes_to_use = 1048576 bytes .* asks for {region_bytes} bytes .* 65536"
    ):
        spec.get_worker(kv_caches())
    assert not os.path.exists(region_file(config.engine_id))


# -- where the region's pages go -------------------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/proc/self/numa_maps"), reason="needs Linux with NUMA support")
def test_worker_slots_are_placed_on_the_chosen_node(monkeypatch, caplog):
    """vLLM's constructor touches this worker's slots itself: it runs on a thread of the node's CPUs under a memory
    policy bound to the node (read back with get_mempolicy inside it), the caller's own policy and affinity stay, and
    the worker's pages, read back from numa_maps, are on that node."""
    from triton_offload.connector import tiering
    from triton_offload.host import numa

    seen = {}

    class Recorded(SharedOffloadRegion):
        def __init__(self, *args, **kwargs):
            seen.update(policy=numa.thread_policy(), cpus=os.sched_getaffinity(0), thread=threading.get_ident())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tiering, "SharedOffloadRegion", Recorded)
    config = make_config({"cpu_bytes_to_use": 64 * 4096, "numa_node": 0}, num_groups=2, worker_bytes=sum(PAGES), f=1)
    before = (numa.thread_policy(), os.sched_getaffinity(0))
    with caplog.at_level(logging.INFO, logger="triton_offload.connector.tiering_worker"):
        worker = OffloadingSpecFactory.create_spec(config).get_worker(kv_caches())
    try:
        node0 = numa.choose_node(0)
        assert seen["policy"] == (numa.MPOL_BIND, (0,)) and seen["thread"] != threading.get_ident()
        assert seen["cpus"] == set(node0.cpus or os.sched_getaffinity(0))
        assert (numa.thread_policy(), os.sched_getaffinity(0)) == before
        assert set(worker.placement.node_bytes) == {0} and worker.placement.resident >= 64 * 4096
        assert worker.numa.why == "numa_node = 0"
        assert "bytes used, host format native); numa_node = 0; this worker's pages: node 0: " in caplog.text
    finally:
        worker.shutdown()
    assert not os.path.exists(region_file(config.engine_id))


def test_a_node_that_does_not_exist_stops_the_worker_before_the_region(monkeypatch):
    config = make_config({"cpu_bytes_to_use": 8 * 4096, "numa_node": 63}, num_groups=2, worker_bytes=sum(PAGES), f=1)
    spec = OffloadingSpecFactory.create_spec(config)
    with pytest.raises(ValueError, match=r"numa_node = 63: node 63 does not exist on this machine"):
        spec.get_worker(kv_caches())
    assert not os.path.exists(region_file(config.engine_id))


def test_refused_registration_stops_the_worker_naming_the_packed_spec(monkeypatch):
    """cudaHostRegister refused (Confidential Computing mode): the region cannot be pinned at allocation (it is
    shared with the scheduler's tiers), so startup stops once, saying what to use instead; no file is left."""
    from triton_offload.connector.tiering_worker import TritonTieringWorker
    from triton_offload.host import registration

    class Refusing:
        def cudaHostRegister(self, ptr, size, flags):
            return 801

    monkeypatch.setattr(torch.cuda, "cudart", Refusing)
    monkeypatch.setattr(registration, "check_mapped_at_host_address", lambda ranges: None)
    init = TritonTieringWorker.__init__
    monkeypatch.setattr(TritonTieringWorker, "__init__", lambda self, *a, **k: init(self, *a, **{**k, "pin": True}))
    config = make_config({"cpu_bytes_to_use": 8 * 4096}, num_groups=2, worker_bytes=sum(PAGES), f=1)
    spec = OffloadingSpecFactory.create_spec(config)
    with pytest.raises(
        RuntimeError,
        match=r"cudaHostRegister failed with CUDA error 801 .* TritonTieringOffloadingSpec cannot run without it: .* "
        r"use spec_name TritonOffloadingSpec$",
    ):
        spec.get_worker(kv_caches())
    assert not os.path.exists(region_file(config.engine_id))


def test_failed_worker_startup_removes_the_region_file():
    """A worker that fails after creating the region (here: tensors larger than the slot vLLM sized) removes it."""
    kv = kv_caches()
    config = make_config({"cpu_bytes_to_use": 4 * sum(PAGES)}, num_groups=2, worker_bytes=sum(PAGES) - 128, f=1)
    spec = OffloadingSpecFactory.create_spec(config)
    with pytest.raises((ValueError, AssertionError), match="slot|exceeds worker area"):
        spec.get_worker(kv)
    assert not os.path.exists(region_file(config.engine_id))


def test_failed_scheduler_startup_removes_the_region_file(tmp_path, monkeypatch):
    """The scheduler fails to build its tiers after the worker created the region: the name goes too."""
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    def broken(*args, **kwargs):
        raise OSError("the fs tier's disk went away")

    kv = kv_caches()
    extra = {"cpu_bytes_to_use": 4 * sum(PAGES), "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path)}]}
    config = make_config(extra, num_groups=2, worker_bytes=sum(PAGES), f=1)
    spec = OffloadingSpecFactory.create_spec(config)
    worker = spec.get_worker(kv)
    monkeypatch.setattr(FileSystemTierManager, "__init__", broken)
    try:
        with pytest.raises(OSError, match="went away"):
            spec.get_manager()
        assert not os.path.exists(region_file(config.engine_id))
    finally:
        worker.shutdown()


# -- configuration ---------------------------------------------------------------------------------------------------

FS = {"type": "fs", "root_dir": "/x"}
T0 = r"\['secondary_tiers'\]\[0\]"  # how messages name the first tier
# Refused, with the network tiers' BAD_NETWORK, by test_bad_config_is_refused_at_startup_naming_the_key below.
BAD = {
    "unknown-tier": ({"secondary_tiers": [{**FS, "type": "nfs"}]}, T0 + r"\['type'\] = 'nfs' is not a usable"),
    "no-root-dir": ({"secondary_tiers": [{"type": "fs"}]}, T0 + r" \(type 'fs'\) needs 'root_dir'"),
    "no-type": ({"secondary_tiers": [{"root_dir": "/x"}]}, T0 + r"\['type'\] is missing"),
    "typo": ({"secondary_tiers": [{**FS, "rootdir": 1}]}, r"unknown key\(s\) 'rootdir' \(did you mean 'root_dir'\?\)"),
    "not-a-list": ({"secondary_tiers": FS}, r"\['secondary_tiers'\] = .* must be a list"),
    "not-a-dict": ({"secondary_tiers": ["fs"]}, T0 + " = 'fs' must be a dict"),
    "bp-no-cls": ({"secondary_tiers": [{**FS, "backpressure": {}}]}, T0 + r"\['backpressure'\] .* 'backpressure_cls'"),
    "bp-not-dict": ({"backpressure": [1], "secondary_tiers": [FS]}, r"\['backpressure'\] = \[1\] must be a dict"),
    "policy": ({"eviction_policy": "fifo"}, "eviction_policy = 'fifo' is not usable"),
    "store-threshold": ({"store_threshold": 2}, "store_threshold = 2 is not supported"),
    "canonical": ({"canonical_layout": True}, "canonical_layout = True is not supported"),
    "host-layout": ({"host_layout": "compact"}, r"host_layout = 'compact' is not supported; accepted: 'worker_slots'"),
    "num-ctas": ({"num_ctas": 0}, "num_ctas = 0 must be a positive int"),
    "transfer-path": ({"transfer_path": "DMA"}, "transfer_path = 'DMA' must be one of 'auto', 'kernel', 'dma'"),
    "no-budget": ({"cpu_bytes_to_use": None}, "needs 'cpu_bytes_to_use'"),
    "bad-budget": ({"cpu_bytes_to_use": "lots"}, "cpu_bytes_to_use = 'lots' is not a size"),
    "tiny-budget": ({"cpu_bytes_to_use": 100}, "cpu_bytes_to_use = 100 bytes is less than one chunk"),
    "numa-node": ({"numa_node": "near"}, r"numa_node = 'near' is not a NUMA setting; expected 'auto'"),
    "huge-pages": (
        {"huge_pages": "2MiB"},
        r"huge_pages = '2MiB' is not supported by TritonTieringOffloadingSpec: the region is vLLM's /dev/shm file",
    ),
    "pinning": (
        {"pinning": "auto"},
        r"pinning = 'auto' is not supported by TritonTieringOffloadingSpec: the region must be registered",
    ),
    "host-format": (
        {"host_format": "fp8_e4m3"},
        r"host_format = 'fp8_e4m3' needs host_layout = 'packed' with TritonTieringOffloadingSpec: vLLM's worker",
    ),
}


def _assert_refused(extra: dict, message: str) -> None:
    """Creating the spec with ``extra`` (over a 1 MiB CPU tier unless it sets its own) raises ``message``, as do the
    metrics vLLM builds from the same config where ``extra`` leaves the budget alone; nothing is allocated."""
    config = make_config({"cpu_bytes_to_use": "1MiB", **extra}, worker_bytes=sum(PAGES), f=1)
    with pytest.raises(ValueError, match=message):
        OffloadingSpecFactory.create_spec(config)
    if "cpu_bytes_to_use" not in extra:  # the metrics vLLM builds from the raw config refuse it the same way
        with pytest.raises(ValueError, match=message):
            TritonTieringOffloadingSpec.build_metric_definitions(dict(config.extra_config))
    assert not os.path.exists(region_file(config.engine_id)), "nothing may be allocated for a refused config"


def test_good_config_is_parsed_once_with_vllm_keys_passed_through(tmp_path):
    extra = {
        "cpu_bytes_to_use": "2MiB",
        "eviction_policy": "arc",
        "num_ctas": "4",  # an int written as a string, as vLLM reads its own block_size
        "transfer_path": "kernel",
        "backpressure": {"backpressure_cls": "EMABackpressureDetector"},
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 2, "n_write_threads": 2}],
    }
    config = make_config(extra, worker_bytes=sum(PAGES), f=2)
    spec = OffloadingSpecFactory.create_spec(config)
    assert spec.tiering_config == TritonTieringConfig(2 << 20, "arc", ("fs",), 4, ((0, str(tmp_path)),), "kernel")
    assert spec.extra_config["cpu_bytes_to_use"] == 2 << 20, "vLLM's spec reads int(cpu_bytes_to_use)"
    assert spec.num_chunks == (2 << 20) // 4096  # 2 x 1408 bytes per chunk row, rounded up to a 4 KiB page
    # vLLM merged the top-level backpressure into the tier, as its own spec does.
    assert spec.secondary_tier_configs[0]["backpressure"] == {"backpressure_cls": "EMABackpressureDetector"}
    metrics = TritonTieringOffloadingSpec.build_metric_definitions(dict(config.extra_config))
    assert "vllm:kv_offload_tiering_chunk_hits" in metrics


def test_registered_by_name_next_to_the_packed_spec():
    plugin.register()
    plugin.register()
    assert OffloadingSpecFactory.get_spec_cls({"spec_name": plugin.TIERING_SPEC_NAME}) is TritonTieringOffloadingSpec
    by_path = {"spec_name": plugin.TIERING_SPEC_NAME, "spec_module_path": "triton_offload.connector"}
    assert OffloadingSpecFactory.get_spec_cls(by_path) is TritonTieringOffloadingSpec


# -- the fs tier's root_dir: checked, created private ----------------------------------------------------------------

ROOT_DIR = r"kv_connector_extra_config\['secondary_tiers'\]\[0\]\['root_dir'\]"


def fs_config(root_dir, **tier) -> object:
    extra = {"cpu_bytes_to_use": 4 * 4096, "secondary_tiers": [{"type": "fs", "root_dir": root_dir, **tier}]}
    return make_config(extra, num_groups=2, worker_bytes=sum(PAGES), f=1)


@pytest.mark.parametrize(
    "where, message",
    [
        ("file", "is not a directory"),
        ("file/kv", r"passes through '.*/file', which is not a directory"),
        ("/proc/triton-offload-kv", r"cannot be created: mkdir '/proc/triton-offload-kv' failed"),
        ("", "must be a directory path"),
        (7, "must be a directory path"),
    ],
    ids=["a-file", "through-a-file", "under-proc", "empty", "not-a-path"],
)
def test_a_root_dir_that_cannot_be_a_directory_is_refused_naming_the_key(tmp_path, where, message):
    """Instead of vLLM's bare FileNotFoundError / NotADirectoryError from inside its tier, at startup."""
    (tmp_path / "file").write_text("")
    root_dir = str(tmp_path / where) if where in ("file", "file/kv") else where
    config = fs_config(root_dir)
    with pytest.raises(ValueError, match=ROOT_DIR + " = .*" + message):
        OffloadingSpecFactory.create_spec(config)
    assert not os.path.exists(region_file(config.engine_id))


def test_a_missing_root_dir_is_created_private_before_the_tier_writes(tmp_path):
    """Under a world-readable parent and the usual umask 022, the missing root_dir and the directory created on the
    way to it are 0700, so the files vLLM's tier writes inside (its run config, 0644 in a 0755 directory) are out of
    other users' reach."""
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(0o755)
    root = parent / "kv" / "cache"
    old_umask = os.umask(0o022)
    try:
        config = fs_config(str(root), n_read_threads=1, n_write_threads=1)
        spec = OffloadingSpecFactory.create_spec(config)
        assert [stat.S_IMODE(p.stat().st_mode) for p in (parent / "kv", root)] == [0o700, 0o700]
        worker = spec.get_worker(kv_caches())
        try:
            spec.get_manager().shutdown()
        finally:
            worker.shutdown()
    finally:
        os.umask(old_umask)
    written = [p for p in root.rglob("*") if p.is_file()]
    assert written, "vLLM's fs tier wrote nothing: the check below would pass vacuously"
    assert not exposed_below(parent), exposed_below(parent)
    assert exposed_below(root), "vLLM's own modes inside root_dir are open: only root_dir's 0700 protects them"


@pytest.mark.parametrize("mode, warned", [(0o755, True), (0o770, True), (0o700, False)])
def test_an_existing_root_dir_open_to_others_is_warned_of(tmp_path, caplog, mode, warned):
    """An existing root_dir is left as the operator made it (instances may share it on purpose); one that its group or
    others may enter is named at startup, with its mode and the risk."""
    tmp_path.chmod(mode)
    config = fs_config(str(tmp_path), n_read_threads=1, n_write_threads=1)
    spec = OffloadingSpecFactory.create_spec(config)
    worker = spec.get_worker(kv_caches())
    fs_root = "triton_offload.connector.fs_root"
    with caplog.at_level(logging.WARNING, logger=fs_root):
        try:
            spec.get_manager().shutdown()
        finally:
            worker.shutdown()
    warnings = [r.getMessage() for r in caplog.records if r.name == fs_root and r.levelno == logging.WARNING]
    assert stat.S_IMODE(tmp_path.stat().st_mode) == mode, "an existing root_dir is not changed"
    if warned:
        (text,) = warnings
        assert re.search(ROOT_DIR + rf" = '{re.escape(str(tmp_path))}' has mode {mode:04o}", text), text
        assert "read the prompts" in text and "change other users' outputs" in text
    else:
        assert not warnings


# -- the network tiers: p2p and obj ----------------------------------------------------------------------------------

P2P = {"type": "p2p", "host": "127.0.0.1", "port": 5701, "backends": ["UCX"], "num_threads": 1}
STORE = {"bucket": "kvcache", "endpoint_override": "127.0.0.1:9000", "access_key": "k", "secret_key": "s"}
OBJ = {"type": "ObjectStoreTier", "module_path": "triton_offload.connector.obj_tier", "store_config": STORE}
EMA = {"backpressure_cls": "EMABackpressureDetector"}
BAD_NETWORK = {
    "p2p-typo": (
        {"secondary_tiers": [{**P2P, "prot": 5702}]},
        r"unknown key\(s\) 'prot' \(did you mean 'port'\?\) \(vLLM's p2p tier would",
    ),
    "p2p-port": ({"secondary_tiers": [{**P2P, "port": 70000}]}, T0 + r"\['port'\] = 70000 must be a TCP port"),
    "p2p-port-str": ({"secondary_tiers": [{**P2P, "port": "5701"}]}, r"\['port'\] = '5701' must be a TCP port"),
    "p2p-host": ({"secondary_tiers": [{**P2P, "host": ""}]}, T0 + r"\['host'\] = '' must be the address"),
    "p2p-backends": ({"secondary_tiers": [{**P2P, "backends": "UCX"}]}, r"\['backends'\] = 'UCX' must be a list"),
    "p2p-threads": ({"secondary_tiers": [{**P2P, "num_threads": 0}]}, r"\['num_threads'\] = 0 must be a positive"),
    "p2p-reap": ({"secondary_tiers": [{**P2P, "unbound_store_timeout_s": -1}]}, r"= -1 must be a positive number"),
    "p2p-backpressure": ({"secondary_tiers": [{**P2P, "backpressure": EMA}]}, r"p2p tier takes no backpressure"),
    "p2p-top-backpressure": ({"backpressure": EMA, "secondary_tiers": [P2P]}, r"top-level 'backpressure' applies"),
    "obj-no-store": ({"secondary_tiers": [{**OBJ, "store_config": "kvcache"}]}, "must be a dict with 'bucket'"),
    "obj-missing-store": (
        {"secondary_tiers": [{"type": OBJ["type"], "module_path": OBJ["module_path"]}]},
        T0 + r" \(type 'ObjectStoreTier'\) needs 'store_config'",
    ),
    "obj-store-typo": (
        {"secondary_tiers": [{**OBJ, "store_config": {**STORE, "endpoint": "x"}}]},
        r"\['store_config'\] has unknown key\(s\) 'endpoint' \(did you mean 'endpoint_override'\?\); "
        r"it accepts \['bucket', ",
    ),
    "obj-no-endpoint": (
        {"secondary_tiers": [{**OBJ, "store_config": {"bucket": "kvcache"}}]},
        r"\['store_config'\]\['endpoint_override'\] = None must be a non-empty string",
    ),
    "obj-scheme": (
        {"secondary_tiers": [{**OBJ, "store_config": {**STORE, "scheme": "s3"}}]},
        r"\['scheme'\] = 's3' must be one of \['http', 'https'\]",
    ),
    "obj-endpoint-port": (
        {"secondary_tiers": [{**OBJ, "store_config": {**STORE, "endpoint_override": "h:99999"}}]},
        r"\['endpoint_override'\] = 'h:99999' is not host\[:port\]",
    ),
    "obj-io-threads": ({"secondary_tiers": [{**OBJ, "io_threads": 0}]}, r"\['io_threads'\] = 0 must be a positive int"),
    "obj-typo": ({"secondary_tiers": [{**OBJ, "bucket": "kvcache"}]}, r"unknown key\(s\) 'bucket'"),
}


@pytest.fixture
def nixl_installed(monkeypatch):
    """The checks below do not need NIXL itself: the tests run where it is not installed too."""
    from triton_offload.connector import network_tiers

    monkeypatch.setattr(network_tiers, "_nixl_installed", lambda: True)


@pytest.mark.parametrize("extra,message", list((BAD | BAD_NETWORK).values()), ids=list(BAD | BAD_NETWORK))
def test_bad_config_is_refused_at_startup_naming_the_key(nixl_installed, extra, message):
    # nixl_installed is read only by p2p and obj tiers: BAD's cases are refused as they would be without it.
    _assert_refused(extra, message)


@pytest.mark.parametrize("tier", [P2P, OBJ], ids=["p2p", "obj"])
def test_network_tiers_need_nixl(monkeypatch, tier):
    from triton_offload.connector import network_tiers

    monkeypatch.setattr(network_tiers, "_nixl_installed", lambda: False)
    message = (
        rf"\(type '{tier['type']}'\) needs NIXL, which is not installed: "
        r"pip install --no-deps nixl==1\.5\.1 nixl-cu12==1\.5\.1"
    )
    _assert_refused({"secondary_tiers": [tier]}, message)


def test_good_network_tiers_are_parsed_with_the_object_store_to_check(nixl_installed):
    from triton_offload.connector.network_tiers import ObjectStore

    https = {
        **OBJ,
        "store_config": {**STORE, "endpoint_override": "s3.example", "scheme": "https", "secret_key": "pw9"},
    }
    extra = {"cpu_bytes_to_use": "1MiB", "secondary_tiers": [P2P, {"type": "p2p"}, OBJ, https]}
    spec = OffloadingSpecFactory.create_spec(make_config(extra, worker_bytes=sum(PAGES), f=1))
    where = "kv_connector_extra_config['secondary_tiers'][{}]".format
    assert spec.tiering_config.secondary_tiers == ("p2p", "p2p", "ObjectStoreTier", "ObjectStoreTier")
    assert spec.tiering_config.object_stores == (
        ObjectStore(where(2), "http://127.0.0.1:9000", "127.0.0.1", 9000),
        ObjectStore(where(3), "https://s3.example", "s3.example", 443),
    )
    assert dict(spec.tiering_config.object_stores[1].store_config) == https["store_config"], "for the credentials check"
    assert "pw9" not in repr(spec.tiering_config), "store_config (credentials) is never printed"


def test_vllm_obj_tier_is_refused_before_0_33_naming_ours(nixl_installed):
    """vLLM 0.32's obj tier dies at its first finished transfer (NIXL_ERR_NO_TELEMETRY); 0.33's works as it is."""
    import vllm

    extra = {"cpu_bytes_to_use": "1MiB", "secondary_tiers": [{"type": "obj", "store_config": STORE}]}
    config = make_config(extra, worker_bytes=sum(PAGES), f=1)
    if vllm.__version__.startswith("0.32"):
        with pytest.raises(ValueError, match=r"capture_telemetry.*'type': 'ObjectStoreTier', 'module_path': 'triton"):
            OffloadingSpecFactory.create_spec(config)
    else:
        assert OffloadingSpecFactory.create_spec(config).tiering_config.secondary_tiers == ("obj",)


def test_unreachable_object_store_stops_startup_naming_the_endpoint(nixl_installed):
    """Nothing listens at the endpoint: the scheduler refuses at once, naming it (vLLM's own probe retries for about
    25 s and names no endpoint), before any NIXL agent exists; the region file goes too."""
    port = free_port()  # nobody listens there
    store = {**STORE, "endpoint_override": f"127.0.0.1:{port}"}
    extra = {"cpu_bytes_to_use": 4 * sum(PAGES), "secondary_tiers": [{**OBJ, "store_config": store}]}
    config = make_config(extra, num_groups=2, worker_bytes=sum(PAGES), f=1)
    spec = OffloadingSpecFactory.create_spec(config)
    worker = spec.get_worker(kv_caches())
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match=rf"\[0\]: the object store http://127.0.0.1:{port} is unreachable"):
            spec.get_manager()
        assert time.monotonic() - t0 < 10
        assert not os.path.exists(region_file(config.engine_id))
    finally:
        worker.shutdown()


def test_reachable_object_store_passes_the_startup_check():
    import socket

    from triton_offload.connector.network_tiers import ObjectStore, check_reachable

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        check_reachable((ObjectStore("tier", f"http://127.0.0.1:{port}", "127.0.0.1", port),))
