#!/usr/bin/env python3
"""Standalone benchmark of triton-offload's gather/scatter against today's ways and the PCIe link's own peak.

    python bench/bench_transfer.py [--quick] [--json PATH] [--plot PATH] [--save]
                                   [--workloads NAME ...] [--layouts NAME ...] [--blocks N ...] [--num-ctas C ...]

On a CUDA machine, for each workload, layout, transfer size, host-block factor and direction, the same blocks are
moved by every method in one run on one GPU, after a byte-exact check of each method; then the host cost of one
call and the GEMM slowdown caused by concurrent transfers are measured, and the targets are printed (PASS/FAIL).
Without CUDA it runs a correctness pass of every method that exists on CPU, under the Triton interpreter, with tiny
shapes of every workload, and measures no bandwidth. See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import pathlib
import platform
import re
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import triton

import triton_offload as to
from triton_offload.kernels.copy_blocks import DEFAULT_NUM_CTAS

# isort: split
# Sibling modules: bench/ is on sys.path when this runs as a script (it is not a package).
from baselines import BASELINE_NAMES, METHODS, Env, MemcpyBatch, TransferCase, Triton, Unavailable, runs_of
from cuda_api import driver_info, load_cuda_api
from extras import cpu_overhead, interference
from plot import plot_results
from report import ProgressBar, print_table, say
from summary import evaluate_targets, print_extras, print_results, print_targets
from timing import GpuTimer
from verify import check_method, reference_blocks
from workloads import WORKLOADS, Workload, make_caches, resolve_workloads

SWEEP = (1, 2, 4, 8, 16, 32)
QUICK_SWEEP = (1, 8, 32)
BLOCKS = (16, 128, 1024)
HOST_CONFIGS = ((1, 0), (4, 1))  # (blocks_per_host_block, skip): plain, and f=4 starting mid-block
ORDER = ("memcpy_batch", "memcpy_per_block", "torch_staged", "peak")  # baselines after the triton sweep
EXTRAS_WORKLOAD, EXTRAS_LAYOUT, EXTRAS_BLOCKS = "llama3-70b-tp8", "kv_first", 1024  # 1024 blocks x 80 layers
ROW_KEYS = (
    "device", "workload", "layout", "direction", "method", "num_ctas", "page_bytes", "num_layers", "blocks",
    "blocks_per_host_block", "skip", "total_bytes", "median_ms", "p20_ms", "p80_ms", "gbps", "fraction_of_peak",
    "speedup_vs_memcpy_batch", "speedup_vs_memcpy_per_block", "speedup_vs_torch_staged",
)  # fmt: skip
RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class MethodSpec:
    """A row label of the sweep: the JSON ``method`` and ``num_ctas`` and how to build the method."""

    label: str
    num_ctas: int | None
    factory: Callable[[], object]

    @property
    def key(self) -> tuple[str, int | None]:
        return self.label, self.num_ctas

    @property
    def name(self) -> str:
        return f"triton[{self.num_ctas}]" if self.label == "triton" else self.label


def method_specs(sweep: tuple[int, ...]) -> list[MethodSpec]:
    """Triton at every swept num_ctas (the default always included, run as num_ctas=None), then the baselines."""
    ctas = sorted(set(sweep) | {DEFAULT_NUM_CTAS})
    specs = [MethodSpec("triton", c, lambda c=c: Triton(None if c == DEFAULT_NUM_CTAS else c)) for c in ctas]
    return specs + [MethodSpec(name, None, METHODS[name]) for name in ORDER]


@dataclass
class Group:
    """One workload in one layout: caches, host buffer, staging buffer, block ids and the reference bytes."""

    workload: Workload
    layout: str
    spec: to.KVCacheSpec
    runs: list
    host_flat: torch.Tensor
    staging: torch.Tensor
    g_src: np.ndarray
    g_dst: np.ndarray
    expected: torch.Tensor | None
    rng: np.random.Generator


def _host_rows(n: int, f: int, skip: int) -> int:
    # +1: torch_staged's consecutive host ids start at 1; +1: an unaddressed row whose sentinel must survive.
    return math.ceil((skip + n) / f) + 2


def allocate(
    w: Workload, layout: str, n_max: int, host_configs, device: torch.device, seed: int, reference: bool = True
) -> Group:
    """Caches with room for disjoint store sources and load destinations, one pinned host buffer sized for the
    largest transfer of any host configuration (each case is a view of it), and the expected bytes."""
    num_blocks = 2 * n_max + 16
    spec = to.KVCacheSpec(make_caches(w, layout, num_blocks, device, seed), layout)
    bpb = spec.bytes_per_block
    host_bytes = max(_host_rows(n_max, f, skip) * f for f, skip in host_configs) * bpb
    host_flat = torch.empty(host_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    staging = torch.empty(n_max * bpb, dtype=torch.uint8, device=device)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(num_blocks).astype(np.int64)  # random, non-contiguous ids
    g_src, g_dst = perm[:n_max], perm[n_max : 2 * n_max]
    expected = reference_blocks(spec, g_src, device) if reference else None
    return Group(w, layout, spec, runs_of(spec), host_flat, staging, g_src, g_dst, expected, rng)


def make_case(group: Group, n: int, f: int, skip: int, store: bool) -> TransferCase:
    bpb = group.spec.bytes_per_block
    m = math.ceil((skip + n) / f)
    rows = _host_rows(n, f, skip)
    host = group.host_flat[: rows * f * bpb].view(rows, f * bpb)
    host_ids = group.rng.permutation(rows)[:m].astype(np.int64)
    gpu_ids = (group.g_src if store else group.g_dst)[:n]
    return TransferCase(group.spec, group.runs, host, gpu_ids, host_ids, f, skip, store, group.staging, group.g_src[:n])


def release(device: torch.device) -> None:
    """Frees what the last group held, device and pinned host memory both, before the next is allocated."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        # PyTorch caches pinned blocks too; names differ across versions.
        empty_host = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or getattr(
            torch._C, "_host_emptyCache", None
        )
        if empty_host is not None:
            empty_host()


