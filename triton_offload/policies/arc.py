"""Adaptive replacement cache (Megiddo & Modha, FAST 2003): keys used twice survive a scan of keys used once; four
``OrderedDict`` lists, the manager owning capacity (the class docstring says where it differs from the paper)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from itertools import chain, islice

from triton_offload._checks import positive_int

__all__ = ["ARCPolicy"]


class ARCPolicy:
    """Adaptive replacement cache (Megiddo & Modha, FAST 2003), with the manager owning capacity.

    Resident keys live in T1 (seen once since they became resident) or T2 (used again since). B1 and B2 remember
    keys recently evicted from T1 and T2 (ghosts: keys only, no block). A key stored again while it is a ghost
    tells which list was too short, and the target size ``p`` of T1 moves towards it. Eviction takes T1's LRU key
    while T1 is longer than ``p``, else T2's, so keys used twice survive a scan of keys used once that would flush
    them out of an LRU cache.

    Difference from the paper, forced by the manager evicting for a whole call at once: eviction
    (:meth:`evict_candidates`) runs before the call's keys are inserted, so the paper's tie-break (``|T1| == p`` and
    the new key in B2) is not applied. The ghost-hit adaptation happens when a store is prepared (:meth:`insert`),
    the one moment a key evicted too early costs work, and nowhere else. Ghost lists are trimmed when a store
    completes (:meth:`on_stored`), so that ``|T1| + |B1| <= c`` and ``|T1| + |T2| + |B1| + |B2| <= 2c`` hold (the
    paper's bounds) counting the keys whose store completed; a store in flight may exceed them by its keys until it
    completes. A store that fails (:meth:`remove`) so leaves the ghost lists as they were: the keys evicted to make
    room for it stay ghosts, as in vLLM.

    :meth:`refresh` (a request using again a block it stored or already reused) moves a key to the most recent end of
    the list it is in: a request counts as one use, so it never promotes a key from T1 to T2.
    """

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
