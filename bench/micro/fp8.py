"""The FP8 host format's speed beside the bf16 copy (issue 63): on CUDA, for bf16 caches in kv_first and block_first
at pages of 2-256 KiB per layer-block (bench/micro/fp8_cases.py's PAGES), a store (gather) and a load (scatter) of many
random blocks of every layer into / from pinned host rows, with ``host_format`` None (the copy kernel) and
``"fp8_e4m3"``, each timed with CUDA events after an L2 flush (bench/common/timing.py); logical GB/s counts the bf16
bytes of the KV moved (both formats), wire GB/s the bytes crossing the link; FP8 at its default programs and at a few
others (best tried reported apart), the link's contiguous pinned copy of the same bytes as the peak. Every page is
checked on the GPU before it is timed (the bf16 round trip byte for byte, the FP8 one within E4M3's bound, FP8 host
bytes against kernels/reference_fp8.py): a page that fails is not timed and the run exits 1. The JSON is rewritten
after every page, ``complete`` false until the end. Without CUDA, or with ``--cpu-check``, the same checks run on tiny
CPU caches through Triton's interpreter and nothing is timed.

    python -m bench.micro.fp8 [--json PATH] [--plot PATH] [--blocks N] [--pages 16x8x128 ...] [--cpu-check]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import torch

from bench.common.report import say
from bench.common.results import write_json
from bench.micro import fp8_cases as cases
from bench.micro.fp8_cases import FP8, LAYOUTS, PAGES, Group, Page
from bench.micro.fp8_checked import check_checked, checked_runners
from triton_offload.kernels.fp8_blocks import DEFAULT_PROGRAMS

TARGET_BYTES = 128 << 20  # bf16 bytes of KV per transfer: layers chosen per page to come near it
MAX_LAYERS = 32
SWEEP = (8, 32, 64)  # FP8 programs tried beside its default (and the GPU's SM count)
BUDGET_MS = 20.0  # device time per measurement's samples (at least MIN_REPS)
MIN_REPS = 5
TIME_LIMIT_S = 70.0  # no page is started after this many seconds of the run: the GPU stage's budget
CPU_BLOCKS, CPU_LAYERS = 6, 2
STYLES = {"PASS": "green", "FAIL": "bold red"}


def layers_for(page: Page, blocks: int, target: int = TARGET_BYTES) -> int:
    """Layers per transfer: as many as bring ``blocks`` pages near ``target`` bytes, 1 to :data:`MAX_LAYERS`."""
    return max(1, min(MAX_LAYERS, target // (blocks * page.page_bytes)))


def make_row(group: Group, direction: str, method: str, num_ctas: int | None, default: bool, timing) -> dict:
    """One measurement: ``method`` bf16 / fp8 / peak, its programs (None: the default), the median device time and
    both rates (logical: the bf16 bytes of the KV; wire: the host rows' bytes, what crosses the link)."""
    fmt = FP8 if method.startswith("fp8") else None
    logical = group.logical_bytes()
    wire = logical if method == "peak" else group.wire_bytes(fmt)
    fields = timing.fields()
    ms = fields["median_ms"]
    page = group.page
    return {"page": page.name, "page_bytes": page.page_bytes, "tokens": page.tokens, "heads": page.heads,
            "head_dim": page.head_dim, "layout": group.layout, "layers": group.layers, "blocks": group.n,
            "direction": direction, "method": method, "host_format": fmt, "num_ctas": num_ctas, "default": default,
            **fields, "logical_bytes": logical, "wire_bytes": wire, "logical_gbps": round(logical / ms / 1e6, 3),
            "wire_gbps": round(wire / ms / 1e6, 3), "gbps": round(logical / ms / 1e6, 3), "status": "pass"}  # fmt: skip


def measure_group(group: Group, timer, sweep: list[int], budget_ms: float) -> list[dict]:
    """bf16 and FP8 at their default programs, FP8 with the integrity checks, then FP8 at each of ``sweep``, store
    and load."""
    rows = []
    checked = checked_runners(group, FP8)
    for direction, fn in (("store", cases.store), ("load", cases.load)):
        runs = [("bf16", None, None), ("fp8", FP8, None), *(("fp8", FP8, c) for c in sweep)]
        for method, fmt, ctas in runs:
            t = timer(lambda fn=fn, fmt=fmt, ctas=ctas: fn(group, fmt, ctas), budget_ms, min_reps=MIN_REPS)
            rows.append(make_row(group, direction, method, ctas, ctas is None, t))
        t = timer(checked[direction], budget_ms, min_reps=MIN_REPS)
        rows.append(make_row(group, direction, "fp8+checks", None, True, t))
    return rows


def measure_peak(group: Group, timer, budget_ms: float) -> list[dict]:
    """The link's practical ceiling: one contiguous pinned copy of the transfer's bf16 bytes, each direction."""
    nbytes = group.logical_bytes()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=group.caches[0].device)
    host = group.hosts[None].view(-1)[:nbytes]
    rows = []
    for direction, run in (("store", lambda: host.copy_(dev, non_blocking=True)),
                           ("load", lambda: dev.copy_(host, non_blocking=True))):  # fmt: skip
        rows.append(make_row(group, direction, "peak", None, True, timer(run, budget_ms, min_reps=MIN_REPS)))
    return rows


