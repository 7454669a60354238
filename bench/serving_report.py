"""The serving benchmark's output: its rows (:data:`ROW_KEYS`), the figures relative to ``none`` and to the
contiguous copy, the targets (PASS / FAIL / n/a with the worst case), the tables and the PNG."""

from __future__ import annotations

import numpy as np

from triton_offload.kernels.copy_blocks import DEFAULT_NUM_CTAS

# isort: split
# Sibling modules: bench/ is on sys.path when this runs as a script (it is not a package).
from report import print_table
from results import keyed_row
from serving_loop import LoopRun
from serving_methods import MethodPoint
from summary import target_result

__all__ = ["ROW_KEYS", "TIMING_KEYS", "new_row", "timing_fields", "count_fields", "fill_relative", "evaluate_targets",
           "print_rows", "print_duplex", "plot_serving"]  # fmt: skip

# Every key a run's timing sets; null on CPU, and on a row whose byte check failed.
TIMING_KEYS = (
    "step_ms_median", "step_ms_p90", "step_ms_p99", "slowdown_vs_none", "compute_ms_median",
    "load_latency_ms_median", "load_latency_ms_p99", "load_wait_ms_median", "load_device_ms_median",
    "load_vs_contiguous", "submit_cpu_us_per_step", "store_submit_us_median", "load_submit_us_median",
    "poll_us_per_step", "offload_gbps",
)  # fmt: skip
ROW_KEYS = (
    "device", "workload", "layout", "method", "num_ctas", "impl", "page_bytes", "num_layers", "block_size",
    "prefill_tokens", "decode_tokens", "prefix_tokens", "load_every", "steps", "defer_stores", "byte_check",
    "byte_check_note", *TIMING_KEYS, "loads", "stored_bytes_per_step", "load_bytes", "store_waits",
)  # fmt: skip
"""One row per (workload, method, num_ctas); see bench/README.md, "Serving benchmark"."""


def new_row(**fields) -> dict:
    return keyed_row(ROW_KEYS, fields)


def _median(values) -> float | None:
    return float(np.median(values)) if len(values) else None


def _q(values, q: float) -> float | None:
    return float(np.quantile(values, q)) if len(values) else None


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def timing_fields(run: LoopRun) -> dict:
    """A GPU run's timing fields (the relative ones are filled by :func:`fill_relative`)."""
    recs = run.records
    step_ms = [r.step_s * 1e3 for r in recs]
    loads = [r for r in recs if r.load_job is not None]
    stores = [r.store_submit_s * 1e6 for r in recs if r.store_submit_s is not None]
    submit = [(r.store_submit_s or 0.0) + (r.load_submit_s or 0.0) for r in recs]
    moved = sum(r.store_bytes + r.load_bytes for r in recs)
    ms, us = 3, 1
    return {
        "step_ms_median": _round(_median(step_ms), ms),
        "step_ms_p90": _round(_q(step_ms, 0.9), ms),
        "step_ms_p99": _round(_q(step_ms, 0.99), ms),
        "compute_ms_median": _round(_median(run.compute_ms), ms),
        "load_latency_ms_median": _round(_median([r.load_latency_s * 1e3 for r in loads]), ms),
        "load_latency_ms_p99": _round(_q([r.load_latency_s * 1e3 for r in loads], 0.99), ms),
        "load_wait_ms_median": _round(_median([r.load_wait_s * 1e3 for r in loads]), ms),
        "load_device_ms_median": _round(
            _median([run.load_device_s[r.load_job] * 1e3 for r in loads if r.load_job in run.load_device_s]), ms
        ),
        "submit_cpu_us_per_step": _round(float(np.mean(submit)) * 1e6, us),
        "store_submit_us_median": _round(_median(stores), us),
        "load_submit_us_median": _round(_median([r.load_submit_s * 1e6 for r in loads]), us),
        "poll_us_per_step": _round(float(np.mean([r.poll_s for r in recs])) * 1e6, us),
        "offload_gbps": _round(moved / sum(r.step_s for r in recs) / 1e9, 3),
    }


def count_fields(run: LoopRun) -> dict:
    """What a run moved (both modes)."""
    recs = run.records
    return {
        "loads": sum(r.load_job is not None for r in recs),
        "stored_bytes_per_step": int(np.mean([r.store_bytes for r in recs])),
        "load_bytes": max((r.load_bytes for r in recs), default=0),
        "store_waits": sum(r.store_waits for r in recs),
    }


