"""Worker-side transfer engine: a store or load is planned (:mod:`triton_offload.plan`), its path chosen
(:mod:`triton_offload.path_choice`), issued by that path's issuer (:mod:`triton_offload.issuers`) and tracked to
completion on a side stream per lane (:mod:`triton_offload.jobs`): stores, loads, and expedited loads. Everything that
does not change per call is built and checked once, at construction. With the integrity checks, every transfer also
checksums the blocks it moves (docs/integrity.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import numpy as np
import torch

from triton_offload._checks import int_in_range, transfer_path
from triton_offload._checks import launch_shape as check_launch_shape
from triton_offload.calibrate import calibrate, canary_issuers
from triton_offload.checksums import NO_BLOCKS, BlockRefs, Checksums
from triton_offload.issuers.base import Issuer, IssuerContext
from triton_offload.issuers.factory import PATHS, PathUnavailable, describe_launch_paths, kernel_launcher
from triton_offload.jobs import JobResult, JobTracker
from triton_offload.layouts import KVCacheSpec
from triton_offload.path_choice import Calibration, cheapest
from triton_offload.plan import BlockIds, Direction, TransferPath, TransferPlan, TransferPlanner, check_host_buffer
from triton_offload.staging import IdStager

__all__ = ["TransferEngine", "JobResult", "STORE", "LOAD", "EXPEDITED", "LANES"]

logger = logging.getLogger(__name__)

# The directions by their short names, as the connector and the benchmarks spell them.
STORE, LOAD = Direction.STORE, Direction.LOAD
# The lane of expedited loads (vLLM 0.33's synchronous loads, which the step waits for): a stream of their own, so
# they never queue behind asynchronous loads submitted earlier (as vLLM's own worker gives them a handler and stream of
# their own).
EXPEDITED = "expedited load"
# The engine's lanes, one side stream each.
LANES = (STORE, LOAD, EXPEDITED)
_BUILT_IN = {p.value for p in TransferPath}


class TransferEngine:
    """Runs stores (GPU -> host) and loads (host -> GPU) of one worker's KV caches asynchronously.

    Args:
        kv: the worker's prepared KV caches.
        host_buffer: the packed host buffer, (num_host_blocks, kv.host_block_bytes(blocks_per_host_block)); pinned
            on CUDA (see :class:`triton_offload.host.cache.HostCache`).
        blocks_per_host_block: GPU blocks per host block (f).
        num_ctas: programs each launch may occupy; None for the kernel's default.
        launch_shape: how a launch picks its programs: ``"fixed"`` (``num_ctas``, or the default's) or
            ``"size-aware"`` (by the caches' page runs, never above ``num_ctas``; see
            :mod:`triton_offload.kernels.copy_blocks`).
        fast_launch: launch the kernel's compiled variant directly, past Triton's per-call dispatch, where a canary
            transfer at creation proves it moves the same bytes (:mod:`triton_offload.fast_launch`); None follows
            ``TRITON_OFFLOAD_FAST_LAUNCH`` (on unless it is ``0``). ``launch_paths`` says what each direction uses.
        path: how transfers move: ``"kernel"`` (the Triton kernel), ``"dma"`` (one ``cuMemcpyBatchAsync`` of
            coalesced descriptors, :mod:`triton_offload.issuers.dma`), another path of ``issuers``, or ``"auto"`` (per
            call, the one a calibration made now predicts fastest, :mod:`triton_offload.path_choice`). None:
            ``"auto"`` on CUDA, ``"kernel"`` on CPU.
        calibration: for ``"auto"``, use this :class:`~triton_offload.path_choice.Calibration` instead of measuring
            one (required on CPU, where nothing can be measured).
        checksums: the integrity checks (:class:`~triton_offload.checksums.Checksums`: ``"verify"`` or
            ``"require"`` and a checksum table beside the host buffer, e.g. :attr:`triton_offload.host.cache.HostCache.
            checksums`); None (the default): none. With them, a store writes each block's checksum and a load checks
            it; a load's result says which blocks failed (:meth:`load_failures`). docs/integrity.md.
        issuers: the transfer paths by name, each a builder of its issuer from an
            :class:`~triton_offload.issuers.base.IssuerContext` (one per lane); None:
            :data:`triton_offload.issuers.factory.PATHS`. ``auto`` chooses among those that can run here.
        tracker: the :class:`~triton_offload.jobs.JobTracker` of :data:`LANES` to run the jobs on (tests pass one
            over a stand-in for ``torch.cuda``); None: one on the caches' device.

    Raises:
        ValueError: a bad argument, a path that cannot run here asked for by name (``"dma"`` where the driver has no
            ``cuMemcpyBatchAsync``), or ``"auto"`` on CPU without a calibration.
    """

    def __init__(
        self,
        kv: KVCacheSpec,
        host_buffer: torch.Tensor,
        *,
        blocks_per_host_block: int = 1,
        num_ctas: int | None = None,
        launch_shape: str = "fixed",
        fast_launch: bool | None = None,
        path: str | None = None,
        calibration: Calibration | None = None,
        checksums: Checksums | None = None,
        issuers: Mapping[str, Callable[[IssuerContext], Issuer]] | None = None,
        tracker: JobTracker | None = None,
    ):
        self.kv = kv
        self.host_buffer = host_buffer
        if checksums is not None and not isinstance(checksums, Checksums):
            raise TypeError(f"checksums must be a triton_offload.checksums.Checksums or None, got {checksums!r}")
        self.checksums = checksums
        # Fixed for the engine's life, so checked once here; a job then checks only its ids.
        self.blocks_per_host_block = int_in_range(blocks_per_host_block, "blocks_per_host_block", 1)
        check_host_buffer(kv, host_buffer, self.blocks_per_host_block)
        self.num_ctas = None if num_ctas is None else int_in_range(num_ctas, "num_ctas", 1)
        self.launch_shape = check_launch_shape(launch_shape)
        self.cuda = kv.device.type == "cuda"
        builders = dict(PATHS if issuers is None else issuers)
        default = TransferPath.AUTO if self.cuda else TransferPath.KERNEL
        self.path = transfer_path(default if path is None else path, choices=(TransferPath.AUTO, *builders))
        if self.path in _BUILT_IN:  # a path added to PATHS keeps its str name
            self.path = TransferPath(self.path)
        if kv.quant is not None and self.path is TransferPath.AUTO:
            # Only the kernel quantizes (the copy engines move bytes): nothing for auto to choose or calibrate.
            self.path = TransferPath.KERNEL
        self._planner = TransferPlanner(kv, host_buffer.shape[0], self.blocks_per_host_block)
        # Test and profiling hook: trace(step) is called at each step of a submission (bench/micro/call_cost.py).
        self.trace = None
        # The kernel's launcher for both directions, its tables and shapes built now, on the caller's stream and
        # synchronously, rather than by the first job on whichever side stream it runs (the other stream would read
        # them unordered); launching directly where a canary proves it (the verdicts in ``launch_paths``). The kernel
        # launches of every path (the copy engines' checks too) and the calibration pass the same programs.
        kernel = kernel_launcher(kv, host_buffer, self.blocks_per_host_block, checksums=self.checksums,
                                 num_ctas=self.num_ctas, launch_shape=self.launch_shape,
                                 fast_launch=fast_launch)  # fmt: skip
        self._launcher, self._kernel_ctas, self.launch_paths = kernel
        logger.info("triton-offload engine: %s", describe_launch_paths(self.launch_paths))
        # Chosen once here: a store lane, a load lane and an expedited-load lane, so loads (on the critical path of a
        # request waiting for its prefix) never queue behind a long store, and a load the step waits for (expedited)
        # never queues behind earlier asynchronous loads.
        #
        # The lanes are not ordered against each other, and do not need to be, under one invariant: a GPU block that
        # a pending store still reads is not overwritten (by a load, or by the model) before that store completes.
        # vLLM keeps it: when it hands out again a block whose store is pending, it flushes that store
        # (jobs_to_flush) and waits for it (wait) before it submits any transfer of the step (vLLM 0.33; vLLM 0.32
        # under MultiConnector does not, and is refused at startup: connector/preflight.py). Broken, a load would
        # overwrite the block while the store reads it, and the host block would hold a mix of two requests' KV,
        # loaded later as a hit. Guarded here too, cheaply: a load into a block a pending store of this engine reads
        # waits for that store on the device (_stores_reading, tests/unit/test_engine_lanes.py).
        self._tracker = JobTracker(kv.device, LANES, name="the transfer engine") if tracker is None else tracker
        # Paths that cannot run here (auto goes on without them), with why.
        self._unavailable: dict[str, str] = {}
        paths = tuple(builders) if self.path is TransferPath.AUTO else (self.path,)
        self._issuers = {lane: self._lane_issuers(lane, paths, builders) for lane in LANES}
        self.calibration = self._calibration(calibration, builders) if self.path is TransferPath.AUTO else None
        # Per GPU block, the sequence number of the last store that reads it (0: none); the pending stores by number;
        # the highest number reported complete (a lane completes in order, so every lower one is complete too).
        self._store_reads = np.zeros(kv.num_blocks, dtype=np.int64)
        self._store_seq = self._stores_done = 0
        self._pending_stores: dict[int, int] = {}  # store sequence number -> job id
        self._store_seq_of: dict[int, int] = {}  # job id -> store sequence number
        self.ordered_loads = 0  # loads that had to wait for a pending store of the same blocks
        # Per (direction, path): jobs, bytes, measured seconds and the chosen path's predicted seconds.
        self._path_totals: dict[tuple[Direction, str], list] = {}

    # -- construction -------------------------------------------------------------------------------------------
    def _lane_issuers(self, lane, paths, builders) -> dict[str, Issuer]:
        """The issuers of one lane's jobs, in the builders' order (the kernel first: it wins ties). Id slots are
        allocated on the lane's stream: if a job fails and its slot is dropped, the caching allocator hands that
        memory out again only in that stream's order, after the queued copy."""
        stager = IdStager(self.kv.device, self._tracker.streams[lane]) if self.cuda else None
        ctx = IssuerContext(self.kv, self.host_buffer, self.blocks_per_host_block, self._launcher, stager,
                            self._kernel_ctas)  # fmt: skip
        out: dict[str, Issuer] = {}
        for path in paths:
            if path in self._unavailable:
                continue
            try:
                out[path] = builders[path](ctx)
            except PathUnavailable as e:
                if self.path is not TransferPath.AUTO:
                    raise ValueError(f"transfer path {path!r} cannot run here: {e}") from e
                logger.warning("triton-offload engine: no %r path (%s): 'auto' goes on without it", path, e)
                self._unavailable[path] = f"no {path!r} path: {e}"
        if not out:
            raise ValueError(f"no transfer path can run here: {'; '.join(self._unavailable.values())}")
        return out

    def _calibration(self, calibration: Calibration | None, builders) -> Calibration:
        """The given calibration, or one measured now on canary blocks of this engine's layout (CUDA), of every path
        that can run here."""
        if calibration is None:
            if not self.cuda:
                raise ValueError(
                    "transfer path 'auto' calibrates the paths on the GPU: on CPU choose one by name, or pass a "
                    "calibration"
                )
            paths = [p for p in builders if p not in self._unavailable]
            issuers_for = canary_issuers(self._launcher, self._kernel_ctas, paths, builders)
            note = "; ".join(self._unavailable.values()) or None
            calibration = calibrate(self.kv, self.blocks_per_host_block, issuers_for, note)
        logger.info(
            "triton-offload engine: transfer path auto, calibrated in %.3f s: %s",
            calibration.seconds,
            calibration.describe(),
        )
        return calibration

    # -- submission ---------------------------------------------------------------------------------------------
    def submit_store(
        self,
        job_id: int,
        gpu_block_ids: BlockIds,
        host_block_ids: BlockIds,
        *,
        skip=0,
        group_sizes=None,
        identities: BlockIds | None = None,
    ) -> None:
        """Queues a copy of GPU blocks into host blocks (position ``skip + i`` for GPU block i).

        With KV-cache groups, ids are concatenated group by group, ``group_sizes`` gives the GPU ids per group and
        ``skip`` may be one per group (see :meth:`triton_offload.plan.TransferPlanner.plan`). ``identities``: with the
        integrity checks, one 64-bit value per host id naming its content (a key's hash,
        :func:`triton_offload.integrity.key_identity`); a load must name a block as its store did. Default: the host
        id. Bad input raises here, before anything is queued, a ``job_id`` still pending (submitted, its result not
        yet returned by :meth:`get_finished`) included.
        """
        self._submit(job_id, STORE, gpu_block_ids, host_block_ids, skip, group_sizes, STORE, identities)

    def submit_load(
        self,
        job_id: int,
        gpu_block_ids: BlockIds,
        host_block_ids: BlockIds,
        *,
        skip=0,
        group_sizes=None,
        identities: BlockIds | None = None,
        expedited: bool = False,
    ) -> None:
        """Queues a copy of host blocks into GPU blocks; arguments as :meth:`submit_store`. ``expedited``: a load the
        caller will wait for soon (vLLM 0.33's synchronous loads), on a stream of its own, so that it never queues
        behind earlier loads that are not. With the integrity checks, the job's result says which blocks failed
        (:meth:`load_failures`): their bytes were copied all the same, and must not be used."""
        lane = EXPEDITED if expedited else LOAD
        self._submit(job_id, LOAD, gpu_block_ids, host_block_ids, skip, group_sizes, lane, identities)

    def load_failures(self, result: JobResult) -> tuple[BlockRefs, int]:
        """(the blocks of a finished load whose integrity check failed, blocks loaded without a checksum to check):
        each failed block with its GPU block, the host block it came from and the identity it was checked under
        (:meth:`~triton_offload.checksums.Checksums.failures`: ``"require"`` counts a block stored without a checksum
        as failed, ``"verify"`` loads it unchecked). None failed without the checks."""
        if self.checksums is None:
            return NO_BLOCKS, 0
        return self.checksums.failures(result.check)

    def _submit(
        self, job_id, direction: Direction, gpu_block_ids, host_block_ids, skip, group_sizes, lane, identities=None
    ) -> None:
        # Bad input is the caller's bug: raise now, before anything is queued, rather than report a failed job.
        self._tracker.check_new(job_id)
        trace = self.trace
        if trace is not None:
            trace("submit")
        plan = self._planner.plan(
            gpu_block_ids,
            host_block_ids,
            direction=direction,
            skip=skip,
            group_sizes=group_sizes,
            identities=identities,
        )
        if trace is not None:
            trace("plan")
        issuers = self._issuers[lane]
        path, predicted = self._choose(plan, issuers)
        after = ()
        if self._tracker.cuda and plan.n_blocks:
            if direction is STORE:
                self._store_seq += 1
                self._store_reads[plan.gpu_ids] = self._store_seq
                self._pending_stores[self._store_seq] = job_id
                self._store_seq_of[job_id] = self._store_seq
            elif self._pending_stores:
                after = self._stores_reading(plan.gpu_ids)
        self._tracker.submit(
            job_id,
            direction,
            plan.num_bytes,
            issuers[path],
            plan if plan.n_blocks else None,
            lane=lane,
            path=path,
            predicted=predicted,
            trace=trace,
            after=after,
        )
        if trace is not None:
            trace("done")

    def _stores_reading(self, gpu_ids: np.ndarray) -> tuple[int, ...]:
        """The pending store a load into ``gpu_ids`` must follow, as a job id in a tuple (empty: none). The stores
        complete in order on their lane, so following the last one that reads any of the blocks follows them all.
        Nothing vLLM submits should ever need it (the engine's invariant, in ``__init__``): it is logged."""
        last = int(self._store_reads[gpu_ids].max())
        if last <= self._stores_done or last not in self._pending_stores:
            return ()
        if not self._tracker.running(self._pending_stores[last]):
            # Waited for (vLLM's jobs_to_flush), so complete on the device, with every earlier store of its lane.
            return ()
        self.ordered_loads += 1
        blocks = gpu_ids[self._store_reads[gpu_ids] > self._stores_done]
        logger.warning(
            "triton-offload engine: a load overwrites GPU block(s) %s that store job %d still reads: ordered after it "
            "(the caller should have waited for the store)",
            blocks[:8].tolist(),
            self._pending_stores[last],
        )
        return (self._pending_stores[last],)

    def _stores_reported(self, results: list[JobResult]) -> None:
        for r in results:
            seq = self._store_seq_of.pop(r.job_id, None)
            if seq is not None:
                self._pending_stores.pop(seq, None)
                self._stores_done = max(self._stores_done, seq)

    def _choose(self, plan: TransferPlan, issuers: dict[str, Issuer]) -> tuple[str, dict[str, float] | None]:
        """(the path of ``plan``, each path's predicted seconds): the engine's path, or with ``auto`` the one
        predicted cheapest (the predictions go into the job's result)."""
        if self.calibration is None:
            return self.path, None
        copies = {path: issuer.copies(plan) for path, issuer in issuers.items()}
        predicted = self.calibration.predict(plan.direction, plan.num_bytes, copies)
        return cheapest(predicted), predicted

    # -- completion ---------------------------------------------------------------------------------------------
    def get_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call, each reported once, without blocking."""
        results = self._tracker.get_finished()
        if self._pending_stores:
            self._stores_reported(results)
        return self._tally_paths(results)

    def wait(self, job_ids) -> None:
        """Blocks until the given jobs are finished; unknown or already reported ids are ignored."""
        self._tracker.wait(job_ids)

    @property
    def num_pending(self) -> int:
        return self._tracker.num_pending

    def shutdown(self) -> list[JobResult]:
        """Drains every job, then re-raises the first error any job hit. Returns the results not yet reported."""
        try:
            results = self._tracker.shutdown()
            self._stores_reported(results)
            return self._tally_paths(results)
        finally:
            if self.calibration is not None:
                logger.info("triton-offload engine: auto's transfers by path: %s", self.describe_paths())

    def _tally_paths(self, results: list[JobResult]) -> list[JobResult]:
        if self.calibration is None:  # one path: nothing was chosen
            return results
        for r in results:
            totals = self._path_totals.get((r.direction, r.path))
            if totals is None:
                totals = self._path_totals[(r.direction, r.path)] = [0, 0, 0.0, 0.0]
            totals[0] += 1
            totals[1] += r.num_bytes
            totals[2] += r.seconds
            if r.predicted is not None:  # None for a job that moved nothing
                totals[3] += r.predicted[r.path]
        return results

    def path_totals(self) -> dict[str, dict[str, dict]]:
        """With ``auto``, per direction and path, the jobs reported so far: how many, their bytes, their measured
        seconds and the seconds predicted for the path each took (empty for a forced path). A GPU run compares the
        last two (and each result's ``predicted``) to judge the choice."""
        out: dict[str, dict[str, dict]] = {}
        for (direction, path), (jobs, nbytes, seconds, predicted) in self._path_totals.items():
            row = {"jobs": jobs, "bytes": nbytes, "seconds": seconds, "predicted_seconds": predicted}
            out.setdefault(str(direction), {})[path] = row
        return out

    def describe_paths(self) -> str:
        """:meth:`path_totals` as one line for a log, e.g. ``store: kernel 12 jobs 3.100 ms (predicted 2.900 ms)``."""
        parts = []
        for direction, paths in self.path_totals().items():
            each = []
            for path, row in paths.items():
                each.append(
                    f"{path} {row['jobs']} jobs {row['seconds'] * 1e3:.3f} ms (predicted "
                    f"{row['predicted_seconds'] * 1e3:.3f} ms)"
                )
            parts.append(f"{direction}: {', '.join(each)}")
        return "; ".join(parts) or "no jobs reported"
