#!/usr/bin/env python3
"""What a serving engine sees: a vLLM-like worker step loop on one GPU (model compute + offload traffic), per method.

    python -m bench.serving [--preset decisive] [--json PATH] [--plot PATH] [--workloads NAME ...]
                            [--shapes prefill-heavy decode-heavy] [--load-modes async sync] [--methods NAME ...]
                            [--rounds R] [--prefill N] [--decode N] [--context N] [--prefix-tokens N] [--steps N]

Each step runs the model's per-layer matrix products in bf16 (each workload's real per-GPU shapes) over a prefill
chunk and decode tokens (decode-heavy: with each decode's attention read of its KV), writing the step's KV into its
GPU blocks; the blocks it completed are stored to the host cache, and every few steps an arriving request's cached
prefix is loaded, synchronously before its step or asynchronously beside the others (vLLM 0.33's default). The same
loop runs with no offload (``none``), with our TransferEngine (``triton``, ``auto``), with vLLM 0.33's data path
(``vllm033``), vLLM 0.33's own worker (``vllm_native``) and cuMemcpyBatchAsync both ways (``memcpy_batch``), in
rounds with ``none`` between them; every job's bytes are checked while it runs. Without CUDA it runs at tiny shapes
through the Triton interpreter and times nothing. See docs/benchmarks.md, "The serving benchmark".

Roles (bench/serving/): this module is the command line and the run; config the shapes, load modes, plans and
presets, model the compute, blocks the block plan, methods the engines, loop the loop and the byte-exact check, check
the per-job checks, gpu the contiguous copy and the duplex figure, report the rows, drift, targets, tables and PNG.
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
    FULL_PLAN,
    LOAD_MODES,
    PRESETS,
    RUN_LAST,
    SERVING_WORKLOADS,
    SHAPE_NAMES,
    RunPlan,
    with_integrity,
)
from bench.serving.gpu import contiguous_load, duplex
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
from triton_offload.kernels.copy_blocks import DEFAULT_NUM_CTAS

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
    p.add_argument("--json", metavar="PATH", help="write the rows, drift, duplex, targets and samples (rewritten "
                   "after every workload and shape, so a killed run keeps what it measured)")  # fmt: skip
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
                   "checks, docs/integrity.md) after the methods: their cost per step, beside triton's")  # fmt: skip
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
    setup: Setup, point: MethodPoint, mode: str, device: str, args, impl: str, problem: str | None, runs: list[LoopRun]
) -> dict:
    w, shape = setup.workload, setup.shape
    fields = dict(
        device=device, workload=w.name, shape=shape.name, layout=setup.layout, load_mode=mode, method=point.method,
        num_ctas=point.num_ctas, impl=impl, page_bytes=setup.spec.page_bytes[0], num_layers=setup.spec.num_layers,
        block_size=w.block_size, prefill_tokens=shape.prefill, decode_tokens=shape.decode,
        context_tokens=shape.context, prefix_tokens=shape.prefix_tokens, load_every=shape.load_every,
        steps=shape.steps, rounds=len(runs), defer_stores=args.defer_stores,
        byte_check="fail" if problem else "pass" if runs else "n/a", byte_check_note=problem,
    )  # fmt: skip
    if runs:
        fields.update(count_fields(runs))
        if setup.cuda and problem is None:  # wrong bytes are reported, never timed
            fields.update(timing_fields(runs, shape.warmup))
    return new_row(**fields)


class _Engines:
    """Each point's engine on one set-up, made on first use and kept for every load mode and round (so auto
    calibrates, and vLLM's worker pins its region, once), shut down at the end. A point that cannot run here, or
    whose run failed, is remembered and not run again."""

    def __init__(self, setup: Setup, env: Env):
        self.setup, self.env = setup, env
        self.engines: dict[MethodPoint, object] = {}
        self.unavailable: dict[MethodPoint, str] = {}

    def get(self, point: MethodPoint):
        if point not in self.engines:
            self.engines[point] = build_engine(point, self.setup.target)
        return self.engines[point]

    def drop(self, point: MethodPoint) -> None:
        engine = self.engines.pop(point, None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # the first error is the one reported
                pass

    def close(self) -> None:
        for point in list(self.engines):
            engine = self.engines.pop(point)
            if engine is not None:
                engine.shutdown()


def _run_point(engines: _Engines, point: MethodPoint, mode: str, defer: bool, exact: bool):
    """(run, problem, impl) of one run of one method: the loop with its per-job checks, then (``exact``) the
    byte-exact check of the final state. ``run`` is None where the method cannot run here (impl says why)."""
    setup, env = engines.setup, engines.env
    impl = METHODS[point.method].describe
    try:
        engine = engines.get(point)
        run = run_loop(setup, engine, load_mode=mode, defer_stores=defer)
        where = "its descriptors replayed by memmove" if getattr(engine, "path", None) == "dma" else "the interpreter"
        impl = run.impl or (impl if setup.cuda else f"{impl}; no CUDA: synchronous, {where}")
        if getattr(engine, "path", None) is not None:  # ours: how its jobs moved, and what its calibration took
            jobs = ", ".join(f"{d} {p} x{k}" for (d, p), k in sorted(run.paths.items()))
            cal = engine.calibration
            impl += f"; path {engine.path}: {jobs}" + (f"; calibrated in {cal.seconds:.3f} s" if cal else "")
        problem = run.check_problem or (byte_check(setup, run, host_rows_of(setup, engine)) if exact else None)
        return run, problem, impl
    except Unavailable as exc:  # cannot run on this machine: said in its row, not a failure
        return None, None, f"n/a: {exc}"
    except Exception as exc:  # reported in its row; a dead CUDA context stops the run
        if not env.alive():
            raise FatalCudaError(f"{point.label} on {setup.workload.name}: {exc}") from exc
        engines.drop(point)
        return None, f"ERROR: {type(exc).__name__}: {exc}", impl


def _duplex_row(setup: Setup, point: MethodPoint, env: Env, repeats: int, contiguous_gbps: float | None) -> dict:
    try:
        return duplex(setup, point, repeats, contiguous_gbps)
    except Exception as exc:  # reported in its row, as a run's
        if not env.alive():
            raise FatalCudaError(f"duplex {point.label} on {setup.workload.name}: {exc}") from exc
        note = f"ERROR: {type(exc).__name__}: {exc}"
        return {"workload": setup.workload.name, "method": point.method, "num_ctas": point.num_ctas,
                "byte_check": "fail", "byte_check_note": note, "ratio": None}  # fmt: skip


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
    rows, duplex_rows, contiguous, samples, workloads, drift = [], [], {}, {}, {}, {}
    doc = {"benchmark": "serving", "mode": mode, **meta, "args": dict(vars(args)), "preset": args.preset,
           "plan": {"cases": [list(c) for c in plan.cases], "methods": list(plan.methods),
                    "triton_ctas": list(plan.triton_ctas), "load_modes": list(plan.load_modes),
                    "rounds": plan.rounds, "shapes": {n: dataclasses.asdict(s) for n, s in plan.shapes.items()}},
           "load_modes": list(plan.load_modes), "load_mode_sources": LOAD_MODE_SOURCES,
           "submit_timing": SUBMIT_TIMING}  # fmt: skip

    def write(complete: bool, **extra) -> None:
        if args.json:
            write_json(args.json, {**doc, "complete": complete, "workloads": workloads, "rows": rows,
                                   "drift": drift, "duplex": duplex_rows, "contiguous": contiguous,
                                   "samples": samples, **extra})  # fmt: skip

    fatal = None
    try:
        for w, shape in plan.cases:
            state = (rows, duplex_rows, contiguous, samples, workloads, drift)
            first_of_workload = next(c for c in plan.cases if c[0] == w) == (w, shape)
            _run_case(WORKLOADS[w] if cuda else WORKLOADS[w].tiny(), plan, shape, points, env, meta, args, state,
                      duplex_too=plan.duplex and first_of_workload)  # fmt: skip
            fill_relative(rows, contiguous)
            write(False)
    except FatalCudaError as exc:  # keep what was measured before the context died
        fatal = str(exc)
        say(f"FATAL: the CUDA context is unusable after {fatal}; stopping, results so far follow", "bold red")
    fill_relative(rows, contiguous)
    print_rows(rows, cuda)
    print_duplex(duplex_rows)
    targets = evaluate_targets(rows, duplex_rows) if cuda else []
    if cuda:
        print_targets(targets)
    failed = [r for r in rows + duplex_rows if r["byte_check"] == "fail"]
    ran = [r for r in rows if r["byte_check"] != "n/a"]
    na = len(rows) - len(ran)
    say(
        f"{sum(r['byte_check'] == 'pass' for r in ran)} of {len(ran)} runs byte-checked pass"
        + (f" ({na} n/a: cannot run here, not counted)" if na else "")
        + f"; {sum(r['jobs_checked'] or 0 for r in ran)} jobs' bytes checked as they completed"
        + ("" if cuda else "; nothing was timed: this machine has no CUDA device (or --cpu-check)"),
        style="bold red" if failed else "bold green",
    )
    failures = [{k: r.get(k) for k in ("workload", "shape", "load_mode", "method", "num_ctas", "byte_check_note")}
                for r in failed]  # fmt: skip
    write(fatal is None, targets=targets, failures=failures, fatal=fatal)
    if args.json:
        say(f"wrote {args.json}")
    if args.plot:
        why = plot_serving(samples, contiguous, args.plot, f"{meta['device']} -- triton-offload serving step loop")
        say(why or f"wrote {args.plot}")
    return 1 if failed or fatal else 0


def _run_case(w, plan: RunPlan, shape_name: str, points, env, meta, args, state, duplex_too: bool) -> None:
    """Every load mode, round and method on one workload in one shape (then its duplex figure), into ``state``."""
    rows, duplex_rows, contiguous, samples, workloads, drift = state
    cuda, name, shape = env.cuda, w.name, plan.shape(shape_name)
    say(f"{name}, {shape_name}: {w.model.source}; {shape.prefill} prefill + {shape.decode} decode tokens per step"
        + (f", each decode reading {shape.context} tokens of KV" if shape.context else ""))  # fmt: skip
    setup = setup_workload(w, args.layout, shape, env, args.seed)
    engines = _Engines(setup, env)
    try:
        entry = workloads.setdefault(name, {"model": dataclasses.asdict(w.model),
                                            "bytes_per_block": setup.spec.bytes_per_block, "sizes": {}})  # fmt: skip
        entry["sizes"][shape_name] = dataclasses.asdict(setup.sizes)
        nbytes = setup.sizes.prefix_blocks * setup.spec.bytes_per_block
        case = f"{name}/{shape_name}"  # the shapes' prefixes differ in size
        if cuda:
            contiguous[case] = contiguous_load(setup, nbytes, CONTIGUOUS_REPEATS)
            say(f"  contiguous pinned copy of one prefix ({nbytes / 2**20:.0f} MiB): {contiguous[case]}")
        order = schedule(points, plan.rounds)
        last_run = {p: i for i, (p, _) in enumerate(order)}
        for mode in plan.load_modes:
            runs: dict[MethodPoint, list[LoopRun]] = collections.defaultdict(list)
            problems: dict[MethodPoint, str] = {}
            impls: dict[MethodPoint, str] = {}
            for i, (point, rnd) in enumerate(order):
                if point in problems or point in engines.unavailable:
                    continue
                say(f"  {name}/{shape_name}/{mode} round {rnd + 1}: {point.label}")
                # The byte-exact check of the final state: every run without CUDA; on a GPU a point's last run (in
                # the last mode), the per-job checks having seen every job of every run.
                exact = not cuda or (mode == plan.load_modes[-1] and i == last_run[point])
                run, problem, impl = _run_point(engines, point, mode, args.defer_stores, exact)
                impls[point] = impl
                if run is None and problem is None:
                    engines.unavailable[point] = impl
                    continue
                if problem is not None:
                    problems[point] = problem
                    say(f"    FAIL: {problem}", "bold red")
                    continue
                runs[point].append(run)
            group = f"{name}/{shape_name}/{mode}"
            # Nothing is timed without CUDA: no drift either.
            drift[group] = drift_of(runs.get(MethodPoint("none"), []) if cuda else [])
            for point in points:
                impl = engines.unavailable.get(point) or impls.get(point, METHODS[point.method].describe)
                row = _row(setup, point, mode, meta["device"], args, impl, problems.get(point), runs.get(point, []))
                if point.method == "none" and row["step_ms_mean"] is not None:
                    row["drift_vs_none"] = drift[group]["drift_vs_none"]
                rows.append(row)
                _say_row(row)
                if cuda and point not in problems and runs.get(point):
                    samples.setdefault(group, {})[point.label] = {
                        "step_ms": [round(r.step_s * 1e3, 4) for run in runs[point] for r in run.records],
                        "load_step": [int(r.load_step) for run in runs[point] for r in run.records],
                        "run": [k for k, run in enumerate(runs[point]) for _ in run.records],
                        "load_latency_ms": [round(ld.latency_s * 1e3, 4) for run in runs[point]
                                            for ld in run.loads.values() if ld.measured and ld.latency_s is not None],
                    }  # fmt: skip
        if duplex_too:
            for point in DUPLEX_POINTS:
                if point in points:
                    gbps = contiguous.get(case, {}).get("gbps")
                    duplex_rows.append(_duplex_row(setup, point, env, args.duplex_repeats, gbps))
    finally:
        try:
            engines.close()
        finally:
            try:
                setup.close()
                del setup
                release(env.device)
            except RuntimeError:  # a dead context fails every sync: the FatalCudaError in flight says why
                if env.alive():
                    raise


if __name__ == "__main__":
    sys.exit(main())
