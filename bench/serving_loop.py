"""The serving step loop and its byte check: one method's run over one workload's caches, host cache and model.

A step, on the worker thread, as vLLM's worker runs it with the offloading connector:

1. (every ``load_every`` steps, from the first) a request arrives whose prefix the host cache holds: its load is
   submitted, and the worker waits for it before the forward pass (vLLM 0.33 submits such a load ``expedited`` and
   calls ``wait`` on it before the step; a synchronous connector does the same);
2. the step's blocks are allocated; a block whose previous store is still running is waited for first (vLLM flushes
   such jobs before reusing a block);
3. the forward pass is queued on the compute stream (:class:`serving_model.StepModel`), writing the step's KV;
4. the blocks the step completed are stored: submitted now, after the compute is queued, so the store waits for it
   on the GPU (with ``defer_stores``, at the start of the next step instead, as vLLM 0.33's connector defers them);
5. the worker waits for the step's output (the compute stream), then polls the engine for finished jobs.

Step time is the worker's wall time for all of it. Without CUDA the same loop runs synchronously through the
interpreter, and its times mean nothing.
"""

from __future__ import annotations

import collections
import contextlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch

import triton_offload as to
from triton_offload.host_cache import HostCache

# isort: split
# Sibling modules: bench/ is on sys.path when this runs as a script (it is not a package).
from case import Env
from serving_blocks import Blocks
from serving_config import LoopShape, RingSizes, ring_sizes
from serving_methods import OffloadTarget
from serving_model import StepModel
from verify import SENTINEL, reference_blocks, where_in_block
from workloads import Workload, make_caches

__all__ = ["Setup", "setup_workload", "StepRecord", "LoopRun", "run_loop", "byte_check", "compare_blocks"]

# Blocks compared per chunk in the byte check (bounds the device memory it takes).
CHECK_CHUNK = 128


@dataclass
class Setup:
    """One workload's buffers, shared by every method's run.

    Attributes:
        workload, layout, shape, sizes: what runs.
        target: the KV caches, host cache and machine every method moves blocks between.
        model: the step's compute.
        compute: the model's stream (None on CPU).
        prefix_sums: (prefix blocks,) byte sums of the cached prefixes' host blocks, to catch a write into them.
        seed: the seed of the block plan and the step inputs.
    """

    workload: Workload
    layout: str
    shape: LoopShape
    sizes: RingSizes
    target: OffloadTarget
    model: StepModel
    compute: torch.cuda.Stream | None
    prefix_sums: torch.Tensor
    seed: int

    @property
    def spec(self) -> to.KVCacheSpec:
        return self.target.kv

    @property
    def host(self) -> torch.Tensor:
        return self.target.host_buffer

    @property
    def cuda(self) -> bool:
        return self.compute is not None

    def stream(self):
        """The context every step's work is queued in: the compute stream (a no-op on CPU)."""
        return torch.cuda.stream(self.compute) if self.cuda else contextlib.nullcontext()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.spec.device)

    def close(self) -> None:
        self.sync()
        self.target.host_cache.close()


def _block_sums(rows: torch.Tensor) -> torch.Tensor:
    return rows.sum(dim=1, dtype=torch.int64)


def setup_workload(w: Workload, layout: str, shape: LoopShape, env: Env, seed: int) -> Setup:
    """Allocates the caches (random bytes), the host cache (pinned on CUDA, the cached prefixes random), the model."""
    shape.check(w.block_size)
    sizes = ring_sizes(shape, w.block_size)
    device = env.device
    spec = to.KVCacheSpec(make_caches(w, layout, sizes.gpu_blocks, device, seed), layout)
    cache = HostCache(spec.host_block_bytes(1), num_blocks=sizes.host_blocks, pin=device.type == "cuda")
    prefixes = cache.buffer[sizes.host_ring :]
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    for rows in torch.split(prefixes, CHECK_CHUNK):
        # Random on the device (fast), down to pageable memory, then a host memcpy: a CUDA copy into the cache
        # could span two of its registered chunks, which the driver rejects.
        rows.copy_(torch.empty(rows.shape, dtype=torch.uint8, device=device).random_(0, 256, generator=gen).cpu())
    model = StepModel(w, spec, shape.tokens, seed)
    compute = torch.cuda.Stream(device) if device.type == "cuda" else None
    target = OffloadTarget(spec, cache, env)
    return Setup(w, layout, shape, sizes, target, model, compute, _block_sums(prefixes), seed)


