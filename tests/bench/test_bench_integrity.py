"""The benchmarks measure the integrity checks' cost (issue 41, docs/integrity.md): ``--integrity`` runs the kernel with
the checks (``triton_integrity``) beside ``triton`` at the default num_ctas, in the transfer benchmark (rows, a side
by side table, the JSON's ``integrity`` pairs and a target) and in the serving benchmark (a method after the others).
On CPU: the bytes are checked, nothing is timed; the tables and targets run over made-up rows."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from bench.baselines import METHODS, SERVING_METHODS
from bench.common import results
from bench.serving import cli as serving
from bench.transfer import cli as transfer
from bench.transfer import summary
from bench.transfer.session import method_specs
from triton_offload.checksums import LoadCheck
from triton_offload.engine import LOAD
from triton_offload.kernels.shapes import DEFAULT_NUM_CTAS


def test_the_method_is_registered_for_both_benchmarks_and_runs_only_when_asked():
    assert results.INTEGRITY_METHOD in METHODS and results.INTEGRITY_METHOD in SERVING_METHODS
    assert not METHODS[results.INTEGRITY_METHOD].sweeps_ctas
    names = [ms.name for ms in method_specs([1, DEFAULT_NUM_CTAS])]
    assert results.INTEGRITY_METHOD not in names
    names = [ms.name for ms in method_specs([1, DEFAULT_NUM_CTAS], integrity=True)]
    assert names.index(results.INTEGRITY_METHOD) == names.index(f"triton[{DEFAULT_NUM_CTAS}]") + 1


def test_the_transfer_cpu_check_moves_the_right_bytes_with_the_checks(tmp_path):
    """Every case that triton runs, triton_integrity runs too, and passes the byte check (a load's launch flagging an
    intact block would fail it); nothing is timed."""
    out = tmp_path / "cpu.json"
    argv = ["--quick", "--cpu-check", "--integrity", "--workloads", "small-page", "deepseek-v3-mla", "--json", str(out)]
    assert transfer.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["failures"] == [] and data["args"]["integrity"]
    checked = [r for r in data["rows"] if r["method"] == results.INTEGRITY_METHOD]
    kernel = [r for r in data["rows"] if r["method"] == "triton" and r["num_ctas"] == DEFAULT_NUM_CTAS]
    assert len(checked) == len(kernel) == 4  # two workloads, one layout each, both directions
    case = lambda r: tuple(r[k] for k in results.CASE_KEYS)  # noqa: E731
    assert {case(r) for r in checked} == {case(r) for r in kernel}
    assert all(r["status"] == "pass" and r["num_ctas"] is None and r["gbps"] is None for r in checked), checked
    assert "integrity checks fused" in data["methods"][results.INTEGRITY_METHOD]


def _rows(cost_pct: float, page_bytes: int = 8192) -> list[dict]:
    """One made-up case: triton at the default num_ctas, and triton_integrity ``cost_pct`` % slower in bandwidth."""
    case = dict(workload="w", layout="kv_first", direction="store", page_bytes=page_bytes, num_layers=80,
                blocks=128, blocks_per_host_block=4, skip=1, total_bytes=128 * 80 * page_bytes, device="x",
                status="pass")  # fmt: skip
    off = results.new_row(**case, method="triton", num_ctas=DEFAULT_NUM_CTAS, median_ms=1.0, gbps=80.0,
                          call_cpu_us=20.0)  # fmt: skip
    on = results.new_row(**case, method=results.INTEGRITY_METHOD, num_ctas=None, median_ms=1 / (1 - cost_pct / 100),
                         gbps=80.0 * (1 - cost_pct / 100), call_cpu_us=20.5)  # fmt: skip
    return [off, on]


@pytest.mark.parametrize(("cost_pct", "verdict"), [(1.0, "PASS"), (5.0, "FAIL")], ids=["1%", "5%"])
def test_on_and_off_side_by_side_in_the_table_the_json_and_a_target(capsys, cost_pct, verdict):
    rows = _rows(cost_pct) + _rows(50.0, page_bytes=2048)  # a small page: shown, but not the goal's
    pair, small = results.integrity_pairs(rows, DEFAULT_NUM_CTAS)
    assert pair["gbps_off"] == 80.0 and pair["cost_pct"] == pytest.approx(cost_pct)
    assert pair["call_cpu_us_off"] == 20.0 and pair["call_cpu_us_on"] == 20.5 and pair["page_bytes"] == 8192
    assert small["cost_pct"] == pytest.approx(50.0)
    summary.print_results(rows, [DEFAULT_NUM_CTAS])
    out = capsys.readouterr().out
    assert "Integrity checks on vs off" in out and f"{cost_pct:.1f}" in out and "+0.5" in out
    targets = {t["target"]: t for t in summary.evaluate_targets(rows, None, None)}
    (target,) = (t for name, t in targets.items() if name.startswith("integrity checks cost"))
    assert target["result"] == verdict and target["worst"] == pytest.approx(cost_pct), target
    # Without the checks' rows, no table and no target.
    summary.print_results(rows[:1], [DEFAULT_NUM_CTAS])
    assert "Integrity checks" not in capsys.readouterr().out
    assert not any("integrity" in t["target"] for t in summary.evaluate_targets(rows[:1], None, None))


SERVING = ["--cpu-check", "--workloads", "small-page", "--shapes", "prefill-heavy", "--load-modes", "sync"]


def test_the_serving_benchmark_runs_the_checks_after_its_methods(tmp_path):
    out = tmp_path / "serving.json"
    assert serving.main([*SERVING, "--methods", "none", "triton", "--integrity", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["plan"]["methods"] == ["none", "triton", results.INTEGRITY_METHOD]
    rows = {r["method"]: r for r in data["rows"]}
    assert rows[results.INTEGRITY_METHOD]["byte_check"] == "pass" and rows["triton"]["byte_check"] == "pass"
    # Asked for by name, it is not run twice.
    plan = serving.run_plan(serving.parse_args([*SERVING, "--methods", results.INTEGRITY_METHOD, "--integrity"]), False)
    assert plan.methods == (results.INTEGRITY_METHOD,)


def test_the_serving_loop_fails_when_a_check_flags_an_intact_block(tmp_path, monkeypatch):
    """The loop's blocks are intact: a load whose check failed means the checks are wrong, and the run says so."""
    real = serving.build_engine

    class Flagging:
        def __init__(self, engine):
            self.engine = engine

        def __getattr__(self, name):
            return getattr(self.engine, name)

        def get_finished(self):
            flag = LoadCheck(np.array([0]), np.zeros(0, dtype=np.int64))
            return [dataclasses.replace(r, check=flag) if r.direction == LOAD else r
                    for r in self.engine.get_finished()]  # fmt: skip

    def build(point, target):
        engine = real(point, target)
        return Flagging(engine) if point.method == results.INTEGRITY_METHOD else engine

    monkeypatch.setattr(serving, "build_engine", build)
    out = tmp_path / "serving.json"
    assert serving.main([*SERVING, "--methods", "triton", "--integrity", "--json", str(out)]) == 1
    data = json.loads(out.read_text())
    (failure,) = data["failures"]
    assert failure["method"] == results.INTEGRITY_METHOD and "flagged intact blocks at positions [0]" in str(failure)


def test_the_call_cost_benchmark_traces_the_submits_with_the_checks():
    """bench.micro.call_cost --integrity: the engine's submits with the checks, labelled so (on CPU at the tiny shape,
    only their steps, as for the submits without them)."""
    from bench.micro import call_cost

    traced = call_cost.measure(True, 4, integrity=True)["engine submit steps (inside the calls above)"]
    for call in ("engine.submit_store", "engine.submit_load"):
        plain = [k for k in traced if k.startswith(call) and "integrity" not in k]
        checked = [k for k in traced if k.startswith(call) and ", integrity verify / plan:" in k]
        assert plain and checked, traced
        assert all(traced[k]["calls"] == 4 for k in checked), traced
