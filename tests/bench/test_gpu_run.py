"""`./dev gpu run`, the one command of a GPU lease (tools/gpu/: run.py, stages.py, summary.py), on CPU: stub
stages under a fake clock and a fake process runner for the scheduling, the packing and the ledger; the summary's
verdicts from made-up stage files; one real run of two small real stages; the pytest plugin that keeps finished
tests when a run is killed. Nothing here runs on a GPU or measures anything."""

from __future__ import annotations

import ast
import datetime
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET

import pytest

from bench.common import grid, results, targets
from bench.serving import report as serving_report
from tools.gpu import run, stages, summary

ROOT = pathlib.Path(__file__).resolve().parents[2]
SAFE = re.compile(r"[A-Za-z0-9._-]+")
DAY = datetime.date(2026, 11, 27)
# A lease that started at 09:30 UTC: its files are named <device>-<date>-0930-...
START = datetime.datetime(2026, 11, 27, 9, 30, 12, tzinfo=datetime.timezone.utc)


@pytest.fixture(scope="module")
def m():

    class M:
        pass

    mods = M()
    mods.run, mods.stages, mods.summary, mods.results, mods.targets = run, stages, summary, results, targets
    yield mods


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, dt: float) -> None:
        self.now += dt


class FakeProc:
    """A stage's command that takes ``seconds`` of the fake clock, then writes its files and exits with ``rc``."""

    def __init__(self, clock, behaviour, files):
        self.clock, self.b, self.files = clock, behaviour, files
        self.start, self.killed, self.ended = clock(), False, False

    def poll(self):
        if self.b.get("during"):
            self.b["during"](self.clock() - self.start)
        if self.clock() - self.start < self.b.get("seconds", 1.0):
            return None
        if not self.ended:
            self.ended = True
            self.b.get("writes", lambda files: None)(self.files)
        return self.b.get("rc", 0)

    def kill(self):
        self.killed = True


def stub_stages(m, kinds: dict[str, str], estimates: dict[str, float]):
    """Stages that run "stub NAME JSON XML PNG" (the fake spawn reads them), machine first, with these estimates."""
    return {
        name: m.stages.Stage(name, f"stub {name}", kind, (("stub", name, "{json}", "{xml}", "{plot}"),),
                             estimates.get(name, 5.0))
        for name, kind in kinds.items()
    }  # fmt: skip


def machine_json(files):
    pathlib.Path(files["json"]).write_text(
        json.dumps({"benchmark": "machine", "device": "Fake GPU 80GB", "cuda": True})
    )


class Harness:
    def __init__(self, m, tmp_path, kinds, behaviours, estimates, budget=300.0, chosen=None, ledger=None, spent=0.0):
        self.clock, self.procs, self.started = FakeClock(), {}, []
        ledger_path = tmp_path / "ledger.json"
        if ledger is not None:
            ledger_path.write_text(json.dumps(ledger))
        self.out, self.work = tmp_path / "out", tmp_path / "work"
        behaviours.setdefault("machine", {"seconds": 2.0, "writes": machine_json})

        def spawn(argv, log, env, cwd, echo):
            name = argv[1]
            files = {"json": argv[2], "xml": argv[3], "plot": argv[4]}
            self.started.append(name)
            pathlib.Path(log).write_text(f"log of {name}\n")
            self.procs[name] = FakeProc(self.clock, behaviours.get(name, {}), files)
            return self.procs[name]

        self.runner = m.run.Runner(
            self.out, budget_s=budget, chosen=chosen, spent_s=spent, work=self.work, ledger_path=ledger_path,
            stages=stub_stages(m, kinds, estimates), default=tuple(kinds), clock=self.clock, sleep=self.clock.sleep,
            spawn=spawn, root=tmp_path, started_at=START, out=open(os.devnull, "w"),
        )  # fmt: skip

    def run(self) -> int:
        return self.runner.run()

    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    def stage(self, name: str) -> dict:
        return next(s for s in self.summary()["stages"] if s["stage"] == name)

    def tar_names(self) -> list[str]:
        (tarball,) = self.out.glob("*.tar.gz")
        with tarfile.open(tarball) as tar:
            return tar.getnames()


KINDS = {"machine": "machine", "a": "transfer", "b": "transfer", "c": "transfer"}


def test_a_stage_that_does_not_fit_is_skipped_never_started(m, tmp_path):
    """Budget 300 s (10 kept for packing): machine ~2 s, a ~100 s, b ~200 s does not fit in the ~188 s left after a,
    c ~50 s still does."""
    h = Harness(m, tmp_path, KINDS, {"a": {"seconds": 100}, "c": {"seconds": 50}},
                {"machine": 2, "a": 100, "b": 200, "c": 50})  # fmt: skip
    assert h.run() == 0
    assert h.started == ["machine", "a", "c"]
    b = h.stage("b")
    assert b["outcome"] == "skipped" and "does not fit: needs ~200 s" in b["why"], b
    assert [h.stage(n)["outcome"] for n in ("machine", "a", "c")] == ["ok"] * 3
    assert h.summary()["complete"] is True


def test_the_install_counts_against_the_budget(m, tmp_path):
    """200 of the 300 s went to the install: a (~100 s) no longer fits, b (~50 s) does, then c (~50 s) does not."""
    h = Harness(m, tmp_path, KINDS, {"b": {"seconds": 50}}, {"machine": 2, "a": 100, "b": 50, "c": 50}, spent=200.0)
    h.run()
    assert h.started == ["machine", "b"]
    assert [h.stage(n)["outcome"] for n in ("a", "c")] == ["skipped", "skipped"] and h.summary()["install_s"] == 200.0


def test_a_timed_out_stage_is_killed_and_the_results_before_it_stay(m, tmp_path):
    def a_writes(files):
        pathlib.Path(files["json"]).write_text(json.dumps({"mode": "gpu", "rows": [], "complete": True}))

    h = Harness(m, tmp_path, KINDS, {"a": {"seconds": 10, "writes": a_writes}, "b": {"seconds": 10_000}},
                {"machine": 2, "a": 20, "b": 50, "c": 10})  # fmt: skip
    assert h.run() == 1  # a stage did not end ok
    assert h.procs["b"].killed and not h.procs["a"].killed
    b = h.stage("b")
    # b's timeout: twice its estimate (2 x 50 s), at least a minute.
    assert b["outcome"] == "timed out" and 100 <= b["seconds"] <= 101, b
    assert h.stage("a")["outcome"] == "ok" and h.stage("a")["figures"]["complete"] is True
    assert "fake-gpu-80gb-2026-11-27-0930-a.json" in h.tar_names()
    assert h.started == ["machine", "a", "b", "c"]  # c still fitted after b's 100 s
    ledger = json.loads((h.out / "gpu-ledger.json").read_text())
    assert ledger["stages"]["b"]["outcome"] == "timed out" and ledger["stages"]["a"]["outcome"] == "ok"


