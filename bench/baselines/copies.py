"""The copy-engine baselines over the library's uncoalesced descriptors (one per run and block, as a caller that
never merges builds them: :meth:`TransferCase.descriptors`, ``DmaPlanner(coalesce=False)``), issued from compiled code
over arrays built in ``prepare``, as a C++ caller would: ``memcpy_batch`` is one ``cuMemcpyBatchAsync`` through
ctypes (in the serving loop the library's own :class:`~triton_offload.issuers.dma.DmaIssuer` with ``coalesce=False``,
its descriptors built per call), ``memcpy_per_block`` one ``cudaMemcpyAsync`` per descriptor from a C++ loop built at
benchmark time. Without CUDA their calls are replayed on host memory (a memmove stand-in for the driver, or a
memmove of the same copy plan), so the CPU check still verifies the bytes their descriptors address.
"""

from __future__ import annotations

import functools

from bench.baselines.copy_loop import BuildFailed, CompiledCopyLoop, build_copy_loop
from bench.baselines.driver import memcpy_async
from bench.baselines.tracked import TrackedEngine
from bench.common.case import OffloadTarget, Prepared, TransferCase, Unavailable, memmove_replay
from bench.common.env import Env
from bench.common.results import PYTHON_ISSUED
from triton_offload.cuda_driver import FLAG_PREFER_OVERLAP_WITH_COMPUTE, BatchIssuer, CudaError
from triton_offload.issuers.dma import DmaIssuer

__all__ = ["issue_each", "prepare_per_block", "batch_issuer", "batch_impl", "prepare_batch", "batch_engine"]


@functools.cache
def _compiled_loop() -> tuple[object | None, str]:
    """(the C++ loop, "") or (None, why not): built once per process."""
    try:
        return build_copy_loop(), ""
    except BuildFailed as exc:
        return None, str(exc)


def issue_each(descs, env: Env, lib, why_not: str = "") -> tuple[object, str]:
    """(run, impl) issuing one copy per descriptor of ``descs`` = (srcs, dsts, sizes) on the benchmark's stream: from
    the compiled helper ``lib`` when there is one, else from a Python loop over the driver's cuMemcpyAsync, labelled
    handicapped."""
    src, dst, sizes, stream = *descs, env.stream_handle
    if lib is not None:
        return CompiledCopyLoop(lib, src, dst, sizes, stream), "cudaMemcpyAsync per copy, loop in C++ (load_inline)"
    if env.driver is None:
        raise Unavailable(f"no compiled helper ({why_not}) and no CUDA driver ({env.driver_note})")
    memcpy = memcpy_async(env.driver)
    copies = list(zip(dst.tolist(), src.tolist(), sizes.tolist()))

    def run() -> None:
        for d, s, n in copies:
            err = memcpy(d, s, n, stream or None)
            if err:  # checked inline: the loop is the cost being measured
                raise CudaError(f"cuMemcpyAsync({d:#x}, {s:#x}, {n}) failed: CUresult {err}")

    return run, f"{PYTHON_ISSUED}: cuMemcpyAsync per copy from a Python loop; no compiled helper: {why_not}"


def prepare_per_block(case: TransferCase, env: Env, num_ctas: int | None = None) -> Prepared:
    """The original design: one cudaMemcpyAsync per block per run (per K and per V where they are apart), block by
    block."""
    # The library's descriptors are run-major, (runs, blocks): the original loop is block-major.
    descs = tuple(a.reshape(-1, case.n).T.ravel() for a in case.descriptors())
    if not env.cuda:
        return Prepared(memmove_replay(*descs), case.host_ids, "memmove replay of the copy plan (no CUDA)", True)
    run, impl = issue_each(descs, env, *_compiled_loop())
    return Prepared(run, case.host_ids, impl)


def batch_issuer(device, env: Env, flags: int) -> BatchIssuer:
    """The ``cuMemcpyBatchAsync`` entry point on ``env``'s driver (a memmove stand-in without CUDA), or Unavailable
    saying why not."""
    if env.cuda and env.driver is None:
        raise Unavailable(f"needs the CUDA driver: {env.driver_note}")
    try:
        return BatchIssuer(device, flags, env.driver)
    except CudaError as exc:
        raise Unavailable(str(exc)) from exc


def batch_impl(env: Env) -> str:
    """How a prebuilt batch call runs here."""
    if not env.cuda:
        return "cuMemcpyBatchAsync call, run by a memmove stand-in (no CUDA)"
    return f"one cuMemcpyBatchAsync over prebuilt arrays ({env.driver_note})"


def prepare_batch(case: TransferCase, env: Env, num_ctas: int | None = None) -> Prepared:
    """One cuMemcpyBatchAsync with every (src, dst, size) descriptor, srcAccessOrder=STREAM, preferring overlap with
    compute: the library's copy-engine path, uncoalesced, its call built once."""
    batch = batch_issuer(case.device, env, FLAG_PREFER_OVERLAP_WITH_COMPUTE)
    call = batch.call(*case.descriptors(), case.store, env.stream_handle)
    if not env.cuda:
        run = lambda batch=batch: call()  # noqa: E731 - the default argument keeps the stand-in's callback alive
        return Prepared(run, case.host_ids, batch_impl(env), True)
    return Prepared(call, case.host_ids, batch_impl(env))


def batch_engine(target: OffloadTarget, num_ctas: int | None) -> TrackedEngine:
    """The library's copy-engine issuer with ``coalesce=False`` (descriptors built per call, one per run and block)
    behind the worker API."""
    if target.env.cuda and target.env.driver is None:
        raise Unavailable(f"needs the CUDA driver: {target.env.driver_note}")
    return TrackedEngine(target, DmaIssuer(target.kv, target.host_buffer, 1, coalesce=False), "memcpy_batch")
