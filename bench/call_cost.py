#!/usr/bin/env python3
"""Where the host time of one transfer call goes, at 1024 blocks x 80 layers (Llama-3-70B TP8 pages, kv_first):
the whole public ``gather_blocks`` call, each of its steps alone, and ``TransferEngine.submit_store`` /
``submit_load`` (the vLLM plugin's path).

    python bench/call_cost.py            # on a GPU
    python bench/call_cost.py --tiny     # any machine: the same code at a tiny shape (CPU: the interpreter)

Calls are issued in bursts of 8 after a synchronize (the GPU keeps the queue short, as in the benchmark's CPU-cost
extra); each step is timed alone the same way. Medians over 200 calls; on CPU the numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np
import torch

import triton_offload as to
from triton_offload.engine import TransferEngine
from triton_offload.host_cache import HostCache
from triton_offload.kernels.copy_blocks import CopyLauncher

# isort: split
# Sibling modules: bench/ is on sys.path when this runs as a script (it is not a package).
from timing import stats_us
from workloads import WORKLOADS, make_caches

BURST = 8


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, calls: int, drain=None) -> dict:
    """:func:`timing.stats_us` of ``fn()``'s host time, called in bursts of BURST; ``drain()`` (default: a device
    synchronize) runs before each burst and at the end, outside the timing."""
    drain = drain or (lambda: _sync(device))
    ts = []
    for i in range(calls):
        if i % BURST == 0:
            drain()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    drain()
    return stats_us(ts)


def measure(tiny: bool, calls: int) -> dict[str, dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    w = WORKLOADS["llama3-70b-tp8"]
    n, num_blocks, host_blocks = (8, 20, 12) if tiny else (1024, 2100, 1100)
    if tiny:
        w = dataclasses.replace(w.tiny(), num_layers=4)
    spec = to.KVCacheSpec(make_caches(w, "kv_first", num_blocks, device), "kv_first")
    cache = HostCache(spec.host_block_bytes(1), num_blocks=host_blocks, pin=device.type == "cuda")
    host = cache.buffer
    rng = np.random.default_rng(0)
    g = rng.permutation(num_blocks)[:n].astype(np.int64)
    h = rng.permutation(host_blocks)[:n].astype(np.int64)
    kw = dict(store=True, blocks_per_host_block=1, skip=0)
    plan = to.plan_transfer(spec, host, g, h, **kw)
    dev_ids = torch.from_numpy(plan.ids).to(device)
    launcher = CopyLauncher(spec, host, 1, True)
    to.gather_blocks(spec, g, host, h)  # compiles
    _sync(device)
    pin = (lambda t: t.pin_memory()) if device.type == "cuda" else (lambda t: t.clone())
    out = {
        "gather_blocks (whole call)": timed(lambda: to.gather_blocks(spec, g, host, h), device, calls),
        "plan_transfer (validation, packing)": timed(lambda: to.plan_transfer(spec, host, g, h, **kw), device, calls),
        "ids: from_numpy + pin_memory": timed(lambda: pin(torch.from_numpy(plan.ids)), device, calls),
        "ids: pin + upload": timed(
            lambda: pin(torch.from_numpy(plan.ids)).to(device, non_blocking=True), device, calls
        ),
        "CopyLauncher(...)": timed(lambda: CopyLauncher(spec, host, 1, True), device, calls),
        "launch (kernel only)": timed(lambda: launcher.launch(plan, dev_ids), device, calls),
    }
    eng = TransferEngine(spec, host)
    job, queued = [0], []

    def drain() -> None:  # waits for the burst's jobs outside the timing, as the synchronize does above
        if queued:
            eng.wait(queued)
            assert all(r.ok for r in eng.get_finished())
            queued.clear()

    for name, submit in (("engine.submit_store", eng.submit_store), ("engine.submit_load", eng.submit_load)):

        def one(submit=submit):
            job[0] += 1
            submit(job[0], g, h)
            queued.append(job[0])

        one()  # compiles this direction
        out[name] = timed(one, device, calls, drain)
    eng.shutdown()
    cache.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (any machine; CPU runs the interpreter)")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (interpreter: not a measurement)"
    shape = "tiny" if args.tiny else "1024 blocks x 80 layers"
    print(f"host time per call, {shape}, {where}")
    for name, s in measure(args.tiny, args.calls).items():
        print(f"{name:<38} median {s['median_us']:8.1f} us  p20 {s['p20_us']:8.1f}  p80 {s['p80_us']:8.1f}  "
              f"min {s['min_us']:8.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
