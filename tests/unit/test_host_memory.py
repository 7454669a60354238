"""Where a host cache's memory goes and what pins it (docs/host-memory.md): NUMA placement read back from the
kernel, a simulated two-node topology, reserved huge pages and their shortage, and the fallback when CUDA refuses
registration (the driver faked on CPU, as in tests/unit/test_host_cache.py)."""

from __future__ import annotations

import ctypes
import errno
import gc
import logging
import mmap
import os
import re
import threading

import pytest
import torch

from triton_offload.host import cache as host_cache
from triton_offload.host import numa, placement, registration
from triton_offload.host import pages as host_pages
from triton_offload.host.cache import HostCache
from triton_offload.host.numa import NodeChoice, choose_node
from triton_offload.host.registration import RegistrationError

LINUX_NUMA = os.path.exists("/proc/self/numa_maps") and numa.mempolicy_supported()
needs_numa = pytest.mark.skipif(not LINUX_NUMA, reason="needs Linux with NUMA support (/proc/self/numa_maps)")
MIB = 1 << 20


def numa_maps_line(address: int) -> str:
    """This process's numa_maps line for the mapping that starts at ``address``, read here, not by the code under
    test."""
    with open("/proc/self/numa_maps") as f:
        lines = [line for line in f if line.startswith(f"{address:x} ")]
    assert len(lines) == 1, f"no numa_maps line at {address:#x}"
    return lines[0]


def node_pages(line: str) -> dict[int, int]:
    return {int(k[1:]): int(v) for k, v in (f.split("=") for f in line.split()[2:] if "=" in f) if k[1:].isdigit()}


def node0() -> NodeChoice:
    """This machine's node 0, chosen as the plugin would choose it."""
    return choose_node(0)


# -- settings --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value,want", [("auto", "auto"), (" OFF ", "off"), (0, 0), ("3", 3), (12, 12)])
def test_numa_setting_accepts(value, want):
    assert numa.numa_setting(value) == want


@pytest.mark.parametrize("value", ["near", "", -1, "-1", True, 1.0, None, [0]])
def test_numa_setting_refuses_naming_the_forms(value):
    with pytest.raises(
        ValueError, match=rf"numa_node = {re.escape(repr(value))} is not a NUMA setting; expected 'auto'"
    ):
        numa.numa_setting(value)


@pytest.mark.parametrize("kwargs,match", [
    ({"numa_node": "near"}, "numa_node = 'near' is not a NUMA setting"),
    ({"huge_pages": "4MiB"}, "huge_pages = '4MiB' is not a huge-page setting"),
    ({"pinning": "maybe"}, "pinning = 'maybe' is not a pinning setting"),
    ({"pinning": "alloc", "huge_pages": "off"}, "huge_pages = 'off' cannot apply with pinning = 'alloc'"),
    ({"numa_node": 63}, "numa_node = 63: node 63 does not exist on this machine; nodes with memory: 0"),
])  # fmt: skip
def test_a_bad_setting_is_refused_before_anything_is_allocated(monkeypatch, kwargs, match):
    calls = []
    monkeypatch.setattr(host_pages, "map_anonymous", lambda *a: calls.append(a))
    if "numa_node" in kwargs and isinstance(kwargs["numa_node"], int) and numa.online_nodes() is None:
        pytest.skip("this kernel shows no NUMA nodes")
    with pytest.raises(ValueError, match=match):
        HostCache(4096, num_blocks=4, pin=False, **kwargs)
    assert calls == [], "nothing may be allocated for a refused setting"


