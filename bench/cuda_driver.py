"""The benchmark's view of the CUDA driver: the library's ctypes binding (:mod:`triton_offload.cuda_driver`), which
the copy-engine baselines call, and what the results files record about the driver."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

from triton_offload.cuda_driver import (  # noqa: F401  (re-exported for the baselines)
    FLAG_DEFAULT,
    FLAG_PREFER_OVERLAP_WITH_COMPUTE,
    SRC_ACCESS_ORDER_ANY,
    SRC_ACCESS_ORDER_STREAM,
    BatchIssuer,
    CudaDriver,
    CudaError,
    CUmemcpyAttributes,
    HostBatchStandIn,
    batch_prototype,
    cuda_version_text,
    load_driver,
)

__all__ = ["driver_info"]


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