def test_a_sigterm_mid_stage_still_packs_everything(m, tmp_path):
    def a_writes(files):
        pathlib.Path(files["json"]).write_text(json.dumps({"mode": "gpu", "rows": []}))

    def term(elapsed):
        if elapsed >= 3:
            signal.raise_signal(signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    h = Harness(m, tmp_path, KINDS, {"a": {"seconds": 5, "writes": a_writes}, "b": {"seconds": 50, "during": term}},
                {"machine": 2, "a": 5, "b": 50, "c": 5})  # fmt: skip
    assert h.run() == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before  # the runner's handler is gone again
    assert h.procs["b"].killed and h.started == ["machine", "a", "b"]
    s = h.summary()
    assert s["complete"] is False and s["interrupted"] == "SIGTERM"
    assert [st["outcome"] for st in s["stages"]] == ["ok", "ok", "killed", "not started"]
    names = h.tar_names()
    assert "fake-gpu-80gb-2026-11-27-0930-a.json" in names and "fake-gpu-80gb-2026-11-27-0930-b.log" in names
    assert json.loads((h.out / "gpu-ledger.json").read_text())["stages"]["b"]["outcome"] == "killed"


def test_the_returned_files_are_at_most_seven_and_safely_named(m, tmp_path):
    kinds = {"machine": "machine", **{f"p{i}": "transfer" for i in range(6)}}

    def png(files):
        pathlib.Path(files["plot"]).write_bytes(b"\x89PNG fake")

    h = Harness(m, tmp_path, kinds, {f"p{i}": {"writes": png} for i in range(6)}, dict.fromkeys(kinds, 5))
    h.run()
    files = sorted(p.name for p in h.out.iterdir())
    assert len(files) == 7 and all(SAFE.fullmatch(f) for f in files), files
    assert [f for f in files if f.endswith(".png")] == [f"fake-gpu-80gb-2026-11-27-0930-p{i}.png" for i in range(4)]
    assert {"fake-gpu-80gb-2026-11-27-0930-p4.png", "fake-gpu-80gb-2026-11-27-0930-p5.png"} <= set(h.tar_names())
    assert all(SAFE.fullmatch(n) for n in h.tar_names())


def test_outdir_must_start_empty(m, tmp_path):
    h = Harness(m, tmp_path, KINDS, {}, dict.fromkeys(KINDS, 5))
    h.out.mkdir()
    (h.out / "old.json").write_text("{}")
    with pytest.raises(SystemExit, match="must be empty"):
        h.run()


# -- the ledger ------------------------------------------------------------------------------------------------------


def _entry(m, outcome, fp=None, seconds=None):
    return dict(dict.fromkeys(m.stages.ENTRY_KEYS), outcome=outcome, fingerprint=fp, seconds=seconds,
                date="2026-11-26", device="X")  # fmt: skip


def test_the_ledger_queues_never_run_then_not_ok_then_changed_stages(m):
    names = ("machine", "ok1", "changed", "never", "failed", "ok2", "killed")
    ledger = m.stages.new_ledger(dict.fromkeys(names))
    given = {"machine": ("ok", "f0"), "ok1": ("ok", "f1"), "failed": ("failed", "f3"), "changed": ("ok", "old"),
             "ok2": ("ok", "f5"), "killed": ("killed", "f6")}  # fmt: skip
    ledger["stages"].update({n: _entry(m, *v) for n, v in given.items()})
    fps = {"machine": "f0", "ok1": "f1", "never": "f2", "failed": "f3", "changed": "f4", "ok2": "f5", "killed": "f6"}
    planned = m.stages.order(ledger, fps, None, names)
    # A code change ranks after "never ran" and "not ok", whatever the priority says (issue 56).
    assert [n for n, _ in planned] == ["machine", "never", "failed", "killed", "changed", "ok1", "ok2"]
    why = dict(planned)
    assert why["never"] == "never ran" and why["changed"].startswith("code changed") and "failed" in why["failed"]
    # --stages: those, in the order given, machine first.
    assert [n for n, _ in m.stages.order(ledger, fps, ["ok2", "never"], names)] == ["machine", "ok2", "never"]


def test_measured_durations_replace_the_estimate(m):
    a, b = (m.stages.Stage(n, "", "transfer", (), 100.0) for n in "ab")
    ledger = m.stages.new_ledger(dict.fromkeys(("machine", "a", "b")))
    ledger["stages"]["a"] = _entry(m, "ok", "x", seconds=30.0)
    est_a = m.stages.estimate(a, ledger)
    assert (est_a.seconds, est_a.timeout_s) == (30.0, 60.0) and est_a.source.startswith("measured")
    est_b = m.stages.estimate(b, ledger)  # never ran: its own estimate, and twice that as its timeout
    assert (est_b.seconds, est_b.timeout_s) == (100.0, 200.0) and est_b.source.startswith("estimate")
    # A stage cut short last time is expected to take at least as long as it already ran.
    ledger["stages"]["b"] = _entry(m, "timed out", "x", seconds=150.0)
    assert m.stages.estimate(b, ledger).seconds == 150.0


def test_a_run_records_what_it_measured_and_the_next_plan_uses_it(m, tmp_path):
    kinds = {"machine": "machine", "a": "transfer"}
    h = Harness(m, tmp_path, kinds, {"a": {"seconds": 33}}, {"machine": 2, "a": 100})
    h.run()
    ledger = json.loads((h.out / "gpu-ledger.json").read_text())
    a = ledger["stages"]["a"]
    assert (
        a["outcome"] == "ok" and 33 <= a["seconds"] <= 34 and a["estimate_s"] == 100 and a["device"] == "Fake GPU 80GB"
    )
    stage = stub_stages(m, kinds, {"a": 100})["a"]
    assert a["fingerprint"] == m.stages.fingerprint(stage, tmp_path) and a["date"] == "2026-11-27"
    est = m.stages.estimate(stage, ledger)
    assert est.seconds == a["seconds"] and est.source.startswith("measured")


def test_merging_takes_the_newer_run_of_each_stage(m):
    names = dict.fromkeys(("machine", "a", "b"))
    committed, returned = m.stages.new_ledger(names), m.stages.new_ledger(names)
    committed["stages"]["a"] = dict(_entry(m, "ok", "x"), ran_at="2026-11-27T10:00:00+00:00", commit="c1")
    returned["stages"]["a"] = dict(_entry(m, "failed", "y"), ran_at="2026-11-27T09:00:00+00:00")  # older
    returned["stages"]["b"] = dict(_entry(m, "ok", "z"), ran_at="2026-11-27T11:00:00+00:00")
    merged, taken = m.stages.merge_ledgers(committed, returned, lambda name, e: f"filled-{name}")
    assert taken == ["b"] and merged["stages"]["a"]["commit"] == "c1" and merged["stages"]["b"]["commit"] == "filled-b"
    assert committed["stages"]["b"]["outcome"] == "never ran"  # the input is not modified


def test_the_committed_ledger_names_every_stage_and_reads_back(m):
    ledger = json.loads(m.stages.LEDGER_PATH.read_text())
    assert set(ledger["stages"]) == set(m.stages.STAGES)
    assert all(set(e) == set(m.stages.ENTRY_KEYS) for e in ledger["stages"].values())
    assert m.stages.load_ledger() == ledger


# -- fingerprints ----------------------------------------------------------------------------------------------------


def test_a_fingerprint_is_git_s_blob_hash_over_the_declared_files(m, tmp_path):
    (tmp_path / "lib" / "sub").mkdir(parents=True)
    (tmp_path / "lib" / "x.py").write_text("x = 1\n")
    (tmp_path / "lib" / "sub" / "y.py").write_text("y = 2\n")
    (tmp_path / "lib" / "notes.txt").write_text("not code\n")
    (tmp_path / "tool.py").write_text("t = 0\n")
    (tmp_path / "unrelated.py").write_text("q = 0\n")
    stage = m.stages.Stage("s", "", "transfer", (("{py}", "-m", "tool"),), 1.0, ("lib", "tool.py"))
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path, copy, ignore=shutil.ignore_patterns("copy"))
    fp = m.stages.fingerprint(stage, tmp_path)
    assert m.stages.fingerprint(stage, copy) == fp  # contents alone, wherever they are
    for unseen in ("unrelated.py", "lib/notes.txt"):
        (copy / unseen).write_text("changed\n")
        assert m.stages.fingerprint(stage, copy) == fp, unseen  # not declared, or not a .py file
    (copy / "lib" / "sub" / "y.py").write_text("y = 3\n")
    assert m.stages.fingerprint(stage, copy) != fp  # in a declared folder, at any depth
    if shutil.which("git"):
        out = subprocess.run(["git", "hash-object", str(tmp_path / "lib" / "x.py")], capture_output=True, text=True)
        assert m.stages.git_blob_hash(b"x = 1\n") == out.stdout.strip()


