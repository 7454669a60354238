#!/usr/bin/env python3
"""One command per GPU lease: ``./dev gpu run OUTDIR [--budget SECONDS] [--stages A,B,...] [--dry-run]``. The stages
(tools/gpu/stages.py) run in priority order inside one budget (default 540 s, counted from ``--t0``, when ``./dev gpu``
began); a stage whose estimate does not fit what is left is skipped and named as skipped, never started and killed
(:class:`Runner`). After every stage, and on SIGTERM/SIGINT, OUTDIR is packed as at most 7 files (:meth:`Runner._pack`).
Stdlib only: it starts before the project is installed.

    python -m tools.gpu.run run OUTDIR [--budget S] [--stages A,B] [--dry-run] [--t0 EPOCH]
    python -m tools.gpu.run check OUTDIR [...]     # the options and OUTDIR, before ./dev installs anything
    python -m tools.gpu.run merge OUTDIR           # here: a returned run into bench/results/ and the ledger
"""

from __future__ import annotations

import argparse
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
import tempfile
import threading
import time

from bench.common.results import result_stem, write_json
from tools.gpu.stages import (
    DEFAULT_ORDER,
    INSTALL_S,
    LEDGER_PATH,
    ROOT,
    STAGES,
    estimate,
    fingerprint,
    load_ledger,
    merge_ledgers,
    order,
    record_run,
    resolve_stages,
)
from tools.gpu.summary import evaluate, stage_figures

# Seconds from the top of `./dev gpu` (the CUDA probe, the install, the stages, the packing): one 10-minute command
# (the device tool's timeout_s 600) with a minute to spare for the last pack, the report and the tool's own start.
DEFAULT_BUDGET_S = 540.0
PACK_RESERVE_S = 10.0  # kept back from the last stage for the final pack
POLL_S, KILL_GRACE_S = 0.5, 5.0  # a stage's process group gets SIGTERM, then SIGKILL after the grace
MAX_FILES = 7
MAX_PNGS = MAX_FILES - 3  # summary.json, the tarball, the ledger
SAFE_NAME = re.compile(r"[A-Za-z0-9._-]+")
SUMMARY, LEDGER_OUT, INSTALL_LOG, RUN_LOG = "summary.json", "gpu-ledger.json", "install.log", "gpu-run.log"
FILE_KINDS = {"json": ".json", "plot": ".png", "xml": ".xml"}
RESULTS_DIR = ROOT / "bench" / "results"


class Interrupted(Exception):
    """SIGTERM or SIGINT arrived: stop the stage in flight and pack."""


def _on_signal(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


class Process:
    """One command in its own process group (so its children die with it), its output tee'd into ``log`` and
    ``echo``."""

    def __init__(self, argv: list[str], log: pathlib.Path, env: dict, cwd: pathlib.Path, echo):
        self._log, self._echo = open(log, "ab"), echo
        self._p = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self._tee = threading.Thread(target=self._copy, daemon=True)
        self._tee.start()

    def _copy(self) -> None:
        for line in iter(self._p.stdout.readline, b""):
            self._log.write(line)
            self._log.flush()
            self._echo(line)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self._p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _close(self) -> None:
        self._signal_group(signal.SIGKILL)  # whatever the command left behind in its group
        self._tee.join(timeout=5)
        self._log.close()

    def poll(self) -> int | None:
        rc = self._p.poll()
        if rc is not None and not self._log.closed:
            self._close()
        return rc

    def kill(self) -> None:
        if self._log.closed:
            return
        self._signal_group(signal.SIGTERM)
        try:
            self._p.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self._p.wait()
        self._close()


def _commit(root: pathlib.Path) -> str | None:
    """HEAD, with ``+changes`` when the tree differs from it; None without git (the GPU machine's copy)."""
    git = ["git", "-C", str(root)]
    try:
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "") if head.returncode == 0 else None


