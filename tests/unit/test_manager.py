"""Scenario tests of the scheduler-side manager and its eviction policies (pure Python, no torch)."""

from __future__ import annotations

import logging

import pytest

from triton_offload.manager import OffloadEvent, OffloadManager, RequestUse, StoreAllocation
from triton_offload.policies import POLICIES, ARCPolicy, LRUPolicy, make_policy

BOTH = pytest.mark.parametrize("policy", ["lru", "arc"])


def k(i: int) -> bytes:
    """A block-hash-like key."""
    return b"h%04d" % i


def store(m: OffloadManager, keys: list[bytes], success: bool = True) -> StoreAllocation:
    out = m.prepare_store(keys)
    assert out is not None, f"no room to store {keys}"
    m.complete_store(out.keys_to_store, success=success)
    return out


def store_each(m: OffloadManager, keys: list[bytes]) -> None:
    """Stores keys one call each, so the last one is the most recently used."""
    for key in keys:
        store(m, [key])


@BOTH
def test_fill_then_hit(policy):
    """Filling the cache hands out every block exactly once; keys become hits only once their store completes."""
    m = OffloadManager(4, policy)
    out = m.prepare_store([k(0), k(1), k(2), k(3)])
    assert out == StoreAllocation([k(0), k(1), k(2), k(3)], [0, 1, 2, 3], [])
    assert (m.num_free, m.num_cached, m.num_storing, len(m)) == (0, 0, 4, 4)
    assert m.lookup([k(0)]) == 0, "an in-flight store must not be a hit"
    m.complete_store(out.keys_to_store)
    assert (m.num_free, m.num_cached, m.num_storing, len(m)) == (0, 4, 0, 4)
    assert m.lookup([k(0), k(1), k(2), k(3), k(4)]) == 4
    assert m.lookup([k(1), k(9), k(2)]) == 1, "lookup counts only the leading run of hits"
    assert m.lookup([k(9), k(0)]) == 0
    stats = m.stats
    assert (stats.hits, stats.misses, stats.stores, stats.evictions) == (5, 1 + 1 + 2 + 2, 4, 0)


@BOTH
def test_lookup_stops_at_in_flight_key(policy):
    """A ready prefix followed by a key still being stored counts only the prefix."""
    m = OffloadManager(4, policy)
    store(m, [k(0)])
    assert m.prepare_store([k(1)]) is not None
    assert m.lookup([k(0), k(1)]) == 1
    m.complete_store([k(1)])
    assert m.lookup([k(0), k(1)]) == 2


@BOTH
def test_prepare_load_returns_blocks_and_pins(policy):
    """Loading returns the blocks the keys were stored in and pins them until complete_load."""
    m = OffloadManager(4, policy)
    out = store(m, [k(0), k(1), k(2)])
    assert m.prepare_load([k(2), k(0)]) == [out.host_block_ids[2], out.host_block_ids[0]]
    assert m.num_pinned == 2
    m.complete_load([k(0), k(2)])
    assert m.num_pinned == 0


def test_pinned_lru_victim_is_skipped():
    """The least recently used key is loading (pinned): eviction takes the next one, and the pin is a count."""
    m = OffloadManager(3, "lru")
    store_each(m, [k(0), k(1), k(2)])  # LRU order: 0, 1, 2
    m.prepare_load([k(0)])
    m.prepare_load([k(0)])  # a second request loads the same block
    out = m.prepare_store([k(3)])
    assert out is not None and out.evicted_keys == [k(1)]
    m.complete_store([k(3)])
    m.complete_load([k(0)])  # one load still in flight: k0 stays pinned
    out = m.prepare_store([k(4)])
    assert out is not None and out.evicted_keys == [k(2)]
    m.complete_store([k(4)])
    m.complete_load([k(0)])
    out = m.prepare_store([k(5)])
    assert out is not None and out.evicted_keys == [k(0)]