def test_every_benchmark_stage_fingerprints_the_bench_packages_it_imports(m):
    """A stage's fingerprint covers whole folders: the library, and each bench package its command's files import
    (read here from their import lines, at any depth), so a change to what a stage runs is never missed."""
    for stage in m.stages.STAGES.values():
        covered = {p.relative_to(ROOT).as_posix() for p in m.stages.stage_files(stage)}
        bench = {f for f in covered if f.startswith("bench/")}
        if stage.kind == "pytest" or not bench:
            continue
        found = (re.findall(r"^\s*(?:from|import) bench\.(\w+)", (ROOT / f).read_text(), re.M) for f in bench)
        imported = {f"bench/{pkg}/__init__.py" for pkgs in found for pkg in pkgs}
        assert imported <= covered, (stage.name, imported - covered)
        if stage.name != "machine":
            assert {"triton_offload/engine.py", "kernels/copy_blocks.py"} <= covered, stage.name
    assert not any(f.parts[-2] == "serving" for f in m.stages.stage_files(m.stages.STAGES["quick"]))
    machine = {p.relative_to(ROOT).as_posix() for p in m.stages.stage_files(m.stages.STAGES["machine"])}
    assert machine == {"tools/gpu/machine.py", "bench/common/results.py"}


# -- the stages ------------------------------------------------------------------------------------------------------


def test_the_stages_of_a_first_lease(m):
    # The call cost before serving: its figure is the one most likely to come back empty (issue 56).
    assert m.stages.DEFAULT_ORDER[:9] == ("machine", "gpu-tests", "call-cost", "serving", "quick", "launch-shape",
                                        "serving-shape", "host-memory", "gpu-tests-slow")  # fmt: skip
    core, vllm = m.stages.STAGES["gpu-tests"].steps
    slow = m.stages.STAGES["gpu-tests-slow"].steps[0]
    for t in m.stages.SLOW_TESTS:
        path, name = t.split("::")
        assert t in slow and path not in core + vllm
        funcs = {n.name for n in ast.walk(ast.parse((ROOT / path).read_text())) if isinstance(n, ast.FunctionDef)}
        assert name in funcs, f"{t} no longer exists: the stages would run or deselect nothing"
    # The library's GPU test files in the first process, vLLM's in the second, appended to the same XML.
    assert core[-len(m.stages.GPU_TESTS_CORE) :] == m.stages.GPU_TESTS_CORE and "--live-junit-append" not in core
    assert vllm[-len(m.stages.GPU_TESTS_VLLM) :] == m.stages.GPU_TESTS_VLLM and "--live-junit-append" in vllm
    for step in (core, vllm):
        assert step[step.index("--timeout") + 1] == "45" and "--live-junit" in step and "-m" in step
    assert m.stages.STAGES["gpu-tests"].keep_going
    serving = m.stages.STAGES["serving"].steps[0]
    assert serving[1:3] == ("-m", "bench.serving") and tuple(serving[3:5]) == m.stages.SERVING_DECISIVE


def test_every_test_stage_finds_its_plugins(m, tmp_path):
    """A pytest stage's command loads live_junit (from its PYTHONPATH) and pytest-timeout (--timeout): both must
    import in the stage's environment, or the stage fails before its first test."""
    runner = m.run.Runner(tmp_path / "out", ledger_path=tmp_path / "l.json")
    stages = [s for s in m.stages.STAGES.values() if s.kind == "pytest"]
    assert [s.name for s in stages] == ["gpu-tests", "gpu-tests-slow"]
    for stage in stages:
        for step in stage.steps:
            assert step[step.index("-p") + 1] == "live_junit" and "--timeout" in step
        probe = subprocess.run([sys.executable, "-c", "import live_junit, pytest_timeout"], env=runner._env(stage),
                               capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
        assert probe.returncode == 0, (stage.name, probe.stderr)


def test_the_quick_part_measures_auto_and_both_vllm_baselines():
    """bench_transfer.py --part quick restricts workloads and sizes, never methods: every baseline is timed, and the
    kernel with the integrity checks beside the kernel (issue 41)."""
    assert {"auto", "vllm033", "vllm_native", "peak"} <= set(results.BASELINE_ORDER)
    assert grid.PARTS["quick"] == ["--quick", "--integrity"]


def test_the_stages_measure_the_integrity_checks():
    """Issue 41's cost is measured by the next lease: the quick transfer stage (triton_integrity beside triton), the
    serving stage (the decisive preset, then triton_integrity) and the call-cost stage (the engine's submits with the
    checks)."""
    serving = stages.STAGES["serving"].steps[0]
    assert serving[3 : 3 + len(stages.SERVING_STAGE)] == stages.SERVING_STAGE and "--integrity" in stages.SERVING_STAGE
    assert "--integrity" in stages.STAGES["call-cost"].steps[0]
    assert stages.STAGES["quick"].steps[0][3:5] == ("--part", "quick")


def test_the_call_cost_stage_runs_fewer_calls_than_the_benchmark_s_default():
    """Issue 56: the call-cost stage runs fewer calls per row than the benchmark's default, to fit a first lease."""
    (cmd,) = stages.STAGES["call-cost"].steps
    calls = int(cmd[cmd.index("--calls") + 1])
    assert calls == stages.CALL_COST_STAGE_CALLS == 200 < grid.CALL_COST_CALLS


def test_stage_names_and_aliases(m):
    assert m.stages.resolve_stages("tests,quick") == ["gpu-tests", "gpu-tests-slow", "quick"]
    assert m.stages.resolve_stages(None) is None
    with pytest.raises(ValueError, match="unknown stage 'quik'; stages: machine, gpu-tests"):
        m.stages.resolve_stages("quik")


# -- the summary's verdicts ------------------------------------------------------------------------------------------


def _call_cost(worst_us: float) -> dict:
    names = ("gather_blocks", "scatter_blocks", "engine.submit_store", "engine.submit_load")
    med = dict(zip(names, (12.0, worst_us, 20.0, 18.0)))
    st = lambda us: {"median_us": us, "p20_us": us, "p80_us": us, "min_us": us}  # noqa: E731
    return {"benchmark": "call_cost", "shape": "1024 blocks x 80 layers", "sections": {
        "public calls": {f"{n}, {lab}": st(med[n] * k) for n in names[:2]
                         for lab, k in (("direct launch", 1), ("Triton's dispatch", 5))},
        "engine submits": {f"{n}, {lab}": st(med[n] * k) for n in names[2:]
                           for lab, k in (("direct launch", 1), ("Triton's dispatch", 5))}}}  # fmt: skip


def _transfer(results, frac_4: float, auto_ms: float, native_ms: float) -> dict:
    case = dict(workload="small-page", layout="kv_first", direction="load", page_bytes=2048, num_layers=32,
                blocks=128, blocks_per_host_block=4, skip=1, total_bytes=1 << 23, device="x",
                status="pass")  # fmt: skip
    medians = {("peak", None): 1.0, ("triton", 4): 1 / frac_4, ("triton", 16): 1.0, ("memcpy_batch", None): 6.0,
               ("auto", None): auto_ms, ("vllm033", None): 3.0, ("vllm_native", None): native_ms}  # fmt: skip
    rows = [results.new_row(**case, method=meth, num_ctas=c, median_ms=ms, gbps=8.388608 / ms)
            for (meth, c), ms in medians.items()]  # fmt: skip
    results.fill_relative(rows)
    return {"mode": "gpu", "complete": True, "default_num_ctas": 4, "rows": rows, "targets": []}


def _junit(path: pathlib.Path, cases: dict[str, tuple[str, str] | None], complete=True) -> None:
    suite = ET.Element("testsuite")
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="complete", value="true" if complete else "false")
    for tid, outcome in cases.items():
        path_, name = tid.split("::")
        case = ET.SubElement(suite, "testcase", file=path_, name=name)
        if outcome:
            ET.SubElement(case, outcome[0], message=outcome[1])
    ET.ElementTree(suite).write(path)


