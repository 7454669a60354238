"""The tables the manager and its policies keep per host block, built so that no call inside an engine step ever pays
for the size of the cache: integer arrays indexed by a dense slot id (a host block id, or an ARC ghost's id) on lazily
zeroed anonymous memory (:func:`int_array`, :func:`byte_array`: O(1) to create, pages filled on first touch), slot ->
key in chunks of 2,048 created as ids are first handed out (:class:`SlotKeys`), and key -> int in dicts of at most
~2,600 keys each, picked by the key's hash (:class:`KeyTable`): a Python dict rebuilds itself when its entry array
runs out, which for one dict of 10^7 keys is a pause of seconds inside whichever call hits it; here the rebuild is of
one shard, so its cost stays that of a few thousand keys whatever the cache size. Stdlib only.
"""

from __future__ import annotations

import copy
import mmap
from collections.abc import Hashable, Iterable, Iterator

__all__ = ["SHARD_BITS", "SHARD_KEYS", "CHUNK_BITS", "CHUNK_MASK", "EMPTY", "int_array", "byte_array", "long_array"]
__all__ += ["copy_array", "KeyTable", "SlotKeys", "SlotState", "shard_count"]

SHARD_BITS = 12  # a KeyTable holds under 2**12 keys per shard at capacity: about what one rebuild ever copies
# The most keys per shard at capacity (5 x 2**9). Under churn a dict rebuilds itself when its entry array (2/3 of its
# power-of-two index) runs out, to the smallest index of at least 3x its keys: 5 x 2**k keys stay in a 2**(k + 4)-slot
# index with about two entries per key (~58 B per key), where 1.1 times as many would take an index twice as large.
# Fewer, larger shards keep their headers in the CPU's caches: a lookup at 10^6 keys touches fewer cold lines.
SHARD_KEYS = 2560
CHUNK_BITS = 11  # SlotKeys' chunk: 2**11 slots (16 KiB of pointers)
_CHUNK = 1 << CHUNK_BITS
CHUNK_MASK = _CHUNK - 1  # a slot's place in its chunk: chunks[slot >> CHUNK_BITS][slot & CHUNK_MASK]


def _zeros(count: int, fmt: str, size: int) -> memoryview:
    # Anonymous private memory: the kernel hands out zero pages as they are first written, so creating the array
    # costs nothing per element; private, so that a forked child never writes into its parent's tables.
    flags = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}
    return memoryview(mmap.mmap(-1, max(1, count) * size, **flags)).cast(fmt)


def int_array(count: int) -> memoryview:
    """``count`` int32 zeros, indexable and writable like a list, created in O(1) (memory is taken as it is used)."""
    return _zeros(count, "i", 4)


def byte_array(count: int) -> memoryview:
    """``count`` unsigned byte zeros, like :func:`int_array`."""
    return _zeros(count, "B", 1)


def long_array(count: int) -> memoryview:
    """``count`` int64 zeros, like :func:`int_array` (NumPy can view it: ``np.frombuffer(view, np.int64)``)."""
    return _zeros(count, "q", 8)


def copy_array(view: memoryview) -> memoryview:
    """A private copy of an array made by :func:`int_array` or :func:`byte_array` (for ``copy.deepcopy``)."""
    new = _zeros(len(view), view.format, view.itemsize)
    new[:] = view
    return new


class SlotState:
    """A mix-in giving ``copy.deepcopy`` to a class holding :func:`int_array` arrays in its ``__dict__``, directly or
    in a list (a memoryview cannot be deep-copied itself; one array held twice is copied once); the manager's property
    tests copy managers."""

    def __deepcopy__(self, memo: dict):
        new = object.__new__(type(self))
        memo[id(self)] = new
        for name, value in vars(self).items():
            if isinstance(value, memoryview):
                value = _copied(value, memo)
            elif isinstance(value, list) and value and isinstance(value[0], memoryview):
                value = [_copied(view, memo) for view in value]
            else:
                value = copy.deepcopy(value, memo)
            setattr(new, name, value)
        return new

    def parts(self) -> list:
        """Empties this object (it must not be used again) into a list of its tables, none larger than a shard, a
        chunk or one array: dropping them one at a time keeps each release small, where dropping a full object at
        once frees every block's entry in one go (O(n))."""
        parts: list = []
        for value in vars(self).values():
            if isinstance(value, KeyTable):
                parts += [shard for shard in value.shards if shard is not EMPTY]
                value.shards[:] = []
            elif isinstance(value, SlotKeys):
                parts += [chunk for chunk in value.chunks if chunk is not None]
                value.chunks[:] = []
            elif isinstance(value, (memoryview, dict)):
                parts.append(value)
            elif isinstance(value, list) and value and isinstance(value[0], memoryview):
                parts += value
        return parts


