"""The manager with several block pools (``OffloadManager(..., pools=, pool_of=)``), as the vLLM plugin uses it for
host rows with one region per KV-cache group: a key takes a block of its own pool and evicts only keys of its pool.

Scenarios, and a property test against a trivially correct model: one single-pool manager per pool, each fed its
pool's keys, where a call that cannot be satisfied in every pool changes no pool.
"""

from __future__ import annotations

import copy

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from triton_offload.manager import OffloadManager


def pool_of(key: bytes) -> int:
    return key[0] - ord("a")  # b"a..." in pool 0, b"b..." in pool 1, ...


def test_a_key_evicts_only_keys_of_its_pool():
    """Pool 0 full of evictable keys and pool 1 full of pinned ones: a store to pool 1 finds no room and changes
    nothing, though pool 0 could give room; a store to pool 0 evicts its least recent key; block ids repeat across
    pools (region 0 and region 1 of one row)."""
    m = OffloadManager(2, "lru", pools=2, pool_of=pool_of, enable_events=True)
    out = m.prepare_store([b"a0", b"b0", b"a1", b"b1"])
    assert out.host_block_ids == [0, 0, 1, 1] and out.evicted_keys == []
    m.complete_store(out.keys_to_store)
    m.prepare_load([b"b0", b"b1"])  # pins pool 1
    before = m.snapshot()
    assert m.prepare_store([b"b2"]) is None
    assert m.prepare_store([b"a2", b"b2"]) is None, "a call is all or nothing across pools"
    assert m.snapshot() == before
    out = m.prepare_store([b"a2"])
    assert out.evicted_keys == [b"a1"] and out.host_block_ids == [1]
    assert len(m) + m.num_free == m.num_blocks * m.num_pools == 4


def test_pools_need_a_pool_of_keys():
    with pytest.raises(ValueError, match="pools = 2 needs pool_of"):
        OffloadManager(4, pools=2)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "complete", "fail", "load", "unload", "touch", "reset"]),
        st.lists(st.sampled_from([b"a0", b"a1", b"a2", b"a3", b"b0", b"b1", b"b2", b"c0", b"c1"]), max_size=5),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, num_blocks=st.integers(1, 3), policy=st.sampled_from(["lru", "arc"]))
def test_pools_behave_as_independent_managers(ops, num_blocks, policy):
    pooled = OffloadManager(num_blocks, policy, pools=3, pool_of=pool_of)
    model = [OffloadManager(num_blocks, policy) for _ in range(3)]
    loads: list[list[bytes]] = []

    def split(keys):
        parts = [[], [], []]
        for key in keys:
            parts[pool_of(key)].append(key)
        return parts

    for op, keys in ops:
        parts = split(keys)
        if op == "store":
            trial = copy.deepcopy(model)
            outs = [trial[p].prepare_store(parts[p]) if parts[p] else None for p in range(3)]
            ok = all(o is not None for p, o in enumerate(outs) if parts[p])
            got = pooled.prepare_store(keys)
            if not ok:
                assert got is None
                continue
            model = trial
            where = {k: h for o in outs if o for k, h in zip(o.keys_to_store, o.host_block_ids)}
            assert got.keys_to_store == [k for k in dict.fromkeys(keys) if k in where]
            assert got.host_block_ids == [where[k] for k in got.keys_to_store]
            assert got.evicted_keys == [k for o in outs if o for k in o.evicted_keys]
        elif op in ("complete", "fail"):
            done = pooled.complete_store(keys, success=op == "complete")
            want = [k for p in range(3) for k in model[p].complete_store(parts[p], success=op == "complete")]
            assert sorted(done) == sorted(want)
        elif op == "load":
            ready = [all(m.key_state(k) == "ready" for k in part) for m, part in zip(model, parts)]
            if not all(ready):
                with pytest.raises(ValueError):
                    pooled.prepare_load(keys)
                continue
            got = pooled.prepare_load(keys)
            where = {}
            for p in range(3):
                where.update(zip(parts[p], model[p].prepare_load(parts[p])))
            assert got == [where[k] for k in keys]
            loads.append(keys)
        elif op == "unload" and loads:
            done = loads.pop()
            pooled.complete_load(done)
            for p, part in enumerate(split(done)):
                model[p].complete_load(part)
        elif op == "touch":
            pooled.touch(keys)
            for p in range(3):
                model[p].touch(parts[p])
        elif op == "reset":
            assert sorted(pooled.reset()) == sorted(k for m in model for k in m.reset())
        snap, snaps = pooled.snapshot(), [m.snapshot() for m in model]
        assert snap.ready == {k: v for s in snaps for k, v in s.ready.items()}
        assert snap.storing == {k: v for s in snaps for k, v in s.storing.items()}
        assert snap.free_block_ids == tuple(s.free_block_ids for s in snaps)
        assert snap.policy == {"pools": tuple(s.policy for s in snaps)}