def _targets(m, tmp_path, docs: dict[str, tuple[str, object]]) -> dict[str, dict]:
    stages = []
    for name, (kind, doc) in docs.items():
        if kind == "pytest":
            _junit(tmp_path / f"{name}.xml", *doc)
            files = {"xml": tmp_path / f"{name}.xml"}
        else:
            (tmp_path / f"{name}.json").write_text(json.dumps(doc))
            files = {"json": tmp_path / f"{name}.json"}
        stages.append({"stage": name, "kind": kind, "outcome": "ok", "files": files})
    # Keyed by the target's key (bench/common/targets.py's for the transfer targets).
    return {t["key"]: t for t in m.summary.evaluate(stages)}


def test_verdicts_come_from_the_stage_files(m, tmp_path):
    ok = {"tests/a.py::t1": None, "tests/b.py::t2": None}
    # The serving benchmark's own targets (name, verdict), as its JSON carries them.
    cases = [serving_report.Case(0.01, "w1"), serving_report.Case(0.03, "w2")]
    serving_targets = [serving_report.target("step within 2%", cases, 0.02, relative=False)]
    t = _targets(m, tmp_path, {
        "gpu-tests": ("pytest", (ok,)),
        "gpu-tests-slow": ("pytest", ({"tests/c.py::t3": None},)),
        "call-cost": ("call-cost", _call_cost(worst_us=45.0)),
        "quick": ("transfer", _transfer(m.results, frac_4=0.80, auto_ms=2.5, native_ms=0.5)),
        "serving": ("serving", {"mode": "gpu", "targets": serving_targets}),
    })  # fmt: skip
    assert t["gpu-tests"]["verdict"] == "pass" and t["gpu-tests"]["worst"] == 0
    cc = t["call-cost"]
    assert cc["verdict"] == "miss" and cc["worst"] == 45.0 and cc["where"] == "scatter_blocks, direct launch", cc
    frac = t["peak"]
    assert (
        frac["verdict"] == "miss"
        and frac["worst"] == pytest.approx(0.8)
        and "small-page/kv_first 2048B" in frac["where"]
    )
    auto = t["auto"]  # 2.5 ms against the kernel's 1.25 and memcpy_batch's 6.0: 2x the faster
    assert auto["verdict"] == "miss" and auto["worst"] == pytest.approx(2.0) and "dma: memcpy_batch" in auto["where"]
    vs = t["vs-vllm"]  # vllm_native at 0.5 ms beats both ours
    assert vs["verdict"] == "miss" and vs["worst"] == pytest.approx(0.2) and vs["where"].endswith("auto vs vllm_native")
    serving = t["serving"]
    assert serving["target"] == "serving (serving): step within 2%"
    assert serving["verdict"] == "miss" and serving["worst"] == 0.03 and serving["where"] == "w2"


def test_a_serving_run_cut_short_gives_its_targets_and_says_where_it_stopped(m, tmp_path):
    """A serving JSON whose run was cut short (complete false: a CUDA context that died in its second case) still
    gives the targets over the rows it finished, each saying how many cases ended and where the context died; the
    stage's figures give each case's status."""
    cases = [serving_report.Case(1.05, "llama3-70b-tp8/decode-heavy/sync")]
    at = {"workload": "llama3-8b", "shape": "decode-heavy", "load_mode": "async", "method": "vllm_native",
          "num_ctas": None, "round": 1, "during": "loop"}  # fmt: skip
    doc = {"mode": "gpu", "complete": False, "fatal": "vllm_native on llama3-8b: RuntimeError: illegal address",
           "fatal_at": at, "plan": {"cases": [["llama3-70b-tp8", "decode-heavy"], ["llama3-8b", "decode-heavy"],
                                              ["llama3-8b", "prefill-heavy"]]},
           "cases": [{"workload": "llama3-70b-tp8", "shape": "decode-heavy", "status": "done"},
                     {"workload": "llama3-8b", "shape": "decode-heavy", "status": "fatal"}],
           "rows": [{"byte_check": "pass"}, {"byte_check": "fail"}], "failures": [{"method": "vllm_native"}],
           "targets": [serving_report.target("load within 1.15x", cases, 1.15)]}  # fmt: skip
    t = _targets(m, tmp_path, {"serving": ("serving", doc)})["serving"]
    assert t["target"] == "serving (serving): load within 1.15x" and t["verdict"] == "pass" and t["worst"] == 1.05
    assert t["detail"].endswith(f" [run cut short: 1 of 3 cases ended; the CUDA context died at {at}]"), t
    path = tmp_path / "serving.json"
    figures = m.summary.stage_figures("serving", {"json": path})
    assert figures["cases"] == {"llama3-70b-tp8/decode-heavy": "done", "llama3-8b/decode-heavy": "fatal"}
    assert figures["fatal_at"] == at and figures["failures"] == 1 and figures["not_pass"] == 1
    assert figures["own_targets"] == {"pass": 1} and figures["complete"] is False


def test_verdicts_pass_when_the_files_say_so(m, tmp_path):
    t = _targets(m, tmp_path, {
        "gpu-tests": ("pytest", ({"tests/a.py::t1": None},)),
        "gpu-tests-slow": ("pytest", ({"tests/b.py::t2": None},)),
        "call-cost": ("call-cost", _call_cost(worst_us=29.0)),
        "quick": ("transfer", _transfer(m.results, frac_4=0.95, auto_ms=1 / 0.95, native_ms=3.0)),
    })  # fmt: skip
    verdicts = {k: v["verdict"] for k, v in t.items()}
    unmeasured = ("shape-gain", "shape-loss", "vs-per-block", "integrity-cost", "cpu-cost", "gemm", "serving",
                  "integrity-host")  # fmt: skip
    assert verdicts == {
        **dict.fromkeys(
            ("gpu-tests", "call-cost", "peak-best", "peak", "vs-batch-small", "vs-batch", "vs-vllm", "auto"), "pass"
        ),
        **dict.fromkeys(unmeasured, "not measured"),
    }


@pytest.mark.parametrize(
    "frac_4, sized, gain, loss",
    [(0.75, 0.85, "pass", "pass"), (0.75, 0.78, "miss", "pass"), (0.95, 0.90, "not measured", "miss")],
    ids=["gains", "gains-too-little", "loses-where-the-default-was-fine"],
)
def test_the_size_aware_launch_shape_decision(m, tmp_path, frac_4, sized, gain, loss):
    doc = _transfer(m.results, frac_4=frac_4, auto_ms=1 / frac_4, native_ms=3.0)
    row = dict(next(r for r in doc["rows"] if r["method"] == "peak"), method="triton_size_aware", num_ctas=None)
    row.update(median_ms=1 / sized, gbps=8.388608 * sized)
    doc["rows"].append(row)
    m.results.fill_relative(doc["rows"])
    t = _targets(m, tmp_path, {"launch-shape": ("launch-shape", doc)})
    assert (t["shape-gain"]["verdict"], t["shape-loss"]["verdict"]) == (gain, loss), (t["shape-gain"], t["shape-loss"])
    (fig,) = m.summary.launch_shape(doc["rows"], 4)
    assert fig["fraction_size_aware"] == pytest.approx(sized)


@pytest.mark.parametrize(("cost_pct", "extra_us", "verdict"), [(1.5, 0.8, "pass"), (3.0, 1.4, "miss")],
                         ids=["within", "over"])  # fmt: skip
