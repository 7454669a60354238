"""The budgets CI holds the copy kernel to (tests/unit/test_kernel_static.py), from a static report: per gated variant
(pages whose addresses allow 16-byte accesses, on sm_90) the most instructions per 16 bytes its loops may take, the
barriers its copy and tile loops may hold, its stack, and the exact atomics of its PTX with their semantics; no
variant may spill, a checked copy loop and tile may each take at most twice the plain one's instructions, and every
variant without the checks (the default path) must move its data in 16-byte accesses. :func:`make` writes them from
a report with slack for other Tritons; :func:`problems` says what a measured variant breaks."""

from __future__ import annotations

import math
import pathlib

from bench.static.variants import Variant

__all__ = ["BUDGET_PATH", "SLACK", "CHECKED_OVER_PLAIN", "CHECKED_LOOP_OVER_PLAIN", "gated", "make", "problems"]

BUDGET_PATH = pathlib.Path(__file__).with_name("budget.json")
# Instructions may grow by this much over the report the budget was made from (Tritons differ by a few percent) and
# by at least 2 per 16 bytes: a change that adds real work to a loop does not fit.
SLACK = 1.15
# The checks may at most double the instructions a tile of 16-byte pages takes per 16 bytes moved (issue 59).
CHECKED_OVER_PLAIN = 2.0
# ... and those of its steady copy loop (issue 59: the checked loop at most 2x the plain loop's, per 16 bytes; each
# loop in its own launch shape).
CHECKED_LOOP_OVER_PLAIN = 2.0


def gated(v: Variant) -> bool:
    """The variants CI compiles: 16-byte pages; every mode with one KV-cache group, the plain copy with several."""
    return v.width == 16 and (not v.grouped or v.mode == "plain")


def _ceil(value: float) -> float:
    return math.ceil(max(value * SLACK, value + 2) * 100) / 100


def _atomics(row: dict) -> dict[str, int]:
    """The PTX atomics of a row, a ``red`` (an atomic whose result is unused: Triton 3.9 emits it where 3.6 emits an
    ``atom``) counted as the ``atom`` it stands for: their semantics and counts are what the gate holds."""
    out: dict[str, int] = {}
    for k, n in row["ptx"]["atomics"].items():
        key = "atom." + k[4:] if k.startswith("red.") else k
        out[key] = out.get(key, 0) + n
    return out


def make(rows: list[dict], arch: str = "sm_90") -> dict:
    """Budgets from a (merged) report's rows of ``arch``: the worst over its Tritons, with :data:`SLACK`."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        if r["arch"] == arch and r["width"] == 16 and (not r["grouped"] or r["mode"] == "plain"):
            by.setdefault(r["variant"], []).append(r)
    budgets = {}
    for vid, rs in sorted(by.items()):
        loops = [r["loop"] for r in rs if r.get("loop")]
        tiles = [r["tile_loop"] for r in rs if r.get("tile_loop")]
        atomics = {k for r in rs for k in _atomics(r)}
        budgets[vid] = {
            "max_loop_instructions_per_16B": _ceil(max(lp["instructions_per_16B"] for lp in loops)),
            "max_tile_instructions_per_16B": _ceil(max(t["instructions_per_16B"] for t in tiles)),
            "max_loop_barriers": max(sum(lp["barriers"].values()) for lp in loops),
            "max_tile_barriers": max(sum(t.get("barriers", {}).values()) for t in tiles),
            "max_stack_bytes": max(r["stack_bytes"] for r in rs),
            "ptx_atomics": {k: max(_atomics(r).get(k, 0) for r in rs) for k in sorted(atomics)},
        }
    return {
        "about": "per variant: what tests/unit/test_kernel_static.py holds the kernel to (bench/static/budget.py)",
        "arch": arch,
        "made_from": sorted({r.get("triton", "?") for r in rows}),
        "slack": SLACK,
        "variants": budgets,
    }


def problems(row: dict, budget: dict, plain: dict | None = None) -> list[str]:
    """What a measured variant (a report row) breaks in its budget (and, without the checks, the default path's
    rules: no spill, 16-byte data accesses). With the checks, ``plain`` (the same page and direction without them)
    bounds the tile loop (at most :data:`CHECKED_OVER_PLAIN` times its instructions per 16 bytes) and the copy loop
    (at most :data:`CHECKED_LOOP_OVER_PLAIN` times)."""
    out = []
    for loop, what, ratio in (
        ("tile_loop", "tile loop", CHECKED_OVER_PLAIN),
        ("loop", "copy loop", CHECKED_LOOP_OVER_PLAIN),
    ):
        if plain is not None and row.get(loop) and plain.get(loop):
            got, base = row[loop]["instructions_per_16B"], plain[loop]["instructions_per_16B"]
            if got > ratio * base:
                out.append(f"{row['variant']}: {what} {got} instructions per 16 B > {ratio} x plain {base}")
    name = row["variant"]
    if row["stack_bytes"] or row["spill_stores"] or row["spill_loads"]:  # no variant may spill
        out.append(f"{name}: spills ({row['stack_bytes']} stack bytes, {row['spill_stores']} STL, "
                   f"{row['spill_loads']} LDL)")  # fmt: skip
    if row["mode"] == "plain":
        # Every store is data (id and table loads are 32 or 64 bits): all 16-byte, each after a 16-byte load.
        acc = row["global_accesses"]
        stores = {op: n for op, n in acc.items() if op.startswith("STG")}
        if set(stores) != {"STG.E.128"} or acc.get("LDG.E.128") != stores["STG.E.128"]:
            out.append(f"{name}: global accesses {acc}: data must move in 16-byte loads and stores")
    loop, tile = row.get("loop"), row.get("tile_loop")
    if loop is None or tile is None:
        return out + [f"{name}: no copy loop found in its SASS"]
    checks = (
        ("loop instructions per 16 B", loop["instructions_per_16B"], budget["max_loop_instructions_per_16B"]),
        ("tile instructions per 16 B", tile["instructions_per_16B"], budget["max_tile_instructions_per_16B"]),
        ("barriers in the copy loop", sum(loop["barriers"].values()), budget["max_loop_barriers"]),
        ("barriers in the tile loop", sum(tile.get("barriers", {}).values()), budget["max_tile_barriers"]),
        ("stack bytes", row["stack_bytes"], budget["max_stack_bytes"]),
    )
    out += [f"{name}: {what} {got} > budget {limit}" for what, got, limit in checks if got > limit]
    if _atomics(row) != budget["ptx_atomics"]:
        out.append(f"{name}: PTX atomics {_atomics(row)} != budget {budget['ptx_atomics']}")
    return out
