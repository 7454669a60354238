"""The benchmark end to end on a GPU, at a size that takes seconds: every method is byte-checked on every case and
then timed, the baselines issue from compiled code, and the rows carry the CPU cost and the vllm033 speedup. Runs
in `./dev gpu tests`, before the benchmark parts, so a broken baseline shows before any time is spent measuring.
``vllm_native`` must run wherever vLLM 0.33's code is on the path (`./dev gpu` puts the carried bundle there)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from vllm_harness import VLLM_033

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.gpu
def test_a_small_gpu_run_checks_and_times_every_method(tmp_path):
    out = tmp_path / "small.json"
    args = ["--workloads", "small-page", "--blocks", "16", "128", "--num-ctas", "8", "--budget-ms", "5"]
    args += ["--no-overhead", "--no-interference", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.transfer", *args], capture_output=True, text=True, timeout=400, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["complete"] and data["failures"] == [] and data["mode"] == "gpu"
    rows = data["rows"]
    methods = {"triton", "triton_size_aware", "auto", "memcpy_batch", "memcpy_per_block", "torch_staged", "vllm033",
               "vllm_native", "peak"}  # fmt: skip
    assert {r["method"] for r in rows} == methods
    # 2 layouts x 2 sizes x 2 host formats x 2 directions, each method checked on each before it was timed.
    assert len({(r["layout"], r["blocks"], r["skip"], r["direction"]) for r in rows}) == 16
    native = [r for r in rows if r["method"] == "vllm_native"]
    if not (VLLM_033 or os.environ.get("TRITON_OFFLOAD_VLLM_BUNDLE")):
        assert all(r["status"] == "n/a" for r in native), native
        rows = [r for r in rows if r["method"] != "vllm_native"]
    else:
        # vLLM's own choices: its Triton kernel for loads of 2 KiB pages, one STREAM-ordered batch for stores.
        assert all("Triton swap kernel" in r["impl"] for r in native if r["direction"] == "load"), native
        assert all("srcAccessOrder=STREAM" in r["impl"] for r in native if r["direction"] == "store"), native
    assert all(r["status"] == "pass" and r["median_ms"] and r["call_cpu_us"] for r in rows), rows
    impls = {r["method"]: r["impl"] for r in rows}
    assert "C++" in impls["memcpy_per_block"], impls  # not the handicapped Python loop
    assert "ctypes" in impls["memcpy_batch"], impls
    loads = {r["impl"].split(" ")[0] for r in rows if r["method"] == "vllm033" and r["direction"] == "load"}
    assert loads == {"SM"}  # 2 KiB pages at >= 16 descriptors: the SM copy
    # auto took one of its two paths in every case, and its calibration is in the file.
    assert all(r["impl"].startswith("per call: ") for r in rows if r["method"] == "auto")
    assert data["calibrations"] and all(c["seconds"] > 0 and c["models"] for c in data["calibrations"])
    # The size-aware shape's 2 KiB pages (1 KiB runs in kv_first, 2 KiB in block_first): 16 programs.
    sized = [r for r in rows if r["method"] == "triton_size_aware"]
    assert sized and all(r["impl"].endswith("16 programs at most") for r in sized), sized
    tri = [r for r in rows if r["method"] == "triton"]
    assert all(r["speedup_vs_vllm033"] and r["speedup_vs_memcpy_batch"] for r in tri)
