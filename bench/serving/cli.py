#!/usr/bin/env python3
"""What a serving engine sees: a vLLM-like worker step loop on one GPU (model compute + offload traffic), per method.
Each step runs the model's per-layer matrix products in bf16 (each workload's real per-GPU shapes) over a prefill chunk
and decode tokens (decode-heavy: with each decode's attention read of its KV), writing the step's KV into its GPU
blocks; the blocks it completed are stored to the host cache, and every few steps an arriving request's cached prefix is
loaded, synchronously before its step or asynchronously beside the others (vLLM 0.33's default). The same loop runs with
no offload (``none``), with our TransferEngine (``triton``, ``auto``), with vLLM 0.33's data path (``vllm033``), vLLM
0.33's own worker (``vllm_native``) and cuMemcpyBatchAsync both ways (``memcpy_batch``), in rounds with ``none`` between
them; every job's bytes are checked while it runs. Without CUDA it runs at tiny shapes through the Triton interpreter
and times nothing. See docs/benchmarks.md, "The serving benchmark"; the package's docstring names its modules' roles.

    python -m bench.serving [--preset decisive] [--json PATH] [--plot PATH] [--workloads NAME ...]
                            [--shapes prefill-heavy decode-heavy] [--load-modes async sync] [--methods NAME ...]
                            [--rounds R] [--prefill N] [--decode N] [--context N] [--prefix-tokens N] [--steps N]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys

import torch

from bench.baselines import METHODS, SERVING_METHODS
from bench.common.case import Unavailable
from bench.common.env import Env, FatalCudaError, environment, open_gpu, print_header, release
from bench.common.report import say
from bench.common.results import write_json
from bench.common.workloads import WORKLOADS
from bench.serving.config import (
    CONTIGUOUS_REPEATS,
    CPU_PLAN,
    CPU_SHAPES,
    DUPLEX_METHODS,
    DUPLEX_REPEATS,
    FP8_METHOD,
    FULL_PLAN,
    LOAD_MODES,
    PRESETS,
    RUN_LAST,
    SERVING_WORKLOADS,
    SHAPE_NAMES,
    RunPlan,
    with_integrity,
    with_method,
)
from bench.serving.fp8 import fp8_setup
from bench.serving.gpu import contiguous_load, duplex, duplex_row
from bench.serving.loop import LoopRun, Setup, byte_check, host_rows_of, run_loop, setup_workload
from bench.serving.methods import MethodPoint, build_engine, method_points
from bench.serving.report import (
    count_fields,
    drift_of,
    evaluate_targets,
    fill_relative,
    new_row,
    plot_serving,
    print_duplex,
    print_rows,
    print_targets,
    timing_fields,
)
from triton_offload.kernels.shapes import DEFAULT_NUM_CTAS

# The points the duplex figure is measured for, when they are in the run.
DUPLEX_POINTS = tuple(MethodPoint(m, DEFAULT_NUM_CTAS if METHODS[m].sweeps_ctas else None) for m in DUPLEX_METHODS)
SUBMIT_TIMING = (
    "wall time (perf_counter) around each submit call on the worker thread: a submit that blocks (a synchronising "
    "copy, a driver lock) takes the thread just as much as one that computes, and the thread CPU clock would hide it"
)
# Which vLLM 0.33 behaviour each load mode follows (docs/benchmarks.md, "Load modes", says more).
LOAD_MODE_SOURCES = {
    "async": "vLLM 0.33's default (sync_load_budget_bytes = 0): "
    "OffloadingConnectorScheduler.get_num_new_matched_tokens returns load_async=True (offloading/scheduler.py); "
    "KVConnectorModelRunnerMixin._get_kv_connector_output calls start_load_kv after the forward pass is queued when "
    "no load is sync (v1/worker/kv_connector_model_runner_mixin.py); OffloadingConnectorWorker.start_kv_transfers "
    "submits it without waiting and get_finished reports it in finished_recving (offloading/worker.py)",
    "sync": "vLLM 0.33's budgeted option (sync_load_budget_bytes > 0): OffloadingConnectorScheduler._reserve_sync_load "
    "(offloading/scheduler.py); OffloadingConnectorWorker.start_kv_transfers submits the load expedited=True, then "
    "worker.wait (offloading/worker.py), before the forward pass (kv_connector_model_runner_mixin.py)",
}
SHAPE_FIELDS = ("prefill", "decode", "context", "prefix_tokens", "load_every", "steps", "warmup")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.serving",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named configuration (serving_config.PRESETS): "
                   "'decisive' is the GPU run's serving stage; options below filter or override it")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="write the rows, drift, duplex, cases, targets and samples "
                   "(rewritten after every row, so a killed run keeps every row it finished)")  # fmt: skip
    p.add_argument("--plot", metavar="PATH", help="write a PNG: step-time distribution and load latency per method")
    p.add_argument("--workloads", nargs="+", metavar="NAME", help=f"subset of {list(SERVING_WORKLOADS)}")
    p.add_argument("--shapes", nargs="+", choices=SHAPE_NAMES, help=f"loop shapes (default: both, {list(SHAPE_NAMES)})")
    p.add_argument("--load-modes", nargs="+", choices=LOAD_MODES, help="async: vLLM 0.33's default; sync: its "
                   "budgeted option (default: both)")  # fmt: skip
    p.add_argument("--layout", choices=("block_first", "kv_first"), default="block_first",
                   help="GPU KV layout (block_first: what vLLM's offloading connector uses)")  # fmt: skip
    p.add_argument("--methods", nargs="+", metavar="NAME", help=f"subset of {sorted(SERVING_METHODS)}")
    p.add_argument("--num-ctas", nargs="+", type=int, metavar="C", help=f"triton's num_ctas besides the default "
                   f"{DEFAULT_NUM_CTAS} (default {list(FULL_PLAN.triton_ctas)})")  # fmt: skip
    p.add_argument("--rounds", type=int, help=f"rounds of every method, none between them (default "
                   f"{FULL_PLAN.rounds}; without CUDA {CPU_PLAN.rounds})")  # fmt: skip
    for name, help_ in (("prefill", "prefill tokens per step"), ("decode", "decode requests per step (1 token each)"),
                        ("context", "context tokens each decode's attention reads per layer"),
                        ("prefix-tokens", "tokens of each arriving request's cached prefix"),
                        ("load-every", "a request arrives every K steps"), ("steps", "measured steps per run"),
                        ("warmup", "steps before the measured ones, per run")):  # fmt: skip
        attr = name.replace("-", "_")
        defaults = ", ".join(f"{n} {getattr(s, attr)}" for n, s in FULL_PLAN.shapes.items())
        p.add_argument(f"--{name}", type=int, help=f"{help_}, every shape (default: {defaults})")
    p.add_argument(
        "--defer-stores",
        action="store_true",
        help="submit a step's stores in the next step's transfer start, as vLLM 0.33's connector does (before its "
        "forward pass with a sync load, else after it is queued), instead of right after its compute is queued",
    )
    p.add_argument("--no-duplex", action="store_true", help="skip the duplex figure")
    p.add_argument("--duplex-repeats", type=int, default=DUPLEX_REPEATS, help="samples per duplex point "
                   f"(default {DUPLEX_REPEATS})")  # fmt: skip
    p.add_argument("--cpu-check", action="store_true", help="the CPU mode (tiny shapes, nothing timed) even with CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--integrity", action="store_true", help="also run triton_integrity (triton with the integrity "
                   "checks, docs/integrity.md) after the methods (before vllm_native, last in every round): their cost "
                   "per step, beside triton's")  # fmt: skip
    p.add_argument("--fp8", action="store_true", help=f"also run {FP8_METHOD} (triton over the FP8 host format, its "
                   "own host cache) after the methods: its load time beside triton's (bf16)")  # fmt: skip
    args = p.parse_args(argv)
    unknown = [w for w in args.workloads or () if w not in SERVING_WORKLOADS]
    if unknown:
        p.error(f"unknown or unmodelled workload(s) {unknown}; supported: {list(SERVING_WORKLOADS)}")
    try:
        method_points(args.methods or (), ())
    except ValueError as exc:
        p.error(str(exc))
    if args.duplex_repeats < 1:
        p.error(f"--duplex-repeats must be >= 1, got {args.duplex_repeats}")
    if args.rounds is not None and args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def run_plan(args, cuda: bool) -> RunPlan:
    """What runs: the preset's plan, the full run's, or the CPU check's; then the options given."""
    if args.preset:
        plan = PRESETS[args.preset]
        if not cuda:  # the preset's cases and methods at the CPU check's tiny shapes
            plan = dataclasses.replace(plan, shapes=CPU_SHAPES, duplex=False)
    else:
        plan = FULL_PLAN if cuda else CPU_PLAN
    if args.preset:  # the preset's cases, filtered
        cases = [(w, s) for w, s in plan.cases if (args.workloads is None or w in args.workloads)
                 and (args.shapes is None or s in args.shapes)]  # fmt: skip
    else:
        cases = [(w, s) for w in args.workloads or SERVING_WORKLOADS for s in args.shapes or SHAPE_NAMES]
    plan = dataclasses.replace(
        plan,
        cases=tuple(cases),
        methods=tuple(args.methods) if args.methods else plan.methods,
        triton_ctas=tuple(args.num_ctas) if args.num_ctas else plan.triton_ctas,
        load_modes=tuple(args.load_modes) if args.load_modes else plan.load_modes,
        rounds=args.rounds or plan.rounds,
        duplex=plan.duplex and not args.no_duplex and cuda,
    )
    if args.integrity:
        plan = with_integrity(plan)
    if args.fp8:
        plan = with_method(plan, FP8_METHOD)
    given = {k: getattr(args, k) for k in SHAPE_FIELDS if getattr(args, k) is not None}
    return plan.with_shapes(**given) if given else plan


