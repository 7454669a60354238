"""A small stand-in for CUDA streams and events, for the transfer engine's orderings on CPU: streams queue their work
and run it only when the test (or a ``synchronize``) runs them, honouring event records and waits, so the lanes run
in whatever order their events allow, as on a device. ``deferred(engine)`` puts an engine on it: its tracker's CUDA
calls go to the simulator and its issuers' work (the kernel, through Triton's interpreter) runs when their stream
does."""

from __future__ import annotations

import types

import torch

from triton_offload.engine import LANES
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

    def descriptors(self, plan):
        return self.real.descriptors(plan)

    def issue(self, plan, stream=None, trace=None):
        stream.ops.append(("work", lambda: self.real.issue(plan)))

    def release(self, keep, after=None):
        pass


def deferred(engine) -> SimCuda:
    """Puts a CPU ``engine`` on a simulated device (its pending results are dropped): returns the simulator."""
    sim = SimCuda()
    engine._tracker = JobTracker(torch.device("cuda", 0), LANES, name="the transfer engine", cuda=sim)
    for lane in LANES:
        engine._issuers[lane] = {k: Deferred(v) for k, v in engine._issuers[lane].items()}
    return sim


def lane_stream(engine, lane):
    return engine._tracker.streams[lane]
