"""The interface of an eviction policy for the host KV cache: which resident key gives up its block when the cache is
full. A policy only orders keys; the :class:`~triton_offload.manager.OffloadManager` owns blocks, pins and in-flight
stores and tells the policy what happens to each key. Every operation is O(1) amortised.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Protocol

__all__ = ["EvictionPolicy"]


class EvictionPolicy(Protocol):
    """The interface the manager drives. ``capacity`` is the most keys that may be resident at once.

    Methods that name a resident key raise ``KeyError`` when it is not resident: the manager never does that, so it
    is a bug in the caller, not an expected condition.
    """

    name: str
    capacity: int

    def insert(self, key: Hashable) -> None:
        """Makes a key given a block resident (its store may be in flight); it counts as its first use.

        ``ValueError`` if it already is resident or the policy is at capacity.
        """

    def on_stored(self, key: Hashable) -> None:
        """A resident key's store completed (it was inserted when the store was prepared); its order is unchanged."""

    def access(self, key: Hashable) -> None:
        """Records a reuse of a resident key (a load or touch by a request that did not count it yet)."""

    def refresh(self, key: Hashable) -> None:
        """Makes a resident key the most recently used without counting a reuse (ARC keeps it in its list)."""

    def remove(self, key: Hashable) -> None:
        """Drops a resident key that is not being evicted (failed store, reset): it leaves no history behind."""

    def on_evict(self, key: Hashable) -> None:
        """Drops a resident key the manager evicted; a policy may remember it (ARC's ghost lists)."""

    def evict_candidates(self) -> Iterator[Hashable]:
        """Yields every resident key once, in eviction order, lazily (the first key costs O(1)).

        The caller must stop iterating before it changes the policy (``on_evict`` and the rest): the iterator walks
        the live lists.
        """

    def snapshot(self) -> dict[str, object]:
        """The full internal state as plain values, O(n): for tests and debugging, not the hot path."""

    def __len__(self) -> int:
        """The number of resident keys."""

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is resident (ghost entries are not)."""
