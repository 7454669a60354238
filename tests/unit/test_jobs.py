"""The job tracker (triton_offload/jobs.py) on CPU. Its CUDA side runs on a stand-in CUDA API that logs every event
record and stream wait, so the orderings it promises are checked without a GPU: the compute fence before a job's
start event, the start event before anything the issuer does (an id upload included), FIFO completion per lane,
pooled events, failed jobs' buffers never reused, drain-then-re-raise, and a lane added by name alone."""

from __future__ import annotations

import types

import pytest
import torch

from triton_offload.jobs import JobResult, JobTracker
from triton_offload.plan import Direction

STORE, LOAD = Direction.STORE, Direction.LOAD


class FakeCuda:
    """torch.cuda's Stream, Event and current_stream, logging what is recorded and waited where. Side streams are
    named side0, side1, ... and events e0, e1, ... in the order they are made."""

    def __init__(self):
        self.log: list[tuple] = []
        self.streams = self.events = 0
        self.compute = types.SimpleNamespace(name="compute")

    def Stream(self, device):  # noqa: N802 - torch.cuda.Stream's name
        name, self.streams = f"side{self.streams}", self.streams + 1
        return types.SimpleNamespace(name=name, wait_event=lambda ev: self.log.append(("wait", ev.name, name)))

    def Event(self, enable_timing=False):  # noqa: N802
        cuda = self

        class Ev:
            def __init__(self):
                self.name, self.done = f"e{cuda.events}", False
                cuda.events += 1

            def record(self, stream):
                self.done = False
                cuda.log.append(("record", self.name, stream.name))

            def query(self):
                return self.done

            def synchronize(self):
                self.done = True

            def elapsed_time(self, end):
                return 2.0  # ms

        self.log.append(("new event", enable_timing))
        return Ev()

    def current_stream(self, device):
        return self.compute


class LoggingIssuer:
    """Logs each issue (as the kernel issuer's id upload and launch) and each release."""

    path = "kernel"

    def __init__(self, cuda: FakeCuda, fail: bool = False):
        self.cuda, self.fail, self.released = cuda, fail, []

    def issue(self, plan, stream=None, trace=None):
        self.cuda.log.append(("upload", plan, getattr(stream, "name", None)))
        if self.fail:
            raise RuntimeError("launch failed: out of resources")
        self.cuda.log.append(("launch", plan))
        return f"slot of {plan}"

    def copies(self, plan):
        return 0

    def outcome(self, keep):
        return None

    def release(self, keep, after=None):
        self.released.append(keep)


def _tracker(lanes=tuple(Direction)):
    cuda = FakeCuda()
    return cuda, JobTracker(torch.device("cuda", 0), lanes, cuda=cuda)


def _records(cuda, since=0):
    return [e for e in cuda.log[since:] if e[0] in ("record", "wait", "upload", "launch")]


def test_a_job_is_fenced_then_started_before_its_issuer_runs():
    """The compute stream's fence first, then the job's start event, then the issuer (its id upload included), then
    the end event: a kernel job is timed from the same point as a copy-engine job."""
    cuda, tracker = _tracker()
    since = len(cuda.log)
    tracker.submit(1, STORE, 10, LoggingIssuer(cuda), "p1")
    fence, start, end = "e0", "e2", "e3"  # e0, e1: the two lanes' fences; then the job's two timing events
    assert _records(cuda, since) == [
        ("record", fence, "compute"),
        ("wait", fence, "side0"),
        ("record", start, "side0"),
        ("upload", "p1", "side0"),
        ("launch", "p1"),
        ("record", end, "side0"),
    ]


