"""The interface of an eviction policy for the host KV cache: which resident slot (host block) gives up its block when
the cache is full. A policy only orders slots; the :class:`~triton_offload.manager.OffloadManager` owns keys, blocks,
pins and in-flight stores and tells the policy what happens to each slot. Every operation costs a fixed number of
array reads and writes (no hashing but ARC's ghosts, kept in the manager's key table), and creating a policy is O(1)
(:mod:`.slots`).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Iterator, Mapping, Sequence
from typing import Protocol

__all__ = ["EvictionPolicy"]


class EvictionPolicy(Protocol):
    """The interface the manager drives. ``capacity`` is the most slots that may be resident at once; slots are ints
    in ``[0, slots)`` (``slots`` defaults to ``capacity``: the manager's pools give each policy a range of its own).

    Methods that name a resident slot misbehave when it is not resident: the manager never does that, so it is a bug
    in the caller, not an expected condition.
    """

    name: str
    capacity: int
    counts_reuse: bool  # whether :meth:`use` tells a reuse from a use (the manager skips ``reuse`` otherwise)
    # Whether it keeps evicted keys (ghosts) in the manager's key table it was built with (``keys``, ``pool``): its
    # :meth:`evict` then turns the keys' entries into ghost codes (<= -2, its own range per pool), which the manager
    # passes back in :meth:`use`'s ``new`` when such a key is stored again.
    ghosts: bool

    def insert(self, slot: int, key: Hashable = None) -> None:
        """Makes a slot given a key resident (its store may be in flight); it counts as its first use. ``key`` lets
        a policy with a history recognise it (ARC's ghosts).

        ``ValueError`` if it already is resident or the policy is at capacity.
        """

    def use(self, slots: Sequence[int], reuse: Container[int], new: Mapping[int, int]) -> None:
        """Applies one call's uses: ``slots`` distinct, resident or in ``new`` (inserted: slot -> its key's ghost code
        in the key table, -1 when none), the call's first key first. They are applied in reverse, so the first ends
        up the most recently used; a slot in ``reuse`` counts a reuse (ARC: to T2), the others are only made
        recent."""

    @property
    def links(self) -> memoryview:
        """An int32 array over the slots whose entry for a slot that is not resident the policy neither reads nor
        keeps (it writes a slot's entry when the slot becomes resident): the manager chains its free slots there."""

    def stored(self) -> None:
        """Stores completed (called once per call that completed any); their slots' order is unchanged."""

    def remove(self, slot: int) -> None:
        """Drops a resident slot that is not being evicted (failed store, reset): it leaves no history behind."""

    def evict(self, slots: Sequence[int], keys: Sequence[Hashable]) -> None:
        """Drops resident slots the manager evicted, in order; a policy with ``ghosts`` remembers their keys, still
        ready in its key table (the manager takes the others' keys out first)."""

    def evict_candidates(self) -> Iterator[int]:
        """Yields every resident slot once, in eviction order, lazily (the first one costs O(1)).

        The caller must stop iterating before it changes the policy (``evict`` and the rest): the iterator walks
        the live lists.
        """

    def snapshot(self, key_of: Callable[[int], Hashable] = int) -> dict[str, object]:
        """The full internal state as plain values, slots named by ``key_of``, O(n): for tests and debugging."""

    def __len__(self) -> int:
        """The number of resident slots."""

    def __contains__(self, slot: object) -> bool:
        """Whether ``slot`` is resident (ghost entries are not)."""
