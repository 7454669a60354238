"""The vllm033 baseline's SM copy: when a transfer takes it, and that its Triton kernel (run by the interpreter here)
moves exactly the descriptors' bytes, across several chunks and rounds of its persistent programs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.baselines import vllm033

KIB = 1024


@pytest.fixture(scope="module")
def sm_copy():
    return vllm033


def _descriptors(count: int, size: int, base: int = 1 << 20):
    sizes = np.full(count, size, dtype=np.uint64)
    srcs = np.uint64(base) + np.arange(count, dtype=np.uint64) * np.uint64(32 * KIB)
    return srcs, srcs + np.uint64(1 << 30), sizes


@pytest.mark.parametrize(
    ("store", "count", "size", "shift", "expected"),
    [
        (False, 16, 8 * KIB, 0, True),
        (False, 16, 28 * KIB - 8, 0, True),
        (True, 16, 8 * KIB, 0, False),  # stores are always a batch
        (False, 15, 8 * KIB, 0, False),  # too few descriptors
        (False, 64, 28 * KIB, 0, False),  # a page of 28 KiB is not under 28 KiB
        (False, 64, 8 * KIB + 4, 0, False),  # a size that is not whole words
        (False, 64, 8 * KIB, 4, False),  # addresses that are not 8-byte aligned
    ],
    ids=["16-desc", "just-under-28K", "store", "15-desc", "28K", "size-unaligned", "addr-unaligned"],
)
def test_which_loads_take_the_sm_copy(sm_copy, store, count, size, shift, expected):
    srcs, dsts, sizes = _descriptors(count, size, base=(1 << 20) + shift)
    assert sm_copy.uses_sm_copy(store, srcs, dsts, sizes) is expected


def test_the_sm_copy_moves_exactly_the_described_bytes(sm_copy):
    """29 descriptors (three rounds of 12 programs), sizes from one word to 20 KiB (three 8 KiB steps), scattered
    sources and destinations in two buffers; everything not described must keep its sentinel."""
    rng = np.random.default_rng(0)
    words = rng.integers(1, 20 * KIB // 8 + 1, 29)
    words[:3] = [1, 1024, 20 * KIB // 8]
    src = torch.randint(0, 256, (int(words.sum()) * 8 + 4096,), dtype=torch.uint8)
    dst = torch.full((int(words.sum()) * 8 + 8192,), 0xA5, dtype=torch.uint8)
    src_off = np.concatenate([[0], np.cumsum(words)[:-1]]) * 8 + 64
    order = rng.permutation(29)
    dst_off = np.empty(29, dtype=np.int64)
    dst_off[order] = np.concatenate([[0], np.cumsum(words[order])[:-1]]) * 8 + 128
    sizes = (words * 8).astype(np.uint64)
    srcs = (src.data_ptr() + src_off).astype(np.uint64)
    dsts = (dst.data_ptr() + dst_off).astype(np.uint64)
    assert sm_copy.uses_sm_copy(False, srcs, dsts, sizes)
    copy = sm_copy.SmCopy(srcs, dsts, sizes, torch.device("cpu"))
    assert (copy.programs, copy.rounds, copy.chunk, copy.n_chunks) == (12, 3, 1024, 3)
    copy()
    want = torch.full_like(dst, 0xA5)
    for s, d, n in zip(src_off, dst_off, sizes):
        want[d : d + int(n)] = src[s : s + int(n)]
    assert torch.equal(dst, want)


def test_the_sm_copy_compiles_for_hopper_with_8_byte_accesses(sm_copy):
    """What the interpreter cannot show: the kernel type-checks in compiled mode, and moves 8-byte words."""
    import re

    import triton

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction
    except ImportError as e:  # pragma: no cover - a Triton without the AOT entry points
        pytest.skip(f"this Triton has no ASTSource/GPUTarget: {e}")
    # A fresh JITFunction: the test session may have TRITON_INTERPRET=1, which turns triton.jit into the interpreter.
    fn = JITFunction(sm_copy._sm_copy_kernel, do_not_specialize=["n_desc", "rounds", "n_chunks"])
    signature = {"anchor_ptr": "*i64", "desc_ptr": "*i64", "n_desc": "i32", "rounds": "i32", "n_chunks": "i32"}
    signature["CHUNK"] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(2)}  # torch allocations are 16-byte aligned
    source = ASTSource(fn, signature, {"CHUNK": sm_copy.CHUNK_BYTES // 8}, attrs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    stores = re.findall(r"st\.global(?:\.[a-z0-9]+)*(?:\.v(\d))?\.b(\d+)", ptx)
    assert stores and {int(v or 1) * int(b) // 8 for v, b in stores} == {8}, stores
