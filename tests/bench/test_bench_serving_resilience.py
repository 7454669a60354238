"""One bad method cannot wipe the serving table (issue 56, item 2; the lease review of 2026-11-28, risk 2): on CPU at
tiny shapes, a method whose adapter raises (vllm_native's, or any other's) costs only its own row; a CUDA context that
dies in the second case leaves the first case's rows, table and targets in the JSON, and says where it died; a run
killed (or interrupted) after a row keeps that row, and after the first case that case's results, on disk.

The CPU check times nothing, and the targets are computed only where something was timed: :func:`fake_times` gives
each passing row made-up step and load times (the same per method), so that each case's targets are computed from
its rows and can be checked here. vLLM 0.33 is not importable here: vllm_native's stand-in is memcpy_batch's engine
behind vllm_native's name."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys

import pytest

from bench.baselines import METHODS, copies
from bench.common.env import Env
from bench.serving import cli as serving

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASE = ["--cpu-check", "--num-ctas", "4", "--rounds", "2"]
METHOD_ARGS = ["--methods", "none", "triton", "vllm033", "vllm_native"]
ONE_CASE = [*BASE, *METHOD_ARGS, "--workloads", "small-page", "--shapes", "decode-heavy"]
TWO_CASES = [*BASE, *METHOD_ARGS, "--workloads", "small-page", "--shapes", "decode-heavy", "prefill-heavy"]
POINTS = [("none", None), ("triton", 4), ("vllm033", None), ("vllm_native", None)]
MODES = ("async", "sync")
ILLEGAL = "CUDA error: an illegal memory access was encountered"

# Made-up times per method (ms, us): ours faster than the baselines, within 2 % of none.
_TIMES = {
    "none": dict(step=10.0),
    "triton": dict(step=10.1, latency=1.0, device=0.8, store_us=5.0, load_us=5.0),
    "vllm033": dict(step=10.4, latency=2.0, device=1.6, store_us=100.0, load_us=20.0),
    "vllm_native": dict(step=10.5, latency=2.2, device=1.7, store_us=90.0, load_us=25.0),
}


def _times(method: str) -> dict:
    t = _TIMES[method]
    step = {k: t["step"] for k in ("step_ms_mean", "step_ms_median", "step_ms_p90", "step_ms_p99",
                                   "load_steps_ms_mean", "other_steps_ms_mean")}  # fmt: skip
    if "latency" not in t:
        return {**step, "compute_ms_median": 9.0}
    return {**step, "compute_ms_median": 9.0, "load_latency_ms_median": t["latency"], "load_device_ms_median":
            t["device"], "store_submit_us_median": t["store_us"], "load_submit_us_median": t["load_us"],
            "submit_cpu_us_per_step": t["store_us"] + t["load_us"], "offload_gbps": 10.0}  # fmt: skip


def stand_in_native(setitem) -> None:
    """vllm_native's adapter builds memcpy_batch's engine (``setitem(METHODS, "vllm_native", ...)``: a MonkeyPatch's,
    or a plain assignment in a subprocess), so that it runs here, where vLLM 0.33 is not importable."""
    setitem(METHODS, "vllm_native", dataclasses.replace(METHODS["vllm_native"], engine=copies.batch_engine))


def fake_times(setattr) -> None:
    """Every passing row gets its method's made-up times (``setattr(serving, "_row", ...)``: a MonkeyPatch's, or
    the builtin in a subprocess)."""
    real = serving._row

    def row(setup, point, mode, device, args, impl, problem, runs, note=None):
        r = real(setup, point, mode, device, args, impl, problem, runs, note)
        if r["byte_check"] == "pass":
            r.update(_times(point.method))
        return r

    setattr(serving, "_row", row)


class _Faulty:
    """An engine that raises ``fail()``'s error at its second load submit, or at its shutdown (after shutting down)."""

    def __init__(self, engine, when: str, fail):
        self.engine, self.when, self.fail, self.loads = engine, when, fail, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit_load(self, job, gpu_ids, host_ids):
        self.loads += 1
        if self.when == "load" and self.loads == 2:
            self.fail()
        self.engine.submit_load(job, gpu_ids, host_ids)

    def shutdown(self):
        self.engine.shutdown()
        if self.when == "shutdown":
            self.fail()


