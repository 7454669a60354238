"""A small stand-in for CUDA streams and events, for the transfer engine's orderings on CPU: streams queue their work
and run it only when the test (or a ``synchronize``) runs them, honouring event records and waits, so the lanes run
in whatever order their events allow, as on a device. ``sim_engine(...)`` builds a TransferEngine on it through the
engine's own seams (``tracker=``, ``issuers=``): its tracker's CUDA calls go to the simulator and its issuers' work
(the kernel, through Triton's interpreter) runs when their stream does. ``SimEngine`` is the same as a class, for a
worker's ``engine_class``."""

from __future__ import annotations

import types

import torch

from triton_offload.engine import LANES, TransferEngine
from triton_offload.issuers.factory import PATHS
from triton_offload.jobs import JobTracker


class SimEvent:
    def __init__(self, sim):
        self.sim, self.marker, self.fired = sim, 0, 0
        sim.events += 1
        self.name = f"e{sim.events - 1}"

    def record(self, stream):
        self.marker += 1
        self.sim.log.append(("record", self.name, stream.name))
        stream.ops.append(("record", self, self.marker))

    def query(self) -> bool:
        return self.fired == self.marker

    def synchronize(self) -> None:
        """Runs every stream that is not held until this event's last record has run; a wait that would block
        behind held work fails the test."""
        self.sim.run_until(lambda: self.query())
        assert self.query(), f"synchronize on {self.name} would block behind held work ({sorted(self.sim.held)})"

    def elapsed_time(self, end) -> float:
        return 1.0


class SimCuda:
    """torch.cuda's Stream, Event and current_stream over simulated streams. ``held``: names of streams the device
    does not run until the test releases them (work that is slow)."""

    def __init__(self):
        self.log: list[tuple] = []
        self.streams: list = []
        self.events = 0
        self.held: set[str] = set()
        self.compute = self._stream("compute")

    def _stream(self, name):
        stream = types.SimpleNamespace(name=name, ops=[])

        def wait_event(ev):
            self.log.append(("wait", ev.name, name))
            stream.ops.append(("wait", ev, ev.marker))

        stream.wait_event = wait_event
        self.streams.append(stream)
        return stream

    def Stream(self, device):  # noqa: N802 - torch.cuda.Stream's name
        return self._stream(f"side{len(self.streams) - 1}")

    def Event(self, enable_timing=False):  # noqa: N802
        return SimEvent(self)

    def current_stream(self, device):
        return self.compute

    @staticmethod
    def run(stream) -> bool:
        """Runs ``stream``'s queued work until a wait on an event not yet reached; True if it ran everything."""
        progressed = False
        while stream.ops:
            op = stream.ops[0]
            if op[0] == "wait" and op[1].fired < op[2]:
                return progressed
            stream.ops.pop(0)
            progressed = True
            if op[0] == "record":
                op[1].fired = max(op[1].fired, op[2])
            elif op[0] == "work":
                op[1]()
        return progressed

    def run_until(self, done) -> None:
        """Runs the streams that are not held, round after round, until ``done()`` or nothing can progress."""
        while not done():
            if not any(self.run(s) for s in self.streams if s.name not in self.held):
                return


class Deferred:
    """An issuer whose work runs when its stream does."""

    def __init__(self, real):
        self.real, self.path = real, real.path

    def copies(self, plan):
        return self.real.copies(plan)

    def issue(self, plan, stream=None, trace=None):
        stream.ops.append(("work", lambda: self.real.issue(plan)))

    def outcome(self, keep):
        return None

    def release(self, keep, after=None):
        pass


def deferred_paths(builders=PATHS) -> dict:
    """``builders`` (the engine's paths) whose issuers run their work when their stream does."""
    return {path: (lambda ctx, build=build: Deferred(build(ctx))) for path, build in builders.items()}


def sim_engine(*args, sim: SimCuda | None = None, **kwargs) -> TransferEngine:
    """A CPU TransferEngine (its arguments) whose jobs run on the simulator ``sim`` (a new one by default; the
    engine's ``sim``)."""
    return SimEngine(*args, sim=sim, **kwargs)


class SimEngine(TransferEngine):
    """A TransferEngine on a stream simulator (``engine.sim``), built through the engine's seams."""

    def __init__(self, *args, sim: SimCuda | None = None, **kwargs):
        self.sim = sim or SimCuda()
        tracker = JobTracker(torch.device("cuda", 0), LANES, name="the transfer engine", cuda=self.sim)
        super().__init__(*args, tracker=tracker, issuers=deferred_paths(), **kwargs)


def lane_stream(engine, lane):
    return engine._tracker.streams[lane]
