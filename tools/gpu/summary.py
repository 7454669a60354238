"""The GPU run's summary: per stage its key figures, and the project's targets (issue 38, "Targets"), each with its
worst case, where, and a verdict (pass / miss / not measured), all computed from the files the stages wrote (their
JSON and JUnit XML), never written by hand.

Stdlib only. The transfer targets use bench/common/results.py's ``by_case`` and ``target_result`` (as
bench/transfer/summary.py's do); the serving targets are the serving benchmark's own ``targets`` list, as its JSON
carries them (bench/serving/report.py's ``target``: ``name`` and ``verdict``), over every row it finished: a serving
run cut short (``complete`` false) says how many of its cases ended.
"""

from __future__ import annotations

import json
import pathlib
import xml.etree.ElementTree as ET
from collections.abc import Callable

from bench.common.results import (
    INTEGRITY_MAX_COST_PCT,
    INTEGRITY_MAX_HOST_US,
    INTEGRITY_MIN_PAGE_BYTES,
    SHAPE_GAIN_POINTS,
    SHAPE_LOSS_POINTS,
    SHAPE_PAGE_BYTES,
    SHAPE_SHORT_OF,
    by_case,
    compare_shapes,
    integrity_pairs,
    target_result,
)

__all__ = ["VERDICTS", "stage_figures", "evaluate", "junit_results", "launch_shape"]

VERDICTS = {"PASS": "pass", "FAIL": "miss", "n/a": "not measured"}
CALL_COST_US = 30.0  # median host time per call at 1024 blocks x 80 layers
CALL_COST_SHAPE = "1024 blocks x 80 layers"
PEAK_FRACTION = 0.90  # of the same run's contiguous copy, pages >= 2 KiB, 128 and 1024 blocks
AUTO_SLACK = 1.05  # auto's time over the faster of the kernel and the copy engines
VLLM_BASELINES = ("vllm033", "vllm_native")
# A GPU test skipped for one of these did not run where it should have: vLLM's code missing (the bundle), or no
# CUDA device (tests/conftest.py's skip). Other skips (say, a test that needs two GPUs) are listed, not counted.
SKIPS_THAT_MISS = ("vllm", "cuda device")
# Together the whole `pytest -m gpu` (tools/gpu/stages.py): the target passes only when both ran to the end.
TEST_STAGES = ("gpu-tests", "gpu-tests-slow")


def _load_json(path: pathlib.Path | None) -> dict | None:
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def junit_results(path: pathlib.Path | None) -> dict | None:
    """A JUnit XML file: ``complete`` (the session ended), and per outcome the test ids with their messages."""
    if path is None or not path.is_file():
        return None
    try:
        suite = ET.parse(path).getroot()
    except ET.ParseError:
        return None  # the plugin replaces the file atomically: only a foreign file can be half-written
    if suite.tag == "testsuites":
        suite = suite.find("testsuite")
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    out: dict = {"complete": props.get("complete", "true") == "true", "passed": [], "failure": [], "error": [],
                 "skipped": [], "modules_skipped": []}  # fmt: skip
    for case in suite.iter("testcase"):
        path, name = case.get("file") or case.get("classname"), case.get("name")
        tid = path if name == path else f"{path}::{name}"  # a module's own case (skipped or broken at collection)
        child = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if child is None:
            out["passed"].append(tid)
        elif child.tag == "skipped" and case.get("gpu") == "no":  # a whole module skipped, with no GPU test in it
            out["modules_skipped"].append((tid, child.get("message") or ""))
        else:
            out[child.tag].append((tid, child.get("message") or ""))
    return out


def launch_shape(rows: list[dict], default_ctas: int) -> list[dict]:
    """Per (page, blocks, direction): the kernel's fraction of the contiguous peak at the default CTAs (the worst
    over layouts and host formats), the CTA count whose worst fraction is the highest, and the size-aware launch
    shape's worst fraction (None where the run has no such rows)."""
    by: dict[tuple, dict[int, list[float]]] = {}
    sized: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get("fraction_of_peak") is None:
            continue
        key = (r["page_bytes"], r["blocks"], r["direction"])
        if r["method"] == "triton":
            by.setdefault(key, {}).setdefault(r["num_ctas"], []).append(r["fraction_of_peak"])
        elif r["method"] == "triton_size_aware":
            sized.setdefault(key, []).append(r["fraction_of_peak"])
    out = []
    for (page, blocks, direction), per in sorted(by.items()):
        worst = {c: min(v) for c, v in per.items()}
        best = max(worst, key=lambda c: (worst[c], -c))
        shape = sized.get((page, blocks, direction))
        out.append({"page_bytes": page, "blocks": blocks, "direction": direction,
                    f"fraction_at_{default_ctas}": worst.get(default_ctas), "best_ctas": best,
                    "fraction_at_best": worst[best], "fraction_size_aware": shape and min(shape),
                    "fraction_by_ctas": dict(sorted(worst.items()))})  # fmt: skip
    return out