def environment(device: torch.device, api_note: str) -> dict:
    info = {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "triton_offload": to.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "cuda_python": api_note,
        "default_num_ctas": DEFAULT_NUM_CTAS,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=torch.cuda.get_device_name(device), sms=props.multi_processor_count, **driver_info())
    else:
        info.update(device=f"cpu ({platform.machine()})", sms=None, driver=None, driver_cuda=None)
    return info


def print_header(meta: dict, mode: str) -> None:
    say(f"triton-offload transfer benchmark -- {mode}", style="bold")
    say(
        f"device {meta['device']}" + (f" ({meta['sms']} SMs)" if meta["sms"] else "")
        + f" | driver {meta['driver']} (CUDA {meta['driver_cuda']}) | CUDA (torch) {meta['cuda']}"
        + f" | torch {meta['torch']} | Triton {meta['triton']} | Python {meta['python']}"
    )  # fmt: skip
    say(f"memcpy baselines: {meta['cuda_python']} | default num_ctas = {DEFAULT_NUM_CTAS} | {meta['timestamp']}")


# ---------------------------------------------------------------------------------------------------------------
# Verification and timing of one group
# ---------------------------------------------------------------------------------------------------------------


class FatalCudaError(RuntimeError):
    """The CUDA context is unusable (a sticky error such as an illegal address): nothing after it can be measured."""


def _cuda_alive(device: torch.device) -> bool:
    try:
        torch.cuda.synchronize(device)
        return True
    except RuntimeError:
        return False


