"""The GPU run's summary: per stage its key figures, and the project's targets (issue 38, "Targets"), each with its
worst case, where, and a verdict (pass / miss / not measured), all computed from the files the stages wrote (their
JSON and JUnit XML), never written by hand. The transfer targets are bench/common/targets.py's, the ones the transfer
benchmark prints, over every transfer stage's rows; the serving targets the serving JSON's own (``name``,
``verdict``), over every row it finished, saying where a run cut short stopped. Stdlib only."""

from __future__ import annotations

import json
import pathlib
import re
import xml.etree.ElementTree as ET

from bench.common import targets
from bench.common.targets import INTEGRITY_MAX_HOST_US, target_result

__all__ = ["VERDICTS", "stage_figures", "evaluate", "junit_results", "launch_shape", "model_figures"]

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "bench" / "results"

VERDICTS = {"PASS": "pass", "FAIL": "miss", "n/a": "not measured"}
CALL_COST_US = 30.0  # median host time per call at 1024 blocks x 80 layers
CALL_COST_SHAPE = "1024 blocks x 80 layers"
# A GPU test skipped for one of these did not run where it should have: vLLM's code missing (the bundle), or no
# CUDA device (tests/conftest.py's skip). Other skips (say, a test that needs two GPUs) are listed, not counted.
SKIPS_THAT_MISS = ("vllm", "cuda device")
# ... except a test that needs more GPUs than a lease has (one): "needs two CUDA devices" is another skip.
_NEEDS_MORE_GPUS = re.compile(r"needs (two|three|four|\d+) cuda devices")
# Together the whole `pytest -m gpu` (tools/gpu/stages.py): the target passes only when both ran to the end.
TEST_STAGES = ("gpu-tests", "gpu-tests-slow")


def _load_json(path: pathlib.Path | None) -> dict | None:
    try:
        return json.loads(path.read_text()) if path else None
    except (OSError, ValueError):
        return None


def junit_results(path: pathlib.Path | None) -> dict | None:
    """A JUnit XML file: ``complete`` (the session ended), and per outcome the test ids with their messages."""
    try:
        suite = ET.parse(path).getroot() if path else None
    except (OSError, ET.ParseError):  # the plugin replaces it atomically: only a foreign file can be half-written
        return None
    if suite is None:
        return None
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
        keys = ("device", "cuda", "driver", "driver_cuda", "gpu_numa_node", "cpus", "notes")
        return {**{k: doc.get(k) for k in keys}, "torch": (doc.get("torch") or {}).get("version"), "pcie": link,
                "numa_nodes": len(doc.get("numa_nodes") or {}),
                "mem_available_gib": (doc.get("memory") or {}).get("mem_available_gib")}  # fmt: skip
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
    rows, own = doc.get("rows") or [], {}
    for t in doc.get("targets") or []:  # target_result's "result", or the serving benchmark's "verdict"
        verdict = VERDICTS.get(t.get("result", t.get("verdict")), str(t.get("result", t.get("verdict"))))
        own[verdict] = own.get(verdict, 0) + 1
    out = {"complete": doc.get("complete"), "mode": doc.get("mode"), "device": doc.get("device"), "rows": len(rows),
           "not_pass": sum((r.get("status") or r.get("byte_check")) not in ("pass", "n/a") for r in rows),
           "fatal": doc.get("fatal"), "own_targets": own}  # fmt: skip
    if kind == "serving":  # per case (workload/shape) how it ended, and where the CUDA context died, if it did
        out["cases"] = {f"{c.get('workload')}/{c.get('shape')}": c.get("status") for c in doc.get("cases") or []}
        out["fatal_at"] = doc.get("fatal_at")
        out["failures"] = len(doc.get("failures") or [])
    if kind == "launch-shape":
        out["launch_shape"] = launch_shape(doc.get("rows") or [], doc.get("default_num_ctas"))
    if kind in ("transfer", "launch-shape") and doc.get("mode") == "gpu":
        out["model"] = model_figures(doc)
    return out


def _static_report(results: pathlib.Path) -> pathlib.Path | None:
    """The newest committed static report (bench/results/static-<commit>-<date>.json, ./dev static)."""
    reports = sorted(results.glob("static-*.json"), key=lambda p: (p.stem.rsplit("-", 3)[-3:], p.name))
    return reports[-1] if reports else None


