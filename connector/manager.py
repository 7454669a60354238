"""Scheduler side: our :class:`~triton_offload.manager.OffloadManager` behind vLLM's ``OffloadingManager`` API
(:class:`TritonOffloadingManager`). vLLM's keys (``OffloadKey`` bytes: a block hash plus the KV-cache group index) are
used as they are; each names one host block. The load and store specs handed back to vLLM (:class:`HostBlocksSpec`)
carry host block ids in the order of the keys, which is the order vLLM walks the request's GPU blocks (group by group,
chunk by chunk) when it builds the matching ``GPULoadStoreSpec``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from operator import itemgetter

import numpy as np
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
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from triton_offload.integrity import CarriesIdentities, keep_digests
from triton_offload.manager import OffloadManager, RequestUse
from triton_offload.policies.slots import long_array

__all__ = ["HostBlocksSpec", "TritonOffloadingManager", "METRICS", "VLLM_TRANSFER_COUNTERS"]

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
# vLLM's own transfer counters, which its connector fills from the workers' results (vLLM >= 0.32: declared for every
# offloading spec). vLLM creates a metric's series only when a stats report names it, so the first report from this
# manager names these at zero too: every counter a user looks for is in /metrics from the first engine step, before
# its first hit, eviction or load.
VLLM_TRANSFER_COUNTERS = (
    "vllm:kv_offload_load_bytes",
    "vllm:kv_offload_load_time",
    "vllm:kv_offload_store_bytes",
    "vllm:kv_offload_store_time",
)


class HostBlocksSpec(CarriesIdentities, BlockIDsLoadStoreSpec):
    """Host block ids in our packed host cache, one per offload key, in the keys' order; with the integrity checks,
    each key's identity too (:func:`triton_offload.integrity.identities_of_keys`, kept as its digest:
    :class:`~triton_offload.integrity.CarriesIdentities`), which the workers mix into the blocks' checksums
    (docs/integrity.md).

    Small and picklable: it travels to the workers inside vLLM's connector metadata.
    """

    def __init__(self, block_ids, identities=None):
        super().__init__(block_ids)
        self.identities = identities


class TritonOffloadingManager(OffloadingManager):
    """Adapts :class:`~triton_offload.manager.OffloadManager` to vLLM's scheduler-side manager API.

    Single-threaded, like vLLM's own CPU manager: the 0.33 ``lock`` stays the default no-op.

    Each request's uses go through one :class:`~triton_offload.manager.RequestUse` kept in vLLM's ``ReqContext``, so a
    request reading or offering again blocks it stored itself, or reusing a block twice, counts one use (vLLM's rule;
    it matters for ARC). A context without a request id (``req_id=""``) is anonymous: each of its calls counts as a
    use of its own, as every touch does in vLLM. The policy sees each call's keys in prefix order (by the end token
    vLLM records for each key, group-interleaved), while the specs keep vLLM's order; without recorded positions, the
    order vLLM passed them in. A job's completion changes no recency (vLLM reports a job's keys as a set, whose order
    varies from run to run).

    Args:
        num_blocks: host blocks (rows) in the cache (identical to every worker's host cache).
        eviction_policy: ``"lru"`` or ``"arc"``.
        enable_events: report stores and evictions as vLLM ``OffloadingEvent``\\ s.
        info: static facts published through 0.33's ``config_info`` (label name to value).
        identities: give each host block the identity of its key in the specs (the integrity checks).
        pools: host regions of a row (each a block pool: a row holds one key per region); ``pool_of`` maps a key to
            its region (see :class:`~triton_offload.manager.OffloadManager`).
    """

    def __init__(
        self,
        num_blocks: int,
        eviction_policy: str = "lru",
        *,
        enable_events: bool = False,
        info: dict[str, str | int | float | bool] | None = None,
        identities: bool = False,
        pools: int = 1,
        pool_of=None,
    ) -> None:
        self.num_blocks = num_blocks
        self.identities = identities
        # Key slot (:meth:`key_slots`) -> the identity its store gave the key it holds (int64; its digest's 8 bytes),
        # so that loads read rather than hash them: a ready key's slot was written by its store (every key becomes
        # ready through prepare_store). Lazily zeroed (O(1) to create); it outlives reset_cache, whose new manager's
        # stores write it anew.
        table = long_array(num_blocks * pools if identities else 0)
        self._identity, self._digest = np.frombuffer(table, np.int64), table.cast("B")  # (a view of it in bytes)
        # Key slot (:meth:`key_slots`) -> key of the blocks pinned by loads: a failed integrity check names them.
        self._loading: dict[int, OffloadKey] = {}
        self.eviction_policy = eviction_policy
        self.enable_events = enable_events
        self._pools, self._pool_of = pools, pool_of
        self._info = dict(info or {})
        self._retired: list = []  # the tables of the managers reset_cache replaced, still to drop
        self._set_manager()
        # Ours, not the inner manager's: they must survive reset_cache, which replaces the inner manager.
        self._totals = dict.fromkeys(_COUNTERS, 0)
        self._reported = dict.fromkeys(_COUNTERS, 0)
        self._announced = False  # whether a stats report has named every counter (at zero) yet

    # -- loads ---------------------------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # The manager's key_state, inlined: vLLM calls this once per key of every request it schedules. Without
        # ghosts membership says ready, leaving the slot's int object (a cache miss in a large cache) untouched.
        shard = self._shards[hash(key) % self._mod]
        if (key in shard) if self._ready_only else shard.get(key, -1) >= 0:  # ARC's ghosts have negative codes
            return LookupResult.HIT
        # HIT_PENDING (store in flight) makes vLLM retry the request a step later instead of recomputing it.
        return LookupResult.HIT_PENDING if key in self._storing else LookupResult.MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> HostBlocksSpec:
        keys = list(keys)
        # A load is a use, applied now (not at the request's end): this request's own stores that follow must not
        # evict what it just loaded.
        ordered = _prefix_order(keys, req_context)
        block_ids = self._manager.prepare_load(ordered, self._request_use(req_context))
        if ordered is not keys:  # ids go back in vLLM's order of the keys, as it pairs them with GPU blocks
            where = dict(zip(ordered, block_ids))
            block_ids = [where[key] for key in keys]
        self._totals["hit_blocks"] += len(keys)
        if not self.identities:
            return HostBlocksSpec(block_ids)
        slots = self.key_slots(keys, block_ids)
        self._loading.update(zip(slots, keys))
        if len(slots) == 1:  # a slice for less than take() converting a list
            return HostBlocksSpec(block_ids, bytes(self._digest[slots[0] * 8 : slots[0] * 8 + 8]))
        return HostBlocksSpec(block_ids, self._identity.take(slots).tobytes())

    def key_slots(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> list[int]:
        """Where each key lives, as one number: its block id, or with several host regions (pools) ``pool x
        num_blocks + block id`` (the same block id in two pools is two keys of one row). The workers name the host
        blocks of a failed integrity check so (``LoadError.key_slots``). With one pool, a list (the manager's ids are
        ints) is returned as it is, not copied: the store and load paths pass theirs."""
        if self._pools == 1:
            return block_ids if type(block_ids) is list else [int(b) for b in block_ids]
        pool_of, n = self._pool_of, self.num_blocks
        return [pool_of(key) * n + int(b) for key, b in zip(keys, block_ids)]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        # Every hit of this spec comes from host memory: vLLM's metrics count it under source="host", as they do for
        # its own CPU spec (the default would be "external_unspecified").
        return CacheHitSource.HOST

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._manager.touch(_prefix_order(list(keys), req_context), self._request_use(req_context))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        slots = self.key_slots(keys, [self._manager.key_block(key) for key in keys]) if self._loading else None
        self._manager.complete_load(keys)
        if slots:  # a key with no load left in flight (dropped or not) no longer names its block here
            pinned = self._manager.is_pinned
            for key, slot in zip(keys, slots):
                if not pinned(key):
                    self._loading.pop(slot, None)

    def discard_failed(self, key_slots: Iterable[int]) -> list[OffloadKey]:
        """The keys whose bytes failed an integrity check on a worker (loads in flight, or completed in the same
        step), by their slots (:meth:`key_slots`), are dropped: later lookups miss them, so requests recompute and
        store them anew. Returns the keys. Call before the loads' completion is processed."""
        keys = [self._loading[h] for h in dict.fromkeys(key_slots) if h in self._loading]
        self._manager.discard(keys)
        return keys

    # -- stores --------------------------------------------------------------------------------------------------

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        if self._retired:
            self._retired.pop()
        keys = list(keys)
        ordered = _prefix_order(keys, req_context)
        out = self._manager.prepare_store(ordered, self._request_use(req_context))
        if out is None:
            return None  # vLLM counts it (allocation failure) and stores nothing for this offer
        self._totals["evicted_blocks"] += len(out.evicted_keys)
        keys_to_store, host_ids = out.keys_to_store, out.host_block_ids
        if ordered is not keys:  # back to vLLM's order, in which it walks the request's GPU blocks
            where = dict(zip(keys_to_store, host_ids))
            keys_to_store = [key for key in dict.fromkeys(keys) if key in where]
            host_ids = [where[key] for key in keys_to_store]
        identities = None
        if self.identities:  # the keys' identities (digests), each also kept at its key's slot for the loads to read
            identities = keep_digests(keys_to_store, self.key_slots(keys_to_store, host_ids), self._digest)
        # The allocation's lists are the manager's fresh ones, kept by nobody else: handed over as they are.
        return PrepareStoreOutput(
            keys_to_store=keys_to_store, store_spec=HostBlocksSpec(host_ids, identities), evicted_keys=out.evicted_keys
        )

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        # A key with no store in flight (completed already, or dropped by reset_cache) is a no-op, as in vLLM.
        if self._retired:
            self._retired.pop()
        done = self._manager.complete_store(list(keys), success=success)
        if success:
            self._totals["stored_blocks"] += len(done)

    # -- requests, events, housekeeping --------------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        # vLLM calls touch() nowhere (0.32, 0.33). The request used all its blocks until now, so they become recent
        # again, head first: losing a prefix head makes every block after it useless, losing the tail costs only the
        # tail. Counts no reuse.
        state = req_context.get_state(_RequestState)
        if state is not None and state.manager is self._manager and state.use.keys:
            self._manager.finish_request(state.use, _prefix_order(list(state.use.keys), req_context))

    def take_events(self) -> Iterable[OffloadingEvent]:
        for event in self._manager.take_events():
            yield OffloadingEvent(keys=list(event.keys), medium=Medium.CPU, removed=event.kind == "removed")

    def reset_cache(self) -> None:
        # vLLM never completes the jobs in flight at a reset (their reports are dropped as stale), so pinned and
        # storing keys must go too: start from an empty manager. Reusing their blocks at once is safe because vLLM
        # makes the workers wait for those jobs (jobs_to_flush) before it submits any new transfer.
        # Dropping a full manager at once is O(n) (150 ms at 10^6 blocks): its tables are dropped one per later store
        # call instead (a shard of ~1,300 keys, a chunk of 2,048 block keys or an array each).
        self._retired += self._manager.retire()
        self._set_manager()
        self._loading.clear()

    def _set_manager(self) -> None:
        """A new, empty inner manager (O(1) to build), and the tables :meth:`lookup` reads."""
        self._manager = OffloadManager(
            self.num_blocks,
            self.eviction_policy,
            enable_events=self.enable_events,
            pools=self._pools,
            pool_of=self._pool_of,
        )
        self._shards, self._mod, self._storing, self._ready_only = self._manager.lookup_tables()

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        for name in _COUNTERS:
            delta = self._totals[name] - self._reported[name]
            if delta or not self._announced:
                stats.increase_counter(METRICS[name], delta)
        if not self._announced:
            for name in VLLM_TRANSFER_COUNTERS:
                stats.increase_counter(name, 0)
            self._announced = True
        self._reported = dict(self._totals)
        stats.set_gauge(METRICS["cached_blocks"], self._manager.num_cached)
        return stats

    def config_info(self) -> Sequence[dict[str, str | int | float | bool]]:  # vLLM >= 0.33 reads it once
        return [dict(self._info)]

    @property
    def counters(self) -> dict[str, int]:
        """Totals since start: host blocks loaded (hits), stored, evicted; and the blocks cached now."""
        return {
            **self._totals,
            "cached_blocks": self._manager.num_cached,
            "host_blocks": self.num_blocks,
            "host_keys": self.num_blocks * self._pools,
        }

    @property
    def occupancy(self) -> dict[str, int]:
        """The host blocks now: ready (cached), with a store in flight, free; and the cached ones pinned by loads."""
        m = self._manager
        return {"cached": m.num_cached, "storing": m.num_storing, "free": m.num_free, "pinned": m.num_pinned}

    def shutdown(self) -> None:
        logger.info("triton-offload scheduler counters: %s; host blocks at shutdown: %s", self.counters, self.occupancy)

    def _request_use(self, req_context: ReqContext) -> RequestUse | None:
        if not req_context.req_id:
            # No request identity (vLLM's own manager tests pass one ReqContext(req_id="") to every call): every call
            # is a use of its own, as in vLLM, where a touch always counts.
            return None
        state = req_context.get_state(_RequestState)
        if state is None or state.manager is not self._manager:  # new request, or its history predates a reset
            state = _RequestState(self._manager, RequestUse())
            req_context.set_state(state)
        return state.use


@dataclass
class _RequestState:
    """Per-request scratch kept in vLLM's ReqContext: the request's uses, for the manager they belong to."""

    manager: OffloadManager
    use: RequestUse


def _prefix_order(keys: list[OffloadKey], req_context: ReqContext) -> list[OffloadKey]:
    """The keys sorted by the end token vLLM recorded for each (stable: groups interleave block by block), or the
    same list object when a position is unknown or the keys are in that order already."""
    if len(keys) < 2:
        return keys
    # vLLM's ReqContext keeps the positions in a dict: read it directly (one C loop rather than a method call per key).
    table = getattr(req_context, "_offload_key_positions", None)
    position = table.get if isinstance(table, dict) else req_context.get_offload_key_position
    positions = list(map(position, keys))
    if None in positions or positions == sorted(positions):
        return keys
    return [key for _, key in sorted(zip(positions, keys), key=itemgetter(0))]
