"""The GPU mode: for every workload, layout, size, host format and direction, each method is byte-checked on that
exact case and then timed; then the extras (CPU cost per call, GEMM interference) and the targets."""

from __future__ import annotations

from collections.abc import Callable

from bench.common.case import TransferCase
from bench.common.env import Env, FatalCudaError, open_gpu, print_header, release
from bench.common.grid import EXTRAS_BASELINES, EXTRAS_BLOCKS, EXTRAS_LAYOUT, EXTRAS_WORKLOAD, grid
from bench.common.report import ProgressBar, print_table, say
from bench.common.results import fill_relative, integrity_pairs
from bench.common.timing import GpuTimer
from bench.common.workloads import WORKLOADS, Workload, resolve_workloads
from bench.transfer.extras import cpu_overhead, interference
from bench.transfer.session import Group, MethodSpec, Session, allocate, make_case, method_specs
from bench.transfer.summary import evaluate_targets, print_extras, print_results, print_targets
from triton_offload.kernels.shapes import DEFAULT_NUM_CTAS

__all__ = ["selected_groups", "run_gpu"]


def selected_groups(args) -> list[tuple[Workload, str]]:
    """(workload, layout) pairs after --workloads / --layouts (--quick: one layout per workload)."""
    groups = []
    for w in resolve_workloads(args.workloads):
        layouts = [lay for lay in w.layouts if not args.layouts or lay in args.layouts]
        if args.quick and not args.layouts:
            layouts = layouts[:1]
        groups += [(w, layout) for layout in layouts]
    if not groups:
        raise SystemExit(f"no workload/layout left after the filters (layouts: {args.layouts})")
    return groups


def _measure(run: Session, group: Group, case: TransferCase, ms: MethodSpec, timer: GpuTimer, budget_ms: float):
    """The row of one method on one case: its byte check on this very case, then (only after a pass) its timing."""
    peak_key = (case.direction, case.total_bytes)
    if ms.label == "peak" and peak_key in run.peak_cache:  # the link does not care which layout the bytes had
        impl, timing = run.peak_cache[peak_key]
        return run.row(group, case, ms, impl, "pass", "timed once per direction and size", timing)
    status, note, prepared = run.check(group, case, ms)
    impl = prepared and prepared.impl
    if status != "pass":
        return run.row(group, case, ms, impl, status, note)
    try:
        timing = timer(prepared.run, budget_ms, device_ms=prepared.device_ms)
    except Exception as exc:
        if not run.env.alive():
            raise FatalCudaError(f"timing {ms.name} on {group.workload.name}/{group.layout}: {exc}") from exc
        run.record_check(group, case, ms, "ERROR", f"while timing: {exc!r}")
        return run.row(group, case, ms, impl, "ERROR", f"while timing: {exc!r}")
    if ms.label == "peak":
        run.peak_cache[peak_key] = (impl, timing)
    return run.row(group, case, ms, impl, "pass", "", timing)


def _measure_group(run: Session, group: Group, blocks, host_configs, timer: GpuTimer, args, bar: ProgressBar) -> None:
    cases = [(n, f, skip, store) for n in blocks for f, skip in host_configs for store in (True, False)]
    for n, f, skip, store in cases:
        case = make_case(group, n, f, skip, store)
        for ms in run.specs:
            item = f"{group.workload.name}/{group.layout} n={n} f={f} {case.direction} {ms.name}"
            bar.describe(item)
            run.rows.append(_measure(run, group, case, ms, timer, args.budget_ms))
            bar.advance(item)


