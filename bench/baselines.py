"""The transfer methods the benchmark compares, behind one interface: ``prepare(case, env) -> Prepared``, looked up by
exact name in :data:`METHODS`.

The copy-engine baselines issue their copies from compiled code over descriptor arrays built in ``prepare``, as a C++
caller would: ``memcpy_batch`` and ``vllm033``'s batches call the driver's ``cuMemcpyBatchAsync`` through ctypes,
``memcpy_per_block`` loops over ``cudaMemcpyAsync`` in a helper built at benchmark time. Without CUDA, their calls are
replayed on host memory (a memmove stand-in for the driver, or a memmove of the same copy plan), so the CPU check
still verifies the bytes their descriptors address.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np
import torch

import triton_offload as to
from triton_offload.calibrate import calibrate, path_issuers
from triton_offload.dma import DmaIssuer
from triton_offload.fast_launch import enable_fast_launch
from triton_offload.host_cache import checksum_table
from triton_offload.kernel_issuer import CopyLauncher, KernelIssuer
from triton_offload.path_choice import DMA, KERNEL, Calibration
from triton_offload.plan import Direction, TransferPlanner
from triton_offload.staging import IdStager

# isort: split
# Sibling modules: bench/ is on sys.path when this runs as a script (it is not a package).
from case import Env, Prepared, TransferCase, Unavailable, memmove_replay
from copy_loop import PYTHON_ISSUED, BuildFailed, CompiledCopyLoop, build_copy_loop
from cuda_driver import FLAG_DEFAULT, FLAG_PREFER_OVERLAP_WITH_COMPUTE, BatchIssuer, CudaError
from grid import NATIVE_WARM_DEPTH
from sm_copy import SmCopy, uses_sm_copy
from vllm_native import VLLM_VERSION, NativeWorker, PackedHostView, open_native_worker

__all__ = [
    "METHODS",
    "Triton",
    "TritonIntegrity",
    "Auto",
    "MemcpyPerBlock",
    "MemcpyBatch",
    "TorchStaged",
    "Vllm033",
    "VllmNative",
    "Peak",
    "issue_each",
]


class Triton:
    """Ours: one launch of triton_offload.gather_blocks / scatter_blocks for all blocks and layers."""

    def __init__(self, num_ctas: int | None = None):
        self.num_ctas = num_ctas

    def prepare(self, case: TransferCase, env: Env) -> Prepared:
        spec, host, g, h = case.spec, case.host, case.gpu_ids, case.host_ids
        kw = dict(blocks_per_host_block=case.f, skip=case.skip, num_ctas=self.num_ctas)
        if case.store:
            run = lambda: to.gather_blocks(spec, g, host, h, **kw)
        else:
            run = lambda: to.scatter_blocks(host, h, spec, g, **kw)
        where = "compiled kernel" if env.cuda else "Triton interpreter"
        return Prepared(run, h, f"triton_offload.{'gather' if case.store else 'scatter'}_blocks ({where})")


class TritonIntegrity:
    """Ours with the integrity checks (docs/integrity.md; ``--integrity``): the kernel path as the engine issues it
    with ``integrity="verify"``, per call a plan, the ids and identities packed into a pinned slot and uploaded, one
    launch that copies and checksums (its last program writing a store's checksums into the table, or checking a
    load's), the slot handed back behind an event. Compare with ``triton`` at the default num_ctas in the same run."""

    def __init__(self, num_ctas: int | None = None):
        self.num_ctas = num_ctas

    def prepare(self, case: TransferCase, env: Env) -> Prepared:
        direction = Direction.STORE if case.store else Direction.LOAD
        table = checksum_table(case.host.shape[0], case.f, pin=env.cuda)
        launcher = CopyLauncher(case.spec, case.host, case.f, direction, checksums=table)
        if env.cuda:
            enable_fast_launch(launcher, self.num_ctas)  # the launch the engine would make (proven on a canary)
        issuer = KernelIssuer(launcher, IdStager(case.device) if env.cuda else None, self.num_ctas)
        planner = TransferPlanner(case.spec, case.host.shape[0], case.f)
        g, h, skip = case.gpu_ids, case.host_ids, case.skip

        def run() -> None:
            keep = issuer.issue(planner.plan(g, h, direction=direction, skip=skip, identities=h))
            if env.cuda:
                after = torch.cuda.Event()
                after.record()
                issuer.release(keep, after)
            else:
                issuer.release(keep)

        where = "compiled kernel" if env.cuda else "Triton interpreter"
        return Prepared(run, h, f"the kernel with the integrity checks ({where}): a launch per call, checksums fused")


_COMPILED_LOOP: list = []  # [(lib or None, why not)], built once per process


def _compiled_loop() -> tuple[object | None, str]:
    if not _COMPILED_LOOP:
        try:
            _COMPILED_LOOP.append((build_copy_loop(), ""))
        except BuildFailed as exc:
            _COMPILED_LOOP.append((None, str(exc)))
    return _COMPILED_LOOP[0]


def issue_each(plan, env: Env, lib, why_not: str = "") -> tuple[object, str]:
    """(run, impl) issuing one copy per descriptor of ``plan`` = (srcs, dsts, sizes) on the benchmark's stream: from
    the compiled helper ``lib`` when there is one, else from a Python loop over the driver's cuMemcpyAsync, labelled
    handicapped."""
    src, dst, sizes, stream = *plan, env.stream_handle
    if lib is not None:
        return CompiledCopyLoop(lib, src, dst, sizes, stream), "cudaMemcpyAsync per copy, loop in C++ (load_inline)"
    if env.driver is None:
        raise Unavailable(f"no compiled helper ({why_not}) and no CUDA driver ({env.driver_note})")
    memcpy = env.driver.memcpy_async()
    copies = list(zip(dst.tolist(), src.tolist(), sizes.tolist()))

    def run() -> None:
        for d, s, n in copies:
            err = memcpy(d, s, n, stream or None)
            if err:  # checked inline: the loop is the cost being measured
                raise CudaError(f"cuMemcpyAsync({d:#x}, {s:#x}, {n}) failed: CUresult {err}")

    return run, f"{PYTHON_ISSUED}: cuMemcpyAsync per copy from a Python loop; no compiled helper: {why_not}"


class MemcpyPerBlock:
    """The original design: one cudaMemcpyAsync per block per run (per K and per V where they are apart)."""

    def prepare(self, case: TransferCase, env: Env) -> Prepared:
        plan = case.copy_plan(case.host_ids)
        if not env.cuda:
            return Prepared(memmove_replay(*plan), case.host_ids, "memmove replay of the copy plan (no CUDA)", True)
        run, impl = issue_each(plan, env, *_compiled_loop())
        return Prepared(run, case.host_ids, impl)


def _batch(case: TransferCase, env: Env, plan, flags: int) -> Prepared:
    """One cuMemcpyBatchAsync of every descriptor in ``plan``, srcAccessOrder=STREAM, with ``flags``."""
    if env.cuda and env.driver is None:
        raise Unavailable(f"needs the CUDA driver: {env.driver_note}")
    try:
        batch = BatchIssuer(case.device, flags, env.driver)  # without CUDA, a memmove stand-in for the driver
    except CudaError as exc:
        raise Unavailable(str(exc)) from exc
    call = batch.call(*plan, case.store, env.stream_handle)
    if not env.cuda:
        run = lambda batch=batch: call()  # the default argument keeps the stand-in's callback alive
        return Prepared(run, case.host_ids, "cuMemcpyBatchAsync call, run by a memmove stand-in (no CUDA)", True)
    return Prepared(call, case.host_ids, f"one cuMemcpyBatchAsync over prebuilt arrays ({env.driver_note})")


class MemcpyBatch:
    """One cuMemcpyBatchAsync with every (src, dst, size) descriptor, preferring overlap with compute."""

    def prepare(self, case: TransferCase, env: Env) -> Prepared:
        return _batch(case, env, case.copy_plan(case.host_ids), FLAG_PREFER_OVERLAP_WITH_COMPUTE)


class Vllm033:
    """What vLLM 0.33's native offloading worker does for the same transfer, from its description (no vLLM code):
    stores are one cuMemcpyBatchAsync (srcAccessOrder=STREAM, no flags); loads of small, 8-byte-aligned pages with
    enough descriptors are an SM copy (:mod:`sm_copy`), other loads one cuMemcpyBatchAsync."""

    def prepare(self, case: TransferCase, env: Env) -> Prepared:
        plan = case.copy_plan(case.host_ids)
        if uses_sm_copy(case.store, *plan):
            where = "compiled" if env.cuda else "Triton interpreter"
            impl = f"SM copy ({where}): 12 programs, 8-byte words, <= 8 KiB steps, descriptors uploaded per call"
            return Prepared(SmCopy(*plan, case.device), case.host_ids, impl)
        prepared = _batch(case, env, plan, FLAG_DEFAULT)
        return dataclasses.replace(prepared, impl=f"batch: {prepared.impl}")


# spec -> ((f, chunks), NativeWorker): the worker of the spec's latest host format, so a case's store and load share
# one vLLM worker and its region; it goes with the spec (the workload's caches), and a new format replaces it.
_NATIVE_WORKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _native_worker(case: TransferCase, env: Env) -> NativeWorker:
    key = (case.f, case.host.shape[0])
    held = _NATIVE_WORKERS.get(case.spec)
    if held is not None and held[0] == key:
        return held[1]
    if held is not None:
        held[1].shutdown()  # frees its region before the next is allocated
    worker = open_native_worker([r.view for r in case.runs], case.f, case.host.shape[0], env)
    _NATIVE_WORKERS[case.spec] = (key, worker)
    return worker


class VllmNative:
    """vLLM 0.33's own CPUOffloadingWorker (:mod:`vllm_native`) over the case's KV tensors, one canonical tensor per
    run, with a host region of its own layout (one tensor per run) at the case's host ids: vLLM's descriptor building,
    streams and Triton load kernel, its compiled op replaced by the same cuMemcpyBatchAsync through ctypes."""

    def prepare(self, case: TransferCase, env: Env) -> Prepared:
        worker = _native_worker(case, env)
        specs = worker.transfer_specs(case.gpu_ids, case.host_ids, case.skip)  # the scheduler's side, built once
        if env.cuda:
            worker.warm(case.store, specs, NATIVE_WARM_DEPTH)  # vLLM's pools as a running engine's, before timing

        def run() -> None:
            worker.poll()  # as vLLM's connector does every step: finished jobs hand back their streams and buffers
            worker.order_after(worker.submit(case.store, specs))

        impl = f"vLLM {VLLM_VERSION}'s own worker ({worker.vllm.where}): {worker.path(case.store, case.n)}"
        return Prepared(run, case.host_ids, impl, not env.cuda, PackedHostView(worker.host_views, case.f))


class TorchStaged:
    """Gather on the GPU with index_select (per run) into one contiguous (n, bytes_per_block) staging buffer in packed
    order, then one copy_ to pinned memory; the reverse for loads (one copy_, then index_copy_ per run).

    One copy_ needs one contiguous host range, so this method is given consecutive host blocks
    (:attr:`TransferCase.contiguous_host_ids`); the others get random ones.
    """

    def prepare(self, case: TransferCase, env: Env) -> Prepared:
        n, bpb = case.n, case.bytes_per_block
        staging = case.staging[: n * bpb].view(n, bpb)
        host_region = case.contiguous_host_region()
        cols = [staging[:, r.host_offset : r.host_offset + r.nbytes] for r in case.runs]
        views = [r.view for r in case.runs]
        device = case.device
        # Uploaded on every call, from pinned memory: from pageable memory the copy may synchronise with the stream.
        ids = torch.from_numpy(np.ascontiguousarray(case.gpu_ids))
        ids = ids.pin_memory() if env.cuda else ids

        def store() -> None:
            g = ids.to(device, non_blocking=True)
            for view, col in zip(views, cols):
                torch.index_select(view, 0, g, out=col)
            host_region.copy_(staging, non_blocking=True)

        def load() -> None:
            g = ids.to(device, non_blocking=True)
            staging.copy_(host_region, non_blocking=True)
            for view, col in zip(views, cols):
                view.index_copy_(0, g, col)

        impl = "index_select / index_copy_ per run + one copy_"
        return Prepared(store if case.store else load, case.contiguous_host_ids, impl)


class Auto:
    """Ours with the per-call path choice of ``TransferEngine(path="auto")`` (triton_offload/path_choice.py): a
    calibration per spec and f (made once, timed, kept in :attr:`calibrations`), then for the case the predicted
    faster of the kernel (the public call, as ``triton``) and one ``cuMemcpyBatchAsync`` of the library's coalesced
    descriptors, planned and built per call as the engine does."""

    # spec -> {f: Calibration}: held weakly, so a workload's caches are freed when the sweep moves on.
    _calibrated: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    # What every calibration of this run measured, for the results file (outlives the specs).
    _records: list[dict] = []

    @classmethod
    def calibrations(cls) -> list[dict]:
        """What each calibration of this run measured and how long it took, for the results file."""
        return list(cls._records)

    def _calibration(self, case: TransferCase) -> Calibration:
        by_f = self._calibrated.setdefault(case.spec, {})
        cal = by_f.get(case.f)
        if cal is None:
            launcher = CopyLauncher(case.spec, case.host, case.f)
            enable_fast_launch(launcher)  # the calibration times the launch the engine would make
            cal = by_f[case.f] = calibrate(case.spec, case.f, path_issuers(launcher))
            self._records.append({"spec": repr(case.spec), "blocks_per_host_block": case.f, **cal.to_dict()})
        return cal

    def prepare(self, case: TransferCase, env: Env) -> Prepared:
        planner = TransferPlanner(case.spec, case.host.shape[0], case.f)
        g, h, skip = case.gpu_ids, case.host_ids, case.skip
        direction = Direction.STORE if case.store else Direction.LOAD
        dma = DmaIssuer(case.spec, case.host, case.f)
        kept = []  # the last call's descriptors, held until the next call (the driver reads them at submission)
        stream = torch.cuda.ExternalStream(env.stream_handle, device=env.device) if env.cuda else None

        def run_dma() -> None:
            kept[:] = [dma.issue(planner.plan(g, h, skip=skip, direction=direction), stream)]

        if not env.cuda:
            impl = "copy-engine path (triton_offload.dma) replayed with memmove: no CUDA to calibrate on"
            return Prepared(run_dma, h, impl, True)
        cal = self._calibration(case)
        plan = planner.plan(g, h, skip=skip, direction=direction)
        path = cal.choose(direction, plan.num_bytes, {KERNEL: 0, DMA: dma.descriptors(plan)})
        if path == KERNEL:
            prepared = Triton(None).prepare(case, env)
            return dataclasses.replace(prepared, impl=f"per call: {prepared.impl}")
        return Prepared(run_dma, h, f"per call: one cuMemcpyBatchAsync, descriptors built per call ({env.driver_note})")


class Peak:
    """The link's practical ceiling: one contiguous pinned copy_ of the same number of bytes."""

    def prepare(self, case: TransferCase, env: Env) -> Prepared:
        host = case.host.view(-1)[: case.total_bytes]
        dev = case.staging[: case.total_bytes]
        if case.store:
            run = lambda: host.copy_(dev, non_blocking=True)
        else:
            run = lambda: dev.copy_(host, non_blocking=True)
        return Prepared(run, None, "one contiguous copy_ (cudaMemcpyAsync)" if env.cuda else "one contiguous copy_")


# Methods by exact name; "triton" is built per num_ctas by the driver.
METHODS = {
    "triton": Triton,
    "triton_integrity": TritonIntegrity,
    "auto": Auto,
    "memcpy_per_block": MemcpyPerBlock,
    "memcpy_batch": MemcpyBatch,
    "torch_staged": TorchStaged,
    "vllm033": Vllm033,
    "vllm_native": VllmNative,
    "peak": Peak,
}
