"""The benchmark's CPU mode (``python -m bench.transfer`` without CUDA): every method that exists on CPU moves the right
bytes, the CUDA-only baselines' copy plans replay correctly with memmove, no bandwidth number is ever written, and
a method that moves wrong bytes fails the run instead of reporting anything.

Run with --cpu-check (the end to end runs as subprocesses), so the same test holds on a CUDA machine."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from bench_faults import short_uncoalesced_copies

from bench.transfer import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMING_FIELDS = (
    "median_ms", "p20_ms", "p80_ms", "gbps", "call_cpu_us", "fraction_of_peak",
    "speedup_vs_memcpy_batch", "speedup_vs_memcpy_per_block", "speedup_vs_torch_staged", "speedup_vs_vllm033",
    "speedup_vs_vllm_native",
)  # fmt: skip
RUNS_ON_CPU = {"triton", "triton_size_aware", "torch_staged", "peak"}
CUDA_ONLY = {"memcpy_per_block", "memcpy_batch", "auto"}
# Stores are one cuMemcpyBatchAsync (CUDA only); loads of these small pages are its Triton SM copy, run on CPU.
VLLM033 = "vllm033"
# vLLM 0.33's own worker: its descriptors replayed on host memory where vLLM 0.33's code is importable, else n/a with
# the reason (this environment's vLLM, if any, is another version).
NATIVE = "vllm_native"


def _run(args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False
    )


def test_cpu_check_passes_every_method_and_measures_nothing(tmp_path):
    out = tmp_path / "cpu.json"
    proc = _run(["-m", "bench.transfer", "--quick", "--cpu-check", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "NO BANDWIDTH IS MEASURED" in proc.stdout
    data = json.loads(out.read_text())
    assert data["mode"] == "cpu-interpreter-check"
    assert data["failures"] == []
    rows = data["rows"]
    assert {r["method"] for r in rows} == RUNS_ON_CPU | CUDA_ONLY | {VLLM033, NATIVE}
    # One row schema, in both modes: every row has exactly the same keys.
    assert len({tuple(r) for r in rows}) == 1 and set(TIMING_FIELDS) <= set(rows[0])
    # Every workload and every layout took part, in both directions, with a non-zero skip.
    assert {r["workload"] for r in rows} == {"llama3-8b", "llama3-70b-tp8", "deepseek-v3-mla", "small-page"}
    assert {r["layout"] for r in rows} >= {"kv_first", "mla"}
    assert {r["direction"] for r in rows} == {"store", "load"}
    assert all(r["skip"] == 1 and r["blocks_per_host_block"] == 4 for r in rows)
    for r in rows:
        assert all(r[k] is None for k in TIMING_FIELDS), f"a number was reported without a GPU: {r}"
        if r["method"] in RUNS_ON_CPU:
            assert r["status"] == "pass", r
        elif r["method"] == VLLM033 and r["direction"] == "load":
            # The SM copy ran under the interpreter in every layout and moved the right bytes.
            assert r["status"] == "pass" and r["impl"].startswith("SM copy"), r
        elif r["method"] == NATIVE and r["impl"] is None:
            assert r["status"] == "n/a" and "vllm_native runs vLLM 0.33.0's own worker" in r["note"], r
        else:
            # Not runnable without CUDA, but the copy plan they would issue moved the right bytes.
            assert r["status"] == "n/a" and "memmove" in r["note"], r


def test_a_method_moving_wrong_bytes_fails_the_run(tmp_path, monkeypatch):
    out = tmp_path / "broken.json"
    short_uncoalesced_copies(monkeypatch, 16)  # the last copy of every baseline's transfer
    assert cli.main(["--quick", "--cpu-check", "--workloads", "small-page", "--json", str(out)]) == 1
    data = json.loads(out.read_text())
    failed = {(f["method"], f["direction"]) for f in data["failures"]}
    # Every method issuing the library's uncoalesced descriptors; auto (the engine's copy-engine path, which asks for
    # coalescing: triton_offload/issuers/dma.py, tests/unit/test_dma.py) still passes.
    assert failed == {(m, d) for m in (CUDA_ONLY - {"auto"}) | {VLLM033} for d in ("store", "load")}
    assert all("differ" in f["note"] for f in data["failures"])
    # The methods whose bytes are right still pass, and still nothing is measured.
    assert all(r["status"] == "pass" for r in data["rows"] if r["method"] in RUNS_ON_CPU)
    assert all(r["gbps"] is None for r in data["rows"])


def test_call_cost_runs_every_step_at_a_tiny_shape(tmp_path):
    """bench.micro.call_cost (the per-call host-time breakdown measured on the GPU) runs end to end and writes its
    JSON; on CPU it times only the steps before the launch and says so."""
    out = tmp_path / "cost.json"
    proc = _run(["-m", "bench.micro.call_cost", "--tiny", "--calls", "8", "--json", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "the steps before the launch only" in proc.stdout or "NVIDIA" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["left"] == [] and doc["done"], doc["done"]
    sections = doc["sections"]
    assert all("launch" in row for rows in sections.values() for row in rows.values())
    steps = sections["public steps"]
    for step in ("check_host_buffer", "plan: validation + packing", "CopyLauncher(...)"):
        assert steps[step]["calls"] == 8 and steps[step]["median_us"] > 0, step
    traced = sections["engine submit steps (inside the calls above)"]
    for name in ("engine.submit_store", "engine.submit_load"):
        assert any(k.startswith(name) and "plan:" in k for k in traced), traced
