"""The scheduler-side manager against vLLM's, through vLLM's ``OffloadingManager`` API in one process: ours
(:class:`~triton_offload.connector.manager.TritonOffloadingManager`) and the installed vLLM's ``CPUOffloadingManager``
with the same policy, side by side at each cache size. Three parts per size and policy: *steps*, the serving workload of
:mod:`bench.micro.manager_workload` on a full cache (which side goes first alternates every step; per call and per step
mean, p99 and max, and the step ratio ours / vLLM as the median over 10 segments of their sums); *stall*, a churn of
``--churn`` x n fresh keys stored 256 per call past a full cache, each call timed (the longest single call is where a
table rebuilding itself, or a heap compaction, shows), with a probe of the platform's own memory stalls between calls
(the longest call is also given over the calls the probe saw quiet); *memory*, the Python heap (tracemalloc) per host
block after filling and after churning n more keys, keys aside (both sides hold the same key objects), plus the arrays
ours maps (at full size, an upper bound, and the pages touched), and the time to build an empty manager and to reset a
full one (ours drops the old tables one per later store call: the longest drop too). The garbage collector is off while
calls are timed (after ``gc.freeze``), as the engine's critical path would want, and a call's time is its thread's CPU
time (``--clock wall`` for wall time), so that a shared machine's descheduling is not billed to whichever side it hits;
vLLM's ``touch`` is never called by its scheduler, so the step sums leave it out (it is still timed). Run it once per
vLLM: the vLLM it compares with is the one importable.

    python -m bench.micro.manager --sizes 10000 100000 1000000 --json bench/results/manager-<date>-vllm0.32.json
    .venv-vllm33/bin/python -m bench.micro.manager --sizes 10000 100000 --parts steps
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import mmap
import random
import statistics
import time
import tracemalloc

import vllm
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from bench.common.report import print_table
from bench.common.results import machine_info, write_json
from bench.micro.manager_workload import OPS, Engine, fill, new_keys
from triton_offload.connector.manager import TritonOffloadingManager

SIDES = ("ours", "vllm")
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
STEP_OPS = [op for op in OPS if op != "touch"]  # what vLLM's scheduler calls


def make(side: str, n: int, policy: str):
    return TritonOffloadingManager(n, policy) if side == "ours" else CPUOffloadingManager(n, cache_policy=policy)


def summary(ns: list[int]) -> dict:
    """Mean, p99 and max of nanosecond times, in microseconds."""
    if not ns:
        return {"calls": 0}
    ordered = sorted(ns)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"calls": len(ns), "mean_us": statistics.fmean(ns) / 1e3, "p99_us": p99 / 1e3, "max_us": ordered[-1] / 1e3}


class _GCOff:
    """The garbage collector off, with what exists now frozen (not scanned by a later collection)."""

    def __enter__(self):
        gc.collect()
        gc.freeze()
        gc.disable()

    def __exit__(self, *exc):
        gc.enable()
        gc.unfreeze()


def steps(n: int, policy: str, count: int, warmup: int, seed: int, clock) -> dict:
    """The serving workload on a full cache of ``n`` blocks: per call and per step statistics of each side."""
    ours, theirs = make("ours", n, policy), make("vllm", n, policy)
    keys = new_keys(0, n, tag=9)
    fill(ours, keys)
    fill(theirs, keys)
    del keys
    engine = Engine(ours, theirs, seed=seed, clock=clock)
    for _ in range(warmup):
        engine.step()
    calls = {side: {op: [] for op in OPS} for side in SIDES}
    step_ns = {side: [] for side in SIDES}
    with _GCOff():
        for _ in range(count):
            out = engine.step()
            for side, times in zip(SIDES, out):
                for op, pairs in times.items():
                    calls[side][op] += pairs
                step_ns[side].append(sum(ns for op in STEP_OPS for ns, _ in times[op]))
    segment = max(1, count // 10)
    ratios = [
        sum(step_ns["ours"][i : i + segment]) / sum(step_ns["vllm"][i : i + segment])
        for i in range(0, count - segment + 1, segment)
    ]
    row = {"part": "steps", "blocks": n, "policy": policy, "steps": count, "step_ratio": statistics.median(ratios)}
    for side in SIDES:
        row[f"{side}_step"] = summary(step_ns[side])
        for op in OPS:
            pairs = calls[side][op]
            keys = sum(k for _, k in pairs)
            row[f"{side}_{op}"] = {
                **summary([ns for ns, _ in pairs]),
                "keys": keys,
                "us_per_key": sum(ns for ns, _ in pairs) / keys / 1e3 if keys else None,
            }
    return row


class _Probe:
    """The platform's own pauses, seen without any manager: 256 random reads of a buffer of its own (256 MiB, every
    page touched, so as far from the caches as the managers' tables), timed between the churn's calls. When the
    process is slowed as a whole (memory access stalled for every structure alike) the probe slows too: a call whose
    probes before and after both ran within 3x the probe's median is *quiet*, the others are counted apart."""

    def __init__(self, clock, size: int = 256 << 20) -> None:
        self.buf, self.clock, self.times = bytearray(size), clock, []
        for offset in range(0, size, 4096):
            self.buf[offset] = 1
        rng = random.Random(7)
        self.offsets = [rng.randrange(size) for _ in range(4096)]

    def __call__(self) -> None:
        j, buf = (len(self.times) * 256) % 3840, self.buf
        t0 = self.clock()
        for offset in self.offsets[j : j + 256]:
            buf[offset]
        self.times.append(self.clock() - t0)

    def quiet(self) -> list[bool]:
        """Per call between two probes: whether both stayed within 3x the median."""
        limit = 3 * statistics.median(self.times)
        return [a <= limit and b <= limit for a, b in zip(self.times, self.times[1:])]