def _copied(view: memoryview, memo: dict) -> memoryview:
    if id(view) not in memo:
        memo[id(view)] = copy_array(view)
    return memo[id(view)]


class _EmptyShard(dict):
    """The one shard every :class:`KeyTable` starts with in every place (so creating a table allocates no dict per
    shard): empty and never written; a table replaces it by a dict of its own on the first insert there."""

    __slots__ = ()

    def __setitem__(self, key, value):
        raise TypeError("the shared empty shard is read-only")

    def __deepcopy__(self, memo: dict):
        return self


EMPTY = _EmptyShard()  # where a KeyTable has no dict yet: a hot loop writing to a shard replaces it first


def shard_count(capacity: int) -> int:
    """The shards (an odd count) of a :class:`KeyTable` for ``capacity`` keys: of the counts giving about 5 x 2**k keys
    per shard (at most :data:`SHARD_KEYS`), the one with the largest shards among those whose dicts settle in the
    fewest bytes per key under churn (within 2 %), a shard's keys taken two standard deviations above their mean."""
    costs = []
    for k in range(9, 4, -1):
        mod = -(-max(1, capacity) // (5 << k)) | 1  # rounded up, to odd
        keys = capacity / mod
        index = 8
        while index < 3 * (keys + 2 * keys**0.5):
            index *= 2
        width = 1 if index < 256 else 2 if index < 65536 else 4
        costs.append(((index * 2 // 3 * 24 + index * width) / max(1.0, keys), mod))
    least = min(cost for cost, _ in costs)
    return next(mod for cost, mod in costs if cost <= 1.02 * least)


class KeyTable:
    """key -> int in ``mod`` dicts (shards), a key's shard ``hash(key) % mod``, ``mod`` (:func:`shard_count`) such
    that a shard holds at most about :data:`SHARD_KEYS` keys when the table holds ``capacity``: no rebuild ever copies
    more than a shard. ``mod`` is odd, so the keys of a shard do not share the low bits of their hashes, which a dict
    uses to place them.

    Hot loops read ``shards`` and ``mod`` into locals and look up ``shards[hash(key) % mod]`` themselves; inserting
    goes through :meth:`put` (a shard may still be the shared empty one). ``size`` counts the keys.
    """

    __slots__ = ("shards", "mod", "size")

    def __init__(self, capacity: int) -> None:
        self.mod = shard_count(capacity)
        self.shards: list[dict] = [EMPTY] * self.mod
        self.size = 0

    def get(self, key: Hashable, default=None):
        return self.shards[hash(key) % self.mod].get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self.shards[hash(key) % self.mod]

    def put(self, key: Hashable, value: int) -> None:
        """Adds a key that is not in the table."""
        i = hash(key) % self.mod
        shard = self.shards[i]
        if shard is EMPTY:
            shard = self.shards[i] = {}
        shard[key] = value
        self.size += 1

    def put_many(self, items: Iterable[tuple[Hashable, int]]) -> None:
        """Adds (key, value) pairs whose keys are not in the table."""
        shards, mod = self.shards, self.mod
        count = 0
        for key, value in items:
            i = hash(key) % mod
            shard = shards[i]
            if shard is EMPTY:
                shard = shards[i] = {}
            shard[key] = value
            count += 1
        self.size += count

    def pop(self, key: Hashable) -> int:
        """Removes a key that is in the table; returns its value."""
        value = self.shards[hash(key) % self.mod].pop(key)
        self.size -= 1
        return value

    def items(self) -> Iterator[tuple[Hashable, int]]:
        """Every (key, value), shard by shard (O(n): not for the step path)."""
        for shard in self.shards:
            yield from shard.items()

    def __len__(self) -> int:
        return self.size


class SlotKeys:
    """slot -> key for ``count`` slots, in chunks of 2,048 pointers created by :meth:`grow` as slots are first handed
    out (a list of ``count // 2048`` chunk pointers up front). ``chunks[slot >> CHUNK_BITS][slot & 2047]`` is a slot's
    key (None when it holds none)."""

    __slots__ = ("chunks",)

    def __init__(self, count: int) -> None:
        self.chunks: list[list | None] = [None] * ((max(1, count) + _CHUNK - 1) >> CHUNK_BITS)

    def grow(self, start: int, stop: int) -> None:
        """Makes slots ``[start, stop)`` addressable (the chunks they fall in exist)."""
        chunks = self.chunks
        for i in range(start >> CHUNK_BITS, ((stop - 1) >> CHUNK_BITS) + 1 if stop > start else 0):
            if chunks[i] is None:
                chunks[i] = [None] * _CHUNK

    def __getitem__(self, slot: int) -> Hashable:
        return self.chunks[slot >> CHUNK_BITS][slot & CHUNK_MASK]

    def __setitem__(self, slot: int, key: Hashable) -> None:
        self.chunks[slot >> CHUNK_BITS][slot & CHUNK_MASK] = key