def _safe(name: str) -> str:
    if not SAFE_NAME.fullmatch(name):
        raise ValueError(f"not a safe file name (letters, digits, '.', '_', '-'): {name!r}")
    return name


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Runner:
    """Orders and runs the stages; ``clock``, ``sleep``, ``spawn`` (-> ``poll()``, ``kill()``) and ``stages`` are
    injectable for tests. Each stage's commands run in their own process group, killed at the stage's timeout, their
    output tee'd into the stage's log."""

    def __init__(self, outdir: pathlib.Path, *, budget_s: float = DEFAULT_BUDGET_S, chosen: list[str] | None = None,
                 spent_s: float | None = None, work: pathlib.Path | None = None, ledger_path=LEDGER_PATH,
                 stages=STAGES, default=DEFAULT_ORDER, clock=time.monotonic, sleep=time.sleep, spawn=Process,
                 python: str = sys.executable, root: pathlib.Path = ROOT, started_at=None, out=None):  # fmt: skip
        self.outdir, self.budget_s, self.spent_s, self.stages = pathlib.Path(outdir), budget_s, spent_s, stages
        self.clock, self.sleep, self.spawn, self.python, self.root = clock, sleep, spawn, python, root
        # The lease's start (UTC) names its files, so two leases on one day and device merge side by side.
        self.started_at = started_at or datetime.datetime.now(datetime.timezone.utc)
        self.today = self.started_at.date()
        self._own_work, self.work = work is None, pathlib.Path(work) if work else None
        self.out = out or sys.stdout
        self.ledger = load_ledger(ledger_path, stages)
        self.fingerprints = {name: fingerprint(stage, root) for name, stage in stages.items()}
        self.queue = order(self.ledger, self.fingerprints, chosen, default)
        self.records: dict[str, dict] = {}
        self.device, self.commit = "unknown-device", _commit(root)
        self.interrupted: str | None = None
        self.finished = False
        self._current: dict | None = None
        self._written: set[str] = set()
        self._log_lines: list[str] = []

    def dry_run(self) -> int:
        """Prints the order, why, each estimate and timeout, and what would be skipped if each took its estimate."""
        inst = self.ledger["install"].get("seconds")
        t = inst or INSTALL_S
        self._say(f"budget {self.budget_s:.0f} s; install ~{t:.0f} s ({'measured' if inst else 'estimate'}); "
                  f"{PACK_RESERVE_S:.0f} s kept for packing")  # fmt: skip
        self._say(f"{'#':>2} {'stage':<15} {'expect':>7} {'timeout':>7} {'starts':>7}  runs?; why there; estimate from")
        for i, (name, why_first) in enumerate(self.queue, 1):
            est = estimate(self.stages[name], self.ledger)
            left = self.budget_s - PACK_RESERVE_S - t
            runs, starts = f"SKIPPED (~{est.seconds:.0f} s > {max(0, left):.0f} s left)", "-"
            if est.seconds <= left:
                runs, starts, t = "runs", f"{t:.0f}s", t + est.seconds
            self._say(f"{i:>2} {name:<15} {est.seconds:>6.0f}s {est.timeout_s:>6.0f}s {starts:>7}  {runs}; "
                      f"{why_first}; {est.source}")  # fmt: skip
        self._say(f"expected end ~{t:.0f} s of {self.budget_s:.0f} s (nothing was run: --dry-run)")
        return 0

    def run(self) -> int:
        """Runs the stages; returns 0 when every stage that started ended ok, 1 otherwise, 128+N on signal N."""
        self.work = self.work or pathlib.Path(tempfile.mkdtemp(prefix="gpu-run-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.outdir.mkdir(parents=True, exist_ok=True)
        stray = sorted(p.name for p in self.outdir.iterdir() if p.name != INSTALL_LOG)
        if stray:
            raise SystemExit(f"OUTDIR {self.outdir} must be empty (it holds {stray}): its files are what comes back")
        if (self.outdir / INSTALL_LOG).is_file():  # ./dev's install, before this process
            shutil.move(str(self.outdir / INSTALL_LOG), str(self.work / INSTALL_LOG))
        spent, self.start = self.spent_s or 0.0, self.clock()
        self.deadline = self.start + self.budget_s - spent
        if self.spent_s is not None:
            self.ledger["install"] = {"seconds": round(spent, 1), "ran_at": _now(), "device": None}
        bundle, bundle_error = (os.environ.get(f"TRITON_OFFLOAD_VLLM_BUNDLE{k}") for k in ("", "_ERROR"))
        handlers = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._say(f"GPU run: budget {self.budget_s:.0f} s, {spent:.0f} s spent before this process (install); "
                      f"commit {self.commit or 'unknown (no git here)'}; vLLM bundle: {bundle or 'none'}")  # fmt: skip
            self._say("order: " + ", ".join(f"{n} ({why})" for n, why in self.queue))
            if bundle_error:
                self._say(f"vLLM bundle failed to unpack, going on without it: {bundle_error}")
            for name, _ in self.queue:
                self._stage(name)
                self._pack()
            self.finished = True
        except Interrupted as exc:
            for s in handlers:  # a second signal must not cut the stop short
                signal.signal(s, signal.SIG_IGN)
            self.interrupted = str(exc)
            self._say(f"{exc}: stopping the stage in flight, packing what was measured")
            cur, self._current = self._current, None
            if cur:
                if cur["handle"] is not None:
                    cur["handle"].kill()
                self._finish(cur["name"], "killed", cur["est"], cur["timeout"], cur["start"], [], cur["commands"])
        finally:
            for s in handlers:  # the final pack is short: a signal now would only leave it half done
                signal.signal(s, signal.SIG_IGN)
            try:
                self._pack()
                self._report()
            finally:
                for s, h in handlers.items():
                    signal.signal(s, h)
                if self._own_work:
                    shutil.rmtree(self.work, ignore_errors=True)
        if self.interrupted:
            return 128 + signal.Signals[self.interrupted].value
        return 1 if any(r["outcome"] not in ("ok", "skipped") for r in self.records.values()) else 0

    def _files(self, name: str, existing: bool = False) -> dict[str, pathlib.Path]:
        files = {kind: self.work / f"{name}{ext}" for kind, ext in FILE_KINDS.items()}
        return {k: p for k, p in files.items() if p.is_file()} if existing else files

    def _env(self, stage) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
        for key, value in stage.env:
            value = value.format(root=self.root)
            env[key] = f"{value}{os.pathsep}{env[key]}" if key == "PYTHONPATH" and env.get(key) else value
        return env

    def _stage(self, name: str) -> None:
        stage = self.stages[name]
        est = estimate(stage, self.ledger)
        left = self.deadline - self.clock() - PACK_RESERVE_S
        if est.seconds > left:
            why = f"does not fit: needs ~{est.seconds:.0f} s, {max(0, left):.0f} s left"
            self._record(name, "skipped", est, why=why)
            self._say(f"[{name}] skipped: {why} ({est.source})")
            return
        timeout, start = min(est.timeout_s, left), self.clock()
        fmt = {"py": self.python, **{k: str(v) for k, v in self._files(name).items()}}
        commands = [[a.format(**fmt) for a in step] for step in stage.steps]
        self._current = cur = {"name": name, "start": start, "est": est, "timeout": timeout, "handle": None,
                               "commands": commands}  # fmt: skip
        self._say(f"[{name}] starts: ~{est.seconds:.0f} s expected ({est.source}), killed at {timeout:.0f} s")
        outcome, rcs, failed = "ok", [], []
        log = self.work / f"{name}.log"
        for i, argv in enumerate(commands):
            with open(log, "a") as f:
                f.write(f"$ {' '.join(argv)}\n")
            handle = cur["handle"] = self.spawn(argv, log, self._env(stage), self.root, self._echo)
            while (rc := handle.poll()) is None and self.clock() < start + timeout:
                self.sleep(POLL_S)
            if rc is None:
                handle.kill()
                outcome = "timed out"
                failed.append(f"{stage.step_name(i)}: timed out")
                break
            rcs.append(rc)
            if rc != 0:
                outcome = "failed"
                failed.append(f"{stage.step_name(i)}: exit {rc}")
                if not stage.keep_going:
                    break
        self._current = None
        self._finish(name, outcome, est, timeout, start, rcs, commands, failed)

    def _finish(self, name, outcome, est, timeout, start, rcs, commands, failed=()) -> None:
        seconds = self.clock() - start
        shown = [" ".join(_shown(a, self.work, self.root) for a in argv) for argv in commands]
        # Which step did not end ok, where the stage has several (gpu-tests: the library's tests or vLLM's).
        why = {"why": "; ".join(failed)} if failed and len(commands) > 1 else {}
        self._record(name, outcome, est, seconds=round(seconds, 1), timeout_s=round(timeout, 1), returncodes=rcs,
                     commands=shown, **why)  # fmt: skip
        if name == "machine":
            try:
                doc = json.loads(self._files(name)["json"].read_text())
            except (OSError, ValueError):
                doc = {}
            self.device = doc.get("device") or ("no-gpu" if doc else "unknown-device")
            self.ledger["install"]["device"] = self.device
        record_run(self.ledger, name, outcome=outcome, device=self.device, date=self.today.isoformat(), ran_at=_now(),
                   commit=self.commit, seconds=round(seconds, 1), estimate_s=round(est.seconds, 1),
                   fingerprint=self.fingerprints[name])  # fmt: skip
        self._say(f"[{name}] {outcome} in {seconds:.0f} s" + (f" ({'; '.join(failed)})" if failed else ""))

    def _record(self, name: str, outcome: str, est, **fields) -> None:
        self.records[name] = {"stage": name, "kind": self.stages[name].kind, "outcome": outcome,
                              "estimate_s": round(est.seconds, 1), "estimate_source": est.source,
                              "fingerprint": self.fingerprints[name], **fields}  # fmt: skip

    def _echo(self, line: bytes) -> None:
        buf = getattr(self.out, "buffer", None)
        if buf is None:
            self.out.write(line.decode(errors="replace"))
        else:
            buf.write(line)
            buf.flush()

    def _say(self, text: str) -> None:
        print(f"[gpu-run] {text}", file=self.out, flush=True)
        self._log_lines.append(f"[gpu-run] {text}")

    @property
    def stem(self) -> str:
        return f"{result_stem(self.device, date=self.today)}-{self.started_at:%H%M}"

    def summary(self) -> dict:
        stages = []
        for name, why in self.queue:
            pending = {"stage": name, "kind": self.stages[name].kind, "outcome": "not started",
                       "why": "interrupted" if self.interrupted else "not reached yet"}  # fmt: skip
            rec, files = self.records.get(name) or pending, self._files(name, existing=True)
            try:
                figures = stage_figures(rec["kind"], files) if files else {}
            except Exception as exc:  # a malformed stage file costs only its figures
                figures = {"error": f"could not read the stage's files: {exc!r}"[:300]}
            packed = sorted(f"{self.stem}-{p.name}" for p in files.values())
            stages.append({**rec, "order_why": why, "figures": figures, "files": packed})
        targets = evaluate([{**s, "files": self._files(s["stage"], existing=True)} for s in stages])
        verdicts: dict[str, int] = {}
        for t in targets:
            verdicts[t["verdict"]] = verdicts.get(t["verdict"], 0) + 1
        tarball = f"{self.stem}-gpu-run.tar.gz"
        return {"runner": "tools/gpu/run.py", "complete": self.finished and not self.interrupted,
                "interrupted": self.interrupted, "device": self.device, "date": self.today.isoformat(),
                "stem": self.stem, "commit": self.commit,
                "vllm_bundle": os.environ.get("TRITON_OFFLOAD_VLLM_BUNDLE") or None,
                "vllm_bundle_error": os.environ.get("TRITON_OFFLOAD_VLLM_BUNDLE_ERROR") or None,
                "started_at": self.started_at.isoformat(timespec="seconds"), "budget_s": self.budget_s,
                "install_s": None if self.spent_s is None else round(self.spent_s, 1),
                "elapsed_s": round(self.clock() - self.start + (self.spent_s or 0.0), 1), "stages": stages,
                "targets": targets, "verdicts": verdicts, "tarball": tarball,
                "commit_to": {SUMMARY: f"bench/results/{self.stem}-gpu-run.json",
                              tarball: "extracted into bench/results/ (<device>-<date>-<HHMM>-<stage>.log/.json/.xml)",
                              LEDGER_OUT: "merged into bench/results/gpu-ledger.json",
                              "*.png": "bench/results/ (same names)"}}  # fmt: skip

    def _pack(self) -> None:
        """summary.json, the tarball, the ledger and the first PNGs into OUTDIR, each written whole then renamed: at
        most 7 files, ``summary.json`` (tools/gpu/summary.py, from the stages' files),
        ``<device>-<date>-<HHMM>-gpu-run.tar.gz`` (every log, JSON and JUnit XML), ``gpu-ledger.json`` and up to 4
        PNGs."""
        stem = self.stem
        (self.work / RUN_LOG).write_text("\n".join(self._log_lines) + "\n")
        pngs = [self.work / f"{n}.png" for n, _ in self.queue if (self.work / f"{n}.png").is_file()]
        shown = pngs[:MAX_PNGS]
        wanted = {SUMMARY, LEDGER_OUT, _safe(f"{stem}-gpu-run.tar.gz"), *(_safe(f"{stem}-{p.name}") for p in shown)}
        tar_tmp = self.outdir / f"{stem}-gpu-run.tar.gz.tmp"
        with tarfile.open(tar_tmp, "w:gz") as tar:
            for path in sorted(self.work.iterdir()):
                if path.is_file() and path not in shown and not path.name.endswith(".tmp"):
                    tar.add(path, arcname=_safe(f"{stem}-{path.name}"))
        os.replace(tar_tmp, self.outdir / f"{stem}-gpu-run.tar.gz")
        for p in shown:
            shutil.copyfile(p, self.outdir / f"{stem}-{p.name}.tmp")
            os.replace(self.outdir / f"{stem}-{p.name}.tmp", self.outdir / f"{stem}-{p.name}")
        write_json(self.outdir / LEDGER_OUT, self.ledger)
        write_json(self.outdir / SUMMARY, self.summary())
        for name in self._written - wanted:
            (self.outdir / name).unlink(missing_ok=True)
        self._written = wanted
        assert len(wanted) <= MAX_FILES, wanted

    def _report(self) -> None:
        doc = json.loads((self.outdir / SUMMARY).read_text())
        self._say(f"stages ({doc['elapsed_s']:.0f} s of {self.budget_s:.0f}):")
        for s in doc["stages"]:
            secs = f"{s['seconds']:.0f} s" if s.get("seconds") is not None else "-"
            self._say(f"  {s['stage']:<15} {s['outcome']:<11} {secs:>6}  {s.get('why') or ''}")
        self._say("targets:")
        for t in doc["targets"]:
            self._say(f"  {t['verdict']:<12} {t['target']}: {t['detail']}")
        for s in doc["stages"]:  # the compiler's model beside each kernel case measured (bench/static/model.py)
            model = (s.get("figures") or {}).get("model") or {}
            if model.get("cases"):
                self._say(f"model vs measured, {s['stage']} ({model['static']}, {model['arch']}): {model['summary']}")
            for c in model.get("cases", []):
                self._say(f"  {c['workload']}/{c['layout']} n={c['blocks']} f={c['f']} {c['direction']} "
                          f"{c['method']}@{c['num_ctas'] or '-'}: measured {c['measured']:.2f}, predicted "
                          f"{c['predicted']:.2f} ({c['error']:+.2f}, {c['bound']})")  # fmt: skip
        self._say(f"OUTDIR {self.outdir} holds {len(self._written)} files: {', '.join(sorted(self._written))}")
        self._say("to commit them: ./dev gpu merge <the returned folder> (here) puts " +
                  "; ".join(f"{k} -> {v}" for k, v in doc["commit_to"].items()))  # fmt: skip


def _shown(arg: str, work: pathlib.Path, root: pathlib.Path) -> str:
    """A command's argument as the summary shows it: the stage's files by name, the repository's paths relative."""
    for base in (work, root):
        if arg.startswith(f"{base}{os.sep}"):
            return arg[len(str(base)) + 1 :]
    return arg


def merge(outdir: pathlib.Path, results: pathlib.Path = RESULTS_DIR, ledger_path: pathlib.Path = LEDGER_PATH,
          root: pathlib.Path = ROOT, out=None) -> list[str]:  # fmt: skip
    """A returned run into ``results``: the summary as ``<stem>-gpu-run.json``, the tarball's files, the PNGs, and the
    ledger merged. Refuses (SystemExit, nothing written) a run whose machine stage did not see a CUDA device (a run
    here, or on a broken lease: its numbers measure no GPU), and to overwrite a different file or take an unsafe
    name."""
    summary = json.loads((outdir / SUMMARY).read_text())
    machine = next((s for s in summary.get("stages") or [] if s.get("stage") == "machine"), {})
    if (machine.get("figures") or {}).get("cuda") is not True:
        raise SystemExit(f"refusing to merge {outdir}: its machine stage saw no CUDA device (device "
                         f"{summary.get('device')!r}, machine stage {machine.get('outcome', 'missing')}): "
                         "not a GPU run")  # fmt: skip
    files: dict[str, bytes] = {f"{_safe(summary['stem'])}-gpu-run.json": (outdir / SUMMARY).read_bytes()}
    with tarfile.open(outdir / _safe(summary["tarball"])) as tar:
        for m in tar.getmembers():
            if not m.isfile() or not SAFE_NAME.fullmatch(m.name):
                raise SystemExit(f"refusing tarball member {m.name!r}: not a plain file with a safe name")
            files[m.name] = tar.extractfile(m).read()
    files.update((_safe(png.name), png.read_bytes()) for png in sorted(outdir.glob("*.png")))
    clash = [n for n, data in files.items() if (results / n).is_file() and (results / n).read_bytes() != data]
    if clash:
        raise SystemExit(f"refusing to overwrite {clash} in {results}: a different run has those names")
    results.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (results / name).write_bytes(data)
    head = _commit(root)

    def fill_commit(name: str, entry: dict) -> str | None:
        same = name in STAGES and fingerprint(STAGES[name], root) == entry.get("fingerprint")
        return f"{head} (filled at merge: same fingerprint)" if same and head else None

    merged, taken = merge_ledgers(load_ledger(ledger_path), json.loads((outdir / LEDGER_OUT).read_text()), fill_commit)
    ledger_path.write_text(json.dumps(merged, indent=1) + "\n")
    print(f"wrote {len(files)} files into {results}: {', '.join(sorted(files))}", file=out or sys.stdout)
    print(f"ledger {ledger_path}: took {', '.join(taken) or 'nothing (no newer runs)'}", file=out or sys.stdout)
    return sorted(files)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.gpu.run", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("run", "check"):
        p = sub.add_parser(cmd)
        p.add_argument("outdir", type=pathlib.Path)
        p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds of work, install included")
        p.add_argument("--stages", help=f"comma-separated, in this order after machine (default: by the ledger); "
                       f"{', '.join(STAGES)}")  # fmt: skip
        p.add_argument("--dry-run", action="store_true", help="print the order and estimates, run nothing")
        p.add_argument("--t0", type=float, help="epoch seconds when ./dev began (the install counts)")
        p.add_argument("--work", type=pathlib.Path, help="where stages write (default: a temporary folder)")
        p.add_argument("--ledger", type=pathlib.Path, default=LEDGER_PATH)
    p = sub.add_parser("merge")
    p.add_argument("outdir", type=pathlib.Path)
    p.add_argument("--results", type=pathlib.Path, default=RESULTS_DIR)
    p.add_argument("--ledger", type=pathlib.Path, default=LEDGER_PATH)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.cmd == "merge":
        merge(args.outdir, args.results, args.ledger)
        return 0
    try:
        chosen = resolve_stages(args.stages)
    except ValueError as exc:
        print(f"./dev gpu run: {exc}", file=sys.stderr)
        return 2
    if args.budget <= PACK_RESERVE_S:
        print(f"./dev gpu run: --budget must exceed {PACK_RESERVE_S:.0f} s, got {args.budget}", file=sys.stderr)
        return 2
    if args.cmd == "check":
        if args.outdir.exists() and any(args.outdir.iterdir()):
            print(f"./dev gpu run: OUTDIR {args.outdir} is not empty: its files are what comes back", file=sys.stderr)
            return 2
        return 0
    spent = time.time() - args.t0 if args.t0 else None
    runner = Runner(args.outdir, budget_s=args.budget, chosen=chosen, spent_s=spent, work=args.work,
                    ledger_path=args.ledger)  # fmt: skip
    return runner.dry_run() if args.dry_run else runner.run()


if __name__ == "__main__":
    sys.exit(main())
