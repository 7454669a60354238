"""The FP8 host format in the serving loop (``triton_fp8``, bench/serving/fp8.py): on CPU at tiny shapes it runs beside
``triton`` with its own host cache of FP8 rows and every job checked, byte for byte, against the reference
quantization; a load or a store one bit off fails the run; the reference rows are the kernel reference's; the report's
target reads FP8's load time against bf16's from one run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import triton_offload as to
from bench.common import workloads
from bench.common.env import Env
from bench.common.verify import reference_blocks
from bench.micro.fp8_cases import fp8_bound_excess
from bench.serving import cli as serving
from bench.serving import config, fp8, loop, report
from tools.gpu import stages
from triton_offload.kernels.reference_fp8 import gather_fp8_ref

BASE = ["--cpu-check", "--workloads", "small-page", "--shapes", "prefill-heavy"]


def _serve(tmp_path, methods: list[str], fault=None, modes=("sync",)) -> tuple[int, dict]:
    """The serving benchmark's main in this process, every ``triton_fp8`` engine wrapped in ``fault``."""
    out = tmp_path / "serving.json"
    with pytest.MonkeyPatch.context() as mp:
        if fault is not None:
            real = serving.build_engine
            mp.setattr(serving, "build_engine", lambda p, t: fault(real(p, t), t) if p.method == "triton_fp8"
                       else real(p, t))  # fmt: skip
        argv = [*BASE, "--load-modes", *modes, "--methods", *methods, "--num-ctas", "4", "--json", str(out)]
        rc = serving.main(argv)
    return rc, json.loads(out.read_text())


class _Wrapped:
    def __init__(self, engine, target):
        self.engine, self.target = engine, target

    def __getattr__(self, name):
        return getattr(self.engine, name)


class _LoadOneBitOff(_Wrapped):
    """Every load restores one bf16 value one unit in the last place off (a rounding slip, well within E4M3's bound):
    on CPU the engine is synchronous, so the load is done when its submit returns."""

    def submit_load(self, job_id, gpu_ids, host_ids, **kw):
        self.engine.submit_load(job_id, gpu_ids, host_ids, **kw)
        self.target.kv.kv_caches[1][int(gpu_ids[-1]), 1, 0, 0, 3].view(torch.int16).bitwise_xor_(1)


class _StoreOneBitOff(_Wrapped):
    """Every store writes one FP8 code one unit off in its last host row."""

    def submit_store(self, job_id, gpu_ids, host_ids, **kw):
        self.engine.submit_store(job_id, gpu_ids, host_ids, **kw)
        self.target.host_buffer[int(host_ids[-1]), 5].bitwise_xor_(1)


def test_fp8_runs_beside_bf16_with_every_job_checked(tmp_path):
    rc, data = _serve(tmp_path, ["none", "triton", "triton_fp8"], modes=("async", "sync"))
    assert rc == 0, data["failures"]
    by = {(r["load_mode"], r["method"]): r for r in data["rows"]}
    assert by["async", "triton_fp8"]["byte_check"] == "pass" and by["async", "triton_fp8"]["jobs_checked"] == 12
    fp8_row, bf16 = by["sync", "triton_fp8"], by["sync", "triton"]
    assert fp8_row["byte_check"] == "pass" and fp8_row["jobs_checked"] == bf16["jobs_checked"] == 12
    # The same logical bytes move: the rows compare like for like.
    for key in ("load_bytes", "stored_bytes_per_step"):
        assert fp8_row[key] == bf16[key] > 0, key
    assert "host_format='fp8_e4m3'" in fp8_row["impl"] and "load kernel x4, store kernel x8" in fp8_row["impl"]
    # Its own host cache, of FP8 rows: at this tiny shape (one head of 2 x 8 values per layer and half) the 16-byte
    # values and the padded scale take what the bf16 bytes took; at the GPU shapes, about half (below).
    assert "host rows of 128 bytes (native: 128)" in fp8_row["impl"], fp8_row["impl"]


@pytest.mark.parametrize("name", config.SERVING_WORKLOADS)
def test_the_fp8_rows_are_about_half_at_the_gpu_shapes(name):
    w = workloads.WORKLOADS[name]
    caches = workloads.make_caches(w, "block_first", 1, torch.device("cpu"), 0)
    native = to.KVCacheSpec(caches, "block_first").host_block_bytes(1)
    ratio = to.KVCacheSpec(caches, "block_first", host_format="fp8_e4m3").host_block_bytes(1) / native
    assert 0.5 < ratio <= 0.52, ratio