def stage_figures(kind: str, files: dict[str, pathlib.Path]) -> dict:
    """The few numbers a reader wants from one stage's files."""
    if kind == "pytest":
        t = junit_results(files.get("xml"))
        if t is None:
            return {"error": "no JUnit XML written"}
        counts = ("passed", "failure", "error", "skipped", "modules_skipped")
        return {"complete": t["complete"], **{k: len(t[k]) for k in counts}}
    doc = _load_json(files.get("json"))
    if doc is None:
        return {"error": "no JSON written (or unreadable)"}
    if kind == "machine":
        pci = (doc.get("pci") or [None])[0]
        link = pci and (f"{pci['current_link_speed']} x{pci['current_link_width']} (max {pci['max_link_speed']} "
                        f"x{pci['max_link_width']})")  # fmt: skip
        return {"device": doc.get("device"), "cuda": doc.get("cuda"), "driver": doc.get("driver"),
                "driver_cuda": doc.get("driver_cuda"), "torch": (doc.get("torch") or {}).get("version"),
                "pcie": link,
                "gpu_numa_node": doc.get("gpu_numa_node"), "numa_nodes": len(doc.get("numa_nodes") or {}),
                "cpus": doc.get("cpus"), "mem_available_gib": (doc.get("memory") or {}).get("mem_available_gib"),
                "notes": doc.get("notes")}  # fmt: skip
    if kind == "host-memory":
        rows = [{k: r.get(k) for k in ("gib", "placement", "node", "pages_used", "touch_gibps", "error")}
                | {"register_gibps": {g["threads"]: g["register_gibps"] for g in r.get("registration") or []}}
                for r in doc.get("results") or []]  # fmt: skip
        near_far = doc.get("near_far") or {}
        return {"complete": doc.get("complete"), "device": doc.get("device"), "setups": rows,
                "near_far": near_far.get("runs") or near_far.get("status")}  # fmt: skip
    if kind == "call-cost":
        rows = {name: st for sec in ("public calls", "engine submits")
                for name, st in (doc.get("sections") or {}).get(sec, {}).items()}  # fmt: skip
        # complete, left and error: what a run cut short measured (files from before issue 56 lack them); launch: what
        # each row's launches went through (direct, triton dispatch, or direct refused: why).
        return {"shape": doc.get("shape"), "device": doc.get("device"), "complete": doc.get("complete"),
                "left": doc.get("left"), "error": doc.get("error"),
                "median_us": {name: st["median_us"] for name, st in rows.items()},
                "launch": {name: st.get("launch") for name, st in rows.items()}}  # fmt: skip
    out = {"complete": doc.get("complete"), "mode": doc.get("mode"), "device": doc.get("device"),
           "rows": len(doc.get("rows") or []), "not_pass": _not_pass(doc), "fatal": doc.get("fatal"),
           "own_targets": _counts(doc.get("targets") or [])}  # fmt: skip
    if kind == "serving":  # per case (workload/shape) how it ended, and where the CUDA context died, if it did
        out["cases"] = {f"{c.get('workload')}/{c.get('shape')}": c.get("status") for c in doc.get("cases") or []}
        out["fatal_at"] = doc.get("fatal_at")
        out["failures"] = len(doc.get("failures") or [])
    if kind == "launch-shape":
        out["launch_shape"] = launch_shape(doc.get("rows") or [], doc.get("default_num_ctas"))
    return out


def _not_pass(doc: dict) -> int:
    rows = doc.get("rows") or []
    status = [r.get("status") or r.get("byte_check") for r in rows]
    return sum(s not in ("pass", "n/a") for s in status)


def _counts(targets: list[dict]) -> dict:
    out: dict[str, int] = {}
    for t in targets:
        result = t.get("result", t.get("verdict"))  # target_result's key, or the serving benchmark's
        verdict = VERDICTS.get(result, str(result))
        out[verdict] = out.get(verdict, 0) + 1
    return out


