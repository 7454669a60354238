"""Throughput of the scheduler-side :class:`~triton_offload.manager.OffloadManager` on a large, full host cache. The
manager runs in the serving scheduler's critical path, once per request per step, so what matters is the cost of one
call with a request's worth of keys. Each operation is timed over ``--ops`` calls of ``--keys-per-call`` keys on a cache
of ``--blocks`` blocks that is full before timing starts; batches are drawn at random (fixed seed) and built before the
clock starts. CPU only: no GPU, torch or vLLM involved.

    python -m bench.micro.manager                      # 1M blocks, both policies
    python -m bench.micro.manager --policy arc --ops 20000 --json bench/results/manager.json
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections.abc import Callable
from pathlib import Path

from bench.common.report import print_table
from bench.common.results import machine_info, write_json
from triton_offload.manager import OffloadManager

KEY_BYTES = 32  # a sha256-sized block hash, like vLLM's
ROW_KEYS = ("policy", "op", "calls", "keys_per_call", "seconds", "calls_per_s", "keys_per_s", "us_per_call")


def make_key(i: int) -> bytes:
    return i.to_bytes(KEY_BYTES, "little")


def timed(fn: Callable[[list], object], batches: list[list]) -> float:
    """Seconds to call ``fn`` on every batch, after a GC so an earlier phase's garbage is not billed here."""
    gc.collect()
    start = time.perf_counter()
    for batch in batches:
        fn(batch)
    return time.perf_counter() - start


def bench_policy(policy: str, num_blocks: int, ops: int, per_call: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    keys = [make_key(i) for i in range(num_blocks)]
    m = OffloadManager(num_blocks, policy)
    rows = []

    def row(op: str, calls: int, keys_per_call: int, seconds: float) -> None:
        rates = (calls / seconds, calls * keys_per_call / seconds, seconds / calls * 1e6)
        rows.append(dict(zip(ROW_KEYS, (policy, op, calls, keys_per_call, seconds, *rates))))

    def store(batch: list) -> None:
        out = m.prepare_store(batch)
        assert out is not None, "benchmark cache unexpectedly full of pinned or in-flight blocks"
        m.complete_store(out.keys_to_store)

    # Fill: stores into free blocks only. Every row after this runs on a full cache.
    fill = [keys[i : i + per_call] for i in range(0, num_blocks, per_call)]
    row("fill (store, free blocks)", len(fill), per_call, timed(store, fill))
    assert m.num_free == 0 and m.num_cached == num_blocks

    def random_batches() -> list[list]:
        starts = [rng.randrange(num_blocks - per_call + 1) for _ in range(ops)]
        return [keys[s : s + per_call] for s in starts]

    hits = random_batches()
    row("lookup (all hit)", ops, per_call, timed(m.lookup, hits))
    missing = b"never stored"
    misses = [[missing] + batch[1:] for batch in random_batches()]
    row("lookup (first key misses)", ops, per_call, timed(m.lookup, misses))
    row("touch", ops, per_call, timed(m.touch, random_batches()))

    def load(batch: list) -> None:
        m.prepare_load(batch)
        m.complete_load(batch)

    row("prepare_load + complete_load", ops, per_call, timed(load, random_batches()))
    row("prepare_store (all cached)", ops, per_call, timed(m.prepare_store, random_batches()))

    # Steady state of a full cache: every new key evicts one. Timed twice: with nothing pinned, then with a
    # request's worth of keys pinned at the eviction end, which every eviction then has to walk past (as while
    # loads of the coldest blocks are in flight).
    fresh = [[make_key(num_blocks + i * per_call + j) for j in range(per_call)] for i in range(2 * ops)]
    row("store with eviction", ops, per_call, timed(store, fresh[:ops]))
    pol = m.snapshot().policy  # O(n) once, untimed; ARC evicts from T1 while |T1| > p
    eviction_end = pol["order"] if policy == "lru" else pol["t1"] if len(pol["t1"]) > pol["p"] else pol["t2"]
    pinned = list(eviction_end[:per_call])
    m.prepare_load(pinned)
    row(f"store with eviction, {len(pinned)} pinned", ops, per_call, timed(store, fresh[ops:]))
    assert all(m.lookup([key]) for key in pinned), "a pinned key was evicted"
    m.complete_load(pinned)
    assert m.stats.evictions == 2 * ops * per_call, m.stats
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=1_000_000, help="host blocks, all cached before timing")
    parser.add_argument("--ops", type=int, default=50_000, help="timed calls per operation")
    parser.add_argument("--keys-per-call", type=int, default=16, help="keys per call (a request's new blocks)")
    parser.add_argument("--policy", choices=["lru", "arc", "both"], default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the rows here as JSON")
    args = parser.parse_args()
    if args.blocks < args.keys_per_call or args.ops < 1 or args.keys_per_call < 1:
        parser.error(
            f"need blocks >= keys-per-call >= 1 and ops >= 1, got {args.blocks}, {args.keys_per_call}, {args.ops}"
        )

    machine = machine_info()
    print(f"# OffloadManager throughput: {args.blocks:,} blocks, {args.ops:,} calls x {args.keys_per_call} keys")
    print(f"# {machine['cpu']} ({machine['cores']} cores), {machine['implementation']} {machine['python']}")
    policies = ["lru", "arc"] if args.policy == "both" else [args.policy]
    rows = []
    wall = time.perf_counter()
    for policy in policies:
        rows += bench_policy(policy, args.blocks, args.ops, args.keys_per_call, args.seed)
        gc.collect()
    wall = time.perf_counter() - wall

    print_table(
        "OffloadManager throughput",
        ["policy", "operation", "calls/s", "keys/s", "us/call"],
        [[r["policy"], r["op"], f"{r['calls_per_s']:,.0f}", f"{r['keys_per_s']:,.0f}", f"{r['us_per_call']:.2f}"]
         for r in rows],
        note="keys/s counts the keys passed in; a lookup that misses on the first key examines only that one.",
    )  # fmt: skip
    print(f"# total {wall:.1f} s")

    if args.json:
        doc = {"benchmark": "manager", "mode": "cpu", "complete": True, **machine, "args": vars(args), "rows": rows}
        write_json(args.json, doc)
        print(f"# wrote {len(rows)} rows to {args.json}")


if __name__ == "__main__":
    main()
