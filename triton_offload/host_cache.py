"""The packed host buffer: sized from a byte budget and page-locked on CUDA without PyTorch's caching host allocator
(which rounds a request up to a power of two: a 65 GiB budget would take 128 GiB). It is an anonymous mapping,
touched in parallel (page faults are the cost of a large buffer), then registered with the CUDA driver in bounded
chunks of whole host blocks, so no single call holds the driver for long and a failure releases exactly what was
registered.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from triton_offload._checks import positive_int

__all__ = [
    "HostCache",
    "available_host_bytes",
    "check_host_memory",
    "host_blocks_for_budget",
    "register_host_range",
    "unregister_host_ranges",
]

logger = logging.getLogger(__name__)

REGISTER_CHUNK_BYTES = 1 << 30
# Threads a HostCache registers its chunks from by default (at most the CPU count).
REGISTER_THREADS = 8
# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every context, and mapped so the kernels can read
# and write it through the same (unified) address.
_CUDA_HOST_REGISTER_FLAGS = 0x01 | 0x02
_PAGE = mmap.PAGESIZE


def host_blocks_for_budget(cpu_bytes_to_use: int, host_block_bytes: int, world_size: int = 1) -> int:
    """Host blocks one rank gets: its share of the instance-wide budget divided by the bytes of a host block.

    Raises:
        ValueError: a non-positive size, or a share too small for one block (both sizes named).
    """
    for name, value in (
        ("cpu_bytes_to_use", cpu_bytes_to_use),
        ("host_block_bytes", host_block_bytes),
        ("world_size", world_size),
    ):
        positive_int(value, name)
    share = cpu_bytes_to_use // world_size
    if share < host_block_bytes:
        raise ValueError(
            f"cpu_bytes_to_use = {cpu_bytes_to_use} bytes gives each of {world_size} rank(s) {share} bytes, "
            f"less than one host block of {host_block_bytes} bytes"
        )
    return share // host_block_bytes


def available_host_bytes() -> int | None:
    """Host memory that can be allocated now without swapping: ``MemAvailable`` of ``/proc/meminfo`` (Linux), in
    bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB (KiB)
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(nbytes: int, setting: str) -> None:
    """Refuses, before anything is allocated, host memory this machine does not have available.

    A buffer larger than RAM otherwise fails in ``mmap`` with a bare ``ENOMEM``; one below RAM but above what is
    available is mapped and then ends in the OOM killer while its pages are touched.

    Args:
        nbytes: the bytes about to be allocated in this process.
        setting: the configured value that asks for them, for the message (e.g. ``"cpu_bytes_to_use = 40GiB ..."``).

    Raises:
        ValueError: ``nbytes`` exceeds :func:`available_host_bytes`; the message names ``setting``, the bytes asked
            and the bytes available. Where the available memory cannot be read, nothing is checked.
    """
    available = available_host_bytes()
    if available is None:
        logger.debug("MemAvailable not readable: not checking %d bytes of host memory for %s", nbytes, setting)
        return
    if nbytes > available:
        raise ValueError(
            f"{setting} asks for {nbytes} bytes ({nbytes / 2**30:.2f} GiB) of host memory on this machine, but only "
            f"{available} bytes ({available / 2**30:.2f} GiB) are available (MemAvailable in /proc/meminfo): lower "
            "it, or free host memory"
        )


