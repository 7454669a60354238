"""The packed host buffer: :class:`HostCache`, sized from a byte budget (:mod:`.budget`) and page-locked on CUDA
without PyTorch's caching host allocator (which rounds a request up to a power of two: a 65 GiB budget would take
128 GiB). It is an anonymous mapping placed on a NUMA node (:mod:`.numa`), on huge pages where asked
(:mod:`.pages`), touched in parallel (page faults are the cost of a large buffer), then registered with the CUDA
driver in bounded chunks of whole host blocks (:mod:`.registration`), or pinned at allocation where registration is
refused. docs/host-memory.md says what each setting does.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import time
import weakref

import numpy as np
import torch

from triton_offload._checks import positive_int
from triton_offload.checksums import Checksums
from triton_offload.host import numa, pages, registration
from triton_offload.host.budget import host_blocks_for_budget
from triton_offload.host.numa import NodeChoice, choose_node
from triton_offload.host.pages import HugePageShortage, huge_pages_setting, pinning_setting
from triton_offload.host.placement import read_placement, size_text
from triton_offload.host.registration import RegistrationError, unregister_host_ranges
from triton_offload.integrity import OFF, integrity_setting

__all__ = ["HostCache"]

logger = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
_EHWPOISON = getattr(errno, "EHWPOISON", 133)  # Linux's; what MADV_POPULATE_WRITE returns for a missing huge page


def _address(region: mmap.mmap) -> int:
    """The address of a mapping; the temporary export is released at once, so the mapping can still be closed."""
    return ctypes.addressof(ctypes.c_char.from_buffer(region))


def _touch_pages(address: int):
    """Writes one byte per page of ``[address + start, address + end)`` (kernels without ``MADV_POPULATE_WRITE``):
    through a view of the raw address, so that no export of the mapping outlives the call."""

    def touch(start: int, end: int) -> None:
        view = (ctypes.c_uint8 * (end - start)).from_address(address + start)
        torch.frombuffer(view, dtype=torch.uint8)[::_PAGE].zero_()  # torch ops release the GIL

    return touch


class HostCache:
    """A packed host buffer of ``num_blocks`` rows of ``host_block_bytes``, pinned when ``pin`` (default: CUDA).

    Args:
        host_block_bytes: bytes of one host block (``KVCacheSpec.host_block_bytes(f)``).
        cpu_bytes_to_use: the budget for the whole instance; each of ``world_size`` ranks takes its share.
        world_size: ranks sharing the budget (tensor parallelism).
        num_blocks: instead of a budget, the exact number of host blocks.
        pin: page-lock and register with CUDA; None pins exactly when CUDA is available.
        populate_threads: threads touching pages up front (None: the CPU count, at most 16).
        register_threads: chunks registered with CUDA at once
        (:func:`~triton_offload.host.registration.register_host_range`); None: the CPU count,
            at most :data:`~triton_offload.host.registration.REGISTER_THREADS` (8 threads pinned 32-64 GiB 2.5-2.9x
            faster than one on an H100, 2026-11-22: bench/results/nvidia-h100-80gb-hbm3-2026-11-22-host-cache.json).
        numa_node: ``"auto"`` (the node of ``device``'s GPU; not bound without one), a node number, ``"off"``, or a
            :class:`~triton_offload.host.numa.NodeChoice` already made. Bound memory is checked against the node's free
            memory, mapped with ``mbind``, and touched and registered from threads on the node's CPUs.
        huge_pages: ``"thp"``, ``"2MiB"``, ``"1GiB"`` or ``"off"`` (:mod:`triton_offload.host.pages`); too few
            reserved pages fall back to ``"thp"`` with a warning that says how many are free and needed.
        pinning: ``"auto"`` (register; where the driver refuses, allocate pinned memory, with a warning),
            ``"register"`` or ``"alloc"``.
        device: the device the cache serves (for ``"auto"``, and the CUDA device the pinning threads use); None: the
            current CUDA device for a pinned cache.
        sysfs: the root the NUMA topology and huge-page pools are read from.
        host_alloc: what pins memory at allocation (``alloc(nbytes) -> address``, ``free(address)``); None:
            :class:`~triton_offload.host.pages.CudaHostAlloc`.
        integrity: ``"off"`` (the default), ``"verify"`` or ``"require"``: with the checks, :attr:`checksums` is
            their :class:`~triton_offload.checksums.Checksums`, its table kept beside the blocks (zeroed, pinned where
            the cache is; docs/integrity.md); None without.
        checksum_blocks: the GPU blocks per host block (f) the checksums are for.
        checksum_regions: the host regions of a row (``KVCacheSpec.num_regions``: each holds a key of its own).

    Attributes besides the arguments': ``numa`` (the NodeChoice), ``huge_pages`` (the setting in effect; None for
    memory the driver allocated), ``pinned_by`` (``"cudaHostRegister"``, ``"cudaHostAlloc"`` or None),
    ``placement`` (pages per node, read back), ``warnings`` (each also logged), and the seconds spent:
    ``map_seconds``, ``touch_seconds``, ``register_seconds``, ``alloc_seconds`` (map + touch).
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
        numa_node: str | int | NodeChoice = "auto",
        huge_pages: str = "thp",
        pinning: str = "auto",
        device: torch.device | str | None = None,
        sysfs: str = numa.SYSFS,
        host_alloc=None,
        integrity: str = "off",
        checksum_blocks: int = 1,
        checksum_regions: int = 1,
    ):
        if (cpu_bytes_to_use is None) == (num_blocks is None):
            raise ValueError("give exactly one of cpu_bytes_to_use (a budget) and num_blocks (an exact count)")
        if register_threads is None:
            register_threads = min(registration.REGISTER_THREADS, os.cpu_count() or 1)
        positive_int(register_threads, "register_threads")  # before the allocation, not after it
        huge_pages, pinning = huge_pages_setting(huge_pages), pinning_setting(pinning)
        integrity = integrity_setting(integrity)  # before the allocation, not after it
        pages.check_settings(huge_pages, pinning)
        if num_blocks is not None:
            # An exact count: a worker whose scheduler already divided the budget must match it block for block.
            positive_int(num_blocks, "num_blocks")
            cpu_bytes_to_use, world_size = num_blocks * host_block_bytes, 1
        self.num_blocks = host_blocks_for_budget(cpu_bytes_to_use, host_block_bytes, world_size)
        self.host_block_bytes = host_block_bytes
        self.nbytes = self.num_blocks * host_block_bytes
        self.pinned = torch.cuda.is_available() if pin is None else pin
        device = None if device is None else torch.device(device)
        if device is None and self.pinned and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())  # a pinned cache serves the current GPU
        self.numa = numa_node if isinstance(numa_node, NodeChoice) else choose_node(numa_node, device, sysfs=sysfs)
        numa.check_node_memory(self.numa, self.nbytes, "the host cache", sysfs=sysfs)
        self.huge_pages, self.pinned_by, self.populated_by, self.warnings = huge_pages, None, None, []
        # Shared with the finalizer, which must not reference self: the ranges are unregistered when the cache is
        # closed *or* dropped. A registration that outlives its munmap makes the driver treat whatever is mapped
        # there next as pinned (copies then touch stale pages) and fails the next cudaHostRegister at that address.
        self._registered: list[tuple[int, int]] = []
        self._finalizer = weakref.finalize(self, unregister_host_ranges, self._registered)
        self._mmap: mmap.mmap | None = None
        self.map_seconds = self.touch_seconds = self.register_seconds = 0.0
        cuda_device = device.index if device is not None and device.type == "cuda" else None
        # A normal tensor even when the caller is in torch.inference_mode() (vLLM builds workers there): an inference
        # tensor could not be written outside the mode later.
        with torch.inference_mode(False):
            if self.pinned and pinning == "alloc":
                flat = self._allocate_pinned(host_alloc, cuda_device, pinning, refused=None)
            else:
                self._map(huge_pages, populate_threads, sysfs)
                flat = self._register(register_threads, cuda_device, pinning, host_alloc) if self.pinned else None
                if flat is None:
                    flat = torch.frombuffer(self._mmap, dtype=torch.uint8)
            self.buffer = flat[: self.nbytes].view(self.num_blocks, host_block_bytes)
            self.checksums = None
            if integrity != OFF:
                self.checksums = Checksums.allocate(integrity, self.num_blocks, checksum_blocks, pin=self.pinned,
                                                    regions=checksum_regions)  # fmt: skip
        self.alloc_seconds = self.map_seconds + self.touch_seconds
        # The whole mapping (reserved huge pages round it up): it is ours alone.
        self.placement = read_placement(self.buffer.data_ptr(), len(self._mmap) if self._mmap else self.nbytes)
        logger.info(
            "host cache: %d blocks x %d bytes = %.2f GiB at %#x; allocated and touched in %.3f s, %s; %s; memory: %s",
            self.num_blocks,
            host_block_bytes,
            self.nbytes / 2**30,
            self.buffer.data_ptr(),
            self.alloc_seconds,
            self._pinned_text(),
            self.numa.why,
            self.placement.describe(),
        )

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        logger.warning("%s", message)

    def _unmap(self) -> None:
        region, self._mmap = self._mmap, None
        if region is not None:
            region.close()

    def _new_mapping(self, page_bytes: int | None) -> mmap.mmap:
        try:
            return pages.map_anonymous(self.nbytes, page_bytes)
        except OSError as e:
            raise OSError(
                e.errno,
                f"cannot allocate a host cache of {self.nbytes} bytes ({self.nbytes / 2**30:.2f} GiB: "
                f"{self.num_blocks} blocks x {self.host_block_bytes} bytes): {e.strerror}",
            ) from e

    def _map(self, setting: str, populate_threads: int | None, sysfs: str) -> None:
        """Maps the buffer with the pages ``setting`` asks for, binds it to the node (before the first touch), and
        populates it from threads on the node's CPUs. Reserved huge pages that are too few, or that the kernel then
        fails to provide, fall back to transparent huge pages with a warning; the mapping is closed on every other
        failure."""
        threads = populate_threads or min(16, os.cpu_count() or 1)
        while True:
            page = pages.huge_page_bytes(setting)
            t0 = time.perf_counter()
            try:
                pages.check_huge_pages(setting, self.nbytes, self.numa.node, sysfs=sysfs)
                self._mmap = self._new_mapping(page)
                address = _address(self._mmap)
                if self.numa.bound:
                    self._bind(address, len(self._mmap))
                refused = pages.advise(self._mmap, setting) if page is None else None
                if refused is not None and setting == "thp":
                    # Kernels built without THP reject the advice: the cache works with 4 KiB pages, only slower to
                    # set up.
                    logger.info("transparent huge pages unavailable (%s): the host cache uses base pages", refused)
                t1 = time.perf_counter()
                self.populated_by = pages.populate(
                    address,
                    self.nbytes,
                    threads=threads,
                    align=page or _PAGE,
                    initializer=lambda: numa.enter_node(self.numa),
                    touch=_touch_pages(address),
                )
            except HugePageShortage as e:
                self._unmap()
                self._warn(str(e))
                setting = "thp"
                continue
            except OSError as e:
                self._unmap()
                if page is None or e.errno not in (errno.ENOMEM, errno.EFAULT, _EHWPOISON):
                    raise
                self._warn(
                    f"huge_pages = {setting!r}: the kernel did not provide the reserved pages for {self.nbytes} bytes "
                    f"({os.strerror(e.errno)}): falling back to transparent huge pages (huge_pages = 'thp')"
                )
                setting = "thp"
                continue
            except BaseException:
                self._unmap()
                raise
            self.map_seconds, self.touch_seconds = t1 - t0, time.perf_counter() - t1
            self.huge_pages = setting
            return

    def _bind(self, address: int, length: int) -> None:
        try:
            numa.bind_memory(address, length, self.numa.node)
        except OSError as e:
            raise RuntimeError(
                f"numa_node = {self.numa.setting!r}: the kernel refused to bind the host cache to node "
                f"{self.numa.node} ({e}); the node may be outside this process's cpuset: use another node or 'off'"
            ) from e

    def _register(self, threads: int, cuda_device: int | None, pinning: str, host_alloc) -> torch.Tensor | None:
        """Registers the mapping; where the driver refuses and ``pinning`` is ``"auto"``, closes it and returns
        memory pinned at allocation instead (None: registered)."""
        # Whole host blocks per chunk: one copy-engine copy (cudaMemcpy) must lie inside one registration (the
        # driver rejects one that spans two with cudaErrorInvalidValue; seen on an H100, driver 580.159), so no block
        # may straddle a chunk boundary. The kernels address across chunks freely.
        chunk = max(1, registration.REGISTER_CHUNK_BYTES // self.host_block_bytes) * self.host_block_bytes
        t0 = time.perf_counter()
        try:
            self._registered.extend(
                registration.register_host_range(
                    _address(self._mmap),
                    self.nbytes,
                    chunk_bytes=chunk,
                    threads=threads,
                    what="host cache",
                    cpus=self.numa.cpus,
                    device=cuda_device,
                )
            )
        except RegistrationError as e:
            self._unmap()  # before anything else is allocated: never two copies of the cache at once
            if pinning == "register":
                raise RegistrationError(
                    f"{e}. pinning = 'register' allows no other way to pin it; pinning = 'auto' falls back to memory "
                    "pinned at allocation (cudaHostAlloc)",
                    e.code,
                ) from e
            return self._allocate_pinned(host_alloc, cuda_device, pinning, refused=e)
        except BaseException:
            self._unmap()
            raise
        self.register_seconds = time.perf_counter() - t0
        self.pinned_by = "cudaHostRegister"
        return None

    def _allocate_pinned(
        self, host_alloc, cuda_device: int | None, pinning: str, refused: RegistrationError | None
    ) -> torch.Tensor:
        """The buffer as memory pinned at allocation (``cudaHostAlloc``), from a thread bound to the node. It is
        freed when the last tensor over it goes (as a mapping is unmapped)."""
        t0 = time.perf_counter()
        try:
            alloc = host_alloc if host_alloc is not None else pages.CudaHostAlloc()

            def allocate() -> int:
                if cuda_device is not None and torch.cuda.current_device() != cuda_device:
                    torch.cuda.set_device(cuda_device)
                return alloc.alloc(self.nbytes)

            ptr = numa.run_on_node(self.numa, allocate, bind_thread=True, name="pinned-alloc")
        except (RuntimeError, OSError) as e:
            raise RuntimeError(
                f"cannot pin a host cache of {self.nbytes} bytes with pinning = {pinning!r}: "
                + (f"{refused}; then " if refused is not None else "")
                + f"cudaHostAlloc failed ({e}). Nothing is left allocated, and there is no other way to pin it: "
                "offloading cannot run here (remove the offloading connector, or allow cudaHostRegister)"
            ) from e
        array = np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(ptr))
        weakref.finalize(array, registration.free_pinned, alloc.free, ptr)  # when the last tensor over it goes
        flat = torch.from_numpy(array)
        del array
        try:
            registration.check_mapped_at_host_address([(ptr, self.nbytes)])
        except RuntimeError:
            del flat  # frees it
            raise
        self.register_seconds = time.perf_counter() - t0
        self.pinned_by, self.huge_pages = "cudaHostAlloc", None
        if refused is not None:
            name = getattr(alloc, "error_name", lambda code: "")(refused.code)
            self._warn(
                f"cudaHostRegister refused the host cache (CUDA error {refused.code}{f' {name}' if name else ''}; "
                "Confidential Computing mode and some containers do): pinned at allocation instead (cudaHostAlloc, "
                "pinning = 'auto'); it costs: pages chosen by the driver (huge_pages does not apply), no sharing "
                "with other processes, and allocation time in place of registration"
            )
        return flat

    def _pinned_text(self) -> str:
        if self.pinned_by == "cudaHostRegister":
            return f"pinned (cudaHostRegister) in {len(self._registered)} chunk(s) in {self.register_seconds:.3f} s"
        if self.pinned_by == "cudaHostAlloc":
            return f"pinned at allocation (cudaHostAlloc) in {self.register_seconds:.3f} s"
        return "not pinned"

    def describe(self) -> str:
        """Where the memory is, for logs and the worker's description: size, pinning, pages and pages per node."""
        pages = {None: "pages chosen by the driver", "thp": "transparent huge pages advised", "off": "base pages"}
        return (
            f"{size_text(self.nbytes)}, {self._pinned_text()}, "
            f"{pages.get(self.huge_pages, f'{self.huge_pages} reserved huge pages')}; {self.numa.why}; "
            f"memory: {self.placement.describe()}"
        )

    def close(self) -> None:
        """Unregisters the pages from CUDA and drops this object's references to the buffer (the memory goes back
        when the last tensor over it goes). Idempotent; also done when the cache is garbage-collected."""
        self._finalizer()
        self.buffer = self._mmap = self.checksums = None

    def __repr__(self) -> str:
        return (
            f"HostCache(num_blocks={self.num_blocks}, host_block_bytes={self.host_block_bytes}, pinned={self.pinned}, "
            f"numa_node={self.numa.node}, huge_pages={self.huge_pages!r}, pinned_by={self.pinned_by!r})"
        )