def schedule(points: list[MethodPoint], rounds: int) -> list[tuple[MethodPoint, int]]:
    """(point, round) in run order: each round ``none`` first, then the other points (in reverse order every other
    round, so a linear drift cancels out of their means), then RUN_LAST's methods (``vllm_native``: a sticky fault
    there costs no other method's run of that round), and ``none`` once more at the end."""
    none = [p for p in points if p.method == "none"]
    last = sorted((p for p in points if p.method in RUN_LAST), key=lambda p: RUN_LAST.index(p.method))
    others = [p for p in points if p.method != "none" and p.method not in RUN_LAST]
    order = []
    for r in range(rounds):
        middle = others if r % 2 == 0 else others[::-1]
        order += [(p, r) for p in [*none, *middle, *last]]
    return order + [(p, rounds) for p in none]


def _row(
    setup: Setup,
    point: MethodPoint,
    mode: str,
    device: str,
    args,
    impl: str,
    problem: str | None,
    runs: list[LoopRun],
    note: str | None = None,
) -> dict:
    w, shape = setup.workload, setup.shape
    fields = dict(
        device=device, workload=w.name, shape=shape.name, layout=setup.layout, load_mode=mode, method=point.method,
        num_ctas=point.num_ctas, impl=impl, page_bytes=setup.spec.page_bytes[0], num_layers=setup.spec.num_layers,
        block_size=w.block_size, prefill_tokens=shape.prefill, decode_tokens=shape.decode,
        context_tokens=shape.context, prefix_tokens=shape.prefix_tokens, load_every=shape.load_every,
        steps=shape.steps, rounds=len(runs), defer_stores=args.defer_stores,
        byte_check="fail" if problem else "pass" if runs else "n/a", byte_check_note=problem or note,
    )  # fmt: skip
    if runs:
        fields.update(count_fields(runs))
        if setup.cuda and problem is None:  # wrong bytes are reported, never timed
            fields.update(timing_fields(runs, shape.warmup))
    return new_row(**fields)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _locate(exc: FatalCudaError, **where) -> None:
    """Notes on ``exc`` where the CUDA context died (``exc.at``; the innermost place that knew is kept)."""
    if getattr(exc, "at", None) is None:
        exc.at = where


