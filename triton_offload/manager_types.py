"""The values :class:`~triton_offload.manager.OffloadManager`'s calls take and return: what a store was given
(:class:`StoreAllocation`), what happened to a key (:class:`OffloadEvent`), the counters (:class:`ManagerStats`), the
state for a test or a log (:class:`ManagerSnapshot`) and a request's use of keys (:class:`RequestUse`). Stdlib only.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal

__all__ = ["StoreAllocation", "OffloadEvent", "ManagerStats", "ManagerSnapshot", "RequestUse"]


@dataclass(frozen=True)
class StoreAllocation:
    """What a successful :meth:`OffloadManager.prepare_store` decided.

    Attributes:
        keys_to_store: the keys to copy to the host, in call order (already cached keys and repeats left out).
        host_block_ids: the host block of each key in ``keys_to_store``, same length and order.
        evicted_keys: keys evicted to make room, in eviction order; their blocks may be among ``host_block_ids``.
    """

    keys_to_store: list[Hashable]
    host_block_ids: list[int]
    evicted_keys: list[Hashable]


@dataclass(frozen=True)
class OffloadEvent:
    """A change in the set of cached keys, for KV-event consumers (e.g. a cache-aware router).

    Attributes:
        kind: ``"stored"`` when keys became ready, ``"removed"`` when they were evicted or dropped by a reset.
        keys: the keys concerned, in the order they were stored or evicted.
    """

    kind: Literal["stored", "removed"]
    keys: list[Hashable]


@dataclass(frozen=True)
class ManagerStats:
    """Counters since construction.

    Attributes:
        hits: keys counted by :meth:`OffloadManager.lookup` (the ready prefixes).
        misses: keys passed to ``lookup`` past the ready prefix, per call (a repeated lookup counts again).
        stores: keys whose store completed successfully.
        store_failures: keys whose store completed with ``success=False``.
        evictions: keys evicted to make room (a reset is not counted).
    """

    hits: int
    misses: int
    stores: int
    store_failures: int
    evictions: int


@dataclass(frozen=True)
class ManagerSnapshot:
    """The complete state of a manager as plain values, for tests and debugging (O(n) to build).

    Attributes:
        ready: key to host block id of every ready key.
        storing: key to host block id of every key whose store is in flight.
        pins: key to the number of loads in flight, for pinned keys only.
        free_block_ids: the free list, in the order blocks are handed out last to first (with several pools, one
            such tuple per pool).
        policy: the policy's own snapshot (with several pools, ``{"pools": (each pool's snapshot, ...)}``).
        stats: the counters.
        pending_events: events not yet taken (empty when events are disabled).
    """

    ready: dict[Hashable, int]
    storing: dict[Hashable, int]
    pins: dict[Hashable, int]
    free_block_ids: tuple[int, ...]
    policy: dict[str, object]
    stats: ManagerStats
    pending_events: tuple[OffloadEvent, ...]


class RequestUse:
    """What one request did with the cache, so that its uses count once; create one per request.

    Pass it to every :meth:`OffloadManager.prepare_store`, :meth:`~OffloadManager.prepare_load` and
    :meth:`~OffloadManager.touch` of the request, then to :meth:`~OffloadManager.finish_request`. It holds only keys
    the request named (dropped with the request) and no reference to the manager, so a caller that replaces its
    manager (a reset) must start new ones.

    Attributes:
        inserted: keys this request's stores put into the cache: reading or offering them again is not a reuse.
        reused: keys cached by others that this request has reused (counted once).
        keys: every key the request stored or used while it was cached, in the order first named (its prefix order
            when the caller passes keys head first, as vLLM does), with the slot it held when last named.
    """

    __slots__ = ("inserted", "reused", "keys")

    def __init__(self) -> None:
        self.inserted: set[Hashable] = set()
        self.reused: set[Hashable] = set()
        self.keys: dict[Hashable, int] = {}

    def __repr__(self) -> str:
        return f"RequestUse(inserted={len(self.inserted)}, reused={len(self.reused)}, keys={len(self.keys)})"
