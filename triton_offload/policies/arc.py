"""Adaptive replacement cache (Megiddo & Modha, FAST 2003): keys used twice survive a scan of keys used once; four
linked lists in int32 arrays (T1 and T2 over host slots, B1 and B2 over ghost ids), the manager owning capacity (the
class docstring says where it differs from the paper)."""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Iterator, Mapping, Sequence

from triton_offload._checks import positive_int
from triton_offload.policies.slots import (
    CHUNK_BITS,
    CHUNK_MASK,
    KeyTable,
    SlotKeys,
    SlotState,
    byte_array,
    int_array,
)

__all__ = ["ARCPolicy"]


class ARCPolicy(SlotState):
    """Adaptive replacement cache (Megiddo & Modha, FAST 2003), with the manager owning capacity.

    Resident slots live in T1 (seen once since they became resident) or T2 (used again since). B1 and B2 remember
    keys recently evicted from T1 and T2 (ghosts: keys only, no block). A key stored again while it is a ghost
    tells which list was too short, and the target size ``p`` of T1 moves towards it. Eviction takes T1's LRU slot
    while T1 is longer than ``p``, else T2's, so keys used twice survive a scan of keys used once that would flush
    them out of an LRU cache.

    Difference from the paper, forced by the manager evicting for a whole call at once: eviction
    (:meth:`evict_candidates`) runs before the call's keys are inserted, so the paper's tie-break (``|T1| == p`` and
    the new key in B2) is not applied. The ghost-hit adaptation happens when a store is prepared (a new slot in
    :meth:`use`), the one moment a key evicted too early costs work, and nowhere else. Ghost lists are trimmed when
    stores complete (:meth:`stored`, once per call), so that ``|T1| + |B1| <= c`` and ``|T1| + |T2| + |B1| + |B2| <=
    2c`` hold (the paper's bounds) counting the keys whose store completed; a store in flight may exceed them by its
    keys until it completes. A store that fails (:meth:`remove`) so leaves the ghost lists as they were: the keys
    evicted to make room for it stay ghosts, as in vLLM. Ghosts never outnumber ``2c`` (evictions need a full cache,
    and every trim leaves ``|T| + |B| <= 2c``), which sizes their id space.

    A use that is not a reuse (a request using again a block it stored or already reused) moves a slot to the most
    recent end of the list it is in: a request counts as one use, so it never promotes a slot from T1 to T2.

    Layout: ``prev``/``next`` link slots ``[0, slots)`` with sentinels ``slots`` (T1) and ``slots + 1`` (T2); ``list``
    says which list a slot is in (0: not resident). Ghosts have ids ``[0, 2c)`` with their own links (sentinels
    ``2c``: B1, ``2c + 1``: B2), a key per id and key -> code in a :class:`KeyTable` (the manager's, shared with its
    ready keys), the code telling the id and the list; ids given back are chained through the ghost links (a free
    list, so that a trim gives its run of ids back in O(1)).
    """

    name = "arc"
    counts_reuse = True
    ghosts = True

    def __init__(self, capacity: int, slots: int | None = None, keys: KeyTable | None = None, pool: int = 0) -> None:
        self.capacity = c = positive_int(capacity, "eviction policy capacity")
        end = c if slots is None else positive_int(slots, "slots")
        self._t1, self._t2 = end, end + 1  # sentinels
        self._prev, self._next = int_array(end + 2), int_array(end + 2)
        for s in (end, end + 1):
            self._prev[s] = self._next[s] = s
        self._list = byte_array(end + 2)  # 1: T1, 2: T2, 0: not resident
        self._n1 = self._n2 = 0
        self._p = 0  # target size of T1, 0 <= p <= capacity
        ghosts = 2 * c
        self._b1, self._b2 = ghosts, ghosts + 1  # sentinels
        self._gprev, self._gnext = int_array(ghosts + 2), int_array(ghosts + 2)
        for g in (ghosts, ghosts + 1):
            self._gprev[g] = self._gnext[g] = g
        self._gkeys = SlotKeys(ghosts)
        # key -> ghost code: the manager's key table (ready keys there are >= 0), or one of its own (at most c ghosts
        # while the cache is full). Ghost g's code is code0 - 2g in B1, code0 - 2g - 1 in B2: the list is in the code,
        # and the pools' ranges of codes <= -2 never overlap.
        self._shared = keys is not None
        self._ghosts = keys if keys is not None else KeyTable(c)
        self._code0 = -2 - pool * 2 * ghosts
        self._gspare = -1  # the first ghost id given back (the rest chained through _gnext; -1: none)
        self._gfresh = 0  # ids from here on were never used
        self._m1 = self._m2 = 0

    def insert(self, slot: int, key: Hashable = None) -> None:
        if self._list[slot]:
            raise ValueError(f"slot {slot} is already resident")
        if self._n1 + self._n2 >= self.capacity:
            raise ValueError(f"cannot insert slot {slot}: {self._n1 + self._n2} resident, capacity {self.capacity}")
        code = None if key is None else self._ghosts.get(key)
        self.use((slot,), (), {slot: -1 if code is None or code >= 0 else code})

    def use(self, slots: Sequence[int], reuse: Container[int], new: Mapping[int, int]) -> None:
        # As moving the slots one by one, last slot first, to the most recent end of their lists (and adapting p to
        # ghost hits in that order), but a run of them already linked in that order and going to one list (a call's
        # keys stay together until another call moves some) moves as one: cut out and pasted at the end.
        prev, nxt, lists, t1, t2 = self._prev, self._next, self._list, self._t1, self._t2
        chain = slots[::-1]
        count, i, to_t2, new1, new2 = len(chain), 0, 0, 0, 0  # slots promoted from T1, new in T1, new in T2
        while i < count:
            first = last = chain[i]
            i += 1
            where = lists[first]
            if not where:  # new: into T1, or into T2 if its key is a ghost
                code = new[first]
                if code == -1:
                    lists[first] = 1
                    new1 += 1
                    head = t1
                else:
                    self._ghost_hit(self._code0 - code)  # 2 x its ghost id, + 1 in B2
                    lists[first] = 2
                    new2 += 1
                    head = t2
            else:
                if where == 2:
                    while i < count and nxt[last] == chain[i]:  # linked to it, so in T2 too
                        last = chain[i]
                        i += 1
                    head = t2
                elif first in reuse:  # from T1 to T2, with the reused slots linked to it
                    lists[first] = 2
                    to_t2 += 1
                    while i < count and nxt[last] == chain[i] and chain[i] in reuse:
                        last = chain[i]
                        lists[last] = 2
                        to_t2 += 1
                        i += 1
                    head = t2
                else:
                    while i < count and nxt[last] == chain[i] and chain[i] not in reuse:
                        last = chain[i]
                        i += 1
                    head = t1
                before, after = prev[first], nxt[last]
                nxt[before] = after
                prev[after] = before
            tail = prev[head]
            nxt[tail] = first
            prev[first] = tail
            nxt[last] = head
            prev[head] = last
        self._n1 += new1 - to_t2
        self._n2 += new2 + to_t2

    def _ghost_hit(self, place: int) -> None:
        """A key stored again while a ghost (``place``: 2 x its id, + 1 in B2): move ``p`` towards the list it was
        evicted from, forget the ghost."""
        m1, m2 = self._m1, self._m2
        ghost = place >> 1
        if not place & 1:
            # Evicted from T1 but wanted again: T1 was too short. Grow its target faster when B1 is the smaller
            # ghost list, since a hit there is then the stronger signal.
            self._p = min(self.capacity, self._p + max(1, m2 // m1))
            self._m1 -= 1
        else:
            self._p = max(0, self._p - max(1, m1 // m2))
            self._m2 -= 1
        gprev, gnext = self._gprev, self._gnext
        before, after = gprev[ghost], gnext[ghost]
        gnext[before] = after
        gprev[after] = before
        chunk = self._gkeys.chunks[ghost >> CHUNK_BITS]
        self._ghosts.pop(chunk[ghost & CHUNK_MASK])
        chunk[ghost & CHUNK_MASK] = None
        gnext[ghost] = self._gspare
        self._gspare = ghost

    @property
    def links(self) -> memoryview:
        return self._next

    def remove(self, slot: int) -> None:
        prev, nxt = self._prev, self._next
        before, after = prev[slot], nxt[slot]
        nxt[before] = after
        prev[after] = before
        if self._list[slot] == 1:
            self._n1 -= 1
        else:
            self._n2 -= 1
        self._list[slot] = 0

    def evict(self, slots: Sequence[int], keys: Sequence[Hashable]) -> None:
        # Each slot leaves Ti and its key enters Bi: |T1| + |B1| and the total stay the same, so no trim is needed.
        # The new ghosts are chained after each list's tail as they come, and the lists closed once at the end. In
        # the manager's key table a key's entry only changes its value (slot to ghost code): no entry used up.
        prev, nxt, lists = self._prev, self._next, self._list
        gprev, gnext, chunks, bits, mask = self._gprev, self._gnext, self._gkeys.chunks, CHUNK_BITS, CHUNK_MASK
        table = self._ghosts
        shards, mod, b1, b2, spare, code0 = table.shards, table.mod, self._b1, self._b2, self._gspare, self._code0
        if not self._shared:  # a table of its own: the keys enter it (their codes set below)
            table.put_many((key, 0) for key in keys)
        tail1, tail2 = gprev[b1], gprev[b2]
        from_t1 = 0
        for slot, key in zip(slots, keys):
            before, after = prev[slot], nxt[slot]
            nxt[before] = after
            prev[after] = before
            if spare >= 0:
                ghost = spare
                spare = gnext[ghost]
            else:
                ghost = self._new_ghost()
            chunks[ghost >> bits][ghost & mask] = key
            if lists[slot] == 1:
                shards[hash(key) % mod][key] = code0 - 2 * ghost
                gnext[tail1] = ghost
                gprev[ghost] = tail1
                tail1 = ghost
                from_t1 += 1
            else:
                shards[hash(key) % mod][key] = code0 - 2 * ghost - 1
                gnext[tail2] = ghost
                gprev[ghost] = tail2
                tail2 = ghost
            lists[slot] = 0
        gnext[tail1], gprev[b1], gnext[tail2], gprev[b2] = b1, tail1, b2, tail2
        self._gspare = spare
        self._n1 -= from_t1
        self._m1 += from_t1
        self._n2 -= len(slots) - from_t1
        self._m2 += len(slots) - from_t1

    def _new_ghost(self) -> int:
        """A ghost id never used yet (ids given back are reused first)."""
        ghost = self._gfresh
        assert ghost < 2 * self.capacity, "more than 2c ghosts"
        self._gfresh += 1
        self._gkeys.grow(ghost, ghost + 1)
        return ghost

    def stored(self) -> None:
        """Stores completed (once per call, whatever its number of keys): trims the ghost lists to the paper's bounds;
        the lists' lengths do not change while stores complete, so one trim per call is one per key's worth."""
        c = self.capacity
        drop = max(0, min(self._m1, self._n1 + self._m1 - c))
        if drop:
            self._drop_oldest(self._b1, drop)
            self._m1 -= drop
        # With at most c resident and |T1| + |B1| <= c, an excess over 2c implies |T2| + |B2| > c >= |T2|, so B2
        # holds something to drop.
        drop = max(0, min(self._m2, self._n1 + self._n2 + self._m1 + self._m2 - 2 * c))
        if drop:
            self._drop_oldest(self._b2, drop)
            self._m2 -= drop

    def _drop_oldest(self, head: int, count: int) -> None:
        """Forgets the ``count`` oldest ghosts of the list at sentinel ``head``; their ids, still chained, join the free
        list as one run."""
        gprev, gnext, chunks, bits, mask = self._gprev, self._gnext, self._gkeys.chunks, CHUNK_BITS, CHUNK_MASK
        shards, mod = self._ghosts.shards, self._ghosts.mod
        first = last = ghost = gnext[head]
        for _ in range(count):
            chunk = chunks[ghost >> bits]
            key = chunk[ghost & mask]
            chunk[ghost & mask] = None
            del shards[hash(key) % mod][key]
            last = ghost
            ghost = gnext[ghost]
        gnext[head] = ghost
        gprev[ghost] = head
        gnext[last] = self._gspare
        self._gspare = first
        self._ghosts.size -= count

    def evict_candidates(self) -> Iterator[int]:
        # The paper's REPLACE, repeated as if every yielded slot were evicted: T1 gives slots while it is longer than
        # p; then taking from T2 leaves |T1| unchanged, so all of T2 comes next, then the rest of T1. Slots the
        # manager skips (pinned) count as taken, which only shifts the T1/T2 balance while pins are around.
        nxt, t1, t2 = self._next, self._t1, self._t2
        take = self._n1 - self._p
        slot = nxt[t1]
        while take > 0 and slot != t1:
            yield slot
            slot = nxt[slot]
            take -= 1
        other = nxt[t2]
        while other != t2:
            yield other
            other = nxt[other]
        while slot != t1:
            yield slot
            slot = nxt[slot]

    @staticmethod
    def _walk(nxt, head: int) -> Iterator[int]:
        at = nxt[head]
        while at != head:
            yield at
            at = nxt[at]

    def snapshot(self, key_of: Callable[[int], Hashable] = int) -> dict[str, object]:
        gkey = self._gkeys.__getitem__
        return {
            "t1": tuple(map(key_of, self._walk(self._next, self._t1))),
            "t2": tuple(map(key_of, self._walk(self._next, self._t2))),
            "b1": tuple(map(gkey, self._walk(self._gnext, self._b1))),
            "b2": tuple(map(gkey, self._walk(self._gnext, self._b2))),
            "p": self._p,
        }

    def __len__(self) -> int:
        return self._n1 + self._n2

    def __contains__(self, slot: object) -> bool:
        return isinstance(slot, int) and 0 <= slot < self._t1 and bool(self._list[slot])
