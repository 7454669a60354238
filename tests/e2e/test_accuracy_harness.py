"""End to end: the accuracy harness (bench/accuracy) on the real model (SmolLM2-135M-Instruct), a sample of its prompts
(:data:`PROMPTS` of up to 248, cut to :data:`LENGTHS` tokens, :data:`TOKENS` greedy tokens each; the full set is
``python -m bench.accuracy``, whose run is committed under bench/results/). Lossless offloading agrees 100 % with the
engine without offloading, every whole block of every prompt coming back from the host; the same offloading with one
byte of every host block flipped before its first load (tests/e2e/integrity_plugin.py's PerturbingSpec) is caught:
its tokens and top-k differ."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from vllm_harness import E2E, GPU_BLOCK, ROOT, require_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow, *require_engine()]

PROMPTS, TOKENS, LENGTHS = 4, 16, (256, 448)
PERTURBED = {"spec_name": "PerturbingSpec", "spec_module_path": "integrity_plugin"}


@pytest.fixture(scope="module")
def report(real_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("accuracy") / "accuracy.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VLLM_CPU_KVCACHE_SPACE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(E2E), env.get("PYTHONPATH")) if p)  # the plugin
    cmd = [sys.executable, "-m", "bench.accuracy", "--model", str(real_model), "--prompts", str(PROMPTS)]
    cmd += ["--max-tokens", str(TOKENS), "--lengths", *map(str, LENGTHS)]
    cmd += ["--compare", "offload", f"perturbed={json.dumps(PERTURBED)}"]
    run = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return json.loads(out.read_text()) | {"printed": run.stdout}


def host_tokens(report) -> tuple[int, int]:
    """What the host can give, at least and at most: every whole GPU block before each prompt's last token, and every
    whole block (vLLM then computes the last token again: its count of cached tokens may include it)."""
    lengths = report["results"]["offload"]["prompt_tokens"]
    return sum((n - 1) // GPU_BLOCK * GPU_BLOCK for n in lengths), sum(n // GPU_BLOCK * GPU_BLOCK for n in lengths)


def test_lossless_offloading_agrees_100_percent_with_no_offloading(report):
    s = report["summaries"]["offload"]
    assert (s["prompts"], s["tokens"]) == (PROMPTS, PROMPTS * TOKENS)
    assert s["token_agreement"] == 1.0 and s["prompts_identical"] == 1.0 and s["diverged_prompts"] == 0, s
    assert s["kl_max"] < 1e-6, s
    least, most = host_tokens(report)
    assert s["cached_tokens"][0] == 0 and least <= s["cached_tokens"][1] <= most, (s["cached_tokens"], least, most)
    assert "offload vs off: token agreement 100.00%" in report["printed"]


def test_a_perturbed_kv_is_caught(report):
    """One byte flipped per host block: the same host hits, and the harness reports the difference."""
    s = report["summaries"]["perturbed"]
    assert s["cached_tokens"] == report["summaries"]["offload"]["cached_tokens"]
    assert s["token_agreement"] < 1.0 and s["diverged_prompts"] > 0, s
    assert s["kl_max"] > 1e-3, s
