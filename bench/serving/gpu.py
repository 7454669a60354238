"""The serving benchmark's two GPU-only measurements beside the loop: the contiguous pinned copy a load is compared
with, and the duplex figure (a store and a load of the same size in flight at once)."""

from __future__ import annotations

import itertools
import time

import torch

from bench.common.timing import gbps, quantiles
from bench.serving.blocks import Blocks
from bench.serving.config import GATE_US
from bench.serving.loop import Setup, compare_blocks
from bench.serving.methods import MethodPoint, build_engine
from triton_offload.calibrate import sleep_cycles_per_us

__all__ = ["contiguous_load", "duplex"]


def contiguous_load(setup: Setup, nbytes: int, repeats: int) -> dict:
    """One contiguous pinned ``copy_`` host -> GPU of ``nbytes``, alone on an idle GPU: the host time from the call
    to its completion (what a load's latency is compared with) and its device time. Medians over ``repeats``."""
    device = setup.spec.device
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    host_s, device_ms = [], []
    for i in range(repeats + 1):  # the first is a warm-up
        torch.cuda.synchronize(device)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            e0.record(stream)
            dst.copy_(src, non_blocking=True)
            e1.record(stream)
        e1.synchronize()
        t1 = time.perf_counter()
        if i:
            host_s.append(t1 - t0)
            device_ms.append(e0.elapsed_time(e1))
    latency_ms = quantiles(host_s)[0] * 1e3
    dev_ms = quantiles(device_ms)[0]
    return {"bytes": nbytes, "latency_ms": round(latency_ms, 4), "device_ms": round(dev_ms, 4),
            "gbps": round(gbps(nbytes, dev_ms), 2)}  # fmt: skip


def duplex_row(setup, point, problem: str | None, contiguous_gbps: float | None = None) -> dict:
    """A duplex row with every figure None (what a failed point reports; a measured one fills them in)."""
    return {
        "workload": setup.workload.name,
        "method": point.method,
        "num_ctas": point.num_ctas,
        "bytes_each": None,
        "byte_check": "fail" if problem else "pass",
        "byte_check_note": problem,
        "samples": 0,
        "contiguous_gbps": contiguous_gbps,
        **dict.fromkeys(("store_alone_gbps", "load_alone_gbps", "duplex_gbps", "ratio", "ratio_vs_contiguous")),
    }


def duplex(setup: Setup, point: MethodPoint, repeats: int, contiguous_gbps: float | None = None) -> dict:
    """A store and a load of one prefix's blocks each, alone and both at once, with ``point``'s engine.

    Each sample queues its transfers behind a GPU sleep on the compute stream, so those of a duplex sample start
    together; each transfer's time is the engine's own (events around its copies). Aggregate GB/s = both transfers'
    bytes / the longer of the two; ``ratio`` = aggregate / the faster direction alone; ``ratio_vs_contiguous`` =
    aggregate / ``contiguous_gbps`` (one contiguous pinned copy, one way: two directions each as fast as the link
    allows score ~2, two slow ones cannot). The last sample's bytes are checked.
    """
    device = setup.spec.device
    blocks = Blocks(setup.shape, setup.sizes, setup.workload.block_size, setup.seed)
    n = min(setup.sizes.prefix_blocks, setup.sizes.host_ring)
    store_g, store_h = blocks.ring[:n], blocks.host_ring[:n]
    load_g, load_h = blocks.load_gpu[0], blocks.prefix_host[0]
    nbytes = n * setup.spec.bytes_per_block
    sleep = int(GATE_US * sleep_cycles_per_us(setup.compute))
    engine = build_engine(point, setup.target)
    ids = itertools.count(1)

    def sample(store: bool, load: bool) -> tuple[float | None, float | None]:
        s_job, l_job = next(ids), next(ids)
        with torch.cuda.stream(setup.compute):
            torch.cuda._sleep(sleep)
            if store:
                engine.submit_store(s_job, store_g, store_h)
            if load:
                engine.submit_load(l_job, load_g, load_h)
        engine.wait([s_job, l_job])
        done = {}
        for r in engine.get_finished():
            if not r.ok:
                raise RuntimeError(f"duplex {r.direction} job failed: {r.error}")
            done[r.job_id] = r.seconds * 1e3
        return done.get(s_job), done.get(l_job)

    try:
        sample(True, True)  # warm-up: compiles, grows the engine's pools
        store_ms = quantiles([sample(True, False)[0] for _ in range(repeats)])[0]
        load_ms = quantiles([sample(False, True)[1] for _ in range(repeats)])[0]
        both_ms = quantiles([max(sample(True, True)) for _ in range(repeats)])[0]
    finally:
        engine.shutdown()
    torch.cuda.synchronize(device)
    problem = compare_blocks(setup, store_h, store_g, "duplex store") or compare_blocks(
        setup, load_h, load_g, "duplex load"
    )
    row = duplex_row(setup, point, problem, contiguous_gbps) | {"bytes_each": nbytes, "samples": repeats}
    if problem is None:  # wrong bytes are reported, never timed
        alone = (gbps(nbytes, store_ms), gbps(nbytes, load_ms))
        both = gbps(2 * nbytes, both_ms)
        row.update(store_alone_gbps=round(alone[0], 2), load_alone_gbps=round(alone[1], 2),
                   duplex_gbps=round(both, 2), ratio=round(both / max(alone), 3))  # fmt: skip
        if contiguous_gbps:
            row["ratio_vs_contiguous"] = round(both / contiguous_gbps, 3)
    return row
