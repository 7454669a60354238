"""The offload paths the serving benchmark compares, each behind the worker API of
:class:`triton_offload.engine.TransferEngine` (``submit_store`` / ``submit_load`` with GPU and host block ids,
``get_finished``, ``wait``, ``shutdown``), looked up by exact name in :data:`METHODS`.

``triton`` is the engine itself, as the vLLM plugin's worker builds it. ``vllm033`` and ``dma`` are
:class:`BatchEngine`: like vLLM's own CPU offloading worker, they turn the block ids of every call into copy
descriptors (vectorised NumPy over the KV caches' runs) and issue them on a stream per direction that first waits for
the compute stream: ``vllm033`` stores with one ``cuMemcpyBatchAsync`` and loads small pages with its SM copy
(``sm_copy.py``), its other loads with one ``cuMemcpyBatchAsync`` whose source access order is ``ANY``, as vLLM's
``swap_blocks_batch`` passes for loads; ``dma`` uses ``cuMemcpyBatchAsync`` both ways, in stream order. Without CUDA
the batch calls go to a memmove stand-in for the driver and the SM copy runs under the Triton interpreter,
synchronously.

A method is added with one entry: a builder ``(target, num_ctas) -> engine`` and a description. ``none`` builds no
engine: the loop then runs without offload traffic.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from triton_offload.cuda_driver import MemcpyBatchCall, batch_attributes
from triton_offload.engine import LOAD, STORE, JobResult, TransferEngine
from triton_offload.host_cache import HostCache, checksum_table
from triton_offload.kernels.copy_blocks import DEFAULT_NUM_CTAS
from triton_offload.layouts import KVCacheSpec

# isort: split
# Sibling modules: bench/ is on sys.path when this runs as a script (it is not a package).
from case import Env, copy_plan, runs_of
from cuda_driver import FLAG_DEFAULT, FLAG_PREFER_OVERLAP_WITH_COMPUTE, SRC_ACCESS_ORDER_ANY, BatchIssuer
from sm_copy import SmCopy, uses_sm_copy
from verify import SENTINEL
from vllm_native import PackedHostView, open_native_worker  # imports vLLM only when a worker is opened

__all__ = [
    "OffloadTarget",
    "BatchEngine",
    "Method",
    "METHODS",
    "MethodPoint",
    "method_points",
    "build_engine",
    "triton_engine",
    "auto_engine",
    "NativeEngine",
]


@dataclass
class OffloadTarget:
    """What every method moves blocks between: one worker's KV caches and its host cache.

    Attributes:
        kv: the prepared KV caches.
        host_cache: the pinned (on CUDA) packed host buffer, one GPU block per host block.
        env: the machine (the CUDA driver for the batch methods).
    """

    kv: KVCacheSpec
    host_cache: HostCache
    env: Env

    @property
    def host_buffer(self) -> torch.Tensor:
        return self.host_cache.buffer


@dataclass
class _Job:
    job_id: int
    direction: str
    num_bytes: int
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None
    keep: object = None  # descriptors the queued copies still read, held until they are done
    result: JobResult | None = None


class BatchEngine:
    """Copy-engine (and vLLM 0.33's SM copy) transfers behind TransferEngine's API, descriptors built per call.

    Args:
        target: the caches and host buffer.
        sm_copy_loads: load with the SM copy where vLLM 0.33 does (every page < 28 KiB, 8-byte aligned, >= 16
            descriptors); else every transfer is one cuMemcpyBatchAsync.
        flags: the CUmemcpyAttributes flags of the batches.
        name: how the output names it.
        load_order_any: a batch load reads its source in any order (``srcAccessOrder = ANY``), as vLLM 0.33's
            ``swap_blocks_batch`` does for loads (``SingleDirectionOffloadingHandler.transfer_async``:
            ``is_src_access_order_any = not self.gpu_to_cpu``: host memory no GPU stream writes meanwhile); else in
            stream order, as every store.
    """

    def __init__(self, target: OffloadTarget, *, sm_copy_loads: bool, flags: int, name: str,
                 load_order_any: bool = False):  # fmt: skip
        self.kv, self.host, self.env = target.kv, target.host_buffer, target.env
        self.sm_copy_loads, self.name = sm_copy_loads, name
        self.runs = runs_of(self.kv)
        self.cuda = self.kv.device.type == "cuda"
        if self.cuda:
            if self.env.driver is None:
                raise RuntimeError(f"{name} needs the CUDA driver: {self.env.driver_note}")
            self._streams = {STORE: torch.cuda.Stream(self.kv.device), LOAD: torch.cuda.Stream(self.kv.device)}
        self._batch = BatchIssuer(self.kv.device, flags, self.env.driver)  # the entry point resolved once
        # The loads' one attribute entry when they read in any order (the issuer's entries read in stream order).
        self._load_attrs = None
        if load_order_any:
            self._load_attrs = batch_attributes(False, self.kv.device.index or 0, flags)
            self._load_attrs.srcAccessOrder = SRC_ACCESS_ORDER_ANY
        self._pending: dict[str, collections.deque[_Job]] = {STORE: collections.deque(), LOAD: collections.deque()}
        self.paths: set[str] = set()  # what it issued: "batch store", "SM copy load", ...

    @property
    def impl(self) -> str:
        where = "" if self.cuda else " (no CUDA: batches run by a memmove stand-in, the SM copy by the interpreter)"
        return f"{self.name}: {', '.join(sorted(self.paths)) or 'nothing issued'}; descriptors built per call{where}"

    def submit_store(self, job_id: int, gpu_block_ids, host_block_ids) -> None:
        """Queues copies of GPU blocks into host blocks (block i -> host block i), after the current stream's work."""
        self._submit(job_id, True, gpu_block_ids, host_block_ids)

    def submit_load(self, job_id: int, gpu_block_ids, host_block_ids) -> None:
        """Queues copies of host blocks into GPU blocks, after the current stream's work."""
        self._submit(job_id, False, gpu_block_ids, host_block_ids)

    def _op(self, store: bool, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: int):
        if self.sm_copy_loads and uses_sm_copy(store, src, dst, sizes):
            self.paths.add("SM copy load")
            return SmCopy(src, dst, sizes, self.kv.device)
        if not store and self._load_attrs is not None:
            self.paths.add("cuMemcpyBatchAsync load (source order ANY)")
            b = self._batch
            return MemcpyBatchCall(b.address, b.with_fail_idx, src, dst, sizes, self._load_attrs, stream)
        self.paths.add(f"cuMemcpyBatchAsync {'store' if store else 'load'}")
        return self._batch.call(src, dst, sizes, store, stream)

    def _submit(self, job_id: int, store: bool, gpu_block_ids, host_block_ids) -> None:
        g = np.asarray(gpu_block_ids, dtype=np.int64)
        h = np.asarray(host_block_ids, dtype=np.int64)
        # As vLLM's worker does it: descriptors from this call's ids, every call.
        src, dst, sizes = copy_plan(self.runs, self.host, g, h, f=1, skip=0, store=store)
        job = _Job(job_id, STORE if store else LOAD, int(sizes.sum()))
        if not self.cuda:
            t0 = time.perf_counter()
            self._op(store, src, dst, sizes, 0)()
            job.result = JobResult(job_id, True, job.direction, job.num_bytes, time.perf_counter() - t0)
        else:
            stream = self._streams[job.direction]
            # Both directions wait for the compute stream as it is now: a store reads KV the model is writing, a load
            # overwrites blocks the model last used. Jobs of one direction complete in order on its stream.
            stream.wait_stream(torch.cuda.current_stream(self.kv.device))
            with torch.cuda.stream(stream):  # the SM copy's device descriptors belong to this stream
                op = self._op(store, src, dst, sizes, stream.cuda_stream)
                job.start, job.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                job.start.record(stream)
                op()
                job.end.record(stream)
            job.keep = op
        self._pending[job.direction].append(job)

    def _poll(self, job: _Job, block: bool) -> bool:
        if job.result is not None:
            return True
        if block:
            job.end.synchronize()
        elif not job.end.query():
            return False
        seconds = job.start.elapsed_time(job.end) / 1e3
        job.result = JobResult(job.job_id, True, job.direction, job.num_bytes, seconds)
        job.keep = job.start = job.end = None
        return True

    def get_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call, each once, without blocking (FIFO per direction)."""
        out = []
        for queue in self._pending.values():
            while queue and self._poll(queue[0], block=False):
                out.append(queue.popleft().result)
        return out

    def wait(self, job_ids) -> None:
        """Blocks until the given jobs are finished; unknown ids are ignored."""
        wanted = set(job_ids)
        for queue in self._pending.values():
            for job in queue:
                if job.job_id in wanted:
                    self._poll(job, block=True)

    def shutdown(self) -> list[JobResult]:
        """Waits for every job; returns the results not yet reported."""
        out = []
        for queue in self._pending.values():
            for job in queue:
                self._poll(job, block=True)
                out.append(job.result)
            queue.clear()
        return out


class NativeEngine:
    """vLLM 0.33's own ``CPUOffloadingWorker`` (:class:`vllm_native.NativeWorker`: vLLM's descriptor building, streams
    and Triton load kernel, its one compiled op replaced by the same ``cuMemcpyBatchAsync`` through ctypes) behind
    TransferEngine's worker API, over the same KV caches: one canonical tensor per run, one GPU block per chunk.

    vLLM's host region has its own layout (a tensor per run), so the host cache's bytes (the cached prefixes) are
    mirrored into it once, when the engine is made, and each run starts with the store ring's rows set to the sentinel
    in it as in the host cache (:meth:`begin_run`, outside the measured steps); the loop's checks read the host blocks
    from vLLM's region (:meth:`host_rows`).

    Raises:
        Unavailable: vLLM 0.33.0's code cannot be imported here (the bundle is not built), or no CUDA driver.
    """

    def __init__(self, target: OffloadTarget):
        host = target.host_buffer
        self.worker = open_native_worker([r.view for r in runs_of(target.kv)], 1, host.shape[0], target.env)
        self.region = PackedHostView(self.worker.host_views, 1)
        self.host, self.bytes_per_block = host, target.kv.bytes_per_block
        self.impl = f"vllm_native: vLLM's own worker ({self.worker.vllm.where}), swap_blocks_batch -> {self.worker.op}"
        self.region.copy_(host)  # the cached prefixes (the store ring is reset by begin_run)
        self._jobs: dict[int, tuple[int, str, int]] = {}  # vLLM's job id -> (ours, direction, bytes)
        self._done: list[JobResult] = []

    def begin_run(self, ring_rows: int) -> None:
        """A run starts: the first ``ring_rows`` rows (the store ring) of vLLM's region hold the sentinel, as the
        loop reset the host cache's."""
        for part in self.region.parts:
            part[:ring_rows].fill_(SENTINEL)

    def host_rows(self, host_ids) -> torch.Tensor:
        """(n, bytes_per_block) uint8: packed host blocks ``host_ids`` as vLLM's region holds them."""
        ids = torch.from_numpy(np.asarray(host_ids, dtype=np.int64))
        return torch.cat([part.index_select(0, ids) for part in self.region.parts], dim=1)

    def _submit(self, job_id: int, store: bool, gpu_ids, host_ids) -> None:
        n = int(np.asarray(gpu_ids).size)
        native = self.worker.submit_store(gpu_ids, host_ids) if store else self.worker.submit_load(host_ids, gpu_ids)
        self._jobs[native] = (job_id, STORE if store else LOAD, n * self.bytes_per_block)

    def submit_store(self, job_id: int, gpu_block_ids, host_block_ids) -> None:
        self._submit(job_id, True, gpu_block_ids, host_block_ids)

    def submit_load(self, job_id: int, gpu_block_ids, host_block_ids) -> None:
        self._submit(job_id, False, gpu_block_ids, host_block_ids)

    def _results(self, finished) -> list[JobResult]:
        out = []
        for r in finished:
            job_id, direction, nbytes = self._jobs.pop(r.job_id)
            out.append(JobResult(job_id, bool(r.success), direction, nbytes, float(r.transfer_time or 0.0)))
        return out

    def get_finished(self) -> list[JobResult]:
        out, self._done = self._done + self._results(self.worker.poll()), []
        return out

    def wait(self, job_ids) -> None:
        wanted = set(job_ids)
        native = [n for n, (ours, _, _) in self._jobs.items() if ours in wanted]
        if native:
            self._done += self._results(self.worker.wait(native))

    def shutdown(self) -> list[JobResult]:
        out = self.get_finished()
        self.wait([ours for ours, _, _ in self._jobs.values()])
        out += self.get_finished()
        self.worker.shutdown()
        return out


