"""``vllm033``: vLLM 0.33's data path, written here from a description of its native offloading worker (no vLLM code is
copied), once for both benchmarks (:class:`Vllm033`, an :class:`~triton_offload.issuers.base.Issuer`). Its descriptors
are the library's, one per run and block (``DmaPlanner(coalesce=False)``), as vLLM builds them. Stores are one
``cuMemcpyBatchAsync`` that reads its source in stream order (the compute may still write it), no flags; loads read
theirs in any order (``srcAccessOrder = ANY``: host memory no GPU stream writes meanwhile), as vLLM's
``swap_blocks_batch`` is called (``transfer_async``: ``is_src_access_order_any = not gpu_to_cpu``), except a load of
many small aligned descriptors (:func:`uses_sm_copy`), which vLLM moves with a Triton kernel (:class:`SmCopy`).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from bench.baselines.copies import batch_impl, batch_issuer
from bench.baselines.driver import SRC_ACCESS_ORDER_ANY
from bench.baselines.tracked import TrackedEngine
from bench.common.case import OffloadTarget, Prepared, TransferCase
from bench.common.env import Env
from bench.common.grid import VLLM033_MAX_PAGE_BYTES as MAX_PAGE_BYTES  # every descriptor strictly smaller
from triton_offload.cuda_driver import FLAG_DEFAULT, MemcpyBatchCall, batch_attributes
from triton_offload.issuers.dma import DmaPlanner
from triton_offload.kernels._triton_compat import patch_interpreter_scalar_index
from triton_offload.plan import Direction, TransferPlan

__all__ = [
    "MAX_PAGE_BYTES",
    "MIN_DESCRIPTORS",
    "ALIGN",
    "PROGRAMS",
    "CHUNK_BYTES",
    "uses_sm_copy",
    "SmCopy",
    "Vllm033",
    "prepare",
    "engine",
]

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

    A load where every descriptor is smaller than 28 KiB, every address and size is a multiple of 8 bytes and there
    are at least 16 descriptors is done by a Triton kernel instead of the copy engines: one (src, dst, bytes)
    descriptor per (block, layer page) -- per run where a layer's K and V of a block are apart (kv_first) --, uploaded
    host -> device on every call, and 12 persistent programs that each take every 12th descriptor and copy it in
    8-byte words, at most 8 KiB per step.

    Addresses are passed as word offsets from one anchor, the uploaded descriptor buffer itself, rather than as
    integers cast to pointers: under unified addressing a pinned host address and a device address live in one space,
    and the Triton interpreter (which runs this kernel on CPU in ``./dev bench``) then dereferences plain base+offset
    pointers.

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


class Vllm033:
    """vLLM 0.33's policy as an :class:`~triton_offload.issuers.base.Issuer` between one spec and one host buffer.

    Args:
        spec, host_buffer, blocks_per_host_block: the caches, the packed host buffer and f.
        env: the machine (its CUDA driver); Unavailable on CUDA without one.

    Attributes:
        paths: what it issued so far ("SM copy load", "cuMemcpyBatchAsync store", ...).
    """

    path = "dma"  # the copy engines (and, for some loads, vLLM's SM copy: ``paths`` says which)
    on_cpu = "batches run by a memmove stand-in, the SM copy by the interpreter"

    def __init__(self, spec, host_buffer: torch.Tensor, blocks_per_host_block: int, env: Env):
        self.planner = DmaPlanner(spec, host_buffer, blocks_per_host_block, coalesce=False)
        self.device, self.env = spec.device, env
        self._batch = None  # the driver's entry point, resolved at the first batch (the SM copy needs none)
        self._load_attrs = batch_attributes(False, spec.device.index or 0, FLAG_DEFAULT)
        self._load_attrs.srcAccessOrder = SRC_ACCESS_ORDER_ANY
        self.paths: set[str] = set()

    @property
    def batch(self):
        if self._batch is None:
            self._batch = batch_issuer(self.device, self.env, FLAG_DEFAULT)
        return self._batch

    def copies(self, plan: TransferPlan) -> int:
        return self.planner.count(plan)

    def op(self, plan: TransferPlan, stream: int):
        """``plan``'s transfer, built and not issued (calling it issues it): the SM copy for a load that vLLM would
        give it, else one batch call on the raw CUstream ``stream`` (0 on CPU)."""
        src, dst, sizes = self.planner.descriptors(plan)
        store = plan.direction is Direction.STORE
        if uses_sm_copy(store, src, dst, sizes):
            self.paths.add("SM copy load")
            return SmCopy(src, dst, sizes, self.device)
        b = self.batch
        if store:
            self.paths.add("cuMemcpyBatchAsync store")
            return b.call(src, dst, sizes, True, stream)
        self.paths.add("cuMemcpyBatchAsync load (source order ANY)")
        return MemcpyBatchCall(b.address, b.with_fail_idx, src, dst, sizes, self._load_attrs, stream)

    def issue(self, plan: TransferPlan, stream: torch.cuda.Stream | None = None, trace=None):
        """Builds ``plan``'s descriptors and issues them on ``stream`` (None: the current one; on CPU they run now);
        returns the op, which holds the arrays the copies read."""
        if self.device.type != "cuda":  # the copies run now
            op = self.op(plan, 0)
            op()
            return op
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        # The SM copy's device descriptors belong to the stream that reads them; the driver acts in the caches' device.
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            op = self.op(plan, stream.cuda_stream)
            op()
        return op

    def outcome(self, keep) -> None:
        """No integrity checks."""
        return None

    def release(self, keep, after=None) -> None:
        """Nothing to hand back: the arrays go with the op."""


def prepare(case: TransferCase, env: Env, num_ctas: int | None = None) -> Prepared:
    """The transfer benchmark's ``vllm033``: the case's op built once (descriptors, and an SM copy's buffers)."""
    issuer = Vllm033(case.spec, case.host, case.f, env)
    op = issuer.op(case.plan(), env.stream_handle)
    if isinstance(op, SmCopy):
        where = "compiled" if env.cuda else "Triton interpreter"
        impl = f"SM copy ({where}): 12 programs, 8-byte words, <= 8 KiB steps, descriptors uploaded per call"
        return Prepared(op, case.host_ids, impl)
    order = "" if case.store or not env.cuda else " (source order ANY)"
    run = lambda issuer=issuer: op()  # noqa: E731 - the default argument keeps the stand-in's callback alive
    return Prepared(run if not env.cuda else op, case.host_ids, f"batch: {batch_impl(env)}{order}", not env.cuda)


def engine(target: OffloadTarget, num_ctas: int | None) -> TrackedEngine:
    """The serving loop's ``vllm033``: descriptors built per call from the block ids, as vLLM's worker builds them."""
    return TrackedEngine(target, Vllm033(target.kv, target.host_buffer, 1, target.env), "vllm033")
