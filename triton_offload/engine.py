"""Worker-side transfer engine: each store or load is one kernel launch on a side stream, polled for completion.

On CUDA, stores and loads each have their own stream, so a long store never delays a load; streams, timing events
and id buffers are pooled (no device allocation or synchronisation per call). Without CUDA the same API runs each
transfer synchronously through the interpreter-mode kernels. The engine is not thread-safe: one worker thread
submits and polls.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from numbers import Integral

import torch

from triton_offload._checks import int_in_range, transfer_path
from triton_offload.cuda_driver import CudaError
from triton_offload.dma import DmaCopier
from triton_offload.fast_launch import DIRECT, enable_fast_launch, fast_launch_default
from triton_offload.kernels.copy_blocks import CopyLauncher, TransferPlan
from triton_offload.layouts import KVCacheSpec
from triton_offload.path_choice import AUTO, DMA, KERNEL, Calibration, calibrate
from triton_offload.staging import IdSlot, IdStager
from triton_offload.transfer import BlockIds, TransferPlanner, check_host_buffer

__all__ = ["TransferEngine", "JobResult", "TransferResult", "STORE", "LOAD"]

logger = logging.getLogger(__name__)

STORE, LOAD = "store", "load"


@dataclass(frozen=True)
class JobResult:
    """A finished job. ``seconds`` is GPU time between the launch's events (wall time on CPU); ``path`` is how it
    moved: ``"kernel"`` (one Triton launch) or ``"dma"`` (one cuMemcpyBatchAsync)."""

    job_id: int
    ok: bool
    direction: str
    num_bytes: int
    seconds: float
    error: str | None = None
    path: str = KERNEL


# The 0.1 name; vLLM's connector API has its own ``TransferResult``, which the plugin imports next to this one.
TransferResult = JobResult


@dataclass
class _Job:
    job_id: int
    direction: str
    num_bytes: int
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None
    ids: IdSlot | None = None
    path: str = KERNEL
    keep: object = None  # the copy-engine path's descriptor arrays, which the driver reads until the job is done
    result: JobResult | None = None


class TransferEngine:
    """Runs stores (GPU -> host) and loads (host -> GPU) of one worker's KV caches asynchronously.

    Args:
        kv: the worker's prepared KV caches.
        host_buffer: the packed host buffer, (num_host_blocks, kv.host_block_bytes(blocks_per_host_block)); pinned
            on CUDA (see :class:`triton_offload.host_cache.HostCache`).
        blocks_per_host_block: GPU blocks per host block (f).
        num_ctas: programs each launch may occupy; None for the kernel's default.
        fast_launch: launch the kernel's compiled variant directly, past Triton's per-call dispatch, where a canary
            transfer at creation proves it moves the same bytes (:mod:`triton_offload.fast_launch`); None follows
            ``TRITON_OFFLOAD_FAST_LAUNCH`` (on unless it is ``0``). ``launch_paths`` says what each direction uses.
        path: how transfers move: ``"kernel"`` (the Triton kernel), ``"dma"`` (one ``cuMemcpyBatchAsync`` of
            coalesced descriptors, :mod:`triton_offload.dma`) or ``"auto"`` (per call, the one a calibration made now
            predicts faster, :mod:`triton_offload.path_choice`). None: ``"auto"`` on CUDA, ``"kernel"`` on CPU.
        calibration: for ``"auto"``, use this :class:`~triton_offload.path_choice.Calibration` instead of measuring
            one (required on CPU, where nothing can be measured).

    Raises:
        ValueError: a bad argument, ``"dma"`` where the driver has no ``cuMemcpyBatchAsync``, or ``"auto"`` on CPU
            without a calibration.
    """

    def __init__(
        self,
        kv: KVCacheSpec,
        host_buffer: torch.Tensor,
        *,
        blocks_per_host_block: int = 1,
        num_ctas: int | None = None,
        fast_launch: bool | None = None,
        path: str | None = None,
        calibration: Calibration | None = None,
    ):
        self.kv = kv
        self.host_buffer = host_buffer
        # Fixed for the engine's life, so checked once here; a job then checks only its ids.
        self.blocks_per_host_block = int_in_range(blocks_per_host_block, "blocks_per_host_block", 1)
        check_host_buffer(kv, host_buffer, self.blocks_per_host_block)
        self.num_ctas = None if num_ctas is None else int_in_range(num_ctas, "num_ctas", 1)
        self.cuda = kv.device.type == "cuda"
        self._planner = TransferPlanner(kv, host_buffer.shape[0], self.blocks_per_host_block)
        self._pending: dict[str, collections.deque[_Job]] = {STORE: collections.deque(), LOAD: collections.deque()}
        # Ids submitted and not yet reported: a second job under one of them would report two results with one id.
        self._pending_ids: set[int] = set()
        self._done: list[JobResult] = []
        self._first_error: BaseException | None = None
        self._closed = False
        # Test and profiling hook: trace(step) is called at each step of a submission (bench/call_cost.py).
        self.trace = None
        # The kernel's segment tables and launch shapes are built now, on the caller's stream and synchronously,
        # rather than by the first job on whichever side stream it runs: the other stream would read them unordered.
        self._launcher = CopyLauncher(kv, host_buffer, self.blocks_per_host_block)
        # How each direction launches: directly, once a canary transfer proved it (triton_offload/fast_launch.py),
        # or through Triton's dispatch, and why.
        if fast_launch is None:
            fast_launch = fast_launch_default()
        if fast_launch:
            verdicts = enable_fast_launch(self._launcher, self.num_ctas)
        else:
            verdicts = {store: "turned off" for store in self._launcher.directions}
        self.launch_paths = {STORE if store else LOAD: v for store, v in verdicts.items()}
        logger.info(
            "triton-offload engine: store launches %s, load launches %s",
            *(("direct" if v == DIRECT else f"through Triton's dispatch ({v})") for v in self.launch_paths.values()),
        )
        self.path = transfer_path(path if path is not None else AUTO if self.cuda else KERNEL)
        self._dma = self._copy_engines() if self.path != KERNEL else None
        self.calibration = None
        if self.path == AUTO:
            if calibration is None:
                if not self.cuda:
                    raise ValueError(
                        "transfer path 'auto' calibrates both paths on the GPU: on CPU choose 'kernel' or 'dma', or "
                        "pass a calibration"
                    )
                calibration = calibrate(self._launcher, self.blocks_per_host_block, self.num_ctas)
            self.calibration = calibration
            logger.info(
                "triton-offload engine: transfer path auto, calibrated in %.3f s: %s",
                calibration.seconds,
                calibration.describe(),
            )
        if self.cuda:
            # Chosen once here: a store stream and a load stream, so loads (on the critical path of a request
            # waiting for its prefix) never queue behind a long store.
            self._streams = {STORE: torch.cuda.Stream(kv.device), LOAD: torch.cuda.Stream(kv.device)}
            # One event per direction marks the compute stream at submission; a wait enqueued on it keeps the point
            # it was enqueued at, so the event is recorded again by the next submission at no risk.
            self._fences = {STORE: torch.cuda.Event(), LOAD: torch.cuda.Event()}
            self._events: list[torch.cuda.Event] = []
            # Id staging per direction, allocated on its side stream: if a job fails and its slot is dropped, the
            # caching allocator hands that memory out again only in that stream's order, after the queued copy.
            self._stagers = {d: IdStager(kv.device, self._streams[d]) for d in (STORE, LOAD)}

    def _copy_engines(self) -> DmaCopier | None:
        """The copy-engine path, or None (with ``path="auto"``: every call takes the kernel) when the driver cannot."""
        try:
            return DmaCopier(self.kv, self.host_buffer, self.blocks_per_host_block)
        except CudaError as e:
            if self.path == DMA:
                raise ValueError(f"transfer path 'dma' needs cuMemcpyBatchAsync (CUDA >= 12.8): {e}") from e
            logger.warning("triton-offload engine: no copy-engine path (%s): 'auto' takes the kernel for every call", e)
            return None

    # -- submission ---------------------------------------------------------------------------------------------
    def submit_store(
        self, job_id: int, gpu_block_ids: BlockIds, host_block_ids: BlockIds, *, skip=0, group_sizes=None
    ) -> None:
        """Queues a copy of GPU blocks into host blocks (position ``skip + i`` for GPU block i).

        With KV-cache groups, ids are concatenated group by group, ``group_sizes`` gives the GPU ids per group and
        ``skip`` may be one per group (see :func:`triton_offload.transfer.plan_transfer`). Bad input raises here,
        before anything is queued, a ``job_id`` still pending (submitted, its result not yet returned by
        :meth:`get_finished`) included.
        """
        self._submit(job_id, STORE, gpu_block_ids, host_block_ids, skip, group_sizes)

    def submit_load(
        self, job_id: int, gpu_block_ids: BlockIds, host_block_ids: BlockIds, *, skip=0, group_sizes=None
    ) -> None:
        """Queues a copy of host blocks into GPU blocks; arguments as :meth:`submit_store`."""
        self._submit(job_id, LOAD, gpu_block_ids, host_block_ids, skip, group_sizes)

    def _submit(self, job_id, direction, gpu_block_ids, host_block_ids, skip, group_sizes) -> None:
        if self._closed:
            raise RuntimeError("the transfer engine is shut down")
        if type(job_id) is not int and (isinstance(job_id, bool) or not isinstance(job_id, Integral)):
            raise TypeError(f"job_id must be an int, got {type(job_id).__name__} {job_id!r}")
        if job_id in self._pending_ids:
            raise ValueError(
                f"job_id = {job_id} is still pending (submitted, not yet reported by get_finished): a job id may be "
                "reused only once its result has been reported"
            )
        trace = self.trace
        if trace is not None:
            trace("submit")
        # Bad input is the caller's bug: raise now, before anything is queued, rather than report a failed job.
        kw = dict(skip=skip, store=direction == STORE, group_sizes=group_sizes)
        if self.cuda:  # the ids are packed straight into a pinned slot
            plan, slot = self._stagers[direction].staged(
                lambda stage: self._planner.plan(gpu_block_ids, host_block_ids, **kw, stage=stage)
            )
        else:
            plan, slot = self._planner.plan(gpu_block_ids, host_block_ids, **kw), None
        if trace is not None:
            trace("plan")
        path = self.path
        if path == AUTO:
            store = direction == STORE
            path = self.calibration.choose(store, plan.num_bytes, self._dma.count(plan)) if self._dma else KERNEL
        job = _Job(job_id, direction, plan.num_bytes, path=path)
        if plan.n_blocks == 0:
            job.result = JobResult(job_id, True, direction, 0, 0.0, path=path)
            if slot is not None:
                self._stagers[direction].give_back(slot)
        elif self.cuda:
            self._launch_cuda(job, plan, slot)
        else:
            self._run_cpu(job, plan)
        self._pending[direction].append(job)
        self._pending_ids.add(job_id)
        if trace is not None:
            trace("done")

    def _run_cpu(self, job: _Job, plan: TransferPlan) -> None:
        t0 = time.perf_counter()
        try:
            if job.path == DMA:
                self._dma.issue(plan)  # the descriptors replayed by memmove, now
            else:
                self._launcher.launch(plan, torch.from_numpy(plan.ids), self.num_ctas)
            seconds = time.perf_counter() - t0
            job.result = JobResult(job.job_id, True, job.direction, job.num_bytes, seconds, path=job.path)
        except Exception as e:  # reported as a failed job; shutdown re-raises the first
            self._fail(job, e)

    def _launch_cuda(self, job: _Job, plan: TransferPlan, slot: IdSlot) -> None:
        trace = self.trace
        stream = self._streams[job.direction]
        fence = self._fences[job.direction]
        # The copy engines read descriptors built from the ids on the host: no ids to upload, no slot to hold.
        job.ids = None if job.path == DMA else slot
        job.start, job.end = self._take_event(), self._take_event()
        try:
            # Both directions wait for the compute stream as it is at submission: a store reads KV the model may
            # still be writing; a load overwrites blocks the model (or the allocator's previous owner) last wrote
            # there. Earlier transfers of the same direction are ordered by their stream, so they also complete
            # in submission order. Stores and loads are not ordered against each other: the connector only loads
            # into blocks no store is reading (vLLM keeps a block allocated until its store completes), and a host
            # block is only loaded after its store completed (the manager's complete_store).
            fence.record(torch.cuda.current_stream(self.kv.device))
            stream.wait_event(fence)
            if trace is not None:
                trace("fence")
            if job.path == DMA:
                job.start.record(stream)
                job.keep = self._dma.issue(plan, stream.cuda_stream)
                job.end.record(stream)
                # The plan's ids live in the slot: it goes back only once the descriptors have been built from them.
                self._stagers[job.direction].give_back(slot)
                return
            # The start event precedes the id upload: a kernel job is timed from the same point as a copy-engine job
            # (whose descriptors need no upload), so their seconds compare.
            job.start.record(stream)
            with torch.cuda.stream(stream):
                # The slot is pinned, so this copy is truly asynchronous; it is not reused until the job's end event
                # has completed.
                ids = slot.upload(plan.ids.size)
                if trace is not None:
                    trace("upload")
                self._launcher.launch(plan, ids, self.num_ctas)
                if trace is not None:
                    trace("launch")
                job.end.record(stream)
        except Exception as e:
            self._fail(job, e)

    def _take_event(self) -> torch.cuda.Event:
        return self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)

    def _release(self, job: _Job) -> None:
        if job.ids is not None:
            self._stagers[job.direction].give_back(job.ids)
        for ev in (job.start, job.end):
            if ev is not None:
                self._events.append(ev)
        job.ids = job.start = job.end = job.keep = None

    def _fail(self, job: _Job, error: BaseException) -> None:
        logger.error("transfer job %s (%s) failed: %s", job.job_id, job.direction, error)
        if self._first_error is None:
            self._first_error = error
        job.result = JobResult(job.job_id, False, job.direction, job.num_bytes, 0.0, repr(error), job.path)
        # Its buffers may still be referenced by work already queued on the stream: do not recycle them.
        job.ids = job.start = job.end = None

    # -- completion ---------------------------------------------------------------------------------------------
    def _poll(self, job: _Job, block: bool) -> bool:
        """True once the job has a result. Never blocks unless ``block``."""
        if job.result is not None:
            return True
        try:
            if block:
                job.end.synchronize()
            elif not job.end.query():
                return False
            seconds = job.start.elapsed_time(job.end) / 1e3
            job.result = JobResult(job.job_id, True, job.direction, job.num_bytes, seconds, path=job.path)
            self._release(job)
        except Exception as e:  # a CUDA error surfaces here: fail the job instead of hanging
            self._fail(job, e)
        return True

    def get_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call, each reported once, without blocking."""
        out, self._done = self._done, []
        for queue in self._pending.values():
            # FIFO per direction: the stream completes jobs in order, so the first unfinished one ends the scan.
            while queue and self._poll(queue[0], block=False):
                out.append(queue.popleft().result)
        self._pending_ids.difference_update(r.job_id for r in out)
        return out

    def wait(self, job_ids) -> None:
        """Blocks until the given jobs are finished; unknown or already reported ids are ignored."""
        wanted = set(job_ids)
        for queue in self._pending.values():
            for job in list(queue):
                if job.job_id in wanted:
                    self._poll(job, block=True)

    @property
    def num_pending(self) -> int:
        return sum(len(q) for q in self._pending.values())

    def shutdown(self) -> list[JobResult]:
        """Drains every job, then re-raises the first error any job hit. Returns the results not yet reported."""
        if not self._closed:
            self._closed = True
            for queue in self._pending.values():
                for job in queue:
                    self._poll(job, block=True)
                self._done.extend(job.result for job in queue)
                queue.clear()
            self._pending_ids.clear()
        if self._first_error is not None:
            error, self._first_error = self._first_error, None
            raise RuntimeError("a KV transfer failed") from error
        out, self._done = self._done, []
        return out
