"""The serving benchmark's output: its rows (:data:`ROW_KEYS`, one per workload, shape, load mode and method, over
the method's runs in every round), the figures relative to ``none`` and to the contiguous copy, the drift between the
``none`` runs, the targets (PASS / FAIL / n/a with the worst case), the tables and the PNG."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.common.report import print_table
from bench.common.results import keyed_row
from bench.serving.config import ASYNC, SYNC
from bench.serving.loop import LoopRun
from bench.serving.methods import MethodPoint
from triton_offload.kernels.shapes import DEFAULT_NUM_CTAS

__all__ = ["ROW_KEYS", "TIMING_KEYS", "COUNT_KEYS", "BASELINES", "new_row", "timing_fields", "count_fields",
           "drift_of", "fill_relative", "evaluate_targets", "print_rows", "print_duplex", "print_targets",
           "plot_serving", "group_key"]  # fmt: skip

# Every key a run's timing sets; null on CPU, and on a row whose bytes were wrong.
TIMING_KEYS = (
    "step_ms_mean", "step_ms_median", "step_ms_p90", "step_ms_p99", "load_steps_ms_mean", "other_steps_ms_mean",
    "slowdown_vs_none", "slowdown_vs_none_median", "load_steps_slowdown_vs_none", "other_steps_slowdown_vs_none",
    "drift_vs_none", "compute_ms_median", "load_latency_ms_median", "load_latency_ms_p99", "load_wait_ms_median",
    "load_device_ms_median", "load_steps_waited_median", "load_vs_contiguous", "submit_cpu_us_per_step",
    "store_submit_us_median", "load_submit_us_median", "poll_us_per_step", "check_pause_ms_per_step",
    "offload_gbps", "offload_demand_gbps",
)  # fmt: skip
# What a run moved and checked (both modes).
COUNT_KEYS = ("loads", "load_steps", "stored_bytes_per_step", "load_bytes", "store_waits", "jobs_checked",
              "load_region_waits", "store_slot_waits")  # fmt: skip
ROW_KEYS = (
    "device", "workload", "shape", "layout", "load_mode", "method", "num_ctas", "impl", "page_bytes", "num_layers",
    "block_size", "prefill_tokens", "decode_tokens", "context_tokens", "prefix_tokens", "load_every", "steps",
    "rounds", "defer_stores", "byte_check", "byte_check_note", *TIMING_KEYS, *COUNT_KEYS,
)  # fmt: skip
"""One row per (workload, shape, load mode, method, num_ctas); see docs/benchmarks.md, "The serving benchmark"."""

# The baselines our methods' load and submit targets compare against, where they ran.
BASELINES = ("vllm033", "vllm_native")
# Issue 63: a host hit's load time in the FP8 host format "~half" of bf16's (its rows are ~0.51-0.53 of the bytes).
FP8_LOAD_RATIO = 0.55


def new_row(**fields) -> dict:
    return keyed_row(ROW_KEYS, fields)


def group_key(row: dict) -> tuple[str, str, str]:
    """(workload, shape, load mode): the rows compared with each other (and with their ``none``)."""
    return row["workload"], row["shape"], row["load_mode"]


def _mean(values) -> float | None:
    return float(np.mean(values)) if len(values) else None


def _median(values) -> float | None:
    return float(np.median(values)) if len(values) else None


def _q(values, q: float) -> float | None:
    return float(np.quantile(values, q)) if len(values) else None


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _measured_loads(runs: Sequence[LoopRun]):
    return [ld for run in runs for ld in run.loads.values() if ld.measured]


def timing_fields(runs: Sequence[LoopRun], shape_warmup: int) -> dict:
    """A GPU row's timing fields over its runs (the relative ones are filled by :func:`fill_relative`): every
    measured step counts (the mean is what throughput sees), load steps and the others apart."""
    recs = [r for run in runs for r in run.records]
    step_ms = [r.step_s * 1e3 for r in recs]
    loads = _measured_loads(runs)
    done = [ld for ld in loads if ld.latency_s is not None]
    device = [run.device_s[ld.job][1] * 1e3 for run in runs for ld in run.loads.values()
              if ld.measured and ld.job in run.device_s]  # fmt: skip
    stores = [r.store_submit_s * 1e6 for r in recs if r.store_submit_s is not None]
    submit = [(r.store_submit_s or 0.0) + (r.load_submit_s or 0.0) for r in recs]
    # Achieved: bytes of the measured steps' jobs / their device time (the engines' events); demand: / wall time.
    jobs = [(run.job_bytes[j], sec) for run in runs for j, (_, sec) in run.device_s.items() if j // 2 >= shape_warmup]
    moved, dev_s = sum(b for b, _ in jobs), sum(sec for _, sec in jobs)
    wall = sum(r.step_s for r in recs)
    demand = sum(r.store_bytes + r.load_bytes for r in recs) / wall if wall else None
    ms, us = 3, 1
    return {
        "step_ms_mean": _round(_mean(step_ms), ms),
        "step_ms_median": _round(_median(step_ms), ms),
        "step_ms_p90": _round(_q(step_ms, 0.9), ms),
        "step_ms_p99": _round(_q(step_ms, 0.99), ms),
        "load_steps_ms_mean": _round(_mean([r.step_s * 1e3 for r in recs if r.load_step]), ms),
        "other_steps_ms_mean": _round(_mean([r.step_s * 1e3 for r in recs if not r.load_step]), ms),
        "compute_ms_median": _round(_median([c for run in runs for c in run.compute_ms]), ms),
        "load_latency_ms_median": _round(_median([ld.latency_s * 1e3 for ld in done]), ms),
        "load_latency_ms_p99": _round(_q([ld.latency_s * 1e3 for ld in done], 0.99), ms),
        "load_wait_ms_median": _round(_median([ld.wait_s * 1e3 for ld in done if ld.wait_s is not None]), ms),
        "load_device_ms_median": _round(_median(device), ms),
        "load_steps_waited_median": _median([ld.steps for ld in done if ld.steps is not None]),
        "submit_cpu_us_per_step": _round(_mean(submit) * 1e6, us) if submit else None,
        "store_submit_us_median": _round(_median(stores), us),
        "load_submit_us_median": _round(_median([ld.submit_s * 1e6 for ld in loads]), us),
        "poll_us_per_step": _round(_mean([r.poll_s for r in recs]) * 1e6, us) if recs else None,
        "check_pause_ms_per_step": _round(sum(run.pause_s for run in runs) * 1e3 / max(1, len(recs)), ms),
        "offload_gbps": _round(moved / dev_s / 1e9, 3) if dev_s else None,
        "offload_demand_gbps": _round(demand / 1e9, 3) if demand is not None else None,
    }


def count_fields(runs: Sequence[LoopRun]) -> dict:
    """What a row's runs moved and checked (both modes)."""
    recs = [r for run in runs for r in run.records]
    return {
        "loads": len(_measured_loads(runs)),
        "load_steps": sum(r.load_step for r in recs),
        "stored_bytes_per_step": int(np.mean([r.store_bytes for r in recs])) if recs else 0,
        "load_bytes": max((ld.nbytes for run in runs for ld in run.loads.values()), default=0),
        "store_waits": sum(r.store_waits for r in recs),
        "jobs_checked": sum(run.jobs_checked for run in runs),
        "load_region_waits": sum(run.load_region_waits for run in runs),
        "store_slot_waits": sum(run.store_slot_waits for run in runs),
    }


