"""Least recently used: one ``OrderedDict`` as a linked list, least recent first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

from triton_offload._checks import positive_int

__all__ = ["LRUPolicy"]


class LRUPolicy:
    """Least recently used: evicts the key whose last insert or access is oldest."""

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
