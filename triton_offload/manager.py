"""Scheduler-side bookkeeping of the host KV cache: which key (a block hash) lives in which host block, whether its
copy is still in flight (*storing*: not a hit, never evicted) or done (*ready*: a hit, evictable unless a load in
flight pins it), and which key the eviction policy gives up when the cache is full. docs/design.md (section 8) states
the rules it keeps: recency follows use, not completion; a call's first key is evicted last; reuse counts once per
request. O(1) amortised per key and stdlib only, because it runs in the scheduler's critical path.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Literal

from triton_offload._checks import positive_int
from triton_offload.manager_types import ManagerSnapshot, ManagerStats, OffloadEvent, RequestUse, StoreAllocation
from triton_offload.policies import EvictionPolicy, make_policy

__all__ = [
    "OffloadManager",
    "StoreAllocation",
    "OffloadEvent",
    "ManagerStats",
    "ManagerSnapshot",
    "RequestUse",
]

logger = logging.getLogger(__name__)


class OffloadManager:
    """Host block allocation, pinning and eviction for a cache of ``num_blocks`` host blocks (per pool).

    Args:
        num_blocks: host blocks in the cache (in each pool); also the policy's capacity.
        eviction_policy: a name in :data:`triton_offload.policies.POLICIES` (``"lru"`` or ``"arc"``).
        enable_events: record :class:`OffloadEvent`\\ s for :meth:`take_events`.
        pools: independent block pools, each of ``num_blocks`` blocks with ids ``[0, num_blocks)`` of its own and an
            eviction policy of its own: a key only ever takes a block of its pool and only evicts keys of its pool.
            For host rows with several regions (``KVCacheSpec(group_regions=...)``), where block id ``i`` of pool
            r names region r of row ``i``.
        pool_of: the pool of a key (required with several pools).

    Raises:
        ValueError: ``num_blocks`` or ``pools`` is not a positive int, several pools without ``pool_of``, or the
            policy name is unknown (the message lists the supported names).
    """

    def __init__(
        self,
        num_blocks: int,
        eviction_policy: str = "lru",
        *,
        enable_events: bool = False,
        pools: int = 1,
        pool_of: Callable[[Hashable], int] | None = None,
    ) -> None:
        self.num_blocks = positive_int(num_blocks, "num_blocks")
        self.num_pools = positive_int(pools, "pools")
        if pools > 1 and pool_of is None:
            raise ValueError(f"pools = {pools} needs pool_of, the pool of a key")
        self._pool_of = pool_of
        self._policies: list[EvictionPolicy] = [make_policy(eviction_policy, num_blocks) for _ in range(pools)]
        # A stack per pool: popping from the end hands out low ids first on a fresh cache, and a freed block is
        # reused first.
        self._frees: list[list[int]] = [list(range(num_blocks - 1, -1, -1)) for _ in range(pools)]
        # One pool (the common case) keeps its policy and free list at hand: the per-key loops below use them
        # directly.
        self._policy, self._free = self._policies[0], self._frees[0]
        self._ready: dict[Hashable, int] = {}
        self._storing: dict[Hashable, int] = {}
        self._pins: dict[Hashable, int] = {}  # only keys with loads in flight; always a subset of _ready
        # Pinned keys to drop once their last load completes (their bytes failed an integrity check): see discard.
        self._doomed: set[Hashable] = set()
        self._events: list[OffloadEvent] | None = [] if enable_events else None
        self._hits = self._misses = self._stores = self._store_failures = self._evictions = 0

    def _by_pool(self, keys) -> list[tuple[int, list[Hashable]]]:
        """``keys`` split by pool, each pool's keys in call order (pools in order, those without keys left out)."""
        if self.num_pools == 1:
            return [(0, list(keys))]
        split: list[list[Hashable]] = [[] for _ in range(self.num_pools)]
        pool_of = self._pool_of
        for key in keys:
            split[pool_of(key)].append(key)
        return [(p, ks) for p, ks in enumerate(split) if ks]

    # -- queries -------------------------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[Hashable]) -> int:
        """Returns how many leading keys are ready; a key whose store is in flight ends the run like a missing one."""
        ready = self._ready
        hits = 0
        for key in keys:
            if key not in ready:
                break
            hits += 1
        self._hits += hits
        self._misses += len(keys) - hits
        return hits

    def key_state(self, key: Hashable) -> Literal["ready", "storing"] | None:
        """One key's state in O(1): ``"ready"``, ``"storing"`` (store in flight) or None (not cached).

        For callers that look keys up one at a time and must tell a pending store from a miss (vLLM's
        ``HIT_PENDING``). Changes nothing: no counter, no policy access.
        """
        if key in self._ready:
            return "ready"
        return "storing" if key in self._storing else None

    @property
    def num_free(self) -> int:
        """Blocks holding no key (all pools)."""
        return sum(len(free) for free in self._frees)

    @property
    def num_cached(self) -> int:
        """Ready keys (hits); in-flight stores are not counted."""
        return len(self._ready)

    @property
    def num_storing(self) -> int:
        """Keys whose store is in flight."""
        return len(self._storing)

    @property
    def num_pinned(self) -> int:
        """Distinct keys with at least one load in flight."""
        return len(self._pins)

    def __len__(self) -> int:
        """Keys holding a block, ready or storing, so ``len(m) + m.num_free == m.num_blocks * m.num_pools``."""
        return len(self._ready) + len(self._storing)

    @property
    def stats(self) -> ManagerStats:
        return ManagerStats(self._hits, self._misses, self._stores, self._store_failures, self._evictions)

    # -- loads ---------------------------------------------------------------------------------------------------

    def prepare_load(self, keys: Sequence[Hashable], request: RequestUse | None = None) -> list[int]:
        """Pins ready keys for a load and returns their host block ids, in order.

        A load is a use: the keys become the most recently used, the first key most of all (see :meth:`touch` for
        what counts as a reuse). A key may appear more than once (in one call or across calls); each occurrence is
        one pin and needs one occurrence in :meth:`complete_load`.

        Raises:
            ValueError: a key is not ready (not cached, or its store is in flight). Nothing is pinned then.
        """
        ready = self._ready
        for key in keys:  # validate everything first so a bad call pins nothing
            if key not in ready:
                state = "still being stored" if key in self._storing else "not cached"
                raise ValueError(f"cannot load key {key!r}: it is {state}")
        pins = self._pins
        block_ids = []
        for key in keys:
            pins[key] = pins.get(key, 0) + 1
            block_ids.append(ready[key])
        # Now, not when the load completes: the request's own stores that follow must not evict what it loads.
        self._use(keys, request)
        return block_ids

    def complete_load(self, keys: Sequence[Hashable]) -> None:
        """Unpins keys loaded by :meth:`prepare_load` (one pin per occurrence).

        Raises:
            ValueError: a key has fewer loads in flight than occurrences in ``keys``. Nothing is unpinned then.
        """
        pins = self._pins
        counts = Counter(keys)
        for key, n in counts.items():
            if pins.get(key, 0) < n:
                raise ValueError(f"complete_load of key {key!r} x{n}, but it has {pins.get(key, 0)} load(s) in flight")
        for key, n in counts.items():
            left = pins[key] - n
            if left:
                pins[key] = left
            else:
                del pins[key]
                if key in self._doomed:
                    self._doomed.discard(key)
                    self._drop([key])

    def touch(self, keys: Sequence[Hashable], request: RequestUse | None = None) -> None:
        """Marks keys as used, the first one the most recently used; keys not cached are ignored.

        A ready key is reused (ARC moves a once-used key to T2) unless ``request`` already stored or reused it; then,
        like a key whose store is in flight, it is only made recent. Without ``request`` every ready key is reused.
        """
        self._use(keys, request)

    def finish_request(self, request: RequestUse, order: Sequence[Hashable] | None = None) -> None:
        """Ends a request: every key it stored or used that is still cached becomes recent again, counting no reuse.

        The request used its blocks until its end (attention reads the whole prefix at every step), so they are
        newer than anything used before; the first key of ``order`` (default: the order the request first named its
        keys) ends up the most recently used. The request's key list is emptied, so a second call does nothing.
        """
        keys = list(request.keys) if order is None else order
        for pool, pool_keys in self._by_pool(keys):
            policy = self._policies[pool]
            resident, refresh = policy.__contains__, policy.refresh
            for key in reversed(pool_keys):
                if resident(key):
                    refresh(key)
        request.keys.clear()

    def _use(self, keys: Sequence[Hashable], request: RequestUse | None, new: frozenset | set = frozenset()) -> None:
        """Applies one call's keys to the policy in reverse (module docstring); ``new`` keys are inserted.

        A key named twice in one call is one use, at its first position.
        """
        keys = dict.fromkeys(keys)
        if self.num_pools == 1:
            self._use_pool(self._policy, keys, request, new)
        else:
            for pool, pool_keys in self._by_pool(keys):
                self._use_pool(self._policies[pool], pool_keys, request, new)
        if request is not None:
            ready, storing = self._ready, self._storing
            # dict.update keeps the first position of a key seen before: the request's prefix order.
            request.keys.update((key, None) for key in keys if key in ready or key in storing)

    def _use_pool(self, policy: EvictionPolicy, keys, request: RequestUse | None, new) -> None:
        """:meth:`_use` on one pool's keys (distinct, in call order) and its policy."""
        ready, storing = self._ready, self._storing
        access, refresh, insert = policy.access, policy.refresh, policy.insert
        if request is None:
            for key in reversed(keys):
                if key in new:
                    insert(key)
                elif key in ready:
                    access(key)
                elif key in storing:
                    refresh(key)
            return
        inserted, reused = request.inserted, request.reused
        for key in reversed(keys):
            if key in new:
                insert(key)
                inserted.add(key)
            elif key in ready:
                if key in inserted or key in reused:
                    refresh(key)  # the request's own block, or a reuse it already counted
                else:
                    access(key)
                    reused.add(key)
            elif key in storing:
                refresh(key)  # not loadable yet, so not a reuse; still in use by this request

    # -- stores --------------------------------------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[Hashable], request: RequestUse | None = None) -> StoreAllocation | None:
        """Allocates host blocks for the keys not cached yet, evicting per the policy if the free list runs out.

        Keys that are ready or storing are not stored again. Free blocks are used first; eviction never takes a
        pinned key, a storing key or a key named in this call. Every key of the call is a use, applied as in
        :meth:`touch` (new keys enter the policy now, the first key of the call the most recently used); for ARC a
        new key that is a ghost adapts the target and enters T2.

        Returns:
            The decision, or None when room cannot be made for every key to store; then nothing changed (no
            eviction, no allocation, no counter).
        """
        ready, storing = self._ready, self._storing
        # dict.fromkeys drops repeats and keeps call order.
        to_store = [key for key in dict.fromkeys(keys) if key not in ready and key not in storing]
        by_pool = self._by_pool(to_store) if to_store else []
        shortfalls = [(pool, len(pool_keys) - len(self._frees[pool])) for pool, pool_keys in by_pool]
        victims: list[Hashable] = []
        if any(short > 0 for _, short in shortfalls):
            # Pinned keys are ready and never evictable: reject in O(1) rather than walking a cache full of them.
            if sum(max(0, short) for _, short in shortfalls) > len(ready) - len(self._pins):
                return None
            pins, in_call = self._pins, set(keys)
            # Collect first, evict after: a call that cannot be satisfied must leave everything untouched. A pool's
            # policy holds only that pool's keys, so its victims free blocks of that pool.
            for pool, shortfall in shortfalls:
                if shortfall <= 0:
                    continue
                found = 0
                for key in self._policies[pool].evict_candidates():
                    if key in pins or key in in_call or key in storing:
                        continue
                    victims.append((pool, key))
                    found += 1
                    if found == shortfall:
                        break
                else:
                    return None
        if victims:
            for pool, key in victims:
                self._policies[pool].on_evict(key)
                self._frees[pool].append(ready.pop(key))
            victims = [key for _, key in victims]
            self._evictions += len(victims)
            if self._events is not None:
                self._events.append(OffloadEvent("removed", list(victims)))
        if self.num_pools == 1:
            free = self._free
            block_ids = [free.pop() for _ in to_store]
        else:
            pool_of, frees = self._pool_of, self._frees
            block_ids = [frees[pool_of(key)].pop() for key in to_store]
        storing.update(zip(to_store, block_ids))
        self._use(keys, request, new=set(to_store))
        return StoreAllocation(to_store, block_ids, victims)

    def complete_store(self, keys: Sequence[Hashable], success: bool = True) -> list[Hashable]:
        """Ends stores started by :meth:`prepare_store`; returns the keys it ended, in call order.

        On success the keys become ready (hits). Their place in the eviction order stays the one their request gave
        them: a late completion does not make them recent. On failure their blocks are freed, they leave the policy
        and are not reported as cached. A key with no store in flight (already stored, never prepared, dropped by a
        reset) is skipped with a debug log, as vLLM's own manager does, so a repeated or stale completion cannot
        stop the engine.
        """
        storing = self._storing
        unique = []
        for key in dict.fromkeys(keys):
            if key in storing:
                unique.append(key)
            else:
                logger.debug(
                    "complete_store of key %r ignored: it is %s",
                    key,
                    "already stored" if key in self._ready else "not being stored",
                )
        if success:
            ready = self._ready
            for pool, pool_keys in self._by_pool(unique):
                on_stored = self._policies[pool].on_stored
                for key in pool_keys:
                    ready[key] = storing.pop(key)
                    on_stored(key)
            self._stores += len(unique)
            if self._events is not None and unique:
                self._events.append(OffloadEvent("stored", unique))
        else:
            for pool, pool_keys in self._by_pool(unique):
                free, remove = self._frees[pool], self._policies[pool].remove
                for key in pool_keys:
                    free.append(storing.pop(key))
                    remove(key)
            self._store_failures += len(unique)
        return unique

    def key_block(self, key: Hashable) -> int | None:
        """The host block of a ready or storing key, or None."""
        block = self._ready.get(key)
        return self._storing.get(key) if block is None else block

    def is_pinned(self, key: Hashable) -> bool:
        """Whether ``key`` has loads in flight."""
        return key in self._pins

    def discard(self, keys: Sequence[Hashable]) -> list[Hashable]:
        """Drops ready keys whose cached bytes must not be used again (they failed an integrity check): a later
        lookup misses them and the request recomputes and stores them anew. A key with loads in flight is dropped when
        its last one completes; keys not cached (or only being stored) are ignored. Returns the keys dropped now.
        Not an eviction: removed from the policy without a ghost, reported in one ``"removed"`` event."""
        now = []
        for key in dict.fromkeys(keys):
            if key not in self._ready:
                continue
            if key in self._pins:
                self._doomed.add(key)
            else:
                now.append(key)
        self._drop(now)
        return now

    def _drop(self, keys: list[Hashable]) -> None:
        ready = self._ready
        for pool, pool_keys in self._by_pool(keys):  # each key's block goes back to its own pool
            free, remove = self._frees[pool], self._policies[pool].remove
            for key in pool_keys:
                remove(key)
                free.append(ready.pop(key))
        if self._events is not None and keys:
            self._events.append(OffloadEvent("removed", list(keys)))

    # -- housekeeping --------------------------------------------------------------------------------------------

    def take_events(self) -> list[OffloadEvent]:
        """Returns the events recorded since the last call, oldest first, and forgets them ([] when disabled)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def reset(self) -> list[Hashable]:
        """Drops every ready key that is not pinned and returns them; pinned keys and in-flight stores stay.

        The dropped keys are removed from the policy without counting as evictions (ARC keeps no ghost of them)
        and are reported in one ``"removed"`` event when events are enabled.
        """
        pins, ready = self._pins, self._ready
        dropped = [key for key in ready if key not in pins]
        for pool, pool_keys in self._by_pool(dropped):
            free, remove = self._frees[pool], self._policies[pool].remove
            for key in pool_keys:
                remove(key)
                free.append(ready.pop(key))
        if self._events is not None and dropped:
            self._events.append(OffloadEvent("removed", list(dropped)))
        return dropped

    def snapshot(self) -> ManagerSnapshot:
        """The complete state as plain values (O(n)); equal snapshots mean nothing changed (dict order aside)."""
        return ManagerSnapshot(
            ready=dict(self._ready),
            storing=dict(self._storing),
            pins=dict(self._pins),
            free_block_ids=tuple(self._free) if self.num_pools == 1 else tuple(tuple(free) for free in self._frees),
            policy=self._policy.snapshot()
            if self.num_pools == 1
            else {"pools": tuple(p.snapshot() for p in self._policies)},
            stats=self.stats,
            pending_events=tuple(self._events or ()),
        )

    def __repr__(self) -> str:
        return (
            f"OffloadManager(num_blocks={self.num_blocks}, "
            f"{f'pools={self.num_pools}, ' if self.num_pools > 1 else ''}policy={self._policy.name!r}, "
            f"ready={len(self._ready)}, storing={len(self._storing)}, pinned={len(self._pins)}, free={self.num_free})"
        )
