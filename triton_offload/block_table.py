"""The manager's block bookkeeping (:class:`BlockTable`): which ready key holds which slot (in one key table with ARC's
ghosts), which keys are being stored, each slot's key, and the free slots of each pool; the rules (what to evict, what
counts as a use) stay in :mod:`triton_offload.manager`. Slots are the host blocks of all pools in one id space: pool
``p``'s block ``b`` is slot ``p * num_blocks + b``. Creating a table is O(1) and no method's cost grows with the cache
(:mod:`triton_offload.policies.slots`). Stdlib only.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator

from triton_offload.policies.slots import CHUNK_BITS, CHUNK_MASK, EMPTY, KeyTable, SlotKeys, SlotState

__all__ = ["BlockTable"]


class BlockTable(SlotState):
    """Keys and free lists of ``pools`` pools of ``num_blocks`` slots each.

    Attributes (read by the manager's per-key loops directly):
        index, shards, mod: key -> code (:class:`~triton_offload.policies.slots.KeyTable`): a ready key's slot (>= 0),
            or a policy's ghost code (<= -2: ARC's evicted keys share the table, so that an eviction overwrites a
            key's entry and a store looks a key up once); ``shards[hash(key) % mod].get(key, -1)`` is a ready key's
            slot, negative when the key is not ready.
        num_ready: the ready keys (the rest of the index are ghosts).
        storing: key -> slot of the keys whose store is in flight (a plain dict: as many keys as the copies in flight).
        chunks: slot -> key (:class:`~triton_offload.policies.slots.SlotKeys`' chunks).
    Each pool hands out its freed slots first, the last freed first, then slots never handed out in increasing order
    (a fresh cache hands out block 0 first), the free list the manager has always had, built lazily.
    """

    def __init__(self, num_blocks: int, pools: int, ghosts: bool = False) -> None:
        self.num_blocks, self.pools = num_blocks, pools
        # Sized for what a full cache holds: a ready key per block, and with ghosts at most as many ghosts (ARC).
        self.index = KeyTable(pools * num_blocks * (2 if ghosts else 1))
        self.shards, self.mod = self.index.shards, self.index.mod
        self.num_ready = 0
        self.storing: dict[Hashable, int] = {}
        self.keys = SlotKeys(pools * num_blocks)
        self.chunks = self.keys.chunks
        # Each pool's freed slots, a stack chained through its policy's next links (a free slot is in no list of
        # the policy, which writes a slot's links without reading them when it takes the slot again): set by
        # :meth:`chain_free` before the first slot is freed. No array of its own: 4 B per host block less.
        self._links: list = [None] * pools
        self._tops = [-1] * pools  # the last slot freed (-1: none)
        self._freed = [0] * pools  # how many are chained
        self._fresh = [p * num_blocks for p in range(pools)]  # the pool's first slot never handed out

    def resolve(self, keys: Iterable[Hashable], ghosts: dict | None = None) -> tuple[dict, list[Hashable]]:
        """The keys, repeats dropped (first position kept), each with its slot (None when not cached), and the ready
        ones; the ghosts among the keys not cached go into ``ghosts`` (key -> ghost code) when given."""
        shards, mod, storing = self.shards, self.mod, self.storing
        pairs: dict[Hashable, int | None] = {}
        ready = []
        for key in keys:
            code = shards[hash(key) % mod].get(key, -1)
            if code >= 0:
                pairs[key] = code
                ready.append(key)
            else:
                pairs[key] = storing.get(key)
                if code != -1 and ghosts is not None:
                    ghosts[key] = code
        return pairs, ready

    def by_pool(self, slots: list[int]) -> list[list[int]]:
        """``slots`` split by pool (a list per pool, in order)."""
        if self.pools == 1:
            return [slots]
        parts: list[list[int]] = [[] for _ in range(self.pools)]
        n = self.num_blocks
        for slot in slots:
            parts[slot // n].append(slot)
        return parts

    def num_free(self, pool: int) -> int:
        return (pool + 1) * self.num_blocks - self._fresh[pool] + self._freed[pool]

    def chain_free(self, pool: int, links: memoryview) -> None:
        """Chains ``pool``'s freed slots through ``links`` (its policy's next links, an int32 array over the slots)."""
        self._links[pool] = links

    def take(self, pool: int, count: int) -> list[int]:
        """``count`` free slots of ``pool`` (at most :meth:`num_free`), in the order they are handed out."""
        reused = min(count, self._freed[pool])
        slots = []
        if reused:
            links, top = self._links[pool], self._tops[pool]
            for _ in range(reused):
                slots.append(top)
                top = links[top]
            self._tops[pool], self._freed[pool] = top, self._freed[pool] - reused
        if count > reused:
            fresh = self._fresh[pool]
            self._fresh[pool] = fresh + count - reused
            self.keys.grow(fresh, fresh + count - reused)
            slots += range(fresh, fresh + count - reused)
        return slots

    def add(self, slots: dict[Hashable, int]) -> None:
        """Gives each new key its slot (taken by :meth:`take`): its store is in flight (a ghost of the key has left
        :attr:`index` with the policy's use of the slot)."""
        chunks = self.chunks
        for key, slot in slots.items():
            chunks[slot >> CHUNK_BITS][slot & CHUNK_MASK] = key
        self.storing.update(slots)

    def end_stores(self, keys: Iterable[Hashable], ready: bool) -> tuple[dict[Hashable, int], dict[Hashable, None]]:
        """Takes keys out of :attr:`storing`: returns those it held (key -> slot, call order) and the others (repeats
        of the first left out); with ``ready`` the ones it held go into :attr:`index` too, in call order."""
        shards, mod, pop = self.shards, self.mod, self.storing.pop
        done: dict[Hashable, int] = {}
        stale: dict[Hashable, None] = {}
        for key in keys:
            slot = pop(key, None)
            if slot is None:
                if key not in done:
                    stale[key] = None
                continue
            done[key] = slot
            if ready:
                i = hash(key) % mod
                if shards[i] is EMPTY:
                    shards[i] = {}
                shards[i][key] = slot
        if ready:
            self.index.size += len(done)
            self.num_ready += len(done)
        return done, stale

    def free(self, pool: int, slots: list[int]) -> None:
        """Frees slots of ``pool`` (their keys already out of :attr:`index` and :attr:`storing`)."""
        chunks, links, top = self.chunks, self._links[pool], self._tops[pool]
        for slot in slots:
            chunks[slot >> CHUNK_BITS][slot & CHUNK_MASK] = None
            links[slot] = top
            top = slot
        self._tops[pool] = top
        self._freed[pool] += len(slots)

    def forget(self, keys: list[Hashable]) -> None:
        """Takes ready keys out of :attr:`index` (their slots' entries are overwritten by the keys that take them)."""
        shards, mod = self.shards, self.mod
        for key in keys:
            del shards[hash(key) % mod][key]
        self.index.size -= len(keys)
        self.num_ready -= len(keys)

    def add_ready(self, items: Iterable[tuple[Hashable, int]]) -> None:
        """Adds (key, slot) pairs of keys not in :attr:`index` as ready."""
        count = self.index.size
        self.index.put_many(items)
        self.num_ready += self.index.size - count

    def pop_ready(self, key: Hashable) -> int:
        """Takes a ready key out of :attr:`index`; returns its slot."""
        self.num_ready -= 1
        return self.index.pop(key)

    def ready_items(self) -> Iterator[tuple[Hashable, int]]:
        """Every ready (key, slot), shard by shard (O(n))."""
        return ((key, code) for key, code in self.index.items() if code >= 0)

    def free_ids(self) -> tuple[tuple[int, ...], ...]:
        """Each pool's free block ids, in the order they are handed out, last first (O(n))."""
        n, ids = self.num_blocks, []
        for p, (links, top, freed, fresh) in enumerate(zip(self._links, self._tops, self._freed, self._fresh)):
            chained = []
            for _ in range(freed):
                chained.append(top - p * n)
                top = links[top]
            ids.append(tuple(range((p + 1) * n - 1 - p * n, fresh - 1 - p * n, -1)) + tuple(chained[::-1]))
        return tuple(ids)
