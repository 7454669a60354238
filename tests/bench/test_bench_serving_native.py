"""vLLM 0.33's own worker in the serving step loop (``vllm_native``, bench.baselines.vllm_native.NativeEngine), on CPU
in host replay: byte-checked like every method, and a run whose bytes are wrong fails. Runs where vLLM 0.33.0's
Python code imports (``./dev test`` runs it in the vLLM 0.33 environment); skipped elsewhere."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from vllm_harness import VLLM_033, vllm_version

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not VLLM_033, reason=f"needs vLLM 0.33.0's Python code, found {vllm_version()}")

_RUN = """
import sys
from bench.serving import cli as serving
from bench.baselines.vllm_native import NativeEngine
if {broken!r}:
    submit = NativeEngine._submit
    def shifted(self, job_id, direction, gpu_ids, host_ids):  # a store lands one host block over
        if direction == "store":
            host_ids = (host_ids + 1) % self.host.shape[0]
        submit(self, job_id, direction, gpu_ids, host_ids)
    NativeEngine._submit = shifted
sys.exit(serving.main(["--cpu-check", "--methods", "none", "vllm_native", "--workloads", "small-page", "--shapes",
                       "decode-heavy", "--json", {out!r}]))
"""


def _run(tmp_path, broken: bool) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "native.json"
    code = _RUN.format(broken=broken, out=str(out))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    return proc, json.loads(out.read_text())


def test_vllms_worker_in_the_loop_moves_every_byte(tmp_path):
    proc, data = _run(tmp_path, broken=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [r for r in data["rows"] if r["method"] == "vllm_native"]
    assert [r["load_mode"] for r in rows] == ["async", "sync"]  # one engine for both: its region reset per run
    for row in rows:
        assert row["byte_check"] == "pass" and row["loads"] == 3 and row["stored_bytes_per_step"] > 0, row
        assert row["jobs_checked"] == 12, row  # every store and load, read back from vLLM's own region
        assert row["impl"].startswith("vllm_native: vLLM's own worker") and "memmove" in row["impl"]


def test_a_store_into_the_wrong_host_block_fails_the_run(tmp_path):
    proc, data = _run(tmp_path, broken=True)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    for row in [r for r in data["rows"] if r["method"] == "vllm_native"]:
        assert row["byte_check"] == "fail" and row["byte_check_note"].startswith("store job 0: "), row
