"""The GPU mode's output, run on CPU over made-up rows (nothing here is a measurement): the relative columns, the
tables, the targets and the plot must work before the first GPU run, which has no time to spare for a crash in a
table printer."""

from __future__ import annotations

import json

import pytest

from bench.baselines import copy_loop
from bench.common import plot, results
from bench.transfer import summary
from triton_offload.kernels.shapes import DEFAULT_NUM_CTAS

DEFAULT = DEFAULT_NUM_CTAS


def _rows(results, copy_loop, triton_ms: float, vllm_ms: float) -> list[dict]:
    """One made-up case (a 8 KiB page, 128 blocks) with every method, and each median given in ms."""
    case = dict(workload="w", layout="kv_first", direction="load", page_bytes=8192, num_layers=80, blocks=128,
                blocks_per_host_block=4, skip=1, total_bytes=128 * 80 * 8192, device="x", status="pass")  # fmt: skip
    medians = {("triton", DEFAULT): triton_ms, ("triton", 1): 4 * triton_ms, ("memcpy_batch", None): 3.0,
               ("memcpy_per_block", None): 9.0, ("torch_staged", None): 2.0, ("vllm033", None): vllm_ms,
               ("peak", None): 1.0}  # fmt: skip
    rows = []
    for (method, ctas), ms in medians.items():
        impl = f"{copy_loop.PYTHON_ISSUED}: test" if method == "memcpy_per_block" else "test"
        gbps = case["total_bytes"] / (ms * 1e-3) / 1e9
        rows.append(results.new_row(**case, method=method, num_ctas=ctas, impl=impl, median_ms=ms, p20_ms=ms,
                                    p80_ms=ms, gbps=gbps, call_cpu_us=12.5))  # fmt: skip
    return rows


def test_speedups_are_against_the_same_case():
    rows = _rows(results, copy_loop, triton_ms=1.25, vllm_ms=2.5)
    other = [dict(r, blocks=16, median_ms=r["median_ms"] * 10, gbps=r["gbps"] / 80) for r in rows]
    results.fill_relative(rows + other)
    tri = next(r for r in rows if r["method"] == "triton" and r["num_ctas"] == DEFAULT)
    assert tri["speedup_vs_vllm033"] == 2.0 and tri["speedup_vs_memcpy_batch"] == 2.4
    assert tri["speedup_vs_memcpy_per_block"] == 7.2 and tri["fraction_of_peak"] == 0.8
    assert all(r["speedup_vs_vllm033"] == rows[i]["speedup_vs_vllm033"] for i, r in enumerate(other))


def test_a_row_has_exactly_the_schema():
    assert tuple(results.new_row(method="peak")) == results.ROW_KEYS
    with pytest.raises(KeyError, match="median_us"):
        results.new_row(median_us=1.0)


@pytest.mark.parametrize(("vllm_ms", "verdict"), [(2.5, "PASS"), (1.0, "FAIL")], ids=["faster", "slower"])
def test_tables_and_the_vllm033_target(capsys, vllm_ms, verdict):
    rows = _rows(results, copy_loop, triton_ms=1.25, vllm_ms=vllm_ms)
    results.fill_relative(rows)
    summary.print_results(rows, [1, DEFAULT])
    out = capsys.readouterr().out
    assert "x vllm033" in out and "Per call: device ms / host us" in out and "1.250 / 12" in out
    assert "\u2020" in out  # the Python-issued per-block baseline is marked as handicapped
    targets = {t["target"]: t for t in summary.evaluate_targets(rows, None, None)}
    (vllm,) = (t for t in targets.values() if t["key"] == "vs-vllm")
    assert vllm["result"] == verdict and vllm["where"].endswith(f"triton@{DEFAULT} vs vllm033"), vllm
    per_block = next(t for name, t in targets.items() if "memcpy_per_block" in name)
    assert "\u2020" in per_block["detail"]


def test_the_plot_has_a_line_per_method(tmp_path):
    pytest.importorskip("matplotlib")
    rows = _rows(results, copy_loop, 1.25, 2.5)
    rows += [dict(r, page_bytes=65536, layout="block_first") for r in rows]  # loads only: one panel is empty
    path = tmp_path / "p.png"
    assert plot.plot_results(rows, str(path), "made-up", DEFAULT) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    series = plot._series(rows, "load", 128, 4, DEFAULT)
    assert set(series) == {"triton", "memcpy_batch", "memcpy_per_block", "torch_staged", "vllm033", "peak"}


def test_parts_of_one_device_plot_together_and_other_devices_are_refused(tmp_path):
    pytest.importorskip("matplotlib")
    small = _rows(results, copy_loop, 1.25, 2.5)
    large = [dict(r, page_bytes=65536) for r in small]
    docs = [dict(device="x", default_num_ctas=DEFAULT, rows=rows) for rows in (small, large)]
    paths = []
    for i, doc in enumerate(docs):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(doc))
    out = tmp_path / "all.png"
    assert plot.main([str(p) for p in paths] + [str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows, device, default = plot.merge_results(docs)
    assert len(rows) == len(small) + len(large) and (device, default) == ("x", DEFAULT)
    assert [p for p, _ in plot._series(rows, "load", 128, 4, DEFAULT)["peak"]] == [8192, 65536]
    with pytest.raises(SystemExit, match="different devices"):
        plot.merge_results([docs[0], dict(docs[1], device="y")])
    with pytest.raises(SystemExit, match="different devices"):
        plot.merge_results([docs[0], dict(docs[1], default_num_ctas=DEFAULT + 1)])


def test_results_are_written_whole_or_not_at_all(tmp_path):
    path = tmp_path / "sub" / "r.json"
    results.write_json(path, {"rows": [1], "complete": False})
    results.write_json(path, {"rows": [1, 2], "complete": True})
    assert json.loads(path.read_text()) == {"rows": [1, 2], "complete": True}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temporary left behind


@pytest.mark.parametrize(("auto_ms", "verdict"), [(1.28, "PASS"), (1.30, "FAIL")], ids=["2.4%-slower", "4%-slower"])
def test_the_auto_target_compares_with_the_better_of_kernel_and_copy_engines(auto_ms, verdict):
    rows = _rows(results, copy_loop, triton_ms=1.25, vllm_ms=2.5)  # memcpy_batch 3.0 ms: the kernel is the better
    auto = dict(rows[0], method="auto", num_ctas=None, median_ms=auto_ms)
    targets = {t["target"]: t for t in summary.evaluate_targets([*rows, auto], None, None)}
    (target,) = (t for name, t in targets.items() if name.startswith("auto never slower"))
    assert target["result"] == verdict and f"worst {auto_ms / 1.25:.3g}" in target["detail"], target
