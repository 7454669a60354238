"""What the serving benchmark runs: its shapes, load modes, rounds and presets (bench/serving_config.py), the
command line that picks them, the step estimate that sized the shapes, and the baseline's
load attributes (vLLM 0.33 reads a load's source in any order)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from vllm_harness import VLLM_033

from bench.common import verify, workloads
from bench.common.case import OffloadTarget
from bench.common.env import Env
from bench.serving import cli as serving
from bench.serving import config, methods
from bench.serving import model as serving_model

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_decisive_preset_is_what_the_issue_asks():
    p = config.PRESETS["decisive"]
    assert set(p.methods) == {"none", "triton", "auto", "vllm033", "vllm_native"} and p.triton_ctas == ()
    assert set(p.load_modes) == {"async", "sync"} and {s for _, s in p.cases} == {"decode-heavy", "prefill-heavy"}
    assert p.rounds >= 2  # every method bracketed by none, so the drift is measured


def test_the_decisive_preset_runs_the_decisive_case_first():
    """Llama-3-70B at TP 8, decode-heavy (8 KiB pages: vllm033's loads take its SM copy against a busy GPU) runs first,
    so a lease cut short keeps it; the command line's filters keep the preset's order."""
    assert config.PRESETS["decisive"].cases[0] == ("llama3-70b-tp8", "decode-heavy")
    for cuda in (True, False):
        plan = serving.run_plan(serving.parse_args(["--preset", "decisive", "--integrity"]), cuda)
        assert plan.cases[0] == ("llama3-70b-tp8", "decode-heavy") and len(plan.cases) == 3, plan.cases
    plan = serving.run_plan(serving.parse_args(["--preset", "decisive", "--shapes", "decode-heavy"]), True)
    assert plan.cases == (("llama3-70b-tp8", "decode-heavy"), ("llama3-8b", "decode-heavy"))


def test_the_decode_heavy_shape_is_a_decode_step_with_heavier_loads():
    """5-15 ms on an H100 by the step estimate (its reads of the weights and the batch's KV bound it), and its prefix
    loads ask far more of the link than the prefill-heavy shape's."""
    w = workloads.WORKLOADS["llama3-8b"]
    decode, prefill = config.GPU_SHAPES["decode-heavy"], config.GPU_SHAPES["prefill-heavy"]
    step = config.h100_step_seconds(w, decode)
    assert 5e-3 <= step <= 15e-3 and decode.prefill == 0 and decode.context > 0
    assert config.h100_step_seconds(w, prefill) > 40e-3
    block = w.num_layers * w.page_bytes

    def demand(shape):  # load bytes per second of steps
        return shape.prefix_tokens // w.block_size * block / (shape.load_every * config.h100_step_seconds(w, shape))

    assert demand(decode) > 5 * demand(prefill)


def test_the_schedule_brackets_every_method_with_none():
    points = methods.method_points(["none", "triton", "auto", "vllm033"], ())
    order = [(p.label, r) for p, r in serving.schedule(points, 2)]
    assert order == [("none", 0), ("triton@4", 0), ("auto", 0), ("vllm033", 0),
                     ("none", 1), ("vllm033", 1), ("auto", 1), ("triton@4", 1), ("none", 2)]  # fmt: skip
    assert [p.label for p, _ in serving.schedule(methods.method_points(["triton"], ()), 1)] == ["triton@4"]


@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_vllm_native_runs_last_in_every_round(rounds):
    """vllm_native, the least-proven path (a ctypes stand-in for vLLM's compiled op), runs after every other method of
    its round, triton_integrity included, wherever it stands in the method list: a sticky CUDA fault there costs no
    other method's run of that round. The other methods still reverse every other round, and none brackets each."""
    names = ["none", "vllm_native", "triton", "auto", "vllm033", "triton_integrity"]
    order = [(p.label, r) for p, r in serving.schedule(methods.method_points(names, ()), rounds)]
    assert len(order) == rounds * len(names) + 1 and order[-1] == ("none", rounds)
    middle = ["triton@4", "auto", "vllm033", "triton_integrity"]
    for r in range(rounds):
        this = [label for label, k in order if k == r]
        assert this == ["none", *(middle if r % 2 == 0 else middle[::-1]), "vllm_native"], (r, this)
    # The stage's plan (the decisive preset with --integrity) alike.
    plan = config.with_integrity(config.PRESETS["decisive"])
    order = serving.schedule(methods.method_points(plan.methods, plan.triton_ctas), plan.rounds)
    for r in range(plan.rounds):
        this = [p.method for p, k in order if k == r]
        assert this[-1] == "vllm_native" and "triton_integrity" in this[:-1], (r, this)


def test_the_command_line_picks_the_plan():
    full = serving.run_plan(serving.parse_args([]), cuda=True)
    assert full.cases == config.FULL_PLAN.cases and full.rounds == 2 and full.shapes == config.GPU_SHAPES
    cpu = serving.run_plan(serving.parse_args([]), cuda=False)
    assert cpu.shapes == config.CPU_SHAPES and cpu.rounds == 1 and not cpu.duplex
    preset = serving.run_plan(serving.parse_args(["--preset", "decisive", "--workloads", "llama3-8b"]), True)
    assert preset.cases == (("llama3-8b", "decode-heavy"), ("llama3-8b", "prefill-heavy"))
    decisive = config.PRESETS["decisive"]
    assert preset.shapes == decisive.shapes and preset.methods == decisive.methods
    args = ["--workloads", "small-page", "--shapes", "decode-heavy", "--load-modes", "sync", "--rounds", "3",
            "--steps", "7", "--context", "64", "--methods", "none", "memcpy_batch"]  # fmt: skip
    plan = serving.run_plan(serving.parse_args(args), True)
    assert plan.cases == (("small-page", "decode-heavy"),) and plan.load_modes == ("sync",) and plan.rounds == 3
    assert plan.methods == ("none", "memcpy_batch") and plan.runs_per_mode() == 3 * 2 + 1
    assert all(s.steps == 7 and s.context == 64 for s in plan.shapes.values())
    assert plan.shape("prefill-heavy").decode == config.GPU_SHAPES["prefill-heavy"].decode


def test_the_preset_runs_on_cpu(tmp_path):
    """`--preset decisive` without CUDA: its cases and methods at the tiny shapes, both load modes, none bracketing
    every method in two rounds; every byte checked."""
    out = tmp_path / "preset.json"
    proc = subprocess.run([sys.executable, "-m", "bench.serving", "--preset", "decisive", "--cpu-check", "--json",
                           str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["preset"] == "decisive" and data["complete"] and data["failures"] == []
    groups = {(r["workload"], r["shape"], r["load_mode"]) for r in data["rows"]}
    assert len(groups) == 3 * 2 and len(data["rows"]) == 6 * 5
    for r in data["rows"]:
        if r["byte_check"] == "n/a":
            assert r["method"] == "vllm_native" and not VLLM_033, r
            continue
        assert r["byte_check"] == "pass" and r["rounds"] == (3 if r["method"] == "none" else 2), r
        assert r["jobs_checked"] == (0 if r["method"] == "none" else 2 * 12), r


def test_vllm033_reads_a_batch_load_in_any_order_and_a_store_in_stream_order():
    """vLLM 0.33's swap_blocks_batch (kv_offload/cpu/gpu_worker.py, transfer_async: is_src_access_order_any = not
    gpu_to_cpu): a load's host source is read in any order, a store's GPU source in stream order (the compute may
    still write it). Here on CPU, where the batch goes to the driver's memmove stand-in, which records the
    attributes it was handed; `memcpy_batch` keeps stream order both ways."""
    import triton_offload as to
    from bench.baselines.driver import SRC_ACCESS_ORDER_ANY
    from triton_offload.cuda_driver import SRC_ACCESS_ORDER_STREAM
    from triton_offload.host.cache import HostCache

    w = workloads.WORKLOADS["llama3-8b"].tiny()
    spec = to.KVCacheSpec(workloads.make_caches(w, "block_first", 8, "cpu", seed=1), "block_first")
    cache = HostCache(spec.host_block_bytes(1), num_blocks=8, pin=False)
    try:
        target = OffloadTarget(spec, cache, Env(torch.device("cpu"), None, "cpu"))
        gpu, host = np.array([1, 6, 3]), np.array([0, 2, 5])  # 6 descriptors: below the SM copy's 16
        for name, load_order in (("vllm033", SRC_ACCESS_ORDER_ANY), ("memcpy_batch", SRC_ACCESS_ORDER_STREAM)):
            engine = methods.build_engine(methods.MethodPoint(name), target)
            # vllm033's batches, or the library's copy-engine issuer's (memcpy_batch): their memmove stand-in.
            calls = (engine.issuer.batch if name == "vllm033" else engine.issuer._batch).stand_in.calls
            engine.submit_store(0, gpu, host)
            engine.submit_load(1, np.array([2, 4, 7]), host)
            engine.shutdown()
            assert [c["attrs"][0] for c in calls] == [SRC_ACCESS_ORDER_STREAM, load_order], name
            assert "cuMemcpyBatchAsync load" in engine.impl
            want = verify.reference_blocks(spec, gpu, torch.device("cpu"))
            assert torch.equal(cache.buffer[torch.from_numpy(host)], want)  # the bytes moved either way
            assert torch.equal(verify.reference_blocks(spec, np.array([2, 4, 7]), torch.device("cpu")), want)
    finally:
        cache.close()


def test_the_decode_step_reads_its_batchs_kv_per_layer():
    import triton_offload as to

    w = workloads.WORKLOADS["llama3-8b"].tiny()
    spec = to.KVCacheSpec(workloads.make_caches(w, "block_first", 12, "cpu", seed=2), "block_first")
    model = serving_model.StepModel(w, spec, 6, seed=1, kv_read_tokens=6 * 4)
    m = w.model
    assert model.kv_read_bytes == 2 * (6 * 4) * m.kv_width * 2 * spec.num_layers  # K and V, bf16, every layer
    offsets = model._kv_offsets
    assert len(set(offsets)) == spec.num_layers  # consecutive layers read different bytes
    assert all(o + model.kv_read_elems <= model.kv_buffer.numel() for o in offsets)
    model.step(model.slot_rows(np.arange(6) % 12, np.zeros(6, dtype=np.int64)))
    assert serving_model.StepModel(w, spec, 6, seed=1).kv_read_elems == 0  # prefill-heavy: no attention read