def test_the_integrity_checks_cost_targets(m, tmp_path, cost_pct, extra_us, verdict):
    """Issue 41's goal, from a transfer stage run with --integrity (triton_integrity beside triton at the default
    num_ctas, at 8 KiB pages) and the call-cost stage's submits with the checks; made-up numbers."""
    quick = _transfer(m.results, frac_4=0.95, auto_ms=1 / 0.95, native_ms=3.0)
    kernel = next(r for r in quick["rows"] if r["method"] == "triton" and r["num_ctas"] == 4)
    big = [dict(r, page_bytes=8192) for r in quick["rows"]]  # the same case at 8 KiB pages (>= the goal's 8 KiB)
    on = [dict(r, method="triton_integrity", num_ctas=None, gbps=r["gbps"] * (1 - cost_pct / 100))
          for r in (kernel, dict(kernel, page_bytes=8192))]  # fmt: skip
    quick["rows"] += big + on
    cc = _call_cost(worst_us=20.0)
    for call in ("engine.submit_store", "engine.submit_load"):
        us = cc["sections"]["engine submits"][f"{call}, direct launch"]["median_us"] + extra_us
        cc["sections"]["engine submits"][f"{call}, direct launch, integrity verify"] = {"median_us": us}
    t = _targets(m, tmp_path, {"quick": ("transfer", quick), "call-cost": ("call-cost", cc)})
    bandwidth, host = t["integrity-cost"], t["integrity-host"]
    assert bandwidth["verdict"] == verdict and bandwidth["worst"] == pytest.approx(cost_pct, abs=0.01), bandwidth
    assert "8192B" in bandwidth["where"] and bandwidth["from"] == ["quick"]  # the 2 KiB case is not the goal's
    assert host["verdict"] == verdict and host["worst"] == pytest.approx(extra_us), host
    assert host["where"].startswith("call-cost: engine.submit_")


_KEYS = ("peak-best", "peak", "shape-gain", "shape-loss", "vs-batch-small", "vs-batch", "vs-per-block", "vs-vllm",
         "auto", "integrity-cost", "cpu-cost", "gemm")  # fmt: skip
_MISSES = ("peak-best", "peak", "shape-gain", "vs-batch-small", "vs-vllm", "auto", "integrity-cost", "gemm")
VERDICTS_OF_BOTH = {0.95: {**dict.fromkeys(_KEYS, "PASS"), "shape-gain": "n/a"},
                    0.8: {k: "FAIL" if k in _MISSES else "PASS" for k in _KEYS}}  # fmt: skip


@pytest.mark.parametrize(
    "frac_4, auto_ms, native_ms, cost_pct, gemm_pct",
    [(0.95, 1 / 0.95, 3.0, 1.0, 2.0), (0.8, 2.5, 0.5, 3.0, 9.0)],
    ids=["all-pass", "misses"],
)
def test_both_summaries_give_the_same_verdicts_from_the_same_rows(m, tmp_path, frac_4, auto_ms, native_ms, cost_pct,
                                                                  gemm_pct):  # fmt: skip
    """The transfer targets are defined once (bench/common/targets.py): the transfer benchmark's own summary over a
    run's rows and extras, and the GPU run's over the JSON that run wrote, give every target the same text, verdict
    and worst case."""
    from bench.transfer import summary as bench_summary
    from triton_offload.kernels.shapes import DEFAULT_NUM_CTAS

    doc = _transfer(m.results, frac_4=frac_4, auto_ms=auto_ms, native_ms=native_ms)
    assert doc["default_num_ctas"] == DEFAULT_NUM_CTAS
    kernel = next(r for r in doc["rows"] if r["method"] == "triton" and r["num_ctas"] == 4)
    peak = next(r for r in doc["rows"] if r["method"] == "peak")
    sized, off = frac_4 + 0.01, 1 - cost_pct / 100
    doc["rows"] += [
        dict(peak, method="memcpy_per_block", impl=f"{m.results.PYTHON_ISSUED}: test", median_ms=30.0, gbps=0.28),
        dict(peak, method="triton_size_aware", median_ms=1 / sized, gbps=8.388608 * sized),
        *(dict(r, page_bytes=8192) for r in doc["rows"]),
        dict(kernel, page_bytes=8192, method="triton_integrity", num_ctas=None, gbps=kernel["gbps"] * off),
    ]
    m.results.fill_relative(doc["rows"])
    overhead = {k: {"median_us": us} for k, us in (("gather", 20.0), ("scatter", 30.0))}
    inter = {"rows": [{"method": "triton", "num_ctas": 4, "direction": d, "slowdown_pct": gemm_pct}
                      for d in ("store", "load")]}  # fmt: skip
    bench = bench_summary.evaluate_targets(doc["rows"], overhead, inter)
    gpu = _targets(m, tmp_path, {"quick": ("transfer", dict(doc, cpu_overhead=overhead, interference=inter))})
    assert [t["key"] for t in bench] == [t.key for t in m.targets.TARGETS]
    for t in bench:
        same = (t["target"], m.summary.VERDICTS[t["result"]], t["worst"])
        assert (gpu[t["key"]]["target"], gpu[t["key"]]["verdict"], gpu[t["key"]]["worst"]) == same, t
    verdicts = {t["key"]: t["result"] for t in bench}
    assert verdicts == VERDICTS_OF_BOTH[frac_4], verdicts


def test_the_call_cost_target_says_where_the_direct_launch_was_refused(m, tmp_path):
    """Issue 56: a row that asked for the direct launch but was refused by the canary measured Triton's dispatch. It
    still counts (it is what the default gives on that machine), and the verdict's place and detail say so; the
    stage's figures carry each row's launch and whether the run completed."""
    cc = _call_cost(worst_us=45.0)
    for sec in cc["sections"].values():
        for name, row in sec.items():
            row["launch"] = "direct" if "direct launch" in name else "triton dispatch"
    refused = "direct refused: the direct launch of the load wrote other bytes than Triton's launch on the canary"
    cc["sections"]["public calls"]["scatter_blocks, direct launch"]["launch"] = refused
    cc.update(complete=True, left=[])
    cc_target = _targets(m, tmp_path, {"call-cost": ("call-cost", cc)})["call-cost"]
    assert cc_target["verdict"] == "miss" and cc_target["worst"] == 45.0
    assert cc_target["where"] == f"scatter_blocks, direct launch (launch: {refused})", cc_target
    assert "the direct launch was not used in 1: scatter_blocks" in cc_target["detail"]
    fig = m.summary.stage_figures("call-cost", {"json": tmp_path / "call-cost.json"})
    assert fig["complete"] is True and fig["launch"]["scatter_blocks, direct launch"] == refused
    assert fig["launch"]["gather_blocks, direct launch"] == "direct"
    assert fig["median_us"]["scatter_blocks, direct launch"] == 45.0


def test_a_call_cost_run_cut_short_is_not_measured_and_says_why(m, tmp_path):
    """A call-cost JSON a killed run left (complete false): the calls it measured pass, the rest were never measured,
    so the target is not measured, naming what was left; a miss among what it measured is still a miss."""
    cc = _call_cost(worst_us=20.0)
    del cc["sections"]["engine submits"]
    left = ["engine submits, direct launch", "engine submits, Triton's dispatch"]
    cc.update(complete=False, left=left, error=None)
    t = _targets(m, tmp_path, {"call-cost": ("call-cost", cc)})["call-cost"]
    assert t["verdict"] == "not measured", t
    assert "only 2 of the 4 calls measured" in t["detail"] and ", ".join(left) in t["detail"], t
    cc["sections"]["public calls"]["gather_blocks, direct launch"]["median_us"] = 50.0
    assert _targets(m, tmp_path, {"call-cost": ("call-cost", cc)})["call-cost"]["verdict"] == "miss"
    fig = m.summary.stage_figures("call-cost", {"json": tmp_path / "call-cost.json"})
    assert fig["complete"] is False and fig["left"] == left


