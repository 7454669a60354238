"""The scheduler adapter (TritonOffloadingManager) where vLLM relies on its own manager's behaviour (issue 12, A-D),
and vLLM's own ARC manager tests (E).

Driven the way vLLM's OffloadingConnector scheduler drives a manager: a ReqContext per request, the keys of a job
completed as a set, ``on_request_finished`` once all of a request's stores are prepared. No engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm.v1.kv_offload.base", reason="needs vLLM >= 0.32 (pip install 'triton-offload[vllm]')")

from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402
from vllm_configs import ctx, key  # noqa: E402

from triton_offload.connector.manager import TritonOffloadingManager  # noqa: E402

pytestmark = pytest.mark.vllm

BOTH = pytest.mark.parametrize("policy", ["lru", "arc"])


def policy_state(m: TritonOffloadingManager) -> dict:
    return m._manager.snapshot().policy


def store(m: TritonOffloadingManager, keys: list[bytes], rc: ReqContext) -> list[bytes]:
    out = m.prepare_store(keys, rc)
    assert out is not None
    m.complete_store(set(out.keys_to_store), rc)  # vLLM hands a job's keys back as a set
    return out.evicted_keys


@BOTH
def test_complete_store_of_a_key_not_in_flight_is_a_no_op(policy):
    """A. vLLM's manager ignores completions of keys already stored or never prepared; ours must not raise (that
    would stop the engine core) nor count them as stored."""
    m = TritonOffloadingManager(4, policy)
    rc = ctx("r")
    store(m, [key(0)], rc)
    before = (m._manager.snapshot(), m.counters)
    m.complete_store({key(0)}, rc)
    m.complete_store({key(5)}, rc)
    m.complete_store([key(0), key(5)], rc, success=False)
    assert (m._manager.snapshot(), m.counters) == before
    assert m.counters["stored_blocks"] == 1
    assert (m.lookup(key(0), rc), m.lookup(key(5), rc)) == (LookupResult.HIT, LookupResult.MISS)


@BOTH
def test_lookup_tells_each_state_apart(policy):
    """vLLM's per-key lookup in every state a key can be in: ready (HIT), being stored (HIT_PENDING), never stored,
    evicted (for ARC a ghost, which shares the key table with a negative code), dropped after a failed check, or
    failed to store (MISS). LRU answers from membership alone (its table holds ready keys only), ARC from the code."""
    m = TritonOffloadingManager(2, policy)
    rc = ctx("r")
    store(m, [key(0), key(1)], rc)
    pending = m.prepare_store([key(2)], rc)  # evicts key(1), the older of the two
    assert pending.evicted_keys == [key(1)]
    assert m._manager.key_state(key(1)) is None  # an ARC ghost is not cached
    got = {i: m.lookup(key(i), rc) for i in range(4)}
    assert got == {0: LookupResult.HIT, 1: LookupResult.MISS, 2: LookupResult.HIT_PENDING, 3: LookupResult.MISS}
    m.complete_store({key(2)}, rc, success=False)
    assert m.lookup(key(2), rc) is LookupResult.MISS
    m._manager.discard([key(0)])
    assert m.lookup(key(0), rc) is LookupResult.MISS
    if policy == "arc":  # the ghost stays one until it is stored again: a ready key then
        assert m._manager.snapshot().policy["b1"] == (key(1),)
        store(m, [key(1)], rc)
        assert m.lookup(key(1), rc) is LookupResult.HIT


_EVICTION_ORDER = textwrap.dedent(
    """
    import json
    from vllm.v1.kv_offload.base import ReqContext
    from vllm_configs import key
    from triton_offload.connector.manager import TritonOffloadingManager

    orders = {}
    for policy in ("lru", "arc"):
        m = TritonOffloadingManager(16, policy)
        rc = ReqContext(req_id="r")  # no key positions recorded
        out = m.prepare_store([key(i) for i in range(16)], rc)
        m.complete_store(set(out.keys_to_store), rc)  # as vLLM does: a set, iterated in hash order
        m.on_request_finished(rc)
        evicted = []
        for j in range(16):
            other = ReqContext(req_id=f"o{j}")
            out = m.prepare_store([key(100 + j)], other)
            m.complete_store(set(out.keys_to_store), other)
            m.on_request_finished(other)
            evicted += [int.from_bytes(k[:4], "big") for k in out.evicted_keys]
        orders[policy] = evicted
    print("ORDER " + json.dumps(orders))
    """
)


def test_eviction_order_does_not_depend_on_the_hash_seed():
    """B. Without key positions, eviction is deterministic (the same under two PYTHONHASHSEEDs, in separate
    processes) and takes a request's prefix tail before its head."""
    orders = []
    for seed in ("0", "4242"):
        # tests/ on the path: the script imports vllm_configs (a shared factory) as the tests here do.
        tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": path}
        proc = subprocess.run(
            [sys.executable, "-c", _EVICTION_ORDER], capture_output=True, text=True, env=env, timeout=120
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("ORDER ")]
        assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
        orders.append(json.loads(lines[-1][len("ORDER ") :]))
    assert orders[0] == orders[1], f"eviction order changes with PYTHONHASHSEED: {orders}"
    assert orders[0] == {"lru": list(range(15, -1, -1)), "arc": list(range(15, -1, -1))}