def drift_of(none_runs: Sequence[LoopRun]) -> dict:
    """The drift between a group's ``none`` runs: their mean step times and (max - min) / min (a fraction; None with
    fewer than two runs)."""
    means = [float(np.mean([r.step_s for r in run.records])) * 1e3 for run in none_runs if run.records]
    drift = (max(means) - min(means)) / min(means) if len(means) >= 2 and min(means) > 0 else None
    return {"none_step_ms_means": [round(m, 3) for m in means], "drift_vs_none": _round(drift, 4)}


def fill_relative(rows: list[dict], contiguous: dict[str, dict]) -> None:
    """The columns relative to the same group's ``none`` row (its mean step time over every step: its steps are
    alike) and to the contiguous pinned copy of the same bytes (``contiguous``: by ``workload/shape``)."""
    none = {group_key(r): r for r in rows if r["method"] == "none" and r["step_ms_mean"]}
    for r in rows:
        base = none.get(group_key(r))
        if base is not None and r["step_ms_mean"] is not None:
            r["drift_vs_none"] = base["drift_vs_none"]
            for key, of in (("slowdown_vs_none", "step_ms_mean"), ("load_steps_slowdown_vs_none", "load_steps_ms_mean"),
                            ("other_steps_slowdown_vs_none", "other_steps_ms_mean")):  # fmt: skip
                if r[of] is not None:
                    r[key] = round(r[of] / base["step_ms_mean"] - 1.0, 4)
            r["slowdown_vs_none_median"] = round(r["step_ms_median"] / base["step_ms_median"] - 1.0, 4)
        contig = contiguous.get(f"{r['workload']}/{r['shape']}")
        if r["load_latency_ms_median"] is not None and contig and r["load_mode"] == SYNC:
            r["load_vs_contiguous"] = round(r["load_latency_ms_median"] / contig["latency_ms"], 3)


