"""End to end: vLLM's ``p2p`` tier (NIXL over UCX's TCP transport, ZMQ control) between engine processes on loopback,
every engine with ``TritonTieringOffloadingSpec``: a consumer gets a producer's prefix from the producer's CPU tier,
and falls back to computing it when the peer is refused, absent, or killed in the middle of the fetch.

Every engine's tier is docs/tiering.md's loopback recipe, read from the page (``P2PTier``: vLLM's p2p tier with NIXL's
progress thread paused and 0.33's ZMQ linger), on a port of its own; A3 runs it with a test-only stall
(tests/e2e/vllm_p2p_tiers.py). Engines (tests/e2e/vllm_tiering_driver.py, one process each; each binds a port the kernel
picked, retried if lost):

- A1 (chunk = 1 GPU block) and A3 (chunk = 3 GPU blocks) serve prompts cold, so that our worker stores them into
  their CPU tier, print their tokens, and keep serving peers, the driver stepping their engine every 10 ms, until
  told to stop. Every engine here is vLLM's in-process engine (``IN_PROCESS`` says why).
- C1 (chunk = 1), fresh, the same weights with another RoPE base (vLLM's ``hf_overrides``): prompt 1 from A1, refused
  at the handshake by the configuration fingerprint naming the field (issue 62), so computed.
- B1 (chunk = 1), fresh: prompt 1 from A1 (a hit over p2p); prompt 2 from A3, whose chunk size differs (refused at
  the handshake, so computed); prompt 4 from a port nobody listens on (computed).
- B3 (chunk = 3), fresh: prompt 1 from A3 (a hit); then prompt 3 from A3 with a ``kv_request_id`` that A3 stalls on
  (tests/e2e/vllm_p2p_tiers.py): A3 has submitted its NIXL write to B3 when the test SIGKILLs its process group; B3
  must compute the prompt itself, promptly.

The consumers' failing requests come after their successful ones on purpose: vLLM's p2p tier (0.32) can lose its
other sessions ~10-16 s after it tried a peer that refused the connection (a ZMQ monitor closed under a lingering
DEALER; see docs/tiering.md), and a lookup waiting on such a session never ends.

Every engine runs the real model (SmolLM2-135M-Instruct) on real text: every request's greedy tokens, so its text,
must equal those A1 computed cold (a wrong byte loaded changes them); hits are
counted by vLLM (cached tokens, ``source=p2p``) and by our workers' totals; every engine's ``/dev/shm`` files are
gone once it has exited or been killed.
"""

from __future__ import annotations

import json
import pathlib
import threading
import time
from collections.abc import Sequence

import pytest
from doc_recipes import recipe_env, recipe_json
from vllm_harness import (
    GPU_BLOCK,
    TIERING_DRIVER,
    TIERING_RESULT,
    Background,
    assert_shm_released,
    free_port,
    require_engine,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, *require_engine("vllm.v1.kv_offload.tiering.p2p.manager")]
pytest.importorskip("nixl._api", reason="the p2p tier needs NIXL: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1")

# UCX's TCP transport on loopback only: nothing leaves this machine, and no shared-memory transport files.
UCX_ENV = recipe_env("p2p-env")  # the recipe's: {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
# vLLM's in-process engine. With a p2p tier, vLLM's multiprocess engine core steps back to back for as long as it
# lives (the tier always reports pending work, to be polled), its worker spinning on the step queue: about two cores
# here. For the same reason it never finishes a graceful shutdown: vLLM kills it after
# VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, before its workers shut down, leaving vLLM's own queues in /dev/shm.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
HIT = 192  # 6 GPU blocks of 32 tokens; vLLM recomputes the last prompt token
FALLBACK_BOUND_S = 30.0  # a refused, absent or killed peer costs a request at most this (measured: under 1 s)
STARTUP_S = 300
# C1's model: the same weights and path with another RoPE base (vLLM's hf_overrides), as an edited config.json gives:
# the same chunk length, another configuration fingerprint (issue 62).
STALE_ROPE = {"rope_parameters": {"rope_theta": 100.0, "rope_type": "default"}}  # SmolLM2's theta is 100000


# docs/tiering.md's loopback recipe, read from the page: the tier entry and a request's kv_transfer_params.
RECIPE_TIER, RECIPE_REQUEST = recipe_json("p2p-tier"), recipe_json("p2p-request")
# The producer that must die mid-fetch runs the recipe's tier with a test-only stall (tests/e2e/vllm_p2p_tiers.py).
STALLING = {"type": "TestP2PTier", "module_path": "vllm_p2p_tiers"}


def tier(port: int, *, stalls: bool = False) -> list[dict]:
    """The recipe's tier entry on ``port`` (with the test-only stall for the producer that is killed mid-fetch)."""
    return [{**RECIPE_TIER, "port": port, **(STALLING if stalls else {})}]


