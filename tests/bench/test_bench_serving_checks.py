"""The serving benchmark must fail when a job's bytes are wrong (the review of 2026-11-26, its mutation table): on CPU
at tiny shapes, each fault is injected into one engine and the whole run (bench/serving.py's main) must fail,
naming the job. The two faults the review found passing (a byte flipped in an early store; a byte flipped in a load
whose region is loaded again later) are also run with the per-job checks switched off, to show that the byte-exact
check of the final state alone misses them: the per-job checks (bench/serving_check.py) are what catches them."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import textwrap

import numpy as np
import pytest
import torch

from bench.common import verify, workloads
from bench.common.env import Env
from bench.serving import check, config, loop, methods
from bench.serving import cli as serving
from triton_offload.engine import LOAD, STORE, JobResult

BASE = ["--cpu-check", "--workloads", "small-page", "--shapes", "prefill-heavy", "--methods", "none", "triton"]
MODES = ["sync", "async"]


def _serve(tmp_path, argv: list[str], patch=None) -> tuple[int, dict]:
    """The serving benchmark's main in this process (``patch(serving, check, mp)`` first, where what ``mp`` patches is
    undone after this run); its exit status and JSON."""
    out = tmp_path / "serving.json"
    with pytest.MonkeyPatch.context() as mp:
        if patch is not None:
            patch(serving, check, mp)
        rc = serving.main([*BASE, *argv, "--json", str(out)])
    return rc, json.loads(out.read_text())


def _rows(data: dict, method: str) -> list[dict]:
    return [r for r in data["rows"] if r["method"] == method]


class _Wrapped:
    """An engine with a fault: everything else is the wrapped engine's."""

    def __init__(self, engine, target):
        self.engine, self.host, self.spec = engine, target.host_buffer, target.kv

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _wrap(monkeypatch, serving, fault):
    """Every triton engine the run builds gets ``fault`` (a _Wrapped subclass) around it."""
    real = serving.build_engine

    def build(point, target):
        engine = real(point, target)
        return fault(engine, target) if point.method == "triton" else engine

    monkeypatch.setattr(serving, "build_engine", build)


def _flip_gpu_block(spec, block: int) -> None:
    spec.kv_caches[0].view(torch.uint8)[block].view(-1)[5] ^= 0x5A


class _FlipStore(_Wrapped):
    """Store job 14 (step 7's) writes one wrong byte into its first host block (on CPU the copy is done when the
    submit returns)."""

    def submit_store(self, job, gpu_ids, host_ids):
        self.engine.submit_store(job, gpu_ids, host_ids)
        if job == 14:
            self.host[int(host_ids[0]), 37] ^= 0x5A


class _FlipLoad(_Wrapped):
    """Load job 5 (the arrival at step 2, into region 1, which the arrival at step 6 loads again) writes one wrong
    byte into its second GPU block."""

    def submit_load(self, job, gpu_ids, host_ids):
        self.engine.submit_load(job, gpu_ids, host_ids)
        if job == 5:
            _flip_gpu_block(self.spec, int(gpu_ids[1]))


def _off(mp, check):
    """The per-job checks see nothing: only the byte-exact check of the final state remains (the code before them)."""
    mp.setattr(check.JobChecks, "_fail", lambda self, problem: None)


@pytest.mark.parametrize("mode", MODES)
def test_a_byte_flipped_in_an_early_store_fails_the_run(tmp_path, monkeypatch, mode):
    argv = ["--load-modes", mode, "--steps", "30"]
    rc, data = _serve(tmp_path, argv, lambda serving, check, mp: (_wrap(mp, serving, _FlipStore), _off(mp, check)))
    assert rc == 0 and all(r["byte_check"] == "pass" for r in data["rows"])  # the final state alone: not caught
    rc, data = _serve(tmp_path, argv, lambda serving, check, mp: _wrap(mp, serving, _FlipStore))
    assert rc == 1, data["rows"]
    (none,), ours = _rows(data, "none"), _rows(data, "triton")
    assert none["byte_check"] == "pass" and len(ours) == 3  # triton at 4, 2 and 8 CTAs
    for r in ours:
        assert r["byte_check"] == "fail", r
        assert r["byte_check_note"].startswith("store job 14: 1 of ") and "layer 0 V page" in r["byte_check_note"]