def _entry(t: dict, stages: list[str]) -> dict:
    return {"target": t["target"], "verdict": VERDICTS[t["result"]], "worst": t.get("worst"), "where": t.get("where"),
            "detail": t["detail"], "from": stages}  # fmt: skip


def _not_measured(name: str, why: str, stages: list[str]) -> dict:
    return {"target": name, "verdict": "not measured", "worst": None, "where": None, "detail": why, "from": stages}


def _tests_target(stages: list[dict]) -> dict:
    name = "every GPU test passes, none skipped for lack of vLLM"
    names = [s["stage"] for s in stages]
    if not stages:
        return _not_measured(name, "no test stage in this run", names)
    bad, other_skips, modules, passed = [], [], [], 0
    missing = [f"{n}: not in this run" for n in TEST_STAGES if n not in names]
    for s in stages:
        t = junit_results(s["files"].get("xml"))
        if t is None or s["outcome"] == "skipped":
            missing.append(f"{s['stage']}: {s['outcome']}")
            continue
        ended = sum(len(t[k]) for k in ("passed", "failure", "error", "skipped"))
        if not t["complete"] or s["outcome"] in ("timed out", "killed"):  # a step may have ended, the next not
            missing.append(f"{s['stage']}: cut short ({s['outcome']}) after {ended} tests")
        elif not ended:
            missing.append(f"{s['stage']}: no test ran")
        passed += len(t["passed"])
        modules += [f"{tid} ({msg[:100]})" for tid, msg in t["modules_skipped"]]
        bad += [f"{tid} ({kind}: {msg[:160]})" for kind in ("failure", "error") for tid, msg in t[kind]]
        for tid, msg in t["skipped"]:
            missed = any(k in msg.lower() for k in SKIPS_THAT_MISS)
            (bad if missed else other_skips).append(f"{tid} (skipped: {msg[:160]})")
    detail = f"{passed} passed; {len(bad)} failed, errored or skipped for lack of vLLM or CUDA"
    detail += "".join(f"; {m}" for m in missing) + (f"; other skips: {len(other_skips)}" if other_skips else "")
    if modules:
        detail += f"; modules without GPU tests skipped at collection: {', '.join(modules)}"
    verdict = "miss" if bad else "not measured" if missing else "pass"
    where = "; ".join(bad[:5]) or "; ".join(other_skips[:5]) or None
    return {"target": name, "verdict": verdict, "worst": len(bad), "where": where, "detail": detail, "from": names}


def _call_cost_target(stages: list[dict]) -> dict:
    name = f"call cost <= {CALL_COST_US:g} us median at {CALL_COST_SHAPE}, both public calls and both engine submits"
    wanted = ("gather_blocks", "scatter_blocks", "engine.submit_store", "engine.submit_load")
    names = [s["stage"] for s in stages]
    for s in stages:
        doc = _load_json(s["files"].get("json"))
        if doc is None or doc.get("shape") != CALL_COST_SHAPE:
            continue
        sections = doc.get("sections") or {}
        rows = {**sections.get("public calls", {}), **sections.get("engine submits", {})}
        # The default launch: the direct one (TRITON_OFFLOAD_FAST_LAUNCH unset). Where its canary refused it, the
        # default is Triton's dispatch, and the row measured that: counted as it is, and the place says so.
        values = [(rows[f"{c}, direct launch"]["median_us"], _asked_direct(f"{c}, direct launch", rows))
                  for c in wanted if f"{c}, direct launch" in rows]  # fmt: skip
        t = target_result(name, values, lambda v: v <= CALL_COST_US, worst_is_min=False)
        if len(values) < len(wanted) and t["result"] != "FAIL":
            why = f"only {len(values)} of the {len(wanted)} calls measured"
            if doc.get("complete") is False:
                why += f" (the run stopped before: {', '.join(doc.get('left') or [])}; {doc.get('error') or 'killed'})"
            return _not_measured(name, why, names)
        refused = [where for _, where in values if "(launch: " in where]
        if refused:
            t["detail"] += f"; the direct launch was not used in {len(refused)}: {'; '.join(refused)}"
        return _entry(t, names)
    return _not_measured(name, f"no call-cost JSON at {CALL_COST_SHAPE} in this run", names)


def _asked_direct(name: str, rows: dict) -> str:
    """A row that asked for the direct launch, by name; followed by what its launches went through where that was not
    the direct launch (a refusal, and why)."""
    used = rows[name].get("launch", "direct")  # files from before issue 56 do not say
    return name if used == "direct" else f"{name} (launch: {used})"


