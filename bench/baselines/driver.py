"""The CUDA driver calls only the baselines make, over the library's ctypes binding
(:class:`triton_offload.cuda_driver.CudaDriver`): ``cuMemcpyAsync`` per copy, and the ``SRC_ACCESS_ORDER_ANY`` that
vLLM's op passes for its loads."""

from __future__ import annotations

import ctypes

from triton_offload.cuda_driver import CudaDriver

__all__ = ["SRC_ACCESS_ORDER_ANY", "memcpy_async"]

SRC_ACCESS_ORDER_ANY = 0x3  # CU_MEMCPY_SRC_ACCESS_ORDER_ANY (cuda.h): vLLM's op passes it for its loads


def memcpy_async(driver: CudaDriver):
    """``cuMemcpyAsync(dst, src, bytes, stream) -> CUresult`` of ``driver`` as a ctypes function (one Python call per
    copy; unified addressing: the driver infers the direction from the pointers)."""
    fn = driver.lib.cuMemcpyAsync
    fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn
