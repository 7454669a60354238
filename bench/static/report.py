"""The static report of one Triton: every variant (bench/static/variants.py) compiled for each architecture and
measured from its code (bench/static/sass.py), as rows of JSON; :func:`merge` puts several Tritons' reports side by
side and :func:`table` prints them."""

from __future__ import annotations

import datetime
import platform
import subprocess
from collections.abc import Callable, Iterable

import triton

from bench.static import sass
from bench.static.compile import ARCHES, compile_variant  # noqa: F401 (ARCHES: the CLI's default)
from bench.static.variants import Variant, variants

__all__ = ["measure", "report", "merge", "table"]


def measure(v: Variant, arch: int, kernel=None) -> dict:
    """One variant's numbers on one architecture (``kernel``: another version of the kernel function, a test's
    mutation)."""
    kernel = compile_variant(v.config, v.store, v.grouped, v.integrity, v.copy, arch=arch, kernel=kernel)
    usage, text = sass.cubin_facts(kernel.asm["cubin"])
    code = sass.analyse(text, v.width, v.config.n_chunks, v.copy)
    shared = max(usage["shared_bytes"], int(getattr(kernel.metadata, "shared", 0) or 0))
    return {
        "variant": v.id,
        **v.to_dict(),
        "arch": f"sm_{arch}",
        **usage,
        "ctas_per_sm": sass.ctas_per_sm(usage["registers"], v.config.num_warps, shared),
        **code,
        "ptx": sass.ptx_sync(kernel.asm["ptx"]),
    }


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def report(arches: Iterable[int] = ARCHES, only: Callable[[Variant], bool] | None = None, progress=None) -> dict:
    """This interpreter's Triton: every variant (``only`` those it accepts) on every architecture."""
    rows = []
    chosen = [v for v in variants() if only is None or only(v)]
    for arch in arches:
        for v in chosen:
            rows.append(measure(v, arch))
            if progress:
                progress(rows[-1])
    return {
        "benchmark": "static",
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": _commit(),
        "date": datetime.date.today().isoformat(),
        "arches": [f"sm_{a}" for a in arches],
        "variants": len(chosen),
        "rows": rows,
    }


def merge(reports: list[dict]) -> dict:
    """Several Tritons' reports as one: their rows, each tagged with its Triton."""
    rows = [{"triton": r["triton"], **row} for r in reports for row in r["rows"]]
    return {
        "benchmark": "static",
        "tritons": [r["triton"] for r in reports],
        "commit": next((r["commit"] for r in reports if r.get("commit")), None),
        "date": max(r["date"] for r in reports),
        "arches": sorted({a for r in reports for a in r["arches"]}),
        "variants": max(r["variants"] for r in reports),
        "rows": rows,
    }


def _loop(row: dict, key: str):
    loop = row.get("loop") or {}
    return loop.get(key)


def table(doc: dict, print_fn=print) -> None:
    """One line per (Triton, arch, variant): the numbers a kernel change is judged by."""
    head = (f"{'triton':<7} {'arch':<6} {'variant':<42} {'regs':>4} {'stack':>5} {'spills':>6} {'ctas':>4} "
            f"{'loop/16B':>8} {'tile/16B':>8} {'inflight/warp':>13} {'loop bar/fence/atom':>19}")  # fmt: skip
    print_fn(head)
    for r in doc["rows"]:
        loop = r.get("loop") or {}
        sync = "/".join(str(sum((loop.get(k) or {}).values())) for k in ("barriers", "fences", "atomics"))
        tile = (r.get("tile_loop") or {}).get("instructions_per_16B")
        print_fn(f"{r.get('triton', doc.get('triton', '?')):<7} {r['arch']:<6} {r['variant']:<42} {r['registers']:>4} "
                 f"{r['stack_bytes']:>5} {r['spill_stores'] + r['spill_loads']:>6} {r['ctas_per_sm']:>4} "
                 f"{_loop(r, 'instructions_per_16B') or '-':>8} {tile or '-':>8} "
                 f"{_loop(r, 'inflight_bytes_per_warp') or '-':>13} {sync if loop else '-':>19}")  # fmt: skip
