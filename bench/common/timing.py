"""Device timing with CUDA events, the way ``triton.testing.do_bench`` does it, plus the host time of each call
(:class:`GpuTimer`). Each sample is one call between two events on the benchmark's stream, after an L2 flush (a 256 MiB
memset, about 70-100 us on an H100/H200) and a GPU sleep of :data:`HIDE_US` microseconds (``torch.cuda._sleep``,
calibrated once). The flush and the sleep keep the GPU busy while the host issues the call, so a call's host work up to
about 300 us (validation, descriptor uploads, the launch) is hidden and the events measure what the transfer occupies on
the device. A method whose host work is longer shows the excess, because its copies cannot run before they are issued:
one ``cudaMemcpyAsync`` per block is such a method at large sizes. The host time of every call is recorded separately
(``call_cpu_us``) and never mixed into GB/s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from triton_offload.calibrate import sleep_cycles_per_us

__all__ = ["quantiles", "stats_us", "gbps", "Timing", "GpuTimer", "FLUSH_BYTES", "HIDE_US"]

FLUSH_BYTES = 256 << 20
HIDE_US = 200.0


def quantiles(samples: Sequence[float]) -> tuple[float, float, float]:
    """(median, p20, p80) of the samples: the one summary every table and JSON field uses."""
    median, p20, p80 = np.quantile(np.asarray(samples, dtype=np.float64), [0.5, 0.2, 0.8])
    return float(median), float(p20), float(p80)


def stats_us(seconds: Sequence[float]) -> dict:
    """Host times in seconds -> calls, median / p20 / p80 / min in microseconds (the CPU-cost tables)."""
    median, p20, p80 = (round(v * 1e6, 2) for v in quantiles(seconds))
    lowest = round(min(seconds) * 1e6, 2)
    return {"calls": len(seconds), "median_us": median, "p20_us": p20, "p80_us": p80, "min_us": lowest}


def gbps(nbytes: int, ms: float) -> float:
    """GB/s (10^9 bytes per second) of ``nbytes`` moved in ``ms`` milliseconds: the one rate every table reports."""
    return nbytes / (ms * 1e-3) / 1e9


@dataclass
class Timing:
    """Samples of one measurement: device milliseconds per call and host milliseconds of the Python call."""

    ms: list[float]
    cpu_ms: list[float]

    def fields(self) -> dict:
        """The row fields: median/p20/p80 device ms and the median host microseconds of one call."""
        median, p20, p80 = quantiles(self.ms)
        return {
            "median_ms": round(median, 5),
            "p20_ms": round(p20, 5),
            "p80_ms": round(p80, 5),
            "call_cpu_us": round(quantiles(self.cpu_ms)[0] * 1e3, 2),
        }


class GpuTimer:
    """Times callables on ``stream`` with CUDA events.

    Args:
        stream: the (non-default) stream every method issues its work on.
        device: the CUDA device.
        hide_us: GPU sleep after each flush, in microseconds (0: none).
    """

    def __init__(self, stream: torch.cuda.Stream, device: torch.device, hide_us: float = HIDE_US):
        self.stream = stream
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)
        self.sleep_cycles = int(hide_us * sleep_cycles_per_us(stream)) if hide_us > 0 else 0

    def _events(self, k: int) -> list[torch.cuda.Event]:
        return [torch.cuda.Event(enable_timing=True) for _ in range(k)]

    def __call__(
        self,
        fn: Callable[[], None],
        budget_ms: float,
        min_reps: int = 3,
        max_reps: int = 100,
        device_ms: Callable[[int], list[float]] | None = None,
    ) -> Timing:
        """Warm-up call, one estimate, then as many samples as fit ``budget_ms`` (at least ``min_reps``).

        ``device_ms(k)``: for a method that times its own calls (an engine's jobs, on a stream of its own, fenced
        after this one), the device milliseconds of its last ``k`` calls, taken instead of the events here; the flush
        and the sleep still run before each call, on this stream, so the engine's stream starts after them too."""
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
            estimate = start.elapsed_time(end) if device_ms is None else device_ms(1)[0]
            if estimate >= budget_ms:
                # Slow methods (per-block copies at 1024 blocks): the estimate is a sample, take min_reps in all.
                ms.append(estimate)
                cpu.append((t1 - t0) * 1e3)
            reps = max(min_reps - len(ms), min(max_reps, int(budget_ms / max(estimate, 1e-3))))
            starts, ends = self._events(reps), self._events(reps)
            for i in range(reps):
                self.flush.zero_()
                if self.sleep_cycles:
                    torch.cuda._sleep(self.sleep_cycles)
                starts[i].record(self.stream)
                t0 = time.perf_counter()
                fn()
                cpu.append((time.perf_counter() - t0) * 1e3)
                ends[i].record(self.stream)
            self.stream.synchronize()
        if device_ms is None:
            ms.extend(s.elapsed_time(e) for s, e in zip(starts, ends))
        else:
            ms.extend(device_ms(reps))
        return Timing(ms, cpu)