def _transfer_targets(stages: list[dict]) -> list[dict]:
    frac, auto, vs_vllm, shape_gain, shape_any = [], [], [], [], []
    names = []
    for s in stages:
        doc = _load_json(s["files"].get("json"))
        if doc is None or doc.get("mode") != "gpu":
            continue
        names.append(s["stage"])
        d = doc.get("default_num_ctas")
        for (w, layout, page, n, f, skip, direction), by in by_case(doc.get("rows") or []).items():
            where = f"{s['stage']}: {w}/{layout} {page}B n={n} f/skip={f}/{skip} {direction}"
            timed = {k: r for k, r in by.items() if r.get("median_ms")}
            kernel, mine = timed.get(("triton", d)), timed.get(("auto", None))
            if kernel and kernel.get("fraction_of_peak") is not None and page >= 2048 and n in (128, 1024):
                frac.append((kernel["fraction_of_peak"], where))
            sized = timed.get(("triton_size_aware", None))
            if shape := compare_shapes(kernel, sized, page):
                shape_any.append((shape[0], where))
                if shape[1]:
                    shape_gain.append((shape[0], where))
            dma_name = "dma" if ("dma", None) in by else "memcpy_batch"
            paths = [r["median_ms"] for r in (kernel, timed.get((dma_name, None))) if r]
            if mine and len(paths) == 2:
                auto.append((mine["median_ms"] / min(paths), f"{where} (dma: {dma_name})"))
            for label, ours in ((f"triton@{d}", kernel), ("auto", mine)):
                for base in VLLM_BASELINES:
                    b = timed.get((base, None))
                    if ours and b:
                        vs_vllm.append((b["median_ms"] / ours["median_ms"], f"{where}: {label} vs {base}"))
    d_label = "the default num_ctas"
    return [
        _entry(target_result(f"transfers at {d_label} >= {PEAK_FRACTION:.2f} of the run's contiguous peak, pages "
                             ">= 2 KiB, 128 and 1024 blocks", frac, lambda v: v >= PEAK_FRACTION), names),
        _entry(target_result(f"auto never slower than the faster of kernel and dma by more than "
                             f"{100 * (AUTO_SLACK - 1):.0f} % (time ratio)", auto, lambda v: v <= AUTO_SLACK,
                             worst_is_min=False), names),
        _entry(target_result("ours (kernel at the default num_ctas, and auto) never slower than vllm033 or vllm_native "
                             "(speedup)", vs_vllm, lambda v: v >= 1.0), names),
        # Issue 38, section 3: the size-aware launch shape becomes the default only if both hold (and the serving
        # stages show no higher step slowdown).
        _entry(target_result(f"size-aware launch shape gains >= {SHAPE_GAIN_POINTS:g} points of peak where the default "
                             f"is below {SHAPE_SHORT_OF:.2f}, pages <= {SHAPE_PAGE_BYTES // 1024} KiB", shape_gain,
                             lambda v: v >= SHAPE_GAIN_POINTS), names),
        _entry(target_result(f"launch shape: size-aware loses <= {SHAPE_LOSS_POINTS:g} points of peak in any case",
                             shape_any, lambda v: v >= -SHAPE_LOSS_POINTS), names),
    ]  # fmt: skip


