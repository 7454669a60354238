"""The serving step-loop benchmark (``python -m bench.serving``). On CPU: every method runs the loop at tiny shapes and
moves the right bytes, nothing is timed, and wrong bytes fail the run; the block plan, the byte check and the method
registry on their own. On a GPU (`gpu` marker): a short run whose numbers are all present and sane.

The end-to-end runs are subprocesses; the unit tests import the bench modules."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from bench_faults import short_uncoalesced_copies
from vllm_harness import VLLM_033

from bench.baselines import ours
from bench.common import workloads
from bench.common.case import OffloadTarget
from bench.common.env import Env
from bench.serving import blocks as blocks_mod
from bench.serving import cli as serving
from bench.serving import config, loop, methods, report
from bench.serving import model as serving_model
from triton_offload.engine import TransferEngine

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVING = ("-m", "bench.serving")
REQUIRED = ("workload", "method", "num_ctas", "byte_check", "step_ms_median", "step_ms_p99", "slowdown_vs_none",
            "load_latency_ms_median", "load_latency_ms_p99", "submit_cpu_us_per_step", "offload_gbps")  # fmt: skip
OFFLOAD = ("triton", "triton_size_aware", "auto", "vllm033", "memcpy_batch")


def _run(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _rows_by_label(rows: list[dict]) -> dict[tuple, dict]:
    return {(r["workload"], r["method"], r["num_ctas"]): r for r in rows}


def test_cpu_run_checks_every_method_and_times_nothing(tmp_path):
    out = tmp_path / "serving.json"
    proc = _run([*SERVING, "--cpu-check", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "NOTHING IS TIMED" in proc.stdout and "nothing was timed" in proc.stdout
    assert "FAIL" not in proc.stdout, proc.stdout  # an n/a method is not a failure, and every other one passes
    data = json.loads(out.read_text())
    assert data["benchmark"] == "serving" and data["mode"] == "cpu-interpreter-check" and data["complete"]
    assert data["load_modes"] == ["async", "sync"] and set(data["load_mode_sources"]) == {"async", "sync"}
    rows = data["rows"]
    keys, timing = report.ROW_KEYS, report.TIMING_KEYS
    assert all(tuple(r) == keys for r in rows) and set(REQUIRED) <= set(keys)
    # The timed fields this test knows of are among those the report leaves empty on CPU.
    assert set(REQUIRED) - {"workload", "method", "num_ctas", "byte_check"} <= set(timing)
    # Every workload with a model in both shapes and both load modes, every method, triton at 4, 2 and 8 CTAs.
    labels = {(r["workload"], r["shape"], r["load_mode"], r["method"], r["num_ctas"]) for r in rows}
    for w in ("llama3-8b", "llama3-70b-tp8", "small-page"):
        for shape in ("prefill-heavy", "decode-heavy"):
            for mode in ("async", "sync"):
                want = [("none", None), ("triton", 4), ("triton", 2), ("triton", 8), ("triton_size_aware", None),
                        ("auto", None), ("vllm033", None), ("vllm_native", None), ("memcpy_batch", None)]  # fmt: skip
                assert {(w, shape, mode, m, c) for m, c in want} <= labels
    assert len(rows) == 3 * 2 * 2 * 9
    for r in rows:
        if r["method"] == "vllm_native" and r["byte_check"] == "n/a":  # vLLM 0.33's code is not importable here
            assert "vllm_native runs vLLM 0.33.0's own worker" in r["impl"] and r["loads"] is None, r
            continue
        assert r["byte_check"] == "pass" and r["byte_check_note"] is None, r
        assert all(r[k] is None for k in timing), f"a number was reported without a GPU: {r}"
        assert r["rounds"] == (2 if r["method"] == "none" else 1), r  # one round, none before and after it
        if r["method"] in OFFLOAD:
            assert r["loads"] == 3 and r["stored_bytes_per_step"] > 0 and r["load_bytes"] > 0, r
            # Every job of the run (warm-up included) was checked as it completed: 8 stores and 4 loads.
            assert r["jobs_checked"] == 12 and r["load_region_waits"] == 0 and r["store_slot_waits"] == 0, r
        else:
            assert r["impl"].startswith("no offload") and r["jobs_checked"] == 0
    # Without CUDA to calibrate on, auto runs the engine's copy-engine path (the memmove stand-in); the kernel is
    # the triton rows' path.
    assert all("memmove; path dma: load dma x4, store dma x" in r["impl"] for r in rows if r["method"] == "auto")
    assert all("path kernel: load kernel x4, store kernel x" in r["impl"] for r in rows
               if r["method"] in ("triton", "triton_size_aware"))  # fmt: skip
    # vllm033's loads took its SM copy (the interpreter), its stores the batch call (the memmove stand-in).
    assert all("SM copy load" in r["impl"] and "store" in r["impl"] for r in rows if r["method"] == "vllm033")
    assert data["duplex"] == [] and data["targets"] == [] and data["failures"] == []
    assert all(d["drift_vs_none"] is None for d in data["drift"].values())  # nothing timed: no drift
    if not VLLM_033:  # the n/a rows are said apart, not counted as runs (nor as passing ones)
        assert "96 of 96 runs byte-checked pass (12 n/a: cannot run here, not counted)" in proc.stdout


def test_wrong_bytes_fail_the_run(tmp_path, monkeypatch, capsys):
    out = tmp_path / "broken.json"
    store = TransferEngine.submit_store

    def short_store(self, job_id, gpu_ids, host_ids, **kw):  # drops the last block of every store
        store(self, job_id, gpu_ids[:-1], host_ids[:-1], **kw)

    monkeypatch.setattr(TransferEngine, "submit_store", short_store)
    short_uncoalesced_copies(monkeypatch, 8, "load")  # the last copy of every baseline's load stops 8 bytes short
    argv = ["--cpu-check", "--workloads", "small-page", "--shapes", "prefill-heavy", "--load-modes", "sync"]
    assert serving.main([*argv, "--json", str(out)]) == 1
    data = json.loads(out.read_text())
    by = {r["method"]: r for r in data["rows"]}
    assert by["none"]["byte_check"] == "pass"
    ours = [r for r in data["rows"] if r["method"] in ("triton", "triton_size_aware", "auto")]  # all TransferEngine
    assert len(ours) == 5 and all(r["byte_check"] == "fail" for r in ours)
    # The first store is short: its check, when it completed, found its last host block unwritten.
    assert all(r["byte_check_note"].startswith("store job 0: 1 of ") for r in ours), ours
    for method in ("vllm033", "memcpy_batch"):  # the first load is 8 bytes short
        assert by[method]["byte_check"] == "fail" and by[method]["byte_check_note"].startswith("load job 1: 1 of ")
    assert len(data["failures"]) == 7
    assert "FAIL" in capsys.readouterr().out


def test_a_setting_that_cannot_run_is_refused_before_anything_runs(tmp_path):
    proc = _run([*SERVING, "--cpu-check", "--prefill", "7", "--json", str(tmp_path / "x.json")])
    assert proc.returncode == 1 and "prefill = 7 must be a multiple of the block size 2 (0: none)" in proc.stderr
    assert not (tmp_path / "x.json").exists()
    proc = _run([*SERVING, "--cpu-check", "--shapes", "decode-heavy", "--decode", "1"])
    assert proc.returncode == 1 and "complete no block of 2 tokens per step: there would be nothing to store" in (
        proc.stderr
    )
    proc = _run([*SERVING, "--methods", "triton", "nvme"])
    assert proc.returncode == 2 and "unknown method(s) ['nvme']" in proc.stderr and "'memcpy_batch'" in proc.stderr


@pytest.fixture(scope="module")
def loop_setup():
    """A tiny small-page setup on CPU, shared by the byte-check tests (each run resets the destinations)."""
    env = Env(torch.device("cpu"), None, "cpu")
    shape = config.CPU_SHAPES["prefill-heavy"]
    setup = loop.setup_workload(workloads.WORKLOADS["small-page"].tiny(), "block_first", shape, env, 3)
    try:
        yield loop, methods, setup
    finally:
        setup.close()


def _flip(t: torch.Tensor, index) -> None:
    t[index] ^= 0x5A


def test_the_byte_check_catches_each_kind_of_wrong_byte(loop_setup):
    loop, methods, setup = loop_setup
    engine = methods.build_engine(methods.MethodPoint("triton", 4), setup.target)
    run = loop.run_loop(setup, engine)
    assert loop.byte_check(setup, run) is None
    host_ids, gpu_ids, never = run.blocks.expected_stores()
    assert host_ids.size == setup.sizes.host_ring and never.size == 0  # the store ring wrapped: all checked
    # A stored host block with one wrong byte.
    _flip(setup.host, (int(host_ids[5]), 17))
    assert "stored host blocks: 1 of" in loop.byte_check(setup, run)
    _flip(setup.host, (int(host_ids[5]), 17))
    # The GPU block changed after its store (as if the store had run before the compute's write).
    layer0 = setup.spec.kv_caches[1].view(torch.uint8)
    _flip(layer0, (int(gpu_ids[0]), 0, 0, 0, 3))
    problem = loop.byte_check(setup, run)
    assert "stored host blocks: 1 of" in problem and "layer 1" in problem
    _flip(layer0, (int(gpu_ids[0]), 0, 0, 0, 3))
    # A loaded block with a wrong byte, and a cached prefix that no region holds now.
    loaded, _ = run.blocks.expected_loads()
    gpu = loaded[0][0]
    _flip(setup.spec.kv_caches[0].view(torch.uint8), (int(gpu[2]), 1, 1, 0, 0))
    assert "loaded GPU blocks: 1 of" in loop.byte_check(setup, run)
    _flip(setup.spec.kv_caches[0].view(torch.uint8), (int(gpu[2]), 1, 1, 0, 0))
    idle = set(range(3)) - set(run.blocks.region_prefix.tolist())
    spare = run.blocks.prefix_host[idle.pop()]
    _flip(setup.host, (int(spare[0]), 0))
    assert loop.byte_check(setup, run) == "a cached prefix's host block changed"
    _flip(setup.host, (int(spare[0]), 0))
    assert loop.byte_check(setup, run) is None


def test_a_store_that_reads_its_blocks_before_the_compute_writes_them_fails(loop_setup, monkeypatch):
    """The step's KV depends on its compute, so a store ordered before the compute stores older bytes (here: every
    method computes the same KV into the same blocks, and the previous run's are what a misordered store would find
    if a run did not start from the sentinel)."""
    loop, methods, setup = loop_setup
    assert loop.byte_check(setup, loop.run_loop(setup, None)) is None  # a previous run left the same KV behind
    engine = methods.build_engine(methods.MethodPoint("triton", 4), setup.target)
    held, real_step, real_store = [], setup.model.step, engine.submit_store
    monkeypatch.setattr(setup.model, "step", held.append)  # the compute is held back...

    def store_first(job, gpu_ids, host_ids):
        real_store(job, gpu_ids, host_ids)  # ...until the (synchronous, on CPU) store has read its blocks
        real_step(held.pop())

    engine.submit_store = store_first
    run = loop.run_loop(setup, engine)
    assert run.check_problem.startswith("store job 0: "), run.check_problem  # seen when the first store completed
    assert "stored host blocks" in loop.byte_check(setup, run)  # and in the final state


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_where_loads_and_deferred_stores_go_in_the_step(loop_setup, monkeypatch, mode):
    """vLLM 0.33's placement (kv_connector_model_runner_mixin._get_kv_connector_output): a step's transfers start
    before its forward pass when it has a sync load, else after the forward pass is queued; they are the deferred
    store first (--defer-stores: the step before's), then the arrival's load. The last step's store goes out after
    the loop, so the host ring still ends complete."""
    loop, methods, setup = loop_setup
    engine = methods.build_engine(methods.MethodPoint("memcpy_batch"), setup.target)
    order = []
    for name in ("submit_store", "submit_load"):
        real = getattr(engine, name)
        monkeypatch.setattr(
            engine, name, lambda job, g, h, real=real, name=name: order.append((name, job)) or real(job, g, h)
        )
    real_step = setup.model.step
    monkeypatch.setattr(setup.model, "step", lambda rows: order.append(("compute", None)) or real_step(rows))
    run = loop.run_loop(setup, engine, load_mode=mode, defer_stores=True)
    assert loop.byte_check(setup, run) is None and run.check_problem is None
    steps = setup.shape.warmup + setup.shape.steps
    assert setup.shape.load_every == 2  # arrivals at steps 0, 2, 4, ...
    compute, store, load = ("compute", None), "submit_store", "submit_load"
    if mode == "sync":  # the arrival's step: its transfers (deferred store, then load) before its forward pass
        want = [(load, 1), compute, compute, (store, 0), (store, 2), (load, 5), compute, compute, (store, 4)]
    else:  # every step's transfers after its forward pass is queued
        want = [compute, (load, 1), compute, (store, 0), compute, (store, 2), (load, 5), compute, (store, 4)]
    assert order[: len(want)] == want, order
    assert order[-1] == (store, 2 * (steps - 1)) and order[-2] in (compute, (store, 2 * (steps - 2)))
    assert all(r.store_submit_s is not None for r in run.records[1:])


def test_async_loads_are_waited_for_by_their_request_only(loop_setup, monkeypatch):
    """Async loads: nothing waits for a load in the step (the engine's wait is called only for the block reuse),
    each load's latency runs to the poll that reported it, and its bytes are checked after that step; sync loads:
    the worker waits for the load before its forward pass."""
    loop, methods, setup = loop_setup
    engine = methods.build_engine(methods.MethodPoint("triton", 4), setup.target)
    waited = []
    real_wait = engine.wait
    monkeypatch.setattr(engine, "wait", lambda ids: waited.append(set(ids)) or real_wait(ids))
    run = loop.run_loop(setup, engine, load_mode="async")
    assert run.check_problem is None and run.jobs_checked == len(run.loads) + setup.shape.warmup + setup.shape.steps
    assert not any(j % 2 for ids in waited for j in ids), waited  # no load job was waited for
    assert all(ld.latency_s is not None and ld.steps == 1 and ld.wait_s is None for ld in run.loads.values())
    assert [r.load_step for r in run.records] == [s % 2 == 0 for s in range(2, 8)]  # on CPU each is done at once
    waited.clear()
    run = loop.run_loop(setup, engine, load_mode="sync")
    assert run.check_problem is None and {1, 5, 9, 13} <= {j for ids in waited for j in ids}
    assert all(ld.wait_s is not None and ld.steps is None for ld in run.loads.values())


def test_without_offload_nothing_may_change_on_either_side(loop_setup):
    loop, _, setup = loop_setup
    run = loop.run_loop(setup, None)
    assert not run.offloaded and loop.byte_check(setup, run) is None
    assert all(r.load_job is None and r.store_submit_s is None for r in run.records)
    _flip(setup.host, (0, 0))
    assert "no store addressed changed" in loop.byte_check(setup, run)
    _flip(setup.host, (0, 0))
    region = run.blocks.load_gpu[1]
    _flip(setup.spec.kv_caches[0].view(torch.uint8), (int(region[0]), 0, 0, 0, 0))
    assert "a load region that no load addressed changed" in loop.byte_check(setup, run)
    _flip(setup.spec.kv_caches[0].view(torch.uint8), (int(region[0]), 0, 0, 0, 0))


# (K or V, block, slot) -> index of that token's heads in a layer tensor, and the block dim, per layout.
_KV_AT = {
    "block_first": (lambda half, b, s: (b, half, s), 0),  # (blocks, 2, block_size, heads, head_dim)
    "kv_first": (lambda half, b, s: (half, b, s), 1),  # (2, blocks, block_size, heads, head_dim)
}


@pytest.mark.parametrize("layout", sorted(_KV_AT))
def test_a_step_writes_its_kv_into_its_blocks_from_the_qkv_product(layout):
    """The KV a step writes is the QKV product's K and V columns of each token, at the token's block and slot, in
    every layer, and nothing else in the cache changes."""
    import triton_offload as to

    w = workloads.WORKLOADS["llama3-8b"].tiny()  # 2 KV heads x 8
    spec = to.KVCacheSpec(workloads.make_caches(w, layout, 12, "cpu", seed=2), layout)
    model = serving_model.StepModel(w, spec, 3, seed=5)
    at, block_dim = _KV_AT[layout]
    blocks = np.array([4, 4, 9], dtype=np.int64)
    slots = np.array([0, 1, 1], dtype=np.int64)
    before = [t.clone() for t in spec.kv_caches]
    m = model.model
    for _ in range(2):  # the second step overwrites the first's KV with its own
        model.step(model.slot_rows(blocks, slots))
        k = model.qkv[:, m.q_width : m.q_width + m.kv_width].view(3, m.kv_heads, m.head_dim)
        v = model.qkv[:, m.q_width + m.kv_width :].view(3, m.kv_heads, m.head_dim)
        layer = spec.kv_caches[-1]  # the last layer's KV: from the last QKV product
        for i, (b, s) in enumerate(zip(blocks, slots)):
            assert torch.equal(layer[at(0, b, s)].view(torch.int16), k[i].view(torch.int16))
            assert torch.equal(layer[at(1, b, s)].view(torch.int16), v[i].view(torch.int16))
    for t, b in zip(spec.kv_caches, before):
        per_block = (t.view(torch.int16) != b.view(torch.int16)).movedim(block_dim, 0).reshape(12, -1)  # bytes
        assert per_block.any(dim=1).nonzero().flatten().tolist() == [4, 9]  # no other block was written


@pytest.mark.parametrize("shape_name", ["prefill-heavy", "decode-heavy"])
@pytest.mark.parametrize("workload", ["llama3-8b", "llama3-70b-tp8", "small-page"])
def test_the_block_plan_at_gpu_shapes(workload, shape_name):
    """At the GPU run's shape: every token gets its own slot, every block a step completes is stored, blocks are
    reused only after many steps, and every host block of the store ring can be checked at the end; a GPU ring
    smaller than ring_sizes' breaks that last property."""
    w = workloads.WORKLOADS[workload]
    shape = config.GPU_SHAPES[shape_name]
    sizes = config.ring_sizes(shape, w.block_size)
    plan = blocks_mod.Blocks(shape, sizes, w.block_size, seed=1)
    per_prefill = shape.prefill // w.block_size
    oldest_reuse = math.inf
    for s in range(shape.warmup + shape.steps):
        step = plan.next_step(store_job=2 * s)
        pairs = step.token_blocks * w.block_size + step.token_slots
        assert np.unique(pairs).size == shape.tokens and step.token_slots.max() < w.block_size
        assert per_prefill + shape.decode // w.block_size <= step.store_gpu.size <= sizes.max_per_step
        assert np.unique(step.store_host).size == step.store_gpu.size
        if step.must_finish:
            oldest_reuse = min(oldest_reuse, s - max(step.must_finish) // 2)
    assert oldest_reuse > config.HOST_RING_STEPS  # steps from a store to its blocks' reuse: long finished
    host_ids, gpu_ids, never = plan.expected_stores()
    assert host_ids.size == sizes.host_ring and never.size == 0 and np.unique(gpu_ids).size == gpu_ids.size
    too_small = sizes.max_per_step * config.HOST_RING_STEPS // 2  # half the steps the host ring holds
    small = blocks_mod.Blocks(shape, config.RingSizes(**{**vars(sizes), "gpu_ring": too_small}), w.block_size, seed=1)
    for s in range(40):
        small.next_step(store_job=2 * s)
    with pytest.raises(AssertionError, match="ring too small"):
        small.expected_stores()


def test_every_default_method_is_registered_and_points_expand():
    assert set(config.DEFAULT_METHODS) <= set(methods.METHODS)
    points = methods.method_points(config.DEFAULT_METHODS, config.TRITON_CTAS)
    labels = ["none", "triton@4", "triton@2", "triton@8", "triton_size_aware", "auto", "vllm033", "vllm_native",
              "memcpy_batch"]  # fmt: skip
    assert [p.label for p in points] == labels
    # The plan counts the runs alike (RunPlan.runs_per_mode, without importing the methods): every point once per
    # round, and none once more; and the duplex points from the same list of methods.
    plan = config.FULL_PLAN
    assert plan.runs_per_mode() == len(serving.schedule(points, plan.rounds)) == plan.rounds * len(points) + 1
    assert [p.method for p in serving.DUPLEX_POINTS] == list(config.DUPLEX_METHODS)
    assert set(serving.DUPLEX_POINTS) <= set(points)
    preset = config.PRESETS["decisive"]
    assert preset.runs_per_mode() == len(serving.schedule(methods.method_points(preset.methods, ()), 2))
    with pytest.raises(
        ValueError, match=r"unknown method\(s\) \['nvme'\]; supported: \['auto', 'memcpy_batch', 'none'"
    ):
        methods.method_points(["triton", "nvme"], ())


def test_the_triton_method_passes_engine_options_through(monkeypatch):
    """So that a path choice (TransferEngine(..., path=...)) is one registry line away."""
    seen = {}
    monkeypatch.setattr(ours, "TransferEngine", lambda kv, host, **kw: seen.update(kw) or "engine")
    target = OffloadTarget("kv", type("Cache", (), {"buffer": "host"})(), None)
    assert ours.triton_engine(target, 4, path="auto") == "engine"
    assert seen == {"num_ctas": None, "path": "auto"}  # the default num_ctas is passed as a user passes it
    seen.clear()
    ours.triton_engine(target, 8)
    assert seen == {"num_ctas": 8}


def test_each_serving_workload_models_its_own_kv_cache():
    for name in config.SERVING_WORKLOADS:
        w = workloads.WORKLOADS[name]
        assert (w.model.kv_heads, w.model.head_dim) == (w.heads, w.head_dim), name
        tiny = w.tiny()
        assert (tiny.model.kv_heads, tiny.model.head_dim) == (tiny.heads, tiny.head_dim), name
    assert workloads.WORKLOADS["small-page"].page_bytes == 2048
    llama8 = workloads.WORKLOADS["llama3-8b"].model
    # 32 layers x (QKV 4096x6144 + O 4096x4096 + gate/up 4096x28672 + down 14336x4096) = 6.98e9 weights.
    assert 32 * llama8.flops_per_token() // 2 == 6_979_321_856


@pytest.mark.gpu
def test_a_short_gpu_serving_run_checks_bytes_and_reports_sane_numbers(tmp_path):
    out, png = tmp_path / "serving.json", tmp_path / "serving.png"
    args = ["--workloads", "llama3-70b-tp8", "--shapes", "decode-heavy", "--steps", "12", "--warmup", "3",
            "--decode", "64", "--context", "256", "--prefix-tokens", "1024", "--load-every", "3", "--rounds", "1",
            "--duplex-repeats", "2", "--json", str(out), "--plot", str(png)]  # fmt: skip
    proc = _run([*SERVING, *args], timeout=500)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["mode"] == "gpu" and data["complete"] and data["failures"] == []
    w = "llama3-70b-tp8"
    for mode in ("async", "sync"):
        rows = {(r["method"], r["num_ctas"]): r for r in data["rows"] if r["load_mode"] == mode}
        # none, triton at 4, 2 and 8 CTAs, auto, vllm033, vllm_native, dma.
        assert len(rows) == 8, sorted(rows)
        if not (VLLM_033 or os.environ.get("TRITON_OFFLOAD_VLLM_BUNDLE")):
            native = rows.pop(("vllm_native", None))  # vLLM 0.33's code is not importable: an n/a row, not a failure
            assert native["byte_check"] == "n/a" and "vllm_native runs vLLM 0.33.0's own worker" in native["impl"]
        assert all(r["byte_check"] == "pass" for r in rows.values()), rows
        none = rows[("none", None)]
        assert none["slowdown_vs_none"] == 0.0 and none["load_latency_ms_median"] is None and none["rounds"] == 2
        assert 0 < none["step_ms_median"] <= none["step_ms_p90"] <= none["step_ms_p99"] < 10_000
        assert 0 < none["step_ms_mean"] <= none["step_ms_p99"] and none["drift_vs_none"] >= 0
        assert 0 < none["compute_ms_median"] <= none["step_ms_median"] * 1.05
        contiguous = data["contiguous"][f"{w}/decode-heavy"]
        assert contiguous["bytes"] == 64 * 80 * 8192 and 1 < contiguous["gbps"] < 200
        for (method, _), r in rows.items():
            if method == "none":
                continue
            assert r["loads"] == 4 and r["load_bytes"] == contiguous["bytes"] and r["jobs_checked"] == 15 + 5, r
            assert 0 < r["load_device_ms_median"] and 0 < r["load_latency_ms_median"] <= r["load_latency_ms_p99"], r
            assert 0 < r["store_submit_us_median"] < 1e5 and 0 < r["load_submit_us_median"] < 1e5, r
            assert 0 < r["submit_cpu_us_per_step"] < 1e5 and 0 < r["offload_gbps"] < 200, r
            assert 0 < r["offload_demand_gbps"] < 200 and r["drift_vs_none"] == none["drift_vs_none"], r
            assert -0.5 < r["slowdown_vs_none"] < 2.0 and r["load_steps"] >= 4, r
            if mode == "sync":
                assert 0 < r["load_device_ms_median"] <= r["load_latency_ms_median"], r
                assert 0 < r["load_wait_ms_median"] <= r["load_latency_ms_median"], r
                assert 0.5 < r["load_vs_contiguous"] < 100, r
            else:
                assert r["load_steps_waited_median"] >= 1 and r["load_vs_contiguous"] is None, r
        assert "SM copy load" in rows[("vllm033", None)]["impl"]  # 8 KiB pages
    duplex = {d["method"]: d for d in data["duplex"]}
    assert set(duplex) == {"triton", "memcpy_batch"}
    for d in duplex.values():
        assert d["byte_check"] == "pass" and 0.5 < d["ratio"] < 2.5 and 0.2 < d["ratio_vs_contiguous"] < 2.5, d
        assert 1 < d["store_alone_gbps"] < 200 and 1 < d["load_alone_gbps"] < 200, d
    # Six step, load and submit targets each for triton at the default CTAs and for auto, and two duplex targets.
    assert len(data["targets"]) == 14 and {t["verdict"] for t in data["targets"]} <= {"PASS", "FAIL", "n/a"}
    assert all({"name", "worst", "where", "verdict"} <= set(t) for t in data["targets"])
    assert png.stat().st_size > 10_000