@dataclass(frozen=True)
class Case:
    """One case of a target: the value, where it was measured, and the drift of its group (0: none measured)."""

    value: float
    where: str
    drift: float = 0.0


def _margin(value: float, limit: float, at_most: bool, relative: bool) -> float:
    """How far ``value`` is inside the limit (negative: outside), as a fraction of the limit (``relative``) or in
    the value's own units (a fraction like a slowdown)."""
    gap = limit - value if at_most else value - limit
    return gap / limit if relative else gap


def target(name: str, cases: Sequence[Case], limit: float, *, at_most: bool = True, relative: bool = True) -> dict:
    """One target's entry. A case passes when it is inside ``limit`` by more than its group's drift between ``none``
    runs (by at least 0 where no drift was measured); the target PASSes when every case does, is n/a without cases.
    ``worst``/``where``: the case with the least margin left over its drift."""
    if not cases:
        return {"name": name, "verdict": "n/a", "worst": None, "where": None, "limit": limit, "drift": None,
                "cases": 0, "missed": 0, "detail": "not measured in this run"}  # fmt: skip
    left = [(_margin(c.value, limit, at_most, relative) - c.drift, c) for c in cases]
    passed = [m > 0 if c.drift else m >= 0 for m, c in left]
    worst_left, worst = min(left, key=lambda x: x[0])
    missed = passed.count(False)
    return {
        "name": name,
        "verdict": "FAIL" if missed else "PASS",
        "worst": worst.value,
        "where": worst.where,
        "limit": limit,
        "drift": worst.drift,
        "cases": len(cases),
        "missed": missed,
        "detail": f"worst {worst.value:.4g} at {worst.where}; {missed} of {len(cases)} cases miss"
        + (
            " (a case passes only by more than its group's drift between none runs)"
            if any(c.drift for c in cases)
            else ""
        ),
    }


def _where(r: dict, text: str) -> str:
    drift = r["drift_vs_none"]
    return f"{r['workload']}/{r['shape']}/{r['load_mode']} ({text}; drift {'-' if drift is None else drift})"


def _targets_of(label: str, ours: list[dict], by_group: dict) -> list[dict]:
    """The step, load and submit targets of one of our methods (its rows), against none and the baselines."""
    slow, other, contig, load_vs, store_sub, load_sub = [], [], [], [], [], []
    for r in ours:
        g = group_key(r)
        drift = r["drift_vs_none"] or 0.0
        none = by_group.get((g, "none"))
        if none is not None and r["slowdown_vs_none"] is not None:
            compute = f"compute {r['compute_ms_median']} vs {none['compute_ms_median']} ms"
            if r["load_mode"] == ASYNC:
                text = f"mean step {r['step_ms_mean']} vs {none['step_ms_mean']} ms; {compute}"
                slow.append(Case(r["slowdown_vs_none"], _where(r, text), drift))
            elif r["other_steps_slowdown_vs_none"] is not None:
                text = f"mean of steps without a load {r['other_steps_ms_mean']} vs {none['step_ms_mean']} ms"
                text += f"; {compute}"
                other.append(Case(r["other_steps_slowdown_vs_none"], _where(r, text), drift))
        if r["load_vs_contiguous"] is not None:
            text = (f"latency {r['load_latency_ms_median']} ms: submit {r['load_submit_us_median']} us, device "
                    f"{r['load_device_ms_median']} ms")  # fmt: skip
            contig.append(Case(r["load_vs_contiguous"], _where(r, text), drift))
        for name in BASELINES:
            b = by_group.get((g, name))
            if b is None:
                continue
            load_key = "load_latency_ms_median" if r["load_mode"] == SYNC else "load_device_ms_median"
            for out, key, unit in ((load_vs, load_key, "ms"), (store_sub, "store_submit_us_median", "us"),
                                   (load_sub, "load_submit_us_median", "us")):  # fmt: skip
                if r[key] is not None and b[key]:
                    out.append(Case(r[key] / b[key], _where(r, f"{key} {r[key]} vs {name}'s {b[key]} {unit}"), drift))
    return [
        target(f"{label}: mean step time within 2% of none, async loads (every step)", slow, 0.02, relative=False),
        target(f"{label}: mean step time of the steps without a load within 2% of none, sync loads", other, 0.02,
               relative=False),
        target(f"{label}: sync load latency <= 1.15x the contiguous pinned copy", contig, 1.15),
        target(f"{label}: load time <= vllm033's and vllm_native's (sync: latency; async: device time)", load_vs,
               1.0),
        target(f"{label}: store submit host time <= 1/10 of vllm033's and vllm_native's", store_sub, 0.1),
        target(f"{label}: load submit host time <= vllm033's and vllm_native's", load_sub, 1.0),
    ]  # fmt: skip


