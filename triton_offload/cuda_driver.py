"""The CUDA driver's ``cuMemcpyBatchAsync`` through ctypes, for the copy-engine transfer path
(:mod:`triton_offload.issuers.dma`): it loads ``libcuda.so.1`` itself (no cuda-python), so a batch is one ctypes call
over arrays built beforehand, the driver's own cost as a C++ caller such as vLLM pays it. The entry point's ABI changed
between CUDA 12.8 and 13.0 (:data:`BATCH_ABIS`; docs/design.md, "The copy-engine path and auto");
bench/baselines/driver.py adds what only the benchmark's baselines use.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

__all__ = [
    "CudaError",
    "CUmemLocation",
    "CUmemcpyAttributes",
    "BATCH_ABIS",
    "batch_attributes",
    "batch_prototype",
    "MemcpyBatchCall",
    "HostBatchStandIn",
    "BatchIssuer",
    "CudaDriver",
    "shared_driver",
    "SRC_ACCESS_ORDER_STREAM",
    "LOCATION_DEVICE",
    "LOCATION_HOST",
    "FLAG_DEFAULT",
    "FLAG_PREFER_OVERLAP_WITH_COMPUTE",
]

# cuda.h enum values.
SRC_ACCESS_ORDER_STREAM = 0x1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
LOCATION_DEVICE = 0x1  # CU_MEM_LOCATION_TYPE_DEVICE
LOCATION_HOST = 0x2  # CU_MEM_LOCATION_TYPE_HOST
FLAG_DEFAULT = 0x0  # CU_MEMCPY_FLAG_DEFAULT
FLAG_PREFER_OVERLAP_WITH_COMPUTE = 0x1  # CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
_GET_PROC_ADDRESS_DEFAULT = 0


class CudaError(RuntimeError):
    """A driver call failed, or the driver lacks an entry point; the message names the call."""


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemcpyAttributes(ctypes.Structure):
    """cuda.h (unchanged from 12.8 to 13.x): ``CUmemcpySrcAccessOrder srcAccessOrder`` (an enum, 4 bytes) at 0,
    ``CUmemLocation srcLocHint`` ({``CUmemLocationType type``, ``int id``}, 8 bytes) at 4, ``dstLocHint`` at 12,
    ``unsigned int flags`` at 20: 24 bytes, 4-byte aligned (``tests/unit/test_cuda_driver.py`` checks it against cuda.h
    with a C compiler where the header is installed)."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", CUmemLocation),
        ("dstLocHint", CUmemLocation),
        ("flags", ctypes.c_uint),
    ]


# cudaVersion to ask cuGetProcAddress for -> (exported symbol of that ABI, whether it takes ``size_t *failIdx``).
# 12.8 (exported as cuMemcpyBatchAsync): (CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
# CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, size_t *failIdx, CUstream hStream); 13.0 (exported as
# cuMemcpyBatchAsync_v2, which cuda.h maps the name to): the same without failIdx. Checked against CUDA 13.0's cuda.h.
# The entry point comes from cuGetProcAddress(symbol, cudaVersion, CU_GET_PROC_ADDRESS_DEFAULT), falling back to the
# exported symbol; the ctypes prototype follows the ABI.
BATCH_ABIS = {13000: ("cuMemcpyBatchAsync_v2", False), 12080: ("cuMemcpyBatchAsync", True)}


def batch_attributes(gpu_to_host: bool, device_index: int, flags: int) -> CUmemcpyAttributes:
    """One attribute entry for every copy of a transfer.

    srcAccessOrder=STREAM: the source is read in stream order (a store's KV may still be being written by the model,
    a load's host block by a previous transfer). The location hints only matter for managed or pageable memory; they
    are set to the true locations anyway so the struct is fully valid.
    """
    device = CUmemLocation(LOCATION_DEVICE, device_index)
    host = CUmemLocation(LOCATION_HOST, 0)
    src, dst = (device, host) if gpu_to_host else (host, device)
    return CUmemcpyAttributes(SRC_ACCESS_ORDER_STREAM, src, dst, flags)


def batch_prototype(with_fail_idx: bool):
    """The ctypes function type of one cuMemcpyBatchAsync ABI (pointers as void*, CUresult as int)."""
    args = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(CUmemcpyAttributes)]
    args += [ctypes.c_void_p, ctypes.c_size_t]
    if with_fail_idx:
        args.append(ctypes.POINTER(ctypes.c_size_t))
    args.append(ctypes.c_void_p)  # CUstream
    return ctypes.CFUNCTYPE(ctypes.c_int, *args)


def _u64(values: np.ndarray) -> np.ndarray:
    out = np.ascontiguousarray(values, dtype=np.uint64)
    if out.ndim != 1:
        raise ValueError(f"descriptor arrays must be 1-D, got shape {out.shape}")
    return out


