"""How :class:`~triton_offload.manager.OffloadManager` makes room for a store (:class:`Eviction`, a mix-in): the
victims each pool's policy offers, skipping what must stay (pinned keys, keys being stored, keys of the call), taken
out of the tables and the policies together; with several pools, each new key's block taken from its own pool. Split
from the manager to keep each file small; the manager's attributes it reads are listed on the class. Stdlib only.
"""

from __future__ import annotations

from collections.abc import Hashable

from triton_offload.manager_types import OffloadEvent
from triton_offload.policies.slots import CHUNK_BITS, CHUNK_MASK

__all__ = ["Eviction"]


class Eviction:
    """Eviction and multi-pool allocation for the manager; uses its ``_table``, ``_policies``, ``_pins``,
    ``_storing``, ``_pool_of``, ``num_pools``, ``_events`` and ``_evictions``."""

    def _pooled(self, to_store: list[Hashable], pairs: dict) -> tuple[dict, list] | None:
        """Several pools: each new key's slot (key -> slot) and the evicted keys, or None (nothing changed)."""
        table, by_pool = self._table, self._split(to_store)
        shortfalls = [(pool, len(part) - table.num_free(pool)) for pool, part in by_pool]
        victims: dict[int, tuple[list[int], list[Hashable]]] = {}
        evicted = []
        if any(short > 0 for _, short in shortfalls):
            if sum(max(0, short) for _, short in shortfalls) > table.num_ready - len(self._pins):
                return None
            found = self._victims(shortfalls, pairs)
            if found is None:
                return None
            victims, evicted = found, self._evict(found)
        slots: dict[Hashable, int] = {}
        for pool, part in by_pool:
            got = victims[pool][0][::-1] if pool in victims else []
            if len(part) > len(got):
                got += table.take(pool, len(part) - len(got))
            slots.update(zip(part, got))
        return slots, evicted

    def _split(self, keys: list[Hashable]) -> list[tuple[int, list[Hashable]]]:
        """``keys`` by pool, each pool's keys in call order (pools in order, those without keys left out)."""
        split: list[list[Hashable]] = [[] for _ in range(self.num_pools)]
        pool_of = self._pool_of
        for key in keys:
            split[pool_of(key)].append(key)
        return [(pool, part) for pool, part in enumerate(split) if part]

    def _victims(self, shortfalls: list[tuple[int, int]], in_call: dict) -> dict | None:
        """Each short pool's victims (``pool -> (slots, keys)``), in eviction order, or None when some pool cannot
        give enough (nothing changed: a pool's policy holds only that pool's slots, so its victims free blocks of
        that pool)."""
        chunks, pins, storing = self._table.chunks, self._pins, self._storing
        victims = {}
        for pool, shortfall in shortfalls:
            if shortfall <= 0:
                continue
            slots, keys = [], []
            for slot in self._policies[pool].evict_candidates():
                key = chunks[slot >> CHUNK_BITS][slot & CHUNK_MASK]
                if key in pins or key in in_call or key in storing:
                    continue
                slots.append(slot)
                keys.append(key)
                if len(slots) == shortfall:
                    break
            else:
                return None
            victims[pool] = slots, keys
        return victims

    def _evict(self, victims: dict) -> list[Hashable]:
        """Evicts the victims; returns their keys, in eviction order. Their blocks go to the keys being stored."""
        evicted, table = [], self._table
        for pool, (slots, keys) in victims.items():
            policy = self._policies[pool]
            if policy.ghosts:  # the policy turns the keys' entries into ghosts
                table.num_ready -= len(keys)
            else:
                table.forget(keys)
            policy.evict(slots, keys)
            evicted += keys
        self._evictions += len(evicted)
        if self._events is not None:
            self._events.append(OffloadEvent("removed", list(evicted)))
        return evicted
