"""The manager of issue 61 (slot arrays, sharded key tables, lazy free lists) behaves exactly as the one before it
(tests/unit/reference_manager.py) on random call sequences: every call returns the same (hits, block ids, victims,
keys ended, events, errors) and the full state (ready, storing, pins, free list in order, the policy's lists and ARC's
ghosts and target) is equal after every few calls, with one or two pools, small caches where every store evicts, and a
cache of several key-table shards and slot chunks (where only reset's order differs, as its docstring says)."""

from __future__ import annotations

import random

import pytest

from tests.unit.reference_manager import ReferenceManager
from triton_offload.manager import OffloadManager, RequestUse


def _call(m, name: str, *args):
    """The call's result, or the type and message of what it raised."""
    try:
        return getattr(m, name)(*args)
    except ValueError as exc:
        return ("raised", type(exc).__name__, str(exc))


class Pair:
    """Drives a new and a reference manager through the same calls and compares what they return."""

    def __init__(self, num_blocks: int, policy: str, pools: int, events: bool) -> None:
        pool_of = (lambda key: key[-1] % pools) if pools > 1 else None
        kwargs = dict(enable_events=events, pools=pools, pool_of=pool_of)
        self.new = OffloadManager(num_blocks, policy, **kwargs)
        self.ref = ReferenceManager(num_blocks, policy, **kwargs)
        self.requests = [(RequestUse(), RequestUse()) for _ in range(3)]
        self.calls = 0

    def both(self, name: str, *args, req: int | None = None):
        """``name(*args, request)`` (``name(request, *args)`` for finish_request) on both, each with its request."""
        got, want = (
            _call(m, name, *args) if req is None
            else _call(m, name, self.requests[req][side], *args) if name == "finish_request"
            else _call(m, name, *args, self.requests[req][side])
            for side, m in enumerate((self.new, self.ref))
        )  # fmt: skip
        self.calls += 1
        assert got == want, f"call {self.calls}: {name}{args} req={req}: {got!r} != reference {want!r}"
        return got

    def check_state(self) -> None:
        new, ref = self.new, self.ref
        assert new.snapshot() == ref.snapshot(), f"state differs after call {self.calls}"
        assert (len(new), new.num_free, new.num_cached, new.num_storing, new.num_pinned) == (
            len(ref),
            ref.num_free,
            ref.num_cached,
            ref.num_storing,
            ref.num_pinned,
        )
        for a, b in self.requests:
            # The keys in order (the new manager also keeps each key's last slot there, a hint for finish_request).
            assert (list(a.keys), a.inserted, a.reused) == (list(b.keys), b.inserted, b.reused)


def run_trace(seed, num_blocks, num_keys, policy, pools, steps, check_every, resets=True):
    rng = random.Random(seed)
    keys = [b"key-%06d" % i + bytes([i % 251]) for i in range(num_keys)]
    pair = Pair(num_blocks, policy, pools, events=rng.random() < 0.5)
    storing: list[bytes] = []  # keys with a store in flight (the same in both)
    loading: list[list[bytes]] = []
    batch = max(4, num_blocks // 4)

    def some(pool: list, most: int) -> list:
        # Runs of consecutive keys (a request's prefix) with the odd repeat, as the connector sends them.
        start = rng.randrange(len(pool))
        run = pool[start : start + rng.randint(1, most)]
        return run + rng.sample(run, 1) if rng.random() < 0.1 else run

    for step in range(steps):
        req = rng.choice([None, 0, 1, 2])
        op = rng.random()
        if op < 0.3:
            out = pair.both("prepare_store", some(keys, batch), req=req)
            if out is not None:
                storing += out.keys_to_store
        elif op < 0.45 and storing:
            rng.shuffle(storing)
            cut = rng.randint(1, len(storing))
            done, storing[:] = storing[:cut], storing[cut:]
            stale = [rng.choice(keys)] if rng.random() < 0.2 else []
            pair.both("complete_store", done + stale, rng.random() < 0.9)
        elif op < 0.6:
            want = some(keys, batch)
            hits = pair.both("lookup", want)
            load = want[: max(hits, 1) if rng.random() < 0.1 else hits]  # sometimes a key that is not ready
            if load and not isinstance(pair.both("prepare_load", load, req=req), tuple):
                loading.append(load)
        elif op < 0.7 and loading:
            pair.both("complete_load", loading.pop(rng.randrange(len(loading))))
        elif op < 0.8:
            pair.both("touch", some(keys, batch), req=req)
        elif op < 0.88 and req is not None:
            order = None if rng.random() < 0.5 else some(keys, batch)
            pair.both("finish_request", *(() if order is None else (order,)), req=req)
        elif op < 0.92:
            pair.both("discard", some(keys, 3))
        elif op < 0.93 and resets:
            pair.both("reset")
        else:
            pair.both("take_events")
            pair.both("key_state", rng.choice(keys))
            pair.both("key_block", rng.choice(keys))
        if step % check_every == 0:
            pair.check_state()
    while loading:
        pair.both("complete_load", loading.pop())
    pair.check_state()
    assert pair.new.stats == pair.ref.stats
    return pair.new.stats


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("pools", [1, 2])
def test_small_caches_match_the_reference(policy, pools):
    """Caches of 1-12 blocks and 3x as many keys: nearly every store evicts, ghosts come back, pins block eviction."""
    evictions = 0
    for seed in range(40):
        rng = random.Random(seed)
        blocks = rng.randint(1, 12)
        stats = run_trace(seed, blocks, 3 * blocks + 2, policy, pools, steps=150, check_every=1)
        evictions += stats.evictions
    assert evictions > 300, "the traces must evict, or they test little"


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_sharded_cache_matches_the_reference(policy):
    """5,000 blocks: a key table of several shards and several slot chunks, stores of hundreds of keys. No reset: it
    returns (and frees) the ready keys shard by shard, not in the order they became ready as the reference does."""
    stats = run_trace(7, 5000, 9000, policy, 1, steps=400, check_every=40, resets=False)
    assert stats.evictions > 1000 and stats.hits > 1000