class MemcpyBatchCall:
    """One ``cuMemcpyBatchAsync`` over descriptor arrays built here, once; calling it issues the batch.

    Args:
        address: the driver function's address.
        with_fail_idx: the 12.8 ABI (``size_t *failIdx`` before the stream).
        srcs, dsts, sizes: (count,) source and destination addresses and byte counts; copied to uint64 arrays that
            this object keeps alive.
        attrs: the one attribute entry every copy uses (``attrsIdxs = [0]``, ``numAttrs = 1``).
        stream: the raw CUstream handle (not the legacy NULL stream: the API rejects it).
    """

    def __init__(self, address: int, with_fail_idx: bool, srcs, dsts, sizes, attrs: CUmemcpyAttributes, stream: int):
        self.srcs, self.dsts, self.sizes = _u64(srcs), _u64(dsts), _u64(sizes)
        if not self.srcs.size == self.dsts.size == self.sizes.size:
            raise ValueError(f"{self.srcs.size} srcs, {self.dsts.size} dsts, {self.sizes.size} sizes: must match")
        self.count = int(self.sizes.size)
        self.with_fail_idx = with_fail_idx
        self.attrs = attrs
        self.attr_idxs = np.zeros(1, dtype=np.uint64)
        self.fail_idx = ctypes.c_size_t(0)
        self._fn = batch_prototype(with_fail_idx)(address)
        args = [self.dsts.ctypes.data, self.srcs.ctypes.data, self.sizes.ctypes.data, self.count]
        args += [ctypes.byref(self.attrs), self.attr_idxs.ctypes.data, 1]
        if with_fail_idx:
            args.append(ctypes.byref(self.fail_idx))
        self._args = (*args, stream or None)

    def __call__(self) -> None:
        err = self._fn(*self._args)
        if err:
            raise CudaError(f"cuMemcpyBatchAsync of {self.count} copies failed: CUresult {err}{self._fail_note()}")

    def _fail_note(self) -> str:
        # 12.8 ABI: the copy the driver rejected, SIZE_MAX when the error concerns no copy in particular.
        fail = self.fail_idx.value
        return f", failIdx={fail}" if self.with_fail_idx and fail < self.count else ""


class HostBatchStandIn:
    """A stand-in for the driver's cuMemcpyBatchAsync on a machine without CUDA: a C-callable function of either ABI
    that reads the arrays it is handed and performs each copy with memmove, so :class:`MemcpyBatchCall`'s marshalling
    runs exactly as on a GPU and its bytes can be checked. ``calls`` records what each call received.

    Args:
        with_fail_idx: the 12.8 ABI.
    """

    def __init__(self, with_fail_idx: bool = False):
        self.with_fail_idx = with_fail_idx
        self.calls: list[dict] = []
        self._callback = batch_prototype(with_fail_idx)(self._batch)  # kept alive as long as this object
        self.address = ctypes.cast(self._callback, ctypes.c_void_p).value

    def _batch(self, dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, *rest) -> int:
        u64 = ctypes.POINTER(ctypes.c_uint64)
        d, s, n = (ctypes.cast(p, u64) for p in (dsts, srcs, sizes))
        a = attrs.contents
        self.calls.append(
            {
                "count": count,
                "arrays": (dsts, srcs, sizes),
                "attrs": (a.srcAccessOrder, (a.srcLocHint.type, a.srcLocHint.id), (a.dstLocHint.type, a.dstLocHint.id),
                          a.flags),
                "attr_idxs": [ctypes.cast(attr_idxs, u64)[i] for i in range(num_attrs)],
                "stream": rest[-1],
                "fail_idx": bool(self.with_fail_idx and rest[0]),
            }
        )  # fmt: skip
        for i in range(count):
            ctypes.memmove(d[i], s[i], n[i])
        return 0


class BatchIssuer:
    """Batches of one device and one set of flags: the ``cuMemcpyBatchAsync`` entry point resolved once (the driver's
    newest ABI on CUDA; without CUDA a :class:`HostBatchStandIn`, held here so its callback lives as long as this
    object) and one :func:`batch_attributes` entry per direction.

    Args:
        device: where the KV caches live (a ``torch.device``; its ``type`` and ``index`` are read).
        flags: the CUmemcpyAttributes flags of every batch.
        driver: the driver to resolve the entry point from on CUDA; None: :func:`shared_driver` of the device.

    Raises:
        CudaError: on CUDA, the driver cannot be loaded or has no cuMemcpyBatchAsync (before 12.8).
    """

    def __init__(self, device, flags: int, driver: CudaDriver | None = None):
        self.cuda = device.type == "cuda"
        index = device.index or 0
        if self.cuda:
            driver = driver if driver is not None else shared_driver(index)
            self.address, self.with_fail_idx = driver.batch_entry()
        else:
            self.stand_in = HostBatchStandIn()
            self.address, self.with_fail_idx = self.stand_in.address, False
        self._attrs = {gpu_to_host: batch_attributes(gpu_to_host, index, flags) for gpu_to_host in (True, False)}

    def call(self, srcs, dsts, sizes, gpu_to_host: bool, stream: int) -> MemcpyBatchCall:
        """The batch of these descriptors on ``stream`` (a raw CUstream; 0 on CPU), built, not issued: calling it
        issues it. It holds the descriptor arrays: keep it until the copies have completed."""
        attrs = self._attrs[gpu_to_host]
        return MemcpyBatchCall(self.address, self.with_fail_idx, srcs, dsts, sizes, attrs, stream)


