#!/usr/bin/env python3
"""What a serving engine sees: a vLLM-like worker step loop on one GPU (model compute + offload traffic), per method.

    python bench/serving.py [--json PATH] [--plot PATH] [--workloads NAME ...] [--methods NAME ...]
                            [--prefill N] [--decode N] [--prefix-tokens N] [--load-every K] [--steps N]

Each step runs the model's per-layer matrix products in bf16 (each workload's real per-GPU shapes) over a prefill
chunk and decode tokens, writing the step's KV into its GPU blocks; the blocks it completed are stored to the host
cache, and every few steps an arriving request's cached prefix is loaded before its step. The same loop runs with no
offload (``none``), with our TransferEngine (``triton``, at several num_ctas), with vLLM 0.33's data path
(``vllm033``) and with cuMemcpyBatchAsync both ways (``dma``); after each run every stored and loaded byte is
checked. Without CUDA it runs at tiny shapes through the Triton interpreter and times nothing. See bench/README.md,
"Serving benchmark".

Roles: this file is the command line and the run; serving_config.py the loop's shape, serving_model.py the compute,
serving_blocks.py the block plan, serving_methods.py the methods, serving_loop.py the loop and the byte check,
serving_gpu.py the contiguous copy and the duplex figure, serving_report.py the rows, targets, tables and PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from triton_offload.kernels.copy_blocks import DEFAULT_NUM_CTAS

# isort: split
# Sibling modules: bench/ is on sys.path when this runs as a script (it is not a package).
from case import Env, Unavailable
from report import say
from results import write_json
from serving_config import (
    CONTIGUOUS_REPEATS,
    CPU_LOOP,
    DEFAULT_METHODS,
    DUPLEX_REPEATS,
    GPU_LOOP,
    SERVING_WORKLOADS,
    LoopShape,
)
from serving_gpu import contiguous_load, duplex
from serving_loop import LoopRun, Setup, byte_check, run_loop, setup_workload
from serving_methods import METHODS, MethodPoint, build_engine, method_points
from serving_report import (
    count_fields,
    evaluate_targets,
    fill_relative,
    new_row,
    plot_serving,
    print_duplex,
    print_rows,
    timing_fields,
)
from session import FatalCudaError, environment, open_gpu, release
from summary import print_header, print_targets
from workloads import WORKLOADS

# The methods the duplex figure is measured for (our default and the copy engines), when they are in the run.
DUPLEX_POINTS = (MethodPoint("triton", DEFAULT_NUM_CTAS), MethodPoint("dma"))
SUBMIT_TIMING = (
    "wall time (perf_counter) around each submit call on the worker thread: a submit that blocks (a synchronising "
    "copy, a driver lock) takes the thread just as much as one that computes, and the thread CPU clock would hide it"
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="write the rows, duplex, targets and samples (rewritten after "
                   "every workload, so a killed run keeps what it measured)")  # fmt: skip
    p.add_argument("--plot", metavar="PATH", help="write a PNG: step-time distribution and load latency per method")
    p.add_argument("--workloads", nargs="+", metavar="NAME", default=list(SERVING_WORKLOADS),
                   help=f"subset of {list(SERVING_WORKLOADS)}")  # fmt: skip
    p.add_argument("--layout", choices=("block_first", "kv_first"), default="block_first",
                   help="GPU KV layout (block_first: what vLLM's offloading connector uses)")  # fmt: skip
    p.add_argument("--methods", nargs="+", metavar="NAME", default=list(DEFAULT_METHODS),
                   help=f"subset of {sorted(METHODS)}")  # fmt: skip
    p.add_argument("--num-ctas", nargs="+", type=int, metavar="C", help=f"triton's num_ctas besides the default "
                   f"{DEFAULT_NUM_CTAS} (default {list(GPU_LOOP.triton_ctas)})")  # fmt: skip
    for name, help_ in (("prefill", "prefill tokens per step"), ("decode", "decode requests per step (1 token each)"),
                        ("prefix-tokens", "tokens of each arriving request's cached prefix"),
                        ("load-every", "a request arrives every K steps"), ("steps", "measured steps per method"),
                        ("warmup", "steps before the measured ones")):  # fmt: skip
        attr = name.replace("-", "_")
        p.add_argument(
            f"--{name}",
            type=int,
            help=f"{help_} (default {getattr(GPU_LOOP, attr)}; without CUDA {getattr(CPU_LOOP, attr)})",
        )
    p.add_argument(
        "--defer-stores",
        action="store_true",
        help="submit a step's stores at the start of the next step "
        "(before its loads), as vLLM 0.33's connector does, instead of right after its compute is queued",
    )
    p.add_argument("--no-duplex", action="store_true", help="skip the duplex figure")
    p.add_argument("--duplex-repeats", type=int, default=DUPLEX_REPEATS, help="samples per duplex point "
                   f"(default {DUPLEX_REPEATS})")  # fmt: skip
    p.add_argument("--cpu-check", action="store_true", help="the CPU mode (tiny shapes, nothing timed) even with CUDA")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    unknown = [w for w in args.workloads if w not in SERVING_WORKLOADS]
    if unknown:
        p.error(f"unknown or unmodelled workload(s) {unknown}; supported: {list(SERVING_WORKLOADS)}")
    try:
        method_points(args.methods, ())
    except ValueError as exc:
        p.error(str(exc))
    if args.duplex_repeats < 1:
        p.error(f"--duplex-repeats must be >= 1, got {args.duplex_repeats}")
    return args


def loop_shape(args, cuda: bool) -> LoopShape:
    """The loop's shape: the mode's defaults, then the options given."""
    base = GPU_LOOP if cuda else CPU_LOOP
    given = {k: getattr(args, k) for k in ("prefill", "decode", "prefix_tokens", "load_every", "steps", "warmup")}
    shape = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
    if args.num_ctas:
        shape = dataclasses.replace(shape, triton_ctas=tuple(args.num_ctas))
    return shape


def _row(setup: Setup, point: MethodPoint, device: str, args, impl: str, problem: str | None, run: LoopRun | None):
    w, shape = setup.workload, setup.shape
    fields = dict(
        device=device, workload=w.name, layout=setup.layout, method=point.method, num_ctas=point.num_ctas, impl=impl,
        page_bytes=setup.spec.page_bytes[0], num_layers=setup.spec.num_layers, block_size=w.block_size,
        prefill_tokens=shape.prefill, decode_tokens=shape.decode, prefix_tokens=shape.prefix_tokens,
        load_every=shape.load_every, steps=shape.steps, defer_stores=args.defer_stores,
        byte_check="fail" if problem else "pass" if run is not None else "n/a", byte_check_note=problem,
    )  # fmt: skip
    if run is not None:
        fields.update(count_fields(run))
        if setup.cuda and problem is None:  # wrong bytes are reported, never timed
            fields.update(timing_fields(run))
    return new_row(**fields)


def _run_point(setup: Setup, point: MethodPoint, env: Env, defer: bool) -> tuple[LoopRun | None, str | None, str]:
    """(run, problem, impl) of one method on one workload: the loop, then its byte check."""
    impl = METHODS[point.method].describe
    engine = None
    try:
        engine = build_engine(point, setup.target)
        run = run_loop(setup, engine, defer)
        where = "its descriptors replayed by memmove" if getattr(engine, "path", None) == "dma" else "the interpreter"
        impl = run.impl or (impl if setup.cuda else f"{impl}; no CUDA: synchronous, {where}")
        if getattr(engine, "path", None) is not None:  # ours: how its jobs moved, and what its calibration took
            jobs = ", ".join(f"{d} {p} x{k}" for (d, p), k in sorted(run.paths.items()))
            cal = engine.calibration
            impl += f"; path {engine.path}: {jobs}" + (f"; calibrated in {cal.seconds:.3f} s" if cal else "")
        return run, byte_check(setup, run), impl
    except Unavailable as exc:  # cannot run on this machine: said in its row, not a failure
        return None, None, f"n/a: {exc}"
    except Exception as exc:  # reported in its row; a dead CUDA context stops the run
        if not env.alive():
            raise FatalCudaError(f"{point.label} on {setup.workload.name}: {exc}") from exc
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # the first error is the one reported
                pass
        return None, f"ERROR: {type(exc).__name__}: {exc}", impl


def _duplex_row(setup: Setup, point: MethodPoint, env: Env, repeats: int) -> dict:
    try:
        return duplex(setup, point, repeats)
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
    elif r["step_ms_median"] is not None:
        load = "" if r["load_latency_ms_median"] is None else f", load {r['load_latency_ms_median']} ms"
        say(f"    step {r['step_ms_median']} ms (p99 {r['step_ms_p99']}){load}, submit "
            f"{r['submit_cpu_us_per_step']} us/step, {r['offload_gbps']} GB/s offloaded")  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu_check
    shape = loop_shape(args, cuda)
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
    chosen = [WORKLOADS[name] if cuda else WORKLOADS[name].tiny() for name in args.workloads]
    try:
        for w in chosen:
            shape.check(w.block_size)
    except ValueError as exc:
        raise SystemExit(f"serving.py: {exc}") from None
    points = method_points(args.methods, shape.triton_ctas)
    rows, duplex_rows, contiguous, samples, workloads = [], [], {}, {}, {}
    doc = {"benchmark": "serving", "mode": mode, **meta, "args": dict(vars(args)), "loop": dataclasses.asdict(shape),
           "submit_timing": SUBMIT_TIMING}  # fmt: skip

    def write(complete: bool, **extra) -> None:
        if args.json:
            write_json(
                args.json,
                {
                    **doc,
                    "complete": complete,
                    "workloads": workloads,
                    "rows": rows,
                    "duplex": duplex_rows,
                    "contiguous": contiguous,
                    "samples": samples,
                    **extra,
                },
            )

    fatal = None
    try:
        for w in chosen:
            _run_workload(w, shape, points, env, meta, args, rows, duplex_rows, contiguous, samples, workloads)
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
    say(
        f"{sum(r['byte_check'] == 'pass' for r in rows)} of {len(rows)} runs byte-checked pass"
        + ("" if cuda else "; nothing was timed: this machine has no CUDA device (or --cpu-check)"),
        style="bold red" if failed else "bold green",
    )
    failures = [{k: r[k] for k in ("workload", "method", "num_ctas", "byte_check_note")} for r in failed]
    write(fatal is None, targets=targets, failures=failures, fatal=fatal)
    if args.json:
        say(f"wrote {args.json}")
    if args.plot:
        why = plot_serving(samples, contiguous, args.plot, f"{meta['device']} -- triton-offload serving step loop")
        say(why or f"wrote {args.plot}")
    return 1 if failed or fatal else 0


def _run_workload(w, shape, points, env, meta, args, rows, duplex_rows, contiguous, samples, workloads) -> None:
    """Every method's run on one workload (then its duplex figure), appended to the run's lists."""
    cuda, name = env.cuda, w.name
    say(f"{name}: {w.model.source}; {shape.tokens} tokens per step")
    setup = setup_workload(w, args.layout, shape, env, args.seed)
    try:
        workloads[name] = {"model": dataclasses.asdict(w.model), "sizes": dataclasses.asdict(setup.sizes),
                           "bytes_per_block": setup.spec.bytes_per_block}  # fmt: skip
        if cuda:
            nbytes = setup.sizes.prefix_blocks * setup.spec.bytes_per_block
            contiguous[name] = contiguous_load(setup, nbytes, CONTIGUOUS_REPEATS)
            say(f"  contiguous pinned copy of one prefix ({nbytes / 2**20:.0f} MiB): {contiguous[name]}")
        for point in points:
            say(f"  {name}: {point.label}")
            run, problem, impl = _run_point(setup, point, env, args.defer_stores)
            rows.append(_row(setup, point, meta["device"], args, impl, problem, run))
            _say_row(rows[-1])
            if cuda and problem is None and run is not None:
                samples.setdefault(name, {})[point.label] = {
                    "step_ms": [round(r.step_s * 1e3, 4) for r in run.records],
                    "load_latency_ms": [
                        round(r.load_latency_s * 1e3, 4) for r in run.records if r.load_job is not None
                    ],
                }
        if cuda and not args.no_duplex:
            for point in DUPLEX_POINTS:
                if point in points:
                    duplex_rows.append(_duplex_row(setup, point, env, args.duplex_repeats))
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
