"""End to end: the integrity checks (docs/integrity.md) in real vLLM engines (CPU platform), with
``TritonOffloadingConnector`` reporting failed checks to vLLM as load errors.

Each engine runs several rounds of corrupt-then-request (tests/e2e/vllm_integrity_driver.py; an engine start costs about
20-60 s here): a bit flipped in a host block of ``TritonOffloadingSpec``'s host cache just before a load reads it; with
``TritonTieringOffloadingSpec``, block files of an ``fs`` tier changed in place (the same size: vLLM's fs tier cannot
tell them from good ones, and without the checks they change the tokens, see
``test_without_the_checks_a_same_size_corrupted_file_changes_the_tokens``), one bit of an object in an S3 server (moto,
on loopback), and a p2p producer whose CPU tier is changed before a consumer fetches from it
(tests/e2e/vllm_tiering_driver.py ``--scramble-region``). With ``kv_load_failure_policy = "recompute"`` every request
gives the tokens of an engine without offloading (its prompt's cold run); with ``"fail"`` the request fails and the log
names the request, the GPU and host blocks and the tier. The failed checks are counted, a failed block becomes a miss
(never loaded again), and intact blocks always load. The "recompute" engines of the host cache and of the fs and obj
tiers, and the engine without the checks, run the real model (SmolLM2-135M-Instruct) on real text: a corrupted block
gives exactly the cold run's text, and without the checks another text; the others run the tiny model.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import vllm_harness
from vllm_harness import GPU_BLOCK, require_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow, *require_engine()]

DRIVER = pathlib.Path(__file__).with_name("vllm_integrity_driver.py")
FAILED = "vllm:triton_offload_integrity_failed_blocks"
# What a consumer read from its peer. The tests below are about what happens to changed bytes once they arrive: a
# consumer that received none (its fetch missed: once in a CI run on a loaded 2-core machine, the request computed cold
# with cached 0) has not run the scenario, so a fresh consumer asks again, at most FETCH_ATTEMPTS times; whether a
# fetch hits at all is tests/e2e/test_vllm_p2p_e2e.py's subject.
P2P_READ = "vllm:kv_offload_tiering_read_bytes{tier=1:P2PTier}"
FETCH_ATTEMPTS = 3
UNCHECKED = "vllm:triton_offload_integrity_unchecked_blocks"
HAS_OBJ = all(importlib.util.find_spec(m) for m in ("nixl", "moto", "boto3"))
CHUNK = 2 * GPU_BLOCK  # the tiering engines' chunk: 2 GPU blocks, 3 chunks per prompt


def run(model, scenario: str, policy: str, *extra: str, timeout: int = 400) -> dict:
    args = ["--model", str(model), "--scenario", scenario, "--policy", policy, *extra]
    return vllm_harness.run_driver(DRIVER, args, "INTEGRITY_RESULT", timeout=timeout, env=vllm_harness.IN_PROCESS)


def rounds(result: dict) -> dict[str, dict]:
    return {r["label"]: r for r in result["rounds"]}


def fs_tier(root) -> dict:
    return {"type": "fs", "root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2}


# The "fail" engine's bucket: the "recompute" engine's objects (the same prompts, the same namespace) must not be
# there, or its first request would not be cold.
FAIL_BUCKET = "triton-offload-integrity-fail"


def s3_tier(endpoint: str, bucket: str | None = None) -> dict:
    from test_vllm_obj_e2e import obj_tier

    tier = obj_tier(endpoint)
    return tier if bucket is None else {**tier, "store_config": {**tier["store_config"], "bucket": bucket}}


@pytest.fixture(scope="module")
def host_recompute(real_model):
    return run(real_model, "host", "recompute")


@pytest.fixture(scope="module")
def host_fail(tiny_model):
    return run(tiny_model, "host", "fail")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    if not HAS_OBJ:
        yield None
        return
    import boto3
    from test_vllm_obj_e2e import BUCKET, client_args, start_s3_server

    server, endpoint = start_s3_server(tmp_path_factory.mktemp("s3") / "moto.log")
    try:
        client = boto3.client("s3", **client_args(endpoint))
        for bucket in (BUCKET, FAIL_BUCKET):
            client.create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        vllm_harness.kill_group(server)
        server.wait()


@pytest.fixture(scope="module")
def tiers_recompute(real_model, s3, tmp_path_factory):
    tiers = [fs_tier(tmp_path_factory.mktemp("fs") / "kv")]
    if s3 is not None:
        tiers.append(s3_tier(s3))
    return run(real_model, "tiers", "recompute", "--block-size", str(CHUNK), "--tiers", json.dumps(tiers))


def assert_cold_text(result: dict, *labels: str) -> None:
    """The real model's rounds ``labels`` wrote exactly their prompt's cold text (a real text, not empty)."""
    assert result["model"] == "real"
    r = rounds(result)
    cold = {x["prompt"]: x["text"] for x in reversed(result["rounds"])}  # each prompt's first round: its cold run
    for label in labels:
        assert r[label]["text"] and r[label]["text"] == cold[r[label]["prompt"]], (label, r[label], cold)


@pytest.fixture(scope="module")
def tiers_fail(tiny_model, s3, tmp_path_factory):
    tiers = [fs_tier(tmp_path_factory.mktemp("fs") / "kv")]
    if s3 is not None:
        tiers.append(s3_tier(s3, FAIL_BUCKET))
    return run(tiny_model, "tiers", "fail", "--block-size", str(CHUNK), "--tiers", json.dumps(tiers))


def failed_requests(log: str) -> list[str]:
    """The ERROR lines of failed checks, each naming the request, its GPU blocks and the blocks of the CPU tier."""
    return [line for line in log.splitlines() if "KV integrity check failed for request" in line]


def discarded_sources(log: str) -> list[str]:
    """The scheduler's lines naming each failed CPU tier block with the tier it was loaded from, '3 (from disk)'."""
    return [line for line in log.splitlines() if "failed their integrity check: their" in line]


