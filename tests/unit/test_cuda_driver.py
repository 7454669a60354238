"""The driver call of the copy-engine path and the memcpy_batch baseline (triton_offload/cuda_driver.py), checked
without a GPU: the CUmemcpyAttributes layout against cuda.h, the arguments each cuMemcpyBatchAsync ABI receives
through ctypes (a host stand-in for the driver records them and does the copies), and which ABI a driver version
gets."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest

from bench.baselines import copy_loop
from triton_offload import cuda_driver as cd


def test_attributes_struct_is_24_bytes_with_cuda_h_offsets():
    a = cd.CUmemcpyAttributes
    assert ctypes.sizeof(a) == 24 and ctypes.alignment(a) == 4
    offsets = {name: getattr(a, name).offset for name in ("srcAccessOrder", "srcLocHint", "dstLocHint", "flags")}
    assert offsets == {"srcAccessOrder": 0, "srcLocHint": 4, "dstLocHint": 12, "flags": 20}


_LAYOUT_PROBE = r"""
#include <stddef.h>
#include <stdio.h>
#include <cuda.h>
int main(void) {
  printf("%zu %zu %zu %zu %zu %zu %d %d %d %d\n", sizeof(CUmemcpyAttributes),
         offsetof(CUmemcpyAttributes, srcAccessOrder), offsetof(CUmemcpyAttributes, srcLocHint),
         offsetof(CUmemcpyAttributes, dstLocHint), offsetof(CUmemcpyAttributes, flags), sizeof(CUmemLocation),
         (int)CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, (int)CU_MEM_LOCATION_TYPE_DEVICE, (int)CU_MEM_LOCATION_TYPE_HOST,
         (int)CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE);
  return 0;
}
"""


def test_attributes_layout_and_enums_match_the_installed_cuda_h(tmp_path):
    home = copy_loop.cuda_home()
    cc = shutil.which("cc") or shutil.which("gcc")
    if home is None or cc is None:
        pytest.skip("needs a CUDA toolkit's cuda.h and a C compiler")
    src = tmp_path / "probe.c"
    src.write_text(_LAYOUT_PROBE)
    subprocess.run([cc, str(src), f"-I{home}/include", "-o", str(tmp_path / "probe")], check=True)
    got = [int(v) for v in subprocess.run([str(tmp_path / "probe")], capture_output=True, text=True).stdout.split()]
    a = cd.CUmemcpyAttributes
    want = [ctypes.sizeof(a), a.srcAccessOrder.offset, a.srcLocHint.offset, a.dstLocHint.offset, a.flags.offset]
    want += [ctypes.sizeof(cd.CUmemLocation), cd.SRC_ACCESS_ORDER_STREAM, cd.LOCATION_DEVICE, cd.LOCATION_HOST]
    want += [cd.FLAG_PREFER_OVERLAP_WITH_COMPUTE]
    assert got == want


def _host_plan(count: int, seed: int = 0):
    """Random sizes and disjoint offsets in two host buffers: (src buffer, dst buffer, srcs, dsts, sizes)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 300, count).astype(np.uint64)
    src = rng.integers(0, 256, int(sizes.sum()) + 64, dtype=np.uint8)
    dst = np.full(src.size + 64, 0xA5, dtype=np.uint8)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
    perm = rng.permutation(count)  # destinations in another order than the sources
    dst_starts = np.concatenate([[0], np.cumsum(sizes[perm])[:-1]]).astype(np.uint64)[np.argsort(perm)]
    srcs = np.uint64(src.ctypes.data) + starts
    dsts = np.uint64(dst.ctypes.data) + np.uint64(32) + dst_starts
    return src, dst, srcs, dsts, sizes