class _Engines:
    """Each point's engine on one set-up, made on first use and kept for every load mode and round (so auto
    calibrates, and vLLM's worker pins its region, once), shut down at the end. A point that cannot run here, or
    whose run failed, is remembered and not run again."""

    def __init__(self, setup: Setup, env: Env):
        self.setup, self.env = setup, env
        self.engines: dict[MethodPoint, object] = {}
        self.unavailable: dict[MethodPoint, str] = {}
        self.formats: dict[str, Setup] = {}  # the set-ups of other host formats, made on first use

    def setup_for(self, point: MethodPoint) -> Setup:
        """The set-up the point runs on: the case's, or for a method of another host format (``triton_fp8``) the
        same caches and rings with that format's host cache and checks (:func:`bench.serving.fp8.fp8_setup`)."""
        fmt = METHODS[point.method].host_format
        if fmt == "native":
            return self.setup
        if fmt not in self.formats:
            self.formats[fmt] = fp8_setup(self.setup)
        return self.formats[fmt]

    def get(self, point: MethodPoint):
        if point not in self.engines:
            self.engines[point] = build_engine(point, self.setup_for(point).target)
        return self.engines[point]

    def drop(self, point: MethodPoint) -> None:
        engine = self.engines.pop(point, None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # the first error is the one reported
                pass

    def close(self) -> list[tuple[MethodPoint, str]]:
        """Shuts every engine down, each whatever the others raise; returns the points whose shutdown raised, with
        the error (none once the context is dead: the error that killed it is the one reported)."""
        errors = []
        for point in list(self.engines):
            engine = self.engines.pop(point)
            if engine is None:
                continue
            try:
                engine.shutdown()
            except Exception as exc:
                errors.append((point, _error(exc)))
        for fmt in list(self.formats):
            self.formats.pop(fmt).target.host_cache.close()
        return errors if self.env.alive() else []


def _run_point(engines: _Engines, point: MethodPoint, mode: str, defer: bool, exact: bool):
    """(run, problem, impl) of one run of one method: the loop with its per-job checks, then (``exact``) the
    byte-exact check of the final state. ``run`` is None where the method cannot run here (impl says why); any error
    of the method is its ``problem``, but one that leaves the CUDA context dead (or a FatalCudaError), which is
    raised as a FatalCudaError."""
    env, impl = engines.env, METHODS[point.method].describe
    try:
        setup = engines.setup_for(point)
        engine = engines.get(point)
        run = run_loop(setup, engine, load_mode=mode, defer_stores=defer)
        where = "its descriptors replayed by memmove" if getattr(engine, "path", None) == "dma" else "the interpreter"
        impl = run.impl or (impl if setup.cuda else f"{impl}; no CUDA: synchronous, {where}")
        if getattr(engine, "path", None) is not None:  # ours: how its jobs moved, and what its calibration took
            jobs = ", ".join(f"{d} {p} x{k}" for (d, p), k in sorted(run.paths.items()))
            cal = engine.calibration
            impl += f"; path {engine.path}: {jobs}" + (f"; calibrated in {cal.seconds:.3f} s" if cal else "")
        if setup is not engines.setup:  # another host format: its rows beside the native ones
            impl += f"; host rows of {setup.host.shape[1]} bytes (native: {engines.setup.host.shape[1]})"
        problem = run.check_problem or (byte_check(setup, run, host_rows_of(setup, engine)) if exact else None)
        return run, problem, impl
    except Unavailable as exc:  # cannot run on this machine: said in its row, not a failure
        return None, None, f"n/a: {exc}"
    except FatalCudaError:
        raise
    except Exception as exc:  # reported in its row; a dead CUDA context stops the run
        if not env.alive():
            raise FatalCudaError(f"{point.label} on {engines.setup.workload.name}: {_error(exc)}") from exc
        engines.drop(point)
        return None, f"ERROR: {_error(exc)}", impl


def _duplex_row(setup: Setup, point: MethodPoint, env: Env, repeats: int, contiguous_gbps: float | None) -> dict:
    try:
        return duplex(setup, point, repeats, contiguous_gbps)
    except FatalCudaError:
        raise
    except Exception as exc:  # reported in its row, as a run's
        if not env.alive():
            raise FatalCudaError(f"duplex {point.label} on {setup.workload.name}: {_error(exc)}") from exc
        return duplex_row(setup, point, f"ERROR: {_error(exc)}", contiguous_gbps)


def _say_row(r: dict) -> None:
    if r["byte_check"] == "n/a":  # cannot run on this machine: its impl says why
        say(f"    {r['impl']}", "yellow")
    elif r["byte_check"] != "pass":
        say(f"    FAIL: {r['byte_check_note']}", "bold red")
    elif r["step_ms_mean"] is not None:
        load = "" if r["load_latency_ms_median"] is None else f", load {r['load_latency_ms_median']} ms"
        say(f"    {MethodPoint(r['method'], r['num_ctas']).label}: step mean {r['step_ms_mean']} ms (p99 "
            f"{r['step_ms_p99']}){load}, submit {r['submit_cpu_us_per_step']} us/step, {r['offload_gbps']} GB/s "
            f"achieved, {r['jobs_checked']} jobs checked")  # fmt: skip
    else:
        say(f"    {MethodPoint(r['method'], r['num_ctas']).label}: bytes pass, {r['jobs_checked']} jobs checked")
    if r["byte_check"] == "pass" and r["byte_check_note"]:  # a row cut short
        say(f"    ({r['byte_check_note']})", "yellow")


FAILURE_KEYS = ("workload", "shape", "load_mode", "method", "num_ctas", "byte_check_note")


class _Results:
    """What a run has measured so far, and its JSON file (``--json``): rewritten whole, atomically (a temporary file,
    then a rename: bench.common.results.write_json), after every row, duplex point and case, so that the file always
    holds every finished row, each finished case's targets and, where the run stopped short, where and why.

    Rows are kept in table order (case, load mode, method point), whatever order they finish in; the relative
    columns and the run's targets are recomputed over every row at each write."""

    def __init__(self, path: str | None, doc: dict, plan: RunPlan, points: list[MethodPoint], cuda: bool):
        self.path, self.doc, self.cuda = path, doc, cuda
        self.rows: list[dict] = []
        self.duplex: list[dict] = []
        self.contiguous: dict[str, dict] = {}
        self.samples: dict[str, dict] = {}
        self.workloads: dict[str, dict] = {}
        self.drift: dict[str, dict] = {}
        self.cases: list[dict] = []
        self.errors: list[dict] = []  # failures outside a row: a case that stopped, an engine that would not shut down
        self.fatal: str | None = None
        self.fatal_at: dict | None = None
        cases = {c: i for i, c in enumerate(plan.cases)}
        modes = {m: i for i, m in enumerate(plan.load_modes)}
        order = {(p.method, p.num_ctas): i for i, p in enumerate(points)}
        self._key = lambda r: (cases[r["workload"], r["shape"]], modes[r["load_mode"]],
                               order[r["method"], r["num_ctas"]])  # fmt: skip

    def add_row(self, row: dict) -> None:
        self.rows.append(row)
        self.rows.sort(key=self._key)
        self.write()

    def add_duplex(self, row: dict) -> None:
        self.duplex.append(row)
        self.write()

    def targets(self, rows: list[dict], duplex_rows: list[dict]) -> list[dict]:
        """The targets over ``rows``: where something was timed (never on CPU)."""
        timed = self.cuda or any(r["step_ms_mean"] is not None for r in rows)
        return evaluate_targets(rows, duplex_rows) if timed else []

    def failures(self) -> list[dict]:
        failed = [r for r in self.rows + self.duplex if r["byte_check"] == "fail"]
        return [{k: r.get(k) for k in FAILURE_KEYS} for r in failed] + self.errors

    def write(self, complete: bool = False) -> None:
        fill_relative(self.rows, self.contiguous)
        if self.path:
            write_json(self.path, {**self.doc, "complete": complete, "workloads": self.workloads, "rows": self.rows,
                                   "drift": self.drift, "duplex": self.duplex, "contiguous": self.contiguous,
                                   "samples": self.samples, "cases": self.cases,
                                   "targets": self.targets(self.rows, self.duplex), "failures": self.failures(),
                                   "fatal": self.fatal, "fatal_at": self.fatal_at})  # fmt: skip

    def start_case(self, workload: str, shape: str) -> dict:
        case = {"workload": workload, "shape": shape, "status": "running", "error": None, "rows": 0, "targets": []}
        self.cases.append(case)
        self.write()
        return case

    def end_case(self, case: dict, duplex_rows: list[dict]) -> None:
        """The case's table and targets, printed and written, from its rows (and the duplex points it measured)."""
        fill_relative(self.rows, self.contiguous)
        rows = [r for r in self.rows if (r["workload"], r["shape"]) == (case["workload"], case["shape"])]
        case["rows"] = len(rows)
        case["targets"] = self.targets(rows, duplex_rows)
        if case["status"] == "running":
            case["status"] = "done"
        self.write()
        say(f"{case['workload']}, {case['shape']}: {case['status']}" + (f" ({case['error']})" if case["error"] else ""),
            "bold green" if case["status"] == "done" else "bold red")  # fmt: skip
        if rows:
            print_rows(rows, self.cuda)
        print_duplex(duplex_rows)
        if case["targets"]:
            print_targets(case["targets"])

    def stop(self, case: dict, exc: Exception, env: Env) -> None:
        """A case that raised: where the CUDA context died (the rest of the run is lost), or an error of the case
        alone (recorded as a failure; the run goes on)."""
        case["error"] = _error(exc) if not isinstance(exc, FatalCudaError) else str(exc)
        if isinstance(exc, FatalCudaError) or not env.alive():
            case["status"] = "fatal"
            self.fatal = case["error"]
            self.fatal_at = getattr(exc, "at", None) or {"workload": case["workload"], "shape": case["shape"]}
            say(f"FATAL: the CUDA context is unusable after {self.fatal}; stopping, results so far follow", "bold red")
        else:
            case["status"] = "error"
            self.errors.append({**dict.fromkeys(FAILURE_KEYS), "workload": case["workload"], "shape": case["shape"],
                                "byte_check_note": f"ERROR: the case stopped: {case['error']}"})  # fmt: skip
            say(f"ERROR: {case['workload']}, {case['shape']} stopped: {case['error']}; going on", "bold red")


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu_check
    plan = run_plan(args, cuda)
    if cuda:
        device, _, env, meta = open_gpu()
    else:
        device = torch.device("cpu")
        env = Env(device, None, "no CUDA device: the driver's batch calls run in a memmove stand-in")
        meta = environment(device, env.driver_note)
    mode = "gpu" if cuda else "cpu-interpreter-check"
    print_header(meta, "GPU" if cuda else "CPU check (Triton interpreter, tiny shapes)", "serving")
    if not cuda:
        say("No CUDA device: running the serving loop at tiny shapes to check every byte. NOTHING IS TIMED.",
            style="bold yellow")  # fmt: skip
    try:
        for w, shape in plan.cases:
            plan.shape(shape).check((WORKLOADS[w] if cuda else WORKLOADS[w].tiny()).block_size)
    except ValueError as exc:
        raise SystemExit(f"bench.serving: {exc}") from None
    points = method_points(plan.methods, plan.triton_ctas)
    doc = {"benchmark": "serving", "mode": mode, **meta, "args": dict(vars(args)), "preset": args.preset,
           "plan": {"cases": [list(c) for c in plan.cases], "methods": list(plan.methods),
                    "triton_ctas": list(plan.triton_ctas), "load_modes": list(plan.load_modes),
                    "rounds": plan.rounds, "shapes": {n: dataclasses.asdict(s) for n, s in plan.shapes.items()}},
           "load_modes": list(plan.load_modes), "load_mode_sources": LOAD_MODE_SOURCES,
           "submit_timing": SUBMIT_TIMING}  # fmt: skip
    results = _Results(args.json, doc, plan, points, cuda)
    for w, shape in plan.cases:
        first_of_workload = next(c for c in plan.cases if c[0] == w) == (w, shape)
        case = results.start_case(w, shape)
        measured = len(results.duplex)
        try:
            _run_case(WORKLOADS[w] if cuda else WORKLOADS[w].tiny(), plan, shape, points, env, meta, args, results,
                      duplex_too=plan.duplex and first_of_workload)  # fmt: skip
        except Exception as exc:  # one case's error costs that case's rest; a dead context the run's
            results.stop(case, exc, env)
        results.end_case(case, results.duplex[measured:])
        if results.fatal:
            break
    targets = results.targets(results.rows, results.duplex)
    if len(results.cases) > 1 and targets:  # over every case (each case's own are above)
        print_targets(targets)
    ran = [r for r in results.rows if r["byte_check"] != "n/a"]
    na = len(results.rows) - len(ran)
    failures = results.failures()
    say(
        f"{sum(r['byte_check'] == 'pass' for r in ran)} of {len(ran)} runs byte-checked pass"
        + (f" ({na} n/a: cannot run here, not counted)" if na else "")
        + f"; {sum(r['jobs_checked'] or 0 for r in ran)} jobs' bytes checked as they completed"
        + ("" if cuda else "; nothing was timed: this machine has no CUDA device (or --cpu-check)"),
        style="bold red" if failures or results.fatal else "bold green",
    )
    results.write(complete=results.fatal is None)
    if args.json:
        say(f"wrote {args.json}")
    if args.plot:
        why = plot_serving(results.samples, results.contiguous, args.plot,
                           f"{meta['device']} -- triton-offload serving step loop")  # fmt: skip
        say(why or f"wrote {args.plot}")
    return 1 if failures or results.fatal else 0


def _run_case(w, plan: RunPlan, shape_name: str, points, env, meta, args, results: _Results, duplex_too: bool) -> None:
    """Every load mode, round and method on one workload in one shape (then its duplex figure), into ``results``:
    each (load mode, point)'s row as soon as its last run is done (or it failed, or cannot run here). A point's error
    is its row's; a FatalCudaError (the CUDA context died) first writes a row for every point that ran in the load
    mode so far (their runs until then: ``rounds`` says how many, ``byte_check_note`` that the row was cut short),
    then propagates with where it happened (``exc.at``)."""
    cuda, name, shape = env.cuda, w.name, plan.shape(shape_name)
    say(f"{name}, {shape_name}: {w.model.source}; {shape.prefill} prefill + {shape.decode} decode tokens per step"
        + (f", each decode reading {shape.context} tokens of KV" if shape.context else ""))  # fmt: skip
    where = {"workload": name, "shape": shape_name}
    setup = setup_workload(w, args.layout, shape, env, args.seed)
    engines = _Engines(setup, env)
    try:
        model = dataclasses.asdict(w.model)
        entry = results.workloads.setdefault(name, {"model": model, "bytes_per_block": setup.spec.bytes_per_block,
                                                    "sizes": {}})  # fmt: skip
        entry["sizes"][shape_name] = dataclasses.asdict(setup.sizes)
        nbytes = setup.sizes.prefix_blocks * setup.spec.bytes_per_block
        case = f"{name}/{shape_name}"  # the shapes' prefixes differ in size
        if cuda:
            results.contiguous[case] = contiguous_load(setup, nbytes, CONTIGUOUS_REPEATS)
            say(f"  contiguous pinned copy of one prefix ({nbytes / 2**20:.0f} MiB): {results.contiguous[case]}")
        order = schedule(points, plan.rounds)
        for mode in plan.load_modes:
            _run_mode(setup, engines, order, plan, mode, points, meta, args, results)
        if duplex_too:
            for point in DUPLEX_POINTS:
                if point in points:
                    gbps = results.contiguous.get(case, {}).get("gbps")
                    try:
                        row = _duplex_row(setup, point, env, args.duplex_repeats, gbps)
                    except FatalCudaError as exc:
                        _locate(exc, **where, during="duplex", method=point.method, num_ctas=point.num_ctas)
                        raise
                    results.add_duplex(row)
    finally:
        try:
            for point, error in engines.close():  # each engine's error its own failure; the case's rows stand
                results.errors.append({**dict.fromkeys(FAILURE_KEYS), **where, "method": point.method,
                                       "num_ctas": point.num_ctas,
                                       "byte_check_note": f"ERROR at shutdown: {error}"})  # fmt: skip
                say(f"  FAIL: {point.label}'s shutdown: {error}", "bold red")
        finally:
            try:
                setup.close()
                del setup
                release(env.device)
            except RuntimeError:  # a dead context fails every sync: the FatalCudaError in flight says why
                if env.alive():
                    raise


def _run_mode(setup: Setup, engines: _Engines, order, plan: RunPlan, mode: str, points, meta, args, results) -> None:
    """One load mode of a case: ``order``'s runs, each point's row written as soon as it is done."""
    cuda, name, shape_name = setup.cuda, setup.workload.name, setup.shape.name
    group = f"{name}/{shape_name}/{mode}"
    last_run = {p: i for i, (p, _) in enumerate(order)}
    planned = collections.Counter(p for p, _ in order)
    runs: dict[MethodPoint, list[LoopRun]] = collections.defaultdict(list)
    problems: dict[MethodPoint, str] = {}
    impls: dict[MethodPoint, str] = {}
    pending = list(points)

    def finish(point: MethodPoint, note: str | None = None) -> None:
        """The point's row in this mode, written."""
        pending.remove(point)
        # Nothing is timed without CUDA: no drift either.
        results.drift[group] = drift_of(runs.get(MethodPoint("none"), []) if cuda else [])
        impl = engines.unavailable.get(point) or impls.get(point, METHODS[point.method].describe)
        row = _row(setup, point, mode, meta["device"], args, impl, problems.get(point), runs.get(point, []), note)
        if point.method == "none" and row["step_ms_mean"] is not None:
            row["drift_vs_none"] = results.drift[group]["drift_vs_none"]
        if cuda and point not in problems and runs.get(point):
            results.samples.setdefault(group, {})[point.label] = {
                "step_ms": [round(r.step_s * 1e3, 4) for run in runs[point] for r in run.records],
                "load_step": [int(r.load_step) for run in runs[point] for r in run.records],
                "run": [k for k, run in enumerate(runs[point]) for _ in run.records],
                "load_latency_ms": [round(ld.latency_s * 1e3, 4) for run in runs[point]
                                    for ld in run.loads.values() if ld.measured and ld.latency_s is not None],
            }  # fmt: skip
        results.add_row(row)
        _say_row(row)

    point, rnd = None, None
    try:
        for i, (point, rnd) in enumerate(order):
            if point not in pending:  # done, failed in this mode
                continue
            if point in engines.unavailable:  # found unable to run here in an earlier mode
                finish(point)
                continue
            say(f"  {group} round {rnd + 1}: {point.label}")
            # The byte-exact check of the final state: every run without CUDA; on a GPU a point's last run (in
            # the last mode), the per-job checks having seen every job of every run.
            exact = not cuda or (mode == plan.load_modes[-1] and i == last_run[point])
            try:
                run, problem, impl = _run_point(engines, point, mode, args.defer_stores, exact)
            except FatalCudaError as exc:
                problems[point] = f"FATAL: the CUDA context died: {exc}"
                _locate(exc, workload=name, shape=shape_name, load_mode=mode, method=point.method,
                        num_ctas=point.num_ctas, round=rnd + 1, during="loop")  # fmt: skip
                raise
            impls[point] = impl
            if run is None and problem is None:
                engines.unavailable[point] = impl
                finish(point)
            elif problem is not None:
                problems[point] = problem
                say(f"    FAIL: {problem}", "bold red")
                finish(point)
            else:
                runs[point].append(run)
                if i == last_run[point]:
                    finish(point)
    except Exception as exc:  # keep what ran: each point that ran gets its row, cut short
        stopped = f"{point.label}, round {rnd + 1}" if point is not None else "its start"
        for p in [p for p in pending if p in problems or runs.get(p)]:
            cut = None if p in problems else (f"cut short: {len(runs[p])} of {planned[p]} runs in this load mode; "
                                              f"the run stopped at {stopped}: {_error(exc)}")  # fmt: skip
            finish(p, cut)
        raise
    for p in list(pending):  # none left in a full run; kept so every point has its row
        finish(p)


if __name__ == "__main__":
    sys.exit(main())
