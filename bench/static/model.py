"""A model from the compiler's numbers to bandwidth (docs/compiler.md): a program keeps one chunk step of data in
flight (its warps' loads, issued before any is used: ``inflight_bytes_per_warp`` x warps) and waits one round trip
for it, so by Little's law a program moves at most ``step bytes / round trip``; and it issues its tile's instructions
meanwhile, at most ``tile bytes / issue time``: the slower bound holds; the programs of a launch add up to the link's
contiguous peak, and a launch with fewer tiles than programs runs fewer. The round trips and the issue rate are the
constants below, assumptions stated once (not fitted to the runs it is checked against)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Link", "H100", "segments_per_block", "predict", "programs_for"]


@dataclass(frozen=True)
class Link:
    """The machine the model predicts for.

    Attributes:
        load_round_trip_s: a chunk step's host reads over PCIe until their data is in registers (a Gen5 x16 read
            completion ~1 us, plus the host memory and the completion's size queueing: 2 us).
        store_round_trip_s: a store's step: its HBM reads (~0.6 us) and the posting of its writes to the link
            (1.4 us in all).
        issue_per_s: warp-instructions an SM issues per second on this integer-heavy code (two of its four
            schedulers' worth, at 1.98 GHz).
        launch_s: a launch's fixed cost on the device (the first and last waves' ramp).
    """

    load_round_trip_s: float = 2.0e-6
    store_round_trip_s: float = 1.4e-6
    issue_per_s: float = 2 * 1.98e9
    launch_s: float = 3.0e-6


H100 = Link()


def segments_per_block(layout: str, num_layers: int) -> int:
    """Kernel rows per GPU block: K and V apart in kv_first, one page per layer otherwise."""
    return num_layers * (2 if layout == "kv_first" else 1)


def programs_for(num_ctas: int | None, tiles: int, default: int = 4) -> int:
    return max(1, min(num_ctas or default, tiles))


def predict(
    static: dict,
    *,
    direction: str,
    layout: str,
    num_layers: int,
    blocks: int,
    segment_bytes: int,
    num_ctas: int | None,
    peak_gbps: float,
    link: Link = H100,
) -> dict:
    """The predicted bandwidth of one transfer from its variant's static numbers (a bench.static report row): GB/s,
    the fraction of ``peak_gbps`` (the same run's contiguous copy), and the programs and bound it is predicted at."""
    cfg = static["config"]
    loop, tile_loop = static.get("loop") or {}, static.get("tile_loop") or {}
    inner = loop.get("instructions", 0)
    outer = tile_loop.get("instructions_outside_inner", 0)
    rows, steps, warps = cfg["rows"], cfg["n_chunks"], cfg["num_warps"]
    items = blocks * segments_per_block(layout, num_layers)
    tiles = math.ceil(items / rows)
    programs = programs_for(num_ctas, tiles)
    rounds = math.ceil(tiles / programs)
    round_trip = link.load_round_trip_s if direction == "load" else link.store_round_trip_s
    issue = warps * (outer + inner * steps) / link.issue_per_s
    # The slower of the two bounds: the round trips of one step in flight (Little's law), or the issue of the tile's
    # instructions (the warps issue while others wait on their loads).
    tile_s = max(steps * round_trip, issue)
    total = items * segment_bytes
    seconds = link.launch_s + rounds * tile_s
    gbps = min(peak_gbps, total / seconds / 1e9)
    bound = "link" if gbps >= peak_gbps else ("issue" if issue > steps * round_trip else "round trips")
    return {"gbps": round(gbps, 2), "fraction_of_peak": round(gbps / peak_gbps, 3), "programs": programs,
            "tiles": tiles, "bound": bound, "tile_us": round(tile_s * 1e6, 2)}  # fmt: skip
