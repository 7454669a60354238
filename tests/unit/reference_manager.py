"""The manager as it was before issue 61 (OrderedDict policies, dict tables, a full free list), kept verbatim but for
docstrings as the reference the new one must match call for call (tests/unit/test_manager_reference.py)."""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from itertools import chain, islice
from typing import Literal

from triton_offload._checks import positive_int
from triton_offload.manager_types import ManagerSnapshot, ManagerStats, OffloadEvent, RequestUse, StoreAllocation

logger = logging.getLogger("triton_offload.manager")


class LRUPolicy:
    name = "lru"

    def __init__(self, capacity: int) -> None:
        self.capacity = positive_int(capacity, "eviction policy capacity")
        self._order: OrderedDict[Hashable, None] = OrderedDict()  # least recently used first

    def insert(self, key: Hashable) -> None:
        if key in self._order:
            raise ValueError(f"key {key!r} is already resident")
        if len(self._order) >= self.capacity:
            raise ValueError(f"cannot insert {key!r}: {len(self._order)} keys resident, capacity {self.capacity}")
        self._order[key] = None

    def on_stored(self, key: Hashable) -> None:
        pass  # its recency was set when the store was prepared

    def access(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    refresh = access  # LRU knows only recency

    def remove(self, key: Hashable) -> None:
        del self._order[key]

    def on_evict(self, key: Hashable) -> None:
        del self._order[key]

    def evict_candidates(self) -> Iterator[Hashable]:
        return iter(self._order)

    def snapshot(self) -> dict[str, object]:
        return {"order": tuple(self._order)}

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class ARCPolicy:
    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity = positive_int(capacity, "eviction policy capacity")
        self._t1: OrderedDict[Hashable, None] = OrderedDict()
        self._t2: OrderedDict[Hashable, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        self._p = 0  # target size of T1, 0 <= p <= capacity

    def insert(self, key: Hashable) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        if key in t1 or key in t2:
            raise ValueError(f"key {key!r} is already resident")
        if len(t1) + len(t2) >= self.capacity:
            raise ValueError(f"cannot insert {key!r}: {len(t1) + len(t2)} keys resident, capacity {self.capacity}")
        if key in b1:
            # Evicted from T1 but wanted again: T1 was too short. Grow its target faster when B1 is the smaller
            # ghost list, since a hit there is then the stronger signal.
            self._p = min(self.capacity, self._p + max(1, len(b2) // len(b1)))
            del b1[key]
            t2[key] = None
        elif key in b2:
            self._p = max(0, self._p - max(1, len(b1) // len(b2)))
            del b2[key]
            t2[key] = None
        else:
            t1[key] = None

    def on_stored(self, key: Hashable) -> None:
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        t1, b1, b2 = self._t1, self._b1, self._b2
        c = self.capacity
        while b1 and len(t1) + len(b1) > c:
            b1.popitem(last=False)
        # With at most c resident and |T1| + |B1| <= c, an excess over 2c implies |T2| + |B2| > c >= |T2|, so B2
        # holds something to drop.
        while b2 and len(t1) + len(self._t2) + len(b1) + len(b2) > 2 * c:
            b2.popitem(last=False)

    def access(self, key: Hashable) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def refresh(self, key: Hashable) -> None:
        if key in self._t1:
            self._t1.move_to_end(key)
        else:
            self._t2.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            del self._t2[key]

    def on_evict(self, key: Hashable) -> None:
        # Moving a key from Ti to Bi keeps |T1| + |B1| and the total unchanged, so no trim is needed.
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        else:
            del self._t2[key]
            self._b2[key] = None

    def evict_candidates(self) -> Iterator[Hashable]:
        # The paper's REPLACE, repeated as if every yielded key were evicted: T1 gives keys while it is longer than
        # p; then taking from T2 leaves |T1| unchanged, so all of T2 comes next, then the rest of T1. Keys the
        # manager skips (pinned) count as taken, which only shifts the T1/T2 balance while pins are around. Built
        # from C iterators: no Python frame per candidate.
        it1 = iter(self._t1)
        return chain(islice(it1, max(0, len(self._t1) - self._p)), self._t2, it1)

    def snapshot(self) -> dict[str, object]:
        return {
            "t1": tuple(self._t1),
            "t2": tuple(self._t2),
            "b1": tuple(self._b1),
            "b2": tuple(self._b2),
            "p": self._p,
        }

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2


class ReferenceManager:
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
        self._policies: list = [_POLICIES[eviction_policy.lower()](num_blocks) for _ in range(pools)]
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
        if self.num_pools == 1:
            return [(0, list(keys))]
        split: list[list[Hashable]] = [[] for _ in range(self.num_pools)]
        pool_of = self._pool_of
        for key in keys:
            split[pool_of(key)].append(key)
        return [(p, ks) for p, ks in enumerate(split) if ks]

    # -- queries -------------------------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[Hashable]) -> int:
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
        if key in self._ready:
            return "ready"
        return "storing" if key in self._storing else None

    @property
    def num_free(self) -> int:
        return sum(len(free) for free in self._frees)

    @property
    def num_cached(self) -> int:
        return len(self._ready)

    @property
    def num_storing(self) -> int:
        return len(self._storing)

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def __len__(self) -> int:
        return len(self._ready) + len(self._storing)

    @property
    def stats(self) -> ManagerStats:
        return ManagerStats(self._hits, self._misses, self._stores, self._store_failures, self._evictions)

    # -- loads ---------------------------------------------------------------------------------------------------

    def prepare_load(self, keys: Sequence[Hashable], request: RequestUse | None = None) -> list[int]:
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
        self._use(keys, request)

    def finish_request(self, request: RequestUse, order: Sequence[Hashable] | None = None) -> None:
        keys = list(request.keys) if order is None else order
        for pool, pool_keys in self._by_pool(keys):
            policy = self._policies[pool]
            resident, refresh = policy.__contains__, policy.refresh
            for key in reversed(pool_keys):
                if resident(key):
                    refresh(key)
        request.keys.clear()

    def _use(self, keys: Sequence[Hashable], request: RequestUse | None, new: frozenset | set = frozenset()) -> None:
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

    def _use_pool(self, policy, keys, request: RequestUse | None, new) -> None:
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
        block = self._ready.get(key)
        return self._storing.get(key) if block is None else block

    def is_pinned(self, key: Hashable) -> bool:
        return key in self._pins

    def discard(self, keys: Sequence[Hashable]) -> list[Hashable]:
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
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def reset(self) -> list[Hashable]:
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


_POLICIES = {"lru": LRUPolicy, "arc": ARCPolicy}
