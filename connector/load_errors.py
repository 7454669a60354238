"""``TritonOffloadingConnector``: vLLM's ``OffloadingConnector`` that reports blocks failing their integrity check
(docs/integrity.md) to vLLM as load errors, so that ``kv_load_failure_policy`` decides: ``"recompute"`` recomputes them
(the tokens of an engine without offloading), ``"fail"`` fails the request. vLLM's own connector cannot: it asserts that
every transfer succeeded. Also here: the integrity counters (:data:`INTEGRITY_METRICS`), the worker metadata that
carries the failed host blocks to the scheduler (:class:`IntegrityWorkerMetadata`), and the spec's refusal of the checks
under any other connector (:func:`check_reporting`).
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import OffloadingCounterMetadata

from triton_offload.connector import CONNECTOR_NAME
from triton_offload.integrity import OFF

__all__ = [
    "CONNECTOR_NAME",
    "INTEGRITY_METRICS",
    "IntegrityWorkerMetadata",
    "TritonOffloadingConnector",
    "check_reporting",
    "integrity_metric_definitions",
    "reporting_connector",
]

logger = logging.getLogger(__name__)

INTEGRITY_METRICS = {
    "failed": "vllm:triton_offload_integrity_failed_blocks",
    "unchecked": "vllm:triton_offload_integrity_unchecked_blocks",
}

# True while TritonOffloadingConnector builds its spec (vLLM builds it, and the scheduler's manager, inside the
# connector's constructor): the spec then knows that failed checks will reach vLLM.
_REPORTING = contextvars.ContextVar("triton_offload_reporting_connector", default=False)


def reporting_connector() -> bool:
    """Whether the spec being built belongs to a :class:`TritonOffloadingConnector` (which reports load errors)."""
    return _REPORTING.get()


def integrity_metric_definitions() -> dict[str, OffloadingCounterMetadata]:
    """The counters of the integrity checks, for a spec's ``build_metric_definitions``."""
    return {
        INTEGRITY_METRICS["failed"]: OffloadingCounterMetadata(
            documentation="GPU blocks whose loaded bytes failed their integrity check (reported to vLLM as load "
            "errors: recomputed, or the request failed, per kv_load_failure_policy)."
        ),
        INTEGRITY_METRICS["unchecked"]: OffloadingCounterMetadata(
            documentation="GPU blocks loaded without a checksum to check (stored without one; integrity = 'verify')."
        ),
    }


def check_reporting(spec, setting: str) -> None:
    """Refuses the integrity checks in a spec whose connector cannot report a failed check.

    Raises:
        ValueError: ``setting`` is not ``"off"`` and the spec was not built by :class:`TritonOffloadingConnector`.
    """
    if setting != OFF and not getattr(spec, "reports_load_errors", False):
        raise ValueError(
            f'integrity = {setting!r} needs "kv_connector": "{CONNECTOR_NAME}" (vLLM\'s OffloadingConnector with '
            "the blocks that fail their check reported to vLLM as load errors; vLLM's own OffloadingConnector "
            "asserts every transfer succeeds). Set it, or integrity = 'off'"
        )