def model_figures(doc: dict, results: pathlib.Path = RESULTS) -> dict:
    """The compiler's model (bench/static/model.py) beside the measurement: per kernel case the predicted and the
    measured fraction of the run's contiguous peak, from the newest committed static report (sm_100 on a B200, sm_90
    otherwise; the run's Triton where the report has it)."""
    from bench.static.compare import describe, predictions, static_rows

    path = _static_report(results)
    if path is None:
        return {"error": "no static report committed (./dev static)"}
    arch = "sm_100" if "b200" in str(doc.get("device", "")).lower() else "sm_90"
    static = static_rows(json.loads(path.read_text()), arch, doc.get("triton"))
    preds = predictions(doc.get("rows") or [], static)
    keys = ("workload", "layout", "blocks", "f", "skip", "direction", "method", "num_ctas", "measured", "predicted",
            "error", "bound")  # fmt: skip
    summary = describe(preds)["all"] if preds else None
    return {"static": path.name, "arch": arch, "summary": summary, "cases": [{k: p[k] for k in keys} for p in preds]}


def _entry(t: dict, stages: list[str]) -> dict:
    return {"key": t.get("key"), "target": t["target"], "verdict": VERDICTS[t["result"]], "worst": t.get("worst"),
            "where": t.get("where"), "detail": t["detail"], "from": stages}  # fmt: skip


def _not_measured(key: str, name: str, why: str, stages: list[str]) -> dict:
    return _entry({"key": key, "target": name, "result": "n/a", "detail": why}, stages)


def _tests_target(stages: list[dict]) -> dict:
    name = "every GPU test passes, none skipped for lack of vLLM"
    names = [s["stage"] for s in stages]
    if not stages:
        return _not_measured("gpu-tests", name, "no test stage in this run", names)
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
            missed = any(k in msg.lower() for k in SKIPS_THAT_MISS) and not _NEEDS_MORE_GPUS.search(msg.lower())
            (bad if missed else other_skips).append(f"{tid} (skipped: {msg[:160]})")
    detail = f"{passed} passed; {len(bad)} failed, errored or skipped for lack of vLLM or CUDA"
    detail += "".join(f"; {m}" for m in missing) + (f"; other skips: {len(other_skips)}" if other_skips else "")
    if modules:
        detail += f"; modules without GPU tests skipped at collection: {', '.join(modules)}"
    verdict = "miss" if bad else "not measured" if missing else "pass"
    where = "; ".join(bad[:5]) or "; ".join(other_skips[:5]) or None
    return {"key": "gpu-tests", "target": name, "verdict": verdict, "worst": len(bad), "where": where, "detail": detail,
            "from": names}  # fmt: skip


