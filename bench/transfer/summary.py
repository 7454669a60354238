"""The benchmark's output: the header, the result tables, and the targets evaluated against the rows (PASS / FAIL /
n/a)."""

from __future__ import annotations

from bench.common import targets
from bench.common.report import print_table
from bench.common.results import BASELINE_NAMES, INTEGRITY_METHOD, PYTHON_ISSUED, by_case
from bench.common.targets import (
    INTEGRITY_MAX_COST_PCT,
    INTEGRITY_MAX_HOST_US,
    INTEGRITY_MIN_PAGE_BYTES,
    SHAPE_GAIN_POINTS,
    SHAPE_SHORT_OF,
)
from triton_offload.kernels.shapes import DEFAULT_NUM_CTAS

__all__ = ["print_results", "print_integrity", "print_extras", "print_targets", "evaluate_targets"]

_SHORT = {
    "memcpy_batch": "batch",
    "memcpy_per_block": "per-blk",
    "torch_staged": "staged",
    "vllm033": "vllm033",
    "vllm_native": "native",
}
_HANDICAP = "\u2020"  # marks a value measured on a Python-issued (handicapped) baseline


def _fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _mark(row: dict | None, text: str) -> str:
    handicapped = row is not None and (row["impl"] or "").startswith(PYTHON_ISSUED)
    return text + _HANDICAP if handicapped else text


def _case_prefix(key: tuple) -> list:
    w, layout, page, n, f, skip, direction = key
    return [w, layout, f"{page // 1024}K" if page >= 1024 else str(page), n, f"{f}/{skip}", direction]


def print_results(rows: list[dict], sweep: list[int]) -> None:
    """Three tables: GB/s and speedups per case, host us beside device ms per call, and the Triton num_ctas sweep."""
    main, per_call, sweep_rows = [], [], []
    methods = [("triton", DEFAULT_NUM_CTAS), *((name, None) for name in BASELINE_NAMES), ("peak", None)]
    for key, by in by_case(rows).items():
        tri = by.get(("triton", DEFAULT_NUM_CTAS))
        best = max(
            (r for (m, c), r in by.items() if m == "triton" and r["gbps"]), key=lambda r: r["gbps"], default=None
        )
        peak = by.get(("peak", None))
        base = {name: by.get((name, None)) for name in BASELINE_NAMES}
        prefix = _case_prefix(key)
        main.append(
            prefix
            + [
                _fmt(next(iter(by.values()))["total_bytes"] / 2**20, ".1f"),
                _fmt(peak and peak["gbps"]),
                _fmt(tri and tri["gbps"]),
                _fmt(tri and tri["fraction_of_peak"] and 100 * tri["fraction_of_peak"], ".0f"),
                f"{best['gbps']:.1f} ({best['num_ctas']})" if best else "-",
                *(_mark(base[name], _fmt(base[name] and base[name]["gbps"])) for name in BASELINE_NAMES),
                *(_mark(base[name], _fmt(tri and tri[f"speedup_vs_{name}"], ".2f")) for name in BASELINE_NAMES),
            ]
        )
        per_call.append(prefix + [_per_call(by.get(m)) for m in methods])
        sweep_rows.append(prefix + [_fmt(by.get(("triton", c), {}).get("gbps")) for c in sweep])
    prefix_cols = ["workload", "layout", "page", "blocks", "f/skip", "dir"]
    handicap_note = f" {_HANDICAP}: a Python-issued (handicapped) baseline: its per-copy Python cost is included."
    print_table(
        "GB/s per method (same blocks, same bytes, same GPU)",
        [*prefix_cols, "MiB", "peak", f"triton@{DEFAULT_NUM_CTAS}", "%peak", "best (ctas)",
         *(_SHORT[name] for name in BASELINE_NAMES), *(f"x {_SHORT[name]}" for name in BASELINE_NAMES)],
        main,
        note="peak: one contiguous pinned copy of the same bytes. x: speedup of triton at the default num_ctas."
        + handicap_note,
    )  # fmt: skip
    print_table(
        "Per call: device ms / host us (the CPU submission cost, measured on the same calls)",
        [*prefix_cols, f"triton@{DEFAULT_NUM_CTAS}", *(_SHORT[name] for name in BASELINE_NAMES), "peak"],
        per_call,
        note="Host us above ~300 (the flush and sleep before each call) adds to the device time: copies cannot start "
        "before they are issued." + handicap_note,
    )
    print_table("Triton GB/s by num_ctas", [*prefix_cols, *(f"ctas={c}" for c in sweep)], sweep_rows)
    shape_rows = []
    for key, by in by_case(rows).items():
        fixed, sized = by.get(("triton", DEFAULT_NUM_CTAS)), by.get(("triton_size_aware", None))
        if sized is None:
            continue
        a, b = (r and r["fraction_of_peak"] for r in (fixed, sized))
        gain = None if a is None or b is None else 100 * (b - a)
        shape_rows.append(
            _case_prefix(key)
            + [_fmt(a and 100 * a, ".0f"), _fmt(b and 100 * b, ".0f"), _fmt(gain, "+.1f"), _programs(sized)]
        )
    if shape_rows:
        print_table(
            "Launch shape: % of peak, fixed (the default) vs size-aware",
            [*prefix_cols, f"fixed@{DEFAULT_NUM_CTAS}", "size-aware", "gain (points)", "programs"],
            shape_rows,
            note="size-aware: programs from the caches' page runs (kernels/copy_blocks.py, SIZE_AWARE_PROGRAMS). It "
            f"becomes the default only if it gains >= {SHAPE_GAIN_POINTS:g} points where the fixed shape is below "
            f"{SHAPE_SHORT_OF:.0%} without losing elsewhere or raising the serving benchmark's step slowdown.",
        )
    print_integrity(rows)


