"""What both benchmarks write: one JSON envelope, the transfer rows' schema, the relative columns, and file names.
Torch-free, so :mod:`bench.micro.manager` (a scheduler-side, CPU-only benchmark) and the GPU runner (tools/gpu/) share
it with :mod:`bench.transfer`. Every results file is one JSON object: ``benchmark`` (``transfer`` or ``manager``),
``mode``, ``complete`` (false while a run is still writing, or when it was killed), the machine and version fields, the
``commit`` it measured and whether the checkout was ``dirty`` (:func:`source_info`), ``args``, and ``rows``: a list of
flat dicts with the same keys in every row of a file (:data:`ROW_KEYS` for the transfer benchmark). The file is
rewritten whole (:func:`write_json`: write to a temporary name, then rename) after every group of rows, so a run killed
at any point leaves valid JSON holding everything measured up to its last completed group.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import re
from collections import defaultdict

__all__ = [
    "PYTHON_ISSUED",
    "ROW_KEYS",
    "BASELINE_NAMES",
    "BASELINE_ORDER",
    "INTEGRITY_METHOD",
    "integrity_pairs",
    "new_row",
    "keyed_row",
    "by_case",
    "fill_relative",
    "machine_info",
    "source_info",
    "slug",
    "result_stem",
    "write_json",
]

# How a row's impl starts when its baseline issued its copies from a Python loop (bench/baselines/copy_loop.py):
# handicapped by about a microsecond per copy; the tables and the plot mark such values.
PYTHON_ISSUED = "Python-issued (handicapped)"
# Baselines a speedup column is computed against, in table order.
BASELINE_NAMES = ("memcpy_batch", "memcpy_per_block", "torch_staged", "vllm033", "vllm_native")
# Every method but triton, in the order a run measures them (after the triton sweep): ours first (the kernel's
# size-aware launch shape, auto: the per-call choice of kernel or copy engines), then the baselines and the peak.
BASELINE_ORDER = ("triton_size_aware", "auto", *BASELINE_NAMES, "peak")

# The kernel with the integrity checks (docs/integrity.md), at the default num_ctas: with --integrity a run measures it
# beside triton at that num_ctas, case by case.
INTEGRITY_METHOD = "triton_integrity"

ROW_KEYS = (
    "device", "workload", "layout", "direction", "method", "num_ctas", "impl", "page_bytes", "num_layers", "blocks",
    "blocks_per_host_block", "skip", "total_bytes", "status", "note", "median_ms", "p20_ms", "p80_ms", "gbps",
    "call_cpu_us", "fraction_of_peak", *(f"speedup_vs_{name}" for name in BASELINE_NAMES),
)  # fmt: skip
"""The transfer benchmark's row. ``status``: pass / FAIL / ERROR / n/a of the byte check that preceded the timing (a
GPU row is timed only after ``pass``); ``note``: why, where it is not ``pass``; ``call_cpu_us``: median host
microseconds of one call (the CPU submission cost), beside the device time of the same calls."""

# The fields that identify one case: every method moves the same bytes within it.
CASE_KEYS = ("workload", "layout", "page_bytes", "blocks", "blocks_per_host_block", "skip", "direction")


def new_row(**fields) -> dict:
    """A row with every :data:`ROW_KEYS` key (None where not given); an unknown key is a bug, not a new column."""
    return keyed_row(ROW_KEYS, fields)


def keyed_row(keys: tuple[str, ...], fields: dict) -> dict:
    """A row with exactly ``keys``, in that order (None where ``fields`` has none); an unknown field is a KeyError."""
    unknown = set(fields) - set(keys)
    if unknown:
        raise KeyError(f"not row keys: {sorted(unknown)}")
    return dict(dict.fromkeys(keys), **fields)


def by_case(rows: list[dict]) -> dict[tuple, dict[tuple, dict]]:
    """``{case key (CASE_KEYS values): {(method, num_ctas): row}}``, in the order the cases were first seen."""
    out: dict = defaultdict(dict)
    for r in rows:
        out[tuple(r[k] for k in CASE_KEYS)][(r["method"], r["num_ctas"])] = r
    return out


def fill_relative(rows: list[dict]) -> None:
    """fraction_of_peak and the speedup columns, against the rows of the same case (same blocks, same bytes)."""
    for case_rows in by_case(rows).values():
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


def integrity_pairs(rows: list[dict], default_ctas: int) -> list[dict]:
    """The integrity checks on vs off, per case where both were timed: ``triton`` at ``default_ctas`` (off) and
    :data:`INTEGRITY_METHOD` (on), each case's :data:`CASE_KEYS`, then their GB/s, the checks' cost in percent of
    the bandwidth without them (``cost_pct``, negative where the run with them was faster), and host us per call."""
    out = []
    for key, by in by_case(rows).items():
        off, on = by.get(("triton", default_ctas)), by.get((INTEGRITY_METHOD, None))
        if not (off and on and off["gbps"] and on["gbps"]):
            continue
        out.append(
            {
                **dict(zip(CASE_KEYS, key)),
                "gbps_off": off["gbps"],
                "gbps_on": on["gbps"],
                "cost_pct": round(100 * (1 - on["gbps"] / off["gbps"]), 2),
                "call_cpu_us_off": off["call_cpu_us"],
                "call_cpu_us_on": on["call_cpu_us"],
            }
        )
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def source_info(repo: str | os.PathLike | None = None) -> dict:
    """The code a results file measured: ``commit`` (``git rev-parse HEAD`` of the checkout, ``"unknown"`` without git
    or outside a checkout) and ``dirty`` (whether tracked files differed from that commit when the run started, so
    the numbers may come from code no commit holds; None when unknown). ``git diff --stat <commit> -- <paths>`` later
    says whether the measured code changed since."""
    import subprocess

    cwd = pathlib.Path(repo) if repo is not None else pathlib.Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": "unknown", "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def machine_info() -> dict:
    """The fields every results file carries about where and when it was made, and from which code
    (:func:`source_info`)."""
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        **source_info(),
    }


def slug(text: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``: a device name as a file name."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def result_stem(device: str, part: str | None = None, date: datetime.date | None = None) -> str:
    """``<device-slug>-<date>[-<part>]``: the name results are committed under in ``bench/results/``."""
    stem = f"{slug(device)}-{(date or datetime.date.today()).isoformat()}"
    return f"{stem}-{part}" if part else stem


def write_json(path: str | os.PathLike, doc: dict) -> None:
    """Writes ``doc`` to ``path`` atomically: a reader (or a kill) never sees a half-written file."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)