@dataclass
class IntegrityWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker metadata plus what the integrity checks found since the last report.

    Attributes:
        failed_host_blocks: per load job, the host blocks (chunks) whose bytes failed a check on some worker, as the
            scheduler names their keys (``LoadError.key_slots``: with host regions, ``region x rows + block``).
        failed_blocks: GPU blocks that failed, summed over the workers.
        unchecked_blocks: GPU blocks loaded without a checksum, summed over the workers.
    """

    failed_host_blocks: dict[int, list[int]] = field(default_factory=dict)
    failed_blocks: int = 0
    unchecked_blocks: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = OffloadingWorkerMetadata.aggregate(self, other)
        failed = {job: list(ids) for job, ids in self.failed_host_blocks.items()}
        extra = (0, 0)
        if isinstance(other, IntegrityWorkerMetadata):
            for job, ids in other.failed_host_blocks.items():
                failed.setdefault(job, []).extend(i for i in ids if i not in failed.get(job, ()))
            extra = (other.failed_blocks, other.unchecked_blocks)
        return IntegrityWorkerMetadata(
            completed_jobs=merged.completed_jobs,
            transfer_stats=merged.transfer_stats,
            failed_host_blocks=failed,
            failed_blocks=self.failed_blocks + extra[0],
            unchecked_blocks=self.unchecked_blocks + extra[1],
        )


class TritonOffloadingConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector``, reporting the blocks that fail their integrity check as load errors.

    Use it in place of ``OffloadingConnector`` (``"kv_connector": "TritonOffloadingConnector"``; the package's vLLM
    plugin registers the name) with ``TritonOffloadingSpec`` or ``TritonTieringOffloadingSpec``; without the checks
    (``integrity = 'off'``) it behaves exactly as vLLM's.

    Worker side, a load whose blocks failed still completes (its other blocks are good); the failed GPU blocks go to
    vLLM through ``get_block_ids_with_load_errors`` in the same step (one KV-cache group; vLLM maps block ids to
    requests only then), or the request through ``failed_recving`` (several groups, asynchronous loads). The host
    blocks they came from travel to the scheduler in the worker metadata, where ``TritonOffloadingSpec``'s manager
    drops their keys (a later lookup misses them) and the connector counts the failed and unchecked blocks
    (``vllm:triton_offload_integrity_{failed,unchecked}_blocks``).
    """

    def __init__(self, vllm_config, role, kv_cache_config=None):
        token = _REPORTING.set(True)
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            _REPORTING.reset(token)
        transfer = vllm_config.kv_transfer_config
        self._failure_policy = getattr(transfer, "kv_load_failure_policy", "fail")
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        # vLLM maps reported block ids to requests with one KV-cache group only; with several, failed requests.
        self._by_request = len(groups) > 1
        self._invalid: set[int] = set()
        self._failed_requests: set[str] = set()
        self._failed_host_blocks: dict[int, list[int]] = {}
        self._failed = self._unchecked = 0
        # Scheduler side: totals and what was reported (vLLM creates a metric's series when a report names it).
        self._totals = {"failed": 0, "unchecked": 0}
        self._reported = {"failed": 0, "unchecked": 0}
        self._announced = False

    # -- worker side -----------------------------------------------------------------------------------------------

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        worker = self.connector_worker
        jobs = dict(getattr(worker, "_load_jobs", {}))  # job -> request, before vLLM forgets the finished ones
        finished = super().get_finished(finished_req_ids)
        take = getattr(worker.worker, "take_load_errors", None)
        if take is not None:
            errors, unchecked = take()
            self._unchecked += unchecked
            for error in errors:
                self._record(error, jobs.get(error.job_id, "?"))
        return finished

    def _record(self, error, request) -> None:
        if self._by_request and request in (None, "?"):
            # vLLM 0.33's expedited (sync) loads carry no request here, and with several KV-cache groups vLLM takes
            # no block ids: nothing can tell it which request must not use these blocks, so stop rather than let the
            # model read them.
            raise RuntimeError(
                f"{_describe(error, request)}; with several KV-cache groups a synchronous load's failed blocks cannot "
                "be reported to vLLM, so the engine stops"
            )
        self._invalid.update(error.gpu_block_ids)
        if request not in (None, "?"):
            self._failed_requests.add(request)
        known = self._failed_host_blocks.setdefault(error.job_id, [])
        slots = error.key_slots or error.host_block_ids  # the scheduler's names of the keys (regions: region x rows)
        known.extend(h for h in dict.fromkeys(slots) if h not in known)
        self._failed += len(error.gpu_block_ids)
        action = "recomputes them" if self._failure_policy == "recompute" else "fails the request"
        level = logging.WARNING if self._failure_policy == "recompute" else logging.ERROR
        logger.log(
            level,
            "%s; vLLM %s (kv_load_failure_policy = %r)",
            _describe(error, request),
            action,
            self._failure_policy,
        )

    def get_transfer_results(self, finished_req_ids: set[str]):
        results = super().get_transfer_results(finished_req_ids)
        if self._by_request and self._failed_requests:
            # Reported with the request's finished_recving of the same step, as vLLM requires.
            results.failed_recving.update(self._failed_requests & results.finished_recving)
            self._failed_requests -= results.failed_recving
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._by_request:
            return set()
        invalid, self._invalid = self._invalid, set()
        return invalid

    def build_connector_worker_meta(self):
        meta = super().build_connector_worker_meta()
        if not (self._failed_host_blocks or self._failed or self._unchecked):
            return meta
        meta = meta or OffloadingWorkerMetadata()
        out = IntegrityWorkerMetadata(
            completed_jobs=meta.completed_jobs,
            transfer_stats=meta.transfer_stats,
            failed_host_blocks=self._failed_host_blocks,
            failed_blocks=self._failed,
            unchecked_blocks=self._unchecked,
        )
        self._failed_host_blocks, self._failed, self._unchecked = {}, 0, 0
        return out

    # -- scheduler side --------------------------------------------------------------------------------------------

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, IntegrityWorkerMetadata):
            self._totals["failed"] += meta.failed_blocks
            self._totals["unchecked"] += meta.unchecked_blocks
            failed = [h for ids in meta.failed_host_blocks.values() for h in ids]
            manager = self.scheduler.manager
            discard = getattr(manager, "discard_failed", None)
            if failed and discard is not None:
                # Before vLLM completes the loads (which unpins their keys): the keys are still known by their blocks.
                sources = getattr(manager, "chunk_sources", {})
                where = [f"{h} (from {sources[h][1]})" if h in sources else str(h) for h in sorted(set(failed))]
                keys = discard(failed)
                logger.warning(
                    "triton-offload: host block(s) %s failed their integrity check: their %d key(s) now miss, so "
                    "later requests recompute them instead of loading these bytes again",
                    ", ".join(where),
                    len(keys),
                )
        super().update_connector_output(connector_output)

    def get_kv_connector_stats(self):
        stats = super().get_kv_connector_stats()
        if self.connector_scheduler is None:
            return stats
        deltas = {k: self._totals[k] - self._reported[k] for k in self._totals}
        if not self._announced or any(deltas.values()):
            stats = stats if stats is not None else OffloadingConnectorStats()
            for key, delta in deltas.items():
                stats.increase_counter(INTEGRITY_METRICS[key], delta)
            self._reported = dict(self._totals)
            self._announced = True
        return stats


def _describe(error, request: Any) -> str:
    regions = error.regions or (None,) * len(error.gpu_block_ids)
    blocks = ", ".join(
        f"GPU block {g} from {error.tier} block {h}{'' if r is None else f' region {r}'} "
        f"(key identity {i & (2**64 - 1):#018x})"
        for g, h, i, r in zip(error.gpu_block_ids, error.host_block_ids, error.identities, regions)
    )
    return (
        f"triton-offload: KV integrity check failed for request {request} (load job {error.job_id}): "
        f"{len(error.gpu_block_ids)} block(s) loaded from the {error.tier} do not match their checksum: {blocks}"
    )