def _reset(setup: Setup) -> None:
    """A fresh start for a method's run: every GPU block, the store ring and the load regions hold the sentinel, and
    the step inputs restart from the seed. Every method computes the same KV into the same blocks, so without the
    reset a method that stored nothing would find the previous method's bytes on the host, and a store that read its
    blocks before the compute wrote them would find the previous method's identical KV there."""
    setup.sync()
    setup.host[: setup.sizes.host_ring].fill_(SENTINEL)
    for t in setup.spec.kv_caches:
        t.view(torch.uint8).fill_(SENTINEL)
    setup.model.reset(setup.seed)
    setup.sync()


@dataclass
class StepRecord:
    """What one measured step cost the worker; times in seconds, None where the step had no such thing."""

    step_s: float = 0.0
    compute_events: tuple | None = None
    store_submit_s: float | None = None
    store_bytes: int = 0
    load_job: int | None = None
    load_submit_s: float | None = None
    load_latency_s: float | None = None
    load_wait_s: float | None = None
    load_bytes: int = 0
    poll_s: float = 0.0
    store_waits: int = 0


@dataclass
class LoopRun:
    """One method's run: the measured steps, each load job's device seconds, and the block plan for the check."""

    records: list[StepRecord]
    load_device_s: dict[int, float]
    blocks: Blocks
    offloaded: bool
    impl: str | None = None
    compute_ms: list[float] = field(default_factory=list)
    paths: collections.Counter = field(default_factory=collections.Counter)  # (direction, path) -> jobs


def _finished(results, unfinished: set[int], load_device_s: dict[int, float], paths: collections.Counter) -> None:
    """Books an engine's reported results (from ``get_finished`` or ``shutdown``); a failed job raises."""
    for r in results:
        if not r.ok:
            # vLLM asserts that a job succeeded; going on would hand the model garbage KV.
            raise RuntimeError(f"{r.direction} job {r.job_id} failed: {r.error}")
        unfinished.discard(r.job_id)
        paths[r.direction, r.path] += 1
        if r.direction == "load":
            load_device_s[r.job_id] = r.seconds


def run_loop(setup: Setup, engine, defer_stores: bool = False) -> LoopRun:
    """Runs ``warmup + steps`` steps with ``engine`` (None: no offload traffic); records the measured steps.

    Job ids: the store of step s is 2s, the load before step s is 2s + 1.
    """
    shape, model = setup.shape, setup.model
    _reset(setup)
    blocks = Blocks(shape, setup.sizes, setup.workload.block_size, setup.seed)
    records: list[StepRecord] = []
    unfinished: set[int] = set()
    load_device_s: dict[int, float] = {}
    paths: collections.Counter = collections.Counter()
    deferred = None  # (job, gpu ids, host ids) of a store submitted at the next step's start

    def submit_store(rec: StepRecord, job: int, gpu_ids: np.ndarray, host_ids: np.ndarray) -> None:
        t0 = time.perf_counter()
        engine.submit_store(job, gpu_ids, host_ids)
        rec.store_submit_s = time.perf_counter() - t0
        rec.store_bytes = gpu_ids.size * setup.spec.bytes_per_block
        unfinished.add(job)

    for s in range(shape.warmup + shape.steps):
        rec = StepRecord()
        t_step = time.perf_counter()
        with setup.stream():
            if deferred is not None:
                submit_store(rec, *deferred)
                deferred = None
            if engine is not None and s % shape.load_every == 0:
                gpu_ids, host_ids = blocks.next_load()
                job = 2 * s + 1
                t0 = time.perf_counter()
                engine.submit_load(job, gpu_ids, host_ids)
                t1 = time.perf_counter()
                engine.wait([job])  # the forward pass needs this request's prefix
                t2 = time.perf_counter()
                rec.load_job, rec.load_submit_s, rec.load_latency_s, rec.load_wait_s = job, t1 - t0, t2 - t0, t2 - t1
                rec.load_bytes = gpu_ids.size * setup.spec.bytes_per_block
            step = blocks.next_step(store_job=2 * s)
            late = step.must_finish & unfinished
            if engine is not None and late:
                engine.wait(late)
                rec.store_waits = len(late)
            rows = model.slot_rows(step.token_blocks, step.token_slots)
            if setup.cuda:
                rec.compute_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                rec.compute_events[0].record(setup.compute)
            model.step(rows)
            if setup.cuda:
                rec.compute_events[1].record(setup.compute)
            if engine is not None:
                if defer_stores:
                    deferred = (2 * s, step.store_gpu, step.store_host)
                else:
                    submit_store(rec, 2 * s, step.store_gpu, step.store_host)
            if setup.cuda:
                rec.compute_events[1].synchronize()  # the step's output goes back to the scheduler
        if engine is not None:
            t0 = time.perf_counter()
            _finished(engine.get_finished(), unfinished, load_device_s, paths)
            rec.poll_s = time.perf_counter() - t0
        rec.step_s = time.perf_counter() - t_step
        if s >= shape.warmup:
            records.append(rec)
    if engine is not None:
        with setup.stream():
            if deferred is not None:  # the last step's stores, so the host ring ends complete
                submit_store(StepRecord(), *deferred)
        _finished(engine.shutdown(), unfinished, load_device_s, paths)  # every result not yet reported
    setup.sync()
    run = LoopRun(records, load_device_s, blocks, engine is not None, getattr(engine, "impl", None), paths=paths)
    if setup.cuda:
        run.compute_ms = [a.elapsed_time(b) for a, b in (r.compute_events for r in records)]
    for r in records:
        r.compute_events = None
    return run