@dataclass(frozen=True)
class Method:
    """One row label's way of moving blocks.

    Attributes:
        build: ``(target, num_ctas) -> engine`` with TransferEngine's worker API, or None (no offload traffic).
        describe: what it is, for the methods table and the rows' ``impl``.
        sweeps_ctas: runs at the default num_ctas and at each of the loop's other num_ctas.
    """

    build: Callable[[OffloadTarget, int | None], object | None]
    describe: str
    sweeps_ctas: bool = False


def triton_engine(target: OffloadTarget, num_ctas: int | None, **engine_args) -> TransferEngine:
    """Ours, as the plugin's worker builds it; the default num_ctas is passed as None, the way a user runs it.
    ``engine_args`` go to TransferEngine as they are (``path``)."""
    ctas = None if num_ctas == DEFAULT_NUM_CTAS else num_ctas
    return TransferEngine(target.kv, target.host_buffer, num_ctas=ctas, **engine_args)


def auto_engine(target: OffloadTarget, num_ctas: int | None) -> TransferEngine:
    """The engine as a user gets it on CUDA: ``path="auto"``, calibrated at creation. Without CUDA nothing can be
    calibrated, so the engine's copy-engine path (auto's other half; the kernel is the ``triton`` row) runs, its
    descriptors replayed by memmove, and is byte-checked like every method."""
    path = "auto" if target.kv.device.type == "cuda" else "dma"
    return triton_engine(target, num_ctas, path=path)


