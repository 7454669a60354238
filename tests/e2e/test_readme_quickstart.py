"""The README's quick start, run as written: its server command starts vLLM's OpenAI server (CPU build), its "see
it work" commands get the documented answers, the server logs the documented line, and stopping it with SIGTERM logs
the workers' transfer totals. Then the same command with a misspelt key stops in the front end, before any engine
process loads the model.

What the test changes in the README's commands, and only that: the port (``8000``: a free one, so runs on one machine
do not collide). Everything else is the README's text, run by bash, with the ``python`` of this environment first on
``PATH``: the model is the README's, SmolLM2-135M-Instruct's folder from ``python -m triton_offload.models`` (made
before, by the ``real_model`` fixture: the same cache directory), served without the Hugging Face hub. The answer
must be the same with and without the host hit, and name Paris. One server start (~1 min on the 2-core CI machine)
and one refused start (~15 s).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from doc_recipes import README, block
from vllm_harness import free_port, kill_group, require_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow, *require_engine()]
if shutil.which("curl") is None or shutil.which("bash") is None:
    pytest.skip("the README's commands need bash and curl", allow_module_level=True)

STARTUP_S = 400
HOST_BLOCKS_HIT = 4  # the chat prompt is 4 whole host blocks of 64 tokens and a part, before its last token
MODEL_LINE = "MODEL=$(python -m triton_offload.models)"


def as_written(name: str, port: int) -> str:
    """The README block ``name`` with its port replaced (the one substitution, visible here)."""
    code = block(name, README)
    first, rest = code.split("\n", 1)
    assert first == MODEL_LINE, f"{name}: the block no longer starts with {MODEL_LINE}: {first!r}"
    assert "8000" in rest, f"{name}: the block no longer uses port 8000"
    return code.replace("8000", str(port))


def environment() -> dict:
    """This environment's as a user's shell would have it: this interpreter's ``python`` first on PATH, without the
    test suite's own settings (TRITON_INTERPRET: the kernels pick the interpreter for CPU tensors themselves)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VLLM_CPU_KVCACHE_SPACE")}
    env["PATH"] = os.pathsep.join([str(pathlib.Path(sys.executable).parent), env.get("PATH", "")])
    return env


@pytest.fixture(scope="module")
def model(real_model) -> pathlib.Path:
    """The README's model folder, made (or found) by the fixture, so that the server's start is not the one that
    makes it; the README's own command then prints the same folder."""
    out = subprocess.run(
        ["bash", "-c", MODEL_LINE + ' && echo "$MODEL"'], capture_output=True, text=True, env=environment(), timeout=600
    )
    assert out.returncode == 0 and out.stdout.strip() == str(real_model), out
    return real_model


def wait_healthy(proc: subprocess.Popen, port: int, log: pathlib.Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited (rc={proc.returncode}):\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"the server did not answer /health within {STARTUP_S} s:\n{log.read_text()[-6000:]}")


def wait_for(log: pathlib.Path, pattern: str, timeout: float) -> re.Match | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found:
            return found
        time.sleep(0.5)
    return None


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    """The quick start's server, the "see it work" commands' output, the log after them and after SIGTERM."""
    port = free_port()
    log = tmp_path_factory.mktemp("quickstart-log") / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            ["bash", "-c", as_written("quickstart:server", port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environment(),
            start_new_session=True,  # its own process group: SIGTERM to all of it, as a service manager sends it
        )
    try:
        wait_healthy(server, port, log)
        asked = subprocess.run(
            ["bash", "-c", as_written("quickstart:see-it-work", port)],
            capture_output=True,
            text=True,
            env=environment(),
            timeout=300,
        )
        stats_line = wait_for(log, r"KV Transfer metrics: [^\n]*vllm:triton_offload_hit_blocks=(\d+)", 30)
        hit_rate = wait_for(log, r"External prefix cache hit rate: ([0-9.]+)%", 5)
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the server did not stop within 60 s of SIGTERM:\n{log.read_text()[-4000:]}"
            ) from None
        yield {"asked": asked, "stats": stats_line, "hit_rate": hit_rate, "log": log.read_text(errors="replace")}
    finally:
        kill_group(server)
        server.wait()


def test_see_it_work_answers_as_documented(served):
    asked = served["asked"]
    assert asked.returncode == 0, asked.stderr
    lines = asked.stdout.splitlines()
    answers = [line for line in lines if line.startswith(('"content"', '"cached_tokens"', '{"success"'))]
    assert len(answers) == 5, asked.stdout
    print("\n".join(answers))  # the answer and the cached tokens, cold then from the host (pytest -s shows them)
    cold, hit = answers[0], answers[3]
    assert answers[1:3] + answers[4:] == ['"cached_tokens":0', '{"success":true}', '"cached_tokens":256'], asked.stdout
    assert cold == hit and "Paris" in cold, f"the answers differ or miss the point: {cold} / {hit}"
    assert f"Both answers are `{cold}`" in README.read_text(), f"the README no longer shows the answer {cold}"
    metrics = {}
    for line in lines:
        found = re.match(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([0-9.e+]+)$", line)
        if found:
            metrics[found.group(1) + ("{host}" if 'source="host"' in (found.group(2) or "") else "")] = float(
                found.group(3)
            )
    assert metrics == {
        "vllm:triton_offload_hit_blocks_total": HOST_BLOCKS_HIT,
        "vllm:external_prefix_cache_hits_total": 256,
        "vllm:prompt_tokens_cached_by_source_total{host}": 256,
    }, asked.stdout
    readme = README.read_text()
    for documented in (
        f"vllm:triton_offload_hit_blocks_total {HOST_BLOCKS_HIT}.0",
        "vllm:external_prefix_cache_hits_total 256.0",
        'source="host"} 256.0',
    ):
        assert documented in readme, f"the README no longer says {documented!r}"


def test_the_server_logs_the_documented_line(served):
    assert served["stats"] is not None, "no 'KV Transfer metrics: ... vllm:triton_offload_hit_blocks=' line"
    assert int(served["stats"].group(1)) == HOST_BLOCKS_HIT
    assert served["hit_rate"] is not None and float(served["hit_rate"].group(1)) > 0
    assert f"KV Transfer metrics: ... vllm:triton_offload_hit_blocks={HOST_BLOCKS_HIT}" in README.read_text()


def test_sigterm_logs_the_workers_transfer_totals(served):
    found = re.search(r"triton-offload worker totals: (\{[^}]*\})", served["log"])
    assert found, "no worker totals in the log after SIGTERM"
    totals = eval(found.group(1), {})  # noqa: S307 - our own log line: a dict literal
    assert totals["load_jobs"] == 1 and totals["loaded_bytes"] > 0 and totals["store_jobs"] >= 1


def test_a_misspelt_key_stops_the_server_before_the_model_loads(model):
    """The quick start's server command with ``eviction_polcy``: refused in the front end, naming the key it
    misspells, before any engine process starts (so before the model loads: ~15 s, not ~1 min and a long
    traceback)."""
    port = free_port()
    script = as_written("quickstart:server", port).replace('"block_size": 64', '"eviction_polcy": "arc"')
    assert "eviction_polcy" in script
    t0 = time.monotonic()
    out = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env=environment(), timeout=300, start_new_session=True
    )
    seconds = time.monotonic() - t0
    log = out.stdout + out.stderr
    assert out.returncode != 0
    assert "'eviction_polcy' (did you mean 'eviction_policy'?)" in log, log[-4000:]
    assert "Starting to load model" not in log and "EngineCore" not in log, "an engine process started"
    assert seconds < 120, f"refused after {seconds:.0f} s"