def test_a_flipped_bit_in_a_host_block_is_recomputed_and_the_block_becomes_a_miss(host_recompute):
    """TritonOffloadingSpec, one engine: the prompt cold, then from the host cache (checked: every block), then with
    one bit of its second host block flipped just before the load reads it: the tokens are the cold ones (vLLM
    recomputed from that block on), the failed check is counted and logged; the block's key was dropped, so the
    next run loads the first block and recomputes and stores the rest, and the one after loads all of it again."""
    r = rounds(host_recompute)
    assert all(x["match"] and x["finish"] == "length" and not x["trigger_left"] for x in r.values()), r
    assert_cold_text(host_recompute, "intact", "corrupted", "after", "healed")
    assert [r[k]["cached"] for k in ("cold", "intact", "after", "healed")] == [0, 192, GPU_BLOCK, 192]
    metrics = host_recompute["metrics"]
    assert metrics[FAILED] == 1 and metrics[UNCHECKED] == 0
    log = host_recompute["log"]
    assert "KV integrity check failed for request" in log
    assert "1 block(s) loaded from the host cache do not match their checksum: GPU block" in log
    assert "from host cache block" in log and "vLLM recomputes them (kv_load_failure_policy = 'recompute')" in log
    assert "Recovered from KV load failure: 1 request(s) rescheduled" in log


def test_with_fail_the_request_fails_naming_the_block_and_the_tier(host_fail):
    """The same with kv_load_failure_policy = "fail": the corrupted request finishes with an error and no tokens,
    its log line names the request, the GPU block, the host cache block and the tier; the engine goes on, and the
    next requests get the cold tokens."""
    r = rounds(host_fail)
    assert r["corrupted"]["finish"] == "error" and r["corrupted"]["tokens"] == []
    assert all(r[k]["match"] for k in ("cold", "intact", "after", "healed"))
    assert r["after"]["cached"] == GPU_BLOCK and r["healed"]["cached"] == 192
    errors = [line for line in host_fail["log"].splitlines() if "KV integrity check failed for request" in line]
    assert len(errors) == 1 and " ERROR " in errors[0], errors
    assert "from host cache block 1" in errors[0] and "vLLM fails the request" in errors[0]
    assert "Failing 1 request(s) due to KV load failure" in host_fail["log"]
    assert host_fail["metrics"][FAILED] == 1


