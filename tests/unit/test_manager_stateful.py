"""Property test: random operation sequences on the manager against a trivially correct model.

The model is plain dicts and lists (O(n) everywhere). After every step the manager's full snapshot must match it and
satisfy the invariants: a key occupies one block, a block holds one key, capacity is never exceeded, a pinned or
storing key is never evicted and its block never reused, a failed call changes nothing, a completion of a key not in
flight is a no-op.

Recency follows use: the model orders keys by their last use (store prepared, load, touch, end of a request that
used them), never by store completion, and stores complete in any order; for LRU it predicts the exact victims. Uses
go through a few requests (:class:`RequestUse`) or none; for ARC the model predicts which list (T1, T2) each key is
in: a key enters T1 (T2 if it was a ghost), and only a reuse by a request that neither stored nor already reused it
(or a use outside any request) moves it to T2. Otherwise ARC is checked for its invariants and ghost-list bounds
(the paper's, over the keys whose store completed).
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from triton_offload.manager import OffloadManager, RequestUse

# Few keys and few blocks, so that evictions, pins, re-stores and ghost hits happen often.
KEYS = [b"k%02d" % i for i in range(14)]
key_lists = st.lists(st.sampled_from(KEYS), max_size=6)
store_lists = st.lists(st.sampled_from(KEYS), max_size=4)
NUM_REQUESTS = 3
requests = st.one_of(st.none(), st.integers(0, NUM_REQUESTS - 1))


class ModelRequest:
    """The model of one request's history: what it stored, what it reused, every key it used, first use first."""

    def __init__(self) -> None:
        self.use = RequestUse()  # the manager's object for this request
        self.inserted: set[bytes] = set()
        self.reused: set[bytes] = set()
        self.keys: list[bytes] = []


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
        self.recency: list[bytes] = []  # ready and storing keys, least recently used first (LRU's exact order)
        self.arc_list: dict[bytes, str] = {}  # resident key -> "t1", "t2" or "either" (inserted as a ghost)
        self.requests = [ModelRequest() for _ in range(NUM_REQUESTS)]
        self.expected_events: list[tuple[str, list[bytes]]] = []
        self.hits = self.misses = self.stores = self.failures = self.evictions = 0

    # -- helpers -------------------------------------------------------------------------------------------------

    def free_blocks(self) -> set[int]:
        return set(range(self.n)) - set(self.ready.values()) - set(self.storing.values())

    def ghosts(self) -> set[bytes]:
        if self.policy != "arc":
            return set()
        pol = self.m.snapshot().policy
        return set(pol["b1"]) | set(pol["b2"])

    def use(self, keys, req, new=(), ghosts=frozenset()):
        """Model of the uses of one call: applied in reverse (the first key ends most recent), once per key."""
        r = None if req is None else self.requests[req]
        unique = list(dict.fromkeys(keys))
        for key in reversed(unique):
            if key in new:
                self.recency.append(key)
                self.arc_list[key] = "either" if key in ghosts else "t1"
                if r is not None:
                    r.inserted.add(key)
            elif key in self.ready or key in self.storing:
                self.recency.remove(key)
                self.recency.append(key)
                counts = key in self.ready and (r is None or not (key in r.inserted or key in r.reused))
                if counts:  # a reuse: ARC's second use
                    self.arc_list[key] = "t2"
                    if r is not None:
                        r.reused.add(key)
        if r is not None:
            r.keys += [key for key in unique if (key in self.ready or key in self.storing) and key not in r.keys]

    def drop(self, key):
        self.recency.remove(key)
        del self.arc_list[key]

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

    @rule(keys=key_lists, req=requests)
    def touch(self, keys, req):
        self.m.touch(keys, None if req is None else self.requests[req].use)
        self.use(keys, req)

    @rule(keys=store_lists, req=requests)
    def prepare_store(self, keys, req):
        self._prepare_store(keys, req)

    @rule(
        batches=st.lists(
            st.tuples(store_lists, requests, st.sampled_from([True, True, True, False])), min_size=1, max_size=3
        )
    )
    def store_now(self, batches):
        """Stores whose copies finish at once: the common case, and what fills the cache so that evictions happen."""
        for keys, req, success in batches:
            out = self._prepare_store(keys, req)
            if out is not None and out.keys_to_store:
                self._complete_store(out.keys_to_store, success)

    def _prepare_store(self, keys, req):
        to_store = [key for key in dict.fromkeys(keys) if key not in self.ready and key not in self.storing]
        free_before = self.free_blocks()
        shortfall = len(to_store) - len(free_before)
        evictable = [key for key in self.recency if key in self.ready and key not in self.pins and key not in keys]
        ghosts = self.ghosts()
        before = self.m.snapshot()
        out = self.m.prepare_store(keys, None if req is None else self.requests[req].use)
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
            self.drop(key)
        self.storing.update(zip(to_store, ids))
        self.use(keys, req, new=set(to_store), ghosts=ghosts)
        self.evictions += len(out.evicted_keys)
        if out.evicted_keys:
            self.expected_events.append(("removed", list(out.evicted_keys)))
        return out

    @precondition(lambda self: self.storing)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data, success):
        """Stores complete in any order, a late one included; stale keys (not in flight) mixed in are no-ops."""
        keys = data.draw(st.lists(st.sampled_from(sorted(self.storing)), min_size=1, unique=True))
        stale = data.draw(st.lists(st.sampled_from(KEYS), max_size=2))
        mixed = data.draw(st.permutations(keys + stale))
        self._complete_store(mixed, success)

    def _complete_store(self, keys, success):
        expected = [key for key in dict.fromkeys(keys) if key in self.storing]
        assert self.m.complete_store(keys, success=success) == expected
        if success:
            for key in expected:  # recency stays where the key's last use put it
                self.ready[key] = self.storing.pop(key)
            self.stores += len(expected)
            if expected:
                self.expected_events.append(("stored", expected))
        else:
            for key in expected:
                del self.storing[key]
                self.drop(key)
            self.failures += len(expected)

    @precondition(lambda self: self.ready)
    @rule(data=st.data(), req=requests)
    def prepare_load(self, data, req):
        keys = data.draw(st.lists(st.sampled_from(sorted(self.ready)), min_size=1, max_size=4))
        use = None if req is None else self.requests[req].use
        assert self.m.prepare_load(keys, use) == [self.ready[key] for key in keys]
        self.pins.update(keys)
        self.loads.append(keys)
        self.use(keys, req)

    @rule(data=st.data(), req=st.integers(0, NUM_REQUESTS - 1))
    def finish_request(self, data, req):
        """A request ends: every key it used that is still cached becomes recent, head first, and counts no reuse.
        The next request takes its slot."""
        r = self.requests[req]
        order = data.draw(st.one_of(st.none(), st.permutations(r.keys)))
        self.m.finish_request(r.use, order)
        for key in reversed(r.keys if order is None else order):
            if key in self.ready or key in self.storing:
                self.recency.remove(key)
                self.recency.append(key)
        assert not r.use.keys, "a finished request keeps its keys"
        self.requests[req] = ModelRequest()

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def complete_load(self, data):
        keys = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.m.complete_load(keys)
        self.pins.subtract(keys)
        self.pins = +self.pins  # drop zero counts

    @rule(data=st.data())
    def rejected_calls(self, data):
        """Loading a key that is not ready or completing a load not pinned: ValueError. Completing a store not in
        flight: a no-op. None of them changes anything."""
        bad = data.draw(st.sampled_from(KEYS))
        before = self.m.snapshot()
        if bad not in self.ready:
            good = sorted(self.ready)[:2]
            with pytest.raises(ValueError):
                self.m.prepare_load([*good, bad])
        if bad not in self.storing:
            assert self.m.complete_store([bad, bad], success=data.draw(st.booleans())) == []
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
            self.drop(key)
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
        resident = set(self.ready) | set(self.storing)
        assert len(t1) + len(t2) == len(resident) and t1 | t2 == resident, "resident lists != ready + storing keys"
        expected = {where: {key for key, at in self.arc_list.items() if at == where} for where in ("t1", "t2")}
        assert expected["t1"] <= t1, f"a key moved to T2 with no reuse: {pol}"
        assert expected["t2"] <= t2, f"a reused key is not in T2: {pol}"
        assert not (t1 & t2 or b1 & b2 or (t1 | t2) & (b1 | b2)), "ARC lists overlap"
        # The paper's bounds, counting keys whose store completed: ghosts are trimmed when a store completes, so a
        # store that fails leaves them as they were.
        ready = set(self.ready)
        assert len(t1 & ready) + len(b1) <= self.n, f"|T1|+|B1| > c: {pol}"
        assert len(ready) + len(b1) + len(b2) <= 2 * self.n, f"ARC lists exceed 2c: {pol}"
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
