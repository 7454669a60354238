"""bench/bench_host_cache.py on CPU: set-up per placement and page size with the placement read back, no
registration, and the near/far comparison reported as not measured, with the reason."""

from __future__ import annotations

import json

import pytest

from bench.micro import host_cache
from triton_offload.host import numa

GPU = {"index": 0, "pci": "0000:1b:00.0", "node": 1}


def layout(memory_nodes: list[int], gpu: dict | None = GPU) -> dict:
    return {"nodes": {str(n): {"memory": True} for n in memory_nodes}, "gpu": gpu}


@pytest.mark.parametrize("nodes,gpu,cuda,want", [
    ([0, 1], GPU, True, (1, 0)),
    ([0, 1, 2, 3], {**GPU, "node": 2}, True, (2, 0)),
    ([0, 1], GPU, False, "not measured: no CUDA device (the transfer rate needs a GPU)"),
    ([0], {**GPU, "node": 0}, True, "not measured: this machine has 1 NUMA node(s) with memory, so no far node"),
    ([], None, True, "not measured: this machine has no NUMA node(s) with memory, so no far node"),
    ([0, 1], {**GPU, "node": None}, True,
     "not measured: GPU 0 (PCI 0000:1b:00.0) reports no NUMA node (-1), so near and far are unknown"),
])  # fmt: skip
def test_near_and_far_nodes_or_why_not(nodes, gpu, cuda, want):
    assert host_cache.near_far(layout(nodes, gpu), cuda) == want


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/numa_maps"), reason="needs Linux NUMA support")
def test_cpu_run_reports_setup_per_placement_and_page_size(tmp_path, capsys):
    out = tmp_path / "host-cache.json"
    args = [
        "--sizes-gib",
        "0.01",
        "--placements",
        "off",
        "each",
        "0",
        "--huge-pages",
        "thp",
        "1GiB",
        "--json",
        str(out),
    ]
    assert host_cache.main(args) == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["complete"] and doc["registration"] == "not measured: no CUDA"
    assert doc["near_far"] == {"status": "not measured: no CUDA device (the transfer rate needs a GPU)", "runs": []}
    assert "near vs far node: not measured: no CUDA device" in printed and "registration not measured" in printed
    assert "0" in doc["topology"]["nodes"] and doc["topology"]["gpu"] is None
    rows = {(r["placement"], r["huge_pages"]): r for r in doc["results"]}
    placements = ["off", *numa.nodes_with_memory()]  # 'each' and 0: every node once
    assert sorted(rows, key=str) == sorted(((p, h) for p in placements for h in ("thp", "1GiB")), key=str)
    for (placement, pages), r in rows.items():
        assert r["registration"] == [] and r["map_s"] >= 0 and r["touch_s"] > 0
        assert sum(r["node_bytes"].values()) == 5 * 2**21, "10 MiB rounded down to whole 2 MiB blocks, all resident"
        if placement != "off":
            assert r["node_bytes"] == {str(placement): 5 * 2**21} and r["policies"] == [f"bind:{placement}"]
        if pages == "1GiB" and r["pages_used"] == "thp":  # no 1 GiB page reserved here: the fallback says so
            assert (
                r["warning"].startswith("huge_pages = '1GiB': 0 free 1GiB page(s)") or "offers no 1GiB" in r["warning"]
            )
        else:
            assert r["pages_used"] == pages and r["warning"] is None