def faulty_adapter(mp, method: str, error: BaseException, when: str, case: int | None = None, kills=False) -> None:
    """``method``'s serving adapter (bench.baselines.METHODS[method].engine, what build_engine calls) replaced by one
    whose engine raises ``error`` when it is built (``when="build"``), at its second load submit (``"load"``) or at
    its shutdown (``"shutdown"``): in every case, or only in the ``case``-th (one engine is built per case).
    ``kills``: the error leaves the CUDA context dead (Env.alive() is False from then on)."""
    base = METHODS[method]
    make = copies.batch_engine if method == "vllm_native" else base.engine
    built, dead = [0], [False]
    mp.setattr(Env, "alive", lambda self: not dead[0])

    def fail():
        dead[0] = kills
        raise error

    def engine(target, num_ctas):
        built[0] += 1
        armed = case is None or built[0] == case
        if armed and when == "build":
            fail()
        inner = make(target, num_ctas)
        return _Faulty(inner, when, fail) if armed else inner

    mp.setitem(METHODS, method, dataclasses.replace(base, engine=engine))


def _serve(tmp_path, argv, patch=None) -> tuple[int, dict]:
    out = tmp_path / "serving.json"
    with pytest.MonkeyPatch.context() as mp:
        fake_times(mp.setattr)
        stand_in_native(mp.setitem)
        if patch is not None:
            patch(mp)
        rc = serving.main([*argv, "--json", str(out)])
    return rc, json.loads(out.read_text())


def _rows(data: dict, shape: str) -> dict[tuple, dict]:
    return {(r["load_mode"], r["method"], r["num_ctas"]): r for r in data["rows"] if r["shape"] == shape}


def _target(targets: list[dict], name: str) -> dict:
    (t,) = [t for t in targets if t["name"] == name]
    return t


LOAD_VS = "triton@4: load time <= vllm033's and vllm_native's (sync: latency; async: device time)"
STEP = "triton@4: mean step time within 2% of none, async loads (every step)"


def _case_is_whole(data: dict, shape: str, index: int, failed: str | None = None) -> None:
    """Every point's row of ``shape`` in both modes (``failed``'s failed, the others passed with all their runs), and
    the case's entry: done, its rows counted, its targets from its own rows."""
    rows = _rows(data, shape)
    assert sorted(rows) == sorted((m, p, c) for m in MODES for p, c in POINTS), sorted(rows)
    for (_, method, _), r in rows.items():
        if method == failed:
            assert r["byte_check"] == "fail", r
            continue
        assert r["byte_check"] == "pass" and r["byte_check_note"] is None, r
        assert r["rounds"] == (3 if method == "none" else 2), r
        assert r["slowdown_vs_none"] is not None, r  # the relative columns were filled against none
    case = data["cases"][index]
    assert (case["workload"], case["shape"], case["status"], case["rows"]) == ("small-page", shape, "done", 8), case
    # The case's own targets: triton against none in both modes, against vllm033 (and vllm_native where it passed).
    assert _target(case["targets"], STEP)["cases"] == 1 and _target(case["targets"], STEP)["verdict"] == "PASS"
    load_vs = _target(case["targets"], LOAD_VS)
    assert load_vs["verdict"] == "PASS" and load_vs["cases"] == (2 if failed == "vllm_native" else 4), load_vs


@pytest.mark.parametrize(
    "method, error, when",
    [
        ("vllm_native", RuntimeError("vLLM's worker: no stream pool"), "build"),
        ("vllm_native", ImportError("cannot import name 'swap_blocks_batch' from 'vllm._custom_ops'"), "build"),
        ("vllm_native", RuntimeError(ILLEGAL), "load"),  # a CUDA error the context survives
        ("triton", RuntimeError("Triton Error [CUDA]: invalid argument"), "load"),
    ],
)
def test_a_method_that_raises_costs_only_its_own_rows(tmp_path, capsys, method, error, when):
    rc, data = _serve(tmp_path, ONE_CASE, lambda mp: faulty_adapter(mp, method, error, when))
    assert rc == 1  # the method's failure fails the run, which went on to the end
    assert data["complete"] and data["fatal"] is None and data["fatal_at"] is None
    rows = _rows(data, "decode-heavy")
    for mode in MODES:  # the method's failure, with its error, in each mode (its engine is built again for the next)
        r = rows[mode, method, 4 if method == "triton" else None]
        assert r["byte_check"] == "fail" and r["byte_check_note"] == f"ERROR: {type(error).__name__}: {error}", r
        assert r["step_ms_mean"] is None
    assert [(f["load_mode"], f["method"]) for f in data["failures"]] == [(m, method) for m in MODES]
    assert all(str(error) in f["byte_check_note"] for f in data["failures"])
    if method == "vllm_native":
        _case_is_whole(data, "decode-heavy", 0, failed=method)
        assert data["targets"] == data["cases"][0]["targets"]  # one case: the run's targets are the case's
    else:  # triton's targets have no case left; the others' rows are whole (vllm_native's own: n/a here)
        assert all(r["byte_check"] == "pass" for (_, m, _), r in rows.items() if m in ("none", "vllm033"))
        assert len(rows) == 8 and all(r["byte_check"] != "fail" for (_, m, _), r in rows.items() if m != "triton")
        assert _target(data["cases"][0]["targets"], LOAD_VS)["verdict"] == "n/a"
    out = capsys.readouterr().out
    assert "small-page, decode-heavy: done" in out and "Targets (reported, not asserted)" in out