def _integrity_targets(transfers: list[dict], call_costs: list[dict]) -> list[dict]:
    """The integrity checks' goal (issue 41, docs/integrity.md): their bandwidth cost at pages >= 8 KiB, from the
    transfer stages run with ``--integrity`` (triton_integrity beside triton at the default num_ctas), and the host
    time they add to an engine submit, from the call-cost stage run with ``--integrity``."""
    cost, names = [], []
    for s in transfers:
        doc = _load_json(s["files"].get("json"))
        if doc is None or doc.get("mode") != "gpu":
            continue
        pairs = integrity_pairs(doc.get("rows") or [], doc.get("default_num_ctas"))
        if pairs:
            names.append(s["stage"])
        for p in pairs:
            if p["page_bytes"] >= INTEGRITY_MIN_PAGE_BYTES:
                where = (f"{s['stage']}: {p['workload']}/{p['layout']} {p['page_bytes']}B n={p['blocks']} "
                         f"f/skip={p['blocks_per_host_block']}/{p['skip']} {p['direction']}")  # fmt: skip
                cost.append((p["cost_pct"], where))
    extra, cc_names, unlike = [], [], []
    for s in call_costs:
        doc = _load_json(s["files"].get("json"))
        if doc is None or doc.get("shape") != CALL_COST_SHAPE:
            continue
        rows = (doc.get("sections") or {}).get("engine submits", {})
        for call in ("engine.submit_store", "engine.submit_load"):
            off, on = rows.get(f"{call}, direct launch"), rows.get(f"{call}, direct launch, integrity verify")
            if off and on and off.get("launch") != on.get("launch"):
                # One went direct and the other through Triton's dispatch: their difference is not the checks'.
                unlike.append(f"{s['stage']}: {call} ({off.get('launch')} vs {on.get('launch')})")
            elif off and on:
                extra.append((on["median_us"] - off["median_us"], f"{s['stage']}: {call}"))
                cc_names.append(s["stage"])
    name_cost = (
        f"bandwidth cost of the integrity checks <= {INTEGRITY_MAX_COST_PCT:g} % at pages >= "
        f"{INTEGRITY_MIN_PAGE_BYTES // 1024} KiB (triton_integrity vs triton at the default num_ctas)"
    )
    name_host = (f"host time the integrity checks add <= {INTEGRITY_MAX_HOST_US:g} us per engine submit at "
                 f"{CALL_COST_SHAPE} (median, direct launch)")  # fmt: skip
    host = target_result(name_host, extra, lambda v: v <= INTEGRITY_MAX_HOST_US, worst_is_min=False)
    no_host = "no call-cost JSON with --integrity in this run"
    if unlike:
        no_host = f"not compared where the two launched differently: {'; '.join(unlike)}"
        host["detail"] += f"; {no_host}"
    return [
        _entry(target_result(name_cost, cost, lambda v: v <= INTEGRITY_MAX_COST_PCT, worst_is_min=False), names)
        if cost else _not_measured(name_cost, "no transfer stage ran with --integrity at pages >= 8 KiB", names),
        _entry(host, sorted(set(cc_names))) if extra else _not_measured(name_host, no_host, []),
    ]  # fmt: skip


def _serving_targets(stages: list[dict]) -> list[dict]:
    """The serving JSONs' own targets (bench/serving/report.py's: ``name``, ``verdict`` PASS / FAIL / n/a, ``worst``,
    ``where``, ``detail``), over every row each run finished; a run cut short says so in each detail."""
    out = []
    for s in stages:
        doc = _load_json(s["files"].get("json"))
        if doc is None or doc.get("mode") != "gpu" or not doc.get("targets"):
            continue
        cut = ""
        if not doc.get("complete"):
            cases = doc.get("cases") or []
            ended = sum(c.get("status") == "done" for c in cases)
            planned = len((doc.get("plan") or {}).get("cases") or cases)
            cut = f" [run cut short: {ended} of {planned} cases ended" + (
                f"; the CUDA context died at {doc['fatal_at']}]" if doc.get("fatal_at") else "]"
            )
        for t in doc["targets"]:
            name = t.get("name", t.get("target"))
            entry = _entry({**t, "target": name, "result": t.get("verdict", t.get("result"))}, [s["stage"]])
            entry["target"] = f"serving ({s['stage']}): {name}"
            entry["detail"] += cut
            out.append(entry)
    if not out:
        why = "no GPU serving JSON with targets in this run"
        return [_not_measured("serving: the serving benchmark's targets", why, [s["stage"] for s in stages])]
    return out


def evaluate(stages: list[dict]) -> list[dict]:
    """Every target from the stages' files. ``stages``: per stage ``stage``, ``kind``, ``outcome`` and ``files``
    (``{"json"|"xml"|...: path}``)."""
    of = lambda *kinds: [s for s in stages if s["kind"] in kinds]  # noqa: E731
    guarded: list[tuple[str, Callable[[], list[dict]]]] = [
        ("GPU tests", lambda: [_tests_target(of("pytest"))]),
        ("call cost", lambda: [_call_cost_target(of("call-cost"))]),
        ("transfers", lambda: _transfer_targets(of("transfer", "launch-shape"))),
        ("serving", lambda: _serving_targets(of("serving"))),
        ("integrity", lambda: _integrity_targets(of("transfer", "launch-shape"), of("call-cost"))),
    ]
    out = []
    for label, compute in guarded:
        try:
            out += compute()
        except Exception as exc:  # a malformed file must not cost the rest of the summary
            out.append(_not_measured(label, f"could not be computed: {exc!r}"[:300], []))
    return out