@BOTH
def test_a_late_store_completion_does_not_make_old_blocks_recent(policy):
    """C. Request a prepares its stores before request b; b's job completes first, a's last. a's blocks were used
    earlier, so they are evicted first, tail first; b's stay."""
    m = TritonOffloadingManager(4, policy)
    a, b = ctx("a"), ctx("b")
    out_a = m.prepare_store([key(0), key(1)], a)
    out_b = m.prepare_store([key(10), key(11)], b)
    m.complete_store(set(out_b.keys_to_store), b)
    m.on_request_finished(b)
    m.complete_store(set(out_a.keys_to_store), a)  # late
    c = ctx("c")
    assert store(m, [key(20), key(21)], c) == [key(1), key(0)]
    assert [m.lookup(key(i), c) for i in (10, 11)] == [LookupResult.HIT] * 2


def test_arc_counts_a_request_reusing_its_own_blocks_once():
    """D. With ARC, a request that stored blocks and then reads them back (e.g. after a preemption) or offers them
    again does not promote them to T2; a load by another request does, once, and its end adds nothing."""
    m = TritonOffloadingManager(8, "arc")
    r = ctx("r")
    store(m, [key(0), key(1)], r)
    m.prepare_load([key(0), key(1)], r)
    m.complete_load([key(0), key(1)], r)
    assert m.prepare_store([key(0), key(1), key(2)], r).keys_to_store == [key(2)]
    m.complete_store({key(2)}, r)
    m.on_request_finished(r)
    state = policy_state(m)
    assert (set(state["t1"]), state["t2"]) == ({key(0), key(1), key(2)}, ())

    s = ctx("s")
    m.prepare_load([key(0), key(1)], s)
    m.complete_load([key(0), key(1)], s)
    m.prepare_store([key(0), key(1), key(3)], s)  # offered again after the load: no second count
    m.complete_store({key(3)}, s)
    m.on_request_finished(s)
    state = policy_state(m)
    assert (set(state["t1"]), state["t2"]) == ({key(2), key(3)}, (key(1), key(0)))


def test_two_groups_interleave_by_position_and_specs_keep_vllms_order():
    """With two KV-cache groups vLLM passes keys group by group; the policy sees them block by block (by the end
    token vLLM recorded), so both groups lose their tails before either loses its head. The host ids still follow
    vLLM's order of the keys, as vLLM pairs them with its GPU blocks."""
    g0, g1 = [key(i, 0) for i in range(3)], [key(i, 1) for i in range(3)]
    positions = {k: 32 * (i + 1) for group in (g0, g1) for i, k in enumerate(group)}
    m = TritonOffloadingManager(6)
    rc = ctx("r", positions)
    out = m.prepare_store(g0 + g1, rc)
    assert out.keys_to_store == g0 + g1
    ids = out.store_spec.block_ids.tolist()
    m.complete_store(set(out.keys_to_store), rc)
    assert m.prepare_load(g1 + g0, rc).block_ids.tolist() == ids[3:] + ids[:3]
    m.complete_load(g1 + g0, rc)
    m.on_request_finished(rc)
    other = ctx("o")
    assert store(m, [key(100 + i) for i in range(4)], other) == [g1[2], g0[2], g1[1], g0[1]]


