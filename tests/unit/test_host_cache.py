"""Host cache sizing, allocation and chunked CUDA registration (the driver is faked on CPU)."""

from __future__ import annotations

import errno
import gc
import logging
import mmap
import os
import sys
import threading
import time
import types

import pytest
import torch

from triton_offload.host import budget, registration
from triton_offload.host import cache as host_cache
from triton_offload.host.budget import host_blocks_for_budget
from triton_offload.host.cache import HostCache


@pytest.mark.parametrize(
    "budget,block,world,want",
    [
        pytest.param(10_000, 1000, 1, 10, id="one-rank"),
        pytest.param(10_000, 1000, 4, 2, id="tp4-share-2500"),
        pytest.param(10_000, 1000, 3, 3, id="tp3-share-3333"),
        pytest.param(1000, 1000, 1, 1, id="exactly-one"),
        pytest.param(80 * 2**30, 2 * 2**20, 8, 5120, id="80GiB-tp8-2MiB"),
    ],
)
def test_blocks_from_budget(budget, block, world, want):
    assert host_blocks_for_budget(budget, block, world) == want


def test_budget_too_small_names_both_sizes():
    with pytest.raises(
        ValueError,
        match=r"cpu_bytes_to_use = 7000 bytes gives each of 8 rank\(s\) 875 bytes, less "
        r"than one host block of 1000 bytes",
    ):
        host_blocks_for_budget(7000, 1000, 8)
    with pytest.raises(ValueError, match="world_size = 0 must be a positive int"):
        host_blocks_for_budget(7000, 1000, 0)


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="MemAvailable is Linux's")
def test_available_host_bytes_is_meminfo_mem_available():
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert 0 < budget.available_host_bytes() <= total


def test_host_memory_check_names_the_setting_and_both_sizes(monkeypatch):
    monkeypatch.setattr(budget, "available_host_bytes", lambda: 3 << 20)
    budget.check_host_memory(3 << 20, "cpu_bytes_to_use = 3MiB")  # exactly what is available
    with pytest.raises(
        ValueError,
        match=r"^cpu_bytes_to_use = 4MiB asks for 4194304 bytes \(0.00 GiB\) of host memory on this machine, but only "
        r"3145728 bytes \(0.00 GiB\) are available \(MemAvailable",
    ):
        budget.check_host_memory(4 << 20, "cpu_bytes_to_use = 4MiB")
    monkeypatch.setattr(budget, "available_host_bytes", lambda: None)
    budget.check_host_memory(1 << 60, "cpu_bytes_to_use = 1EiB")  # not Linux: nothing to check against