def _advise_huge_pages(region: mmap.mmap) -> None:
    """Asks for transparent huge pages: 512x fewer faults to populate and fewer pages for the driver to lock. Kernels
    built without THP reject the advice (EINVAL); the cache then works with 4 KiB pages, only slower to set up."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not hasattr(region, "madvise"):
        return
    try:
        region.madvise(advice)
    except OSError as e:
        logger.info("transparent huge pages unavailable (%s): the host cache uses base pages", e)


def unregister_host_ranges(registered: list[tuple[int, int]]) -> None:
    """Unregisters every ``(address, bytes)`` range in ``registered`` from CUDA, emptying the list. Holds no reference
    to the owner of the memory, so it can run as its finalizer.

    Every device is synchronised first: a transfer still queued against the memory (an engine that was never shut
    down) would otherwise read or write pages that are no longer locked.
    """
    if not registered:
        return
    for device in range(torch.cuda.device_count()):
        torch.cuda.synchronize(device)
    cudart = torch.cuda.cudart()
    while registered:
        ptr, _ = registered.pop()
        cudart.cudaHostUnregister(ptr)


def register_host_range(
    ptr: int, nbytes: int, *, chunk_bytes: int | None = None, threads: int = 1, what: str = "host buffer"
) -> list[tuple[int, int]]:
    """Page-locks ``[ptr, ptr + nbytes)`` with CUDA (portable, mapped) in chunks of at most ``chunk_bytes`` (default
    :data:`REGISTER_CHUNK_BYTES`), so that no single call holds the driver for long, and checks that the memory is
    mapped at its host address. Returns the registered ``(address, bytes)`` ranges, in address order, for
    :func:`unregister_host_ranges`.

    Args:
        threads: chunks registered at once (the calls release the GIL); 1 registers them one after another.

    Raises:
        RuntimeError: a registration or the address check failed; everything registered is released first, and the
            message names the (first failed) chunk, ``what`` was being registered and what to change.
    """
    chunk_bytes = chunk_bytes or REGISTER_CHUNK_BYTES
    positive_int(threads, "threads")
    cudart = torch.cuda.cudart()
    chunks = [(start, min(chunk_bytes, nbytes - start)) for start in range(0, nbytes, chunk_bytes)]

    def register(chunk: tuple[int, int]) -> int:
        start, size = chunk
        err = cudart.cudaHostRegister(ptr + start, size, _CUDA_HOST_REGISTER_FLAGS)
        return int(getattr(err, "value", err))

    done: list[tuple[int, int]] = []
    failed: tuple[int, int, int] | None = None  # (offset, bytes, CUDA error) of the first chunk that failed
    if threads == 1:
        for start, size in chunks:
            code = register((start, size))
            if code != 0:
                failed = (start, size, code)
                break
            done.append((ptr + start, size))
    else:
        # Every chunk is tried; on a failure the ones that succeeded are released below.
        with ThreadPoolExecutor(max_workers=min(threads, len(chunks))) as pool:
            codes = list(pool.map(register, chunks))
        for (start, size), code in zip(chunks, codes):
            if code == 0:
                done.append((ptr + start, size))
            elif failed is None:
                failed = (start, size, code)
    if failed is not None:
        start, size, code = failed
        registered = sum(s for _, s in done)
        unregister_host_ranges(done)
        raise RuntimeError(
            f"cudaHostRegister failed with CUDA error {code} for {size} bytes at offset {start} of a "
            f"{nbytes}-byte {what} (after {registered} bytes registered, now released); lower "
            f"cpu_bytes_to_use or raise the locked-memory limit (ulimit -l)"
        )
    try:
        check_mapped_at_host_address(done)
    except RuntimeError:
        unregister_host_ranges(done)
        raise
    return done


def check_mapped_at_host_address(ranges: list[tuple[int, int]]) -> None:
    """The kernels address a whole buffer from its base pointer, across separately registered chunks: that needs
    registered memory mapped at its host address (cudaDevAttrCanUseHostPointerForRegisteredMem, true on Linux x86-64
    GPUs). Verified through cuda-python where it is installed.

    Raises:
        RuntimeError: the query failed (naming the CUDA error) or a chunk maps elsewhere.
    """
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        try:
            from cuda import cudart as rt
        except ImportError:
            logger.info("cuda-python not installed: not verifying that registered memory is mapped at its address")
            return
    for ptr, _ in ranges:
        err, dev_ptr = rt.cudaHostGetDevicePointer(ptr, 0)
        if int(err) != 0:
            # cuda-python returns (err, None) on failure: report the driver's error, not a formatting one.
            raise RuntimeError(
                f"cudaHostGetDevicePointer failed for registered host memory at {ptr:#x}: "
                f"{getattr(err, 'name', err)} ({int(err)}); the registration was released"
            )
        if int(dev_ptr) != ptr:
            raise RuntimeError(
                f"registered host memory at {ptr:#x} maps to device address {int(dev_ptr):#x}: this platform "
                "does not map registered memory at its host address, which the kernels need"
            )


class HostCache:
    """A packed host buffer of ``num_blocks`` rows of ``host_block_bytes``, pinned when ``pin`` (default: CUDA).

    Args:
        host_block_bytes: bytes of one host block (``KVCacheSpec.host_block_bytes(f)``).
        cpu_bytes_to_use: the budget for the whole instance; each of ``world_size`` ranks takes its share.
        world_size: ranks sharing the budget (tensor parallelism).
        num_blocks: instead of a budget, the exact number of host blocks.
        pin: page-lock and register with CUDA; None pins exactly when CUDA is available.
        populate_threads: threads touching pages up front (None: the CPU count, at most 16).
        register_threads: chunks registered with CUDA at once (:func:`register_host_range`); None: the CPU count,
            at most :data:`REGISTER_THREADS` (8 threads pinned 32-64 GiB 2.5-2.9x faster than one on an H100,
            2026-11-22: bench/results/nvidia-h100-80gb-hbm3-2026-11-22-host-cache.json).
    """

    def __init__(
        self,
        host_block_bytes: int,
        cpu_bytes_to_use: int | None = None,
        *,
        world_size: int = 1,
        num_blocks: int | None = None,
        pin: bool | None = None,
        populate_threads: int | None = None,
        register_threads: int | None = None,
    ):
        if (cpu_bytes_to_use is None) == (num_blocks is None):
            raise ValueError("give exactly one of cpu_bytes_to_use (a budget) and num_blocks (an exact count)")
        if register_threads is None:
            register_threads = min(REGISTER_THREADS, os.cpu_count() or 1)
        positive_int(register_threads, "register_threads")  # before the allocation, not after it
        if num_blocks is not None:
            # An exact count: a worker whose scheduler already divided the budget must match it block for block.
            positive_int(num_blocks, "num_blocks")
            cpu_bytes_to_use, world_size = num_blocks * host_block_bytes, 1
        self.num_blocks = host_blocks_for_budget(cpu_bytes_to_use, host_block_bytes, world_size)
        self.host_block_bytes = host_block_bytes
        self.nbytes = self.num_blocks * host_block_bytes
        self.pinned = torch.cuda.is_available() if pin is None else pin
        # Shared with the finalizer, which must not reference self: the ranges are unregistered when the cache is
        # closed *or* dropped. A registration that outlives its munmap makes the driver treat whatever is mapped
        # there next as pinned (copies then touch stale pages) and fails the next cudaHostRegister at that address.
        self._registered: list[tuple[int, int]] = []
        self._finalizer = weakref.finalize(self, unregister_host_ranges, self._registered)
        t0 = time.perf_counter()
        try:
            self._mmap = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as e:
            raise OSError(
                e.errno,
                f"cannot allocate a host cache of {self.nbytes} bytes ({self.nbytes / 2**30:.2f} GiB: "
                f"{self.num_blocks} blocks x {host_block_bytes} bytes): {e.strerror}",
            ) from e
        _advise_huge_pages(self._mmap)
        # A normal tensor even when the caller is in torch.inference_mode() (vLLM builds workers there): an inference
        # tensor could not be written by the populate threads, which do not inherit the mode, nor later outside it.
        with torch.inference_mode(False):
            flat = torch.frombuffer(self._mmap, dtype=torch.uint8)
            self._populate(flat, populate_threads)
            t1 = time.perf_counter()
            if self.pinned:
                # Whole host blocks per chunk: one copy-engine copy (cudaMemcpy) must lie inside one registration
                # (the driver rejects one that spans two with cudaErrorInvalidValue; seen on an H100, driver
                # 580.159), so no block may straddle a chunk boundary. The kernels address across chunks freely.
                chunk = max(1, REGISTER_CHUNK_BYTES // host_block_bytes) * host_block_bytes
                self._registered.extend(
                    register_host_range(
                        flat.data_ptr(), self.nbytes, chunk_bytes=chunk, threads=register_threads, what="host cache"
                    )
                )
            t2 = time.perf_counter()
            self.buffer = flat.view(self.num_blocks, host_block_bytes)
        logger.info(
            "host cache: %d blocks x %d bytes = %.2f GiB; allocated and touched in %.3f s, %s",
            self.num_blocks,
            host_block_bytes,
            self.nbytes / 2**30,
            t1 - t0,
            f"pinned in {len(self._registered)} chunk(s) in {t2 - t1:.3f} s" if self.pinned else "not pinned",
        )
        self.alloc_seconds, self.register_seconds = t1 - t0, t2 - t1

    @staticmethod
    def _populate(flat: torch.Tensor, threads: int | None) -> None:
        """Touches one byte per page, in parallel: faulting pages in lazily would stall the first transfers."""
        threads = threads or min(16, os.cpu_count() or 1)
        step = max(_PAGE, -(-flat.numel() // threads) // _PAGE * _PAGE)
        spans = [(s, min(s + step, flat.numel())) for s in range(0, flat.numel(), step)]
        with ThreadPoolExecutor(max_workers=len(spans)) as pool:  # torch ops release the GIL
            list(pool.map(lambda s: flat[s[0] : s[1] : _PAGE].zero_(), spans))

    def close(self) -> None:
        """Unregisters the pages from CUDA and drops this object's references to the buffer. Idempotent; also done
        when the cache is garbage-collected."""
        self._finalizer()
        self.buffer = None

    def __repr__(self) -> str:
        return (
            f"HostCache(num_blocks={self.num_blocks}, host_block_bytes={self.host_block_bytes}, pinned={self.pinned})"
        )