def test_lanes_complete_in_order_each_and_independently():
    cuda, tracker = _tracker()
    issuer = LoggingIssuer(cuda)
    tracker.submit(1, STORE, 10, issuer, "s1")
    tracker.submit(2, STORE, 10, issuer, "s2")
    tracker.submit(3, LOAD, 20, issuer, "l1")
    jobs = {job.job_id: job for queue in tracker._pending.values() for job in queue}
    jobs[2].end.done = jobs[3].end.done = True  # the second store is done, the first is not: FIFO waits for it
    assert [r.job_id for r in tracker.get_finished()] == [3]
    assert issuer.released == ["slot of l1"]
    jobs[1].end.done = True
    assert [r.job_id for r in tracker.get_finished()] == [1, 2]
    assert tracker.num_pending == 0 and issuer.released == ["slot of l1", "slot of s1", "slot of s2"]


def test_events_are_pooled_and_reused():
    cuda, tracker = _tracker()
    issuer = LoggingIssuer(cuda)
    for job in range(5):
        tracker.submit(job, LOAD, 1, issuer, job)
        tracker.wait([job])
        (res,) = tracker.get_finished()
        assert res == JobResult(job, True, LOAD, 1, 2e-3, path="kernel")
    made = [e for e in cuda.log if e == ("new event", True)]
    assert len(made) == 2 and len(tracker._events) == 2, "one job's two timing events, reused by every later job"


def test_a_failed_job_is_reported_its_buffers_never_reused_and_shutdown_reraises():
    cuda, tracker = _tracker()
    bad = LoggingIssuer(cuda, fail=True)
    tracker.submit(1, STORE, 10, bad, "p1")
    tracker.submit(2, LOAD, 10, LoggingIssuer(cuda), "p2")
    tracker.wait([2])
    results = {r.job_id: r for r in tracker.get_finished()}
    assert not results[1].ok and "out of resources" in results[1].error and results[2].ok
    assert bad.released == [] and len(tracker._events) == 2, "the failed job's events and buffers are dropped"
    with pytest.raises(RuntimeError, match="a KV transfer failed") as info:
        tracker.shutdown()
    assert "out of resources" in str(info.value.__cause__)
    with pytest.raises(RuntimeError, match="the job tracker is shut down"):
        tracker.check_new(3)


def test_shutdown_drains_every_lane():
    cuda, tracker = _tracker()
    issuer = LoggingIssuer(cuda)
    tracker.submit(1, STORE, 10, issuer, "s")
    tracker.submit(2, LOAD, 10, issuer, "l")
    assert [r.job_id for r in tracker.shutdown()] == [1, 2] and len(issuer.released) == 2


def test_a_third_lane_is_a_name():
    """An expedited-load lane is one more name: its jobs get their own stream and never queue behind the loads."""
    cuda, tracker = _tracker(lanes=(STORE, LOAD, "expedited"))
    issuer = LoggingIssuer(cuda)
    tracker.submit(1, LOAD, 10, issuer, "l")
    tracker.submit(2, LOAD, 10, issuer, "x", lane="expedited")
    assert {ev[2] for ev in _records(cuda) if ev[0] == "upload"} == {"side1", "side2"}
    jobs = {job.job_id: job for queue in tracker._pending.values() for job in queue}
    jobs[2].end.done = True
    assert [r.job_id for r in tracker.get_finished()] == [2], "the expedited load did not wait for the load"


def test_job_ids_are_checked_before_anything_runs():
    _, tracker = _tracker()
    tracker.submit(7, STORE, 1, LoggingIssuer(FakeCuda()), None)  # nothing to move: done at once
    with pytest.raises(ValueError, match="job_id = 7 is still pending"):
        tracker.check_new(7)
    with pytest.raises(TypeError, match="job_id must be an int"):
        tracker.check_new(True)
    assert tracker.get_finished() == [JobResult(7, True, STORE, 1, 0.0)]
    tracker.check_new(7)


def test_without_cuda_a_job_runs_at_submission():
    tracker = JobTracker(torch.device("cpu"), tuple(Direction))
    cuda = FakeCuda()
    issuer = LoggingIssuer(cuda)
    tracker.submit(1, STORE, 10, issuer, "p")
    assert [e[0] for e in cuda.log if e[0] in ("upload", "launch")] == ["upload", "launch"]
    assert issuer.released == ["slot of p"]
    (res,) = tracker.get_finished()
    assert res.ok and res.seconds >= 0