def fetch(prompt: int, kv_request_id: str, port: int) -> dict:
    """A request whose prefix comes from the engine at 127.0.0.1:``port`` (vLLM's symmetric p2p): the recipe's
    ``kv_transfer_params`` with this request's id and the peer's port."""
    source = {**RECIPE_REQUEST["remote_kv_source"], "kv_request_id": kv_request_id, "remote_port": port}
    return {"prompt": prompt, "kv_transfer_params": {"remote_kv_source": source}}


def start(
    name: str,
    model: pathlib.Path,
    block_size: int,
    requests: list[dict],
    tmp: pathlib.Path,
    *,
    serve: bool,
    env: dict,
    stalls: bool = False,
    extra: Sequence[str] = (),
) -> tuple[Background, dict, int]:
    """Starts an engine with a p2p tier on a fresh port (the driver's other arguments: ``extra``) and waits for its
    result; returns it with the port.

    A port the kernel handed out can be taken by someone else before the engine binds it: then the engine fails to
    start ("Address already in use") and another port is tried.
    """
    for attempt in range(3):
        port = free_port()
        args = [
            "--model",
            str(model),
            "--block-size",
            str(block_size),
            "--tiers",
            json.dumps(tier(port, stalls=stalls)),
        ]
        args += ["--requests", json.dumps(requests), *extra]
        if serve:
            args += ["--serve-until", str(tmp / f"{name}.stop")]
        engine = Background(TIERING_DRIVER, args, tmp / f"{name}-{attempt}.log", env={**UCX_ENV, **env})
        try:
            return engine, engine.result(TIERING_RESULT, STARTUP_S), port
        except AssertionError:
            engine.stop()
            if "Address already in use" not in engine.log() or attempt == 2:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def run(real_model, tmp_path_factory):
    """The five engines' results (the scenario above), each with its log and ``/dev/shm`` files."""
    tmp = tmp_path_factory.mktemp("p2p")
    marker = tmp / "stalled"
    env = {"P2P_STALL_MARKER": str(marker), **IN_PROCESS}
    prompts = [{"prompt": p} for p in (1, 2, 3, 4)]
    engines = []
    try:
        a1, a1_out, a1_port = start("A1", real_model, GPU_BLOCK, prompts, tmp, serve=True, env=env)
        engines.append(a1)
        a3, a3_out, a3_port = start("A3", real_model, 3 * GPU_BLOCK, prompts[:3], tmp, serve=True, env=env, stalls=True)
        engines.append(a3)
        dead_port = free_port()  # nobody listens there
        # C1 before B1: a vLLM 0.32 producer whose consumer has exited after a NIXL transfer no longer accepts new
        # connections (A1 after B1, seen here), while one that refused a consumer still serves the next (A3, B1, B3).
        stale = ["--engine", json.dumps({"hf_overrides": STALE_ROPE})]
        c1, c1_out, _ = start("C1", real_model, GPU_BLOCK, [fetch(1, "c1-1", a1_port)], tmp, serve=False, env=env,
                              extra=stale)  # fmt: skip
        engines.append(c1)
        assert c1.wait(120) == 0

        b1_requests = [fetch(1, "b1-1", a1_port), fetch(2, "b1-2", a3_port), fetch(4, "b1-4", dead_port)]
        b1, b1_out, _ = start("B1", real_model, GPU_BLOCK, b1_requests, tmp, serve=False, env=env)
        engines.append(b1)
        assert b1.wait(120) == 0
        (tmp / "A1.stop").touch()
        assert a1.wait(120) == 0, "A1 did not exit when told to"

        killed = {}

        def kill_a3_when_it_stalls():
            deadline = time.monotonic() + STARTUP_S + 60
            while not marker.exists() and time.monotonic() < deadline and not killed.get("give_up"):
                time.sleep(0.02)
            if marker.exists():
                # The time before the kill: the signal leaves after it, so a request still waiting on A3 ends after it.
                # (Taken after stop() returned, once in a CI run it was 1.4 ms past the end of a request that had
                # already noticed A3 was gone and computed its prompt.)
                killed.update(at=time.monotonic(), kv_request_id=marker.read_text())
                a3.stop()  # SIGKILL to A3's whole process group

        killer = threading.Thread(target=kill_a3_when_it_stalls, daemon=True)
        killer.start()
        b3_requests = [fetch(1, "b3-1", a3_port), fetch(3, "stall-b3-3", a3_port)]
        try:
            b3, b3_out, _ = start("B3", real_model, 3 * GPU_BLOCK, b3_requests, tmp, serve=False, env=env)
            engines.append(b3)
            assert b3.wait(120) == 0
        finally:
            killed["give_up"] = True
            killer.join(10)
        assert "at" in killed, "A3 never stalled in a fetch: the kill scenario did not run"
        logs = {name: engine.log() for name, engine in zip(("A1", "A3", "C1", "B1", "B3"), engines)}
        yield {
            "A1": {**a1_out, "log": logs["A1"]},
            "A3": {**a3_out, "log": logs["A3"], "killed": killed},
            "B1": {**b1_out, "log": logs["B1"]},
            "C1": {**c1_out, "log": logs["C1"]},
            "B3": {**b3_out, "log": logs["B3"]},
        }
    finally:
        for engine in engines:
            engine.stop()


