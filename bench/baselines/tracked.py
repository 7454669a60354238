"""Adapters over the library's seams, so a baseline is an issuer and nothing more: :class:`TrackedEngine` gives an
:class:`~triton_offload.issuers.base.Issuer` TransferEngine's worker API with the library's planner and job tracker
(:mod:`triton_offload.jobs`: a side stream per direction fenced after the compute stream, FIFO completion, wait,
drain), which the serving loop drives; :class:`EngineCalls` makes one call of a :class:`TransferEngine` a transfer
benchmark's ``run()``, timed by the engine's own job events.
"""

from __future__ import annotations

from bench.common.case import OffloadTarget, Prepared, TransferCase
from triton_offload.engine import TransferEngine
from triton_offload.issuers.base import Issuer
from triton_offload.jobs import JobResult, JobTracker
from triton_offload.plan import Direction, TransferPlanner

__all__ = ["TrackedEngine", "EngineCalls"]


class TrackedEngine:
    """``issuer`` behind TransferEngine's worker API (``submit_store`` / ``submit_load`` with GPU and host block ids,
    one GPU block per host block; ``get_finished``, ``wait``, ``shutdown``): each call planned by the library's
    planner and tracked by its job tracker, as the engine's own are; the job results name the issuer's transfer
    path (``"dma"`` for the copy-engine baselines).

    Args:
        target: the caches and host buffer.
        issuer: issues the plans; its ``paths``, where it has them, say what it issued, and ``on_cpu`` how it runs
            without CUDA.
        name: the method's name, in the results and the output.
        label: for an issuer without ``paths``, what one of its issues is (each direction it issued is named so).
    """

    def __init__(self, target: OffloadTarget, issuer: Issuer, name: str, label: str = "cuMemcpyBatchAsync"):
        self.kv, self.host, self.issuer, self.name, self.label = target.kv, target.host_buffer, issuer, name, label
        self.cuda = self.kv.device.type == "cuda"
        self._planner = TransferPlanner(self.kv, self.host.shape[0], 1)
        self._tracker = JobTracker(self.kv.device, tuple(Direction), name=name)
        self._issued: set[str] = set()

    @property
    def impl(self) -> str:
        paths = getattr(self.issuer, "paths", None) or self._issued
        on_cpu = getattr(self.issuer, "on_cpu", "batches run by a memmove stand-in")
        where = "" if self.cuda else f" (no CUDA: {on_cpu})"
        return f"{self.name}: {', '.join(sorted(paths)) or 'nothing issued'}; descriptors built per call{where}"

    def submit_store(self, job_id: int, gpu_block_ids, host_block_ids) -> None:
        """Queues copies of GPU blocks into host blocks (block i -> host block i), after the current stream's work."""
        self._submit(job_id, Direction.STORE, gpu_block_ids, host_block_ids)

    def submit_load(self, job_id: int, gpu_block_ids, host_block_ids) -> None:
        """Queues copies of host blocks into GPU blocks, after the current stream's work."""
        self._submit(job_id, Direction.LOAD, gpu_block_ids, host_block_ids)

    def _submit(self, job_id: int, direction: Direction, gpu_block_ids, host_block_ids) -> None:
        self._tracker.check_new(job_id)
        plan = self._planner.plan(gpu_block_ids, host_block_ids, direction=direction)
        self._issued.add(f"{self.label} {direction}")
        job_plan = plan if plan.n_blocks else None
        self._tracker.submit(job_id, direction, plan.num_bytes, self.issuer, job_plan)

    def get_finished(self) -> list[JobResult]:
        return self._tracker.get_finished()

    def wait(self, job_ids) -> None:
        self._tracker.wait(job_ids)

    def shutdown(self) -> list[JobResult]:
        return self._tracker.shutdown()


class EngineCalls:
    """One :class:`TransferEngine` call per ``run()``, for the transfer benchmark: the case's ids submitted as a job
    (the engine plans, chooses its path and issues it on its own stream, fenced after the current one), its finished
    jobs collected before each call; :meth:`device_ms` waits for the calls and returns the device time of each as the
    engine measured it (events around the job on its stream), which the timer uses. A failed job raises.

    Args:
        engine: the engine, over the case's KV caches and host buffer.
        case: the transfer each call makes.
        impl: how it is implemented, for the output; ``{paths}`` in it is replaced by the paths the jobs took.
    """

    def __init__(self, engine: TransferEngine, case: TransferCase, impl: str):
        self.engine, self.case, self.impl = engine, case, impl
        submit = engine.submit_store if case.store else engine.submit_load
        self._submit = lambda job: submit(job, case.gpu_ids, case.host_ids, skip=case.skip)
        self._jobs = 0
        self._ms: dict[int, float] = {}
        self.paths: set[str] = set()
        self.prepared = Prepared(self.run, case.host_ids, self._impl(), emulated=not engine.cuda)
        self.prepared.device_ms = self.device_ms

    def _impl(self) -> str:
        return self.impl.format(paths=" and ".join(sorted(self.paths)) or "not yet known")

    def _collect(self, results: list[JobResult]) -> None:
        for r in results:
            if not r.ok:
                raise RuntimeError(f"{r.direction} job {r.job_id} failed: {r.error}")
            self._ms[r.job_id] = r.seconds * 1e3
            self.paths.add(r.path)
        self.prepared.impl = self._impl()

    def run(self) -> None:
        self._collect(self.engine.get_finished())
        self._jobs += 1
        self._submit(self._jobs)
        if not self.engine.cuda:  # it ran at submission: report it now (a failure raises here)
            self._collect(self.engine.get_finished())

    def device_ms(self, k: int) -> list[float]:
        jobs = range(self._jobs - k + 1, self._jobs + 1)
        self.engine.wait(jobs)
        self._collect(self.engine.get_finished())
        out = [self._ms[j] for j in jobs]
        self._ms.clear()  # the calls before these are not asked for again
        return out