def test_a_same_size_corrupted_fs_file_is_recomputed(tiers_recompute):
    """TritonTieringOffloadingSpec with an fs tier: the prompt's 3 block files are promoted and checked intact; then,
    changed in place (same size), the request gets the cold tokens, each chunk's changed block fails its check, the
    log says they
    came from the disk tier, and their keys now miss: the next request computes the prompt again rather than load
    the same bad bytes (vLLM's CPU tier cannot drop a chunk; docs/integrity.md)."""
    r = rounds(tiers_recompute)
    assert r["from_fs"]["cached"] == 192 and r["from_fs"]["match"]
    assert r["fs_corrupted"]["match"] and r["fs_again"]["match"]
    assert_cold_text(tiers_recompute, "from_fs", "fs_corrupted", "fs_again")
    assert r["fs_again"]["cached"] == 0
    assert all(c["size"] == tiers_recompute["corrupted"]["fs"][0]["size"] for c in tiers_recompute["corrupted"]["fs"])
    # The first 256 bytes of each file are in its chunk's first GPU block: 3 blocks fail (and one more object's).
    assert tiers_recompute["metrics"][FAILED] == 3 + (1 if HAS_OBJ else 0)
    assert "loaded from the CPU tier do not match their checksum" in tiers_recompute["log"]
    assert "(from disk)" in tiers_recompute["log"] and "now miss" in tiers_recompute["log"]


@pytest.mark.skipif(not HAS_OBJ, reason="needs NIXL, moto and boto3 (the obj tier and its S3 server)")
def test_a_changed_object_in_the_s3_store_is_recomputed(tiers_recompute):
    """The same engine, a second prompt: once its chunks are objects (its files removed), one bit of one object is
    flipped in the store: the request gets the cold tokens and the failed block is counted."""
    r = rounds(tiers_recompute)
    assert r["cold2"]["cached"] == 0
    assert r["obj_corrupted"]["match"], r["obj_corrupted"]
    assert_cold_text(tiers_recompute, "obj_corrupted")
    assert tiers_recompute["corrupted"]["obj"]["offset"] == 100
    lines = [line for line in tiers_recompute["log"].splitlines() if "failed their integrity check" in line]
    assert len(lines) == 2, lines  # the fs round's and this one's


def test_with_fail_a_corrupted_fs_file_fails_the_request(tiers_fail):
    """kv_load_failure_policy = "fail": the request whose block files were changed fails (no tokens); the ERROR line
    names the request, each GPU block and the CPU tier block it was loaded from, and the scheduler's line names that
    block's tier of origin (the disk); the failed checks are counted; the next request recomputes."""
    r = rounds(tiers_fail)
    assert r["from_fs"]["cached"] == 192 and r["from_fs"]["match"]
    assert r["fs_corrupted"]["finish"] == "error" and r["fs_corrupted"]["tokens"] == []
    assert r["fs_again"]["match"] and r["fs_again"]["cached"] == 0
    errors = failed_requests(tiers_fail["log"])
    assert errors and all(" ERROR " in line and "from the CPU tier" in line for line in errors)
    assert all("GPU block " in line and "from CPU tier block " in line for line in errors), errors
    assert "(from disk)" in discarded_sources(tiers_fail["log"])[0]
    assert "Failing 1 request(s) due to KV load failure" in tiers_fail["log"]
    assert tiers_fail["metrics"][FAILED] >= 3


@pytest.mark.skipif(not HAS_OBJ, reason="needs NIXL, moto and boto3 (the obj tier and its S3 server)")
def test_with_fail_a_changed_object_in_the_s3_store_fails_the_request(tiers_fail):
    """The same engine, its second prompt from the objects alone: one bit of one object flipped in the S3 server,
    the request fails with the message; one more failed check is counted."""
    r = rounds(tiers_fail)
    assert r["cold2"]["cached"] == 0
    assert r["obj_corrupted"]["finish"] == "error" and r["obj_corrupted"]["tokens"] == [], r["obj_corrupted"]
    errors = failed_requests(tiers_fail["log"])
    assert len(errors) == 2 and all(" ERROR " in line and "from CPU tier block " in line for line in errors), errors
    assert len(discarded_sources(tiers_fail["log"])) == 2
    assert "Failing 1 request(s) due to KV load failure" in tiers_fail["log"]
    assert tiers_fail["metrics"][FAILED] == 3 + 1


def test_without_the_checks_a_same_size_corrupted_file_changes_the_tokens(real_model, tmp_path):
    """What the checks are for (issue 41): the same rounds with integrity = "off": the changed files are loaded as they
    are and the real model writes another text than the cold run's, with no error anywhere."""
    tiers = [fs_tier(tmp_path / "kv")]
    result = run(
        real_model, "tiers", "recompute", "--integrity", "off", "--block-size", str(CHUNK), "--tiers", json.dumps(tiers)
    )
    r = rounds(result)
    assert r["from_fs"]["match"] and r["from_fs"]["cached"] == 192
    assert_cold_text(result, "from_fs")
    assert r["fs_corrupted"]["cached"] == 192 and not r["fs_corrupted"]["match"]
    assert r["fs_corrupted"]["text"] != r["cold"]["text"], r["fs_corrupted"]
    assert "integrity check" not in result["log"]


