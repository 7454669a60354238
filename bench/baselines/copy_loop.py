"""The ``memcpy_per_block`` baseline's loop in compiled code: one ``cudaMemcpyAsync`` per descriptor, issued from C++
(:class:`CompiledCopyLoop`). That is how the original design's ``swap_blocks`` issues its copies, so the baseline pays
the runtime's per-copy cost and nothing more. The helper is a few lines of C++ built at benchmark time with
``torch.utils.cpp_extension.load_inline`` (a plain shared library without pybind11 or torch headers, so it builds in a
couple of seconds) and called through ctypes: one call per transfer, over descriptor arrays built once. Where it cannot
be built (no compiler, no CUDA headers), the baseline falls back to a Python loop and every row and table says so
(:data:`PYTHON_ISSUED`): such a baseline is handicapped by about a microsecond of Python per copy.
"""

from __future__ import annotations

import ctypes
import os
import shutil

import numpy as np

from bench.common.results import PYTHON_ISSUED

__all__ = ["SOURCE", "PYTHON_ISSUED", "CompiledCopyLoop", "BuildFailed", "build_copy_loop", "cuda_home"]


# TO_BENCH_HOST_SHIM: the tests build this same loop over a host memcpy stand-in, to check it without a GPU.
SOURCE = r"""
#include <cstddef>
#include <cstdint>
#ifndef TO_BENCH_HOST_SHIM
#include <cuda_runtime.h>
#endif

// One cudaMemcpyAsync per descriptor, in order, on one stream. Returns 0, or the first error with its index in
// *failed (the copies before it were issued).
extern "C" int to_bench_copy_each(const uint64_t* dsts, const uint64_t* srcs, const uint64_t* sizes, size_t count,
                                  void* stream, uint64_t* failed) {
  for (size_t i = 0; i < count; ++i) {
    cudaError_t err = cudaMemcpyAsync(reinterpret_cast<void*>(dsts[i]), reinterpret_cast<const void*>(srcs[i]),
                                      static_cast<size_t>(sizes[i]), cudaMemcpyDefault,
                                      static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) {
      *failed = i;
      return static_cast<int>(err);
    }
  }
  return 0;
}
"""


class BuildFailed(RuntimeError):
    """The helper could not be built or loaded here; the message says why."""


def cuda_home() -> str | None:
    """A CUDA toolkit with ``include/cuda_runtime.h``: $CUDA_HOME, $CUDA_PATH, torch's guess, /usr/local/cuda."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    try:
        from torch.utils.cpp_extension import CUDA_HOME

        candidates.append(CUDA_HOME)
    except ImportError:
        pass
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if home and os.path.isfile(os.path.join(home, "include", "cuda_runtime.h")):
            return home
    return None


def build_copy_loop(
    name: str = "to_bench_copy_loop", cflags: list[str] | None = None, prelude: str = ""
) -> ctypes.CDLL:
    """Builds and loads the helper; raises BuildFailed with the reason.

    Args:
        name: the extension's name (its build directory under ``TORCH_EXTENSIONS_DIR``).
        cflags: extra compiler flags (the tests pass ``-DTO_BENCH_HOST_SHIM``).
        prelude: source placed before :data:`SOURCE` (the tests' host stand-in for the CUDA runtime).
    """
    try:
        from torch.utils.cpp_extension import load_inline
    except ImportError as exc:
        raise BuildFailed(f"torch.utils.cpp_extension is unavailable: {exc}") from exc
    cflags = list(cflags or [])
    include, ldflags = [], []
    if "-DTO_BENCH_HOST_SHIM" not in cflags:
        home = cuda_home()
        if home is None:
            raise BuildFailed("no CUDA toolkit with include/cuda_runtime.h (set CUDA_HOME)")
        lib = next((d for d in ("lib64", "lib") if os.path.isdir(os.path.join(home, d))), "lib64")
        include = [os.path.join(home, "include")]
        # rpath only as a fallback: PyTorch has normally loaded libcudart.so.<major> already, and the loader reuses it.
        ldflags = [f"-L{os.path.join(home, lib)}", "-lcudart", f"-Wl,-rpath,{os.path.join(home, lib)}"]
    try:
        path = load_inline(
            name,
            [prelude + SOURCE],
            extra_cflags=["-O2", *cflags],
            extra_include_paths=include,
            extra_ldflags=ldflags,
            is_python_module=False,
            no_implicit_headers=True,
        )
        lib = ctypes.CDLL(path)
    except Exception as exc:  # a compiler error, a missing ninja, a loader error: all mean "fall back, say why"
        raise BuildFailed(f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}") from exc
    fn = lib.to_bench_copy_each
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64)]
    fn.restype = ctypes.c_int
    return lib


class CompiledCopyLoop:
    """The built helper bound to one plan: calling it issues every copy, in C++, on ``stream``.

    Args:
        lib: what :func:`build_copy_loop` returned.
        srcs, dsts, sizes: (count,) addresses and byte counts, kept here as uint64 arrays.
        stream: the raw stream handle.
    """

    def __init__(self, lib: ctypes.CDLL, srcs, dsts, sizes, stream: int):
        self.srcs, self.dsts, self.sizes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (srcs, dsts, sizes))
        self.count = int(self.sizes.size)
        self.failed = ctypes.c_uint64(0)
        self._fn = lib.to_bench_copy_each
        self._args = (
            self.dsts.ctypes.data,
            self.srcs.ctypes.data,
            self.sizes.ctypes.data,
            self.count,
            stream or None,
            ctypes.byref(self.failed),
        )

    def __call__(self) -> None:
        err = self._fn(*self._args)
        if err:
            i = self.failed.value
            raise RuntimeError(
                f"cudaMemcpyAsync of copy {i} of {self.count} ({int(self.sizes[i])} bytes, {int(self.srcs[i]):#x} -> "
                f"{int(self.dsts[i]):#x}) failed: cudaError {err}"
            )