def compare_blocks(setup: Setup, host_ids: np.ndarray, gpu_ids: np.ndarray, what: str) -> str | None:
    """None when host block ``host_ids[i]`` holds exactly GPU block ``gpu_ids[i]``'s packed bytes (all layers) for
    every i, else where the first difference is. Compared on the device, in chunks."""
    spec, device = setup.spec, setup.spec.device
    bad = 0
    first = None
    for start in range(0, host_ids.size, CHECK_CHUNK):
        h, g = host_ids[start : start + CHECK_CHUNK], gpu_ids[start : start + CHECK_CHUNK]
        want = reference_blocks(spec, g, device)
        got = setup.host[torch.from_numpy(h)].to(device)
        diff = (got != want).any(dim=1)
        if diff.any():
            bad += int(diff.sum())
            if first is None:
                i = int(diff.nonzero()[0])
                off = int((got[i] != want[i]).nonzero()[0])
                first = f"host block {int(h[i])} vs GPU block {int(g[i])}, {where_in_block(spec.segments, off)}"
    return None if not bad else f"{what}: {bad} of {host_ids.size} blocks differ; first: {first}"


def byte_check(setup: Setup, run: LoopRun) -> str | None:
    """None when every byte is where it must be after ``run``, else what is wrong:

    * every store-ring host block stored to holds the GPU block it was last stored from, as the steps left it (a
      store that read the block before the compute wrote it holds an older KV); the others still hold the sentinel;
    * each load region holds the prefix it last loaded, byte for byte; a region never loaded holds the sentinel;
    * the cached prefixes are unchanged.
    """
    setup.sync()
    host_ids, gpu_ids, never = run.blocks.expected_stores()
    if not run.offloaded:
        host_ids, gpu_ids, never = host_ids[:0], gpu_ids[:0], np.concatenate([host_ids, never])
    problem = compare_blocks(setup, host_ids, gpu_ids, "stored host blocks")
    if problem:
        return problem
    if never.size and bool((setup.host[torch.from_numpy(never)] != SENTINEL).any()):
        return f"a store-ring host block that no store addressed changed ({never.size} such blocks)"
    loaded, unloaded = run.blocks.expected_loads()
    for gpu, host in loaded:
        problem = compare_blocks(setup, host, gpu, "loaded GPU blocks")
        if problem:
            return problem
    if unloaded.size and not bool((reference_blocks(setup.spec, unloaded, setup.spec.device) == SENTINEL).all()):
        return f"a load region that no load addressed changed ({unloaded.size} blocks)"
    if not torch.equal(_block_sums(setup.host[setup.sizes.host_ring :]), setup.prefix_sums):
        return "a cached prefix's host block changed"
    return None