def fill_relative(rows: list[dict], contiguous: dict[str, dict]) -> None:
    """slowdown_vs_none (against the same workload's ``none`` row) and load_vs_contiguous (against the workload's
    contiguous pinned copy of the same bytes)."""
    none = {r["workload"]: r["step_ms_median"] for r in rows if r["method"] == "none" and r["step_ms_median"]}
    for r in rows:
        base = none.get(r["workload"])
        if r["step_ms_median"] is not None and base:
            r["slowdown_vs_none"] = round(r["step_ms_median"] / base - 1.0, 4)
        contig = contiguous.get(r["workload"])
        if r["load_latency_ms_median"] is not None and contig:
            r["load_vs_contiguous"] = round(r["load_latency_ms_median"] / contig["latency_ms"], 3)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _targets_of(label: str, ours: dict, none: dict, v33: dict) -> list[dict]:
    """The step, load and submit targets of one of our methods (rows by workload), against ``none`` and vllm033."""
    slow, contig, vs_v33, store_sub, load_sub = [], [], [], [], []
    for w, r in ours.items():
        if r["slowdown_vs_none"] is not None:
            # The compute stream's own time says whether the model lost SMs or the worker thread lost time.
            base = none[w]
            where = (f"{w} (median step {r['step_ms_median']} vs {base['step_ms_median']} ms; compute "
                     f"{r['compute_ms_median']} vs {base['compute_ms_median']} ms)")  # fmt: skip
            slow.append((r["slowdown_vs_none"], where))
        if r["load_vs_contiguous"] is not None:
            where = (f"{w} (latency {r['load_latency_ms_median']} ms: submit {r['load_submit_us_median']} us, "
                     f"device {r['load_device_ms_median']} ms)")  # fmt: skip
            contig.append((r["load_vs_contiguous"], where))
        b = v33.get(w)
        if b is None:
            continue
        pairs = (
            (vs_v33, "load_latency_ms_median", "ms"),
            (store_sub, "store_submit_us_median", "us"),
            (load_sub, "load_submit_us_median", "us"),
        )
        for out, key, unit in pairs:
            ratio = _ratio(r[key], b[key])
            if ratio is not None:
                out.append((ratio, f"{w} ({r[key]} vs {b[key]} {unit})"))
    return [
        target_result(f"median step time with {label} within 2% of none", slow, lambda v: v <= 0.02, False),
        target_result(f"{label} load latency <= 1.15x the contiguous pinned copy", contig, lambda v: v <= 1.15,
                      False),
        target_result(f"{label} load latency <= vllm033's", vs_v33, lambda v: v <= 1.0, False),
        target_result(f"{label} store submit host time <= 1/10 of vllm033's", store_sub, lambda v: v <= 0.1,
                      False),
        target_result(f"{label} load submit host time <= vllm033's", load_sub, lambda v: v <= 1.0, False),
    ]  # fmt: skip


def evaluate_targets(rows: list[dict], duplex_rows: list[dict]) -> list[dict]:
    """The issue's targets, each over every workload (bench/README.md, "Serving benchmark"): for our kernel at the
    default num_ctas, and for ``auto`` (what a user gets on CUDA) where it ran. A workload contributes where both
    sides of a comparison were measured and byte-checked."""
    by_method = lambda m, c=None: {r["workload"]: r for r in rows if r["method"] == m and r["num_ctas"] == c}  # noqa: E731
    none, v33 = by_method("none"), by_method("vllm033")
    d = DEFAULT_NUM_CTAS
    targets = _targets_of(f"triton@{d}", by_method("triton", d), none, v33)
    auto = by_method("auto")
    if auto:
        targets += _targets_of("auto", auto, none, v33)
    duplex = [
        (x["ratio"], f"{x['workload']} ({x['duplex_gbps']} GB/s vs {x['store_alone_gbps']} / {x['load_alone_gbps']})")
        for x in duplex_rows
        if x["method"] == "triton" and x["num_ctas"] == d and x["ratio"] is not None
    ]
    targets.append(target_result(f"triton@{d} duplex >= 1.7x the faster direction alone", duplex, lambda v: v >= 1.7))
    return targets


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _label(r: dict) -> str:
    return MethodPoint(r["method"], r["num_ctas"]).label


