"""Scheduler side: our :class:`~triton_offload.manager.OffloadManager` behind vLLM's ``OffloadingManager`` API.

vLLM's keys (``OffloadKey`` bytes: a block hash plus the KV-cache group index) are used as they are; each names one
host block. The load and store specs handed back to vLLM carry host block ids in the order of the keys, which is
the order vLLM walks the request's GPU blocks (group by group, chunk by chunk) when it builds the matching
``GPULoadStoreSpec``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from triton_offload.manager import OffloadManager

__all__ = ["HostBlocksSpec", "TritonOffloadingManager", "METRICS"]

logger = logging.getLogger(__name__)

# Prometheus names of our counters and gauge (declared by TritonOffloadingSpec.build_metric_definitions). Bytes moved
# need no metric of ours: vLLM counts them from the workers' TransferResults (vllm:kv_offload_{load,store}_bytes).
METRICS = {
    "hit_blocks": "vllm:triton_offload_hit_blocks",
    "stored_blocks": "vllm:triton_offload_stored_blocks",
    "evicted_blocks": "vllm:triton_offload_evicted_blocks",
    "cached_blocks": "vllm:triton_offload_cached_blocks",
}
_COUNTERS = ("hit_blocks", "stored_blocks", "evicted_blocks")

_LOOKUP = {"ready": LookupResult.HIT, "storing": LookupResult.HIT_PENDING, None: LookupResult.MISS}


class HostBlocksSpec(BlockIDsLoadStoreSpec):
    """Host block ids in our packed host cache, one per offload key, in the keys' order.

    Small and picklable (a NumPy array): it travels to the workers inside vLLM's connector metadata.
    """


class TritonOffloadingManager(OffloadingManager):
    """Adapts :class:`~triton_offload.manager.OffloadManager` to vLLM's scheduler-side manager API.

    Single-threaded, like vLLM's own CPU manager: the 0.33 ``lock`` stays the default no-op.

    Args:
        num_blocks: host blocks in the cache (identical to every worker's host cache).
        eviction_policy: ``"lru"`` or ``"arc"``.
        enable_events: report stores and evictions as vLLM ``OffloadingEvent``\\ s.
        info: static facts published through 0.33's ``config_info`` (label name to value).
    """

    def __init__(
        self,
        num_blocks: int,
        eviction_policy: str = "lru",
        *,
        enable_events: bool = False,
        info: dict[str, str | int | float | bool] | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.eviction_policy = eviction_policy
        self.enable_events = enable_events
        self._info = dict(info or {})
        self._manager = OffloadManager(num_blocks, eviction_policy, enable_events=enable_events)
        # Ours, not the inner manager's: they must survive reset_cache, which replaces the inner manager.
        self._totals = dict.fromkeys(_COUNTERS, 0)
        self._reported = dict.fromkeys(_COUNTERS, 0)

    # -- loads ---------------------------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # HIT_PENDING (store in flight) makes vLLM retry the request a step later instead of recomputing it.
        return _LOOKUP[self._manager.key_state(key)]

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> HostBlocksSpec:
        keys = list(keys)
        block_ids = self._manager.prepare_load(keys)  # in the order of the keys, as vLLM pairs them with GPU blocks
        self._totals["hit_blocks"] += len(keys)
        # A load is a reuse: make the keys recent now, or this request's own stores could evict them right away.
        self._manager.touch(_prefix_order(keys, req_context))
        _reused(req_context).update(dict.fromkeys(keys))
        return HostBlocksSpec(block_ids)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._manager.touch(_prefix_order(keys, req_context))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._manager.complete_load(list(keys))

    # -- stores --------------------------------------------------------------------------------------------------

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        # Offered keys already on the host were computed again on the GPU (device prefix hits): reused all the same.
        state = self._manager.key_state
        _reused(req_context).update(dict.fromkeys(key for key in keys if state(key) == "ready"))
        out = self._manager.prepare_store(keys)
        if out is None:
            return None  # vLLM counts it (allocation failure) and stores nothing for this offer
        self._totals["evicted_blocks"] += len(out.evicted_keys)
        return PrepareStoreOutput(
            keys_to_store=list(out.keys_to_store),
            store_spec=HostBlocksSpec(out.host_block_ids),
            evicted_keys=list(out.evicted_keys),
        )

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        # vLLM hands back a job's keys as a set: restore prefix order so the policy keeps prefix heads longest.
        keys = _prefix_order(keys, req_context)
        self._manager.complete_store(keys, success=success)
        if success:
            self._totals["stored_blocks"] += len(keys)

    # -- requests, events, housekeeping --------------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        # vLLM calls touch() nowhere (0.32, 0.33). Refresh the request's reused keys once more at its end, head
        # first, so they are more recent than the tail it stored meanwhile: losing a prefix head makes every block
        # after it useless, losing the tail costs only the tail.
        reused = req_context.get_state(_ReusedKeys)
        if reused is not None and reused.keys:
            self._manager.touch(_prefix_order(reused.keys, req_context))
            reused.keys.clear()

    def take_events(self) -> Iterable[OffloadingEvent]:
        for event in self._manager.take_events():
            yield OffloadingEvent(keys=list(event.keys), medium=Medium.CPU, removed=event.kind == "removed")

    def reset_cache(self) -> None:
        # vLLM never completes the jobs in flight at a reset (their reports are dropped as stale), so pinned and
        # storing keys must go too: start from an empty manager. Reusing their blocks at once is safe because vLLM
        # makes the workers wait for those jobs (jobs_to_flush) before it submits any new transfer.
        self._manager = OffloadManager(self.num_blocks, self.eviction_policy, enable_events=self.enable_events)

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        for name in _COUNTERS:
            delta = self._totals[name] - self._reported[name]
            if delta:
                stats.increase_counter(METRICS[name], delta)
        self._reported = dict(self._totals)
        stats.set_gauge(METRICS["cached_blocks"], self._manager.num_cached)
        return stats

    def config_info(self) -> Sequence[dict[str, str | int | float | bool]]:  # vLLM >= 0.33 reads it once
        return [dict(self._info)]

    @property
    def counters(self) -> dict[str, int]:
        """Totals since start: host blocks loaded (hits), stored, evicted; and the blocks cached now."""
        return {**self._totals, "cached_blocks": self._manager.num_cached, "host_blocks": self.num_blocks}

    def shutdown(self) -> None:
        logger.info("triton-offload scheduler counters: %s", self.counters)


@dataclass
class _ReusedKeys:
    """Per-request scratch (kept in vLLM's ReqContext): host keys the request loaded or found already stored."""

    keys: dict[OffloadKey, None] = field(default_factory=dict)


def _reused(req_context: ReqContext) -> dict[OffloadKey, None]:
    state = req_context.get_state(_ReusedKeys)
    if state is None:
        state = _ReusedKeys()
        req_context.set_state(state)
    return state.keys


def _prefix_order(keys: Collection[OffloadKey], req_context: ReqContext) -> list[OffloadKey]:
    """The keys ordered by the end token vLLM recorded for each, or as given when a position is unknown."""
    keys = list(keys)
    positions = [req_context.get_offload_key_position(key) for key in keys]
    if len(keys) > 1 and None not in positions:
        keys = [key for _, key in sorted(zip(positions, keys), key=lambda pair: pair[0])]
    return keys