class Session:
    """Everything one benchmark run accumulates."""

    def __init__(self, meta: dict, env: Env, specs: list[MethodSpec]):
        self.meta, self.env, self.specs = meta, env, specs
        self.rows: list[dict] = []
        self.call_cpu: list[dict] = []
        self.checks: list[dict] = []
        self.failures: list[dict] = []
        self.impls: dict[str, str] = {}
        self.skipped: dict[str, str] = {}  # method -> why it cannot run on this machine
        self.peak_cache: dict = {}

    def check(self, group: Group, case: TransferCase, ms: MethodSpec, stream) -> tuple[str, str]:
        """(status, note) of one method on one case: pass, FAIL (wrong bytes), ERROR (raised), n/a (cannot run)."""
        try:
            prepared = ms.factory().prepare(case, self.env)
            self.impls.setdefault(ms.name, prepared.impl)
            if stream is not None:
                with torch.cuda.stream(stream):
                    problem = check_method(case, prepared, group.expected[: case.n])
            else:
                problem = check_method(case, prepared, group.expected[: case.n])
        except Unavailable as exc:
            return "n/a", str(exc)
        except Exception as exc:  # a CUDA error or a binding mismatch: the method cannot be trusted, say so loudly
            if case.device.type == "cuda" and not _cuda_alive(case.device):
                raise FatalCudaError(f"{ms.name} on {group.workload.name}/{group.layout}: {exc}") from exc
            return "ERROR", f"{type(exc).__name__}: {exc}"
        if problem is not None:
            return "FAIL", problem
        if prepared.emulated:
            return "n/a", "needs CUDA; its copy plan was replayed with memmove on CPU: bytes correct"
        return "pass", prepared.impl

    def record_check(self, group: Group, case: TransferCase, ms: MethodSpec, status: str, note: str) -> None:
        entry = {
            "workload": group.workload.name,
            "layout": group.layout,
            "direction": "store" if case.store else "load",
            "method": ms.label,
            "num_ctas": ms.num_ctas,
            "blocks": case.n,
            "blocks_per_host_block": case.f,
            "skip": case.skip,
            "status": status,
            "note": note,
        }
        self.checks.append(entry)
        if status == "n/a" and self.env.cuda and ms.name not in self.skipped:
            self.skipped[ms.name] = note
            say(f"skipping {ms.name}: {note}", "yellow")
        if status in ("FAIL", "ERROR"):
            self.failures.append(entry)
            say(f"{status}: {ms.name} {group.workload.name}/{group.layout} {entry['direction']}: {note}", "bold red")

    def row(self, group: Group, case: TransferCase, ms: MethodSpec, ms_samples: list[float] | None) -> dict:
        spec = group.spec
        row = dict.fromkeys(ROW_KEYS)
        row.update(
            device=self.meta["device"],
            workload=group.workload.name,
            layout=group.layout,
            direction="store" if case.store else "load",
            method=ms.label,
            num_ctas=ms.num_ctas,
            page_bytes=spec.page_bytes[0],
            num_layers=spec.num_layers,
            blocks=case.n,
            blocks_per_host_block=case.f,
            skip=case.skip,
            total_bytes=case.total_bytes,
        )
        if ms_samples:
            median = float(np.median(ms_samples))
            row.update(
                median_ms=round(median, 5),
                p20_ms=round(float(np.quantile(ms_samples, 0.2)), 5),
                p80_ms=round(float(np.quantile(ms_samples, 0.8)), 5),
                gbps=round(case.total_bytes / (median * 1e-3) / 1e9, 3),
            )
        return row


def verify_group(run: Session, group: Group, specs, n: int, cfg, stream, bar) -> dict:
    """Checks every method in both directions on one case; returns {(label, num_ctas, direction): status}."""
    status = {}
    f, skip = cfg
    for store in (True, False):
        case = make_case(group, n, f, skip, store)
        for ms in specs:
            bar.describe(f"check {group.workload.name}/{group.layout} {ms.name}")
            st, note = run.check(group, case, ms, stream)
            run.record_check(group, case, ms, st, note)
            status[(*ms.key, "store" if store else "load")] = st
            bar.advance()
    return status


def time_group(run: Session, group: Group, specs, status, blocks, host_configs, timer, args, bar) -> None:
    for n in blocks:
        for f, skip in host_configs:
            for store in (True, False):
                case = make_case(group, n, f, skip, store)
                direction = "store" if store else "load"
                for ms in specs:
                    item = f"{group.workload.name}/{group.layout} n={n} f={f} {direction} {ms.name}"
                    bar.describe(item)
                    if status.get((*ms.key, direction)) != "pass":
                        bar.advance(item)
                        continue
                    peak_key = (direction, case.total_bytes)
                    try:
                        if ms.label == "peak" and peak_key in run.peak_cache:
                            timing = run.peak_cache[peak_key]  # the link does not care which layout the bytes had
                        else:
                            prepared = ms.factory().prepare(case, run.env)
                            timing = timer(prepared.run, args.budget_ms)
                            if ms.label == "peak":
                                run.peak_cache[peak_key] = timing
                    except Exception as exc:
                        if run.env.cuda and not _cuda_alive(run.env.device):
                            raise FatalCudaError(f"timing {item}: {exc}") from exc
                        entry = {"workload": group.workload.name, "layout": group.layout, "direction": direction}
                        run.failures.append({**entry, "method": ms.name, "status": "ERROR", "note": repr(exc)})
                        say(f"ERROR timing {item}: {exc!r}", "bold red")
                        bar.advance(item)
                        continue
                    row = run.row(group, case, ms, timing.ms)
                    run.rows.append(row)
                    run.call_cpu.append(
                        {k: row[k] for k in ("workload", "layout", "direction", "method", "num_ctas", "blocks")}
                        | {"blocks_per_host_block": f, "skip": skip, "median_cpu_ms": round(timing.median_cpu_ms, 4)}
                    )
                    bar.advance(item)