def test_failed_allocation_names_the_size(monkeypatch):
    """mmap's ENOMEM (a size beyond RAM and swap) comes back naming the cache's size and shape, errno kept."""

    def no_memory(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(host_cache.mmap, "mmap", no_memory)
    with pytest.raises(
        OSError, match=r"host cache of 12288 bytes \(0.00 GiB: 3 blocks x 4096 bytes\): Cannot alloc"
    ) as e:
        HostCache(4096, num_blocks=3, pin=False)
    assert e.value.errno == errno.ENOMEM


def test_cpu_cache_is_plain_memory_of_the_right_shape(make_host_cache):
    cache = make_host_cache(4096 + 8, 3 * 4104 + 100, pin=False, populate_threads=2)
    assert cache.buffer.shape == (3, 4104) and cache.buffer.dtype == torch.uint8
    assert not cache.pinned and cache.register_seconds < 1.0
    cache.buffer[2, -1] = 7  # the whole range is writable
    assert int(cache.buffer[2, -1]) == 7
    cache.close()
    assert cache.buffer is None


class FakeCudart:
    """Records cudaHostRegister/Unregister calls; fails the registration numbered ``fail_at`` (1-based), or every one of
    ``fail_size`` bytes."""

    def __init__(self, fail_at=None, fail_size=None):
        self.fail_at, self.fail_size, self.calls, self.registered = fail_at, fail_size, 0, {}
        self.lock, self.threads = threading.Lock(), set()
        self.log = []  # synchronize and unregister calls, in order

    def cudaHostRegister(self, ptr, size, flags):
        with self.lock:
            self.calls += 1
            self.threads.add(threading.get_ident())
            if self.calls == self.fail_at or size == self.fail_size:
                return 2  # cudaErrorMemoryAllocation
            assert flags == 3 and ptr not in self.registered
            self.registered[ptr] = size
        time.sleep(0.01)  # a driver call takes a while: lets the pool's threads overlap
        return 0

    def cudaHostUnregister(self, ptr):
        del self.registered[ptr]
        self.log.append(("unregister", ptr))
        return 0

    def synchronize(self, device=None):
        self.log.append(("synchronize", device))


def _fake_driver(monkeypatch, fake):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    # The real address check needs a GPU (tested under -m gpu); the fake driver maps nothing.
    monkeypatch.setattr(registration, "check_mapped_at_host_address", lambda ranges: None)


def test_registration_in_bounded_chunks(monkeypatch, make_host_cache):
    fake = FakeCudart()
    _fake_driver(monkeypatch, fake)
    monkeypatch.setattr(registration, "REGISTER_CHUNK_BYTES", 64 * 1024)
    cache = make_host_cache(10_000, 310_000, pin=True)  # 31 blocks; chunks of 6 whole blocks, the last of 1
    base = cache.buffer.data_ptr()
    assert sorted(fake.registered.items()) == [(base + i * 60_000, min(60_000, 310_000 - i * 60_000)) for i in range(6)]
    cache.close()
    assert fake.registered == {}


def test_registration_failure_releases_what_was_registered(monkeypatch):
    fake = FakeCudart(fail_at=3)
    _fake_driver(monkeypatch, fake)
    monkeypatch.setattr(registration, "REGISTER_CHUNK_BYTES", 64 * 1024)
    with pytest.raises(
        RuntimeError,
        match=r"cudaHostRegister failed with CUDA error 2 for 60000 bytes at offset "
        r"120000 .* \(after 120000 bytes registered, now released\)",
    ):
        HostCache(10_000, 300_000, pin=True, register_threads=1)  # one thread: the third call is the third chunk
    assert fake.registered == {}


def test_threaded_registration_registers_every_chunk_in_address_order(monkeypatch, make_host_cache):
    fake = FakeCudart()
    _fake_driver(monkeypatch, fake)
    monkeypatch.setattr(registration, "REGISTER_CHUNK_BYTES", 64 * 1024)
    cache = make_host_cache(10_000, 300_000, pin=True, register_threads=4)
    base = cache.buffer.data_ptr()
    want = [(base + i * 60_000, 60_000) for i in range(5)]
    assert cache._registered == want and sorted(fake.registered.items()) == want
    assert len(fake.threads) > 1, "the chunks were registered from one thread"
    cache.close()
    assert fake.registered == {}


def test_close_synchronizes_every_device_before_unregistering(monkeypatch, make_host_cache):
    """Transfers still queued against the cache (an engine never shut down) finish before its pages are unlocked:
    close(), and the finalizer, synchronise every device first."""
    fake = FakeCudart()
    _fake_driver(monkeypatch, fake)
    monkeypatch.setattr(registration, "REGISTER_CHUNK_BYTES", 64 * 1024)
    cache = make_host_cache(10_000, 120_000, pin=True)  # two chunks of 6 blocks
    base = cache.buffer.data_ptr()
    cache.close()
    assert fake.log == [("synchronize", 0), ("synchronize", 1), ("unregister", base + 60_000), ("unregister", base)]


@pytest.mark.parametrize("cpus,most", [(3, 3), (64, 8)])
def test_default_registration_threads_follow_the_cpu_count(monkeypatch, make_host_cache, cpus, most):
    fake = FakeCudart()
    _fake_driver(monkeypatch, fake)
    monkeypatch.setattr(registration, "REGISTER_CHUNK_BYTES", 10_000)  # one block per chunk: 30 chunks
    monkeypatch.setattr(host_cache.os, "cpu_count", lambda: cpus)
    cache = make_host_cache(10_000, 300_000, pin=True)
    assert len(cache._registered) == 30 and 1 < len(fake.threads) <= most


def test_threaded_registration_failure_releases_every_other_chunk(monkeypatch):
    """With threads every chunk is tried; when one fails, the chunks registered around it are all released, and the
    message names the failed chunk (here the last, partial one, whichever thread got to it)."""
    fake = FakeCudart(fail_size=10_000)
    _fake_driver(monkeypatch, fake)
    monkeypatch.setattr(registration, "REGISTER_CHUNK_BYTES", 64 * 1024)
    with pytest.raises(
        RuntimeError,
        match=r"CUDA error 2 for 10000 bytes at offset 300000 .* \(after 300000 bytes registered, now released\)",
    ):
        HostCache(10_000, 310_000, pin=True, register_threads=3)
    assert fake.calls == 6 and fake.registered == {}


@pytest.mark.parametrize("threads", [0, -1, 1.5, True])
def test_register_threads_must_be_a_positive_int(threads):
    with pytest.raises(ValueError, match=f"register_threads = {threads!r} must be a positive int"):
        HostCache(10_000, 300_000, pin=False, register_threads=threads)


def test_dropped_cache_unregisters_without_close(monkeypatch):
    """A cache that is garbage-collected without close() releases its registrations (the finalizer holds no
    reference to the cache, so dropping the last reference is enough); a closed one is not unregistered twice."""
    fake = FakeCudart()
    _fake_driver(monkeypatch, fake)
    monkeypatch.setattr(registration, "REGISTER_CHUNK_BYTES", 64 * 1024)
    cache = HostCache(10_000, 300_000, pin=True)
    assert len(fake.registered) == 5
    del cache
    gc.collect()
    assert fake.registered == {}
    closed = HostCache(10_000, 300_000, pin=True)
    closed.close()
    closed.close()  # idempotent: FakeCudart raises KeyError on a second unregister of the same pointer
    del closed
    gc.collect()
    assert fake.registered == {}


def test_built_under_inference_mode(make_host_cache):
    """vLLM builds workers under torch.inference_mode(): the buffer must still be populated (by threads that do not
    inherit the mode) and stay writable outside it."""
    with torch.inference_mode():
        cache = make_host_cache(4096, num_blocks=4, pin=False, populate_threads=2)
        cache.buffer[1].fill_(3)
    assert not cache.buffer.is_inference()
    cache.buffer[2].fill_(4)
    assert int(cache.buffer[1, 0]) == 3 and int(cache.buffer[2, -1]) == 4


def test_kernel_without_transparent_huge_pages(monkeypatch, make_host_cache, caplog):
    """madvise(MADV_HUGEPAGE) fails with EINVAL on kernels built without THP: the cache is still built, and says so.
    An advice value the kernel does not know fails the same way, so this exercises the real system call."""
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF, raising=False)
    with caplog.at_level(logging.INFO, logger="triton_offload.host.cache"):
        cache = make_host_cache(4096, num_blocks=3, pin=False)
    assert cache.buffer.shape == (3, 4096)
    assert "transparent huge pages unavailable" in caplog.text


