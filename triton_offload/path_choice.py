"""``auto``: each transfer takes the faster of the Triton kernel and the copy engines, chosen per call from a
calibration made when the engine starts.

Neither path wins everywhere. The kernel moves small pages at the link's speed where the copy engines collapse (the
driver pays per descriptor), but SM-driven copies plateau a few percent under the link's peak, which the copy engines
reach at large pages, taking no SMs from the model. The crossover depends on page size, block count, direction and
machine, so it is measured, not assumed: :func:`calibrate` moves canary blocks of the engine's own layout (fresh
tensors, never live KV) both ways through both paths, at two transfer sizes and, for the copy engines, at both
contiguity extremes (random ids: one descriptor per block and run; consecutive ids: as few as coalescing allows),
and fits per path and direction a linear model of the GPU time (fixed + per byte + per descriptor) and of the host
submission time (fixed + per descriptor; the copy engines cost host time per descriptor, the kernel a fixed launch).
A call then takes the path whose predicted time, its host time plus its GPU time for that call's bytes and descriptor
count, is lower (:meth:`Calibration.choose`).

The predicted time is the one a transfer keeps its stream busy; it does not price the SMs the kernel takes from the
model, nor the worker-thread time the copy engines' submission takes from the next step. Force a path
(``path="kernel"`` or ``"dma"``) where either matters more.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from triton_offload._checks import TRANSFER_PATHS

__all__ = [
    "AUTO",
    "KERNEL",
    "DMA",
    "PathModel",
    "Calibration",
    "calibrate",
    "calibration_transfers",
    "sleep_cycles_per_us",
]

logger = logging.getLogger(__name__)

AUTO, KERNEL, DMA = TRANSFER_PATHS
# Canary bytes (GPU, and as much pinned host memory) a calibration may allocate: the live KV cache already holds
# most of the device's memory when a worker starts.
CANARY_BYTES = 64 << 20
# Most blocks per calibration transfer; the fewest is an eighth of that (at least 1, at most 16).
MAX_BLOCKS = 128
REPS = 3


@dataclass(frozen=True)
class PathModel:
    """One path's predicted seconds in one direction.

    GPU time ``gpu_fixed + gpu_per_byte * bytes + gpu_per_descriptor * descriptors``; host submission time
    ``host_fixed + host_per_descriptor * descriptors``; a call takes their sum: its copies cannot start before they
    are submitted (the calibration times the GPU part behind a sleep that hides the submission, so the two do not
    overlap in the model), and a transfer's stream is otherwise idle once the compute fence has passed.
    """

    gpu_fixed: float
    gpu_per_byte: float
    gpu_per_descriptor: float
    host_fixed: float
    host_per_descriptor: float

    def gpu_s(self, nbytes: int, descriptors: int) -> float:
        return self.gpu_fixed + self.gpu_per_byte * nbytes + self.gpu_per_descriptor * descriptors

    def host_s(self, descriptors: int) -> float:
        return self.host_fixed + self.host_per_descriptor * descriptors

    def predict(self, nbytes: int, descriptors: int) -> float:
        return self.host_s(descriptors) + self.gpu_s(nbytes, descriptors)


def _key(path: str, store: bool) -> str:
    return f"{path}/{'store' if store else 'load'}"


@dataclass(frozen=True)
class Calibration:
    """Per path and direction, a :class:`PathModel`; and how it was measured.

    Attributes:
        models: ``"kernel/store"``, ``"kernel/load"``, ``"dma/store"``, ``"dma/load"`` -> model. Without the copy-engine
            models (the driver has no ``cuMemcpyBatchAsync``) every call takes the kernel.
        seconds: wall time the calibration took.
        points: the measurements the models were fitted to.
        note: why the copy engines are not calibrated, if they are not.
    """

    models: dict[str, PathModel]
    seconds: float = 0.0
    points: tuple[dict, ...] = field(default=())
    note: str | None = None

    def choose(self, store: bool, nbytes: int, dma_descriptors: int) -> str:
        """:data:`KERNEL` or :data:`DMA` for one transfer of ``nbytes`` that the copy-engine path would issue as
        ``dma_descriptors`` descriptors (ties go to the kernel)."""
        dma = self.models.get(_key(DMA, store))
        if dma is None:
            return KERNEL
        kernel = self.models[_key(KERNEL, store)]
        return KERNEL if kernel.predict(nbytes, 0) <= dma.predict(nbytes, dma_descriptors) else DMA

    def to_dict(self) -> dict:
        return {
            "models": {k: asdict(m) for k, m in self.models.items()},
            "seconds": self.seconds,
            "points": list(self.points),
            "note": self.note,
        }

    def describe(self) -> str:
        """One line per model, for the log."""
        lines = []
        for k, m in self.models.items():
            lines.append(
                f"{k}: GPU {m.gpu_fixed * 1e6:.1f} us + {m.gpu_per_byte * 1e9 * 1e3:.3f} ms/GB + "
                f"{m.gpu_per_descriptor * 1e9:.1f} ns/descriptor; host {m.host_fixed * 1e6:.1f} us + "
                f"{m.host_per_descriptor * 1e9:.1f} ns/descriptor"
            )
        return "; ".join(lines) + (f" ({self.note})" if self.note else "")


def _fit(columns: list[np.ndarray], y: np.ndarray) -> list[float]:
    """Least-squares coefficients of ``y`` on ``columns``, negative ones clamped to 0 (a cost never shrinks with
    size). Collinear columns (bytes and descriptors in proportion when nothing coalesces) get the minimum-norm
    split, which predicts every call of that proportion the same."""
    a = np.stack(columns, axis=1)
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    return [max(0.0, float(c)) for c in coef]


def fit(points: list[dict]) -> dict[str, PathModel]:
    """Models per path and direction from calibration points (``path``, ``store``, ``bytes``, ``descriptors``,
    ``gpu_s``, ``host_s``; medians of repeated runs)."""
    models = {}
    for path in (KERNEL, DMA):
        for store in (True, False):
            pts = [p for p in points if p["path"] == path and p["store"] == store]
            if not pts:
                continue
            nbytes = np.array([p["bytes"] for p in pts], dtype=np.float64)
            desc = np.array([p["descriptors"] for p in pts], dtype=np.float64)
            gpu = np.array([p["gpu_s"] for p in pts])
            host = np.array([p["host_s"] for p in pts])
            ones = np.ones_like(nbytes)
            if path == KERNEL:  # one launch whatever the blocks: no per-descriptor terms
                a, b = _fit([ones, nbytes], gpu)
                models[_key(path, store)] = PathModel(a, b, 0.0, float(np.median(host)), 0.0)
            else:
                a, b, c = _fit([ones, nbytes, desc], gpu)
                d, e = _fit([ones, desc], host)
                models[_key(path, store)] = PathModel(a, b, c, d, e)
    return models


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


def _measure(issue: Callable[[], object], stream: torch.cuda.Stream, cycles_per_us: float) -> tuple[float, float]:
    """(GPU seconds, host seconds) of one ``issue()`` on ``stream``: median over :data:`REPS`. Each timed run starts
    behind a GPU sleep longer than its submission, so the events measure the copies, not the host."""
    issue()  # warm-up: compiles, fills the driver's caches
    stream.synchronize()
    t0 = time.perf_counter()
    issue()
    host = [time.perf_counter() - t0]
    stream.synchronize()
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
        del keep
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


def calibrate(launcher, blocks_per_host_block: int, num_ctas: int | None = None) -> Calibration:
    """Measures both paths on canary blocks shaped like ``launcher``'s spec (CUDA) and fits :class:`PathModel` s.

    Args:
        launcher: the live :class:`~triton_offload.kernels.copy_blocks.CopyLauncher` (both directions): the canary
            launches with its launch shapes and, where it has them, its proven direct launches, as live calls do.
        blocks_per_host_block: f.
        num_ctas: the engine's programs per launch.
    """
    from triton_offload.cuda_driver import CudaError
    from triton_offload.dma import DmaCopier
    from triton_offload.fast_launch import canary_spec
    from triton_offload.kernels.copy_blocks import CopyLauncher
    from triton_offload.transfer import TransferPlanner

    t_start = time.perf_counter()
    spec, f = launcher.spec, blocks_per_host_block
    n_max = max(1, min(MAX_BLOCKS, CANARY_BYTES // (2 * spec.host_block_bytes(1))))
    canary = canary_spec(spec, 2 * n_max)
    rows = math.ceil(n_max / f) + spec.num_groups  # a group's last host block may be partly filled
    host = torch.empty(rows, canary.host_block_bytes(f), dtype=torch.uint8, pin_memory=True)
    host.random_(0, 256)  # loads read it
    configs = {store: launcher.config(store) for store in (True, False)}
    kernel = CopyLauncher(canary, host, f, configs=configs)
    for store in (True, False):
        kernel.set_direct(store, launcher.direct(store))
    planner = TransferPlanner(canary, rows, f)
    note = None
    try:
        dma: DmaCopier | None = DmaCopier(canary, host, f)
    except CudaError as e:
        dma, note = None, f"no copy-engine path: {e}"
    stream = torch.cuda.Stream(spec.device)
    cycles = sleep_cycles_per_us(stream)
    rng = np.random.default_rng(0)
    points = []
    with torch.cuda.stream(stream):
        for n, contiguous, g, h, sizes in calibration_transfers(spec.num_groups, f, n_max, rows, rng):
            for store in (True, False):
                plan = planner.plan(g, h, store=store, group_sizes=sizes)
                ids = torch.from_numpy(plan.ids).to(spec.device)
                runs = []
                if not contiguous:  # the kernel's cost does not depend on where the blocks are
                    runs.append((KERNEL, lambda p=plan, i=ids: kernel.launch(p, i, num_ctas), 0))
                if dma is not None:
                    runs.append((DMA, lambda p=plan: dma.issue(p, stream.cuda_stream), dma.count(plan)))
                for path, issue, descriptors in runs:
                    gpu_s, host_s = _measure(issue, stream, cycles)
                    points.append(
                        dict(path=path, store=store, blocks=n, contiguous=contiguous, bytes=plan.num_bytes,
                             descriptors=descriptors, gpu_s=gpu_s, host_s=host_s)
                    )  # fmt: skip
    stream.synchronize()
    return Calibration(fit(points), time.perf_counter() - t_start, tuple(points), note)