def test_an_fp8_load_one_bit_off_fails_the_run(tmp_path):
    rc, data = _serve(tmp_path, ["none", "triton_fp8"], _LoadOneBitOff)
    (row,) = [r for r in data["rows"] if r["method"] == "triton_fp8"]
    assert rc == 1 and row["byte_check"] == "fail", row
    note = row["byte_check_note"]
    assert note.startswith("load job 1: 1 of 8 blocks differ") and "layer 1 V page" in note, note


def test_an_fp8_store_one_bit_off_fails_the_run(tmp_path):
    rc, data = _serve(tmp_path, ["none", "triton_fp8"], _StoreOneBitOff)
    (row,) = [r for r in data["rows"] if r["method"] == "triton_fp8"]
    assert rc == 1 and row["byte_check"] == "fail", row
    assert row["byte_check_note"].startswith("store job 0: 1 of "), row


@pytest.mark.parametrize("layout", ["block_first", "kv_first"])
def test_the_reference_rows_are_the_kernel_references(layout):
    """bench/serving/fp8.py's whole-tensor rows equal kernels/reference_fp8.py's per-head ones, padding left alone;
    and what they restore is within E4M3's bound of the blocks."""
    w = workloads.WORKLOADS["llama3-8b"].tiny()
    shape = config.CPU_SHAPES["prefill-heavy"]
    setup = loop.setup_workload(w, layout, shape, Env(torch.device("cpu"), None, "cpu"), seed=3)
    try:
        spec = to.KVCacheSpec(setup.spec.kv_caches, layout, host_format="fp8_e4m3")
        ids = np.array([5, 0, 9], dtype=np.int64)
        fp8._fill_random(spec, ids, torch.Generator().manual_seed(1))
        rows = fp8.Fp8Rows(spec)
        want = torch.full((3, spec.host_block_bytes(1)), 0xA5, dtype=torch.uint8)
        gather_fp8_ref(spec.kv_caches, layout, ids, want, np.arange(3))
        assert torch.equal(rows.rows(ids), want)
        runs = (3, 2 * w.num_layers, w.block_size, w.heads, w.head_dim)  # packed: per layer K then V, per head
        restored = rows.restored(ids).view(torch.bfloat16).view(runs)
        exact = reference_blocks(setup.spec, ids, setup.spec.device).view(torch.bfloat16).view(runs)
        assert not torch.equal(restored, exact) and fp8_bound_excess(exact, restored) <= 0
    finally:
        setup.close()


def test_the_serving_stage_runs_fp8_beside_bf16():
    """The GPU run's serving stage has triton_fp8 with triton (the ratio is read from one run); --fp8 adds it once."""
    plan = serving.run_plan(serving.parse_args(list(stages.SERVING_STAGE)), cuda=True)
    assert {"triton", "triton_fp8"} <= set(plan.methods) and plan.methods.count("triton_fp8") == 1
    assert "triton_fp8" not in config.DEFAULT_METHODS + config.PRESETS["decisive"].methods  # on request only
    assert "bench/accuracy" in stages.SERVING  # its reference codec: a change reruns the stage


def _rows(fp8_sync_ms: float, fp8_async_ms: float) -> list[dict]:
    rows = []
    for mode, key, bf16_ms, ms in (("sync", "load_latency_ms_median", 10.0, fp8_sync_ms),
                                   ("async", "load_device_ms_median", 8.0, fp8_async_ms)):  # fmt: skip
        common = dict(workload="w", shape="s", load_mode=mode, byte_check="pass", step_ms_mean=10.0)
        rows.append(report.new_row(method="triton", num_ctas=4, **{key: bf16_ms}, **common))
        rows.append(report.new_row(method="triton_fp8", **{key: ms}, **common))
    return rows


def test_the_fp8_target_reads_fp8s_load_time_against_bf16s():
    (t,) = [t for t in report.evaluate_targets(_rows(5.1, 4.2), []) if t["name"].startswith("triton_fp8")]
    assert t["verdict"] == "PASS" and t["cases"] == 2 and t["worst"] == pytest.approx(4.2 / 8.0)
    (t,) = [t for t in report.evaluate_targets(_rows(5.1, 4.8), []) if t["name"].startswith("triton_fp8")]
    assert t["verdict"] == "FAIL" and t["worst"] == pytest.approx(0.6) and t["where"].startswith("w/s/async")
    assert not [t for t in report.evaluate_targets(_rows(5.1, 4.2)[:1], []) if t["name"].startswith("triton_fp8")]