def _fp8_target(measured: list[dict]) -> dict:
    """Issue 63's serving target: a host hit's load time in the FP8 host format (``triton_fp8``) about half of
    bf16's (``triton`` at the default num_ctas) in the same group (sync: latency; async: device time)."""
    d = DEFAULT_NUM_CTAS
    bf16 = {group_key(r): r for r in measured if r["method"] == "triton" and r["num_ctas"] == d}
    cases = []
    for r in measured:
        b = bf16.get(group_key(r))
        key = "load_latency_ms_median" if r["load_mode"] == SYNC else "load_device_ms_median"
        if r["method"] == "triton_fp8" and b is not None and r[key] is not None and b[key]:
            text = f"{key} {r[key]} vs triton@{d}'s {b[key]} ms"
            cases.append(Case(r[key] / b[key], _where(r, text), r["drift_vs_none"] or 0.0))
    return target(f"triton_fp8: load time <= {FP8_LOAD_RATIO}x triton@{d}'s, bf16 (sync: latency; async: device "
                  "time)", cases, FP8_LOAD_RATIO)  # fmt: skip


def evaluate_targets(rows: list[dict], duplex_rows: list[dict]) -> list[dict]:
    """The serving targets (docs/benchmarks.md, "Targets (GPU)"), each over every workload, shape and load mode it
    applies to: for our kernel at the default num_ctas, and for ``auto`` (what a user gets on CUDA) where it ran. A case
    counts where both sides of a comparison were measured and byte-checked."""
    measured = [r for r in rows if r["byte_check"] == "pass" and r["step_ms_mean"] is not None]
    by_group = {(group_key(r), r["method"]): r for r in measured if r["method"] != "triton"}
    d = DEFAULT_NUM_CTAS
    targets = _targets_of(f"triton@{d}", [r for r in measured if r["method"] == "triton" and r["num_ctas"] == d],
                          by_group)  # fmt: skip
    auto = [r for r in measured if r["method"] == "auto"]
    if auto:
        targets += _targets_of("auto", auto, by_group)
    if any(r["method"] == "triton_fp8" for r in measured):
        targets.append(_fp8_target(measured))
    ours = [x for x in duplex_rows if x["method"] == "triton" and x["num_ctas"] == d and x["ratio"] is not None]
    alone = [Case(x["ratio"], f"{x['workload']} ({x['duplex_gbps']} GB/s vs {x['store_alone_gbps']} / "
                  f"{x['load_alone_gbps']} alone)") for x in ours]  # fmt: skip
    contig = [Case(x["ratio_vs_contiguous"], f"{x['workload']} ({x['duplex_gbps']} GB/s vs {x['contiguous_gbps']} "
                   "GB/s)") for x in ours if x.get("ratio_vs_contiguous") is not None]  # fmt: skip
    targets.append(target(f"triton@{d} duplex >= 1.7x the faster direction alone", alone, 1.7, at_most=False))
    targets.append(target(f"triton@{d} duplex >= 1.7x the contiguous pinned copy (one way)", contig, 1.7,
                          at_most=False))  # fmt: skip
    return targets


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _label(r: dict) -> str:
    return MethodPoint(r["method"], r["num_ctas"]).label


def _pct(x) -> str:
    return _fmt(None if x is None else 100 * x, ".1f")


