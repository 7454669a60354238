"""The serving step loop and its byte checks: one method's run over one workload's caches, host cache and model
(:func:`run_loop`, whose docstring lists a step's parts as vLLM 0.33's worker runs them; :func:`byte_check`). Step time
is the worker's wall time for all of a step. Every job's bytes are checked while the loop runs (:mod:`serving_check`),
with the clock stopped: each load's right after its wait (sync) or after the step whose poll reported it (async), each
store's when it is reported finished. Without CUDA the same loop runs synchronously through the interpreter, and its
times mean nothing.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

import triton_offload as to
from bench.common.case import OffloadTarget
from bench.common.env import Env
from bench.common.verify import SENTINEL, reference_blocks, where_in_block
from bench.common.workloads import Workload, make_caches
from bench.serving.blocks import Blocks
from bench.serving.check import CHECK_CHUNK, JobChecks, pages_per_block, row_sums
from bench.serving.config import SYNC, LoopShape, RingSizes, ring_sizes
from bench.serving.model import StepModel
from triton_offload.engine import LOAD, STORE
from triton_offload.host.cache import HostCache

__all__ = ["Setup", "setup_workload", "StepRecord", "LoadRecord", "LoopRun", "RunClock", "run_loop", "byte_check",
           "compare_blocks", "host_rows_of"]  # fmt: skip


@dataclass
class Setup:
    """One workload's buffers in one loop shape, shared by every method's runs.

    Attributes:
        workload, layout, shape, sizes: what runs.
        target: the KV caches, host cache and machine every method moves blocks between.
        model: the step's compute.
        compute: the model's stream (None on CPU).
        prefix_sums: (prefix blocks,) byte sums of the cached prefixes' host blocks, to catch a write into them.
        prefix_pages: (every cached prefix block, pages) page checksums of the cached prefixes' host blocks, in host-id
            order from ``sizes.host_ring``, on the device: what each load must put on the GPU.
        prefix_dev: (every cached prefix block, bytes_per_block) the cached prefixes' bytes kept on the device, in the
            same order: the byte-exact check compares the load regions with them there.
        seed: the seed of the block plan and the step inputs.
        store_rows: ``(GPU ids) -> (n, host row bytes)`` on the device, the host rows a store of those blocks must
            write, where they are not the blocks' own bytes (the FP8 host format: :mod:`bench.serving.fp8`).
    """

    workload: Workload
    layout: str
    shape: LoopShape
    sizes: RingSizes
    target: OffloadTarget
    model: StepModel
    compute: torch.cuda.Stream | None
    prefix_sums: torch.Tensor
    prefix_pages: torch.Tensor
    prefix_dev: torch.Tensor
    seed: int
    store_rows: Callable[[np.ndarray], torch.Tensor] | None = None

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
    pages = pages_per_block(spec.bytes_per_block, spec.num_layers)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    prefix_dev = torch.empty(prefixes.shape, dtype=torch.uint8, device=device)
    for rows, made in zip(torch.split(prefixes, CHECK_CHUNK), torch.split(prefix_dev, CHECK_CHUNK)):
        # Random on the device (fast), kept there, down to pageable memory, then a host memcpy: a CUDA copy into the
        # cache could span two of its registered chunks, which the driver rejects.
        made.random_(0, 256, generator=gen)
        rows.copy_(made.cpu())
    model = StepModel(w, spec, shape.tokens, seed, kv_read_tokens=shape.decode * shape.context)
    compute = torch.cuda.Stream(device) if device.type == "cuda" else None
    target = OffloadTarget(spec, cache, env)
    return Setup(w, layout, shape, sizes, target, model, compute, _block_sums(prefixes), row_sums(prefix_dev, pages),
                 prefix_dev, seed)  # fmt: skip


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


def host_rows_of(setup: Setup, engine):
    """``(host ids) -> (n, bytes_per_block)`` uint8 rows where ``engine``'s host blocks live: the engine's own
    ``host_rows`` (vLLM's region for ``vllm_native``), else the host cache."""
    rows = getattr(engine, "host_rows", None)
    if rows is not None:
        return rows
    return lambda ids: setup.host.index_select(0, torch.from_numpy(np.asarray(ids, dtype=np.int64)))


class RunClock:
    """Wall time of a run without its pauses (the checks between and inside steps): ``now()`` stands still while
    paused, so a step's time, and a load's latency across steps, leave the checks out."""

    def __init__(self):
        self._paused_s = 0.0
        self._since: float | None = None

    def now(self) -> float:
        t = time.perf_counter() if self._since is None else self._since
        return t - self._paused_s

    @contextlib.contextmanager
    def paused(self):
        """Stops the clock for the block (nested pauses count once)."""
        if self._since is not None:
            yield
            return
        self._since = time.perf_counter()
        try:
            yield
        finally:
            self._paused_s += time.perf_counter() - self._since
            self._since = None

    @property
    def paused_s(self) -> float:
        return self._paused_s


@dataclass
class StepRecord:
    """What one step cost the worker; times in seconds, None where the step had no such thing.

    ``load_step``: the step had a load to wait for or in flight (sync: it waited for one; async: one was submitted in
    it or still running when it began); without offload, the arrival steps (the steps the other runs load in)."""

    step_s: float = 0.0
    compute_events: tuple | None = None
    store_submit_s: float | None = None
    store_bytes: int = 0
    load_job: int | None = None
    load_submit_s: float | None = None
    load_bytes: int = 0
    load_step: bool = False
    poll_s: float = 0.0
    store_waits: int = 0


@dataclass
class LoadRecord:
    """One prefix load. ``latency_s``: from the start of its submit to the return of the wait for it (sync), or to
    the end of the poll that reported it (async: the request joins the next step); None when the run ended first.
    ``wait_s``: sync: the wait after the submit returned. ``steps``: async: steps from its submit to its report, both
    included. ``measured``: submitted in a measured step."""

    job: int
    step: int
    submit_s: float
    nbytes: int
    measured: bool
    t_submit: float = 0.0
    latency_s: float | None = None
    wait_s: float | None = None
    steps: int | None = None
    region: int = 0
    gpu_ids: np.ndarray | None = None
    host_ids: np.ndarray | None = None


@dataclass
class LoopRun:
    """One method's run: the measured steps, its loads, each job's device seconds, the block plan, the checks.

    Attributes:
        records: the measured steps.
        loads: every load of the run, by job id.
        device_s: each finished job's direction and device seconds (the engine's events), by job id.
        job_bytes: each submitted job's bytes, by job id.
        blocks: the block plan (for the byte-exact check at the end).
        offloaded: the run had an engine.
        load_mode: ``async`` or ``sync``.
        jobs_checked: jobs whose bytes were checked while the run went on.
        check_problem: the first job whose bytes were wrong, or None.
        pause_s: seconds the clock stood still for checks in and after the measured steps.
        load_region_waits: async arrivals whose GPU region still had a load in flight (waited for outside the steps).
        store_slot_waits: steps whose store's host blocks still had an earlier store unreported or unchecked (waited
            for outside the steps).
    """

    records: list[StepRecord]
    loads: dict[int, LoadRecord]
    device_s: dict[int, tuple[str, float]]
    job_bytes: dict[int, int]
    blocks: Blocks
    offloaded: bool
    load_mode: str = SYNC
    impl: str | None = None
    compute_ms: list[float] = field(default_factory=list)
    paths: collections.Counter = field(default_factory=collections.Counter)  # (direction, path) -> jobs
    jobs_checked: int = 0
    check_problem: str | None = None
    pause_s: float = 0.0
    load_region_waits: int = 0
    store_slot_waits: int = 0


def run_loop(
    setup: Setup, engine, *, load_mode: str = SYNC, defer_stores: bool = False, threaded_checks: bool | None = None
) -> LoopRun:
    """Runs ``warmup + steps`` steps with ``engine`` (None: no offload traffic); records the measured steps and
    checks every job's bytes (``threaded_checks``: host blocks summed in a worker thread; default: on CUDA).

    The engine is drained (every job waited for and reported) but not shut down: it may run again. Job ids: the store
    of step s is 2s, the load of the arrival at step s is 2s + 1.

    A step, on the worker thread, as vLLM 0.33's worker runs it with the offloading connector (the vLLM functions are
    named in docs/benchmarks.md, "The loop"):

    1. (every ``load_every`` steps, from the first) a request arrives whose prefix the host cache holds. ``sync``
       loads: its load is submitted (after any deferred store) and the worker waits for it before the forward pass;
       ``async`` loads (vLLM's default): it is submitted after the forward pass is queued, the other requests keep
       running, and the request joins the batch after the step whose ``get_finished`` reported its load;
    2. the step's blocks are allocated; a block whose previous store is still running is waited for first (vLLM
       flushes such jobs before reusing a block);
    3. the forward pass is queued on the compute stream (:class:`serving_model.StepModel`), writing the step's KV;
    4. the blocks the step completed are stored: submitted now, after the compute is queued, so the store waits for
       it on the GPU (with ``defer_stores``, in the next step's transfer start instead, as vLLM 0.33's connector
       defers them: before that step's forward pass if it has a sync load, else after it is queued);
    5. the worker waits for the step's output (the compute stream), then polls the engine for finished jobs.

    Step time is the worker's wall time for all of it.
    """
    shape = setup.shape
    _reset(setup)
    begin = getattr(engine, "begin_run", None)
    if begin is not None:
        begin(setup.sizes.host_ring)
    offloaded = engine is not None
    blocks = Blocks(shape, setup.sizes, setup.workload.block_size, setup.seed)
    host_rows = host_rows_of(setup, engine)
    checks = JobChecks(setup.spec, host_rows, setup.prefix_pages, setup.sizes.host_ring,
                       setup.cuda if threaded_checks is None else threaded_checks, offloaded,
                       store_rows=setup.store_rows)  # fmt: skip
    run = LoopRun([], {}, {}, {}, blocks, offloaded, load_mode)
    clock = RunClock()
    unfinished: set[int] = set()
    in_flight: dict[int, LoadRecord] = {}  # async loads submitted, not yet reported
    region_load: dict[int, int] = {}  # region -> its async load not yet reported
    deferred = None  # (job, gpu ids, host ids) of a store submitted at the next step's transfer start
    bpb = setup.spec.bytes_per_block

    def poll(step: int, rec: StepRecord | None = None) -> list:
        """get_finished, booked: device seconds and paths; a failed job raises; async loads get their latency."""
        t0 = time.perf_counter()
        results = engine.get_finished()
        if rec is not None:
            rec.poll_s = time.perf_counter() - t0
        now = clock.now()
        for r in results:
            if not r.ok:
                # vLLM asserts that a job succeeded; going on would hand the model garbage KV.
                raise RuntimeError(f"{r.direction} job {r.job_id} failed: {r.error}")
            if r.check is not None and r.check.failed.size:  # with the integrity checks: the loop's blocks are intact
                raise RuntimeError(f"load job {r.job_id}: the integrity check flagged intact blocks at positions "
                                   f"{r.check.failed.tolist()}")  # fmt: skip
            unfinished.discard(r.job_id)
            run.paths[r.direction, r.path] += 1
            run.device_s[r.job_id] = (r.direction, r.seconds)
            load = in_flight.pop(r.job_id, None)
            if load is not None and step >= 0:  # async: the request can join the next step
                load.latency_s, load.steps = now - load.t_submit, step - load.step + 1
        return results

    def book(results) -> None:
        """After a step (clock stopped): stores reported finished get their host blocks checked, async loads their
        GPU blocks."""
        for r in results:
            if r.direction == STORE:
                checks.store_done(r.job_id)
            elif r.direction == LOAD and r.job_id in run.loads and load_mode != SYNC:
                load = run.loads[r.job_id]
                region_load.pop(load.region, None)
                checks.check_load(r.job_id, load.gpu_ids, load.host_ids)

    def submit_store(rec: StepRecord, job: int, gpu_ids: np.ndarray, host_ids: np.ndarray) -> None:
        t0 = time.perf_counter()
        engine.submit_store(job, gpu_ids, host_ids)
        rec.store_submit_s = time.perf_counter() - t0
        rec.store_bytes = run.job_bytes[job] = gpu_ids.size * bpb
        unfinished.add(job)

    def submit_load(rec: StepRecord, s: int) -> LoadRecord:
        gpu_ids, host_ids, region, _ = blocks.next_load()
        job = 2 * s + 1
        t_submit = clock.now()
        t0 = time.perf_counter()
        engine.submit_load(job, gpu_ids, host_ids)
        submit_s = time.perf_counter() - t0
        load = LoadRecord(job, s, submit_s, gpu_ids.size * bpb, s >= shape.warmup, t_submit, region=region,
                          gpu_ids=gpu_ids, host_ids=host_ids)  # fmt: skip
        run.loads[job], run.job_bytes[job] = load, load.nbytes
        rec.load_job, rec.load_submit_s, rec.load_bytes = job, submit_s, load.nbytes
        unfinished.add(job)
        return load

    def transfer_start(rec: StepRecord, s: int, arrival: bool) -> None:
        """vLLM's start_kv_transfers: the deferred store first, then the arrival's load."""
        nonlocal deferred
        if deferred is not None:
            submit_store(rec, *deferred)
            deferred = None
        if not arrival:
            return
        if offloaded:
            load = submit_load(rec, s)
            if load_mode != SYNC:
                in_flight[load.job], region_load[load.region] = load, load.job
                return
            engine.wait([load.job])  # the forward pass needs this request's prefix
            load.latency_s = clock.now() - load.t_submit
            load.wait_s = load.latency_s - load.submit_s
            with clock.paused():  # right after the wait, before anything else can complete the copy
                checks.check_load(load.job, load.gpu_ids, load.host_ids)
        elif load_mode == SYNC:  # the same check, on a region nothing loads into
            gpu_ids = blocks.next_load(record=False)[0]
            with clock.paused():
                checks.check_load(2 * s + 1, gpu_ids, None)

    warm_pause_s = 0.0
    for s in range(shape.warmup + shape.steps):
        if s == shape.warmup:
            warm_pause_s = clock.paused_s
        arrival = s % shape.load_every == 0
        sync_load = arrival and load_mode == SYNC
        # Between steps: what this step may not overwrite yet. A store into host blocks whose last store is not
        # reported, or an async load into a region whose last load is not: waited for here, outside the step (the
        # clock runs, so loads in flight count the time), then checked (the clock stopped).
        with setup.stream():
            late = checks.unreported_into(blocks.next_host_ids()) if offloaded else []
            run.store_slot_waits += bool(late)
            if offloaded and arrival and load_mode != SYNC and blocks.next_load_region() in region_load:
                late.append(region_load[blocks.next_load_region()])
                run.load_region_waits += 1
            if late:
                engine.wait(late)
                results = poll(s)
                with clock.paused():
                    book(results)
            with clock.paused():
                if checks.before_store_into(blocks.next_host_ids()):
                    run.store_slot_waits += 1
        rec = StepRecord(load_step=arrival or bool(in_flight))
        t_step = clock.now()
        with setup.stream():
            if sync_load:
                transfer_start(rec, s, arrival)
            step = blocks.next_step(store_job=2 * s)
            late = step.must_finish & unfinished
            if offloaded and late:
                engine.wait(late)
                rec.store_waits = len(late)
            rows = setup.model.slot_rows(step.token_blocks, step.token_slots)
            if setup.cuda:
                rec.compute_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                rec.compute_events[0].record(setup.compute)
            setup.model.step(rows)
            if setup.cuda:
                rec.compute_events[1].record(setup.compute)
            if not sync_load:  # vLLM starts a step's transfers after its forward pass is queued when none is sync
                transfer_start(rec, s, arrival)
            if offloaded:
                if defer_stores:
                    deferred = (2 * s, step.store_gpu, step.store_host)
                else:
                    submit_store(rec, 2 * s, step.store_gpu, step.store_host)
            if setup.cuda:
                rec.compute_events[1].synchronize()  # the step's output goes back to the scheduler
        results = poll(s, rec) if offloaded else []
        rec.step_s = clock.now() - t_step
        with clock.paused(), setup.stream():  # after the step: its checks
            checks.expect_store(2 * s, step.store_gpu, step.store_host)
            book(results)
            if not offloaded and arrival and load_mode != SYNC:  # the async check, on a region nothing loads into
                checks.check_load(2 * s + 1, blocks.next_load(record=False)[0], None)
        if s >= shape.warmup:
            run.records.append(rec)
    if offloaded:
        with setup.stream():
            if deferred is not None:  # the last step's stores, so the host ring ends complete
                submit_store(StepRecord(), *deferred)
        engine.wait(set(unfinished))
        book(poll(-1))  # every result not yet reported; loads reported now get no latency (the run had ended)
    checks.finish()
    setup.sync()
    run.impl = getattr(engine, "impl", None)
    run.jobs_checked, run.check_problem = checks.jobs_checked, checks.problem
    run.pause_s = clock.paused_s - warm_pause_s
    if setup.cuda:
        run.compute_ms = [a.elapsed_time(b) for a, b in (r.compute_events for r in run.records)]
    for r in run.records:
        r.compute_events = None
    return run


def compare_blocks(setup: Setup, host_ids: np.ndarray, gpu_ids: np.ndarray, what: str, host_rows=None) -> str | None:
    """None when host block ``host_ids[i]`` holds exactly GPU block ``gpu_ids[i]``'s packed bytes (all layers) for
    every i, else where the first difference is. Compared on the device, in chunks. ``host_rows``: where the host
    blocks live (:func:`host_rows_of`; default: the host cache); for host blocks of the cached prefixes, whose bytes
    never change, ``"prefixes"``: their copy on the device."""
    spec, device = setup.spec, setup.spec.device
    host_rows = host_rows or host_rows_of(setup, None)
    bad = 0
    first = None
    for start in range(0, host_ids.size, CHECK_CHUNK):
        h, g = host_ids[start : start + CHECK_CHUNK], gpu_ids[start : start + CHECK_CHUNK]
        stored = host_rows != "prefixes" and setup.store_rows is not None  # host rows in the FP8 format
        want = setup.store_rows(g) if stored else reference_blocks(spec, g, device)
        if host_rows == "prefixes":
            got = setup.prefix_dev[torch.from_numpy(h - setup.sizes.host_ring).to(device)]
        else:
            got = host_rows(h).to(device)
        diff = (got != want).any(dim=1)
        if diff.any():
            bad += int(diff.sum())
            if first is None:
                i = int(diff.nonzero()[0])
                off = int((got[i] != want[i]).nonzero()[0])
                first = f"host block {int(h[i])} vs GPU block {int(g[i])}, {where_in_block(spec.segments, off)}"
    return None if not bad else f"{what}: {bad} of {host_ids.size} blocks differ; first: {first}"


def byte_check(setup: Setup, run: LoopRun, host_rows=None) -> str | None:
    """None when every byte is where it must be after ``run``, byte for byte, else what is wrong:

    * every store-ring host block stored to holds the GPU block it was last stored from, as the steps left it (a
      store that read the block before the compute wrote it holds an older KV); the others still hold the sentinel;
    * each load region holds the prefix it last loaded (compared with the prefixes' copy on the device); a region
      never loaded holds the sentinel;
    * the cached prefixes are unchanged in the method's host blocks.

    ``host_rows``: where the run's host blocks live (:func:`host_rows_of`; default: the host cache). The per-job
    checks (:mod:`serving_check`) saw every job; this sees the final state exactly, words within a page included.
    """
    setup.sync()
    host_rows = host_rows or host_rows_of(setup, None)
    host_ids, gpu_ids, never = run.blocks.expected_stores()
    if not run.offloaded:
        host_ids, gpu_ids, never = host_ids[:0], gpu_ids[:0], np.concatenate([host_ids, never])
    problem = compare_blocks(setup, host_ids, gpu_ids, "stored host blocks", host_rows)
    if problem:
        return problem
    if never.size and bool((host_rows(never) != SENTINEL).any()):
        return f"a store-ring host block that no store addressed changed ({never.size} such blocks)"
    loaded, unloaded = run.blocks.expected_loads()
    for gpu, host in loaded:
        problem = compare_blocks(setup, host, gpu, "loaded GPU blocks", "prefixes")
        if problem:
            return problem
    if unloaded.size and not bool((reference_blocks(setup.spec, unloaded, setup.spec.device) == SENTINEL).all()):
        return f"a load region that no load addressed changed ({unloaded.size} blocks)"
    prefixes = np.arange(setup.sizes.host_ring, setup.sizes.host_blocks, dtype=np.int64)
    if not torch.equal(_block_sums(host_rows(prefixes)), setup.prefix_sums):
        return "a cached prefix's host block changed"
    return None
