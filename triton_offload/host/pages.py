"""The pages under a host buffer: transparent or reserved huge pages (the ``huge_pages`` setting,
:func:`huge_pages_setting`), populated in parallel (:func:`populate`), and memory pinned at allocation
(:class:`CudaHostAlloc`) where registration is refused (the ``pinning`` setting, :func:`pinning_setting`). Stdlib only
at import (the plugin's configuration parser imports the settings).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from triton_offload.host.numa import SYSFS

__all__ = [
    "HUGE_PAGE_SETTINGS",
    "PINNING_SETTINGS",
    "huge_pages_setting",
    "pinning_setting",
    "check_settings",
    "huge_page_bytes",
    "free_huge_pages",
    "HugePageShortage",
    "check_huge_pages",
    "map_anonymous",
    "populate",
    "CudaHostAlloc",
]

logger = logging.getLogger(__name__)

# Setting -> the reserved page size it asks for (None: none reserved).
HUGE_PAGE_SETTINGS = {"thp": None, "2MiB": 2 << 20, "1GiB": 1 << 30, "off": None}
PINNING_SETTINGS = ("auto", "register", "alloc")
_MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)
_MAP_HUGE_SHIFT = 26
# Linux 5.14: faults the range in for writing, and returns an error where a touch would raise SIGBUS (a reserved
# huge page that is not there).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_PAGE = mmap.PAGESIZE


def huge_pages_setting(value: Any, key: str = "huge_pages") -> str:
    """A ``huge_pages`` setting, checked (case-insensitive): ``"thp"``, ``"2MiB"``, ``"1GiB"`` or ``"off"``.

    ``"thp"`` (default: an anonymous mapping advised ``MADV_HUGEPAGE``), ``"2MiB"`` / ``"1GiB"`` (``MAP_HUGETLB`` with
    the size flag, from the pages reserved in ``/sys/kernel/mm/hugepages``; where too few are free the buffer falls back
    to ``"thp"`` with a one-line warning saying how many are free and needed), ``"off"`` (``MADV_NOHUGEPAGE``: base
    pages only).

    Raises:
        ValueError: anything else, naming ``key`` and the accepted values.
    """
    if isinstance(value, str):
        for name in HUGE_PAGE_SETTINGS:
            if value.strip().lower() == name.lower():
                return name
    raise ValueError(
        f"{key} = {value!r} is not a huge-page setting; expected one of "
        f"{', '.join(repr(n) for n in HUGE_PAGE_SETTINGS)} ('thp': transparent huge pages; '2MiB' / '1GiB': pages "
        "reserved in /sys/kernel/mm/hugepages; 'off': base pages)"
    )


def pinning_setting(value: Any, key: str = "pinning") -> str:
    """A ``pinning`` setting, checked: ``"auto"``, ``"register"`` or ``"alloc"``.

    CUDA only: ``"auto"`` (default: ``cudaHostRegister`` of the mapping; where the driver refuses it, Confidential
    Computing mode or some containers, memory pinned at allocation by ``cudaHostAlloc``, with a one-line warning),
    ``"register"`` (registration only: a refusal stops at startup), ``"alloc"`` (``cudaHostAlloc`` only).

    Raises:
        ValueError: anything else, naming ``key`` and the accepted values.
    """
    if isinstance(value, str) and value.strip().lower() in PINNING_SETTINGS:
        return value.strip().lower()
    raise ValueError(
        f"{key} = {value!r} is not a pinning setting; expected one of {', '.join(repr(p) for p in PINNING_SETTINGS)} "
        "('auto': cudaHostRegister, and cudaHostAlloc where registration is refused)"
    )


def check_settings(huge_pages: str, pinning: str) -> None:
    """Refuses settings that contradict each other: memory pinned at allocation has the driver's pages.

    Raises:
        ValueError: ``pinning = 'alloc'`` with ``huge_pages`` other than the default ``'thp'``.
    """
    if pinning == "alloc" and huge_pages != "thp":
        raise ValueError(
            f"huge_pages = {huge_pages!r} cannot apply with pinning = 'alloc': cudaHostAlloc allocates pages of the "
            "driver's choosing; use pinning = 'auto' (registration) or leave huge_pages at 'thp'"
        )


def huge_page_bytes(setting: str) -> int | None:
    """Bytes of the reserved page a setting asks for; None for ``"thp"`` and ``"off"``."""
    return HUGE_PAGE_SETTINGS[setting]


def _pool_dir(page_bytes: int, node: int | None, sysfs: str) -> str:
    name = f"hugepages-{page_bytes // 1024}kB"
    if node is None:
        return os.path.join(sysfs, "kernel", "mm", "hugepages", name)
    return os.path.join(sysfs, "devices", "system", "node", f"node{node}", "hugepages", name)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def free_huge_pages(page_bytes: int, node: int | None = None, sysfs: str = SYSFS) -> tuple[int, int] | None:
    """``(free, reserved)`` pages of ``page_bytes`` on ``node`` (None: the whole machine, less the pages already
    promised to mappings, ``resv_hugepages``); None where the kernel offers no pool of that size."""
    pool = _pool_dir(page_bytes, node, sysfs)
    total = _read_int(os.path.join(pool, "nr_hugepages"))
    free = _read_int(os.path.join(pool, "free_hugepages"))
    if total is None or free is None:
        return None
    if node is None:
        free -= _read_int(os.path.join(pool, "resv_hugepages")) or 0
    return max(0, free), total


class HugePageShortage(RuntimeError):
    """Too few reserved huge pages for a buffer; the message is the one-line warning (what is free, what is needed,
    what the buffer falls back to)."""


def check_huge_pages(setting: str, nbytes: int, node: int | None, *, sysfs: str = SYSFS, key: str = "huge_pages"):
    """Raises :class:`HugePageShortage` where the reserved pages a setting asks for are fewer than ``nbytes`` needs:
    on ``node`` where the memory is bound there (a bound fault finds no page elsewhere), else machine-wide."""
    page = huge_page_bytes(setting)
    if page is None:
        return
    needed = -(-nbytes // page)
    where = "" if node is None else f" on node {node}"
    counts = free_huge_pages(page, node, sysfs)
    fallback = f"falling back to transparent huge pages ({key} = 'thp')"
    if counts is None:
        raise HugePageShortage(
            f"{key} = {setting!r}: this kernel offers no {setting} pages{where} ({_pool_dir(page, node, sysfs)} is "
            f"missing); {needed} needed for {nbytes} bytes: {fallback}"
        )
    free, total = counts
    if free < needed:
        raise HugePageShortage(
            f"{key} = {setting!r}: {free} free {setting} page(s){where} ({total} reserved), {needed} needed for "
            f"{nbytes} bytes: {fallback}; reserve more: echo {total - free + needed} > "
            f"{_pool_dir(page, node, sysfs)}/nr_hugepages"
        )


def map_anonymous(nbytes: int, page_bytes: int | None = None) -> mmap.mmap:
    """A private anonymous mapping of at least ``nbytes``: base pages, or reserved huge pages of ``page_bytes``
    (``MAP_HUGETLB``, the length rounded up to whole huge pages: the kernel unmaps them whole)."""
    if page_bytes is None:
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    length = -(-nbytes // page_bytes) * page_bytes
    size_flag = (page_bytes.bit_length() - 1) << _MAP_HUGE_SHIFT
    return mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_HUGETLB | size_flag)


def advise(region: mmap.mmap, setting: str) -> str | None:
    """Transparent huge pages for ``"thp"`` (512x fewer faults to populate, fewer pages for the driver to lock),
    none for ``"off"``; returns why the advice was refused (kernels built without THP say EINVAL), else None."""
    advice = {"thp": "MADV_HUGEPAGE", "off": "MADV_NOHUGEPAGE"}.get(setting)
    value = getattr(mmap, advice, None) if advice else None
    if value is None or not hasattr(region, "madvise"):
        return None if advice is None else f"{advice} unknown here"
    try:
        region.madvise(value)
    except OSError as e:
        return str(e)
    return None


@functools.cache
def _madvise() -> Callable[..., int]:
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def populate(
    address: int,
    nbytes: int,
    *,
    threads: int,
    align: int = _PAGE,
    initializer: Callable[[], None] | None = None,
    touch: Callable[[int, int], None] | None = None,
) -> str:
    """Faults ``[address, address + nbytes)`` in for writing from ``threads`` threads (each runs ``initializer``
    first: on the buffer's node), spans aligned to ``align`` (a huge page). ``MADV_POPULATE_WRITE`` through ctypes
    (the call releases the GIL); where the kernel predates it, ``touch(start, end)`` writes one byte per page.
    Returns the method used.

    Raises:
        OSError: a page could not be faulted in (``ENOMEM``, or ``EFAULT``/``EHWPOISON`` where a reserved huge page
            is missing: the kernel reports what a touch would have made SIGBUS).
    """
    step = max(align, -(-nbytes // threads) // align * align)
    spans = [(s, min(s + step, nbytes)) for s in range(0, nbytes, step)]
    method = ["MADV_POPULATE_WRITE"]

    def fault(span: tuple[int, int]) -> None:
        start, end = span
        if method[0] == "MADV_POPULATE_WRITE":
            if _madvise()(address + start, end - start, _MADV_POPULATE_WRITE) == 0:
                return
            err = ctypes.get_errno()
            if err != errno.EINVAL or touch is None:
                raise OSError(err, f"populating {end - start} bytes of host memory failed: {os.strerror(err)}")
            method[0] = "touch"  # a kernel before 5.14: every thread falls back
        touch(start, end)

    with ThreadPoolExecutor(max_workers=len(spans), initializer=initializer) as pool:
        list(pool.map(fault, spans))
    return method[0]


@functools.cache
def _cudart_path() -> str:
    """The CUDA runtime library this process already loaded (torch's), so allocations and their errors live in the
    same runtime as torch's: found in ``/proc/self/maps``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rstrip("\n").split(None, 5)[-1]
            if "/libcudart.so" in path and os.path.exists(path):
                return path
    raise OSError("no CUDA runtime (libcudart.so) is loaded in this process")


class CudaHostAlloc:
    """``cudaHostAlloc`` / ``cudaFreeHost`` (portable | mapped, as registrations are) from the CUDA runtime torch
    loaded, through ctypes, not torch's pinned allocator, which would round the size up to a power of two. GPU only:
    not run on CPU machines, where tests use a stand-in with the same methods."""

    _PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostAllocPortable | cudaHostAllocMapped

    def __init__(self) -> None:
        self._lib = ctypes.CDLL(_cudart_path())
        self._lib.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        self._lib.cudaFreeHost.argtypes = [ctypes.c_void_p]
        self._lib.cudaGetErrorName.restype = ctypes.c_char_p

    def error_name(self, code: int) -> str:
        return self._lib.cudaGetErrorName(ctypes.c_int(code)).decode()

    def alloc(self, nbytes: int) -> int:
        """The address of ``nbytes`` of pinned, device-mapped host memory.

        Raises:
            RuntimeError: the runtime refused, naming its error.
        """
        ptr = ctypes.c_void_p()
        code = self._lib.cudaHostAlloc(ctypes.byref(ptr), nbytes, self._PORTABLE_MAPPED)
        if code != 0:
            self._lib.cudaGetLastError()  # a failed call leaves its error pending on the thread: drop it
            raise RuntimeError(
                f"cudaHostAlloc of {nbytes} bytes failed with CUDA error {code} ({self.error_name(code)})"
            )
        return int(ptr.value)

    def free(self, ptr: int) -> None:
        code = self._lib.cudaFreeHost(ctypes.c_void_p(ptr))
        if code != 0:
            self._lib.cudaGetLastError()
            logger.warning("cudaFreeHost(%#x) failed with CUDA error %d (%s)", ptr, code, self.error_name(code))
