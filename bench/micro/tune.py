#!/usr/bin/env python3
"""Tunes the copy kernel's launch constants on a GPU: tile bytes (the bytes one program has in flight per step), warps
per program and programs per launch, per direction, on the pages that matter (:data:`CASES`), against the same run's
contiguous pinned peak. Each variant (:func:`variants`) is byte-checked once on every case, then timed at every num_ctas
(:func:`tune_case`); the summary ranks the variants of each direction by their worst fraction of peak over the cases at
each num_ctas (:func:`summarize`), which is the number the targets are about (>= 90 % of peak on every page, with <= 8
CTAs).

    python -m bench.micro.tune --json tune.json [--budget-ms 20]
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from bench.baselines import METHODS
from bench.common.case import Prepared, TransferCase
from bench.common.env import Env, open_gpu, release
from bench.common.report import print_table, say
from bench.common.results import write_json
from bench.common.timing import GpuTimer, gbps
from bench.common.verify import check_method
from bench.common.workloads import WORKLOADS
from bench.transfer.session import allocate, make_case
from triton_offload.kernels import shapes, tables
from triton_offload.plan import Direction
from triton_offload.transfer import transfer_blocks

KIB = 1024
TILES = tuple(k * KIB for k in (8, 16, 32, 64, 128))
WARPS = (4, 8, 16)
CTAS = (4, 8, 16)
# (workload, layout, blocks): the smallest segments (small-page kv_first: 1 KiB K and V runs), 2 KiB pages, 8 KiB
# pages at both sizes the targets name, and the two large pages (64 KiB, 72 KiB MLA).
CASES = (
    ("small-page", "kv_first", 1024),
    ("small-page", "block_first", 1024),
    ("llama3-70b-tp8", "kv_first", 128),
    ("llama3-70b-tp8", "kv_first", 1024),
    ("llama3-8b", "kv_first", 128),
    ("deepseek-v3-mla", "mla", 128),
)


def variants(tiles=TILES, warps=WARPS) -> list[tuple[int, int]]:
    """(tile bytes, warps) pairs whose bytes per thread per step lie in 32..512: fewer leaves 16-byte lanes idle,
    more needs registers the kernel would spill."""
    return [(t, w) for t in tiles for w in warps if 32 <= t // (w * 32) <= 512]


def tuned_triton(case: TransferCase, num_ctas: int, tuning: shapes.LaunchTuning) -> Prepared:
    """The benchmark's ``triton`` method (one public call per run) with ``tuning`` instead of the defaults."""
    direction = Direction.STORE if case.store else Direction.LOAD
    kw = dict(blocks_per_host_block=case.f, skip=case.skip, num_ctas=num_ctas, tunings={direction: tuning})
    run = lambda: transfer_blocks(case.spec, case.host, case.gpu_ids, case.host_ids, direction=direction, **kw)  # noqa: E731
    return Prepared(run, case.host_ids, f"triton_offload.transfer_blocks with {tuning}")


