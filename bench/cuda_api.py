"""Checked access to the CUDA calls the copy-engine baselines make, through cuda-python (``cuda.bindings``).

Only the benchmark uses this module; the project itself never imports cuda-python. Every cuda-python call returns a
tuple whose first element is the error code, and every one goes through :func:`check`, which raises
:class:`CudaError` naming the call, so a baseline that cannot run says why instead of reporting a number.

Binding versions differ in one place that matters here: ``cuMemcpyBatchAsync`` takes the same Python arguments in
cuda-bindings 12.8+ and 13.x, ``(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, hStream)``, but 12.x returns
``(CUresult, failIdx)`` (the CUDA 12.8 driver API has a ``size_t *failIdx`` out-parameter) and 13.x returns
``(CUresult,)`` (CUDA 13 dropped it). The result is read by position, so both work.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Callable, Sequence

__all__ = ["CudaError", "CudaApi", "load_cuda_api", "driver_info"]


class CudaError(RuntimeError):
    """A CUDA call through cuda-python returned an error."""


def check(result, what: str):
    """Returns the values after the error code of a cuda-python result tuple; raises CudaError on failure."""
    err = result[0]
    # IntEnum (cuda-bindings 12.x) and FastEnum (13.x) are both int subclasses: 0 is success.
    if int(err):
        raise CudaError(f"{what} failed: {getattr(err, 'name', err)} ({int(err)})")
    return result[1:]


def _import_bindings():
    """(driver, runtime, version) from cuda-python, newest layout first; raises ImportError with the reason."""
    try:
        import cuda.bindings
        from cuda.bindings import driver, runtime

        return driver, runtime, getattr(cuda.bindings, "__version__", "unknown")
    except ImportError as first:
        try:  # cuda-python < 12.6 exposed the same modules under other names
            from cuda import cuda as driver
            from cuda import cudart as runtime

            return driver, runtime, "legacy cuda-python"
        except ImportError:
            raise ImportError(f"cuda-python is not installed ({first})") from first


class CudaApi:
    """cuda-python's driver and runtime modules, with the primary context made current on this thread.

    Args:
        device_index: the CUDA device the benchmark runs on (PyTorch has already initialised it).
    """

    def __init__(self, device_index: int):
        self.driver, self.runtime, self.version = _import_bindings()
        self.device_index = device_index
        check(self.driver.cuInit(0), "cuInit")
        (self.driver_version,) = check(self.driver.cuDriverGetVersion(), "cuDriverGetVersion")
        self._ensure_context()

    def _ensure_context(self) -> None:
        # Driver API calls act on the thread's current context. PyTorch's runtime made the primary context current
        # on this thread when it allocated the caches; if not (another thread, an odd build), make it current here.
        (ctx,) = check(self.driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if int(ctx) != 0:
            return
        (dev,) = check(self.driver.cuDeviceGet(self.device_index), "cuDeviceGet")
        (ctx,) = check(self.driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        check(self.driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    # -- one cudaMemcpyAsync per copy -------------------------------------------------------------------------------

    def memcpy_each(self, stream_handle: int) -> Callable[[Sequence[int], Sequence[int], Sequence[int]], None]:
        """A function issuing one ``cudaMemcpyAsync(dst, src, size, cudaMemcpyDefault, stream)`` per descriptor.

        cudaMemcpyDefault lets unified addressing infer the direction from the pointers (pinned host or device).
        """
        memcpy = self.runtime.cudaMemcpyAsync
        kind = self.runtime.cudaMemcpyKind.cudaMemcpyDefault
        stream = self.runtime.cudaStream_t(stream_handle)  # converted once, not per call

        def copy_each(srcs: Sequence[int], dsts: Sequence[int], sizes: Sequence[int]) -> None:
            for dst, src, size in zip(dsts, srcs, sizes):
                err = memcpy(dst, src, size, kind, stream)[0]
                if err:  # checked inline: the loop is the cost being measured
                    raise CudaError(f"cudaMemcpyAsync({dst:#x}, {src:#x}, {size}) failed: {err!r}")

        return copy_each

    # -- one cuMemcpyBatchAsync for all copies ----------------------------------------------------------------------

    def batch_unavailable(self) -> str | None:
        """Why cuMemcpyBatchAsync cannot be used here, or None."""
        if not hasattr(self.driver, "cuMemcpyBatchAsync"):
            return f"cuda-python {self.version} has no cuMemcpyBatchAsync binding (needs cuda-bindings >= 12.8)"
        if self.driver_version < 12080:
            return f"the driver supports CUDA {self.driver_version}, cuMemcpyBatchAsync needs 12.8 (12080)"
        return None

    def batch_attributes(self, gpu_to_host: bool):
        """One CUmemcpyAttributes for every copy of a transfer.

        srcAccessOrder=STREAM: the source is read in stream order (a store's KV may still be written by the model,
        a load's host block by a previous transfer). PREFER_OVERLAP_WITH_COMPUTE asks for the copy engines so the
        copies overlap the model's kernels, which is what an offloader wants. The location hints only matter for
        managed or pageable memory; they are set to the true locations anyway so the struct is fully valid.
        """
        try:
            return self._batch_attributes(gpu_to_host)
        except (AttributeError, TypeError, ValueError) as exc:  # a binding that names these differently
            raise CudaError(f"cuda-python {self.version}: cannot build CUmemcpyAttributes: {exc!r}") from exc

    def _batch_attributes(self, gpu_to_host: bool):
        drv = self.driver
        device_loc = drv.CUmemLocation()
        device_loc.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        device_loc.id = self.device_index
        host_loc = drv.CUmemLocation()
        host_loc.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
        host_loc.id = 0
        attr = drv.CUmemcpyAttributes()
        attr.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        attr.srcLocHint = device_loc if gpu_to_host else host_loc
        attr.dstLocHint = host_loc if gpu_to_host else device_loc
        # CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE is 0x1 in cuda.h; the field is a plain unsigned int.
        flags = getattr(drv, "CUmemcpyFlags", None)
        attr.flags = int(getattr(flags, "CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE", 1))
        return attr

    def memcpy_batch(
        self, srcs: Sequence[int], dsts: Sequence[int], sizes: Sequence[int], gpu_to_host: bool, stream_handle: int
    ) -> Callable[[], None]:
        """A function issuing one ``cuMemcpyBatchAsync`` with every descriptor; the arguments are built here, once.

        The stream must not be the legacy default stream (the API rejects it); the benchmark runs on its own stream.
        """
        reason = self.batch_unavailable()
        if reason:
            raise CudaError(reason)
        drv = self.driver
        cu_dsts = [drv.CUdeviceptr(int(a)) for a in dsts]
        cu_srcs = [drv.CUdeviceptr(int(a)) for a in srcs]
        sizes = [int(s) for s in sizes]
        attrs, attr_idxs = [self.batch_attributes(gpu_to_host)], [0]
        stream = drv.CUstream(stream_handle)
        count = len(sizes)
        batch = drv.cuMemcpyBatchAsync

        def run() -> None:
            result = batch(cu_dsts, cu_srcs, sizes, count, attrs, attr_idxs, 1, stream)
            if int(result[0]):
                # 12.x bindings also return failIdx: the copy the driver rejected (SIZE_MAX if none in particular).
                fail = f", failIdx={result[1]}" if len(result) > 1 else ""
                raise CudaError(f"cuMemcpyBatchAsync of {count} copies failed: {result[0]!r}{fail}")

        return run


def load_cuda_api(device_index: int) -> tuple[CudaApi | None, str]:
    """(CudaApi, description) or (None, why not): cuda-python is optional, the baselines then degrade or skip."""
    try:
        api = CudaApi(device_index)
    except (ImportError, CudaError, AttributeError) as exc:
        return None, str(exc)
    return api, f"cuda-python {api.version}, driver API {api.driver_version}"


def _libcuda_driver_version() -> int | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return version.value
    except OSError:
        pass
    return None


def driver_info() -> dict:
    """The kernel driver version (nvidia-smi) and the CUDA version the driver supports, where they can be read."""
    info: dict = {"driver": None, "driver_cuda": None}
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            ).stdout.strip()
            info["driver"] = out.splitlines()[0] if out else None
        except (subprocess.SubprocessError, OSError):
            pass
    version = _libcuda_driver_version()
    if version:
        info["driver_cuda"] = f"{version // 1000}.{version % 1000 // 10}"
    return info
