"""The SM copy the ``vllm033`` baseline loads small pages with, written here from a description of vLLM 0.33's native
offloading worker (no vLLM code is copied).

A load where every descriptor is smaller than 28 KiB, every address and size is a multiple of 8 bytes and there are
at least 16 descriptors is done by a Triton kernel instead of the copy engines: one (src, dst, bytes) descriptor per
(block, layer page) -- per run where a layer's K and V of a block are apart (kv_first) --, uploaded host -> device on
every call, and 12 persistent programs that each take every 12th descriptor and copy it in 8-byte words, at most
8 KiB per step.

Addresses are passed as word offsets from one anchor, the uploaded descriptor buffer itself, rather than as integers
cast to pointers: under unified addressing a pinned host address and a device address live in one space, and the
Triton interpreter (which runs this kernel on CPU in ``./dev bench``) then dereferences plain base+offset pointers.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from triton_offload.kernels._triton_compat import patch_interpreter_scalar_index

__all__ = ["MAX_PAGE_BYTES", "MIN_DESCRIPTORS", "ALIGN", "PROGRAMS", "CHUNK_BYTES", "uses_sm_copy", "SmCopy"]

MAX_PAGE_BYTES = 28 * 1024  # every descriptor strictly smaller
MIN_DESCRIPTORS = 16
ALIGN = 8  # bytes: every address and size; the kernel moves 8-byte words
PROGRAMS = 12
CHUNK_BYTES = 8 * 1024  # at most this many bytes of one descriptor per step
_WORD = 8


def uses_sm_copy(store: bool, srcs: np.ndarray, dsts: np.ndarray, sizes: np.ndarray) -> bool:
    """Whether vLLM 0.33 would move this transfer with the SM copy (else one cuMemcpyBatchAsync): loads only."""
    if store or sizes.size < MIN_DESCRIPTORS or int(sizes.max()) >= MAX_PAGE_BYTES:
        return False
    return not np.any((srcs | dsts | sizes) % np.uint64(ALIGN))


def _sm_copy_kernel(
    anchor_ptr,  # int64*: the descriptor buffer; every address is a word offset from it
    desc_ptr,  # int64* (n_desc, 3): src offset, dst offset, length, all in 8-byte words
    n_desc,
    rounds,  # ceil(n_desc / programs)
    n_chunks,  # CHUNK-word steps of the longest descriptor; shorter ones are masked
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, CHUNK)
    # Persistent: program p takes descriptors p, p + nprog, ... A fixed trip count (not range(pid, n, nprog)): older
    # Triton interpreters cannot take a program id as a range bound; a round past the end is all masked.
    for i in range(0, rounds):
        d = pid + i * nprog
        live = d < n_desc
        src = tl.load(desc_ptr + 3 * d, mask=live, other=0)
        dst = tl.load(desc_ptr + 3 * d + 1, mask=live, other=0)
        words = tl.load(desc_ptr + 3 * d + 2, mask=live, other=0)  # 0 past the end: every step masked
        for k in range(0, n_chunks):
            col = k * CHUNK + cols  # [CHUNK]
            mask = col < words
            vals = tl.load(anchor_ptr + src + col, mask=mask)
            tl.store(anchor_ptr + dst + col, vals, mask=mask)


_jit_kernel = triton.jit(_sm_copy_kernel, do_not_specialize=["n_desc", "rounds", "n_chunks"])
_interpreted_kernel = InterpretedFunction(_sm_copy_kernel)


class SmCopy:
    """One transfer's descriptors, prepared once; calling it uploads them and launches the copy.

    Args:
        srcs, dsts, sizes: (n,) uint64 byte addresses and byte counts, as :func:`uses_sm_copy` accepted them.
        device: where the kernel runs (CPU: the Triton interpreter).
    """

    def __init__(self, srcs: np.ndarray, dsts: np.ndarray, sizes: np.ndarray, device: torch.device):
        n = int(sizes.size)
        self.n = n
        # The device copy is the anchor, so it is allocated first and the host side is written relative to it.
        self.desc_dev = torch.empty((n, 3), dtype=torch.int64, device=device)
        anchor = self.desc_dev.data_ptr()
        rows = np.stack([srcs.astype(np.int64), dsts.astype(np.int64), sizes.astype(np.int64)], axis=1)
        rows[:, :2] -= anchor
        assert not np.any(rows % _WORD), "uses_sm_copy checks 8-byte alignment; torch allocations are 512-byte aligned"
        self.desc_host = torch.from_numpy(rows // _WORD)
        if device.type == "cuda":
            self.desc_host = self.desc_host.pin_memory()  # an async upload from pageable memory may sync the stream
        max_words = int(sizes.max()) // _WORD
        self.chunk = min(CHUNK_BYTES // _WORD, triton.next_power_of_2(max_words))
        self.n_chunks = triton.cdiv(max_words, self.chunk)
        self.programs = min(PROGRAMS, n)
        self.rounds = triton.cdiv(n, self.programs)
        if device.type == "cpu":
            patch_interpreter_scalar_index()  # Triton < 3.7 under NumPy >= 2.4; a no-op elsewhere
            self.kernel = _interpreted_kernel
        else:
            self.kernel = _jit_kernel

    def __call__(self) -> None:
        # Descriptors are uploaded on every call, as the worker builds them per transfer; the source is constant and
        # pinned, so the copy is truly asynchronous and never overwritten while in flight.
        self.desc_dev.copy_(self.desc_host, non_blocking=True)
        self.kernel[(self.programs,)](
            self.desc_dev, self.desc_dev, self.n, self.rounds, self.n_chunks, CHUNK=self.chunk, num_warps=4
        )