def stall(n: int, policy: str, churn: float, clock, batch: int = 256, sides: tuple = SIDES) -> dict:
    """Fresh keys stored ``batch`` per call, ``churn`` x n of them past a full cache, every call of each side timed,
    with a :class:`_Probe` between calls."""
    managers = [make(side, n, policy) for side in sides]
    for m in managers:
        fill(m, new_keys(0, n, tag=8))
    times = {side: {"prepare_store": [], "complete_store": [], "on_request_finished": []} for side in sides}
    probe = _Probe(clock)
    with _GCOff():
        probe()
        for i, start in enumerate(range(n, n + int(churn * n), batch)):
            keys = new_keys(start, batch, tag=8)
            for s in range(len(sides)) if i % 2 == 0 else reversed(range(len(sides))):
                # A request per call, finished after it, as the scheduler's are: one request storing all 1.5 n keys
                # would grow its per-request state (ours remembers what a request stored) to millions of keys.
                m, rc, out = managers[s], ReqContext(req_id=f"s{i}"), times[sides[s]]
                t0 = clock()
                res = m.prepare_store(keys, rc)
                t1 = clock()
                m.complete_store(set(res.keys_to_store), rc)
                t2 = clock()
                m.on_request_finished(rc)
                t3 = clock()
                out["prepare_store"].append(t1 - t0)
                out["complete_store"].append(t2 - t1)
                out["on_request_finished"].append(t3 - t2)
            probe()
    quiet = probe.quiet()
    row = {"part": "stall", "blocks": n, "policy": policy, "stored": int(churn * n), "batch": batch}
    row["probe"] = {**summary(probe.times), "calls_not_quiet": quiet.count(False)}
    for side in sides:
        for op, ns in times[side].items():
            row[f"{side}_{op}"] = summary(ns)
        calls = [max(pair) for pair in zip(*times[side].values())]
        row[f"{side}_max_call_ms"] = max(calls) / 1e6
        row[f"{side}_max_quiet_call_ms"] = max(ns for ns, ok in zip(calls, quiet) if ok) / 1e6
        row[f"{side}_calls_over_5ms"] = sum(ns > 5e6 for ns in calls)
        row[f"{side}_quiet_calls_over_5ms"] = sum(ns > 5e6 for ns, ok in zip(calls, quiet) if ok)
    return row