def print_rows(rows: list[dict], timed: bool) -> None:
    """The per-method table (timed: the step and load figures; CPU: each method's byte check and path)."""
    if not timed:
        print_table(
            "Serving loop, CPU check: the bytes each method stored and loaded (NOTHING WAS TIMED)",
            ["workload", "shape", "loads", "method", "byte check", "jobs checked", "implementation"],
            [[r["workload"], r["shape"], r["load_mode"], _label(r), r["byte_check"], _fmt(r["jobs_checked"], "d"),
              r["byte_check_note"] or r["impl"] or ""] for r in rows],
            left=6,
            wrap_last=True,
        )  # fmt: skip
        return
    table = []
    for r in rows:
        table.append(
            [r["workload"], r["shape"], r["load_mode"], _label(r), r["byte_check"], _fmt(r["step_ms_mean"]),
             _fmt(r["step_ms_median"]), _fmt(r["step_ms_p99"]), _pct(r["slowdown_vs_none"]),
             _pct(r["load_steps_slowdown_vs_none"]), _pct(r["other_steps_slowdown_vs_none"]), _pct(r["drift_vs_none"]),
             _fmt(r["compute_ms_median"]), _fmt(r["load_latency_ms_median"]), _fmt(r["load_device_ms_median"]),
             _fmt(r["load_vs_contiguous"]), _fmt(r["store_submit_us_median"], ".0f"),
             _fmt(r["load_submit_us_median"], ".0f"), _fmt(r["offload_gbps"]), _fmt(r["offload_demand_gbps"]),
             _fmt(r["jobs_checked"], "d")]
        )  # fmt: skip
    print_table(
        "Serving step loop: step time, prefix-load latency, submit host time, offload bandwidth",
        ["workload", "shape", "loads", "method", "check", "mean ms", "median", "p99", "slow %", "load st %",
         "other %", "drift %", "compute", "load ms", "load dev", "x contig", "store us", "load us", "GB/s", "demand",
         "jobs"],
        table,
        note="mean / median / p99: every measured step's wall time; slow %: mean vs none's mean (load st / other: the "
        "steps with a load in flight / the rest); drift: between the none runs; load ms: submit to done (sync) or "
        "to the poll that reported it (async); GB/s: bytes / the transfers' device time; demand: bytes / step time.",
    )  # fmt: skip


def print_duplex(duplex_rows: list[dict]) -> None:
    if not duplex_rows:
        return
    print_table(
        "Duplex: a store and a load of one prefix's blocks at once vs each alone",
        ["workload", "method", "check", "store GB/s", "load GB/s", "both GB/s", "x faster alone", "contig GB/s",
         "x contig"],
        [[d["workload"], _label(d), d["byte_check"], _fmt(d["store_alone_gbps"]), _fmt(d["load_alone_gbps"]),
          _fmt(d["duplex_gbps"]), _fmt(d["ratio"]), _fmt(d.get("contiguous_gbps")), _fmt(d.get("ratio_vs_contiguous"))]
         for d in duplex_rows],
    )  # fmt: skip


def print_targets(targets: list[dict]) -> None:
    rows = [[t["name"], t["verdict"], t["detail"]] for t in targets]
    print_table("Targets (reported, not asserted)", ["target", "result", "detail"], rows, left=3)


def plot_serving(samples: dict[str, dict[str, dict]], contiguous: dict[str, dict], path: str, title: str) -> str | None:
    """Per group (workload/shape/load mode): the step-time distribution of each method (box: quartiles, whiskers:
    p1-p99; a diamond: the mean) and its load latency (bar: median, tick: p99; dashed: the contiguous copy). Returns
    None, or why nothing was written."""
    if not samples:
        return "nothing was timed: no plot written"
    try:
        import matplotlib
    except ImportError:  # the measurements are in the JSON already; the PNG is a view of them
        return "matplotlib is not installed: no plot written"

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(samples), 2, figsize=(14, 4.2 * len(samples)), squeeze=False)
    for (group, by_method), (ax_step, ax_load) in zip(samples.items(), axes):
        labels = list(by_method)
        steps = [by_method[m]["step_ms"] for m in labels]
        ax_step.boxplot(steps, whis=(1, 99), showfliers=False)
        ax_step.scatter(range(1, len(labels) + 1), [np.mean(s) for s in steps], marker="D", color="tab:red",
                        label="mean", zorder=3)  # fmt: skip
        ax_step.set_xticks(range(1, len(labels) + 1), labels, rotation=20)
        ax_step.set_ylabel("step time, ms")
        ax_step.set_title(f"{group}: step time per method")
        ax_step.legend(fontsize=8)
        loaded = [m for m in labels if by_method[m]["load_latency_ms"]]
        med = [float(np.median(by_method[m]["load_latency_ms"])) for m in loaded]
        p99 = [float(np.quantile(by_method[m]["load_latency_ms"], 0.99)) for m in loaded]
        ax_load.bar(range(len(loaded)), med, color="tab:blue", label="median")
        ax_load.scatter(range(len(loaded)), p99, marker="_", s=400, color="black", label="p99")
        case = group.rsplit("/", 1)[0]  # workload/shape
        if case in contiguous and group.endswith(SYNC):
            ax_load.axhline(contiguous[case]["latency_ms"], linestyle="--", color="gray",
                            label="contiguous pinned copy")  # fmt: skip
        ax_load.set_xticks(range(len(loaded)), loaded, rotation=20)
        ax_load.set_ylabel("prefix load latency, ms")
        ax_load.set_title(f"{group}: load latency per method")
        ax_load.legend(fontsize=8)
        for ax in (ax_step, ax_load):
            ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