@pytest.fixture(scope="module")
def p2p(tiny_model, tmp_path_factory):
    """A producer serves prompt 1 cold into its CPU tier, then has every chunk row of that tier changed in place
    (``--scramble-region``) and keeps serving peers; a fresh consumer fetches prompt 1 from it over p2p (NIXL, UCX's
    TCP transport on loopback: docs/tiering.md's recipe). Both run the checks (integrity = "verify") and vLLM's
    in-process engine (tests/e2e/test_vllm_p2p_e2e.py says why)."""
    pytest.importorskip("nixl._api", reason="the p2p tier needs NIXL")
    from test_vllm_p2p_e2e import IN_PROCESS, UCX_ENV, fetch, start, tier

    tmp = tmp_path_factory.mktemp("p2p")
    env = {**UCX_ENV, **IN_PROCESS}  # the consumers'; start() adds UCX_ENV to the producer's
    checked = ["--extra", '{"integrity": "verify"}', "--connector", "TritonOffloadingConnector"]
    # start() tries another port where the one it was handed is taken before the producer binds it.
    producer, a, port = start("A", tiny_model, GPU_BLOCK, [{"prompt": 1}], tmp, serve=True, env=IN_PROCESS,
                              extra=[*checked, "--policy", "recompute", "--scramble-region"])  # fmt: skip
    try:
        consumers = {}
        for name, policy in (("B", "recompute"), ("C", "fail")):
            for attempt in range(FETCH_ATTEMPTS):  # each a fresh engine: an empty CPU tier
                own = vllm_harness.free_port()
                args = ["--block-size", str(GPU_BLOCK), *checked, "--policy", policy, "--tiers", json.dumps(tier(own)),
                        "--requests", json.dumps([fetch(1, f"{name.lower()}-{attempt}", port)])]  # fmt: skip
                consumers[name] = vllm_harness.run_tiering(tiny_model, *args, env=env, timeout=300)
                (tmp / f"{name}{attempt}.log").write_text(consumers[name]["log"])  # kept for a failure
                if consumers[name]["metrics"].get(P2P_READ, 0) > 0:
                    break
            else:
                lines = [line for line in consumers[name]["log"].splitlines() if "P2P" in line or "p2p" in line]
                pytest.fail(f"consumer {name} never received the peer's blocks in {FETCH_ATTEMPTS} attempts; "
                            "the last one's p2p lines:\n" + "\n".join(lines[-30:]) +
                            f"\nthe producer A: {producer.state()}")  # fmt: skip
        (tmp / "A.stop").touch()
        assert producer.wait(120) == 0
        yield {"A": {**a, "log": producer.log()}, **consumers}
    finally:
        producer.stop()


def test_a_p2p_peers_corrupted_bytes_are_recomputed(p2p):
    """The consumer fetched the producer's (changed) chunks into its CPU tier and loaded them checked: every chunk
    failed, the request got the producer's cold tokens anyway (recomputed), the log says the blocks came over p2p,
    and the failed checks are counted."""
    a, b = p2p["A"], p2p["B"]
    assert a["scrambled_rows"] > 0 and a["requests"][0]["cached"] == 0
    (request,) = b["requests"]
    assert request["tokens"] == a["requests"][0]["tokens"], "the consumer's tokens differ from the producer's cold ones"
    log = b["log"]
    assert "loaded from the CPU tier do not match their checksum" in log
    assert "(from p2p)" in log and "now miss" in log
    assert b["metrics"][FAILED] > 0


def test_with_fail_a_p2p_peers_corrupted_bytes_fail_the_request(p2p):
    """A second consumer with kv_load_failure_policy = "fail" fetches the same changed chunks: its request fails with
    no tokens, the ERROR line names the request, the GPU blocks and the CPU tier blocks, the scheduler's line says they
    came over p2p, and the failed checks are counted."""
    (request,) = p2p["C"]["requests"]
    assert request["finish"] == "error" and request["tokens"] == [], request
    log = p2p["C"]["log"]
    errors = failed_requests(log)
    assert errors and all(" ERROR " in line and "GPU block " in line and "from CPU tier block " in line
                          for line in errors), errors  # fmt: skip
    assert "(from p2p)" in discarded_sources(log)[0]
    assert "Failing 1 request(s) due to KV load failure" in log
    assert p2p["C"]["metrics"][FAILED] > 0