def tokens(result: dict) -> dict[int, list[int]]:
    return {r["prompt"]: r["tokens"] for r in result["requests"]}


def test_producers_computed_the_prompts_cold_with_one_set_of_tokens(run):
    a1, a3 = run["A1"], run["A3"]
    assert all(r["cached"] == 0 for r in a1["requests"] + a3["requests"])
    assert {p: t for p, t in tokens(a1).items() if p in tokens(a3)} == tokens(a3), "the chunk size changed tokens"


# found: chunks the consumer's p2p lookups found at its peers over its life (6 of 1 GPU block for B1; 2 of 3 for B3,
# whose stalled request found its 2 chunks too before the fetch failed).
@pytest.mark.parametrize("consumer,found", [("B1", 6), ("B3", 2 + 2)], ids=["f1", "f3"])
def test_a_consumer_gets_the_producers_prefix_over_p2p_with_its_tokens(run, consumer, found):
    b = run[consumer]
    first = b["requests"][0]
    assert first["prompt"] == 1 and first["cached"] == HIT, f"{consumer} should fetch all 6 GPU blocks from its peer"
    assert first["tokens"] == tokens(run["A1"])[1], "greedy tokens differ: the KV fetched is not the producer's"
    assert first["text"] and first["text"] == run["A1"]["requests"][0]["text"]
    metrics = b["metrics"]
    assert metrics["vllm:prompt_tokens_cached_by_source{source=p2p}"] == HIT
    assert metrics["vllm:kv_offload_tiering_chunk_hits{tier=1:P2PTier}"] == found
    # Fetched into the CPU tier by NIXL, then to the GPU by our kernel: one load job of 6 GPU blocks, nothing else.
    assert "'load_jobs': 1," in b["log"] and f"'loaded_bytes': {6 * b['block_bytes']}," in b["log"]


def test_a_peer_with_another_chunk_size_is_refused_and_nothing_of_it_is_loaded(run):
    b1 = run["B1"]
    refused = b1["requests"][1]
    assert refused["prompt"] == 2 and refused["cached"] == 0
    assert refused["tokens"] == tokens(run["A1"])[2]
    rejections = [line for line in b1["log"].splitlines() if "rejecting peer connect: block_len mismatch" in line]
    assert rejections, "B1 did not refuse A3's connect"
    assert f"remote={3 * b1['block_bytes']}, local={b1['block_bytes']}" in rejections[0]
    assert refused["seconds"] < FALLBACK_BOUND_S


def test_a_peer_of_another_configuration_is_refused_naming_the_field_and_nothing_of_it_is_loaded(run):
    """C1 (another RoPE base, same chunk length) asks A1 for prompt 1: the handshake is refused by the configuration
    fingerprint, naming the field, and C1 computes the prompt itself, which with its RoPE gives another answer than
    A1's (so A1's KV, loaded, would have been wrong)."""
    c1 = run["C1"]
    (refused,) = c1["requests"]
    assert refused["cached"] == 0, f"{refused['cached']} tokens of another configuration loaded"
    assert refused["tokens"] != tokens(run["A1"])[1], "the RoPE change must change the answer"
    logs = run["A1"]["log"] + c1["log"]
    rejections = [line for line in logs.splitlines() if "configuration fingerprint mismatch" in line]
    assert rejections, "no side refused the connect of another configuration"
    assert "rope" in rejections[0], rejections[0]
    assert refused["seconds"] < FALLBACK_BOUND_S


def test_a_peer_nobody_listens_for_falls_back_to_local_prefill(run):
    dead = run["B1"]["requests"][2]
    assert dead["prompt"] == 4 and dead["cached"] == 0
    assert dead["tokens"] == tokens(run["A1"])[4]
    assert dead["seconds"] < FALLBACK_BOUND_S


def test_a_producer_killed_mid_fetch_leaves_the_consumer_computing_the_prompt(run):
    """A3 had submitted its NIXL write (bytes may have landed in B3's CPU tier) but never confirmed it: B3 must not
    load them, and must not wait long."""
    b3 = run["B3"]
    stalled = b3["requests"][1]
    assert stalled["prompt"] == 3 and stalled["cached"] == 0
    assert stalled["tokens"] == tokens(run["A1"])[3]
    assert stalled["seconds"] < FALLBACK_BOUND_S
    killed = run["A3"]["killed"]
    assert killed["kv_request_id"] == "stall-b3-3", "A3 stalled in another fetch than this request's"
    assert stalled["span"][0] < killed["at"] < stalled["span"][1], "A3 was not killed while B3 waited on it"
    assert b3["metrics"]["vllm:kv_offload_tiering_promotion_job_failures{tier=1:P2PTier}"] == 1


def test_no_shm_file_outlives_its_engine(run):
    for name, result in run.items():
        # A3 was SIGKILLed: its region's guard process removes the name, asynchronously.
        assert_shm_released(result, name, wait_s=10)