def _resident_bytes(view: memoryview) -> int:
    """The bytes of an array's mapping that are in memory (touched), by mincore(2)."""
    page = mmap.PAGESIZE
    holder = ctypes.c_char.from_buffer(view.obj)
    try:
        pages = -(-view.nbytes // page)
        vec = (ctypes.c_ubyte * pages)()
        if _LIBC.mincore(ctypes.c_void_p(ctypes.addressof(holder)), ctypes.c_size_t(view.nbytes), vec):
            return view.nbytes
        return page * sum(b & 1 for b in vec)
    finally:
        del holder


def _mapped_bytes(manager) -> tuple[int, int]:
    """The bytes of the arrays our manager maps: at full size (zero pages until touched, so an upper bound) and those
    touched (in memory)."""
    inner = manager._manager
    holders = [inner._table, *inner._policies]
    full = touched = 0
    seen = set()  # an array held twice (the free slots chained through a policy's links) counts once
    for obj in holders:
        for value in vars(obj).values():
            for view in value if isinstance(value, list) else [value]:
                if isinstance(view, memoryview) and id(view) not in seen:
                    seen.add(id(view))
                    full += view.nbytes
                    touched += _resident_bytes(view)
    return full, touched


def memory(n: int, policy: str, clock=time.thread_time_ns) -> dict:
    """Heap per block after filling and after churning n more keys (tracemalloc; the keys made before it starts);
    construction and reset times, on ``clock`` as the calls are."""
    row = {"part": "memory", "blocks": n, "policy": policy}
    keys = new_keys(0, 2 * n, tag=7)
    for side in SIDES:
        gc.collect()
        objects = len(gc.get_objects())
        t0 = clock()
        m = make(side, n, policy)
        row[f"{side}_build_ms"] = (clock() - t0) / 1e6
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        fill(m, keys[:n], batch=256)
        row[f"{side}_filled_B_per_block"] = (tracemalloc.get_traced_memory()[0] - base) / n
        fill(m, keys[n:], batch=256)
        row[f"{side}_steady_B_per_block"] = (tracemalloc.get_traced_memory()[0] - base) / n
        tracemalloc.stop()
        if side == "ours":
            full, touched = _mapped_bytes(m)
            row["ours_mapped_B_per_block"], row["ours_touched_B_per_block"] = full / n, touched / n
        row[f"{side}_gc_objects_per_block"] = (len(gc.get_objects()) - objects) / n  # what every full GC walks
        t0 = clock()
        m.reset_cache()
        row[f"{side}_reset_full_ms"] = (clock() - t0) / 1e6
        if side == "ours":  # the old tables, dropped one per later store call: the longest drop
            worst = 0
            while m._retired:
                t0 = clock()
                m._retired.pop()
                worst = max(worst, clock() - t0)
            row["ours_reset_drop_max_ms"] = worst / 1e6
        del m
    return row


def _print(rows: list[dict]) -> None:
    table = []
    for r in rows:
        if r["part"] == "steps":
            o, v = r["ours_step"], r["vllm_step"]
            table.append([r["policy"], f"{r['blocks']:,}", "step", f"{o['mean_us']:.0f} / {v['mean_us']:.0f}",
                          f"{o['p99_us']:.0f} / {v['p99_us']:.0f}", f"{o['max_us']:.0f} / {v['max_us']:.0f}",
                          f"{r['step_ratio']:.2f}"])  # fmt: skip
        elif r["part"] == "stall":
            got = [side for side in SIDES if f"{side}_max_call_ms" in r]
            table.append([r["policy"], f"{r['blocks']:,}", "store 256 (churn; max: all, quiet)",
                          " / ".join(f"{r[f'{side}_prepare_store']['mean_us']:.0f}" for side in got),
                          " / ".join(f"{r[f'{side}_prepare_store']['p99_us']:.0f}" for side in got),
                          " / ".join(f"{r[f'{side}_max_call_ms'] * 1e3:.0f}, {r[f'{side}_max_quiet_call_ms'] * 1e3:.0f}"
                                     for side in got), ""])  # fmt: skip
        else:
            ours = r["ours_steady_B_per_block"] + r["ours_touched_B_per_block"]
            top = r["ours_steady_B_per_block"] + r["ours_mapped_B_per_block"]
            table.append([r["policy"], f"{r['blocks']:,}", "B/block filled, steady (all mapped)",
                          f"{r['ours_filled_B_per_block'] + r['ours_touched_B_per_block']:.0f} / "
                          f"{r['vllm_filled_B_per_block']:.0f}",
                          f"{ours:.0f} ({top:.0f}) / {r['vllm_steady_B_per_block']:.0f}",
                          f"build {r['ours_build_ms']:.1f} / {r['vllm_build_ms']:.1f} ms", ""])  # fmt: skip
    print_table(
        f"ours / vLLM {vllm.__version__} (us unless said)",
        ["policy", "blocks", "what", "mean", "p99", "max", "ratio"],
        table,
        note="step ratio: median over 10 segments of sum(ours) / sum(vLLM); memory: keys aside, ours with its arrays'"
        " pages in use (and all they map)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000], help="host blocks")
    parser.add_argument("--policies", nargs="+", choices=["lru", "arc"], default=["lru", "arc"])
    parser.add_argument(
        "--parts", nargs="+", choices=["steps", "stall", "memory"], default=["steps", "stall", "memory"]
    )
    parser.add_argument("--steps", type=int, default=1500, help="timed engine steps")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--stall-sides", nargs="+", choices=SIDES, default=list(SIDES), help="stall part: whose")
    parser.add_argument("--churn", type=float, default=1.5, help="stall part: keys stored past a full cache, x n")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu", help="the thread's CPU time, or wall time")
    parser.add_argument("--json", help="write the rows here (rewritten after every row)")
    args = parser.parse_args()
    doc = {"benchmark": "manager", "mode": "cpu", "complete": False, **machine_info(), "vllm": vllm.__version__}
    doc.update(args=vars(args), rows=[])
    clock = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns
    wall = time.perf_counter()
    for n in args.sizes:
        for policy in args.policies:
            for part in args.parts:
                t0 = time.perf_counter()
                if part == "steps":
                    row = steps(n, policy, args.steps, args.warmup, args.seed, clock)
                else:
                    row = (
                        stall(n, policy, args.churn, clock, sides=tuple(args.stall_sides))
                        if part == "stall"
                        else memory(n, policy, clock)
                    )
                row["seconds"] = time.perf_counter() - t0
                doc["rows"].append(row)
                print(f"# {part} {policy} {n:,}: {row['seconds']:.0f} s", flush=True)
                if args.json:
                    write_json(args.json, doc)
    _print(doc["rows"])
    print(f"# total {time.perf_counter() - wall:.0f} s")
    if args.json:
        doc["complete"] = True
        write_json(args.json, doc)


if __name__ == "__main__":
    main()
