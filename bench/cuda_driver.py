"""The benchmark's view of the CUDA driver: the library's ctypes binding (:mod:`triton_offload.cuda_driver`), which
the copy-engine baselines call, plus what only they use (``cuMemcpyAsync`` per copy, the ``SRC_ACCESS_ORDER_ANY`` of
vLLM's op, a driver that may be absent) and what the results files record about the driver."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

from triton_offload.cuda_driver import (  # noqa: F401  (re-exported for the baselines)
    FLAG_DEFAULT,
    FLAG_PREFER_OVERLAP_WITH_COMPUTE,
    SRC_ACCESS_ORDER_STREAM,
    BatchIssuer,
    CudaDriver,
    CudaError,
    CUmemcpyAttributes,
    HostBatchStandIn,
    batch_prototype,
)

__all__ = ["SRC_ACCESS_ORDER_ANY", "BenchDriver", "load_driver", "cuda_version_text", "driver_info"]

SRC_ACCESS_ORDER_ANY = 0x3  # CU_MEMCPY_SRC_ACCESS_ORDER_ANY (cuda.h): vLLM's op passes it for some batches


def cuda_version_text(version: int) -> str:
    """A driver's CUDA version as cuDriverGetVersion encodes it (1000 * major + 10 * minor) -> ``"major.minor"``."""
    return f"{version // 1000}.{version % 1000 // 10}"


class BenchDriver(CudaDriver):
    """The library's driver plus ``cuMemcpyAsync``, which the per-copy baselines call, and a description."""

    def __init__(self, device_index: int):
        super().__init__(device_index)
        self._memcpy_async = None

    @property
    def note(self) -> str:
        return f"driver API via ctypes on libcuda.so.1, CUDA {cuda_version_text(self.version)}"

    def memcpy_async(self):
        """``cuMemcpyAsync(dst, src, bytes, stream) -> CUresult`` as a ctypes function (one Python call per copy)."""
        if self._memcpy_async is None:
            fn = self.lib.cuMemcpyAsync  # unified addressing: the driver infers the direction from the pointers
            fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            self._memcpy_async = fn
        return self._memcpy_async


def load_driver(device_index: int) -> tuple[BenchDriver | None, str]:
    """(BenchDriver, description) or (None, why not)."""
    try:
        driver = BenchDriver(device_index)
    except CudaError as exc:
        return None, str(exc)
    return driver, driver.note


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
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:
            info["driver_cuda"] = cuda_version_text(version.value)
    except OSError:
        pass
    return info
