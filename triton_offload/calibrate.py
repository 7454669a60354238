"""Measures issuers for ``auto``: canary blocks of the engine's own layout (fresh tensors, never live KV) move both
ways through each issuer, at two transfer sizes and at both contiguity extremes, timed on the GPU behind a sleep
that hides their submission and on the host, and :func:`~triton_offload.path_choice.fit` turns the points into the
:class:`~triton_offload.path_choice.Calibration` the engine chooses with (CUDA only).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from triton_offload._checks import DMA, KERNEL
from triton_offload.checksums import Checksums
from triton_offload.fast_launch import canary_spec
from triton_offload.issuers.base import Issuer, IssuerContext
from triton_offload.issuers.factory import PATHS, build_issuers
from triton_offload.issuers.launcher import CopyLauncher
from triton_offload.layouts import KVCacheSpec
from triton_offload.path_choice import Calibration, fit
from triton_offload.plan import Direction, TransferPlanner
from triton_offload.staging import IdStager

__all__ = ["calibrate", "canary_issuers", "calibration_transfers", "sleep_cycles_per_us"]

# Canary bytes (GPU, and as much pinned host memory) a calibration may allocate: the live KV cache already holds
# most of the device's memory when a worker starts.
CANARY_BYTES = 64 << 20
# Most blocks per calibration transfer; the fewest is an eighth of that (at least 1, at most 16).
MAX_BLOCKS = 128
REPS = 3

# issuers_for(canary spec, canary host buffer, the calibration's stream) -> the issuers to measure, by path.
IssuersFor = Callable[[KVCacheSpec, torch.Tensor, torch.cuda.Stream], Mapping[str, Issuer]]


def sleep_cycles_per_us(stream: torch.cuda.Stream) -> float:
    """GPU clock cycles ``torch.cuda._sleep`` spins per microsecond, measured on ``stream``."""
    probe = 1_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(probe)  # the first call loads the module
        start.record(stream)
        torch.cuda._sleep(probe)
        end.record(stream)
    end.synchronize()
    return probe / (start.elapsed_time(end) * 1e3)


def _measure(issue: Callable[[], object], release, stream: torch.cuda.Stream, cycles_per_us: float):
    """(GPU seconds, host seconds) of one ``issue()`` on ``stream``: median over :data:`REPS`. Each timed run starts
    behind a GPU sleep longer than its submission, so the events measure the copies, not the host. What ``issue``
    returns goes to ``release`` once its copies have completed."""
    keep = issue()  # warm-up: compiles, fills the driver's caches
    stream.synchronize()
    release(keep)
    t0 = time.perf_counter()
    keep = issue()
    host = [time.perf_counter() - t0]
    stream.synchronize()
    release(keep)
    gpu = []
    for _ in range(REPS):
        torch.cuda._sleep(int((2 * host[-1] * 1e6 + 50) * cycles_per_us))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        t0 = time.perf_counter()
        keep = issue()
        host.append(time.perf_counter() - t0)
        end.record(stream)
        end.synchronize()
        release(keep)
        gpu.append(start.elapsed_time(end) / 1e3)
    return float(np.median(gpu)), float(np.median(host[1:]))


def calibration_transfers(num_groups: int, blocks_per_host_block: int, n_max: int, rows: int, rng: np.random.Generator):
    """The transfers :func:`calibrate` measures, as ``(blocks, contiguous, gpu ids, host ids, group sizes)``: at
    ``n_max`` blocks and an eighth of that, each with random ids (one descriptor per block and run) and consecutive
    ones (as few as coalescing allows). The blocks are shared out over the groups, as a hybrid model's transfers move
    every group (``group_sizes`` None for one group); GPU ids are drawn from ``2 * n_max`` canary blocks, host ids from
    ``rows`` host blocks, which must hold ``ceil(n_max / f) + num_groups - 1`` of them."""
    f = blocks_per_host_block
    n_min = max(1, min(16, n_max // 8))
    for n in sorted({n_min, n_max}):
        sizes = [n // num_groups + (gi < n % num_groups) for gi in range(num_groups)]
        m = sum(-(-k // f) for k in sizes)  # host ids, group by group
        for contiguous in (False, True):
            g = np.arange(n, dtype=np.int64) if contiguous else rng.permutation(2 * n_max)[:n].astype(np.int64)
            h = np.arange(m, dtype=np.int64) if contiguous else rng.permutation(rows)[:m].astype(np.int64)
            yield n, contiguous, g, h, (None if num_groups == 1 else sizes)


def canary_issuers(
    launcher: CopyLauncher,
    num_ctas: int | None = None,
    paths: Sequence[str] = (KERNEL, DMA),
    builders: Mapping[str, Callable[[IssuerContext], Issuer]] = PATHS,
) -> IssuersFor:
    """The issuers of ``paths`` (built by ``builders``, :data:`~triton_offload.issuers.factory.PATHS`) over a canary:
    the kernel's with ``launcher``'s launch shapes and, where it has them, its proven direct launches (as live calls
    launch), passing the programs the engine's launches pass (``num_ctas``, already resolved under its launch shape
    from the real caches' page runs)."""

    def issuers_for(canary: KVCacheSpec, host: torch.Tensor, stream: torch.cuda.Stream) -> dict[str, Issuer]:
        checksums = None
        if launcher.integrity:  # measured with the checks, as live jobs run (the canary's own, empty, table)
            checksums = Checksums.allocate(launcher.checksums.setting, host.shape[0], launcher.blocks_per_host_block,
                                           pin=canary.device.type == "cuda", regions=canary.num_regions)  # fmt: skip
        kernel = launcher.twin(canary, host, checksums=checksums)
        for d in kernel.directions:
            kernel.set_direct(d, launcher.direct(d))
            if launcher.integrity:
                kernel.set_direct(d, launcher.direct(d, copy=False), copy=False)
        ctx = IssuerContext(canary, host, launcher.blocks_per_host_block, kernel, IdStager(canary.device, stream),
                            num_ctas)  # fmt: skip
        return build_issuers(ctx, paths, builders)

    return issuers_for