def _call_cost_targets(stages: list[dict]) -> list[dict]:
    """From the call-cost stage's JSON: the host time per call of both public calls and both engine submits, at the
    default launch (the direct one; where its canary refused it, Triton's dispatch, counted as it is and named), and
    the time the integrity checks add to an engine submit (issue 41), only where both submits launched alike."""
    name = f"call cost <= {CALL_COST_US:g} us median at {CALL_COST_SHAPE}, both public calls and both engine submits"
    name_host = (f"host time the integrity checks add <= {INTEGRITY_MAX_HOST_US:g} us per engine submit at "
                 f"{CALL_COST_SHAPE} (median, direct launch)")  # fmt: skip
    wanted = ("gather_blocks", "scatter_blocks", "engine.submit_store", "engine.submit_load")
    names = [s["stage"] for s in stages]
    docs = ((s["stage"], _load_json(s["files"].get("json")) or {}) for s in stages)
    stage, doc = next(((n, d) for n, d in docs if d.get("shape") == CALL_COST_SHAPE), (None, None))
    if doc is None:
        why = f"no call-cost JSON at {CALL_COST_SHAPE} in this run"
        return [_not_measured("call-cost", name, why, names), _not_measured("integrity-host", name_host, why, [])]
    sections = doc.get("sections") or {}
    rows = {**sections.get("public calls", {}), **sections.get("engine submits", {})}
    values = []
    for call in (f"{c}, direct launch" for c in wanted if f"{c}, direct launch" in rows):
        used = rows[call].get("launch", "direct")  # files from before issue 56 do not say
        values.append((rows[call]["median_us"], call if used == "direct" else f"{call} (launch: {used})"))
    t = target_result(name, values, lambda v: v <= CALL_COST_US, worst_is_min=False)
    if len(values) < len(wanted) and t["result"] != "FAIL":
        why = f"only {len(values)} of the {len(wanted)} calls measured"
        if doc.get("complete") is False:
            why += f" (the run stopped before: {', '.join(doc.get('left') or [])}; {doc.get('error') or 'killed'})"
        cost = _not_measured("call-cost", name, why, names)
    else:
        refused = [where for _, where in values if "(launch: " in where]
        t["detail"] += f"; the direct launch was not used in {len(refused)}: {'; '.join(refused)}" if refused else ""
        cost = _entry({**t, "key": "call-cost"}, names)
    extra, unlike = [], []
    for call in ("engine.submit_store", "engine.submit_load"):
        off, on = rows.get(f"{call}, direct launch"), rows.get(f"{call}, direct launch, integrity verify")
        if off and on and off.get("launch") != on.get("launch"):
            # One went direct and the other through Triton's dispatch: their difference is not the checks'.
            unlike.append(f"{stage}: {call} ({off.get('launch')} vs {on.get('launch')})")
        elif off and on:
            extra.append((on["median_us"] - off["median_us"], f"{stage}: {call}"))
    no_host = f"not compared where the two launched differently: {'; '.join(unlike)}" if unlike else (
        "no call-cost JSON with --integrity in this run")  # fmt: skip
    if not extra:
        return [cost, _not_measured("integrity-host", name_host, no_host, [])]
    host = target_result(name_host, extra, lambda v: v <= INTEGRITY_MAX_HOST_US, worst_is_min=False)
    host["detail"] += f"; {no_host}" if unlike else ""
    return [cost, _entry({**host, "key": "integrity-host"}, [stage])]


def _transfer_targets(stages: list[dict]) -> list[dict]:
    """bench/common/targets.py's targets over the rows and extras of every transfer stage that ran on a GPU."""
    values: dict[str, list] = {}
    names = []
    for s in stages:
        doc = _load_json(s["files"].get("json"))
        if doc is None or doc.get("mode") != "gpu":
            continue
        names.append(s["stage"])
        found = targets.case_values(doc.get("rows") or [], doc.get("default_num_ctas"), doc.get("cpu_overhead"),
                                    doc.get("interference"), where=f"{s['stage']}: ")  # fmt: skip
        for key, v in found.items():
            values.setdefault(key, []).extend(v)
    return [_entry(t, names) for t in targets.evaluate(values)]


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
            entry = _entry(
                {**t, "key": "serving", "target": name, "result": t.get("verdict", t.get("result"))}, [s["stage"]]
            )
            entry["target"] = f"serving ({s['stage']}): {name}"
            entry["detail"] += cut
            out.append(entry)
    if not out:
        why = "no GPU serving JSON with targets in this run"
        return [_not_measured("serving", "serving: the serving benchmark's targets", why, [s["stage"] for s in stages])]
    return out


def evaluate(stages: list[dict]) -> list[dict]:
    """Every target from the stages' files. ``stages``: per stage ``stage``, ``kind``, ``outcome`` and ``files``
    (``{"json"|"xml"|...: path}``)."""
    of = lambda *kinds: [s for s in stages if s["kind"] in kinds]  # noqa: E731
    guarded = [
        ("gpu-tests", lambda: [_tests_target(of("pytest"))]),
        ("call-cost", lambda: _call_cost_targets(of("call-cost"))),
        ("transfers", lambda: _transfer_targets(of("transfer", "launch-shape"))),
        ("serving", lambda: _serving_targets(of("serving"))),
    ]
    out = []
    for label, compute in guarded:
        try:
            out += compute()
        except Exception as exc:  # a malformed file must not cost the rest of the summary
            out.append(_not_measured(label, label, f"could not be computed: {exc!r}"[:300], []))
    return out
