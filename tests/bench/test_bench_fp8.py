"""bench/micro/fp8.py (and fp8_cases.py) on CPU: the script's check mode end to end through Triton's interpreter, the
rows, ratios and targets from made-up timings, the E4M3 bound, and that a wrong load or store fails the check (the run
exits 1, the page is marked failed) so a wrong fast number cannot be reported on the GPU."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from bench.common.timing import Timing
from bench.micro import fp8, fp8_cases
from bench.micro.fp8_cases import FP8, Page

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_cpu_check_runs_the_script_and_writes_its_json(tmp_path):
    out = tmp_path / "fp8.json"
    proc = subprocess.run([sys.executable, "-m", "bench.micro.fp8", "--cpu-check", "--pages", "16x1x32", "--json",
                           str(out), "--plot", str(tmp_path / "fp8.png")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "fp8" and doc["mode"] == "cpu-check" and doc["complete"] is True
    assert doc["done"] == ["16x1x32/kv_first", "16x1x32/block_first"] and doc["left"] == []
    assert [c["status"] for c in doc["checks"]] == ["pass", "pass"] and doc["rows"] == []
    assert {"device", "commit", "date", "timestamp", "fp8_default_programs"} <= set(doc)
    assert not (tmp_path / "fp8.png").exists()  # nothing timed, nothing plotted


def _timing(ms: float) -> Timing:
    return Timing([ms * 0.9, ms, ms * 1.1], [0.01] * 3)


def test_rows_ratios_and_targets_from_made_up_timings():
    """An 8 KiB page: bf16 2 ms, FP8 1.25 ms at its default programs and 1.0 ms at 32, the peak 1.5 ms, both
    directions. Logical GB/s counts bf16 bytes for both formats; the wire, FP8's smaller rows."""
    group = fp8_cases.build_group(Page(16, 2, 64), "block_first", 4, 2, torch.device("cpu"))
    times = [("bf16", None, 2.0), ("fp8", None, 1.25), ("fp8", 32, 1.0), ("peak", None, 1.5)]
    rows = [fp8.make_row(group, d, m, c, c is None, _timing(ms)) for d in ("store", "load") for m, c, ms in times]
    logical = 4 * 2 * 8192
    bf16, fp8_row = rows[0], rows[1]
    assert bf16["logical_bytes"] == fp8_row["logical_bytes"] == logical == bf16["wire_bytes"]
    assert logical / 2 < fp8_row["wire_bytes"] < logical * 0.6  # one byte a value, plus the scales
    assert bf16["logical_gbps"] == pytest.approx(logical / 2e-3 / 1e9, abs=1e-3)
    assert fp8_row["wire_gbps"] == pytest.approx(fp8_row["wire_bytes"] / 1.25e-3 / 1e9, abs=1e-3)
    assert {r["page_bytes"] for r in rows} == {8192} and all(r["status"] == "pass" for r in rows)

    ratios = fp8_cases.ratio_rows(rows)
    assert [(r["direction"], r["layout"]) for r in ratios] == [("load", "block_first"), ("store", "block_first")]
    for r in ratios:
        assert r["ratio_default"] == pytest.approx(1.6) and r["ratio_best"] == pytest.approx(2.0)
        assert r["fp8_best_num_ctas"] == 32 and r["bf16_of_peak"] == pytest.approx(0.75)
        assert r["fp8_wire_of_peak"] == pytest.approx(fp8_row["wire_bytes"] / logical * 1.5 / 1.25, abs=1e-3)
    got = {t["key"]: t["result"] for t in fp8_cases.targets(ratios)}
    assert got == {"fp8_default": "FAIL", "fp8_best": "PASS"}
    # A page under 8 KiB does not count toward the target.
    small = [dict(r, page_bytes=4096) for r in ratios]
    assert {t["result"] for t in fp8_cases.targets(small)} == {"n/a"}


def test_the_plot_is_written_from_timed_ratios_and_refused_without(tmp_path):
    ratio = {"page": "p", "page_bytes": 8192, "layout": "kv_first", "bf16_gbps": 40.0, "fp8_default_gbps": 70.0,
             "fp8_best_gbps": 75.0, "peak_gbps": 50.0}  # fmt: skip
    ratios = [dict(ratio, direction=d) for d in ("store", "load")]
    assert fp8_cases.plot_fp8(ratios, str(tmp_path / "a.png"), "t") is None and (tmp_path / "a.png").stat().st_size
    empty = [dict(r, bf16_gbps=None, fp8_default_gbps=None) for r in ratios]
    assert "nothing was timed" in fp8_cases.plot_fp8(empty, str(tmp_path / "b.png"), "t")


def test_the_e4m3_bound():
    x = torch.randn(3, 16, 2, 64, dtype=torch.float64).to(torch.bfloat16)
    assert fp8_cases.fp8_bound_excess(x, x) <= 0
    assert fp8_cases.fp8_bound_excess(x, (x.double() * (1 + 2.0**-5)).to(torch.bfloat16)) <= 0
    assert fp8_cases.fp8_bound_excess(x, (x.double() * 1.25).to(torch.bfloat16)) > 0
    assert fp8_cases.fp8_bound_excess(x, torch.zeros_like(x)) > 0
    y = x.clone()
    y[0, 0, 0, 0] = float("nan")
    assert fp8_cases.fp8_bound_excess(x, y) == float("inf")


def _zero_fp8_loads(monkeypatch):
    real = fp8_cases.load

    def load(group, host_format, num_ctas=None):
        real(group, host_format, num_ctas)
        if host_format == FP8:
            idx = torch.as_tensor(group.g_dst)
            for c in group.caches:
                c.index_fill_(1 if group.layout == "kv_first" else 0, idx, 0.0)

    monkeypatch.setattr(fp8_cases, "load", load)