@BOTH
def test_load_of_key_not_ready_raises_and_pins_nothing(policy):
    """Loading a missing key or one whose store is in flight is a ValueError naming it; no key gets pinned."""
    m = OffloadManager(2, policy)
    store(m, [k(0)])
    with pytest.raises(ValueError, match="h0009.*not cached"):
        m.prepare_load([k(0), k(9)])
    assert m.prepare_store([k(1)]) is not None
    with pytest.raises(ValueError, match="h0001.*still being stored"):
        m.prepare_load([k(0), k(1)])
    assert m.num_pinned == 0
    with pytest.raises(ValueError, match="h0000.*0 load"):
        m.complete_load([k(0)])


def test_lru_eviction_order_and_touch():
    """LRU evicts the oldest key first; a touch makes a key the newest, and touch applies keys in reverse."""
    m = OffloadManager(4, "lru")
    store_each(m, [k(0), k(1), k(2), k(3)])
    m.touch([k(0)])  # order now 1, 2, 3, 0
    out = m.prepare_store([k(4), k(5)])
    assert out is not None and out.evicted_keys == [k(1), k(2)]
    m.complete_store(out.keys_to_store)
    # Now 3, 0, then 5, 4 (a store call applies keys in reverse too). Touching [3, 0] leaves 0 older than 3.
    m.touch([k(3), k(0), k(99)])  # unknown keys are ignored
    out = m.prepare_store([k(6), k(7), k(8), k(9)])
    assert out is not None and out.evicted_keys == [k(5), k(4), k(0), k(3)]


def test_store_call_keeps_prefix_head_longest():
    """Keys stored in one call are evicted tail first, so what survives is still a usable prefix."""
    m = OffloadManager(3, "lru")
    store(m, [k(0), k(1), k(2)])
    out = m.prepare_store([k(3)])
    assert out is not None and out.evicted_keys == [k(2)]
    m.complete_store([k(3)])
    assert m.lookup([k(0), k(1), k(2)]) == 2


@BOTH
def test_recency_follows_use_not_store_completion(policy):
    """Request a stores its blocks, then b stores its own; a's copy completes last. A late completion is no use:
    a's blocks, used earlier, are evicted first (tail first), not b's."""
    m = OffloadManager(4, policy)
    a = m.prepare_store([k(0), k(1)])
    b = m.prepare_store([k(10), k(11)])
    m.complete_store(b.keys_to_store)
    m.complete_store(a.keys_to_store)
    out = m.prepare_store([k(20)])
    assert out is not None and out.evicted_keys == [k(1)]
    m.complete_store(out.keys_to_store)
    out = m.prepare_store([k(21)])
    assert out is not None and out.evicted_keys == [k(0)]


def test_a_store_in_flight_takes_its_place_when_used():
    """A key whose store is in flight is used (touched, offered again): it moves up in recency like a ready key,
    and keeps that place when its store completes. Eviction skips it meanwhile."""
    m = OffloadManager(3, "lru")
    store_each(m, [k(0), k(1)])
    assert m.prepare_store([k(2)]) is not None  # in flight, the most recent
    m.touch([k(0)])  # order: 1, 2, 0
    out = m.prepare_store([k(3)])  # evicts 1; k2 is not evictable yet, nothing else is older
    assert out is not None and out.evicted_keys == [k(1)]
    m.complete_store([k(3)])
    m.prepare_store([k(2)])  # offered again while in flight: a use, so the most recent now
    m.complete_store([k(2)])
    assert m.snapshot().policy == {"order": (k(0), k(3), k(2))}


