"""Property test: random operation sequences on the manager against a trivially correct model.

The model is plain dicts and lists (O(n) everywhere). After every step the manager's full snapshot must match it and
satisfy the invariants: a key occupies one block, a block holds one key, capacity is never exceeded, a pinned or
storing key is never evicted and its block never reused, a failed call changes nothing. For LRU the model also
predicts the exact victims; for ARC only the invariants and the ghost-list bounds are checked.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from triton_offload.manager import OffloadManager

# Few keys and few blocks, so that evictions, pins, re-stores and ghost hits happen often.
KEYS = [b"k%02d" % i for i in range(14)]
key_lists = st.lists(st.sampled_from(KEYS), max_size=6)
store_lists = st.lists(st.sampled_from(KEYS), max_size=4)

SETTINGS = settings(
    max_examples=500,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class ManagerMachine(RuleBasedStateMachine):
    policy = "lru"

    @initialize(num_blocks=st.integers(1, 6), events=st.booleans())
    def init(self, num_blocks, events):
        self.n = num_blocks
        self.m = OffloadManager(num_blocks, self.policy, enable_events=events)
        self.events_on = events
        self.ready: dict[bytes, int] = {}
        self.storing: dict[bytes, int] = {}
        self.pins: Counter[bytes] = Counter()
        self.loads: list[list[bytes]] = []  # load calls in flight
        self.recency: list[bytes] = []  # ready keys, least recently used first (LRU's exact order)
        self.expected_events: list[tuple[str, list[bytes]]] = []
        self.hits = self.misses = self.stores = self.failures = self.evictions = 0

    # -- helpers -------------------------------------------------------------------------------------------------

    def free_blocks(self) -> set[int]:
        return set(range(self.n)) - set(self.ready.values()) - set(self.storing.values())

    def use(self, keys):
        """Model of policy order: keys applied in reverse, so the first ends most recent."""
        for key in reversed(keys):
            if key in self.ready:
                self.recency.remove(key)
                self.recency.append(key)

    # -- rules ---------------------------------------------------------------------------------------------------

    @rule(keys=key_lists)
    def lookup(self, keys):
        expected = 0
        for key in keys:
            if key not in self.ready:
                break
            expected += 1
        assert self.m.lookup(keys) == expected
        self.hits += expected
        self.misses += len(keys) - expected

    @rule(keys=key_lists)
    def touch(self, keys):
        self.m.touch(keys)
        self.use(keys)

    @rule(keys=store_lists)
    def prepare_store(self, keys):
        self._prepare_store(keys)

    @rule(batches=st.lists(st.tuples(store_lists, st.sampled_from([True, True, True, False])), min_size=1, max_size=3))
    def store_now(self, batches):
        """Stores whose copies finish at once: the common case, and what fills the cache so that evictions happen."""
        for keys, success in batches:
            out = self._prepare_store(keys)
            if out is not None and out.keys_to_store:
                self._complete_store(out.keys_to_store, success)

    def _prepare_store(self, keys):
        to_store = [key for key in dict.fromkeys(keys) if key not in self.ready and key not in self.storing]
        free_before = self.free_blocks()
        shortfall = len(to_store) - len(free_before)
        evictable = [key for key in self.recency if key not in self.pins and key not in keys]
        before = self.m.snapshot()
        out = self.m.prepare_store(keys)
        if shortfall > len(evictable):
            assert out is None
            assert self.m.snapshot() == before, "a store that found no room changed the state"
            return None
        assert out is not None
        assert out.keys_to_store == to_store
        assert len(out.evicted_keys) == max(0, shortfall), "evicted more than needed, or used no free block"
        assert set(out.evicted_keys) <= set(evictable), "evicted a pinned, storing, or same-call key"
        if self.policy == "lru":
            assert out.evicted_keys == evictable[: max(0, shortfall)], "LRU victim is not the least recently used"
        ids = out.host_block_ids
        assert len(ids) == len(set(ids)) == len(to_store)
        evicted_blocks = {self.ready[key] for key in out.evicted_keys}
        assert set(ids) <= free_before | evicted_blocks, "a block still holding a key was handed out"
        if shortfall > 0:
            assert free_before <= set(ids), "evicted while free blocks were left"
        for key in out.evicted_keys:
            del self.ready[key]
            self.recency.remove(key)
        self.storing.update(zip(to_store, ids))
        self.evictions += len(out.evicted_keys)
        if out.evicted_keys:
            self.expected_events.append(("removed", list(out.evicted_keys)))
        return out

    @precondition(lambda self: self.storing)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data, success):
        keys = data.draw(st.lists(st.sampled_from(sorted(self.storing)), min_size=1, unique=True))
        self._complete_store(keys, success)

    def _complete_store(self, keys, success):
        self.m.complete_store(keys, success=success)
        if success:
            for key in reversed(keys):
                self.ready[key] = self.storing.pop(key)
                self.recency.append(key)
            self.stores += len(keys)
            self.expected_events.append(("stored", keys))
        else:
            for key in keys:
                del self.storing[key]
            self.failures += len(keys)

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def prepare_load(self, data):
        keys = data.draw(st.lists(st.sampled_from(sorted(self.ready)), min_size=1, max_size=4))
        assert self.m.prepare_load(keys) == [self.ready[key] for key in keys]
        self.pins.update(keys)
        self.loads.append(keys)

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def complete_load(self, data):
        keys = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.m.complete_load(keys)
        self.pins.subtract(keys)
        self.pins = +self.pins  # drop zero counts

    @rule(data=st.data())
    def rejected_calls(self, data):
        """Loading a key that is not ready, completing a store not in flight or a load not pinned: all ValueError."""
        bad = data.draw(st.sampled_from(KEYS))
        before = self.m.snapshot()
        if bad not in self.ready:
            good = sorted(self.ready)[:2]
            with pytest.raises(ValueError):
                self.m.prepare_load([*good, bad])
        if bad not in self.storing:
            with pytest.raises(ValueError):
                self.m.complete_store([*sorted(self.storing)[:2], bad], success=data.draw(st.booleans()))
        with pytest.raises(ValueError):
            self.m.complete_load([bad] * (self.pins[bad] + 1))
        assert self.m.snapshot() == before, "a rejected call changed the state"

    @rule(now=st.integers(0, 7))
    def reset(self, now):
        if now:  # a reset empties the cache, so let most draws pass and leave room for evictions to happen
            return
        dropped = self.m.reset()
        expected = {key for key in self.ready if key not in self.pins}
        assert len(dropped) == len(set(dropped)) and set(dropped) == expected
        for key in dropped:
            del self.ready[key]
            self.recency.remove(key)
        if dropped:
            self.expected_events.append(("removed", dropped))

    # -- invariants ----------------------------------------------------------------------------------------------

    @invariant()
    def matches_model(self):
        snap = self.m.snapshot()
        assert snap.ready == self.ready
        assert snap.storing == self.storing
        assert snap.pins == dict(self.pins)
        used = list(self.ready.values()) + list(self.storing.values())
        assert len(used) == len(set(used)), "a block holds two keys"
        assert not self.ready.keys() & self.storing.keys(), "a key is both ready and storing"
        free = snap.free_block_ids
        assert len(free) == len(set(free)) and not set(free) & set(used)
        assert set(free) | set(used) == set(range(self.n)), "blocks leaked or out of range"
        assert (self.m.num_free, self.m.num_cached, self.m.num_storing, len(self.m)) == (
            len(free),
            len(self.ready),
            len(self.storing),
            len(used),
        )
        assert set(self.pins) <= set(self.ready), "a pinned key is not ready"
        s = self.m.stats
        assert (s.hits, s.misses, s.stores, s.store_failures, s.evictions) == (
            self.hits,
            self.misses,
            self.stores,
            self.failures,
            self.evictions,
        )

    @invariant()
    def policy_state(self):
        pol = self.m.snapshot().policy
        if self.policy == "lru":
            assert pol == {"order": tuple(self.recency)}
            return
        t1, t2, b1, b2 = (set(pol[name]) for name in ("t1", "t2", "b1", "b2"))
        assert len(t1) + len(t2) == len(self.ready) and t1 | t2 == set(self.ready), "resident lists != ready keys"
        assert not (t1 & t2 or b1 & b2 or (t1 | t2) & (b1 | b2)), "ARC lists overlap"
        assert len(t1) + len(b1) <= self.n, f"|T1|+|B1| > c: {pol}"
        assert len(t1) + len(t2) + len(b1) + len(b2) <= 2 * self.n, f"ARC lists exceed 2c: {pol}"
        assert 0 <= pol["p"] <= self.n

    @invariant()
    def events(self):
        got = [(e.kind, e.keys) for e in self.m.take_events()]
        assert got == (self.expected_events if self.events_on else [])
        self.expected_events = []


class ARCMachine(ManagerMachine):
    policy = "arc"


TestLRUManager = ManagerMachine.TestCase
TestLRUManager.settings = SETTINGS
TestARCManager = ARCMachine.TestCase
TestARCManager.settings = SETTINGS