def _check_entry(group: Group, problems: list[str]) -> dict:
    return {"page": group.page.name, "page_bytes": group.page.page_bytes, "layout": group.layout,
            "layers": group.layers, "blocks": group.n, "status": "fail" if problems else "pass",
            "problems": problems}  # fmt: skip


def _plan(pages: list[Page], layouts: list[str]) -> list[tuple[Page, str]]:
    return [(p, layout) for p in pages for layout in layouts]


def run_gpu(args, doc: dict, save) -> None:
    """Each page in each layout: built, checked, timed (unless the check failed), the JSON rewritten."""
    from bench.common.env import open_gpu, release
    from bench.common.timing import GpuTimer

    device, stream, _env, meta = open_gpu()
    doc.update(meta, mode="gpu")
    timer = GpuTimer(stream, device)
    sweep = sorted({c for c in (*SWEEP, meta["sms"]) if c and c != DEFAULT_PROGRAMS}) if not args.no_sweep else []
    doc["sweep_num_ctas"] = sweep
    deadline = time.monotonic() + args.time_limit
    for page, layout in _plan(args.pages, args.layouts):
        if time.monotonic() > deadline:
            doc["stopped"] = f"time limit of {args.time_limit:g} s reached: {len(doc['left'])} page(s) not run"
            say(doc["stopped"])
            break
        group = cases.build_group(page, layout, args.blocks, layers_for(page, args.blocks), device)
        with torch.cuda.stream(stream):
            problems = cases.check_group(group) + check_checked(group, FP8)
        doc["checks"].append(_check_entry(group, problems))
        if problems:
            say(f"{page.name} {layout}: FAILED its check, not timed: {'; '.join(problems)}", style=STYLES["FAIL"])
        else:
            if not any(r["page"] == page.name and r["method"] == "peak" for r in doc["rows"]):
                doc["rows"] += measure_peak(group, timer, args.budget_ms)
            doc["rows"] += measure_group(group, timer, sweep, args.budget_ms)
            _print_page(doc["rows"], page.name, layout)
        doc["done"].append(f"{page.name}/{layout}")
        doc["left"].remove(f"{page.name}/{layout}")
        doc["ratios"] = cases.ratio_rows(doc["rows"])
        save()
        del group
        release(device)


def _print_page(rows: list[dict], page: str, layout: str) -> None:
    for r in rows:
        if r["page"] == page and (r["layout"] == layout or r["method"] == "peak"):
            ctas = "default" if r["default"] else r["num_ctas"]
            say(f"  {page:>10} {r['layout']:<11} {r['direction']:<5} {r['method']:<10} programs {ctas!s:<7} "
                f"{r['median_ms']:8.3f} ms  logical {r['logical_gbps']:7.1f} GB/s  "
                f"wire {r['wire_gbps']:7.1f} GB/s")  # fmt: skip


