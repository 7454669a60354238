"""``auto``: each transfer takes the path whose predicted cost is lower, from per-path linear models of GPU time
(fixed + per byte + per descriptor) and host submission time (fixed + per descriptor) that a calibration fitted
(:mod:`triton_offload.calibrate` measures them). Pure: NumPy only, no device. The prediction is the time a transfer
keeps its stream busy; it does not price the SMs the kernel takes from the model, nor the worker-thread time the
copy engines' submission takes, so either path can be forced (docs/design.md, "The copy-engine path and auto").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import numpy as np

from triton_offload._checks import AUTO, DMA, KERNEL
from triton_offload.plan import Direction

__all__ = ["AUTO", "KERNEL", "DMA", "PathModel", "Calibration", "fit", "cheapest"]


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


def _key(path: str, direction: Direction) -> str:
    return f"{path}/{direction}"


def cheapest(predicted: Mapping[str, float]) -> str:
    """The path of the lowest predicted cost; ties go to the one listed first (the engine lists the kernel first)."""
    return min(predicted, key=predicted.__getitem__)


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

    def predict(self, direction: Direction, nbytes: int, descriptors: Mapping[str, int]) -> dict[str, float]:
        """Predicted seconds of one transfer of ``nbytes`` in ``direction`` on each path that has a model, given the
        descriptors each would issue (``descriptors``: path -> count; 0 for the kernel), in the order given."""
        out = {}
        for path, count in descriptors.items():
            model = self.models.get(_key(path, direction))
            if model is not None:
                out[path] = model.predict(nbytes, count)
        return out

    def choose(self, direction: Direction, nbytes: int, descriptors: Mapping[str, int]) -> str:
        """:data:`KERNEL` or :data:`DMA` for one transfer (:meth:`predict`; ties go to the path listed first)."""
        return cheapest(self.predict(direction, nbytes, descriptors))

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
    """Models per path and direction from calibration points (``path``, ``direction``, ``bytes``, ``descriptors``,
    ``gpu_s``, ``host_s``; medians of repeated runs), paths in the order they first appear."""
    models = {}
    for path in dict.fromkeys(p["path"] for p in points):
        for direction in Direction:
            pts = [p for p in points if p["path"] == path and p["direction"] == direction]
            if not pts:
                continue
            nbytes = np.array([p["bytes"] for p in pts], dtype=np.float64)
            desc = np.array([p["descriptors"] for p in pts], dtype=np.float64)
            gpu = np.array([p["gpu_s"] for p in pts])
            host = np.array([p["host_s"] for p in pts])
            ones = np.ones_like(nbytes)
            if not desc.any():  # one launch whatever the blocks (the kernel): no per-descriptor terms
                a, b = _fit([ones, nbytes], gpu)
                models[_key(path, direction)] = PathModel(a, b, 0.0, float(np.median(host)), 0.0)
            else:
                a, b, c = _fit([ones, nbytes, desc], gpu)
                d, e = _fit([ones, desc], host)
                models[_key(path, direction)] = PathModel(a, b, c, d, e)
    return models