def test_the_integrity_host_cost_compares_only_like_launches(m, tmp_path):
    """Where the submit without the checks went direct and the one with them was refused (or the other way), their
    difference is the dispatch's, not the checks': that pair is left out, and said so."""
    cc = _call_cost(worst_us=20.0)
    subs = cc["sections"]["engine submits"]
    for call, on in (("engine.submit_store", "direct"), ("engine.submit_load", "direct refused: RuntimeError: x")):
        subs[f"{call}, direct launch"]["launch"] = "direct"
        us = subs[f"{call}, direct launch"]["median_us"] + 0.5
        subs[f"{call}, direct launch, integrity verify"] = {"median_us": us, "launch": on}
    host = _targets(m, tmp_path, {"call-cost": ("call-cost", cc)})["integrity-host"]
    assert host["verdict"] == "pass" and host["where"] == "call-cost: engine.submit_store", host
    assert "not compared where the two launched differently: call-cost: engine.submit_load" in host["detail"]
    subs["engine.submit_store, direct launch, integrity verify"]["launch"] = "direct refused: RuntimeError: x"
    host = _targets(m, tmp_path, {"call-cost": ("call-cost", cc)})["integrity-host"]
    assert host["verdict"] == "not measured" and "launched differently" in host["detail"], host


@pytest.mark.parametrize(
    "cases, complete, verdict",
    [
        ({"tests/a.py::t": ("skipped", "could not import 'vllm'"), "tests/a.py::u": None}, True, "miss"),
        ({"tests/a.py::t": ("skipped", "needs a CUDA device"), "tests/a.py::u": None}, True, "miss"),
        ({"tests/a.py::t": ("failure", "assert 1 == 2"), "tests/a.py::u": None}, True, "miss"),
        ({"tests/a.py::t": ("error", "RuntimeError"), "tests/a.py::u": None}, True, "miss"),
        ({"tests/a.py::t": ("skipped", "needs 2 GPUs"), "tests/a.py::u": None}, True, "pass"),
        # A lease has one GPU (the 11-28 H200 run counted this skip as a miss).
        ({"tests/a.py::t": ("skipped", "Skipped: needs two CUDA devices"), "tests/a.py::u": None}, True, "pass"),
        ({"tests/a.py::t": None}, False, "not measured"),
        ({}, True, "not measured"),
    ],
    ids=[
        "skipped-for-vllm",
        "skipped-for-cuda",
        "failed",
        "errored",
        "other-skip",
        "two-gpus",
        "cut-short",
        "no-tests",
    ],  # fmt: skip
)
def test_the_gpu_test_target(m, tmp_path, cases, complete, verdict):
    slow = ("pytest", ({"tests/bench/test_bench_gpu.py::t": None},))
    t = _targets(m, tmp_path, {"gpu-tests": ("pytest", (cases, complete)), "gpu-tests-slow": slow})
    assert t["gpu-tests"]["verdict"] == verdict, t["gpu-tests"]
    # Without the slow tests' stage, the whole suite was not run: at best not measured.
    alone = _targets(m, tmp_path, {"gpu-tests": ("pytest", (cases, complete))})["gpu-tests"]
    assert alone["verdict"] == ("miss" if verdict == "miss" else "not measured")
    assert "gpu-tests-slow: not in this run" in alone["detail"]


def test_the_summary_knows_the_test_stages(m):
    assert m.summary.TEST_STAGES == tuple(n for n, s in m.stages.STAGES.items() if s.kind == "pytest")


def test_a_malformed_stage_file_costs_only_its_target(m, tmp_path):
    t = _targets(m, tmp_path, {"quick": ("transfer", {"mode": "gpu", "rows": [{"method": "x"}]})})
    assert t["transfers"]["verdict"] == "not measured" and "could not be computed" in t["transfers"]["detail"]
    assert t["call-cost"]["verdict"] == "not measured"


def test_the_launch_shape_figure(m):
    rows = []
    for ctas, fracs in ((4, (0.75, 0.8)), (8, (0.81, 0.85)), (16, (0.85, 0.9)), (32, (0.84, 0.95))):
        for layout, f in zip(("kv_first", "block_first"), fracs):
            rows.append({"method": "triton", "num_ctas": ctas, "page_bytes": 2048, "blocks": 128, "direction": "load",
                         "fraction_of_peak": f, "layout": layout})  # fmt: skip
    (fig,) = m.summary.launch_shape(rows, 4)
    # The worst layout decides: 16 CTAs (0.85) beats 32 (0.84) although 32 has the best single case.
    assert fig["fraction_at_4"] == 0.75 and fig["best_ctas"] == 16 and fig["fraction_at_best"] == 0.85


# -- merge -----------------------------------------------------------------------------------------------------------


def test_merge_puts_a_returned_run_into_results_and_the_ledger(m, tmp_path):
    kinds = {"machine": "machine", "a": "transfer"}

    def a_writes(files):
        pathlib.Path(files["json"]).write_text('{"mode": "gpu", "rows": []}')
        pathlib.Path(files["plot"]).write_bytes(b"png")

    h = Harness(m, tmp_path, kinds, {"a": {"writes": a_writes}}, {"machine": 2, "a": 5})
    h.run()
    results, ledger = tmp_path / "results", tmp_path / "committed-ledger.json"
    ledger.write_text(json.dumps(m.stages.new_ledger(m.stages.STAGES)))
    # The stub stages are not the real ones: their entries merge, no commit is filled in.
    written = m.run.merge(h.out, results, ledger, out=open(os.devnull, "w"))
    stem = "fake-gpu-80gb-2026-11-27-0930"
    assert {f"{stem}-gpu-run.json", f"{stem}-a.json", f"{stem}-a.png", f"{stem}-a.log", f"{stem}-machine.json",
            f"{stem}-gpu-run.log"} <= set(written)  # fmt: skip
    assert json.loads((results / f"{stem}-gpu-run.json").read_text())["device"] == "Fake GPU 80GB"
    merged = json.loads(ledger.read_text())
    assert merged["stages"]["a"]["outcome"] == "ok" and merged["stages"]["a"]["commit"] is None
    m.run.merge(h.out, results, ledger, out=open(os.devnull, "w"))  # again: the same files, nothing refused
    (results / f"{stem}-a.json").write_text("{}")
    with pytest.raises(SystemExit, match="refusing to overwrite"):
        m.run.merge(h.out, results, ledger, out=open(os.devnull, "w"))