@pytest.mark.parametrize("with_fail_idx", [False, True], ids=["cuda13-v2", "cuda12.8-failIdx"])
def test_batch_call_hands_the_driver_the_prebuilt_arrays(with_fail_idx):
    src, dst, srcs, dsts, sizes = _host_plan(37)
    stand_in = cd.HostBatchStandIn(with_fail_idx)
    attrs = cd.batch_attributes(gpu_to_host=True, device_index=3, flags=cd.FLAG_PREFER_OVERLAP_WITH_COMPUTE)
    call = cd.MemcpyBatchCall(stand_in.address, with_fail_idx, srcs, dsts, sizes, attrs, stream=0x7F00)
    call()
    call()
    assert len(stand_in.calls) == 2
    got = stand_in.calls[0]
    # The very arrays built once in prepare, not per-call copies.
    assert got["arrays"] == (call.dsts.ctypes.data, call.srcs.ctypes.data, call.sizes.ctypes.data)
    assert stand_in.calls[1]["arrays"] == got["arrays"]
    assert got["count"] == 37 and got["attr_idxs"] == [0] and got["stream"] == 0x7F00
    assert got["attrs"] == (cd.SRC_ACCESS_ORDER_STREAM, (cd.LOCATION_DEVICE, 3), (cd.LOCATION_HOST, 0), 1)
    assert got["fail_idx"] is with_fail_idx
    _assert_copied(src, dst, srcs, dsts, sizes)


def _assert_copied(src, dst, srcs, dsts, sizes) -> None:
    """The copies a :func:`_host_plan` describes are the right ones, and nothing around them changed."""
    for s, d, n in zip(srcs - np.uint64(src.ctypes.data), dsts - np.uint64(dst.ctypes.data), sizes):
        assert np.array_equal(dst[int(d) : int(d + n)], src[int(s) : int(s + n)])
    assert (dst[:32] == 0xA5).all() and (dst[32 + int(sizes.sum()) :] == 0xA5).all()


@pytest.mark.parametrize("with_fail_idx", [False, True], ids=["cuda13-v2", "cuda12.8-failIdx"])
def test_a_driver_error_raises_and_names_the_copy(with_fail_idx):
    def failing(*args):
        if with_fail_idx:
            args[7][0] = 5  # failIdx
        return 1  # CUDA_ERROR_INVALID_VALUE

    fn = cd.batch_prototype(with_fail_idx)(failing)
    _, _, srcs, dsts, sizes = _host_plan(9)
    attrs = cd.batch_attributes(False, 0, cd.FLAG_DEFAULT)
    call = cd.MemcpyBatchCall(ctypes.cast(fn, ctypes.c_void_p).value, with_fail_idx, srcs, dsts, sizes, attrs, 1)
    want = "of 9 copies failed: CUresult 1" + (", failIdx=5" if with_fail_idx else "$")
    with pytest.raises(cd.CudaError, match=want):
        call()


class _StandInDriver:
    """A driver whose cuMemcpyBatchAsync is a host stand-in of the 12.8 ABI; counts the entry-point lookups."""

    def __init__(self):
        self.stand_in, self.lookups = cd.HostBatchStandIn(with_fail_idx=True), 0

    def batch_entry(self) -> tuple[int, bool]:
        self.lookups += 1
        return self.stand_in.address, True


def test_a_batch_issuer_resolves_the_entry_once_and_builds_unissued_batches():
    """On CUDA the driver given is asked for the entry point once, for every batch after; each batch carries its
    direction's attributes (the device's index, the flags) and is issued only when called. Without CUDA a memmove
    stand-in is the driver."""
    driver = _StandInDriver()
    issuer = cd.BatchIssuer(SimpleNamespace(type="cuda", index=2), cd.FLAG_PREFER_OVERLAP_WITH_COMPUTE, driver)
    device, host = (cd.LOCATION_DEVICE, 2), (cd.LOCATION_HOST, 0)
    for i, gpu_to_host in enumerate((True, False, True)):
        src, dst, srcs, dsts, sizes = _host_plan(5, seed=i)
        call = issuer.call(srcs, dsts, sizes, gpu_to_host, stream=0x51)
        assert len(driver.stand_in.calls) == i and (dst == 0xA5).all()  # built, not issued
        call()
        got = driver.stand_in.calls[-1]
        where = (device, host) if gpu_to_host else (host, device)
        assert got["attrs"] == (cd.SRC_ACCESS_ORDER_STREAM, *where, cd.FLAG_PREFER_OVERLAP_WITH_COMPUTE)
        assert got["count"] == 5 and got["stream"] == 0x51 and got["fail_idx"]
        _assert_copied(src, dst, srcs, dsts, sizes)
    assert driver.lookups == 1
    cpu = cd.BatchIssuer(SimpleNamespace(type="cpu", index=None), cd.FLAG_DEFAULT)
    src, dst, srcs, dsts, sizes = _host_plan(7)
    call = cpu.call(srcs, dsts, sizes, False, 0)
    assert cpu.stand_in.calls == []
    call()
    (got,) = cpu.stand_in.calls
    assert got["attrs"] == (cd.SRC_ACCESS_ORDER_STREAM, (cd.LOCATION_HOST, 0), (cd.LOCATION_DEVICE, 0), cd.FLAG_DEFAULT)
    assert got["count"] == 7 and not got["fail_idx"]
    _assert_copied(src, dst, srcs, dsts, sizes)