def test_an_engine_that_raises_at_shutdown_costs_no_row(tmp_path):
    error = RuntimeError("cudaFreeHost: driver shutting down")
    rc, data = _serve(tmp_path, ONE_CASE, lambda mp: faulty_adapter(mp, "vllm_native", error, "shutdown"))
    assert rc == 1 and data["complete"] and data["fatal"] is None
    _case_is_whole(data, "decode-heavy", 0)  # every row passed, vllm_native's too
    (failure,) = data["failures"]
    assert failure["method"] == "vllm_native" and failure["load_mode"] is None and failure["shape"] == "decode-heavy"
    assert failure["byte_check_note"] == f"ERROR at shutdown: RuntimeError: {error}"


def test_a_dead_cuda_context_in_the_second_case_keeps_the_first(tmp_path, capsys):
    """vllm_native's second load in the second case raises a sticky CUDA error: the first case's rows, table and
    targets stay; in the second, each point that ran in the load mode so far has its row (cut short: its runs until
    then), vllm_native's is the failure; the JSON says where it died, is not complete, and the exit status is 1."""
    fault = lambda mp: faulty_adapter(mp, "vllm_native", RuntimeError(ILLEGAL), "load", case=2, kills=True)  # noqa: E731
    rc, data = _serve(tmp_path, TWO_CASES, fault)
    assert rc == 1 and not data["complete"]
    _case_is_whole(data, "decode-heavy", 0)
    assert ILLEGAL in data["fatal"] and "vllm_native on small-page" in data["fatal"]
    assert data["fatal_at"] == {"workload": "small-page", "shape": "prefill-heavy", "load_mode": "async",
                                "method": "vllm_native", "num_ctas": None, "round": 1, "during": "loop"}  # fmt: skip
    case = data["cases"][1]
    assert case["status"] == "fatal" and ILLEGAL in case["error"] and case["rows"] == 4
    rows = _rows(data, "prefill-heavy")
    assert sorted(rows) == sorted(("async", p, c) for p, c in POINTS)  # the sync mode never ran
    native = rows["async", "vllm_native", None]
    assert native["byte_check"] == "fail" and native["byte_check_note"].startswith("FATAL: the CUDA context died: ")
    for (_, method, _), r in rows.items():
        if method != "vllm_native":  # round 1 of 2 ran; none's closing run never did
            assert r["byte_check"] == "pass" and r["rounds"] == 1, r
            want = f"cut short: 1 of {3 if method == 'none' else 2} runs in this load mode; the run stopped at "
            assert r["byte_check_note"].startswith(want + "vllm_native, round 1: FatalCudaError: "), r
    # The second case's targets, from what it measured: triton vs none and vllm033 in its one mode.
    assert _target(case["targets"], LOAD_VS)["cases"] == 1 and _target(case["targets"], STEP)["cases"] == 1
    assert {(f["shape"], f["method"]) for f in data["failures"]} == {("prefill-heavy", "vllm_native")}
    out = capsys.readouterr().out
    assert out.count("Targets (reported, not asserted)") == 3  # each case's, then the run's
    assert "FATAL: the CUDA context is unusable after vllm_native on small-page" in out


