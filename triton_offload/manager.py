"""Scheduler-side bookkeeping of the host KV cache: which key (a block hash) lives in which host block, whether its
copy is still in flight (*storing*: not a hit, never evicted) or done (*ready*: a hit, evictable unless a load in
flight pins it), and which key the eviction policy gives up when the cache is full. docs/design.md (section 8) states
the rules it keeps: recency follows use, not completion; a call's first key is evicted last; reuse counts once per
request. Stdlib only, because it runs in the scheduler's critical path, and no call's cost grows with the cache: a
block's state, key and place in the eviction order sit in arrays indexed by its id (:mod:`triton_offload.block_table`),
keys map to blocks through a sharded table that never rebuilds more than ~1,300 keys at once, and building a manager is
O(1) (:mod:`triton_offload.policies.slots`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Literal

from triton_offload._checks import positive_int
from triton_offload.block_table import BlockTable
from triton_offload.manager_evict import Eviction
from triton_offload.manager_types import ManagerSnapshot, ManagerStats, OffloadEvent, RequestUse, StoreAllocation
from triton_offload.policies import POLICIES, EvictionPolicy, make_policy, policy_name
from triton_offload.policies.slots import CHUNK_BITS, CHUNK_MASK, SlotState

__all__ = ["OffloadManager", "StoreAllocation", "OffloadEvent", "ManagerStats", "ManagerSnapshot", "RequestUse"]

logger = logging.getLogger(__name__)


class OffloadManager(Eviction, SlotState):
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
        self.num_blocks = n = positive_int(num_blocks, "num_blocks")
        self.num_pools = positive_int(pools, "pools")
        if pools > 1 and pool_of is None:
            raise ValueError(f"pools = {pools} needs pool_of, the pool of a key")
        self._pool_of = pool_of
        # One table of slots for all pools (pool p's blocks are slots [p * n, (p + 1) * n)) and a policy per pool,
        # over the whole slot range: the pages of its arrays outside its pool are never touched.
        ghosts = POLICIES[policy_name(eviction_policy)].ghosts
        self._table = table = BlockTable(n, pools, ghosts)
        self._shards, self._mod, self._storing = table.shards, table.mod, table.storing
        self._policies: list[EvictionPolicy] = [
            make_policy(eviction_policy, n, pools * n, table.index, pool) for pool in range(pools)
        ]
        for pool, policy in enumerate(self._policies):
            table.chain_free(pool, policy.links)
        self._policy = self._policies[0]
        self._pins: dict[Hashable, int] = {}  # only keys with loads in flight; always ready
        self._doomed: set[Hashable] = set()  # pinned keys to drop after their last load (failed checks): discard
        self._events: list[OffloadEvent] | None = [] if enable_events else None
        self._hits = self._misses = self._stores = self._store_failures = self._evictions = 0

    def _blocks(self, slots: list[int]) -> list[int]:
        """Slots as the block ids of their pools."""
        if self.num_pools == 1:
            return slots
        n = self.num_blocks
        return [slot % n for slot in slots]

    # -- queries -------------------------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[Hashable]) -> int:
        """Returns how many leading keys are ready; a key whose store is in flight ends the run like a missing one."""
        shards, mod = self._shards, self._mod
        hits = 0
        if not self._policy.ghosts:  # ready keys only: membership, without touching the slot (see lookup_tables)
            for key in keys:
                if key not in shards[hash(key) % mod]:
                    break
                hits += 1
        else:
            for key in keys:
                if shards[hash(key) % mod].get(key, -1) < 0:
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
        if self._shards[hash(key) % self._mod].get(key, -1) >= 0:
            return "ready"
        return "storing" if key in self._storing else None

    def lookup_tables(self) -> tuple[list[dict], int, dict, bool]:
        """What :meth:`key_state` reads, for a caller looking keys up one at a time in its own loop (vLLM's adapter):
        ``(shards, mod, storing, ready_only)``; a key is ready when ``shards[hash(key) % mod].get(key, -1) >= 0``
        (ARC's ghosts share the table, with negative codes), or, when ``ready_only`` (a policy without ghosts: the
        table holds ready keys only), when ``key in shards[hash(key) % mod]``, which leaves the key's slot untouched
        (reading it, a cold int object in a large cache, costs about as much as the lookup); storing when ``key in
        storing``. Changed in place, so valid as long as the manager."""
        return self._shards, self._mod, self._storing, not self._policy.ghosts

    @property
    def num_free(self) -> int:
        """Blocks holding no key (all pools)."""
        return sum(map(self._table.num_free, range(self.num_pools)))

    @property
    def num_cached(self) -> int:
        """Ready keys (hits); in-flight stores are not counted."""
        return self._table.num_ready

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
        return self._table.num_ready + len(self._storing)

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
        shards, mod = self._shards, self._mod
        slots = [shards[hash(key) % mod].get(key, -1) for key in keys]
        if slots and min(slots) < 0:  # validate everything first so a bad call pins nothing (ghosts are < 0 too)
            key = keys[next(i for i, slot in enumerate(slots) if slot < 0)]
            state = "still being stored" if key in self._storing else "not cached"
            raise ValueError(f"cannot load key {key!r}: it is {state}")
        pins = self._pins
        for key in keys:
            pins[key] = pins.get(key, 0) + 1
        # Now, not when the load completes: the request's own stores that follow must not evict what it loads.
        pairs = dict(zip(keys, slots))
        self._use(pairs, pairs, request)
        return self._blocks(slots)

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
        pairs, ready = self._table.resolve(keys)
        if None in pairs.values():
            pairs = {key: slot for key, slot in pairs.items() if slot is not None}
        self._use(pairs, ready, request)

    def finish_request(self, request: RequestUse, order: Sequence[Hashable] | None = None) -> None:
        """Ends a request: every key it stored or used that is still cached becomes recent again, counting no reuse.

        The request used its blocks until its end (attention reads the whole prefix at every step), so they are
        newer than anything used before; the first key of ``order`` (default: the order the request first named its
        keys) ends up the most recently used. The request's key list is emptied, so a second call does nothing.
        """
        last = request.keys
        keys = last if order is None else dict.fromkeys(order)
        shards, mod, storing, chunks, get = self._shards, self._mod, self._storing, self._table.chunks, last.get
        slots = []
        for key in keys:  # the slot it had when last named if it still holds it (no lookup), else its slot now
            slot = get(key)
            if slot is None or chunks[slot >> CHUNK_BITS][slot & CHUNK_MASK] != key:
                slot = shards[hash(key) % mod].get(key, -1)
                if slot < 0:
                    slot = storing.get(key)
            if slot is not None:
                slots.append(slot)
        self._apply(slots, (), {})
        request.keys.clear()

    def _use(self, pairs: dict, ready, request: RequestUse | None, stored=(), new: dict | None = None) -> None:
        """Applies one call's keys to the policy: ``pairs`` (distinct, in call order, each with its slot), of which
        ``ready`` are ready and ``stored`` new (their slots in ``new``, each with its key's ghost code). A ready
        key's use is a reuse unless ``request`` stored or reused it already; the keys are applied in reverse, so the
        first ends up the most recent."""
        if request is None:
            reused = ready
        else:
            if stored:
                request.inserted.update(stored)
            reused = set(ready).difference(request.inserted, request.reused)
            request.reused |= reused
            # dict.update keeps the first position of a key seen before: the request's prefix order.
            request.keys.update(pairs)
        reuse = {pairs[key] for key in reused} if reused and self._policy.counts_reuse else ()
        self._apply(list(pairs.values()), reuse, new or {})

    def _apply(self, slots: list[int], reuse, new: dict) -> None:
        """Hands the slots of a call to their pools' policies."""
        if self.num_pools == 1:
            if slots:
                self._policy.use(slots, reuse, new)
            return
        for policy, part in zip(self._policies, self._table.by_pool(slots)):
            if part:
                policy.use(part, reuse, new)

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
        table, ghosts = self._table, {}
        pairs, ready = table.resolve(keys, ghosts)
        to_store = [key for key, slot in pairs.items() if slot is None]
        if not to_store:
            self._use(pairs, ready, request)
            return StoreAllocation([], [], [])
        if self.num_pools == 1:  # the victims' blocks first, the last victim first (as if freed, then taken from
            short = len(to_store) - table.num_free(0)  # the free stack), then free blocks
            evicted: list[Hashable] = []
            got = []
            if short > 0:
                # Pinned keys are ready and never evictable: reject in O(1) rather than walking a cache full of them.
                found = self._victims([(0, short)], pairs) if short <= table.num_ready - len(self._pins) else None
                if found is None:
                    return None
                evicted, got = self._evict(found), found[0][0][::-1]
            if len(to_store) > len(got):
                got += table.take(0, len(to_store) - len(got))
            slots = dict(zip(to_store, got))
        else:
            found = self._pooled(to_store, pairs)
            if found is None:
                return None
            slots, evicted = found
            got = self._blocks([slots[key] for key in to_store])
        table.add(slots)
        pairs.update(slots)
        new = dict.fromkeys(slots.values(), -1)  # slot -> its key's ghost code (-1: none)
        if ghosts:
            new.update((slots[key], code) for key, code in ghosts.items())
        self._use(pairs, ready, request, to_store, new)
        return StoreAllocation(to_store, got, evicted)

    def complete_store(self, keys: Sequence[Hashable], success: bool = True) -> list[Hashable]:
        """Ends stores started by :meth:`prepare_store`; returns the keys it ended, in call order.

        On success the keys become ready (hits). Their place in the eviction order stays the one their request gave
        them: a late completion does not make them recent. On failure their blocks are freed, they leave the policy
        and are not reported as cached. A key with no store in flight (already stored, never prepared, dropped by a
        reset) is skipped with a debug log, as vLLM's own manager does, so a repeated or stale completion cannot
        stop the engine.
        """
        table, one = self._table, self.num_pools == 1
        done, stale = table.end_stores(keys, ready=success and one)  # one pool: straight into the ready table
        for key in stale:
            state = "already stored" if table.index.get(key, -1) >= 0 else "not being stored"
            logger.debug("complete_store of key %r ignored: it is %s", key, state)
        if not done:
            return []
        if success:
            n = self.num_blocks  # pool by pool, call order in each: the order reset follows
            if not one:
                table.add_ready(sorted(done.items(), key=lambda item: item[1] // n))
            self._stores += len(done)
            for pool in (0,) if one else {slot // n for slot in done.values()}:
                self._policies[pool].stored()
            if self._events is not None:
                self._events.append(OffloadEvent("stored", list(done)))
        else:
            self._release(done.values())
            self._store_failures += len(done)
        return list(done)

    def _release(self, slots) -> None:
        """Takes slots whose keys are out of the tables out of the policy without a trace (no eviction, no ghost)
        and frees them."""
        for pool, part in enumerate(self._table.by_pool(list(slots))):
            remove = self._policies[pool].remove
            for slot in part:
                remove(slot)
            self._table.free(pool, part)

    def key_block(self, key: Hashable) -> int | None:
        """The host block of a ready or storing key, or None."""
        slot = self._shards[hash(key) % self._mod].get(key, -1)
        if slot < 0:
            slot = self._storing.get(key)
        return None if slot is None else slot % self.num_blocks

    def is_pinned(self, key: Hashable) -> bool:
        """Whether ``key`` has loads in flight."""
        return key in self._pins

    def discard(self, keys: Sequence[Hashable]) -> list[Hashable]:
        """Drops ready keys whose cached bytes must not be used again (they failed an integrity check): a later
        lookup misses them and the request recomputes and stores them anew. A key with loads in flight is dropped when
        its last one completes; keys not cached (or only being stored) are ignored. Returns the keys dropped now.
        Not an eviction: removed from the policy without a ghost, reported in one ``"removed"`` event."""
        now = []
        index = self._table.index
        for key in dict.fromkeys(keys):
            if index.get(key, -1) < 0:
                continue
            if key in self._pins:
                self._doomed.add(key)
            else:
                now.append(key)
        self._drop(now)
        return now

    def _drop(self, keys: list[Hashable]) -> None:
        """Removes ready, unpinned keys from the cache and the policy (no eviction, no ghost) and reports them."""
        self._release(list(map(self._table.pop_ready, keys)))
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
        """Drops every ready key that is not pinned and returns them (in the key table's order, not the order they
        became ready); pinned keys and in-flight stores stay. O(n).

        The dropped keys are removed from the policy without counting as evictions (ARC keeps no ghost of them)
        and are reported in one ``"removed"`` event when events are enabled.
        """
        pins = self._pins
        dropped = [key for key, _ in self._table.ready_items() if key not in pins]
        self._drop(dropped)
        return dropped

    def retire(self) -> list:
        """Empties the manager (not to be used again) into its tables, to drop a few at a time off the step path
        (dropping a full manager at once is O(n): 150 ms at 10^6 blocks); each is a shard, a key chunk or an array."""
        return self._table.parts() + [part for policy in self._policies for part in policy.parts()]

    def snapshot(self) -> ManagerSnapshot:
        """The complete state as plain values (O(n)); equal snapshots mean nothing changed (dict order aside)."""
        n, frees = self.num_blocks, self._table.free_ids()
        key_of = self._table.keys.__getitem__
        return ManagerSnapshot(
            ready={key: slot % n for key, slot in self._table.ready_items()},
            storing={key: slot % n for key, slot in self._storing.items()},
            pins=dict(self._pins),
            free_block_ids=frees[0] if self.num_pools == 1 else frees,
            policy=self._policy.snapshot(key_of)
            if self.num_pools == 1
            else {"pools": tuple(p.snapshot(key_of) for p in self._policies)},
            stats=self.stats,
            pending_events=tuple(self._events or ()),
        )

    def __repr__(self) -> str:
        return (
            f"OffloadManager(num_blocks={self.num_blocks}, "
            f"{f'pools={self.num_pools}, ' if self.num_pools > 1 else ''}policy={self._policy.name!r}, "
            f"ready={self.num_cached}, storing={self.num_storing}, pinned={len(self._pins)}, free={self.num_free})"
        )
