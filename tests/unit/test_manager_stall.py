"""No manager call pays for the size of the cache (issue 61). A Python dict rebuilds itself, copying every entry, when
its entry array runs out; in one dict of n keys that is an O(n) pause inside whichever call hits it (3.3 s at 10^7
blocks). Here every dict reachable from the manager (key tables and their shards, ARC's ghost table, the tables of
stores and loads in flight) is watched across a churn of 1.5 n stores past a full 10^5-block cache, and a rebuild is
seen as a change of its allocation (``sys.getsizeof``): the entries copied by the rebuilds of one call must stay within
a few shards' worth, where the manager before issue 61 (tests/unit/reference_manager.py) copies its whole table in
one call. Counting copied entries rather than timing calls keeps the test deterministic on a loaded machine; the
times are in bench/micro/manager.py's results. Building a manager is O(1): it allocates no structure per block."""

from __future__ import annotations

import sys
import tracemalloc

import pytest

from tests.unit.reference_manager import ReferenceManager
from triton_offload.manager import OffloadManager, RequestUse
from triton_offload.policies.slots import SHARD_BITS

N = 100_000
SHARD_WORTH = 8 * 2**SHARD_BITS  # eight full shards (a call of 64 keys may hit a few shards that rebuild together)


def _dicts(obj, out: list, seen: set) -> None:
    """Every dict reachable from ``obj`` through attributes and lists of tables, not looking inside the dicts (their
    keys and values are block keys and ints) nor inside lists of keys."""
    if id(obj) in seen or isinstance(obj, (bytes, str, int, float, memoryview, type)) or obj is None:
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        out.append(obj)
    elif isinstance(obj, list):
        if obj and not isinstance(obj[0], (bytes, str, int)):  # a list of tables, not a list of keys or ids
            for item in obj:
                _dicts(item, out, seen)
    elif not callable(obj):
        attrs = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
        attrs += [getattr(obj, name, None) for name in getattr(type(obj), "__slots__", ())]
        for value in attrs:
            _dicts(value, out, seen)


class RebuildWatch:
    """Entries copied by dict rebuilds since the last :meth:`copied` (a dict whose allocation changed, or new)."""

    def __init__(self, manager) -> None:
        self.manager, self.sizes = manager, {}
        self.copied()

    def copied(self) -> int:
        found: list[dict] = []
        _dicts(self.manager, found, set())
        total = 0
        for table in found:
            size = sys.getsizeof(table)
            if self.sizes.get(id(table), size) != size:
                total += len(table)
            self.sizes[id(table)] = size
        return total


def churn(manager, policy_keys: int = 64) -> tuple[int, int]:
    """Fills the cache, then stores 1.5 N more keys (a third of them keys evicted earlier: ARC's ghosts come back)
    with loads of cached keys between; returns the most entries one call copied and how many tables were watched."""
    watch, worst, fresh = RebuildWatch(manager), 0, 0
    request = RequestUse()
    for step in range((N + 3 * N // 2) // policy_keys):
        old = fresh - N - 1000 - (step % 7) * 64  # a run of keys evicted a little earlier
        keys = [b"%031d" % i for i in range(fresh, fresh + 48)]
        keys += [b"%031d" % i for i in range(old, old + 16)] if old > 0 else []
        fresh += 48
        out = manager.prepare_store(keys, request)
        worst = max(worst, watch.copied())
        manager.complete_store(out.keys_to_store)
        worst = max(worst, watch.copied())
        hot = [b"%031d" % i for i in range(max(0, fresh - N // 2), max(0, fresh - N // 2) + 8)]
        hits = manager.lookup(hot)
        manager.prepare_load(hot[:hits], request)
        manager.complete_load(hot[:hits])
        worst = max(worst, watch.copied())
        if step % 64 == 0:
            manager.finish_request(request)
            request = RequestUse()
    return worst, len(watch.sizes)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_no_call_rebuilds_more_than_a_few_shards(policy):
    manager = OffloadManager(N, policy)
    worst, tables = churn(manager)
    assert manager.stats.evictions > N, "the churn must go well past the tables' first sizes"
    assert tables > N >> SHARD_BITS, "the key table must be sharded"
    print(f"{policy}: at most {worst} entries copied in one call, {tables} tables")
    assert worst <= SHARD_WORTH, f"one call copied {worst} entries in table rebuilds (bound {SHARD_WORTH})"


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_the_old_manager_rebuilt_its_whole_table_in_one_call(policy):
    """The same watch on the manager before issue 61: the test above would fail on it."""
    worst, _ = churn(ReferenceManager(N, policy))
    assert worst >= N // 2 > SHARD_WORTH


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_building_a_manager_allocates_nothing_per_block(policy):
    """10^7 blocks cost well under a byte of Python heap each to set up (the old manager built a 10^7-entry free
    list), and the arrays indexed by block id are untouched zero pages until used."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        manager = OffloadManager(10_000_000, policy, pools=2, pool_of=lambda key: key[0] % 2)
        built = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert built < 2_000_000, f"{built} bytes for an empty manager"
    assert manager.num_free == 20_000_000 and len(manager) == 0


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_retired_manager_comes_apart_in_small_tables(policy):
    """reset_cache drops the old manager's tables one per later call (TritonOffloadingManager): none of them holds more
    than a few shards' worth, and with them gone the rest of the manager holds no table."""
    manager = OffloadManager(N, policy)
    churn_keys = [b"%031d" % i for i in range(N + N // 2)]
    for i in range(0, len(churn_keys), 4096):
        manager.complete_store(manager.prepare_store(churn_keys[i : i + 4096]).keys_to_store)
    parts = manager.retire()
    assert len(parts) < N // 250  # ready and ghost shards, block and ghost key chunks, arrays
    assert max(len(part) for part in parts if not isinstance(part, memoryview)) <= 2 * 2**SHARD_BITS
    assert sum(len(part) for part in parts if isinstance(part, dict)) >= N
    found: list[dict] = []
    _dicts(manager, found, set())
    assert sum(map(len, found)) == 0