def run_gpu(args, checkpoint: Callable[[dict], None]) -> tuple[dict, int]:
    """Runs the GPU mode; ``checkpoint`` gets the (incomplete) results document after every workload/layout group,
    so a run killed mid-way keeps what it measured. Returns the final document and the exit code."""
    device, stream, env, meta = open_gpu()
    print_header(meta, "GPU")
    mode = grid(args.quick)
    sweep = sorted(set(args.num_ctas or mode.num_ctas) | {DEFAULT_NUM_CTAS})
    blocks = sorted(args.blocks or mode.blocks)
    host_configs = mode.host_configs
    groups = [] if args.no_sweep else selected_groups(args)
    run = Session(meta, env, method_specs(sweep, integrity=getattr(args, "integrity", False)), stream)
    timer = GpuTimer(stream, device, args.hide_us)
    overhead = inter = fatal = None
    try:
        per_group = len(run.specs) * len(blocks) * len(host_configs) * 2
        with ProgressBar(len(groups) * per_group) as bar:
            for w, layout in groups:
                bar.describe(f"allocating {w.name}/{layout}")
                group = allocate(w, layout, blocks[-1], host_configs, device, args.seed)
                _measure_group(run, group, blocks, host_configs, timer, args, bar)
                del group
                release(device)
                fill_relative(run.rows)
                checkpoint(run.result("gpu", args, complete=False))
        if not (args.no_overhead and args.no_interference):
            overhead, inter = run_extras(run, args, env, stream, sweep)
    except FatalCudaError as exc:
        # Keep what was measured before the context died; report it and stop.
        fatal = str(exc)
        run.failures.append({"status": "FATAL", "note": fatal})
        say(f"FATAL: the CUDA context is unusable after {fatal}; stopping, results so far follow", "bold red")
    fill_relative(run.rows)
    print_results(run.rows, sweep)
    methods = run.method_impls() + [(m, f"skipped: {why}") for m, why in run.skipped.items()]
    print_table("Methods", ["method", "implementation"], methods, wrap_last=True)
    print_extras(overhead, inter, f"{EXTRAS_BLOCKS} blocks x 80 layers ({EXTRAS_WORKLOAD}, {EXTRAS_LAYOUT})")
    targets = evaluate_targets(run.rows, overhead, inter)
    print_targets(targets)
    result = run.result(
        "gpu",
        args,
        complete=fatal is None,
        timing="CUDA events around one call each, after an L2 flush and a GPU sleep that hide the call's host work "
        "up to ~300 us, on a dedicated non-default stream; median/p20/p80 over samples; GB/s = total_bytes / median; "
        "call_cpu_us = median host time of the same calls",
        cpu_overhead=overhead,
        interference=inter,
        targets=targets,
        integrity=integrity_pairs(run.rows, DEFAULT_NUM_CTAS) if getattr(args, "integrity", False) else None,
        calibrations=env.calibrations,
        fatal=fatal,
    )
    return result, 1 if run.failures else 0


def run_extras(run: Session, args, env: Env, stream, sweep) -> tuple[dict | None, dict | None]:
    """CPU cost per call and GEMM interference, on Llama-3-70B TP8 pages at 1024 blocks x 80 layers."""
    w = WORKLOADS[EXTRAS_WORKLOAD]
    say(f"extras on {w.name}/{EXTRAS_LAYOUT}, {EXTRAS_BLOCKS} blocks x {w.num_layers} layers")
    group = allocate(w, EXTRAS_LAYOUT, EXTRAS_BLOCKS, ((1, 0),), env.device, args.seed + 1)
    cases = {d: make_case(group, EXTRAS_BLOCKS, 1, 0, d == "store") for d in ("store", "load")}
    # Only methods that moved the right bytes here are timed.
    used = method_specs(sweep, baselines=EXTRAS_BASELINES)
    ok = set()
    for d, case in cases.items():
        for ms in used:
            status, _, _ = run.check(group, case, ms)
            if status == "pass":
                ok.add((ms.label, ms.num_ctas, d))
    overhead = inter = None
    if not args.no_overhead and ("triton", DEFAULT_NUM_CTAS, "store") in ok:
        bursts, per_burst = grid(args.quick).bursts
        overhead = cpu_overhead({"gather": cases["store"], "scatter": cases["load"]}, env, stream, bursts, per_burst)
    if not args.no_interference:
        preparers = {
            (d, ms.label, ms.num_ctas): (lambda ms=ms, case=case: ms.prepare(case, env))
            for d, case in cases.items()
            for ms in used
            if (ms.label, ms.num_ctas, d) in ok
        }
        iters, repeats = grid(args.quick).gemm_runs
        try:
            inter = interference(preparers, cases["store"].total_bytes, env, stream, args.gemm_size, iters, repeats)
        except RuntimeError as exc:
            if env.alive():
                raise
            raise FatalCudaError(f"the interference measurement: {exc}") from exc
        inter.update(workload=w.name, layout=EXTRAS_LAYOUT, blocks=EXTRAS_BLOCKS)
    del group, cases
    release(env.device)
    return overhead, inter