def test_merge_refuses_an_unsafe_tarball_member(m, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    machine = {"stage": "machine", "outcome": "ok", "figures": {"cuda": True}}
    (out / "summary.json").write_text(json.dumps({"stem": "x-2026-11-27", "tarball": "x-gpu-run.tar.gz",
                                                  "stages": [machine]}))  # fmt: skip
    with tarfile.open(out / "x-gpu-run.tar.gz", "w:gz") as tar:
        (tmp_path / "f").write_text("evil")
        tar.add(tmp_path / "f", arcname="../escape.json")
    with pytest.raises(SystemExit, match="refusing tarball member '../escape.json'"):
        m.run.merge(out, tmp_path / "results", tmp_path / "ledger.json", out=open(os.devnull, "w"))
    assert not (tmp_path / "results").exists()


# -- real processes ----------------------------------------------------------------------------------------------


TINY_TESTS = """
import time
def test_one(): pass
def test_two(): pass
def test_slow(): time.sleep(float(__import__("os").environ.get("TINY_SLEEP", "0")))
"""


def test_a_real_run_without_cuda_degrades_gracefully(m, tmp_path):
    """The real machine stage (no CUDA here: it says so and ends ok) and a real pytest stage (the plugin, under
    pytest-timeout) into a temporary OUTDIR, in a few seconds."""
    (tmp_path / "test_tiny.py").write_text(TINY_TESTS)
    stages = {
        "machine": m.stages.STAGES["machine"],
        "tiny-tests": m.stages.Stage("tiny-tests", "tiny", "pytest",
                                   (m.stages.pytest_step(str(tmp_path / "test_tiny.py"), timeout=60),), 10.0, (),
                                   m.stages.STAGES["gpu-tests"].env),
    }  # fmt: skip
    out, log = tmp_path / "out", tmp_path / "runner.log"
    with open(log, "w") as f:
        runner = m.run.Runner(out, budget_s=120, work=tmp_path / "work", ledger_path=tmp_path / "ledger.json",
                              stages=stages, default=tuple(stages), started_at=START, out=f)  # fmt: skip
        t0 = time.monotonic()
        rc = runner.run()
    assert rc == 0, log.read_text()
    assert time.monotonic() - t0 < 60
    s = json.loads((out / "summary.json").read_text())
    machine, tiny = s["stages"]
    assert machine["outcome"] == "ok" and machine["figures"]["cuda"] is False
    assert any("no CUDA" in n for n in machine["figures"]["notes"]), machine
    assert tiny["outcome"] == "ok" and tiny["figures"] == {"complete": True, "passed": 3, "failure": 0, "error": 0,
                                                           "skipped": 0, "modules_skipped": 0}  # fmt: skip
    assert s["device"] == "no-gpu" and s["stem"] == "no-gpu-2026-11-27-0930"
    with tarfile.open(out / "no-gpu-2026-11-27-0930-gpu-run.tar.gz") as tar:
        names = set(tar.getnames())
    stem = "no-gpu-2026-11-27-0930"
    assert {f"{stem}-machine.json", f"{stem}-machine.log", f"{stem}-tiny-tests.xml", f"{stem}-tiny-tests.log",
            f"{stem}-gpu-run.log"} <= names  # fmt: skip
    text = log.read_text()
    assert "test_tiny.py::test_one PASSED" in text  # the stage's output is tee'd through
    assert "./dev gpu merge" in text and "summary.json -> bench/results/no-gpu-2026-11-27-0930-gpu-run.json" in text


def test_the_live_junit_plugin_keeps_finished_tests_when_killed(tmp_path):
    (tmp_path / "test_mixed.py").write_text(
        "import pytest, time\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2\n"
        "@pytest.mark.skip(reason='needs vLLM 0.33')\n"
        "def test_skipped(): pass\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError('setup broke')\n"
        "def test_error(broken): pass\n"
        "def test_hangs(): time.sleep(120)\n"
    )
    xml = tmp_path / "live.xml"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tools" / "gpu" / "pytest_plugins"))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "live_junit", "--live-junit", str(xml), "-q",
                             "-p", "no:cacheprovider", str(tmp_path / "test_mixed.py")], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if xml.is_file() and ET.parse(xml).getroot().find("testsuite").get("tests") == "4":
                break
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    got = summary.junit_results(xml)
    assert got["complete"] is False
    assert got["passed"] == ["test_mixed.py::test_ok"]
    assert [t for t, _ in got["failure"]] == ["test_mixed.py::test_bad"] and got["failure"][0][1] == "assert 1 == 2"
    assert got["skipped"] == [("test_mixed.py::test_skipped", "Skipped: needs vLLM 0.33")]
    assert got["error"][0][0] == "test_mixed.py::test_error" and "setup broke" in got["error"][0][1]


def test_the_live_junit_plugin_records_modules_skipped_or_broken_at_collection(tmp_path):
    (tmp_path / "test_needs_vllm.py").write_text(
        "import pytest\npytest.importorskip('no_such_vllm_module')\ndef test_x(\n    kind, device\n): pass\n"
    )
    (tmp_path / "test_no_gpu.py").write_text(
        "import pytest\npytest.skip('builds from vLLM', allow_module_level=True)\n"
    )
    (tmp_path / "test_broken.py").write_text("import no_such_module_either\n")
    (tmp_path / "test_fine.py").write_text("def test_fine(): pass\n")
    xml = tmp_path / "live.xml"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tools" / "gpu" / "pytest_plugins"))
    subprocess.run([sys.executable, "-m", "pytest", "-p", "live_junit", "--live-junit", str(xml), "-q", "-p",
                    "no:cacheprovider", "--continue-on-collection-errors", str(tmp_path)], cwd=tmp_path, env=env,
                   capture_output=True, timeout=120)  # fmt: skip
    got = summary.junit_results(xml)
    assert got["complete"] is True and got["passed"] == ["test_fine.py::test_fine"]
    # A module with a test on the `device` fixture (a GPU test under -m gpu) counts; one without is only listed.
    assert [t for t, _ in got["skipped"]] == ["test_needs_vllm.py"] and "no_such_vllm" in got["skipped"][0][1]
    assert got["modules_skipped"] == [("test_no_gpu.py", "Skipped: builds from vLLM")]
    assert [t for t, _ in got["error"]] == ["test_broken.py"] and "no_such_module_either" in got["error"][0][1]


# -- issue 56: what the first lease must bring back whatever happens -------------------------------------------------