def test_a_request_started_before_a_reset_starts_afresh():
    """After reset_cache a request's earlier history belongs to the old cache: the blocks it stores again are its own
    (no reuse), and its end refreshes only what it used since."""
    m = TritonOffloadingManager(4, "arc")
    r = ctx("r")
    store(m, [key(0)], r)
    m.reset_cache()
    store(m, [key(0)], ctx("other"))
    m.prepare_load([key(0)], r)  # stored by someone else in this cache: a reuse
    m.complete_load([key(0)], r)
    assert policy_state(m)["t2"] == (key(0),)
    m.on_request_finished(r)
    assert m.counters["stored_blocks"] == 2


# -- E. vLLM's own ARC manager tests (tests/v1/kv_offload, TestARCPolicy), replayed against ours -----------------------
# They pass one ReqContext(req_id="") to every call: no request identity, so each call is a use of its own (a touch
# of a once-used block promotes it to T2), while a real request keeps counting its own blocks once (D above).

ANON = ReqContext(req_id="")


def test_vllm_arc_t1_to_t2_promotion():
    """vLLM's TestARCPolicy::test_t1_to_t2_promotion: a stored block starts in T1; a touch is its second use."""
    m = TritonOffloadingManager(4, "arc")
    store(m, [key(1)], ANON)
    assert (policy_state(m)["t1"], policy_state(m)["t2"]) == ((key(1),), ())
    m.touch([key(1)], ANON)
    assert (policy_state(m)["t1"], policy_state(m)["t2"]) == ((), (key(1),))


def test_vllm_arc_touch_ordering():
    """vLLM's TestARCPolicy::test_touch_ordering: touching 3, 4 promotes them; touching 1, 3, 4 promotes 1, leaving
    T1 = {2}, T2 = {1, 3, 4}; the next store evicts 2, the one block in T1, and reuses its host block."""
    m = TritonOffloadingManager(4, "arc")
    store(m, [key(1), key(2), key(3), key(4)], ANON)
    m.touch([key(3), key(4)], ANON)
    m.touch([key(1), key(3), key(4)], ANON)
    state = policy_state(m)
    assert (state["t1"], set(state["t2"])) == ((key(2),), {key(1), key(3), key(4)})
    out = m.prepare_store([key(5)], ANON)
    assert out is not None and (out.keys_to_store, out.evicted_keys) == ([key(5)], [key(2)])
    assert out.store_spec.block_ids.tolist() == [1], "key 2's host block (the second handed out)"


def test_vllm_arc_failed_store():
    """vLLM's TestARCPolicy::test_failed_store: a full cache evicts one block for a new one; the store fails: the new
    block is neither cached nor in T1/T2, and the evicted block stays a B1 ghost."""
    m = TritonOffloadingManager(4, "arc")
    store(m, [key(1), key(2), key(3), key(4)], ANON)
    out = m.prepare_store([key(5)], ANON)
    assert out is not None and len(out.evicted_keys) == 1
    m.complete_store([key(5)], ANON, success=False)
    state = policy_state(m)
    assert m.lookup(key(5), ANON) is LookupResult.MISS
    assert key(5) not in state["t1"] + state["t2"]
    assert out.evicted_keys[0] in state["b1"]


@pytest.mark.parametrize("req_id, t2", [("", (key(0),)), ("r", ())], ids=["anonymous", "request"])
def test_only_a_request_with_an_id_counts_its_own_blocks_once(req_id, t2):
    """The same calls through one context: anonymous, the touch after the store is a second use (T2); for request
    "r" the block is its own and stays in T1, also after the request ends."""
    m = TritonOffloadingManager(4, "arc")
    rc = ReqContext(req_id=req_id)
    store(m, [key(0)], rc)
    m.prepare_load([key(0)], rc)
    m.complete_load([key(0)], rc)
    m.touch([key(0)], rc)
    m.on_request_finished(rc)
    assert policy_state(m)["t2"] == t2