def print_rows(rows: list[dict], timed: bool) -> None:
    """The per-method table (timed: the step and load figures; CPU: each method's byte check and path)."""
    if not timed:
        print_table(
            "Serving loop, CPU check: the bytes each method stored and loaded (NOTHING WAS TIMED)",
            ["workload", "method", "byte check", "implementation"],
            [[r["workload"], _label(r), r["byte_check"], r["byte_check_note"] or r["impl"] or ""] for r in rows],
            left=4,
        )
        return
    table = []
    for r in rows:
        slow = r["slowdown_vs_none"]
        table.append(
            [r["workload"], _label(r), r["byte_check"], _fmt(r["step_ms_median"]), _fmt(r["step_ms_p90"]),
             _fmt(r["step_ms_p99"]), _fmt(slow and 100 * slow, ".1f"), _fmt(r["compute_ms_median"]),
             _fmt(r["load_latency_ms_median"]), _fmt(r["load_latency_ms_p99"]), _fmt(r["load_wait_ms_median"]),
             _fmt(r["load_device_ms_median"]), _fmt(r["load_vs_contiguous"]), _fmt(r["submit_cpu_us_per_step"], ".0f"),
             _fmt(r["store_submit_us_median"], ".0f"), _fmt(r["load_submit_us_median"], ".0f"),
             _fmt(r["offload_gbps"])]
        )  # fmt: skip
    print_table(
        "Serving step loop: step time, prefix-load latency, submit host time, offload bandwidth",
        ["workload", "method", "check", "step ms", "p90", "p99", "slow %", "compute ms", "load ms", "p99",
         "waited ms", "load dev ms", "x contig", "submit us/step", "store us", "load us", "offload GB/s"],
        table,
        note="step: the worker's wall time per step; slow %: median vs none; load: submit to done (host), waited: "
        "from the submit's return to done; x contig: load latency / the contiguous pinned copy of the same bytes.",
    )  # fmt: skip


def print_duplex(duplex_rows: list[dict]) -> None:
    if not duplex_rows:
        return
    print_table(
        "Duplex: a store and a load of one prefix's blocks at once vs each alone",
        ["workload", "method", "check", "store GB/s", "load GB/s", "both GB/s", "x faster alone"],
        [[d["workload"], _label(d), d["byte_check"], _fmt(d["store_alone_gbps"]), _fmt(d["load_alone_gbps"]),
          _fmt(d["duplex_gbps"]), _fmt(d["ratio"])] for d in duplex_rows],
    )  # fmt: skip


def plot_serving(samples: dict[str, dict[str, dict]], contiguous: dict[str, dict], path: str, title: str) -> str | None:
    """Per workload: the step-time distribution of each method (box: quartiles, whiskers: p1-p99) and its load
    latency (bar: median, tick: p99; dashed: the contiguous copy). Returns None, or why nothing was written."""
    if not samples:
        return "nothing was timed: no plot written"
    try:
        import matplotlib
    except ImportError:  # the measurements are in the JSON already; the PNG is a view of them
        return "matplotlib is not installed: no plot written"

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(samples), 2, figsize=(14, 4.2 * len(samples)), squeeze=False)
    for (workload, by_method), (ax_step, ax_load) in zip(samples.items(), axes):
        labels = list(by_method)
        ax_step.boxplot([by_method[m]["step_ms"] for m in labels], whis=(1, 99), showfliers=False)
        ax_step.set_xticks(range(1, len(labels) + 1), labels, rotation=20)
        ax_step.set_ylabel("step time, ms")
        ax_step.set_title(f"{workload}: step time per method")
        loaded = [m for m in labels if by_method[m]["load_latency_ms"]]
        med = [float(np.median(by_method[m]["load_latency_ms"])) for m in loaded]
        p99 = [float(np.quantile(by_method[m]["load_latency_ms"], 0.99)) for m in loaded]
        ax_load.bar(range(len(loaded)), med, color="tab:blue", label="median")
        ax_load.scatter(range(len(loaded)), p99, marker="_", s=400, color="black", label="p99")
        if workload in contiguous:
            ax_load.axhline(contiguous[workload]["latency_ms"], linestyle="--", color="gray",
                            label="contiguous pinned copy")  # fmt: skip
        ax_load.set_xticks(range(len(loaded)), loaded, rotation=20)
        ax_load.set_ylabel("prefix load latency, ms (submit to done)")
        ax_load.set_title(f"{workload}: load latency per method")
        ax_load.legend(fontsize=8)
        for ax in (ax_step, ax_load):
            ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