def test_arc_counts_reuse_once_per_request():
    """ARC, as vLLM: a request loading, touching or offering again blocks it stored itself keeps them in T1 (one use);
    another request's load is a reuse (T2); its second load, its offer and its end count nothing more."""
    m = OffloadManager(8, "arc")
    r, s = RequestUse(), RequestUse()
    out = m.prepare_store([k(0), k(1)], r)
    m.complete_store(out.keys_to_store)
    m.prepare_load([k(0), k(1)], r)
    m.complete_load([k(0), k(1)])
    m.touch([k(1)], r)
    assert m.prepare_store([k(0), k(1), k(2)], r).keys_to_store == [k(2)]
    m.complete_store([k(2)])
    m.finish_request(r)
    pol = m.snapshot().policy
    assert (set(pol["t1"]), pol["t2"]) == ({k(0), k(1), k(2)}, ()), "a request's own blocks counted as reused"

    m.prepare_load([k(0)], s)
    m.complete_load([k(0)])
    assert m.snapshot().policy["t2"] == (k(0),)
    m.prepare_load([k(1)], s)
    m.complete_load([k(1)])
    m.prepare_store([k(0), k(1)], s)
    m.finish_request(s)
    pol = m.snapshot().policy
    assert (pol["t1"], pol["t2"]) == ((k(2),), (k(1), k(0))), "the head, first in the request, is the most recent"
    assert m.snapshot().policy["p"] == 0

    m.prepare_load([k(2)])  # no request: every use counts
    m.complete_load([k(2)])
    assert m.snapshot().policy["t1"] == ()


def test_finish_request_makes_its_keys_recent_head_first():
    """A request that ends used all its blocks until then: they become newer than blocks another request stored
    meanwhile, the head most recent; keys it no longer holds are skipped; an explicit order wins; a second finish
    changes nothing."""
    m = OffloadManager(5, "lru")
    r = RequestUse()
    m.complete_store(m.prepare_store([k(0), k(1)], r).keys_to_store)
    m.complete_store(m.prepare_store([k(10), k(11)]).keys_to_store)  # another request, later
    assert m.prepare_store([k(2)], r) is not None  # r's tail, still in flight when it ends
    assert list(r.keys) == [k(0), k(1), k(2)]
    m.finish_request(r)
    assert m.snapshot().policy == {"order": (k(11), k(10), k(2), k(1), k(0))}
    assert not r.keys
    m.finish_request(r)
    assert m.snapshot().policy == {"order": (k(11), k(10), k(2), k(1), k(0))}

    q = RequestUse()
    m.touch([k(10), k(11), k(99)], q)
    m.finish_request(q, order=[k(11), k(98), k(10)])  # e.g. sorted by token position
    assert m.snapshot().policy == {"order": (k(2), k(1), k(0), k(10), k(11))}


@pytest.mark.parametrize("policy, survives", [("lru", False), ("arc", True)])
def test_arc_keeps_frequent_key_through_a_scan(policy, survives):
    """A key used twice, then a scan of once-used keys as long as the cache: LRU loses it, ARC keeps it in T2."""
    m = OffloadManager(4, policy)
    store_each(m, [k(0), k(1), k(2), k(3)])
    m.touch([k(0)])  # second use of k0
    for i in range(10, 14):
        out = m.prepare_store([k(i)])
        assert out is not None
        m.complete_store(out.keys_to_store)
    assert (m.lookup([k(0)]) == 1) is survives
    assert m.num_cached == 4


def test_arc_ghost_hit_moves_key_to_t2_and_adapts_target():
    """A key evicted from T1 and stored again comes back into T2 and grows T1's target p; a B2 ghost shrinks it."""
    m = OffloadManager(2, "arc")
    store(m, [k(0)])
    m.touch([k(0)])  # k0 moves to T2
    store(m, [k(1)])
    out = m.prepare_store([k(2)])
    assert out is not None and out.evicted_keys == [k(1)], "T1 is over its target p=0, so its LRU key goes"
    m.complete_store([k(2)])
    snap = m.snapshot().policy
    assert snap == {"t1": (k(2),), "t2": (k(0),), "b1": (k(1),), "b2": (), "p": 0}
    out = m.prepare_store([k(1)])
    assert out is not None and out.evicted_keys == [k(2)]
    m.complete_store([k(1)])
    snap = m.snapshot().policy
    assert snap == {"t1": (), "t2": (k(0), k(1)), "b1": (k(2),), "b2": (), "p": 1}
    store(m, [k(3)])  # T1 is empty, so T2's LRU key k0 goes (to B2)
    out = m.prepare_store([k(4)])
    assert out is not None and out.evicted_keys == [k(1)], "with |T1| == p the victim must come from T2"
    m.complete_store([k(4)])
    out = m.prepare_store([k(0)])  # k0 is a B2 ghost now
    assert out is not None and out.evicted_keys == [k(3)], "T1 is over p again, so its LRU key goes"
    m.complete_store([k(0)])
    snap = m.snapshot().policy
    assert snap == {"t1": (k(4),), "t2": (k(0),), "b1": (k(3),), "b2": (k(1),), "p": 0}, "a B2 hit shrinks p"