def _programs(row: dict) -> str:
    """The programs a size-aware row's impl names (``... N programs at most``)."""
    impl = row.get("impl") or ""
    head = impl.rsplit(" programs at most", 1)[0] if " programs at most" in impl else ""
    return head.rsplit(" ", 1)[-1] if head else "-"


def print_integrity(rows: list[dict]) -> None:
    """The integrity checks on vs off, case by case (only in a run that measured them: ``--integrity``): triton at the
    default num_ctas beside triton_integrity, their GB/s, the checks' cost and host us per call."""
    if not any(r["method"] == INTEGRITY_METHOD for r in rows):
        return
    table = []
    for key, by in by_case(rows).items():
        off, on = by.get(("triton", DEFAULT_NUM_CTAS)), by.get((INTEGRITY_METHOD, None))
        if on is None:
            continue
        timed = bool(off and off["gbps"] and on["gbps"])
        cost = 100 * (1 - on["gbps"] / off["gbps"]) if timed else None
        extra_us = on["call_cpu_us"] - off["call_cpu_us"] if timed else None
        table.append(
            _case_prefix(key)
            + [_fmt(off and off["gbps"]), _fmt(on["gbps"]) if on["gbps"] else on["status"], _fmt(cost, ".1f"),
               _fmt(off and off["call_cpu_us"]), _fmt(on["call_cpu_us"]), _fmt(extra_us, "+.1f")]
        )  # fmt: skip
    print_table(
        f"Integrity checks on vs off (triton@{DEFAULT_NUM_CTAS}, the same blocks)",
        ["workload", "layout", "page", "blocks", "f/skip", "dir", "GB/s off", "GB/s on", "cost %", "host us off",
         "host us on", "host +us"],
        table,
        note=f"on: {INTEGRITY_METHOD}, the kernel with the checks fused (docs/integrity.md); cost: the bandwidth lost, "
        f"in % of off. The goal: <= {INTEGRITY_MAX_COST_PCT:g} % at pages >= {INTEGRITY_MIN_PAGE_BYTES // 1024} KiB, "
        f"<= {INTEGRITY_MAX_HOST_US:g} us of host time per call (python -m bench.micro.call_cost --integrity "
        "measures that more finely).",
    )  # fmt: skip


def _per_call(row: dict | None) -> str:
    if row is None or row["median_ms"] is None:
        return "-" if row is None else row["status"]
    return _mark(row, f"{row['median_ms']:.3f} / {row['call_cpu_us']:.0f}")


def evaluate_targets(rows: list[dict], overhead: dict | None, inter: dict | None) -> list[dict]:
    """The transfer targets (bench/common/targets.py, listed in docs/benchmarks.md, "Output") over this run's rows and
    extras, each PASS/FAIL (or n/a when not measured) with the worst case as the detail; the integrity checks' only in
    a run that measured them (``--integrity``)."""
    return targets.evaluate(targets.case_values(rows, DEFAULT_NUM_CTAS, overhead, inter), measured_only=True)


def print_extras(overhead: dict | None, inter: dict | None, setup: str) -> None:
    """The CPU cost per call and the interference tables; ``setup`` names the workload they ran on."""
    if overhead:
        print_table(
            f"CPU cost of one call, {setup}, us",
            ["call", "", "median", "p20", "p80", "min", "validation only"],
            [[k, "", v["median_us"], v["p20_us"], v["p80_us"], v["min_us"], v["validation_median_us"]]
             for k, v in overhead.items()],
        )  # fmt: skip
    if inter:
        rows = [["-", "none", "-", inter["gemm_ms_alone"], "0.0", "-", "-", "-"]]
        for r in inter["rows"]:
            if "error" in r:
                rows.append([r["direction"], r["method"], _fmt(r["num_ctas"], "d"), f"ERROR: {r['error'][:80]}"])
                continue
            rows.append(
                [r["direction"], r["method"], _fmt(r["num_ctas"], "d"), r["gemm_ms"], f"{r['slowdown_pct']:.1f}",
                 r["transfer_gbps_during"], r["transfer_gbps_alone"], "yes" if r["covered"] else "NO"]
            )  # fmt: skip
        g = inter["gemm"]
        print_table(
            f"Interference: bf16 GEMM {g['m']}^3 x {g['iters']} on the compute stream, transfers on a side stream",
            ["dir", "method", "ctas", "GEMM ms", "slowdown %", "GB/s during", "GB/s alone", "covered"],
            rows,
            note="covered: the transfers outlasted the whole GEMM loop (otherwise the slowdown is understated).",
        )


def print_targets(targets: list[dict]) -> None:
    rows = [[t["target"], t["result"], t["detail"]] for t in targets]
    print_table("Targets (reported, not asserted)", ["target", "result", "detail"], rows, left=3)