class CudaDriver:
    """``libcuda.so.1`` with the calling thread's context checked, and its ``cuMemcpyBatchAsync`` entry points.

    Args:
        device_index: the CUDA device the caller runs on (PyTorch has already initialised it on this thread).
    """

    def __init__(self, device_index: int):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaError(f"cannot load libcuda.so.1: {exc}") from exc
        self.device_index = device_index
        get = getattr(self.lib, "cuGetProcAddress_v2", None)  # CUDA >= 12.0 drivers
        if get is not None:
            get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64]
            get.argtypes += [ctypes.POINTER(ctypes.c_int)]
        self._check(self.lib.cuInit(0), "cuInit")
        version = ctypes.c_int(0)
        self._check(self.lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
        self.version = version.value
        self._ensure_context()

    def _check(self, err: int, what: str) -> None:
        if err:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(err, ctypes.byref(name))
            raise CudaError(f"{what} failed: {(name.value or b'?').decode()} ({err})")

    def _ensure_context(self) -> None:
        # Driver calls act on the thread's current context. PyTorch's runtime made the primary context current on
        # this thread when it allocated the caches; if not (another thread, an odd build), make it current here.
        ctx = ctypes.c_void_p()
        self._check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if ctx.value:
            return
        dev = ctypes.c_int()
        self._check(self.lib.cuDeviceGet(ctypes.byref(dev), self.device_index), "cuDeviceGet")
        self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self._check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def _proc(self, symbol: str, cuda_version: int, exported: str) -> int:
        pfn, status = ctypes.c_void_p(), ctypes.c_int(0)
        get = getattr(self.lib, "cuGetProcAddress_v2", None)
        if get is not None:
            err = get(symbol.encode(), ctypes.byref(pfn), cuda_version, _GET_PROC_ADDRESS_DEFAULT, ctypes.byref(status))
            if not err and pfn.value:
                return pfn.value
        try:
            return ctypes.cast(getattr(self.lib, exported), ctypes.c_void_p).value
        except AttributeError:
            raise CudaError(
                f"the driver (CUDA {self.version}) has no {symbol} for CUDA {cuda_version} "
                f"(cuGetProcAddress status {status.value}, no {exported} symbol)"
            ) from None

    def batch_entry(self) -> tuple[int, bool]:
        """(address, with_fail_idx) of cuMemcpyBatchAsync in the newest ABI of :data:`BATCH_ABIS` this driver
        speaks; CudaError before 12.8."""
        for cuda_version in BATCH_ABIS:
            if self.version >= cuda_version:
                return self.batch_entry_of(cuda_version)
        raise CudaError(f"the driver supports CUDA {self.version}; cuMemcpyBatchAsync needs 12.8 (12080)")

    def batch_entry_of(self, cuda_version: int) -> tuple[int, bool]:
        """(address, with_fail_idx) of cuMemcpyBatchAsync in the ABI of ``cuda_version`` (a key of
        :data:`BATCH_ABIS`), as a caller built against that CUDA version gets it; CudaError if the driver is
        older."""
        exported, with_fail_idx = BATCH_ABIS[cuda_version]
        if self.version < cuda_version:
            raise CudaError(
                f"the driver supports CUDA {self.version}; the {cuda_version} ABI of cuMemcpyBatchAsync needs 12.8 "
                "(12080)"
            )
        return self._proc("cuMemcpyBatchAsync", cuda_version, exported), with_fail_idx


_SHARED: dict[int, CudaDriver] = {}
_SHARED_LOCK = threading.Lock()


def shared_driver(device_index: int) -> CudaDriver:
    """One :class:`CudaDriver` per device for the process (loading libcuda and resolving entry points once).

    Raises:
        CudaError: libcuda cannot be loaded or initialised.
    """
    with _SHARED_LOCK:
        driver = _SHARED.get(device_index)
        if driver is None:
            driver = _SHARED[device_index] = CudaDriver(device_index)
        return driver