def summarize(rows: list[dict]) -> list[dict]:
    """Per direction, variant and num_ctas: the worst and median fraction of peak over the cases measured."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["direction"], r["tile_bytes"], r["num_warps"], r["num_ctas"]), []).append(r)
    out = []
    for (d, tile, warps, ctas), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["of_peak"])
        out.append(
            {
                "direction": d,
                "tile_bytes": tile,
                "num_warps": warps,
                "num_ctas": ctas,
                "cases": len(rs),
                "worst_of_peak": rs[0]["of_peak"],
                "median_of_peak": rs[len(rs) // 2]["of_peak"],
                "worst_case": f"{rs[0]['workload']}/{rs[0]['layout']} n={rs[0]['blocks']}",
            }
        )
    return out


def best(summary: list[dict], direction: str, max_ctas: int, cases: int) -> dict | None:
    """The variant with the highest worst-case fraction of peak at num_ctas <= max_ctas, over all ``cases``."""
    pool = [s for s in summary if s["direction"] == direction and s["num_ctas"] <= max_ctas and s["cases"] == cases]
    return max(pool, key=lambda s: (s["worst_of_peak"], s["median_of_peak"], -s["num_ctas"]), default=None)


def tune_case(group, n: int, store: bool, vs, ctas_list, env: Env, timer, budget_ms: float, stream=None):
    """One case and direction: the peak, then every variant checked once and timed at every num_ctas. Returns
    (rows, failures, peak GB/s). ``timer(fn, budget_ms)`` returns a :class:`timing.Timing`.

    For every case (a workload, layout and block count; f=1) and direction, each (tile, warps) variant, passed to the
    library as a ``LaunchTuning`` (``kernels/shapes.py``), is byte-checked once on the case (``verify.check_method``,
    as the benchmark does), then timed at every num_ctas with the benchmark's timer. A variant whose check fails (or
    that does not compile) is reported and never timed.
    """
    stream_ctx = (lambda: torch.cuda.stream(stream)) if stream is not None else contextlib.nullcontext
    w, layout = group.workload, group.layout
    case = make_case(group, n, 1, 0, store)
    with stream_ctx():
        peak = METHODS["peak"].prepare(case, env)
    peak_ms = timer(peak.run, budget_ms).fields()["median_ms"]
    peak_gbps = gbps(case.total_bytes, peak_ms)
    labels = {"workload": w.name, "layout": layout, "blocks": n, "direction": case.direction}
    rows, failures = [], []
    for tile, warps in vs:
        tuning = shapes.LaunchTuning(tile, warps)
        cfg = shapes.launch_config(group.spec, tables.access_width(group.spec, case.host), tuning)
        for i, ctas in enumerate(ctas_list):
            try:
                with stream_ctx():
                    prepared = tuned_triton(case, ctas, tuning)
                    problem = check_method(case, prepared, group.expected[:n]) if i == 0 else None
            except Exception as exc:  # a shape the compiler rejects: reported, the sweep goes on
                problem = f"ERROR {type(exc).__name__}: {str(exc)[:300]}"
            if problem is not None:
                failures.append({**labels, "tile_bytes": tile, "num_warps": warps, "problem": problem})
                say(f"FAIL {w.name}/{layout} {case.direction} tile {tile} warps {warps}: {problem}", "bold red")
                break
            ms = timer(prepared.run, budget_ms).fields()["median_ms"]
            rate = gbps(case.total_bytes, ms)
            rows.append(
                {
                    **labels, "page_bytes": w.page_bytes, "total_bytes": case.total_bytes,
                    "tile_bytes": tile, "num_warps": warps, "num_ctas": ctas, "rows": cfg.rows,
                    "chunk_bytes": cfg.chunk * cfg.elem, "median_ms": ms, "gbps": round(rate, 2),
                    "peak_gbps": round(peak_gbps, 2), "of_peak": round(rate / peak_gbps, 4),
                }
            )  # fmt: skip
    return rows, failures, peak_gbps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="results file (rewritten after every case)")
    ap.add_argument("--budget-ms", type=float, default=20.0, help="device time per measurement")
    ap.add_argument("--num-ctas", type=int, nargs="+", default=list(CTAS))
    ap.add_argument("--tiles-kib", type=int, nargs="+", default=[t // KIB for t in TILES])
    ap.add_argument("--warps", type=int, nargs="+", default=list(WARPS))
    ap.add_argument("--cases", type=int, nargs="+", help="indices into CASES (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        say("bench.micro.tune times compiled kernels and needs a CUDA device: nothing measured", "bold red")
        return 1
    device, stream, env, meta = open_gpu()
    timer = GpuTimer(stream, device)
    chosen = [CASES[i] for i in args.cases] if args.cases else list(CASES)
    vs = variants(tuple(t * KIB for t in args.tiles_kib), tuple(args.warps))
    rows: list[dict] = []
    failures: list[dict] = []

    def write(complete: bool) -> list[dict]:
        summary = summarize(rows)
        doc = {"benchmark": "tune", "complete": complete, **meta, "cases": chosen, "variants": vs,
               "num_ctas": args.num_ctas, "rows": rows, "failures": failures, "summary": summary}  # fmt: skip
        write_json(args.json, doc)
        return summary

    for wname, layout, n in chosen:
        group = allocate(WORKLOADS[wname], layout, n, ((1, 0),), device, args.seed)
        for store in (True, False):
            r, f, peak = tune_case(group, n, store, vs, args.num_ctas, env, timer, args.budget_ms, stream)
            rows += r
            failures += f
            top = max((x["of_peak"] for x in r), default=0)
            say(f"{wname}/{layout} n={n} {'store' if store else 'load'}: peak {peak:.1f} GB/s; best triton {top:.0%}")
            write(False)
        del group
        release(device)
    summary = write(True)
    for d in ("store", "load"):
        top = sorted((s for s in summary if s["direction"] == d), key=lambda s: -s["worst_of_peak"])[:12]
        print_table(
            f"{d}: variants by worst fraction of peak over {len(chosen)} cases",
            ["tile KiB", "warps", "ctas", "worst", "median", "worst case"],
            [[s["tile_bytes"] // KIB, s["num_warps"], s["num_ctas"], f"{s['worst_of_peak']:.1%}",
              f"{s['median_of_peak']:.1%}", s["worst_case"]] for s in top],
            left=0,
        )  # fmt: skip
        for cap in (4, 8):
            b = best(summary, d, cap, len(chosen))
            if b:
                say(f"{d} best at <= {cap} CTAs: tile {b['tile_bytes'] // KIB} KiB, {b['num_warps']} warps, "
                    f"{b['num_ctas']} CTAs: worst {b['worst_of_peak']:.1%} ({b['worst_case']})")  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
