"""Device timing with CUDA events, the way ``triton.testing.do_bench`` does it, plus the host time of each call.

Each sample is one call between two events on the benchmark's stream, after an L2 flush (a 256 MiB memset). The
flush also keeps the GPU busy while the host issues the call, so a launch's fixed CPU cost (tens of microseconds)
is hidden behind it and the events measure what the transfer occupies on the device; a method whose issue time
exceeds that (one cudaMemcpyAsync per block) shows its issue time, because the copies cannot run before they are
issued. The host-side cost of a call is reported separately, never mixed into GB/s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Timing", "GpuTimer"]

FLUSH_BYTES = 256 << 20


@dataclass
class Timing:
    """Samples of one measurement: device milliseconds per call and host milliseconds of the Python call."""

    ms: list[float]
    cpu_ms: list[float]

    def quantile(self, q: float) -> float:
        return float(np.quantile(self.ms, q))

    @property
    def median_ms(self) -> float:
        return self.quantile(0.5)

    @property
    def median_cpu_ms(self) -> float:
        return float(np.median(self.cpu_ms)) if self.cpu_ms else float("nan")


class GpuTimer:
    """Times callables on ``stream`` with CUDA events.

    Args:
        stream: the (non-default) stream every method issues its work on.
        device: the CUDA device.
    """

    def __init__(self, stream: torch.cuda.Stream, device: torch.device):
        self.stream = stream
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)

    def _events(self, k: int) -> list[torch.cuda.Event]:
        return [torch.cuda.Event(enable_timing=True) for _ in range(k)]

    def __call__(self, fn: Callable[[], None], budget_ms: float, min_reps: int = 3, max_reps: int = 100) -> Timing:
        """Warm-up call, one estimate, then as many samples as fit ``budget_ms`` (at least ``min_reps``)."""
        ms: list[float] = []
        cpu: list[float] = []
        with torch.cuda.stream(self.stream):
            fn()  # warm-up: compiles a kernel the first time, faults in pages, fills descriptor caches
            self.stream.synchronize()
            start, end = self._events(2)
            start.record(self.stream)
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            end.record(self.stream)
            end.synchronize()
            estimate = start.elapsed_time(end)
            if estimate >= budget_ms:
                # Slow methods (per-block copies at 1024 blocks): the estimate is a sample, take min_reps in all.
                ms.append(estimate)
                cpu.append((t1 - t0) * 1e3)
            reps = max(min_reps - len(ms), min(max_reps, int(budget_ms / max(estimate, 1e-3))))
            starts, ends = self._events(reps), self._events(reps)
            for i in range(reps):
                self.flush.zero_()
                starts[i].record(self.stream)
                t0 = time.perf_counter()
                fn()
                cpu.append((time.perf_counter() - t0) * 1e3)
                ends[i].record(self.stream)
            self.stream.synchronize()
        ms.extend(s.elapsed_time(e) for s, e in zip(starts, ends))
        return Timing(ms, cpu)