@pytest.mark.parametrize("success, ghosts", [(False, (k(3),)), (True, ())], ids=["failed", "completed"])
def test_arc_trims_ghosts_when_a_store_completes(success, ghosts):
    """The key evicted to make room for a store is a B1 ghost; if the store fails it stays one, as in vLLM (its
    TestARCPolicy::test_failed_store), while a store that completes trims B1 to the paper's |T1| + |B1| <= c."""
    m = OffloadManager(4, "arc")
    store(m, [k(0), k(1), k(2), k(3)])  # T1 full; the prefix head k0 is the most recent, so the tail k3 goes first
    out = m.prepare_store([k(4)])
    assert out is not None and out.evicted_keys == [k(3)]
    assert m.snapshot().policy["b1"] == (k(3),)
    m.complete_store([k(4)], success=success)
    pol = m.snapshot().policy
    assert (pol["b1"], set(pol["t1"])) == (ghosts, {k(0), k(1), k(2)} | ({k(4)} if success else set()))
    assert m.lookup([k(4)]) == int(success)


def test_arc_ghost_lists_stay_bounded():
    """Under a long stream with re-references, |T1|+|B1| <= c and all four lists <= 2c, with ghosts in use."""
    c = 4
    m = OffloadManager(c, "arc")
    saw_b1 = saw_b2 = False
    for step in range(200):
        key = k(step % 13 if step % 3 else step % 5)  # mixes keys seen once and keys seen again
        if m.lookup([key]):
            m.touch([key])
        else:
            store(m, [key])
        s = m.snapshot().policy
        assert len(s["t1"]) + len(s["b1"]) <= c, s
        assert len(s["t1"]) + len(s["t2"]) + len(s["b1"]) + len(s["b2"]) <= 2 * c, s
        assert 0 <= s["p"] <= c
        saw_b1 |= len(s["b1"]) > 0
        saw_b2 |= len(s["b2"]) > 0
    assert saw_b1 and saw_b2, "the stream never filled both ghost lists, so the bounds were not exercised"


@BOTH
def test_store_failure_frees_blocks(policy):
    """A failed store frees its blocks, reports nothing as cached, and the keys can be stored again."""
    m = OffloadManager(2, policy, enable_events=True)
    out = m.prepare_store([k(0), k(1)])
    m.complete_store(out.keys_to_store, success=False)
    assert (m.num_free, m.num_cached, len(m), m.lookup([k(0)])) == (2, 0, 0, 0)
    assert m.stats.store_failures == 2 and m.stats.stores == 0
    assert m.take_events() == []
    assert m.snapshot().policy in ({"order": ()}, {"t1": (), "t2": (), "b1": (), "b2": (), "p": 0})
    out = m.prepare_store([k(0), k(1)])
    assert out is not None and out.keys_to_store == [k(0), k(1)]


@BOTH
def test_store_skips_cached_and_in_flight_keys(policy):
    """Ready keys, keys whose store is in flight, and repeats within the call are not stored (again)."""
    m = OffloadManager(8, policy)
    store(m, [k(0), k(1)])
    first = m.prepare_store([k(2)])
    out = m.prepare_store([k(0), k(2), k(3), k(1), k(3), k(4)])
    assert out is not None
    assert out.keys_to_store == [k(3), k(4)]
    assert len(set(out.host_block_ids) | set(first.host_block_ids)) == 3, "blocks handed out twice"
    assert m.num_free == 8 - 5
    assert m.prepare_store([k(0), k(2)]) == StoreAllocation([], [], [])