def fill_relative(rows: list[dict]) -> None:
    """fraction_of_peak and the speedup columns, against the rows of the same case (same blocks, same bytes)."""
    groups: dict = defaultdict(dict)
    for r in rows:
        key = (r["workload"], r["layout"], r["direction"], r["blocks"], r["blocks_per_host_block"], r["skip"])
        groups[key][(r["method"], r["num_ctas"])] = r
    for case_rows in groups.values():
        peak = case_rows.get(("peak", None))
        for r in case_rows.values():
            if r["median_ms"] is None:
                continue
            if peak and peak["gbps"]:
                r["fraction_of_peak"] = round(r["gbps"] / peak["gbps"], 4)
            for name in BASELINE_NAMES:
                base = case_rows.get((name, None))
                if base and base["median_ms"]:
                    r[f"speedup_vs_{name}"] = round(base["median_ms"] / r["median_ms"], 3)


# ---------------------------------------------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------------------------------------------


def _selected(args) -> list[tuple[Workload, str]]:
    groups = []
    for w in resolve_workloads(args.workloads):
        layouts = [lay for lay in w.layouts if not args.layouts or lay in args.layouts]
        if args.quick and not args.layouts:
            layouts = layouts[:1]
        groups += [(w, layout) for layout in layouts]
    if not groups:
        raise SystemExit(f"no workload/layout left after the filters (layouts: {args.layouts})")
    return groups


def run_gpu(args, device: torch.device | None = None) -> tuple[dict, int]:
    device = device or torch.device("cuda", torch.cuda.current_device())
    torch.empty(1, device=device)  # creates the primary context on this thread before cuda-python looks for it
    stream = torch.cuda.Stream(device)  # not the legacy default stream: cuMemcpyBatchAsync rejects that one
    api, api_note = load_cuda_api(device.index)
    env = Env(device, api, api_note, stream.cuda_stream)
    meta = environment(device, api_note)
    print_header(meta, "GPU")
    sweep = sorted(set(args.num_ctas or (QUICK_SWEEP if args.quick else SWEEP)) | {DEFAULT_NUM_CTAS})
    specs = method_specs(tuple(sweep))
    blocks = sorted(args.blocks or ((128,) if args.quick else BLOCKS))
    host_configs = ((4, 1),) if args.quick else HOST_CONFIGS
    verify_cfg = max(host_configs, key=lambda c: (c[1], c[0]))  # the one with a skip: the hardest addressing
    groups = _selected(args)
    run = Session(meta, env, specs)
    timer = GpuTimer(stream, device)
    per_group = 2 * len(specs) * (1 + len(blocks) * len(host_configs))
    overhead = inter = None
    fatal = None
    try:
        with ProgressBar(len(groups) * per_group) as bar:
            for w, layout in groups:
                bar.describe(f"allocating {w.name}/{layout}")
                group = allocate(w, layout, blocks[-1], host_configs, device, args.seed)
                status = verify_group(run, group, specs, blocks[-1], verify_cfg, stream, bar)
                time_group(run, group, specs, status, blocks, host_configs, timer, args, bar)
                del group
                release(device)
        if not (args.no_overhead and args.no_interference):
            overhead, inter = run_extras(run, args, env, stream, sweep)
    except FatalCudaError as exc:
        # Keep what was measured before the context died; report it and stop.
        fatal = str(exc)
        run.failures.append({"status": "FATAL", "note": fatal})
        say(f"FATAL: the CUDA context is unusable after {fatal}; stopping, results so far follow", "bold red")
    fill_relative(run.rows)
    print_results(run.rows, sweep)
    methods = list(run.impls.items()) + [(m, f"skipped: {why}") for m, why in run.skipped.items()]
    print_table("Methods", ["method", "implementation"], methods)
    print_extras(overhead, inter, f"{EXTRAS_BLOCKS} blocks x 80 layers ({EXTRAS_WORKLOAD}, {EXTRAS_LAYOUT})")
    targets = evaluate_targets(run.rows, overhead, inter)
    print_targets(targets)
    result = {
        "mode": "gpu",
        **meta,
        "args": {k: v for k, v in vars(args).items()},
        "timing": "CUDA events around one call each, after an L2 flush, on a dedicated non-default stream; "
        "median/p20/p80 over samples; GB/s = total_bytes / median",
        "rows": run.rows,
        "verification": run.checks,
        "methods": run.impls,
        "skipped_methods": run.skipped,
        "call_cpu_ms": run.call_cpu,
        "cpu_overhead": overhead,
        "interference": inter,
        "targets": targets,
        "failures": run.failures,
        "fatal": fatal,
    }
    return result, 1 if run.failures else 0