def calibrate(
    spec: KVCacheSpec, blocks_per_host_block: int, issuers_for: IssuersFor, note: str | None = None
) -> Calibration:
    """Measures the issuers ``issuers_for`` builds over canary blocks shaped like ``spec`` (CUDA) and fits a
    :class:`~triton_offload.path_choice.PathModel` per path and direction.

    An issuer whose cost does not depend on where the blocks are (it issues no copies of its own: the kernel) is
    measured at random ids only. ``note`` says why a path is missing, for the log.
    """
    t_start = time.perf_counter()
    f = blocks_per_host_block
    n_max = max(1, min(MAX_BLOCKS, CANARY_BYTES // (2 * spec.host_block_bytes(1))))
    canary = canary_spec(spec, 2 * n_max)
    rows = math.ceil(n_max / f) + spec.num_groups  # a group's last host block may be partly filled
    host = torch.empty(rows, canary.host_block_bytes(f), dtype=torch.uint8, pin_memory=True)
    host.random_(0, 256)  # loads read it
    stream = torch.cuda.Stream(spec.device)
    issuers = issuers_for(canary, host, stream)
    planner = TransferPlanner(canary, rows, f)
    cycles = sleep_cycles_per_us(stream)
    rng = np.random.default_rng(0)
    points = []
    with torch.cuda.stream(stream):
        for n, contiguous, g, h, sizes in calibration_transfers(spec.num_groups, f, n_max, rows, rng):
            for direction in Direction:
                plan = planner.plan(g, h, direction=direction, group_sizes=sizes)
                for path, issuer in issuers.items():
                    copies = issuer.copies(plan)
                    if contiguous and not copies:
                        continue
                    issue = lambda i=issuer, p=plan: i.issue(p, stream)  # noqa: E731
                    gpu_s, host_s = _measure(issue, issuer.release, stream, cycles)
                    points.append(
                        dict(path=path, direction=str(direction), blocks=n, contiguous=contiguous,
                             bytes=plan.num_bytes, descriptors=copies, gpu_s=gpu_s, host_s=host_s)
                    )  # fmt: skip
    stream.synchronize()
    return Calibration(fit(points), time.perf_counter() - t_start, tuple(points), note)