def test_cpulist_and_bus_id_forms():
    assert numa.parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert numa.parse_cpulist("\n") == ()
    assert numa.cpus_text((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11"
    assert numa._normalized_bus_id("00000000:1B:00.0") == "0000:1b:00.0"  # the driver's form -> sysfs's


# -- a simulated two-node machine ------------------------------------------------------------------------------------

GPUS = {0: "0000:1b:00.0", 1: "0000:9a:00.0", 2: "0000:00:06.0"}  # CUDA index -> PCI address


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def two_nodes(tmp_path, monkeypatch):
    """A sysfs root: node 0 with CPUs 0-1, node 1 with CPUs 2-3 (both with memory); GPU 0 on node 1, GPU 1 on node
    0, GPU 2 with no affinity (-1, as in most VMs). This process may run on CPUs 0-3."""
    nodes = tmp_path / "devices" / "system" / "node"
    write(nodes / "online", "0-1\n")
    write(nodes / "has_memory", "0-1\n")
    for n, cpus in ((0, "0-1"), (1, "2-3")):
        write(nodes / f"node{n}" / "cpulist", cpus + "\n")
        write(nodes / f"node{n}" / "meminfo", f"Node {n} MemFree:  1048576 kB\nNode {n} Inactive(file):  1024 kB\n")
    for bdf, node in zip(GPUS.values(), ("1", "0", "-1")):
        write(tmp_path / "bus" / "pci" / "devices" / bdf / "numa_node", node + "\n")
    monkeypatch.setattr(numa, "_allowed_cpus", lambda: {0, 1, 2, 3})
    return str(tmp_path)


def pick(setting, device, sysfs) -> NodeChoice:
    return choose_node(setting, torch.device(device) if device else None, sysfs=sysfs, bus_id=GPUS.__getitem__)


def test_auto_picks_the_gpus_node_and_its_cpus(two_nodes):
    """Each tensor-parallel rank (its own GPU) gets its own GPU's node and that node's CPUs."""
    rank0, rank1 = pick("auto", "cuda:0", two_nodes), pick("auto", "cuda:1", two_nodes)
    assert (rank0.node, rank0.cpus) == (1, (2, 3))
    assert (rank1.node, rank1.cpus) == (0, (0, 1))
    assert rank0.why == "numa_node = 'auto': GPU 0 (PCI 0000:1b:00.0) is on node 1"


def test_a_number_picks_that_node_and_off_nothing(two_nodes):
    assert (pick(1, "cuda:1", two_nodes).node, pick(1, None, two_nodes).cpus) == (1, (2, 3))
    off = pick("off", "cuda:0", two_nodes)
    assert not off.bound and off.cpus == () and "numa_node = 'off'" in off.why


@pytest.mark.parametrize("device,why", [
    ("cuda:2", "GPU 2 (PCI 0000:00:06.0) reports no NUMA node (numa_node -1): not bound"),
    ("cpu", "numa_node = 'auto' without a GPU (cpu): not bound"),
    (None, "numa_node = 'auto' without a GPU (no device): not bound"),
])  # fmt: skip
def test_auto_binds_nothing_where_there_is_no_gpu_node(two_nodes, device, why):
    choice = pick("auto", device, two_nodes)
    assert not choice.bound and choice.cpus == () and choice.why.endswith(why)


def test_auto_with_an_unknown_pci_address_binds_nothing(two_nodes):
    def no_address(index):
        raise RuntimeError("cuDeviceGetPCIBusId returned 101")

    choice = choose_node("auto", torch.device("cuda:0"), sysfs=two_nodes, bus_id=no_address)
    assert not choice.bound and "PCI address is unknown (cuDeviceGetPCIBusId returned 101)" in choice.why


def test_a_node_that_does_not_exist_or_has_no_memory_is_refused(two_nodes, tmp_path):
    with pytest.raises(
        ValueError, match=r"numa_node = 2: node 2 does not exist on this machine; nodes with memory: 0, 1"
    ):
        pick(2, "cuda:0", two_nodes)
    write(tmp_path / "devices" / "system" / "node" / "has_memory", "0\n")  # node 1: CPUs only
    with pytest.raises(ValueError, match=r"numa_node = 1: node 1 has no memory on this machine; nodes with memory: 0"):
        pick(1, "cuda:0", two_nodes)
    assert (
        "GPU 0 (PCI 0000:1b:00.0) is on node 1, which has no memory: not bound" in pick("auto", "cuda:0", two_nodes).why
    )


def test_no_numa_topology(tmp_path):
    """A kernel without NUMA shows no node directory: 'auto' binds nothing, a number is refused."""
    assert not choose_node("auto", torch.device("cuda:0"), sysfs=str(tmp_path), bus_id=GPUS.__getitem__).bound
    with pytest.raises(ValueError, match=r"numa_node = 0: this machine shows no NUMA nodes"):
        choose_node(0, sysfs=str(tmp_path))


def test_node_cpus_this_process_may_not_use_are_left_out(two_nodes, monkeypatch):
    monkeypatch.setattr(numa, "_allowed_cpus", lambda: {0, 1})  # a cpuset without node 1's CPUs
    choice = pick("auto", "cuda:0", two_nodes)
    assert choice.node == 1 and choice.cpus == ()
    assert "no CPU of node 1 is allowed to this process" in choice.why


def test_a_node_without_enough_free_memory_is_refused_before_allocation(two_nodes, monkeypatch):
    """Bound memory does not spill to another node: a cache larger than the node's free memory (1 GiB + 1 MiB of
    reclaimable page cache here) stops at startup naming the setting, with nothing mapped."""
    calls = []
    monkeypatch.setattr(host_pages, "map_anonymous", lambda *a: calls.append(a))
    choice = pick(1, None, two_nodes)
    with pytest.raises(
        ValueError,
        match=r"numa_node = 1 binds the host cache \(2147483648 bytes, 2.00 GiB\) to node 1, which has 1074790400 "
        r"bytes \(1.00 GiB\) free or reclaimable",
    ):
        HostCache(1 << 30, num_blocks=2, pin=False, numa_node=choice, sysfs=two_nodes)
    assert calls == []


# -- placement on this machine, read back --------------------------------------------------------------------------


@needs_numa
@pytest.mark.parametrize("huge_pages", ["thp", "off"])
def test_cache_bound_to_node_0_is_there_by_numa_maps(make_host_cache, huge_pages):
    """numa_node = 0: the mapping's policy is bind:0 and every page is on node 0, as this test reads numa_maps
    itself; the cache's own read-back and description agree."""
    cache = make_host_cache(MIB, num_blocks=6, pin=False, numa_node=0, huge_pages=huge_pages, populate_threads=2)
    line = numa_maps_line(cache.buffer.data_ptr())
    assert line.split()[1] == "bind:0"
    kib = int(line.split("kernelpagesize_kB=")[1].split()[0])
    assert node_pages(line) == {0: 6 * MIB // (kib * 1024)}, line
    assert cache.placement.node_bytes == {0: 6 * MIB} and cache.placement.policies == ("bind:0",)
    assert "numa_node = 0; memory: node 0: 6.0 MiB (100.0%); policy bind:0" in cache.describe()
    if huge_pages == "off":
        assert cache.placement.thp_bytes == 0, "MADV_NOHUGEPAGE: base pages only"


@needs_numa
def test_unbound_cache_has_the_default_policy(make_host_cache):
    cache = make_host_cache(MIB, num_blocks=2, pin=False, numa_node="off")
    assert numa_maps_line(cache.buffer.data_ptr()).split()[1] == "default"
    assert cache.placement.policies == ("default",) and cache.placement.resident == 2 * MIB


@needs_numa
def test_populate_and_registration_threads_run_on_the_nodes_cpus(two_nodes, monkeypatch, make_host_cache):
    """The simulated node 0 has only CPU 1 here: every thread that faults pages in and every registration call runs
    there, and never on the caller's thread (a failed registration leaves its CUDA error pending on its thread)."""
    write_cpus = os.path.join(two_nodes, "devices", "system", "node", "node0", "cpulist")
    with open(write_cpus, "w") as f:
        f.write("1\n")
    monkeypatch.setattr(numa, "_allowed_cpus", lambda: os.sched_getaffinity(0))  # the real one from here on
    if 1 not in os.sched_getaffinity(0):
        pytest.skip("CPU 1 is not available to this process")
    choice = choose_node(0, sysfs=two_nodes)
    assert choice.cpus == (1,)
    seen = []
    real = host_pages._madvise()

    def recording_madvise(address, length, advice):
        seen.append(("populate", threading.get_ident(), frozenset(os.sched_getaffinity(0))))
        return real(address, length, advice)

    monkeypatch.setattr(host_pages, "_madvise", lambda: recording_madvise)
    fake = FakeCudart()
    fake_driver(monkeypatch, fake)
    before = os.sched_getaffinity(0)
    cache = make_host_cache(MIB, num_blocks=8, pin=True, numa_node=choice, populate_threads=4, register_threads=1)
    assert os.sched_getaffinity(0) == before, "the caller's own affinity must not change"
    assert len(seen) == 4 and {cpus for _, _, cpus in seen} == {frozenset({1})}
    assert fake.affinities == {frozenset({1})} and threading.get_ident() not in fake.threads
    assert cache.placement.node_bytes == {0: 8 * MIB}


@needs_numa
def test_the_kernel_refuses_a_node_it_does_not_have():
    """The system calls are real: binding to a node this machine lacks fails with the kernel's EINVAL."""
    missing = max(numa.online_nodes() or (0,)) + 1
    region = mmap.mmap(-1, MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        with pytest.raises(OSError, match=rf"mbind\(MPOL_BIND, node {missing}\).*Invalid argument"):
            numa.bind_memory(host_cache._address(region), MIB, missing)
        with pytest.raises(OSError, match=rf"set_mempolicy\(MPOL_BIND, node {missing}\).*Invalid argument"):
            numa.run_on_node(NodeChoice(missing, missing), lambda: None, bind_thread=True)
    finally:
        region.close()


@needs_numa
def test_run_on_node_returns_and_raises_from_its_thread():
    choice = node0()
    assert numa.run_on_node(choice, lambda: threading.get_ident(), bind_thread=True) != threading.get_ident()
    with pytest.raises(KeyError, match="inside"):
        numa.run_on_node(choice, lambda: {}["inside"], bind_thread=True)


def test_read_placement_from_a_proc_directory(tmp_path):
    """numa_maps counts pages of the mapping's page size; a mapping that holds more than the range asked about is
    counted in proportion (and flagged); smaps gives the transparent huge pages."""
    write(
        tmp_path / "maps", "7f0000000000-7f0000400000 rw-p 00000000 00:00 0\n7f0000400000-7f0000c00000 rw-p 0 0:0 0\n"
    )
    write(
        tmp_path / "numa_maps",
        "7f0000000000 bind:1 file=/anon_hugepage\\040(deleted) huge anon=2 dirty=2 N1=2 kernelpagesize_kB=2048\n"
        "7f0000400000 default anon=2048 dirty=2048 N0=1024 N1=1024 kernelpagesize_kB=4\n",
    )
    write(tmp_path / "smaps", "7f0000400000-7f0000c00000 rw-p 0 0:0 0\nAnonHugePages:      4096 kB\nVmFlags: rd\n")
    whole = placement.read_placement(0x7F0000000000, 12 * MIB, proc=str(tmp_path))
    assert whole.node_bytes == {0: 4 * MIB, 1: 8 * MIB} and whole.page_kib == (4, 2048) and not whole.shared_vma
    assert whole.thp_bytes == 4 * MIB and whole.policies == ("bind:1", "default")
    part = placement.read_placement(0x7F0000400000, 4 * MIB, proc=str(tmp_path))  # half of the second mapping
    assert part.node_bytes == {0: 2 * MIB, 1: 2 * MIB} and part.shared_vma
    assert "estimated" in part.describe()
    gone = placement.read_placement(0x7F0000000000, MIB, proc=str(tmp_path / "missing"))
    assert gone.error and gone.describe().startswith("placement unknown (")


# -- huge pages --------------------------------------------------------------------------------------------------------


def fake_pool(root, size_kb: int, total: int, free: int, resv: int = 0, node: int | None = None) -> None:
    base = root / "kernel" / "mm" if node is None else root / "devices" / "system" / "node" / f"node{node}"
    pool = base / "hugepages" / f"hugepages-{size_kb}kB"
    for name, value in (("nr_hugepages", total), ("free_hugepages", free), ("resv_hugepages", resv)):
        write(pool / name, f"{value}\n")


class CountingMaps:
    """Wraps host_pages.map_anonymous: every mapping made, to check none is left open and none made twice."""

    def __init__(self, monkeypatch):
        self.made: list[tuple[mmap.mmap, int | None]] = []
        real = host_pages.map_anonymous

        def counted(nbytes, page_bytes=None):
            region = real(nbytes, page_bytes)
            self.made.append((region, page_bytes))
            return region

        monkeypatch.setattr(host_pages, "map_anonymous", counted)

    @property
    def pages(self) -> list[int | None]:
        return [p for _, p in self.made]


def test_too_few_huge_pages_fall_back_to_thp_saying_how_many(tmp_path, monkeypatch, make_host_cache, caplog):
    """3 free 2 MiB pages, 1 of them promised to another mapping, for a 12 MiB cache: one warning line with the
    counts, the pool to raise, and what the cache uses instead; the cache is mapped once, with base pages advised to
    be transparent huge pages."""
    fake_pool(tmp_path, 2048, total=4, free=3, resv=1)
    maps = CountingMaps(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="triton_offload.host.cache"):
        cache = make_host_cache(MIB, num_blocks=12, pin=False, numa_node="off", huge_pages="2MiB", sysfs=str(tmp_path))
    pool = tmp_path / "kernel" / "mm" / "hugepages" / "hugepages-2048kB"
    want = (
        f"huge_pages = '2MiB': 2 free 2MiB page(s) (4 reserved), 6 needed for 12582912 bytes: falling back to "
        f"transparent huge pages (huge_pages = 'thp'); reserve more: echo 8 > {pool}/nr_hugepages"
    )
    assert cache.warnings == [want] and [r.getMessage() for r in caplog.records] == [want]
    assert maps.pages == [None] and cache.huge_pages == "thp"
    cache.buffer[11, -1] = 5
    assert int(cache.buffer[11, -1]) == 5


@needs_numa
def test_too_few_huge_pages_on_the_bound_node(tmp_path, make_host_cache):
    """Bound to a node, the node's own pool counts (a fault there finds no page elsewhere), not the machine's."""
    fake_pool(tmp_path, 1 << 20, total=8, free=8)  # machine-wide: plenty
    fake_pool(tmp_path, 1 << 20, total=1, free=0, node=0)
    cache = make_host_cache(MIB, num_blocks=2, pin=False, numa_node=node0(), huge_pages="1GiB", sysfs=str(tmp_path))
    assert cache.warnings[0].startswith(
        "huge_pages = '1GiB': 0 free 1GiB page(s) on node 0 (1 reserved), 1 needed for 2097152 bytes: falling back"
    )
    assert cache.placement.policies == ("bind:0",)


def test_a_page_size_the_kernel_does_not_offer(tmp_path, make_host_cache):
    cache = make_host_cache(MIB, num_blocks=2, pin=False, numa_node="off", huge_pages="1GiB", sysfs=str(tmp_path))
    assert cache.warnings[0].startswith("huge_pages = '1GiB': this kernel offers no 1GiB pages (")
    assert cache.warnings[0].endswith("1 needed for 2097152 bytes: falling back to transparent huge pages "
                                      "(huge_pages = 'thp')")  # fmt: skip


def test_pages_the_kernel_then_fails_to_provide_fall_back_once(monkeypatch, make_host_cache):
    """The counts said yes but the kernel says no (another process took the pages meanwhile): here a real
    MAP_HUGETLB mapping of more 2 MiB pages than this machine has free fails with ENOMEM; the cache falls back with
    a warning, and the failed attempt leaves nothing mapped."""
    free = host_pages.free_huge_pages(2 * MIB)
    if free is None:
        pytest.skip("this kernel offers no 2 MiB huge pages")
    monkeypatch.setattr(host_pages, "check_huge_pages", lambda *a, **k: None)
    maps = CountingMaps(monkeypatch)
    nbytes = (free[0] + 1) * 2 * MIB
    cache = make_host_cache(nbytes, num_blocks=1, pin=False, numa_node="off", huge_pages="2MiB")
    assert cache.warnings == [
        f"huge_pages = '2MiB': the kernel did not provide the reserved pages for {nbytes} bytes (Cannot allocate "
        "memory): falling back to transparent huge pages (huge_pages = 'thp')"
    ]
    assert maps.pages == [None], "the failed MAP_HUGETLB mmap made no mapping"


@needs_numa
def test_reserved_huge_pages_are_used_and_read_back(make_host_cache):
    """Needs 4 free 2 MiB pages (as root: echo 4 > /proc/sys/vm/nr_hugepages). A 5 MiB cache takes 3 of them,
    bound to node 0; numa_maps shows a hugetlb mapping of 2048 KiB pages on node 0; closing returns them."""
    counts = host_pages.free_huge_pages(2 * MIB, 0)
    if counts is None or counts[0] < 4 or (host_pages.free_huge_pages(2 * MIB) or (0,))[0] < 4:
        pytest.skip(f"needs 4 free reserved 2 MiB pages on node 0 (free, reserved: {counts})")
    cache = make_host_cache(5 * MIB, num_blocks=1, pin=False, numa_node=0, huge_pages="2MiB")
    assert cache.warnings == [] and cache.huge_pages == "2MiB"
    line = numa_maps_line(cache.buffer.data_ptr())
    assert " huge " in line and "kernelpagesize_kB=2048" in line and node_pages(line) == {0: 3}, line
    assert cache.placement.page_kib == (2048,) and cache.placement.node_bytes == {0: 6 * MIB}
    assert host_pages.free_huge_pages(2 * MIB, 0)[0] == counts[0] - 3
    cache.buffer.fill_(7)
    assert int(cache.buffer.sum()) == 7 * 5 * MIB
    cache.close()
    gc.collect()
    assert host_pages.free_huge_pages(2 * MIB, 0)[0] == counts[0]


# -- pinning: registration refused -------------------------------------------------------------------------------------


class FakeCudart:
    """cudaHostRegister / Unregister; refuses every registration with ``refuse`` (a CUDA error) when set. Records the
    threads and CPU sets the calls ran on."""

    def __init__(self, refuse: int | None = None):
        self.refuse, self.registered, self.calls = refuse, {}, 0
        self.lock, self.threads, self.affinities = threading.Lock(), set(), set()

    def cudaHostRegister(self, ptr, size, flags):
        with self.lock:
            self.calls += 1
            self.threads.add(threading.get_ident())
            self.affinities.add(frozenset(os.sched_getaffinity(0)))
            if self.refuse is not None:
                return self.refuse
            self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        del self.registered[ptr]
        return 0


def fake_driver(monkeypatch, fake: FakeCudart) -> None:
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(registration, "check_mapped_at_host_address", lambda ranges: None)


class FakeHostAlloc:
    """Stands in for cudaHostAlloc: ordinary anonymous memory, touched as the driver's allocation is; ``fail`` makes
    it refuse. Checks, when asked to allocate, that no mapping of the cache is still open (never two copies)."""

    def __init__(self, maps: CountingMaps | None = None, fail: str | None = None):
        self.maps, self.fail, self.live, self.allocs = maps, fail, {}, 0
        self.thread_cpus = None

    def alloc(self, nbytes: int) -> int:
        self.allocs += 1
        self.thread_cpus = frozenset(os.sched_getaffinity(0))
        if self.maps is not None:
            assert all(region.closed for region, _ in self.maps.made), "the refused mapping is still open"
        if self.fail:
            raise RuntimeError(self.fail)
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        ptr = host_cache._address(region)
        ctypes.memset(ptr, 0, nbytes)
        self.live[ptr] = region
        return ptr

    def free(self, ptr: int) -> None:
        self.live.pop(ptr).close()

    def error_name(self, code: int) -> str:
        return {801: "cudaErrorNotSupported"}.get(code, "")


def test_refused_registration_falls_back_to_memory_pinned_at_allocation(monkeypatch, caplog):
    """cudaHostRegister refused (801, as in Confidential Computing mode): the mapping is released first, the cache is
    allocated pinned once, one warning line names the cause and the cost; it works, and close() frees it."""
    fake = FakeCudart(refuse=801)
    fake_driver(monkeypatch, fake)
    maps = CountingMaps(monkeypatch)
    alloc = FakeHostAlloc(maps)
    with caplog.at_level(logging.WARNING, logger="triton_offload.host.cache"):
        cache = HostCache(4096, num_blocks=300, pin=True, register_threads=3, host_alloc=alloc)
    assert cache.pinned_by == "cudaHostAlloc" and cache.huge_pages is None
    assert len(maps.made) == 1 and maps.made[0][0].closed and alloc.allocs == 1, "allocated once after the refusal"
    assert fake.registered == {}, "nothing may stay registered"
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning == cache.warnings[0] and "\n" not in warning
    assert warning.startswith(
        "cudaHostRegister refused the host cache (CUDA error 801 cudaErrorNotSupported; Confidential Computing mode "
        "and some containers do): pinned at allocation instead (cudaHostAlloc, pinning = 'auto'); it costs: "
    )
    (ptr,) = alloc.live
    assert cache.buffer.data_ptr() == ptr and cache.buffer.shape == (300, 4096)
    cache.buffer[299].fill_(9)
    assert int(cache.buffer[299, -1]) == 9
    assert "pinned at allocation (cudaHostAlloc)" in cache.describe()
    cache.close()
    gc.collect()
    assert alloc.live == {}, "cudaFreeHost once the last view is gone"


def test_memory_pinned_at_allocation_is_freed_only_after_every_device_synchronised(monkeypatch):
    """As unregistering does: a transfer still queued against the cache (an engine never shut down) must finish
    before cudaFreeHost hands the pages back."""
    fake_driver(monkeypatch, FakeCudart(refuse=801))
    log = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append(("synchronize", device)))
    alloc = FakeHostAlloc()
    free = alloc.free
    alloc.free = lambda ptr: (log.append(("free", ptr)), free(ptr))
    cache = HostCache(4096, num_blocks=8, pin=True, pinning="alloc", host_alloc=alloc)
    (ptr,) = alloc.live
    cache.close()
    gc.collect()
    assert log == [("synchronize", 0), ("synchronize", 1), ("free", ptr)]


@needs_numa
def test_memory_pinned_at_allocation_is_allocated_on_the_node(monkeypatch, make_host_cache):
    fake_driver(monkeypatch, FakeCudart(refuse=801))
    alloc = FakeHostAlloc()
    choice = node0()
    cache = make_host_cache(4096, num_blocks=64, pin=True, numa_node=choice, host_alloc=alloc)
    assert alloc.thread_cpus == frozenset(choice.cpus or os.sched_getaffinity(0))
    assert set(cache.placement.node_bytes) == {0}


def test_refusal_with_pinning_register_stops_naming_the_setting(monkeypatch):
    fake_driver(monkeypatch, FakeCudart(refuse=801))
    maps = CountingMaps(monkeypatch)
    alloc = FakeHostAlloc(maps)
    with pytest.raises(RegistrationError, match=r"CUDA error 801 .*pinning = 'register' allows no other way to pin"):
        HostCache(4096, num_blocks=8, pin=True, pinning="register", host_alloc=alloc)
    assert alloc.allocs == 0 and maps.made[0][0].closed


def test_pinning_alloc_never_maps_or_registers(monkeypatch, make_host_cache):
    fake = FakeCudart()
    fake_driver(monkeypatch, fake)
    maps = CountingMaps(monkeypatch)
    alloc = FakeHostAlloc(maps)
    cache = make_host_cache(4096, num_blocks=8, pin=True, pinning="alloc", host_alloc=alloc)
    assert (cache.pinned_by, maps.made, fake.calls, alloc.allocs, cache.warnings) == ("cudaHostAlloc", [], 0, 1, [])


@pytest.mark.parametrize("pinning", ["auto", "alloc"])
def test_where_neither_pins_startup_stops_naming_the_setting(monkeypatch, pinning):
    fake = FakeCudart(refuse=801)
    fake_driver(monkeypatch, fake)
    maps = CountingMaps(monkeypatch)
    alloc = FakeHostAlloc(maps, fail="cudaHostAlloc of 32768 bytes failed with CUDA error 801 (cudaErrorNotSupported)")
    with pytest.raises(RuntimeError) as info:
        HostCache(4096, num_blocks=8, pin=True, pinning=pinning, host_alloc=alloc)
    refused = (
        "cudaHostRegister failed with CUDA error 801 for 32768 bytes at offset 0 of a 32768-byte host cache (after 0 "
        "bytes registered, now released); lower cpu_bytes_to_use or raise the locked-memory limit (ulimit -l); then "
    )
    assert str(info.value) == (
        f"cannot pin a host cache of 32768 bytes with pinning = {pinning!r}: {refused if pinning == 'auto' else ''}"
        "cudaHostAlloc failed (cudaHostAlloc of 32768 bytes failed with CUDA error 801 (cudaErrorNotSupported)). "
        "Nothing is left allocated, and there is no other way to pin it: offloading cannot run here (remove the "
        "offloading connector, or allow cudaHostRegister)"
    )
    assert all(region.closed for region, _ in maps.made) and fake.registered == {} and alloc.live == {}


def test_a_failed_first_touch_releases_the_mapping(monkeypatch):
    """Any failure after mapping (here: the kernel refuses to populate) closes the mapping before raising."""
    maps = CountingMaps(monkeypatch)
    monkeypatch.setattr(host_pages, "_madvise", lambda: lambda a, n, advice: (ctypes.set_errno(errno.EIO), -1)[1])
    with pytest.raises(OSError, match="populating .* failed"):
        HostCache(4096, num_blocks=8, pin=False, numa_node="off")
    assert len(maps.made) == 1 and maps.made[0][0].closed


def test_touch_fallback_before_linux_5_14(monkeypatch, make_host_cache):
    """A kernel without MADV_POPULATE_WRITE answers EINVAL: the threads write one byte per page instead."""
    monkeypatch.setattr(host_pages, "_madvise", lambda: lambda a, n, advice: (ctypes.set_errno(errno.EINVAL), -1)[1])
    cache = make_host_cache(4096, num_blocks=8, pin=False, numa_node="off", populate_threads=3)
    assert cache.populated_by == "touch"


def mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        return any(int(lo, 16) <= address < int(hi, 16) for lo, hi in (line.split()[0].split("-") for line in f))


def test_close_unmaps_once_the_last_view_goes():
    """close() drops the cache's own hold on the mapping: the memory goes back (munmap) when the last tensor over it
    goes, not when the HostCache object is finally collected."""
    cache = HostCache(MIB, num_blocks=4, pin=False, numa_node="off")
    address, row = cache.buffer.data_ptr(), cache.buffer[1]
    cache.close()
    assert mapped(address), "a view still uses it"
    del row
    gc.collect()
    assert not mapped(address) and cache.buffer is None


# -- on a GPU ----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_pci_address_and_node():
    """The GPU's PCI address, in sysfs's form, names a device sysfs has; 'auto' says what it found."""
    bdf = numa.gpu_pci_bus_id(torch.cuda.current_device())
    assert re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", bdf), bdf
    assert os.path.exists(f"/sys/bus/pci/devices/{bdf}/numa_node")
    choice = choose_node("auto", torch.device("cuda"))
    assert bdf in choice.why and (choice.bound == (numa.pci_numa_node(bdf) is not None))


class RefusingCudart:
    """The real runtime, except that cudaHostRegister is refused as in Confidential Computing mode."""

    def __init__(self, real):
        self.real = real

    def cudaHostRegister(self, ptr, size, flags):
        return 801

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.gpu
@pytest.mark.parametrize("pinning", ["register-refused", "alloc"])
def test_memory_pinned_at_allocation_moves_bytes_on_cuda(monkeypatch, make_host_cache, pinning):
    """The real cudaHostAlloc path: registration refused (auto falls back) or skipped (alloc); the cache is pinned,
    copies through the copy engine both ways are exact, and it is freed at close."""
    if pinning == "register-refused":
        real = torch.cuda.cudart()
        monkeypatch.setattr(torch.cuda, "cudart", lambda: RefusingCudart(real))
    cache = make_host_cache(MIB, num_blocks=64, pinning="auto" if pinning == "register-refused" else "alloc")
    assert cache.pinned_by == "cudaHostAlloc" and cache.buffer.is_pinned()
    assert bool(cache.warnings) == (pinning == "register-refused")
    dev = torch.randint(0, 255, (64, MIB), dtype=torch.uint8, device="cuda")
    cache.buffer.copy_(dev, non_blocking=True)
    back = torch.empty_like(dev)
    back.copy_(cache.buffer, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(cache.buffer, dev.cpu()) and torch.equal(back, dev)


@pytest.mark.gpu
def test_registered_cache_on_cuda_says_where_it_is(make_host_cache):
    cache = make_host_cache(MIB, num_blocks=64)
    assert cache.pinned_by == "cudaHostRegister" and cache.placement.resident == 64 * MIB
    assert "pinned (cudaHostRegister)" in cache.describe() and cache.numa.why.startswith("numa_node = 'auto': GPU ")