def run_extras(run: Session, args, env: Env, stream, sweep) -> tuple[dict | None, dict | None]:
    """CPU cost per call and GEMM interference, on Llama-3-70B TP8 pages at 1024 blocks x 80 layers."""
    device = env.device
    w = WORKLOADS[EXTRAS_WORKLOAD]
    say(f"extras on {w.name}/{EXTRAS_LAYOUT}, {EXTRAS_BLOCKS} blocks x {w.num_layers} layers")
    group = allocate(w, EXTRAS_LAYOUT, EXTRAS_BLOCKS, ((1, 0),), device, args.seed + 1)
    cases = {d: make_case(group, EXTRAS_BLOCKS, 1, 0, d == "store") for d in ("store", "load")}
    # Only methods that moved the right bytes here are timed.
    used = [MethodSpec("triton", c, lambda c=c: Triton(None if c == DEFAULT_NUM_CTAS else c)) for c in sweep]
    used.append(MethodSpec("memcpy_batch", None, MemcpyBatch))
    ok = set()
    for d, case in cases.items():
        for ms in used:
            st, note = run.check(group, case, ms, stream)
            run.record_check(group, case, ms, st, note)
            if st == "pass":
                ok.add((ms.key, d))
    overhead = inter = None
    if not args.no_overhead and (("triton", DEFAULT_NUM_CTAS), "store") in ok:
        bursts, per_burst = (5, 8) if args.quick else (25, 8)
        overhead = cpu_overhead({"gather": cases["store"], "scatter": cases["load"]}, env, stream, bursts, per_burst)
    if not args.no_interference:
        preparers = {}
        for d, case in cases.items():
            for ms in used:
                if (ms.key, d) in ok:
                    preparers[(d, ms.label, ms.num_ctas)] = lambda ms=ms, case=case: ms.factory().prepare(case, env)
        iters, repeats = (10, 1) if args.quick else (30, 3)
        try:
            inter = interference(preparers, cases["store"].total_bytes, env, stream, args.gemm_size, iters, repeats)
        except RuntimeError as exc:
            if _cuda_alive(device):
                raise
            raise FatalCudaError(f"the interference measurement: {exc}") from exc
        inter.update(workload=w.name, layout=EXTRAS_LAYOUT, blocks=EXTRAS_BLOCKS)
    del group, cases
    release(device)
    return overhead, inter