def _flip_a_stored_byte(monkeypatch):
    real = fp8_cases.store

    def store(group, host_format, num_ctas=None):
        real(group, host_format, num_ctas)
        if host_format == FP8:
            group.hosts[FP8][int(group.host_ids[1]), 3] ^= 1  # one FP8 value one code off

    monkeypatch.setattr(fp8_cases, "store", store)


@pytest.mark.parametrize("mutate,problem", [(_zero_fp8_loads, "beyond E4M3's bound"),
                                            (_flip_a_stored_byte, "differ from the reference")],
                         ids=["load-writes-zeros", "store-flips-a-byte"])  # fmt: skip
def test_a_wrong_round_trip_fails_the_check_and_the_run(monkeypatch, tmp_path, mutate, problem):
    mutate(monkeypatch)
    out = tmp_path / "fp8.json"
    rc = fp8.main(["--cpu-check", "--pages", "16x1x32", "--layouts", "block_first", "--json", str(out)])
    assert rc == 1
    (check,) = json.loads(out.read_text())["checks"]
    assert check["status"] == "fail" and any(problem in p for p in check["problems"]), check
    assert not any(p.startswith("bf16") for p in check["problems"])  # the copy kernel's round trip still passes


def test_a_load_that_writes_nothing_fails_the_check(monkeypatch):
    """Destinations are NaN before each load: a load that does nothing cannot pass on what was there."""
    group = fp8_cases.build_group(Page(16, 1, 32), "kv_first", 4, 1, torch.device("cpu"))
    monkeypatch.setattr(fp8_cases, "load", lambda g, fmt, num_ctas=None: None)
    problems = fp8_cases.check_group(group)
    assert len(problems) == 2 and problems[0].startswith("bf16") and "beyond E4M3's bound" in problems[1]


def test_layers_per_transfer_and_bad_arguments(capsys):
    assert fp8.layers_for(Page(8, 1, 64), 512) == fp8.MAX_LAYERS  # 2 KiB pages: capped at 32 layers
    assert fp8.layers_for(Page(16, 8, 128), 512) == 4  # 64 KiB: 4 x 512 x 64 KiB = 128 MiB
    assert fp8.layers_for(Page(16, 32, 128), 1024) == 1
    for argv, msg in ((["--blocks", "2"], "--blocks must be at least"), (["--pages", "9x9x9"], "unknown page"),
                      (["--budget-ms", "0"], "must be positive")):  # fmt: skip
        with pytest.raises(SystemExit):
            fp8.parse_args(argv)
        assert msg in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_first or block_first"):
        fp8_cases.cache_shape("mla", 4, Page(16, 1, 32))
    assert np.array_equal(fp8.parse_args(["--cpu-check"]).pages, fp8_cases.CPU_PAGES)


def test_the_gpu_run_has_an_fp8_stage_a_lease_with_time_left_reaches():
    """After the first lease's priorities (issue 38), before the long sweeps; its estimate within a short lease's
    leftovers, and the script stops starting pages well before the stage's timeout kills it."""
    from tools.gpu import stages

    stage = stages.STAGES["fp8"]
    (cmd,) = stage.steps
    assert cmd[1:3] == ("-m", "bench.micro.fp8") and "{json}" in cmd and "{plot}" in cmd and stage.kind == "fp8"
    order = list(stages.DEFAULT_ORDER)
    assert order.index("gpu-tests-slow") < order.index("fp8") < order.index("full-small")
    assert stage.estimate_s <= 60 and fp8.TIME_LIMIT_S + 30 <= stages.estimate(stage, stages.new_ledger()).timeout_s
    covered = {p.relative_to(ROOT).as_posix() for p in stages.stage_files(stage)}
    assert {"bench/micro/fp8.py", "bench/micro/fp8_cases.py", "kernels/fp8_blocks.py"} <= covered
    assert "tests/gpu/test_gpu_fp8.py" in stages.GPU_TESTS_CORE


def test_the_checked_kernel_writes_the_plain_ones_bytes_and_flags_a_changed_row():
    """fp8+checks (bench/micro/fp8_checked.py): the checked store writes the plain kernel's host rows, the checked
    load restores the same blocks and flags nothing; a bit flipped in a stored row makes its load raise."""
    from bench.micro.fp8_checked import check_checked, checked_runners

    group = fp8_cases.build_group(Page(16, 1, 32), "block_first", 4, 1, torch.device("cpu"))
    assert fp8_cases.check_group(group) == [] and check_checked(group, FP8) == []
    runners = checked_runners(group, FP8, strict=True)
    runners["store"]()
    group.hosts[FP8][group.host_ids[1], 5] ^= 0x04
    with pytest.raises(RuntimeError, match=r"flagged intact blocks at \[1\]"):
        runners["load"]()


def test_the_checks_cost_is_their_rows_rate_over_plain_fp8s():
    group = fp8_cases.build_group(Page(16, 2, 64), "block_first", 4, 2, torch.device("cpu"))
    times = [("bf16", 2.0), ("fp8", 1.25), ("fp8+checks", 1.3)]
    rows = [fp8.make_row(group, "store", m, None, True, _timing(ms)) for m, ms in times]
    assert rows[2]["host_format"] == FP8 and rows[2]["wire_bytes"] == rows[1]["wire_bytes"]
    (ratio,) = fp8_cases.ratio_rows(rows)
    assert ratio["checked_of_fp8"] == pytest.approx(1.25 / 1.3, abs=1e-3) and ratio["fp8_default_gbps"] is not None
