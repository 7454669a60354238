"""Page-locking host memory with CUDA: a range registered in bounded chunks from threads on its NUMA node (so no
single call holds the driver for long, and a failure releases exactly what was registered), checked to be mapped at
its host address, and unregistered (every device synchronised first) when its owner is closed or dropped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from triton_offload._checks import positive_int

__all__ = [
    "REGISTER_CHUNK_BYTES",
    "REGISTER_THREADS",
    "RegistrationError",
    "register_host_range",
    "unregister_host_ranges",
    "check_mapped_at_host_address",
    "free_pinned",
]

logger = logging.getLogger(__name__)

REGISTER_CHUNK_BYTES = 1 << 30
# Threads a HostCache registers its chunks from by default (at most the CPU count).
REGISTER_THREADS = 8
# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every context, and mapped so the kernels can read
# and write it through the same (unified) address.
_CUDA_HOST_REGISTER_FLAGS = 0x01 | 0x02


def _synchronize_devices() -> None:
    for device in range(torch.cuda.device_count()):
        torch.cuda.synchronize(device)


def free_pinned(free, ptr: int) -> None:
    """Frees memory pinned at allocation once no queued transfer can still touch it (as unregistering does)."""
    _synchronize_devices()
    free(ptr)


def unregister_host_ranges(registered: list[tuple[int, int]]) -> None:
    """Unregisters every ``(address, bytes)`` range in ``registered`` from CUDA, emptying the list. Holds no reference
    to the owner of the memory, so it can run as its finalizer.

    Every device is synchronised first: a transfer still queued against the memory (an engine that was never shut
    down) would otherwise read or write pages that are no longer locked.
    """
    if not registered:
        return
    _synchronize_devices()
    cudart = torch.cuda.cudart()
    while registered:
        ptr, _ = registered.pop()
        cudart.cudaHostUnregister(ptr)


class RegistrationError(RuntimeError):
    """``cudaHostRegister`` failed (everything registered before was released); ``code`` is the CUDA error."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _thread_setup(cpus: Sequence[int], device: int | None):
    """A pool initializer: the thread runs on ``cpus`` (the buffer's node; any CPU when empty) and uses CUDA device
    ``device``. A new thread's current device is 0: registering from it would create device 0's context (memory on
    GPU 0) in every rank of a multi-GPU process."""

    def setup() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        if device is not None:
            torch.cuda.set_device(device)

    return setup


def _caller_device() -> int | None:
    return torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def register_host_range(
    ptr: int,
    nbytes: int,
    *,
    chunk_bytes: int | None = None,
    threads: int = 1,
    what: str = "host buffer",
    cpus: Sequence[int] = (),
    device: int | None = None,
) -> list[tuple[int, int]]:
    """Page-locks ``[ptr, ptr + nbytes)`` with CUDA (portable, mapped) in chunks of at most ``chunk_bytes`` (default
    :data:`REGISTER_CHUNK_BYTES`), so that no single call holds the driver for long, and checks that the memory is
    mapped at its host address. Returns the registered ``(address, bytes)`` ranges, in address order, for
    :func:`unregister_host_ranges`.

    The calls run on threads of their own, never the caller's: a failed ``cudaHostRegister`` leaves its error pending
    on the calling thread, where torch would later report it against an unrelated call.

    Args:
        threads: chunks registered at once (the calls release the GIL); 1 registers them one after another.
        cpus: the CPUs those threads run on (the memory's NUMA node); empty: any.
        device: the CUDA device the threads use; None: the caller's, where CUDA is initialised.

    Raises:
        RegistrationError: a registration failed; everything registered is released first, and the message names
            the (first failed) chunk, ``what`` was being registered and what to change.
        RuntimeError: the address check failed (everything released).
    """
    chunk_bytes = chunk_bytes or REGISTER_CHUNK_BYTES
    positive_int(threads, "threads")
    cudart = torch.cuda.cudart()
    chunks = [(start, min(chunk_bytes, nbytes - start)) for start in range(0, nbytes, chunk_bytes)]
    setup = _thread_setup(tuple(cpus), _caller_device() if device is None else device)

    def register(chunk: tuple[int, int]) -> int:
        start, size = chunk
        err = cudart.cudaHostRegister(ptr + start, size, _CUDA_HOST_REGISTER_FLAGS)
        return int(getattr(err, "value", err))

    def one_by_one() -> list[int]:
        codes = []
        for chunk in chunks:
            codes.append(register(chunk))
            if codes[-1] != 0:
                break
        return codes

    with ThreadPoolExecutor(max_workers=min(threads, len(chunks)), initializer=setup) as pool:
        # One thread stops at the first failure; with several every chunk is tried, and on a failure the ones that
        # succeeded are released below.
        codes = pool.submit(one_by_one).result() if threads == 1 else list(pool.map(register, chunks))
    done: list[tuple[int, int]] = []
    failed: tuple[int, int, int] | None = None  # (offset, bytes, CUDA error) of the first chunk that failed
    for (start, size), code in zip(chunks, codes):
        if code == 0:
            done.append((ptr + start, size))
        elif failed is None:
            failed = (start, size, code)
    if failed is not None:
        start, size, code = failed
        registered = sum(s for _, s in done)
        unregister_host_ranges(done)
        raise RegistrationError(
            f"cudaHostRegister failed with CUDA error {code} for {size} bytes at offset {start} of a "
            f"{nbytes}-byte {what} (after {registered} bytes registered, now released); lower "
            f"cpu_bytes_to_use or raise the locked-memory limit (ulimit -l)",
            code,
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
