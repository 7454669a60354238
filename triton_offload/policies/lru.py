"""Least recently used: one doubly linked list of slots in two int32 arrays (``prev``, ``next``), least recent first."""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Iterator, Mapping, Sequence

from triton_offload._checks import positive_int
from triton_offload.policies.slots import SlotState, byte_array, int_array

__all__ = ["LRUPolicy"]


class LRUPolicy(SlotState):
    """Least recently used: evicts the slot whose last insert or use is oldest.

    The list is circular through a sentinel at index ``slots``: ``next[sentinel]`` is the least recently used slot,
    ``prev[sentinel]`` the most recent. Every operation is a few array reads and writes per slot, with no call per
    slot; creating the policy is O(1).
    """

    name = "lru"
    counts_reuse = False  # a use and a reuse move a slot alike
    ghosts = False

    def __init__(self, capacity: int, slots: int | None = None, keys: object = None, pool: int = 0) -> None:
        # keys, pool: the manager's key table and the policy's pool, which a policy with ghosts shares (not LRU)
        self.capacity = positive_int(capacity, "eviction policy capacity")
        end = self.capacity if slots is None else positive_int(slots, "slots")
        self._end = end  # the sentinel
        self._prev, self._next = int_array(end + 1), int_array(end + 1)
        self._prev[end] = self._next[end] = end
        self._resident = byte_array(end)
        self._len = 0

    def insert(self, slot: int, key: Hashable = None) -> None:
        if self._resident[slot]:
            raise ValueError(f"slot {slot} is already resident")
        if self._len >= self.capacity:
            raise ValueError(f"cannot insert slot {slot}: {self._len} slots resident, capacity {self.capacity}")
        self.use((slot,), (), {slot: -1})

    def use(self, slots: Sequence[int], reuse: Container[int], new: Mapping[int, int]) -> None:
        # As moving the slots one by one, last slot first, to the most recent end, but a run of them already linked
        # in that order (a call's keys stay together until another call moves some) moves as one: cut out and
        # pasted at the end. LRU knows only recency, so ``reuse`` and ``new``'s keys do not matter.
        prev, nxt, resident, end = self._prev, self._next, self._resident, self._end
        chain = slots[::-1]
        count, i = len(chain), 0
        while i < count:
            first = last = chain[i]
            i += 1
            if resident[first]:
                while i < count and nxt[last] == chain[i]:  # linked to it, so resident too
                    last = chain[i]
                    i += 1
                before, after = prev[first], nxt[last]
                nxt[before] = after
                prev[after] = before
            else:
                resident[first] = 1
                self._len += 1
            tail = prev[end]
            nxt[tail] = first
            prev[first] = tail
            nxt[last] = end
            prev[end] = last

    @property
    def links(self) -> memoryview:
        return self._next

    def stored(self) -> None:
        pass  # its recency was set when the store was prepared

    def remove(self, slot: int) -> None:
        prev, nxt = self._prev, self._next
        before, after = prev[slot], nxt[slot]
        nxt[before] = after
        prev[after] = before
        self._resident[slot] = 0
        self._len -= 1

    def evict(self, slots: Sequence[int], keys: Sequence[Hashable]) -> None:
        prev, nxt, resident = self._prev, self._next, self._resident
        for slot in slots:
            before, after = prev[slot], nxt[slot]
            nxt[before] = after
            prev[after] = before
            resident[slot] = 0
        self._len -= len(slots)

    def evict_candidates(self) -> Iterator[int]:
        nxt, end = self._next, self._end
        slot = nxt[end]
        while slot != end:
            yield slot
            slot = nxt[slot]

    def snapshot(self, key_of: Callable[[int], Hashable] = int) -> dict[str, object]:
        return {"order": tuple(map(key_of, self.evict_candidates()))}

    def __len__(self) -> int:
        return self._len

    def __contains__(self, slot: object) -> bool:
        return isinstance(slot, int) and 0 <= slot < self._end and bool(self._resident[slot])
