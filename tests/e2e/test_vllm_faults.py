"""Faults end to end: a real vLLM engine (CPU platform) with a transfer failing on the worker, and a store the
manager cannot place.

Each scenario runs in a subprocess (tests/e2e/vllm_fault_driver.py) with the test-only spec of
tests/e2e/offload_fault_plugin.py, which records what the scheduler's manager and the worker did (one JSON line per
event) and injects the failure through the worker's documented test hook; nothing in the engine is edited.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import vllm_harness
from vllm_harness import assert_no_errors, require_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow, *require_engine()]

TESTS = pathlib.Path(__file__).parent
DRIVER = TESTS / "vllm_fault_driver.py"


def run_driver(scenario: str, tmp_path: pathlib.Path, *extra: str) -> dict:
    record = tmp_path / f"{scenario}.jsonl"
    record.unlink(missing_ok=True)  # the events of this run only (a reference run shares the name)
    # TRITON_OFFLOAD_FAULT is set by the driver itself, for the offloading engine only.
    env = {"TRITON_OFFLOAD_FAULT": None, "TRITON_OFFLOAD_FAULT_RECORD": str(record)}
    result = vllm_harness.run_driver(DRIVER, ["--scenario", scenario, *extra], "FAULT_RESULT", timeout=300, env=env)
    result["events"] = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return result


def events(result: dict, kind: str) -> list[dict]:
    return [e for e in result["events"] if e["kind"] == kind]


def tokens(result: dict) -> dict[str, list[int]]:
    return {p["label"]: p["tokens"] for p in result["probes"]}


@pytest.fixture(scope="module")
def tmp_module(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


def test_a_store_the_manager_cannot_place_changes_nothing_and_the_request_completes(tmp_module):
    """A 6-block prompt with 4 host blocks: every offer of its blocks gets None from prepare_store, which leaves the
    manager exactly as it was; the request completes with the tokens of an engine without offloading, nothing of it
    is ever stored or loaded, and a 3-block prompt afterwards is stored and loaded back as usual."""
    result = run_driver("no-room", tmp_module)
    reference = run_driver("no-room", tmp_module, "--no-offload")
    assert result["raised"] is None and reference["raised"] is None
    assert tokens(result) == tokens(reference)
    cached = {p["label"]: p["cached"] for p in result["probes"]}
    assert cached == {"long": 0, "long_again": 0, "short": 0, "short_from_host": 96}

    refused = [e for e in events(result, "prepare_store") if e["host_ids"] is None]
    assert refused, "the manager never refused a store: the scenario does not test what it says"
    assert all(e["unchanged"] for e in refused), "a refused prepare_store changed the manager's state"
    long_keys = {key for e in refused for key in e["keys"]}
    assert len(long_keys) == 6
    stored = {key for e in events(result, "complete_store") for key in e["keys"]}
    loaded = {key for e in events(result, "prepare_load") for key in e["keys"]}
    assert not long_keys & (stored | loaded)
    assert len(stored) == 3 and loaded == stored, "the short prompt was not stored and loaded back"
    assert "cannot store chunks" in result["log"], "vLLM did not see the refusal"
    assert_no_errors(result["log"])


@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_transfer_failing_on_the_worker_stops_the_engine_and_is_never_counted(direction, tmp_module):
    """The second store job (or the first load job) fails on the worker: vLLM stops with the worker's error naming
    the job; the worker never reports it as a success, so the scheduler never completes it (its keys are never
    cached, or never released as loaded), and nothing runs after it."""
    result = run_driver(f"fail-{direction}", tmp_module)
    assert result["raised"] and "EngineDeadError" in result["raised"], result["raised"]
    (injected,) = events(result, "injected")
    job = injected["job_id"]
    assert injected["direction"] == direction
    assert (
        f"triton-offload {direction} job {job} failed: RuntimeError('injected fault in {direction} job {job}')"
        in (result["log"])
    )
    assert [e["error"] for e in events(result, "worker_raised")] == [
        f"triton-offload {direction} job {job} failed: RuntimeError('injected fault in {direction} job {job}')"
    ]
    reported = [tuple(j) for e in events(result, "worker_reported") for j in e["jobs"]]
    assert all(ok for _, ok in reported), "a job was reported as failed instead of stopping the engine"
    assert job not in {j for j, _ in reported}, "the failed job was reported as a success"
    assert [p["label"] for p in result["probes"]] == ["first"], "the engine went on after the failure"

    (submitted,) = [e for e in events(result, "submit") if e["job_id"] == job]
    scheduled = events(result, f"prepare_{direction}")
    (job_keys,) = [e["keys"] for e in scheduled if e["host_ids"] == submitted["host_ids"]]
    completed = [set(e["keys"]) for e in events(result, f"complete_{direction}") if e.get("success", True)]
    assert not any(set(job_keys) & keys for keys in completed), "the scheduler counted the failed job's blocks"
    # The first prompt's store completed normally, so the records do show completions when they happen.
    assert events(result, "complete_store") and (0, True) in reported
