"""Two costs a serving engine pays besides link time: the host-side cost of one call, and the SMs a copy kernel takes
from the model (measured as the slowdown of a GEMM loop running beside the transfers)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

import triton_offload as to
from bench.baselines import METHODS
from bench.common.case import Prepared, TransferCase
from bench.common.env import Env
from bench.common.timing import gbps, quantiles, stats_us

__all__ = ["cpu_overhead", "interference"]


def cpu_overhead(
    cases: dict[str, TransferCase], env: Env, stream: torch.cuda.Stream, bursts: int, per_burst: int
) -> dict:
    """Host microseconds of one gather / scatter call (validation + planning + launch), with a prepared spec.

    Calls are timed with perf_counter around the Python call only, back to back in bursts of ``per_burst`` after a
    synchronize: the GPU queues the work (each call is hundreds of MiB), a burst keeps that queue short so a full
    launch queue cannot stall the host. Validation alone (``plan_transfer``) is timed too, to split the cost.
    """
    out: dict = {}
    for name, case in cases.items():
        prepared = METHODS["triton"].prepare(case, env)
        with torch.cuda.stream(stream):
            prepared.run()  # compile outside the timing
            torch.cuda.synchronize()
            calls = []
            for _ in range(bursts):
                torch.cuda.synchronize()
                for _ in range(per_burst):
                    t0 = time.perf_counter()
                    prepared.run()
                    calls.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        checks = []
        for _ in range(bursts * per_burst):
            t0 = time.perf_counter()
            to.plan_transfer(
                case.spec,
                case.host,
                case.gpu_ids,
                case.host_ids,
                blocks_per_host_block=case.f,
                skip=case.skip,
                direction=to.Direction.STORE if case.store else to.Direction.LOAD,
            )
            checks.append(time.perf_counter() - t0)
        out[name] = {**stats_us(calls), "validation_median_us": stats_us(checks)["median_us"]}
    return out


def _gemm(n: int, device: torch.device) -> Callable[[], None]:
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn((n, n), dtype=torch.bfloat16, device=device, generator=gen)
    b = torch.randn((n, n), dtype=torch.bfloat16, device=device, generator=gen)
    c = torch.empty((n, n), dtype=torch.bfloat16, device=device)
    return lambda: torch.matmul(a, b, out=c)


def _overlap_once(
    gemm: Callable[[], None],
    run: Callable[[], None] | None,
    transfers: int,
    blockers: int,
    iters: int,
    compute: torch.cuda.Stream,
    side: torch.cuda.Stream,
) -> tuple[float, float | None, bool]:
    """One GEMM loop of ``iters`` on ``compute`` with ``transfers`` calls of ``run`` on ``side``, both released
    at once by an event after ``blockers`` GEMMs that keep the GPU busy while the host enqueues everything.

    Returns (ms per GEMM, ms of all transfers or None, whether the transfers outlasted the GEMM loop).
    """
    gate = torch.cuda.Event()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    xs, xe = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(compute):
        for _ in range(blockers):
            gemm()
        gate.record(compute)
    if run is not None:
        # Ordering: the side stream waits for the gate, so transfers start with the timed GEMMs, not before.
        side.wait_event(gate)
        with torch.cuda.stream(side):
            xs.record(side)
            for _ in range(transfers):
                run()
            xe.record(side)
    with torch.cuda.stream(compute):
        start.record(compute)
        for _ in range(iters):
            gemm()
        end.record(compute)
    torch.cuda.synchronize()
    gemm_ms = start.elapsed_time(end) / iters
    if run is None:
        return gemm_ms, None, True
    return gemm_ms, xs.elapsed_time(xe), start.elapsed_time(xe) >= start.elapsed_time(end)


def interference(
    preparers: dict[tuple[str, str, int | None], Callable[[], Prepared]],
    bytes_per_transfer: int,
    env: Env,
    side: torch.cuda.Stream,
    gemm_n: int,
    iters: int,
    repeats: int,
) -> dict:
    """Slowdown of a bf16 GEMM loop while transfers run on a side stream.

    Args:
        preparers: (direction, method, num_ctas) -> a function returning the method prepared for that direction.
        bytes_per_transfer: bytes one transfer moves.
        env: the benchmark's environment (its stream is ``side``).
        side: the stream transfers run on.
        gemm_n: M = N = K of the GEMM.
        iters: GEMMs in the timed loop.
        repeats: measurements per point; the median is reported.
    """
    device = env.device
    compute = torch.cuda.Stream(device)
    gemm = _gemm(gemm_n, device)
    with torch.cuda.stream(compute):
        for _ in range(3):
            gemm()  # cuBLAS handle, workspace and heuristics outside the timing
    torch.cuda.synchronize()
    alone = [_overlap_once(gemm, None, 0, 2, iters, compute, side)[0] for _ in range(repeats)]
    gemm_ms = quantiles(alone)[0]
    rows = []
    for (direction, method, num_ctas), prepare in preparers.items():
        try:
            rows.append(_point(prepare(), gemm, gemm_ms, bytes_per_transfer, iters, repeats, compute, side))
        except Exception as exc:  # one broken point must not cost the others; the error is reported in its row
            if not env.alive():
                raise
            rows.append({"error": f"{type(exc).__name__}: {exc}"})
        rows[-1] = {"direction": direction, "method": method, "num_ctas": num_ctas, **rows[-1]}
    return {
        "gemm": {"m": gemm_n, "n": gemm_n, "k": gemm_n, "dtype": "bf16", "iters": iters},
        "gemm_ms_alone": round(gemm_ms, 4),
        "rows": rows,
    }


def _point(
    prepared: Prepared,
    gemm: Callable[[], None],
    gemm_ms: float,
    bytes_per_transfer: int,
    iters: int,
    repeats: int,
    compute: torch.cuda.Stream,
    side: torch.cuda.Stream,
) -> dict:
    """One (direction, method) point: the transfer alone, then the GEMM loop beside enough of them."""
    with torch.cuda.stream(side):
        prepared.run()  # warm-up / compile
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(side)
        for _ in range(3):
            prepared.run()
        e1.record(side)
        cpu_ms = (time.perf_counter() - t0) * 1e3 / 3
        torch.cuda.synchronize()
    transfer_ms = e0.elapsed_time(e1) / 3
    # Enough transfers to outlast the GEMM loop, and enough blocking GEMMs to cover enqueueing all of it.
    transfers = min(400, max(2, math.ceil(1.3 * iters * gemm_ms / max(transfer_ms, 1e-3)) + 1))
    blockers = math.ceil((transfers * cpu_ms + iters * 0.05 + 5.0) / gemm_ms) + 1
    samples = [_overlap_once(gemm, prepared.run, transfers, blockers, iters, compute, side) for _ in range(repeats)]
    with_ms = quantiles([s[0] for s in samples])[0]
    xfer_ms = quantiles([s[1] for s in samples])[0]
    return {
        "gemm_ms": round(with_ms, 4),
        "slowdown_pct": round((with_ms / gemm_ms - 1.0) * 100.0, 2),
        "transfer_gbps_during": round(gbps(transfers * bytes_per_transfer, xfer_ms), 2),
        "transfer_gbps_alone": round(gbps(bytes_per_transfer, transfer_ms), 2),
        "transfers": transfers,
        "covered": all(s[2] for s in samples),
    }
