"""Tracks asynchronous transfer jobs: a side stream per *lane*, each job fenced after the compute stream and timed
between pooled events, completion polled FIFO per lane without blocking, ``wait`` on chosen jobs, and a shutdown that
drains every job before re-raising the first error. Any :class:`~triton_offload.issuers.base.Issuer` can be tracked;
lanes are names (the engine's: stores, loads, and expedited loads). A job may also be ordered after chosen earlier jobs
of other lanes (``after``). Without CUDA a job runs synchronously at submission. Not thread-safe: one worker thread
submits and polls.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral

import torch

from triton_offload.issuers.base import Issuer
from triton_offload.plan import Direction, TransferPath

__all__ = ["JobResult", "JobTracker"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobResult:
    """A finished job.

    Attributes:
        seconds: GPU time between the job's events (wall time on CPU).
        path: how it moved: ``"kernel"`` (one Triton launch) or ``"dma"`` (one cuMemcpyBatchAsync).
        predicted: with ``path="auto"``, the seconds each path was predicted to take (the chosen one is the lowest);
            None where no choice was made.
        check: for a load with the integrity checks, what they found (positions in the job's GPU ids of the blocks
            whose checksum did not match, and of those stored without one: ``failed`` and ``absent`` of a
            :class:`~triton_offload.checksums.LoadCheck`); None otherwise. A failed check is not a failed job:
            the job moved its bytes, the caller decides what the failed blocks mean.
    """

    job_id: int
    ok: bool
    direction: Direction
    num_bytes: int
    seconds: float
    error: str | None = None
    path: TransferPath | str = TransferPath.KERNEL
    predicted: Mapping[str, float] | None = None
    check: object | None = None


@dataclass
class _Job:
    job_id: int
    direction: Direction
    num_bytes: int
    path: str
    predicted: Mapping[str, float] | None
    issuer: Issuer | None = None
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None
    keep: object = None  # what the issuer returned: buffers the queued work reads until the job is done
    result: JobResult | None = None

    def finish(self, seconds: float, error: BaseException | None = None, check=None) -> None:
        ok = error is None
        self.result = JobResult(
            self.job_id, ok, self.direction, self.num_bytes, seconds, None if ok else repr(error), self.path,
            self.predicted, check,
        )  # fmt: skip


class JobTracker:
    """Runs and tracks the jobs of one device.

    Args:
        device: where the transfers run (CUDA: side streams and events; otherwise jobs run at submission).
        lanes: the names of the side streams, one each: a lane's jobs complete in submission order, and never queue
            behind another lane's (unless a job names one in ``after``).
        name: how errors name the owner (``"the transfer engine"``).
        cuda: the CUDA API to use (``torch.cuda``; tests pass a stand-in to check the orderings on CPU).

    Lanes are not ordered against each other: two jobs of different lanes that touch the same bytes (a load into a
    GPU block a pending store still reads) must be ordered by the caller, with ``after`` or by waiting for the first
    (the transfer engine does the former for its stores and loads; vLLM does the latter, see
    :class:`~triton_offload.engine.TransferEngine`).
    """

    def __init__(self, device: torch.device, lanes: Sequence[Hashable], *, name: str = "the job tracker", cuda=None):
        self.device, self.name = device, name
        self.cuda = device.type == "cuda"
        self._pending: dict[Hashable, collections.deque[_Job]] = {lane: collections.deque() for lane in lanes}
        # Jobs submitted and not yet reported, by id: a second job under one of them would report two results with
        # one id; ``after`` finds the jobs it names here.
        self._pending_ids: dict[int, _Job] = {}
        self._done: list[JobResult] = []
        self._first_error: BaseException | None = None
        self._closed = False
        if self.cuda:
            self._api = torch.cuda if cuda is None else cuda
            self.streams = {lane: self._api.Stream(device) for lane in lanes}
            # One event per lane marks the compute stream at submission; a wait enqueued on it keeps the point it
            # was enqueued at, so the event is recorded again by the next submission at no risk.
            self._fences = {lane: self._api.Event() for lane in lanes}
            self._events: list = []

    # -- submission ---------------------------------------------------------------------------------------------
    def check_new(self, job_id) -> None:
        """Raises unless a job ``job_id`` may be submitted now (to call before any work on its behalf)."""
        if self._closed:
            raise RuntimeError(f"{self.name} is shut down")
        if type(job_id) is not int and (isinstance(job_id, bool) or not isinstance(job_id, Integral)):
            raise TypeError(f"job_id must be an int, got {type(job_id).__name__} {job_id!r}")
        if job_id in self._pending_ids:
            raise ValueError(
                f"job_id = {job_id} is still pending (submitted, not yet reported by get_finished): a job id may be "
                "reused only once its result has been reported"
            )

    def submit(
        self,
        job_id: int,
        direction: Direction,
        num_bytes: int,
        issuer: Issuer,
        plan,
        *,
        lane: Hashable | None = None,
        path: str | None = None,
        predicted: Mapping[str, float] | None = None,
        trace=None,
        after: Iterable[int] = (),
    ) -> None:
        """Issues ``plan`` through ``issuer`` as job ``job_id`` on ``lane`` (default: the lane named after the
        direction); ``plan`` None moves nothing and completes at once. An issue that raises fails the job, reported
        once by :meth:`get_finished`; :meth:`shutdown` re-raises the first. ``path`` defaults to the issuer's;
        ``predicted`` (each path's predicted seconds, where one was chosen) goes into the result. ``after``: ids of
        earlier jobs (of any lane) the job must follow on the device; ids not pending, or already finished, are
        ignored."""
        job = _Job(job_id, direction, num_bytes, issuer.path if path is None else path, predicted)
        lane = direction if lane is None else lane
        if plan is None:
            job.finish(0.0)
        elif self.cuda:
            self._issue_cuda(job, lane, issuer, plan, trace, after)
        else:
            self._issue_now(job, issuer, plan, trace)
        self._pending[lane].append(job)
        self._pending_ids[job_id] = job

    def _issue_now(self, job: _Job, issuer: Issuer, plan, trace) -> None:
        t0 = time.perf_counter()
        try:
            keep = issuer.issue(plan, None, trace)
            check = issuer.outcome(keep)
            issuer.release(keep)
            job.finish(time.perf_counter() - t0, check=check)
        except Exception as e:  # reported as a failed job; shutdown re-raises the first
            self._fail(job, e)

    def _issue_cuda(self, job: _Job, lane, issuer: Issuer, plan, trace, after: Iterable[int] = ()) -> None:
        cuda = self._api
        stream, fence = self.streams[lane], self._fences[lane]
        job.issuer = issuer
        job.start, job.end = self._take_event(), self._take_event()
        try:
            # Every job waits for the compute stream as it is at submission: a store reads KV the model may still be
            # writing; a load overwrites blocks the model (or the allocator's previous owner) last wrote there.
            # Earlier jobs of the same lane are ordered by its stream, so they also complete in submission order.
            # Lanes are not ordered against each other (a load never waits for a long store), except after the jobs
            # the caller names: the engine names the pending stores that still read a block a load overwrites. A host
            # block is only loaded after its store completed (the manager's complete_store).
            fence.record(cuda.current_stream(self.device))
            stream.wait_event(fence)
            for earlier in after:
                prior = self._pending_ids.get(earlier)
                if prior is not None and prior.end is not None and prior.result is None:
                    stream.wait_event(prior.end)
            if trace is not None:
                trace("fence")
            # The start event precedes everything the issuer does (an id upload included), so every path's jobs are
            # timed alike.
            job.start.record(stream)
            job.keep = issuer.issue(plan, stream, trace)
            job.end.record(stream)
        except Exception as e:
            self._fail(job, e)

    def _take_event(self):
        return self._events.pop() if self._events else self._api.Event(enable_timing=True)

    def _release(self, job: _Job) -> None:
        job.issuer.release(job.keep)
        self._events += (job.start, job.end)
        job.issuer = job.start = job.end = job.keep = None

    def _fail(self, job: _Job, error: BaseException) -> None:
        logger.error("transfer job %s (%s) failed: %s", job.job_id, job.direction, error)
        if self._first_error is None:
            self._first_error = error
        job.finish(0.0, error)
        # Its buffers may still be referenced by work already queued on the stream: do not recycle them.
        job.issuer = job.start = job.end = job.keep = None

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
            job.finish(job.start.elapsed_time(job.end) / 1e3, check=job.issuer.outcome(job.keep))
            self._release(job)
        except Exception as e:  # a CUDA error surfaces here: fail the job instead of hanging
            self._fail(job, e)
        return True

    def get_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call, each reported once, without blocking."""
        out, self._done = self._done, []
        for queue in self._pending.values():
            # FIFO per lane: the stream completes jobs in order, so the first unfinished one ends the scan.
            while queue and self._poll(queue[0], block=False):
                out.append(queue.popleft().result)
        for r in out:
            self._pending_ids.pop(r.job_id, None)
        return out

    def wait(self, job_ids: Iterable[int]) -> None:
        """Blocks until the given jobs are finished; unknown or already reported ids are ignored."""
        wanted = set(job_ids)
        for queue in self._pending.values():
            for job in list(queue):
                if job.job_id in wanted:
                    self._poll(job, block=True)

    def running(self, job_id: int) -> bool:
        """Whether job ``job_id`` was submitted and is not known to be finished (not waited for, or not yet seen
        complete by :meth:`get_finished`)."""
        job = self._pending_ids.get(job_id)
        return job is not None and job.result is None

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
