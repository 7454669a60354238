"""The memcpy_per_block baseline's compiled loop and its fallback, checked without a GPU.

The loop's C++ source is built with ``load_inline`` twice: over a host stand-in for ``cudaMemcpyAsync`` (memcpy), to
check that it issues exactly the plan's copies and reports the one that fails; and, where a CUDA toolkit is installed,
against the real ``cuda_runtime.h`` and libcudart, to check that it builds, loads and reports the runtime's error
(there is no GPU here). Without a compiled loop the baseline falls back to a Python loop, labelled handicapped.
"""

from __future__ import annotations

import ctypes
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bench.baselines import copies, copy_loop
from bench.common import case
from bench.common.env import Env

# The CUDA runtime's types and a memcpy in place of cudaMemcpyAsync; odd sizes fail, as an error to report.
_HOST_SHIM = r"""
#include <cstring>
typedef int cudaError_t;
typedef void* cudaStream_t;
enum cudaMemcpyKind { cudaMemcpyDefault = 4 };
static const cudaError_t cudaSuccess = 0;
static cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t stream) {
  if (n % 2 || kind != cudaMemcpyDefault || stream != reinterpret_cast<cudaStream_t>(0x5eed)) return 11;
  std::memcpy(dst, src, n);
  return cudaSuccess;
}
"""

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None or shutil.which("ninja") is None, reason="needs a C++ compiler and ninja"
)


@pytest.fixture(scope="module")
def shim_lib(tmp_path_factory):
    """The loop's source built over the host stand-in (once for the module)."""
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("needs a C++ compiler and ninja")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path_factory.mktemp("ext")))
        return copy_loop.build_copy_loop("to_bench_copy_loop_shim", ["-DTO_BENCH_HOST_SHIM"], _HOST_SHIM)


def _plan(count: int, odd_at: int | None = None):
    rng = np.random.default_rng(1)
    sizes = (2 * rng.integers(1, 200, count)).astype(np.uint64)
    if odd_at is not None:
        sizes[odd_at] += 1
    src = rng.integers(0, 256, int(sizes.sum()), dtype=np.uint8)
    dst = np.full(src.size + 16, 0xA5, dtype=np.uint8)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
    back = starts[::-1].copy()  # destinations reversed: each copy lands somewhere else
    dst_starts = np.uint64(src.size) - back - sizes[::-1]
    plan = (np.uint64(src.ctypes.data) + starts, np.uint64(dst.ctypes.data) + dst_starts[::-1], sizes)
    return src, dst, plan


def _moved_right(src, dst, plan) -> bool:
    srcs, dsts, sizes = plan
    for s, d, n in zip(srcs - np.uint64(src.ctypes.data), dsts - np.uint64(dst.ctypes.data), sizes):
        if not np.array_equal(dst[int(d) : int(d + n)], src[int(s) : int(s + n)]):
            return False
    return bool((dst[src.size :] == 0xA5).all())


def test_the_compiled_loop_issues_every_copy_of_the_plan(shim_lib):
    src, dst, plan = _plan(41)
    copy_loop.CompiledCopyLoop(shim_lib, *plan, stream=0x5EED)()
    assert _moved_right(src, dst, plan)
    _, _, bad = _plan(41, odd_at=17)
    with pytest.raises(RuntimeError, match=r"cudaMemcpyAsync of copy 17 of 41 .* failed: cudaError 11"):
        copy_loop.CompiledCopyLoop(shim_lib, *bad, stream=0x5EED)()


@needs_compiler
def test_the_real_loop_builds_against_the_cuda_runtime(tmp_path, monkeypatch):
    if copy_loop.cuda_home() is None:
        pytest.skip("needs a CUDA toolkit (cuda_runtime.h, libcudart)")
    if torch.cuda.is_available():
        pytest.skip("checks the error path, which needs a machine without a GPU")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lib = copy_loop.build_copy_loop()
    _, _, plan = _plan(3)
    # No GPU, no driver: the runtime's first call fails, and the loop says which copy and which error.
    with pytest.raises(RuntimeError, match=r"cudaMemcpyAsync of copy 0 of 3 .* failed: cudaError \d+"):
        copy_loop.CompiledCopyLoop(lib, *plan, stream=0)()


@needs_compiler
def test_a_build_failure_is_a_reason_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with pytest.raises(copy_loop.BuildFailed):
        copy_loop.build_copy_loop("to_bench_broken", ["-DTO_BENCH_HOST_SHIM"], "this is not C++;")


class _FakeDriver:
    """The driver's cuMemcpyAsync (``lib.cuMemcpyAsync``, as ctypes exposes it), done with memmove on host memory;
    records the stream it was given."""

    def __init__(self):
        self.streams = []
        self.lib = SimpleNamespace(cuMemcpyAsync=_FakeMemcpy(self.streams))


class _FakeMemcpy:
    """A callable that takes ctypes' ``argtypes`` and ``restype`` like a foreign function."""

    def __init__(self, streams: list):
        self.streams = streams

    def __call__(self, dst, src, n, stream):
        self.streams.append(stream)
        ctypes.memmove(dst, src, n)
        return 0


def test_without_a_compiled_loop_the_python_loop_is_labelled_handicapped():
    src, dst, plan = _plan(12)
    driver = _FakeDriver()
    env = Env(torch.device("cpu"), driver, "fake driver", stream_handle=0x77)
    run, impl = copies.issue_each(plan, env, None, "no compiler here")
    assert impl.startswith(copy_loop.PYTHON_ISSUED) and "no compiler here" in impl
    run()
    assert _moved_right(src, dst, plan) and driver.streams == [0x77] * 12


def test_with_a_compiled_loop_it_is_used_and_labelled_so(shim_lib):
    src, dst, plan = _plan(12)
    env = Env(torch.device("cpu"), None, "no driver", stream_handle=0x5EED)
    run, impl = copies.issue_each(plan, env, shim_lib)
    assert isinstance(run, copy_loop.CompiledCopyLoop) and "C++" in impl and copy_loop.PYTHON_ISSUED not in impl
    run()
    assert _moved_right(src, dst, plan)


def test_neither_a_compiled_loop_nor_a_driver_means_unavailable():
    env = Env(torch.device("cpu"), None, "libcuda.so.1 missing")
    with pytest.raises(case.Unavailable, match="no compiled helper .*libcuda.so.1 missing"):
        copies.issue_each(_plan(2)[2], env, None, "no compiler")