def test_mismatched_descriptor_arrays_are_refused():
    _, _, srcs, dsts, sizes = _host_plan(4)
    with pytest.raises(ValueError, match="4 srcs, 3 dsts, 4 sizes"):
        cd.MemcpyBatchCall(1, False, srcs, dsts[:3], sizes, cd.batch_attributes(True, 0, 0), 1)


class _FakeLib:
    """libcuda's cuGetProcAddress_v2 and exported symbols, for the ABI selection only."""

    def __init__(self, known: dict[tuple[str, int], int], exported: dict[str, int]):
        self.known, self.requests = known, []
        for name, address in exported.items():
            setattr(self, name, ctypes.c_void_p(address))

    def cuGetProcAddress_v2(self, symbol, pfn, version, flags, status):
        self.requests.append((symbol.decode(), version, flags))
        pfn._obj.value = self.known.get((symbol.decode(), version))
        return 0


def _driver(version: int, lib) -> object:
    driver = object.__new__(cd.CudaDriver)  # no libcuda here: only the ABI selection runs
    driver.lib, driver.version, driver.device_index = lib, version, 0
    return driver


@pytest.mark.parametrize(
    ("version", "want"),
    [(13000, (0x1300, False)), (13020, (0x1300, False)), (12080, (0x1280, True)), (12090, (0x1280, True))],
    ids=["13.0", "13.2", "12.8", "12.9"],
)
def test_the_driver_version_picks_the_batch_abi(version, want):
    lib = _FakeLib({("cuMemcpyBatchAsync", 13000): 0x1300, ("cuMemcpyBatchAsync", 12080): 0x1280}, {})
    assert _driver(version, lib).batch_entry() == want
    assert lib.requests == [("cuMemcpyBatchAsync", 13000 if version >= 13000 else 12080, 0)]


def test_without_get_proc_address_the_exported_symbol_of_that_abi_is_used():
    lib = _FakeLib({}, {"cuMemcpyBatchAsync_v2": 0x2222, "cuMemcpyBatchAsync": 0x1111})
    assert _driver(13000, lib).batch_entry() == (0x2222, False)
    assert _driver(12080, lib).batch_entry() == (0x1111, True)


def test_a_driver_before_12_8_has_no_batch():
    with pytest.raises(cd.CudaError, match="needs 12.8"):
        _driver(12060, _FakeLib({}, {})).batch_entry()


def test_an_older_abi_is_given_where_asked_for_it():
    """batch_entry_of: the ABI a caller built against that CUDA version gets (vLLM 0.33's op asks for 12.8's on a
    CUDA 13 driver); a driver older than the ABI is refused, naming it."""
    lib = _FakeLib({("cuMemcpyBatchAsync", 13000): 0x1300, ("cuMemcpyBatchAsync", 12080): 0x1280}, {})
    assert _driver(13000, lib).batch_entry_of(12080) == (0x1280, True)
    assert lib.requests == [("cuMemcpyBatchAsync", 12080, 0)]
    with pytest.raises(cd.CudaError, match="the 13000 ABI of cuMemcpyBatchAsync"):
        _driver(12080, lib).batch_entry_of(13000)