def test_the_gpu_test_files_are_every_file_with_a_gpu_test(m):
    """gpu-tests names its files (the library's, then vLLM's) instead of collecting the whole tree: together with the
    two slow tests they must be every file `pytest -m gpu` collects, or a new GPU test would never run on a lease."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p",
                           "no:cacheprovider", "tests"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = {line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line}
    slow = {t.split("::")[0] for t in m.stages.SLOW_TESTS}
    named = set(m.stages.GPU_TESTS_CORE) | set(m.stages.GPU_TESTS_VLLM)
    assert collected - slow <= named, f"GPU tests in files the gpu-tests stage does not name: {collected - named}"
    assert slow <= collected and all((ROOT / f).is_file() for f in named)
    # The library's files import no vLLM code: a broken vLLM import cannot cost them.
    for f in m.stages.GPU_TESTS_CORE:
        src = (ROOT / f).read_text()
        vllm_import = r"^\s*(import vllm|from vllm|import vllm_|from vllm_|import tiering_factory)"
        assert not re.search(vllm_import, src, re.M), f


def test_a_failed_step_does_not_stop_the_next_and_the_outcome_names_it(m, tmp_path):
    """A stage of two steps with keep_going (gpu-tests): the first fails, the second still runs; the stage is failed
    and says which step; without keep_going the second never starts."""
    for keep_going, started in ((True, ["machine", "core", "vllm"]), (False, ["machine", "core"])):
        stub = ("stub", "machine", "{json}", "{xml}", "{plot}")
        stages = {"machine": m.stages.Stage("machine", "", "machine", (stub,), 2.0),
                  "t": m.stages.Stage("t", "", "pytest", (("stub", "core", "{json}", "{xml}", "{plot}"),
                                                        ("stub", "vllm", "{json}", "{xml}", "{plot}")), 50.0, (),
                                    step_names=("the library's GPU tests", "vLLM's GPU tests"),
                                    keep_going=keep_going)}  # fmt: skip
        h = Harness(
            m,
            tmp_path / str(keep_going),
            {"machine": "machine", "t": "pytest"},
            {"core": {"rc": 1, "seconds": 5}, "vllm": {"rc": 0, "seconds": 5}},
            {"machine": 2, "t": 50},
        )
        h.runner.stages = stages
        assert h.run() == 1
        assert h.started == started
        t = h.stage("t")
        assert t["outcome"] == "failed" and t["why"] == "the library's GPU tests: exit 1", t
        assert t["returncodes"] == ([1, 0] if keep_going else [1])


def test_a_vllm_collection_error_keeps_the_library_s_test_results(m, tmp_path):
    """The real two-process test stage: the library's tests pass in the first process; in the second a vLLM test
    module cannot be imported. The XML holds both processes' tests; the stage is failed naming vLLM's step; the
    summary lists the broken module and every library test as passed."""
    (tmp_path / "test_core.py").write_text("def test_kernel(): pass\ndef test_engine(): pass\n")
    (tmp_path / "test_vllm_mod.py").write_text("raise AttributeError('vllm on torch 2.11: no attribute X')\n")
    (tmp_path / "test_vllm_ok.py").write_text("def test_native(): pass\n")
    two = m.stages.Stage("gpu-tests", "two steps", "pytest",
                       (m.stages.pytest_step(str(tmp_path / "test_core.py"), timeout=60),
                        m.stages.pytest_step(str(tmp_path / "test_vllm_mod.py"), str(tmp_path / "test_vllm_ok.py"),
                                       timeout=60, append=True)),
                       10.0, (), m.stages.STAGES["gpu-tests"].env, m.stages.STAGES["gpu-tests"].step_names,
                       keep_going=True)  # fmt: skip
    stages = {"machine": m.stages.STAGES["machine"], "gpu-tests": two}
    out = tmp_path / "out"
    with open(tmp_path / "runner.log", "w") as f:
        runner = m.run.Runner(out, budget_s=200, work=tmp_path / "work", ledger_path=tmp_path / "ledger.json",
                              stages=stages, default=tuple(stages), started_at=START, out=f)  # fmt: skip
        assert runner.run() == 1
    s = json.loads((out / "summary.json").read_text())
    st = s["stages"][1]
    assert st["outcome"] == "failed" and st["why"] == "vLLM's GPU tests: exit 1", st
    assert st["figures"] == {"complete": True, "passed": 3, "failure": 0, "error": 1, "skipped": 0,
                             "modules_skipped": 0}  # fmt: skip
    target = next(t for t in s["targets"] if t["target"].startswith("every GPU test"))
    assert target["verdict"] == "miss" and "test_vllm_mod.py" in target["where"] and "no attribute X" in target["where"]
    assert target["detail"].startswith("3 passed")


def test_the_install_log_comes_back_in_the_tarball(m, tmp_path):
    """./dev gpu's install writes OUTDIR/install.log before the runner starts: the runner packs it with the stages'
    files, so an OUTDIR that must start empty still returns it."""
    h = Harness(m, tmp_path, KINDS, {}, {})
    h.out.mkdir()
    (h.out / "install.log").write_text("pip install ...\n")
    assert h.run() == 0 and h.started == ["machine", "a", "b", "c"]
    assert "fake-gpu-80gb-2026-11-27-0930-install.log" in h.tar_names()
    assert not (h.out / "install.log").exists()


def test_merge_refuses_a_run_that_saw_no_gpu(m, tmp_path):
    def cpu_machine(files):
        pathlib.Path(files["json"]).write_text(json.dumps({"benchmark": "machine", "device": None, "cuda": False}))

    h = Harness(m, tmp_path, {"machine": "machine", "a": "transfer"}, {"machine": {"writes": cpu_machine}},
                {"machine": 2, "a": 5})  # fmt: skip
    h.run()
    results, ledger = tmp_path / "results", tmp_path / "ledger.json"
    with pytest.raises(SystemExit, match="saw no CUDA device"):
        m.run.merge(h.out, results, ledger, out=open(os.devnull, "w"))
    assert not results.exists()


def test_two_leases_on_one_day_merge_side_by_side(m, tmp_path):
    results, ledger = tmp_path / "results", tmp_path / "committed-ledger.json"
    ledger.write_text(json.dumps(m.stages.new_ledger(m.stages.STAGES)))
    written = []
    for i, hour in enumerate((9, 14)):

        def a_writes(files, i=i):
            pathlib.Path(files["json"]).write_text(json.dumps({"mode": "gpu", "rows": [], "lease": i}))

        h = Harness(m, tmp_path / f"lease{i}", {"machine": "machine", "a": "transfer"}, {"a": {"writes": a_writes}},
                    {"machine": 2, "a": 5})  # fmt: skip
        h.runner.started_at = START.replace(hour=hour)
        h.run()
        written.append(m.run.merge(h.out, results, ledger, out=open(os.devnull, "w")))
    assert "fake-gpu-80gb-2026-11-27-0930-a.json" in written[0] and "fake-gpu-80gb-2026-11-27-1430-a.json" in written[1]
    assert json.loads((results / "fake-gpu-80gb-2026-11-27-1430-a.json").read_text())["lease"] == 1
    assert json.loads((results / "fake-gpu-80gb-2026-11-27-0930-a.json").read_text())["lease"] == 0


def test_the_dry_run_of_a_first_lease_plans_the_three_answers_within_the_budget(m, tmp_path, capsys):
    """A fresh ledger: machine, gpu-tests, call-cost and serving are planned to run, in that order, ending within the
    default budget (counted from the top of ./dev gpu), each with its estimate printed."""
    runner = m.run.Runner(tmp_path / "out", ledger_path=tmp_path / "fresh.json", out=sys.stdout)
    assert runner.budget_s == 540 and runner.dry_run() == 0
    text = capsys.readouterr().out
    runs = [line.split()[2] for line in text.splitlines() if re.match(r"\[gpu-run\]\s+\d+ ", line) and " runs;" in line]
    assert runs[:4] == ["machine", "gpu-tests", "call-cost", "serving"], text
    for name in ("gpu-tests", "call-cost", "serving"):
        line = next(x for x in text.splitlines() if f" {name} " in x)
        assert re.search(rf" {name}\s+{m.stages.STAGES[name].estimate_s:.0f}s ", line), line
    end = float(re.search(r"expected end ~(\d+) s of 540 s", text).group(1))
    assert end <= 540 - m.run.PACK_RESERVE_S


def test_a_bundle_that_cannot_be_unpacked_leaves_a_run_without_vllm(tmp_path):
    """./dev gpu unpacks the vLLM bundle leniently: a damaged bundle is a warning, no folder goes on PYTHONPATH and
    nothing is left half-unpacked, so the lease runs without vLLM's code (vllm_native: not available) instead of
    returning only its install log. ./dev bench stays strict. The shell function itself runs here, from dev."""
    bundle = tmp_path / "repo" / ".gpu-bundle"
    bundle.mkdir(parents=True)
    (bundle / "vllm-0.33.0-py.tar.gz").write_bytes(b"not the tarball the manifest names")
    manifest = {"vllm": "0.33.0", "source": {"file": "vllm-0.33.0-py.tar.gz", "files": 3027, "sha256": "0" * 64},
                "wheels": {}, "pins": {"vllm": "0.33.0"}, "total_bytes": 1, "limit_bytes": 40 << 20}  # fmt: skip
    (bundle / "MANIFEST.json").write_text(json.dumps(manifest))
    function = re.search(r"^use_vllm_bundle\(\) \{.*?^\}$", (ROOT / "dev").read_text(), re.M | re.S).group(0)
    site = tmp_path / "site"
    script = (f"set -euo pipefail\nROOT={tmp_path / 'repo'}\nPY={sys.executable}\nlog() {{ echo \"[dev] $*\" >&2; }}\n"
              f"{function.replace('unpack --bundle', f'unpack --dest {site} --bundle')}\nuse_vllm_bundle \"$1\"\n"
              "echo \"site=${TRITON_OFFLOAD_VLLM_BUNDLE:-} error=${TRITON_OFFLOAD_VLLM_BUNDLE_ERROR:-} "
              "path=${PYTHONPATH:-}\"\n")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_OFFLOAD_VLLM_BUNDLE")}

    def run_(mode):
        return subprocess.run(["bash", "-c", script, "dev", mode], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip

    lenient = run_("lenient")
    assert lenient.returncode == 0, lenient.stderr
    last = lenient.stdout.strip().splitlines()[-1]
    assert last.startswith("site= error=[vllm-bundle] WARNING: the bundle could not be unpacked") and "path=" in last
    assert last.endswith("path=") and "differs from the manifest" in last and not site.exists()
    strict = run_("strict")
    assert strict.returncode == 1 and "differs from the manifest" in strict.stderr and "site=" not in strict.stdout
