"""The serving benchmark's rows: each method of the one registry (:data:`bench.baselines.METHODS`) that the loop runs,
by exact name, as a :class:`MethodPoint` (a ctas-sweeping method once per num_ctas), and its engine, which has the
worker API of :class:`triton_offload.engine.TransferEngine` (``submit_store`` / ``submit_load`` with GPU and host
block ids, ``get_finished``, ``wait``, ``shutdown``). ``none`` builds no engine: the loop then runs without offload
traffic."""

from __future__ import annotations

from dataclasses import dataclass

from bench.baselines import METHODS, SERVING_METHODS
from bench.common.case import OffloadTarget
from triton_offload.kernels.shapes import DEFAULT_NUM_CTAS

__all__ = ["MethodPoint", "method_points", "build_engine"]


@dataclass(frozen=True)
class MethodPoint:
    """One row of a workload: a method, and for a ctas-sweeping method its num_ctas."""

    method: str
    num_ctas: int | None = None

    @property
    def label(self) -> str:
        return self.method if self.num_ctas is None else f"{self.method}@{self.num_ctas}"


def method_points(names, ctas: tuple[int, ...]) -> list[MethodPoint]:
    """Each method by exact name, a ctas-sweeping one at the default num_ctas and then at each of ``ctas``.

    Raises:
        ValueError: a name the serving loop does not run (the supported ones are listed).
    """
    unknown = [n for n in names if n not in SERVING_METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; supported: {sorted(SERVING_METHODS)}")
    points = []
    for name in names:
        if METHODS[name].sweeps_ctas:
            sweep = [DEFAULT_NUM_CTAS, *sorted(set(ctas) - {DEFAULT_NUM_CTAS})]
            points += [MethodPoint(name, c) for c in sweep]
        else:
            points.append(MethodPoint(name))
    return points


def build_engine(point: MethodPoint, target: OffloadTarget):
    """The engine of one point (None for ``none``)."""
    return METHODS[point.method].engine(target, point.num_ctas)