@pytest.mark.parametrize("mode", MODES)
def test_a_byte_flipped_in_a_load_whose_region_is_loaded_again_fails_the_run(tmp_path, monkeypatch, mode):
    argv = ["--load-modes", mode]
    rc, data = _serve(tmp_path, argv, lambda serving, check, mp: (_wrap(mp, serving, _FlipLoad), _off(mp, check)))
    assert rc == 0 and all(r["byte_check"] == "pass" for r in data["rows"])  # the final state alone: not caught
    rc, data = _serve(tmp_path, argv, lambda serving, check, mp: _wrap(mp, serving, _FlipLoad))
    assert rc == 1 and _rows(data, "none")[0]["byte_check"] == "pass"
    for r in _rows(data, "triton"):
        assert r["byte_check"] == "fail" and r["byte_check_note"].startswith("load job 5: 1 of "), r


_STORE_LINE = "tl.store(host_ptr + host_off[:, None] + col[None, :], vals, mask=mask)"
_LOAD_LINE = "tl.store(anchor_ptr + gpu_off[:, None] + col[None, :], vals, mask=mask)"


def _mutated_kernel(monkeypatch, tmp_path, line: str) -> None:
    """Our copy kernel, as the interpreter runs it on CPU, with ``line`` (a store or a load's write) skipping the last
    element of every segment: the review's mutation of kernels/copy_blocks.py, in a copy of its source."""
    from triton.runtime.interpreter import InterpretedFunction

    import triton_offload.kernels.copy_blocks as copy_blocks

    source = textwrap.dedent(inspect.getsource(copy_blocks._copy_blocks_kernel))
    assert source.count(line) == 1, "the kernel's source changed: update the mutation"
    mutated = source.replace(line, line.replace("mask=mask)", "mask=mask & (col[None, :] < seg_len[:, None] - 1))"))
    path = tmp_path / "mutated_copy_blocks.py"
    path.write_text("from triton_offload.kernels.copy_blocks import *  # noqa\n"
                    "from triton_offload.kernels.copy_blocks import tl, triton  # noqa\n" + mutated)  # fmt: skip
    spec = importlib.util.spec_from_file_location("mutated_copy_blocks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    copy_blocks._interpreted_kernel()  # the interpreter's patches, as on a first launch
    monkeypatch.setattr(copy_blocks, "_interpreted", InterpretedFunction(module._copy_blocks_kernel))


@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_kernel_that_drops_the_last_element_of_each_segment_fails_the_run(tmp_path, monkeypatch, direction):
    _mutated_kernel(monkeypatch, tmp_path, _STORE_LINE if direction == "store" else _LOAD_LINE)
    rc, data = _serve(tmp_path, ["--load-modes", "sync", "--methods", "none", "triton", "vllm033"])
    assert rc == 1
    assert _rows(data, "none")[0]["byte_check"] == "pass" and _rows(data, "vllm033")[0]["byte_check"] == "pass"
    first = "store job 0: " if direction == "store" else "load job 1: "
    for r in _rows(data, "triton"):  # every block of the first job of that direction has unwritten elements
        assert r["byte_check"] == "fail" and r["byte_check_note"].startswith(first), r
        assert " of " in r["byte_check_note"] and "differ from their checksums" in r["byte_check_note"], r


class _EarlyLoad(_Wrapped):
    """A load's copy is issued only at the engine's next get_finished: sync mode, its wait returns before the copy is
    done (nothing of it is pending yet); async mode, get_finished reports it finished first, then copies."""

    def __init__(self, engine, target):
        super().__init__(engine, target)
        self.later = []

    def submit_load(self, job, gpu_ids, host_ids):
        self.later.append((job, gpu_ids, host_ids))

    def get_finished(self):
        issued, self.later = self.later, []
        for job, gpu_ids, host_ids in issued:
            self.engine.submit_load(job, gpu_ids, host_ids)
        return self.engine.get_finished()


class _EarlyReport(_Wrapped):
    """Jobs of ``direction`` are reported finished by the first get_finished after their submit, and their copies
    issued at the one after it: the engine says done before the copy is done."""

    direction = LOAD

    def __init__(self, engine, target):
        super().__init__(engine, target)
        self.submitted, self.reported = [], []

    def submit_load(self, job, gpu_ids, host_ids):
        self._submit(job, gpu_ids, host_ids, LOAD)

    def submit_store(self, job, gpu_ids, host_ids):
        self._submit(job, gpu_ids, host_ids, STORE)

    def _submit(self, job, gpu_ids, host_ids, direction):
        if direction != self.direction:
            getattr(self.engine, f"submit_{direction}")(job, gpu_ids, host_ids)
        else:
            self.submitted.append((job, gpu_ids, host_ids))

    def get_finished(self):
        for job, gpu_ids, host_ids in self.reported:  # reported last time: their copies go out now
            getattr(self.engine, f"submit_{self.direction}")(job, gpu_ids, host_ids)
        early = [JobResult(job, True, self.direction, g.size * self.spec.bytes_per_block, 0.0)
                 for job, g, _ in self.submitted]  # fmt: skip
        self.reported, self.submitted = self.submitted, []
        return [r for r in self.engine.get_finished() if r.direction != self.direction] + early

    def wait(self, job_ids):  # the engine knows nothing of the jobs it holds back
        self.engine.wait(job_ids)


class _EarlyStoreReport(_EarlyReport):
    direction = STORE


@pytest.mark.parametrize(
    "fault, mode, first",
    [
        pytest.param(_EarlyLoad, "sync", "load job 1: ", id="sync-wait-returns-before-the-copy"),
        pytest.param(_EarlyReport, "async", "load job 1: ", id="async-reported-before-the-copy"),
        pytest.param(_EarlyStoreReport, "sync", "store job 0: ", id="store-reported-before-the-copy"),
    ],
)
def test_an_engine_that_says_done_before_its_copy_is_done_fails_the_run(tmp_path, monkeypatch, fault, mode, first):
    """The latency of such an engine would look too small and its final bytes can still be right (the copy lands
    later): each job's bytes are checked right after its wait or its report, before anything else can complete it."""
    rc, data = _serve(tmp_path, ["--load-modes", mode], lambda serving, check, mp: _wrap(mp, serving, fault))
    assert rc == 1 and _rows(data, "none")[0]["byte_check"] == "pass"
    for r in _rows(data, "triton"):
        assert r["byte_check"] == "fail" and r["byte_check_note"].startswith(first), r


def test_every_job_passes_with_the_checks_in_a_worker_thread(monkeypatch):
    """On a GPU machine a store's host blocks are summed in a worker thread: the same run there, on CPU, checks the
    same jobs, and a wrong byte in a store still fails it (the thread's check is awaited before the store's host
    blocks are stored to again, and at the end)."""
    env = Env(torch.device("cpu"), None, "cpu")
    shape = config.CPU_SHAPES["decode-heavy"]
    setup = loop.setup_workload(workloads.WORKLOADS["llama3-8b"].tiny(), "kv_first", shape, env, 5)
    try:
        engine = methods.build_engine(methods.MethodPoint("triton", 4), setup.target)
        for mode in MODES:
            run = loop.run_loop(setup, engine, load_mode=mode, threaded_checks=True)
            assert run.check_problem is None and loop.byte_check(setup, run) is None
            assert run.jobs_checked == len(run.loads) + shape.warmup + shape.steps
        none = loop.run_loop(setup, None, threaded_checks=True)
        assert none.check_problem is None and none.jobs_checked == 0
        real = engine.submit_store

        def flip(job, gpu_ids, host_ids):
            real(job, gpu_ids, host_ids)
            if job == 4:
                setup.host[int(host_ids[-1]), 9] ^= 0x5A

        monkeypatch.setattr(engine, "submit_store", flip)
        run = loop.run_loop(setup, engine, threaded_checks=True)
        assert run.check_problem.startswith("store job 4: 1 of "), run.check_problem
        engine.shutdown()
    finally:
        setup.close()


class _Slow(_Wrapped):
    """Correct copies, but get_finished reports a job only once it was waited for: loads longer than the steps
    between two arrivals into one region, stores still running when their host blocks come round again."""

    def __init__(self, engine, target):
        super().__init__(engine, target)
        self.waited, self.held = set(), []

    def get_finished(self):
        self.held += self.engine.get_finished()
        out = [r for r in self.held if r.job_id in self.waited]
        self.held = [r for r in self.held if r.job_id not in self.waited]
        return out

    def wait(self, job_ids):
        self.engine.wait(job_ids)
        self.waited.update(job_ids)


@pytest.mark.parametrize("mode", MODES)
def test_jobs_still_running_when_their_blocks_come_round_again_are_waited_for_between_steps(mode):
    """Outside the steps, before a store writes host blocks whose last store is unreported, or an async load a
    region whose last load is: waited for, checked, counted; every job is still checked once, and the run passes."""
    env = Env(torch.device("cpu"), None, "cpu")
    shape = dataclasses.replace(config.CPU_SHAPES["prefill-heavy"], steps=14)
    setup = loop.setup_workload(workloads.WORKLOADS["small-page"].tiny(), "block_first", shape, env, 2)
    try:
        target = setup.target
        engine = _Slow(methods.build_engine(methods.MethodPoint("triton", 4), target), target)
        run = loop.run_loop(setup, engine, load_mode=mode)
        assert run.check_problem is None and loop.byte_check(setup, run) is None
        assert run.jobs_checked == len(run.loads) + shape.warmup + shape.steps
        assert run.store_slot_waits > 0
        if mode == "async":  # the third arrival's region still has the first's load: waited for, then reused
            assert run.load_region_waits > 0
            reported = [ld for ld in run.loads.values() if ld.latency_s is not None]
            assert reported and all(ld.steps == 2 * shape.load_every + 1 for ld in reported), reported
        else:
            assert run.load_region_waits == 0
        engine.shutdown()
    finally:
        setup.close()


def test_the_device_sums_are_the_packed_blocks_sums():
    """What a store's host blocks must sum to is computed from the GPU blocks in place (each layer's K and V halves,
    gathered): the same sums as the packed bytes the reference builds, in both K/V layouts."""
    import triton_offload as to

    w = workloads.WORKLOADS["llama3-70b-tp8"].tiny()
    for layout in ("block_first", "kv_first"):
        spec = to.KVCacheSpec(workloads.make_caches(w, layout, 9, "cpu", seed=4), layout)
        checks = check.JobChecks(spec, None, torch.empty(0), 0, threaded=False, offloaded=True)
        ids = np.array([7, 0, 3], dtype=np.int64)
        packed = verify.reference_blocks(spec, ids, torch.device("cpu"))
        assert torch.equal(checks.gpu_sums(ids), check.row_sums(packed, checks.pages))
        # One flipped byte changes exactly its block's page sum.
        spec.kv_caches[1].view(torch.uint8).view(-1)[0] ^= 1
        changed = (checks.gpu_sums(ids) != check.row_sums(packed, checks.pages)).nonzero().tolist()
        assert len(changed) == 1 and changed[0][1] in (2, 3)  # layer 1's K or V page