def run_cpu(args) -> tuple[dict, int]:
    """The interpreter-mode correctness pass: every method that exists on CPU, tiny shapes, no timing at all."""
    device = torch.device("cpu")
    env = Env(device, None, "no CUDA device: cudaMemcpyAsync and cuMemcpyBatchAsync do not exist on CPU")
    meta = environment(device, env.api_note)
    print_header(meta, "CPU correctness check (Triton interpreter)")
    say("No CUDA device: checking every method's bytes on CPU. NO BANDWIDTH IS MEASURED.", style="bold yellow")
    n = 5
    host_configs = ((4, 1),) if args.quick else HOST_CONFIGS
    specs = [MethodSpec("triton", DEFAULT_NUM_CTAS, Triton), MethodSpec("triton", 1, lambda: Triton(1))]
    specs += [MethodSpec(name, None, METHODS[name]) for name in ORDER]
    groups = _selected(args)
    run = Session(meta, env, specs)
    table: dict = {}
    total = len(groups) * len(host_configs) * 2 * len(specs)
    with ProgressBar(total, "cpu check") as bar:
        for w, layout in groups:
            group = allocate(w.tiny(), layout, n, host_configs, device, args.seed)
            for f, skip in host_configs:
                for store in (True, False):
                    case = make_case(group, n, f, skip, store)
                    line = table.setdefault(
                        (w.name, layout, f, skip, store),
                        [w.name, layout, group.spec.page_bytes[0], f"{f}/{skip}", "store" if store else "load"],
                    )
                    for ms in specs:
                        bar.describe(f"{w.name}/{layout} f={f} {ms.name}")
                        status, note = run.check(group, case, ms, None)
                        run.record_check(group, case, ms, status, note)
                        row = run.row(group, case, ms, None)
                        row.update(status=status, note=note)
                        run.rows.append(row)
                        line.append(status + ("*" if status == "n/a" else ""))
                        bar.advance()
    print_table(
        f"CPU check: bytes moved by each method vs kernels/reference.py ({n} blocks, tiny shapes of each workload)",
        ["workload", "layout", "page B", "f/skip", "dir", *(ms.name for ms in specs)],
        list(table.values()),
        note="n/a*: needs CUDA (cudaMemcpyAsync / cuMemcpyBatchAsync); its copy plan (src, dst, size per copy) "
        "was replayed with memmove on CPU and moved the right bytes.",
    )
    counts = defaultdict(int)
    for r in run.rows:
        counts[r["status"]] += 1
    say(
        f"{counts['pass']} passed, {counts['FAIL'] + counts['ERROR']} failed, {counts['n/a']} not applicable on CPU. "
        "No bandwidth was measured: this machine has no CUDA device.",
        style="bold red" if run.failures else "bold green",
    )
    result = {
        "mode": "cpu-interpreter-check",
        **meta,
        "args": {k: v for k, v in vars(args).items()},
        "note": "correctness only, tiny shapes of every workload's layout; no timing, every number field is null",
        "rows": run.rows,
        "methods": run.impls,
        "failures": run.failures,
    }
    return result, 1 if run.failures else 0


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a short run: 128 blocks, f=4/skip=1, one layout per model")
    p.add_argument("--json", metavar="PATH", help="write every row, the extras and the targets as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of GB/s vs page size per method, with the peak")
    p.add_argument("--save", action="store_true", help="write both to bench/results/<device>-<date>.json/.png")
    p.add_argument("--workloads", nargs="+", metavar="NAME", help=f"subset of {sorted(WORKLOADS)}")
    p.add_argument("--layouts", nargs="+", choices=("kv_first", "block_first", "mla"), help="subset of layouts")
    p.add_argument("--blocks", nargs="+", type=int, metavar="N", help=f"blocks per transfer (default {BLOCKS})")
    p.add_argument("--num-ctas", nargs="+", type=int, metavar="C", help=f"Triton sweep (default {SWEEP})")
    p.add_argument("--budget-ms", type=float, default=None, help="device time per measurement (default 100, quick 30)")
    p.add_argument("--gemm-size", type=int, default=8192, help="M = N = K of the interference GEMM")
    p.add_argument("--no-overhead", action="store_true", help="skip the CPU-cost measurement")
    p.add_argument("--no-interference", action="store_true", help="skip the GEMM interference measurement")
    p.add_argument("--cpu-check", action="store_true", help="run the CPU correctness check even with CUDA present")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.budget_ms is None:
        args.budget_ms = 30.0 if args.quick else 100.0
    for name, values in (("--blocks", args.blocks), ("--num-ctas", args.num_ctas)):
        if values and min(values) < 1:
            p.error(f"{name} values must be >= 1, got {values}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    gpu = torch.cuda.is_available() and not args.cpu_check
    result, code = run_gpu(args) if gpu else run_cpu(args)
    json_path, plot_path = args.json, args.plot
    if args.save:
        stem = RESULTS_DIR / f"{_slug(result['device'])}-{datetime.date.today().isoformat()}"
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        json_path, plot_path = json_path or f"{stem}.json", plot_path or f"{stem}.png"
    if json_path:
        pathlib.Path(json_path).write_text(json.dumps(result, indent=1, default=str) + "\n")
        say(f"wrote {json_path}")
    if plot_path:
        why = plot_results(result["rows"], plot_path, f"{result['device']} -- triton-offload", DEFAULT_NUM_CTAS)
        say(why or f"wrote {plot_path}")
    return code


if __name__ == "__main__":
    sys.exit(main())
