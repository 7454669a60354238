"""The model (bench/static/model.py) against measurements: for each case of a transfer benchmark's JSON that ran the
kernel (``triton`` rows: one KV-cache group), its variant's static numbers from a bench.static report (the same
architecture, the Triton the run used where the report has it), the predicted fraction of the run's contiguous peak
beside the measured one. :func:`describe` says where the model is right and where it is wrong."""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from bench.static.model import H100, Link, predict

__all__ = ["static_rows", "predictions", "describe", "at_defaults"]

_WORKLOAD_LAYERS = {"llama3-8b": 32, "llama3-70b-tp8": 80, "deepseek-v3-mla": 61, "small-page": 32}


def static_rows(doc: dict, arch: str = "sm_90", triton: str | None = None) -> dict[str, dict]:
    """A report's rows by variant id, for one architecture (and one Triton of a merged report: the oldest where
    ``triton`` is not in it)."""
    rows = [r for r in doc["rows"] if r["arch"] == arch]
    tritons = sorted({r.get("triton", doc.get("triton")) for r in rows})
    pick = triton if triton in tritons else tritons[0]
    return {r["variant"]: r for r in rows if r.get("triton", doc.get("triton")) == pick}


def predictions(result_rows: Iterable[dict], static: dict[str, dict], link: Link = H100) -> list[dict]:
    """Per measured kernel case (``triton``, ``triton_integrity``): predicted and measured fractions of the peak."""
    rows = list(result_rows)
    peaks = {_case(r): r["gbps"] for r in rows if r["method"] == "peak" and r.get("gbps")}
    out = []
    for r in rows:
        if (
            r["method"] not in ("triton", "triton_integrity")
            or not r.get("gbps")
            or r["workload"] not in _WORKLOAD_LAYERS
        ):
            continue
        mode = "checked" if r["method"] == "triton_integrity" else "plain"
        variant = static.get(f"{r['workload']}.{r['layout']}/{r['direction']}/1group/{mode}")
        peak = peaks.get(_case(r))
        if variant is None or not peak:
            continue
        p = predict(variant, direction=r["direction"], layout=r["layout"], num_layers=r.get("num_layers")
                    or _WORKLOAD_LAYERS[r["workload"]], blocks=r["blocks"], segment_bytes=variant["segment_bytes"],
                    num_ctas=r.get("num_ctas"), peak_gbps=peak, link=link)  # fmt: skip
        measured = r["gbps"] / peak
        out.append({"workload": r["workload"], "layout": r["layout"], "direction": r["direction"],
                    "blocks": r["blocks"], "f": r["blocks_per_host_block"], "skip": r["skip"], "method": r["method"],
                    "num_ctas": r.get("num_ctas"), "measured": round(measured, 3),
                    "predicted": p["fraction_of_peak"], "error": round(p["fraction_of_peak"] - measured, 3),
                    "bound": p["bound"], "programs": p["programs"]})  # fmt: skip
    return out


def _case(r: dict) -> tuple:
    return (r["workload"], r["layout"], r["page_bytes"], r["blocks"], r["blocks_per_host_block"], r["skip"],
            r["direction"])  # fmt: skip


def describe(preds: list[dict]) -> dict:
    """Median and worst absolute error, per workload and direction, and the cases off by more than 0.15."""

    def stats(ps):
        errs = [abs(p["error"]) for p in ps]
        return {"cases": len(ps), "median_abs_error": round(statistics.median(errs), 3), "worst": round(max(errs), 3)}

    groups: dict[tuple, list] = {}
    for p in preds:
        groups.setdefault((p["workload"], p["direction"]), []).append(p)
    return {"all": stats(preds) if preds else None,
            "by_workload": {f"{w}/{d}": stats(ps) for (w, d), ps in sorted(groups.items())},
            "off_by_more_than_0.15": [p for p in preds if abs(p["error"]) > 0.15]}  # fmt: skip


def at_defaults(static: dict[str, dict], peak_gbps: float = 52.0, link: Link = H100) -> list[dict]:
    """Per workload, layout and direction, at 128 and 1024 blocks: the predicted fraction of a ``peak_gbps``
    contiguous peak at the default programs (4), and the fewest programs (of 1 to 32) predicted to reach 0.95."""
    out = []
    for workload, layers in _WORKLOAD_LAYERS.items():
        for vid, row in sorted(static.items()):
            page, direction, groups, mode = vid.split("/")
            if not page.startswith(workload + ".") or groups != "1group" or mode != "plain":
                continue
            layout = page.split(".", 1)[1]
            for blocks in (128, 1024):
                kw = dict(direction=direction, layout=layout, num_layers=layers, blocks=blocks,
                          segment_bytes=row["segment_bytes"], peak_gbps=peak_gbps, link=link)  # fmt: skip
                at4 = predict(row, num_ctas=4, **kw)
                enough = next((n for n in range(1, 33) if predict(row, num_ctas=n, **kw)["fraction_of_peak"] >= 0.95),
                              None)  # fmt: skip
                out.append({"workload": workload, "layout": layout, "direction": direction, "blocks": blocks,
                            "at_4": at4["fraction_of_peak"], "bound_at_4": at4["bound"],
                            "programs_for_0.95": enough})  # fmt: skip
    return out