@BOTH
@pytest.mark.parametrize("success", [True, False], ids=["success", "failure"])
def test_complete_store_of_a_key_not_in_flight_is_a_no_op(policy, success, caplog):
    """vLLM's manager ignores a completion of a key already stored or never prepared, and callers rely on it: such a
    key changes nothing (no counter, no event, no block freed, no recency) and is logged at debug level; the keys of
    the same call that are in flight complete normally."""
    m = OffloadManager(4, policy, enable_events=True)
    store(m, [k(0)])
    assert m.prepare_store([k(1), k(2)]) is not None
    m.take_events()
    before = m.snapshot()
    with caplog.at_level(logging.DEBUG, logger="triton_offload.manager"):
        assert m.complete_store([k(0)], success=success) == []
        assert m.complete_store([k(7), k(7)], success=success) == []
    assert m.snapshot() == before
    assert "h0000" in caplog.text and "already stored" in caplog.text
    assert "h0007" in caplog.text and "not being stored" in caplog.text

    assert m.complete_store([k(0), k(2), k(7), k(2)], success=success) == [k(2)]
    assert (m.key_state(k(0)), m.key_state(k(1)), m.key_state(k(2))) == (
        "ready",
        "storing",
        "ready" if success else None,
    )
    assert (m.num_cached, m.num_storing, m.num_free) == ((2, 1, 1) if success else (1, 1, 2))
    assert (m.stats.stores, m.stats.store_failures) == ((2, 0) if success else (1, 1))
    assert m.take_events() == ([OffloadEvent("stored", [k(2)])] if success else [])
    policy_keys = m.snapshot().policy
    resident = set(policy_keys["order"]) if policy == "lru" else set(policy_keys["t1"]) | set(policy_keys["t2"])
    assert resident == ({k(0), k(1), k(2)} if success else {k(0), k(1)})


@BOTH
def test_eviction_spares_keys_named_in_the_call(policy):
    """A key in the store call that is already cached is the LRU victim, but eviction takes another key."""
    m = OffloadManager(2, policy)
    store_each(m, [k(0), k(1)])
    out = m.prepare_store([k(0), k(2)])
    assert out is not None and out.keys_to_store == [k(2)] and out.evicted_keys == [k(1)]


@BOTH
def test_in_flight_store_is_never_evicted(policy):
    """With the cache full of in-flight stores, a new store gets None instead of taking their blocks."""
    m = OffloadManager(2, policy)
    assert m.prepare_store([k(0), k(1)]) is not None
    before = m.snapshot()
    assert m.prepare_store([k(2)]) is None
    assert m.snapshot() == before


@BOTH
def test_no_room_returns_none_and_changes_nothing(policy):
    """Full of pinned blocks: None and identical state. Room for only part of a call: None, nothing evicted."""
    m = OffloadManager(3, policy, enable_events=True)
    store_each(m, [k(0), k(1), k(2)])
    m.touch([k(1)])
    m.prepare_load([k(0), k(1), k(2)])
    before = m.snapshot()
    assert m.prepare_store([k(3)]) is None
    assert m.snapshot() == before

    m.complete_load([k(2)])  # one evictable key, two needed
    before = m.snapshot()
    assert m.prepare_store([k(3), k(4)]) is None
    assert m.snapshot() == before
    assert m.prepare_store([k(2), k(3)]) is None, "the only evictable key is named in the call"
    assert m.snapshot() == before
    assert m.prepare_store([k(3), k(4), k(5), k(6)]) is None, "more keys than the cache holds"
    assert m.snapshot() == before
    assert m.lookup([k(2)]) == 1


@pytest.mark.parametrize("name", ["LRUU", "fifo", "", None])
def test_unknown_policy_lists_supported_names(name):
    """An unknown policy name is a ValueError naming it and every supported one."""
    with pytest.raises(ValueError) as err:
        OffloadManager(4, name)
    assert repr(name) in str(err.value)
    for supported in POLICIES:
        assert supported in str(err.value)
    with pytest.raises(ValueError, match="supported: arc, lru"):
        make_policy(name, 4)


