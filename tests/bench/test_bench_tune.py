"""bench/micro/tune.py on CPU: every launch tuning it passes is really used by the kernel (its shape changes) and moves
the right bytes under the interpreter, and the library's defaults are untouched; a variant that moves wrong bytes is
reported and never timed; the summary ranks by the worst case. The timer is a stand-in: nothing here is a
measurement."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.common import case, timing, workloads
from bench.common.env import Env
from bench.micro import tune
from bench.transfer import session
from triton_offload.issuers.launcher import CopyLauncher
from triton_offload.kernels import shapes, tables
from triton_offload.plan import Direction


@pytest.fixture(scope="module")
def mods():
    loaded = [tune, case, session, timing, workloads]
    yield loaded


class StandInTimer:
    """Calls the function once and returns a fixed time per call (so fractions of peak are exact)."""

    def __init__(self, timing, ms):
        self.timing, self.ms, self.calls = timing, ms, 0

    def __call__(self, fn, budget_ms):
        fn()
        self.calls += 1
        return self.timing.Timing([self.ms(self.calls)], [0.001])


def _group(session, workloads, name, layout, n):
    w = workloads.WORKLOADS[name].tiny()
    return session.allocate(w, layout, n, ((1, 0),), torch.device("cpu"), 0)


def test_variants_keep_bytes_per_thread_in_range(mods):
    tune = mods[0]
    vs = tune.variants()
    assert vs and all(32 <= t // (w * 32) <= 512 for t, w in vs)
    assert (16 * 1024, 4) in vs and (128 * 1024, 4) not in vs


@pytest.mark.parametrize("layout", ["kv_first", "mla"])
def test_every_variant_is_used_and_moves_the_right_bytes(mods, layout):
    tune, case, session, timing, workloads = mods
    name = "deepseek-v3-mla" if layout == "mla" else "llama3-70b-tp8"
    group = _group(session, workloads, name, layout, 8)
    env = Env(torch.device("cpu"), None, "none")
    vs = [(64, 1), (128, 2), (256, 1)]  # tiny tiles for tiny pages: bytes, warps
    before = dict(shapes.DEFAULT_TUNINGS)
    for store in (True, False):
        rows, failures, peak = tune.tune_case(group, 8, store, vs, [1, 2], env, StandInTimer(timing, lambda i: 1.0), 1)
        assert failures == [] and len(rows) == 6
        assert {(r["tile_bytes"], r["num_warps"], r["num_ctas"]) for r in rows} == {
            (t, w, c) for t, w in vs for c in (1, 2)
        }
        # The kernel's shape followed the tile: rows x chunk bytes == the tile for each variant.
        for r in rows:
            assert r["rows"] * r["chunk_bytes"] == r["tile_bytes"], r
        assert len({r["rows"] for r in rows}) > 1
    assert dict(shapes.DEFAULT_TUNINGS) == before
    # A launcher built afterwards, without tunings, launches with the defaults' shapes.
    host = torch.zeros(8, group.spec.host_block_bytes(1), dtype=torch.uint8)
    width = tables.access_width(group.spec, host)
    for d in Direction:
        assert CopyLauncher(group.spec, host, 1).config(d) == shapes.launch_config(group.spec, width, before[d])


def test_a_variant_that_moves_wrong_bytes_is_reported_and_not_timed(mods, monkeypatch):
    tune, case, session, timing, workloads = mods
    group = _group(session, workloads, "small-page", "block_first", 8)
    env = Env(torch.device("cpu"), None, "none")
    real = shapes.launch_config

    def broken(spec, width, tuning, checked=False):  # the 16-byte tile (two chunks per 32-byte segment) drops one
        cfg = real(spec, width, tuning, checked)
        if tuning.tile_bytes == 16:
            assert cfg.n_chunks == 2, cfg
            return shapes.LaunchConfig(cfg.elem, cfg.vec, cfg.rows, cfg.chunk, cfg.n_chunks - 1, cfg.num_warps)
        return cfg

    monkeypatch.setattr(shapes, "launch_config", broken)
    timer = StandInTimer(timing, lambda i: 1.0)
    assert group.spec.max_segment_bytes == 32
    rows, failures, _ = tune.tune_case(group, 8, True, [(16, 1), (128, 1)], [1, 2], env, timer, 1)
    assert [f["tile_bytes"] for f in failures] == [16] and "wrong host bytes" in failures[0]["problem"]
    assert {r["tile_bytes"] for r in rows} == {128}
    assert timer.calls == 1 + 2  # the peak and the good variant's two num_ctas; the broken one never timed


def test_summary_ranks_by_the_worst_case(mods):
    tune = mods[0]

    def row(case, tile, ctas, of_peak):
        return dict(workload=case, layout="kv_first", blocks=128, direction="load", tile_bytes=tile, num_warps=8,
                    num_ctas=ctas, of_peak=of_peak, gbps=1.0)  # fmt: skip

    rows = [row("a", 16, 8, 0.99), row("b", 16, 8, 0.70), row("a", 32, 8, 0.92), row("b", 32, 8, 0.91),
            row("a", 64, 16, 0.99), row("b", 64, 16, 0.98)]  # fmt: skip
    summary = tune.summarize(rows)
    by = {(s["tile_bytes"], s["num_ctas"]): s for s in summary}
    assert by[(16, 8)]["worst_of_peak"] == 0.70 and by[(16, 8)]["worst_case"] == "b/kv_first n=128"
    assert tune.best(summary, "load", 8, 2)["tile_bytes"] == 32  # 64 KiB is better but needs 16 CTAs
    assert tune.best(summary, "load", 16, 2)["tile_bytes"] == 64
    assert tune.best(summary, "store", 8, 2) is None
    assert np.isclose(by[(32, 8)]["median_of_peak"], 0.92)
