"""bench/micro/call_cost.py: the switching of the public calls' direct launch, the JSON a run killed part-way
leaves, and each row's ``launch`` (what its launches went through). The whole script runs in
tests/bench/test_bench_cpu.py."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from bench.micro import call_cost
from triton_offload import fast_launch
from triton_offload.issuers import factory
from triton_offload.issuers.launcher import CopyLauncher
from triton_offload.kernels import copy_blocks
from triton_offload.plan import Direction

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("prior", [None, "0", "1"], ids=["unset", "off", "on"])
def test_public_calls_switch_the_direct_launch_and_put_the_callers_setting_back(monkeypatch, prior):
    """Each call sees the switch asked for; afterwards the variable is as the caller had it (unset stays unset)."""
    env = call_cost.FAST_LAUNCH_ENV
    if prior is None:
        monkeypatch.delenv(env, raising=False)
    else:
        monkeypatch.setenv(env, prior)
    seen = []
    record = lambda *args: seen.append(os.environ.get(env))  # noqa: E731
    monkeypatch.setattr(call_cost, "to", SimpleNamespace(gather_blocks=record, scatter_blocks=record))
    s = SimpleNamespace(spec=None, g=None, host=None, h=None, device=torch.device("cpu"))
    for fast in (True, False):
        seen.clear()
        rows = call_cost.public_calls(s, 3, fast)
        assert seen == ["1" if fast else "0"] * 8  # the warm-up pair, then 3 timed calls of each
        assert len(rows) == 2 and all(r["calls"] == 3 for r in rows.values())
        # On CPU the public calls never launch directly, asked or not.
        want = "direct refused: not applicable" if fast else "triton dispatch"
        assert all(r["launch"].startswith(want) for r in rows.values()), rows
        assert os.environ.get(env) == prior


# -- what a run killed part-way leaves -------------------------------------------------------------------------------

FIRST, SECOND = "public steps", "engine submits, Triton's dispatch"  # the tiny run's measurements on CPU


def test_a_killed_run_leaves_the_measurements_it_finished(tmp_path):
    """SIGKILL as the second measurement starts (no handler, no cleanup can run): the JSON on disk holds the first
    one's rows, says the run is incomplete, and names what was done and what was left."""
    out = tmp_path / "cost.json"
    kill_in_second = (
        "import os, signal, sys\n"
        "from bench.micro import call_cost\n"
        "call_cost.engine_calls = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
        "call_cost.main(sys.argv[1:])\n"
    )
    args = ["--tiny", "--calls", "4", "--json", str(out)]
    proc = subprocess.run([sys.executable, "-c", kill_in_second, *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and "error" not in doc
    assert doc["done"] == [FIRST] and doc["left"] == [SECOND]
    assert list(doc["sections"]) == [FIRST]
    assert all(row["calls"] == 4 for row in doc["sections"][FIRST].values())
    assert not list(tmp_path.glob("*.tmp")), "the atomic write left its temporary file"
    # What was printed before the kill came out too (flushed per measurement).
    assert "check_host_buffer" in proc.stdout


def test_a_run_that_raises_says_where(tmp_path, monkeypatch):
    """An exception in the second measurement: the first one's rows are on disk, marked incomplete, with the error
    and the measurement it happened in; the exception still fails the run."""

    def broken(*args, **kwargs):
        raise RuntimeError("the lease ran out")

    monkeypatch.setattr(call_cost, "engine_calls", broken)
    out = tmp_path / "cost.json"
    with pytest.raises(RuntimeError, match="the lease ran out"):
        call_cost.main(["--tiny", "--calls", "4", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and doc["done"] == [FIRST] and doc["left"] == [SECOND]
    assert doc["error"] == f"{SECOND}: RuntimeError: the lease ran out"
    assert list(doc["sections"]) == [FIRST]


def test_a_finished_run_is_marked_complete(tmp_path):
    out = tmp_path / "cost.json"
    assert call_cost.main(["--tiny", "--calls", "4", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["done"] == [FIRST, SECOND] and doc["left"] == []
    assert "error" not in doc


# -- which launch each row went through ------------------------------------------------------------------------------


def runners(works: bool):
    """A ``make_runner`` for fast_launch.enable_fast_launch on CPU: its runners launch the interpreted kernel with the
    arguments they are given (``works``), or move nothing (the canary must refuse them); each call is counted."""

    def make(launcher, direction, copy=True):
        num_warps = launcher.config(direction).num_warps

        def run(programs, stream, args):
            make.calls[direction] = make.calls.get(direction, 0) + 1
            if works:
                copy_blocks.launch(programs, args, num_warps, False)

        return run

    make.calls = {}
    return make


def with_runners(monkeypatch, make) -> None:
    """The engine (its kernel launcher, from the issuer factory) and the benchmark prove the direct launch with
    ``make``'s runners (on CPU there is no compiled variant to launch directly)."""
    proving = functools.partial(fast_launch.enable_fast_launch, make_runner=make)
    monkeypatch.setattr(factory, "enable_fast_launch", proving)
    monkeypatch.setattr(call_cost, "enable_fast_launch", proving)


REFUSED = "direct refused: the direct launch of the {} wrote other bytes than Triton's launch on the canary"


@pytest.mark.parametrize("works", [True, False], ids=["proven", "refused"])
def test_the_launch_column_follows_the_canarys_verdict(monkeypatch, works):
    """Rows that asked for the direct launch say ``direct`` only where the canary proved it, and then their timed
    calls did go through it; where it refused it they say so, with its reason, and its runner is never called after
    the proof. Rows that did not ask say ``triton dispatch``."""
    make = runners(works)
    with_runners(monkeypatch, make)
    s = call_cost.setup(tiny=True)
    try:
        steps = call_cost.public_steps(s, 4, launches=True)
        after_proof = dict(make.calls)
        whole, traced = call_cost.engine_calls(s, 4, fast=True)
        dispatch, _ = call_cost.engine_calls(s, 4, fast=False)
    finally:
        s.cache.close()
    store, load = ("direct", "direct") if works else (REFUSED.format("store"), REFUSED.format("load"))
    assert steps["launch alone, direct"]["launch"] == store
    assert steps["enable_fast_launch (its verdict known)"]["launch"] == store
    assert steps["launch alone, Triton's dispatch"]["launch"] == "triton dispatch"
    assert steps["check_host_buffer"]["launch"] is None  # launches nothing
    assert whole["engine.submit_store, direct launch"]["launch"] == store
    assert whole["engine.submit_load, direct launch"]["launch"] == load
    assert all(r["launch"] == (store if ".submit_store" in k else load) for k, r in traced.items()), traced
    assert all(r["launch"] == "triton dispatch" for r in dispatch.values()), dispatch
    # One proof per direction (the engine's store reuses the verdict on the same variant); where proven, the timed
    # launches went through the runner: 4 alone, then per engine submit its warm-up and 4 more. Refused: none did.
    STORE, LOAD = Direction.STORE, Direction.LOAD
    if works:
        assert after_proof == {STORE: 1 + 4} and make.calls == {STORE: 1 + 4 + 5, LOAD: 1 + 5}, make.calls
    else:
        assert after_proof == {STORE: 1} and make.calls == {STORE: 1, LOAD: 1}, make.calls


@pytest.mark.parametrize("works", [None, True, False], ids=["never-asked", "proven", "refused"])
def test_the_public_calls_launch_is_the_verdict_their_spec_recorded(works):
    """On CUDA the public calls launch directly where the verdict recorded for their spec's variant (by the first call
    that asked, transfer.py) is a proven runner: the benchmark reads that verdict. Checked here on CPU tensors, with
    the benchmark told the device is CUDA; where no verdict was recorded it does not claim the direct launch."""
    s = call_cost.setup(tiny=True)
    try:
        for d in Direction:
            if works is not None:
                fast_launch.enable_fast_launch(CopyLauncher(s.spec, s.host, 1, d), make_runner=runners(works))
        as_cuda = SimpleNamespace(spec=s.spec, host=s.host, device=torch.device("cuda"))
        used = {d: call_cost.public_launch(as_cuda, d, fast=True) for d in Direction}
        assert all(call_cost.public_launch(as_cuda, d, fast=False) == "triton dispatch" for d in Direction)
    finally:
        s.cache.close()
    if works:
        assert used == {d: "direct" for d in Direction}
    elif works is None:
        assert all(v == "direct refused: never proven: no call asked for it" for v in used.values()), used
    else:
        assert used == {Direction.STORE: REFUSED.format("store"), Direction.LOAD: REFUSED.format("load")}


def test_on_cpu_no_row_claims_the_direct_launch(tmp_path):
    """Without CUDA nothing launches directly: the rows that ask for it say it was refused, and why; a whole run's
    rows never say ``direct``."""
    s = call_cost.setup(tiny=True)
    try:
        steps = call_cost.public_steps(s, 2, launches=True)
        whole, _ = call_cost.engine_calls(s, 2, fast=True)
        public = call_cost.public_launch(s, Direction.STORE, fast=True)
    finally:
        s.cache.close()
    cpu = "direct refused: not applicable: CPU tensors run through Triton's interpreter"
    assert steps["launch alone, direct"]["launch"] == cpu
    assert all(r["launch"] == cpu for r in whole.values()), whole
    assert public.startswith("direct refused: not applicable")
    out = tmp_path / "cost.json"
    assert call_cost.main(["--tiny", "--calls", "2", "--integrity", "--json", str(out)]) == 0
    rows = [r for sec in json.loads(out.read_text())["sections"].values() for r in sec.values()]
    assert rows and all("launch" in r and r["launch"] != "direct" for r in rows)