@pytest.mark.parametrize("num_blocks", [0, -1, 2.0, True])
def test_bad_num_blocks(num_blocks):
    """The block count must be a positive int; the message carries the bad value."""
    with pytest.raises(ValueError, match=repr(num_blocks).replace(".", r"\.")):
        OffloadManager(num_blocks)


def test_policy_names_are_case_insensitive_everywhere():
    """The manager accepts what the connector's configuration accepts ("ARC" from a JSON config)."""
    assert isinstance(make_policy("LRU", 3), LRUPolicy) and isinstance(make_policy("Arc", 3), ARCPolicy)
    assert OffloadManager(4, "ARC").snapshot().policy == OffloadManager(4, "arc").snapshot().policy


def test_make_policy_builds_named_class():
    """Names map to their classes, with the given capacity."""
    assert isinstance(make_policy("lru", 3), LRUPolicy) and make_policy("lru", 3).capacity == 3
    assert isinstance(make_policy("arc", 5), ARCPolicy) and make_policy("arc", 5).capacity == 5


@BOTH
def test_policy_refuses_insert_beyond_capacity(policy):
    """A policy never holds more resident slots (host blocks) than its capacity, nor a slot twice."""
    p = make_policy(policy, 2, slots=4)
    p.insert(0, k(0))
    with pytest.raises(ValueError, match="already resident"):
        p.insert(0, k(0))
    p.insert(1, k(1))
    with pytest.raises(ValueError, match="capacity 2"):
        p.insert(2, k(2))
    assert len(p) == 2 and 2 not in p and 0 in p


@BOTH
def test_events(policy):
    """Stored events at successful completion, removed events on eviction and reset; take_events clears them."""
    m = OffloadManager(2, policy, enable_events=True)
    out = m.prepare_store([k(0), k(1)])
    assert m.take_events() == [], "nothing is stored before complete_store"
    m.complete_store(out.keys_to_store)
    store(m, [k(2)])
    assert m.take_events() == [
        OffloadEvent("stored", [k(0), k(1)]),
        OffloadEvent("removed", [k(1)]),
        OffloadEvent("stored", [k(2)]),
    ]
    assert m.take_events() == []
    assert sorted(m.reset()) == [k(0), k(2)]
    assert [(e.kind, sorted(e.keys)) for e in m.take_events()] == [("removed", [k(0), k(2)])]

    quiet = OffloadManager(2, policy)
    store(quiet, [k(0), k(1)])
    store(quiet, [k(2)])
    assert quiet.take_events() == []


@BOTH
def test_reset_keeps_pinned_and_in_flight(policy):
    """Reset drops ready unpinned keys only; loads and stores in flight complete normally afterwards."""
    m = OffloadManager(4, policy)
    store(m, [k(0), k(1)])
    m.prepare_load([k(0)])
    assert m.prepare_store([k(2)]) is not None
    assert m.reset() == [k(1)]
    assert (m.num_cached, m.num_storing, m.num_free) == (1, 1, 2)
    assert m.lookup([k(0)]) == 1 and m.lookup([k(1)]) == 0
    assert m.stats.evictions == 0, "a reset is not an eviction"
    m.complete_store([k(2)])
    m.complete_load([k(0)])
    assert m.lookup([k(2)]) == 1
    assert sorted(m.reset()) == [k(0), k(2)] and m.num_free == 4


@BOTH
def test_key_state_tells_pending_from_missing(policy):
    """key_state follows a key through storing, ready, failed and evicted, and changes nothing it reads."""
    m = OffloadManager(1, policy)
    assert m.key_state(k(0)) is None
    assert m.prepare_store([k(0)]) is not None
    assert m.key_state(k(0)) == "storing"
    m.complete_store([k(0)], success=False)
    assert m.key_state(k(0)) is None, "a failed store leaves nothing behind"
    store(m, [k(0)])
    before = m.snapshot()
    assert m.key_state(k(0)) == "ready"
    assert m.snapshot() == before, "a state query must not count a hit or touch the policy"
    store(m, [k(1)])  # evicts k0: the cache holds one block
    assert (m.key_state(k(0)), m.key_state(k(1))) == (None, "ready")