def run_cpu(args, doc: dict, save) -> None:
    """The checks of every CPU page and layout on tiny CPU caches (Triton's interpreter); nothing timed."""
    from bench.common.env import environment

    doc.update(environment(torch.device("cpu"), "not used"), mode="cpu-check")
    for page, layout in _plan(args.pages, args.layouts):
        group = cases.build_group(page, layout, CPU_BLOCKS, CPU_LAYERS, torch.device("cpu"))
        problems = cases.check_group(group) + check_checked(group, FP8)
        doc["checks"].append(_check_entry(group, problems))
        say(f"{page.name} {layout}: {'FAILED: ' + '; '.join(problems) if problems else 'round trip ok'}")
        doc["done"].append(f"{page.name}/{layout}")
        doc["left"].remove(f"{page.name}/{layout}")
        save()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.micro.fp8", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="every row, check and ratio, rewritten after each page")
    ap.add_argument("--plot", metavar="PATH", help="a PNG: logical GB/s vs page size, bf16 vs FP8, with the peak")
    ap.add_argument("--blocks", type=int, default=512, help="random GPU blocks per transfer (all layers)")
    ap.add_argument("--pages", nargs="+", metavar="TxHxD", help="pages as tokens x heads x head_dim (default: all)")
    ap.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    ap.add_argument("--budget-ms", type=float, default=BUDGET_MS, help="device time per measurement's samples")
    ap.add_argument("--time-limit", type=float, default=TIME_LIMIT_S, help="no page starts after this many seconds")
    ap.add_argument("--no-sweep", action="store_true", help="FP8 at its default programs only")
    ap.add_argument("--cpu-check", action="store_true", help="the checks on tiny CPU caches; nothing timed")
    args = ap.parse_args(argv)
    args.cpu_check = args.cpu_check or not torch.cuda.is_available()
    if args.blocks < cases.REF_BLOCKS:
        ap.error(f"--blocks must be at least {cases.REF_BLOCKS}, got {args.blocks}")
    if args.budget_ms <= 0 or args.time_limit <= 0:
        ap.error("--budget-ms and --time-limit must be positive")
    known = {p.name: p for p in (*PAGES, *cases.CPU_PAGES)}
    if args.pages is None:
        args.pages = list(cases.CPU_PAGES if args.cpu_check else PAGES)
    else:
        unknown = [p for p in args.pages if p not in known]
        if unknown:
            ap.error(f"unknown page(s) {unknown}; pages: {', '.join(known)}")
        args.pages = [known[p] for p in args.pages]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = [f"{p.name}/{layout}" for p, layout in _plan(args.pages, args.layouts)]
    blocks = CPU_BLOCKS if args.cpu_check else args.blocks
    layers = {p.name: CPU_LAYERS if args.cpu_check else layers_for(p, blocks) for p in args.pages}
    doc = {"benchmark": "fp8", "date": datetime.date.today().isoformat(), "complete": False, "blocks": blocks,
           "layers_per_page": layers, "fp8_default_programs": DEFAULT_PROGRAMS, "budget_ms": args.budget_ms,
           "done": [], "left": plan, "checks": [], "rows": [], "ratios": [], "targets": []}  # fmt: skip

    def save() -> None:
        if args.json:
            write_json(args.json, doc)

    try:
        (run_cpu if args.cpu_check else run_gpu)(args, doc, save)
    except BaseException as e:
        doc["error"] = f"{doc['left'][0] if doc['left'] else 'after the last page'}: {type(e).__name__}: {e}"
        save()
        raise
    doc["ratios"] = cases.ratio_rows(doc["rows"])
    doc["targets"] = cases.targets(doc["ratios"]) if not args.cpu_check else []
    doc["complete"] = not doc["left"]
    failed = [c for c in doc["checks"] if c["status"] != "pass"]
    for t in doc["targets"]:
        say(f"{t['result']:<4} {t['target']}: {t['detail']}", style=STYLES.get(t["result"]))
    if args.plot and not args.cpu_check:
        title = (f"{doc.get('device')} -- FP8 host format vs bf16, {args.blocks} blocks per transfer "
                 f"({doc['date']}, {str(doc.get('commit'))[:12]})")  # fmt: skip
        why = cases.plot_fp8(doc["ratios"], args.plot, title)
        say(why or f"wrote {args.plot}")
    save()
    if failed:
        names = ", ".join(f"{c['page']}/{c['layout']}" for c in failed)
        say(f"{len(failed)} check(s) failed: {names}", style=STYLES["FAIL"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