def test_device_pointer_query_failure_names_the_cuda_error(monkeypatch):
    """cuda-python returns (err, None) when cudaHostGetDevicePointer fails: the error raised names the CUDA error
    (not a TypeError from formatting None), and every registered chunk is released."""
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(registration, "REGISTER_CHUNK_BYTES", 64 * 1024)

    class Err(int):
        name = "cudaErrorInvalidValue"

    runtime = types.SimpleNamespace(cudaHostGetDevicePointer=lambda ptr, flags: (Err(1), None))
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = runtime
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    with pytest.raises(RuntimeError, match=r"cudaHostGetDevicePointer failed .*cudaErrorInvalidValue \(1\)"):
        HostCache(10_000, 300_000, pin=True)
    assert fake.registered == {}


@pytest.mark.gpu
def test_pinned_cache_on_cuda(monkeypatch, make_host_cache):
    monkeypatch.setattr(registration, "REGISTER_CHUNK_BYTES", 256 * 2**20)
    block = 3 * 2**20  # 682 blocks; chunks of 85 whole blocks (255 MiB), the last of 2
    cache = make_host_cache(block, 2 * 2**30 + 5, populate_threads=8, register_threads=4)
    assert cache.pinned and cache.buffer.is_pinned() and len(cache._registered) == 9
    assert all(size % block == 0 for _, size in cache._registered)
    dev = torch.randint(0, 255, (cache.num_blocks, cache.host_block_bytes), dtype=torch.uint8, device="cuda")
    # A copy-engine copy may not span two registrations, but every block lies inside one: copy block by block, in
    # an order that visits every chunk, and through the copy engine in both directions.
    order = torch.randperm(cache.num_blocks).tolist()
    for i in order:
        cache.buffer[i].copy_(dev[i], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(cache.buffer, dev.cpu())
    back = torch.empty_like(dev)
    for i in order:
        back[i].copy_(cache.buffer[i], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, dev)


def test_exact_block_count_instead_of_a_budget(make_host_cache):
    cache = make_host_cache(1000, num_blocks=7, pin=False)
    assert cache.buffer.shape == (7, 1000)
    with pytest.raises(ValueError, match="exactly one of cpu_bytes_to_use"):
        HostCache(1000, 7000, num_blocks=7, pin=False)
    with pytest.raises(ValueError, match="exactly one of cpu_bytes_to_use"):
        HostCache(1000, pin=False)
    with pytest.raises(ValueError, match="num_blocks = 0 must be a positive int"):
        HostCache(1000, num_blocks=0, pin=False)