# Methods by exact name.
METHODS: dict[str, Method] = {
    "none": Method(lambda target, _: None, "no offload traffic: the model's steps alone"),
    "triton": Method(
        lambda target, num_ctas: triton_engine(target, num_ctas, path="kernel"),
        "TransferEngine(path='kernel'): one Triton launch per transfer on its store / load stream",
        sweeps_ctas=True,
    ),
    "auto": Method(
        auto_engine,
        "TransferEngine(path='auto'), the default on CUDA: per transfer the faster of our kernel and one "
        "cuMemcpyBatchAsync of coalesced descriptors, from the calibration the engine makes at creation",
    ),
    "vllm033": Method(
        lambda target, _: BatchEngine(
            target, sm_copy_loads=True, flags=FLAG_DEFAULT, name="vllm033", load_order_any=True
        ),
        "vLLM 0.33's policy: stores one cuMemcpyBatchAsync (source order STREAM); loads of pages < 28 KiB its SM "
        "copy (12 programs), others one cuMemcpyBatchAsync (source order ANY); descriptors built per call from the "
        "block ids",
    ),
    "vllm_native": Method(
        lambda target, _: NativeEngine(target),
        "vLLM 0.33's own CPUOffloadingWorker (bench/vllm_native.py), its swap_blocks_batch op the same "
        "cuMemcpyBatchAsync through ctypes; n/a where vLLM 0.33's code is not importable (./dev gpu-bundle)",
    ),
    "dma": Method(
        lambda target, _: BatchEngine(target, sm_copy_loads=False, flags=FLAG_PREFER_OVERLAP_WITH_COMPUTE, name="dma"),
        "cuMemcpyBatchAsync both ways (PREFER_OVERLAP_WITH_COMPUTE); descriptors built per call from the block ids",
    ),
    # The integrity checks' cost (issue 41, docs/integrity.md): `triton` with them; selected by serving.py
    # --integrity (or --methods).
    "triton_integrity": Method(
        lambda target, num_ctas: triton_engine(
            target,
            num_ctas,
            path="kernel",
            integrity="verify",
            checksums=checksum_table(target.host_buffer.shape[0], 1, pin=target.kv.device.type == "cuda"),
        ),
        "TransferEngine(path='kernel', integrity='verify'): the triton row with the integrity checks fused into "
        "its launches (a checksum per block written by stores, checked by loads)",
    ),
}


@dataclass(frozen=True)
class MethodPoint:
    """One row of a workload: a method, and for a ctas-sweeping method its num_ctas."""

    method: str
    num_ctas: int | None = None

    @property
    def label(self) -> str:
        return self.method if self.num_ctas is None else f"{self.method}@{self.num_ctas}"


def method_points(names, ctas: tuple[int, ...]) -> list[MethodPoint]:
    """Each method by exact name, a ctas-sweeping one at the default num_ctas and then at each of ``ctas``.

    Raises:
        ValueError: an unknown name (the supported ones are listed).
    """
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; supported: {sorted(METHODS)}")
    points = []
    for name in names:
        if METHODS[name].sweeps_ctas:
            sweep = [DEFAULT_NUM_CTAS, *sorted(set(ctas) - {DEFAULT_NUM_CTAS})]
            points += [MethodPoint(name, c) for c in sweep]
        else:
            points.append(MethodPoint(name))
    return points


def build_engine(point: MethodPoint, target: OffloadTarget):
    """The engine of one point (None for ``none``)."""
    return METHODS[point.method].build(target, point.num_ctas)