def test_a_case_that_raises_costs_only_that_case(tmp_path, monkeypatch):
    """An error outside any method (here the second case's set-up), with the context alive: that case is recorded
    as stopped, with the error, and the run goes on to the next case."""
    real, calls = serving.setup_workload, []

    def setup(w, layout, shape, env, seed):
        calls.append(shape.name)
        if len(calls) == 2:
            raise MemoryError("pinned host cache: cudaHostAlloc failed")
        return real(w, layout, shape, env, seed)

    monkeypatch.setattr(serving, "setup_workload", setup)
    argv = [*BASE, "--methods", "none", "triton", "--workloads", "small-page", "llama3-8b"]
    rc, data = _serve(tmp_path, argv)
    assert rc == 1 and data["complete"] and data["fatal"] is None
    assert [(c["workload"], c["shape"]) for c in data["cases"]] == [tuple(c) for c in data["plan"]["cases"]]
    assert [c["status"] for c in data["cases"]] == ["done", "error", "done", "done"]
    stopped = data["cases"][1]
    assert stopped["error"] == "MemoryError: pinned host cache: cudaHostAlloc failed" and stopped["rows"] == 0
    assert len(data["rows"]) == 3 * 2 * 2 and all(r["byte_check"] == "pass" for r in data["rows"])
    (failure,) = data["failures"]
    assert (failure["workload"], failure["shape"]) == (stopped["workload"], stopped["shape"])
    assert failure["byte_check_note"] == f"ERROR: the case stopped: {stopped['error']}"


def test_each_row_is_on_disk_as_soon_as_it_is_done(tmp_path):
    """A run interrupted in the sync mode's second round, at triton (KeyboardInterrupt: nothing is caught, as under
    a kill) keeps every row finished before it: the async mode's, and vllm033's sync row, whose last run (the round
    runs in reverse) came before triton's. The file on disk is whole JSON, not complete."""
    out = tmp_path / "serving.json"
    seen = []

    class Interrupt(_Faulty):
        def submit_load(self, job, gpu_ids, host_ids):
            seen.append(job)
            if len(seen) == 3 * 4 + 1:  # 4 loads a run: async rounds 1 and 2, sync round 1, then sync round 2
                raise KeyboardInterrupt
            self.engine.submit_load(job, gpu_ids, host_ids)

    with pytest.MonkeyPatch.context() as mp:
        fake_times(mp.setattr)
        stand_in_native(mp.setitem)
        base = METHODS["triton"]
        mp.setitem(METHODS, "triton", dataclasses.replace(base, engine=lambda t, c: Interrupt(base.engine(t, c), "",
                                                                                               None)))  # fmt: skip
        with pytest.raises(KeyboardInterrupt):
            serving.main([*ONE_CASE, "--json", str(out)])
    data = json.loads(out.read_text())
    assert not data["complete"] and data["fatal"] is None
    rows = _rows(data, "decode-heavy")
    assert sorted(rows) == sorted([*(("async", p, c) for p, c in POINTS), ("sync", "vllm033", None)]), sorted(rows)
    assert all(r["byte_check"] == "pass" and r["rounds"] == (3 if r["method"] == "none" else 2) for r in rows.values())
    assert data["cases"] == [{"workload": "small-page", "shape": "decode-heavy", "status": "running", "error": None,
                              "rows": 0, "targets": []}]  # fmt: skip
    assert _target(data["targets"], LOAD_VS)["cases"] == 2  # the run's targets over the rows so far


_KILLED = """
import os, signal, sys
sys.path.insert(0, "tests/bench")
import test_bench_serving_resilience as t
from bench.serving import cli as serving
t.fake_times(setattr)
t.stand_in_native(lambda d, k, v: d.__setitem__(k, v))
real, cases = serving.setup_workload, []
def setup(*args):
    cases.append(args)
    if len(cases) == 2:  # the second case starts: killed, as the GPU runner kills a stage at its timeout
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args)
serving.setup_workload = setup
serving.main({argv!r})
"""


def test_a_run_killed_after_the_first_case_keeps_it(tmp_path):
    out = tmp_path / "serving.json"
    code = _KILLED.format(argv=[*TWO_CASES, "--json", str(out)])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == -9, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "small-page, decode-heavy: done" in proc.stdout and "Targets (reported, not asserted)" in proc.stdout
    data = json.loads(out.read_text())
    assert not data["complete"] and data["fatal"] is None
    _case_is_whole(data, "decode-heavy", 0)
    assert [c["status"] for c in data["cases"]] == ["done", "running"] and not _rows(data, "prefill-heavy")
    assert data["targets"] == data["cases"][0]["targets"]
    assert not (tmp_path / "serving.json.tmp").exists()
