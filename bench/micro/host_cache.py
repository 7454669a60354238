"""What a large host cache costs to set up, per placement and page size, and what its NUMA node costs to read and write
from the GPU: allocation (mapping and binding), first touch, CUDA registration (:func:`measure_setup`), and the transfer
rate from the GPU's own node against another node (:func:`measure_transfer`). Placements: ``auto`` (the GPU's node),
``off`` (not bound), a node number, or ``each`` (every node with memory). The JSON is rewritten after every row and
records the machine's node layout (:func:`topology`).

    python -m bench.micro.host_cache --sizes-gib 8 32 64 --threads 1 4 16 --json out.json
    python -m bench.micro.host_cache --sizes-gib 16 --placements auto off each --huge-pages thp 2MiB 1GiB off
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from bench.common.report import print_table, say
from bench.common.results import machine_info, write_json
from triton_offload.host import numa
from triton_offload.host import pages as host_pages
from triton_offload.host.cache import HostCache
from triton_offload.host.placement import read_placement, size_text
from triton_offload.host.registration import REGISTER_CHUNK_BYTES, register_host_range, unregister_host_ranges

GIB = 1 << 30
BLOCK_BYTES = 2 << 20  # any host block size: the cache is sized in bytes


def topology(sysfs: str = numa.SYSFS, cuda: bool = False) -> dict:
    """The machine's node layout: per node its CPUs, free memory and free reserved huge pages; the GPU's PCI address
    and node (CUDA only)."""
    nodes = numa.online_nodes(sysfs)
    memory = set(numa.nodes_with_memory(sysfs) or ())
    layout = {
        "nodes": {
            str(n): {
                "cpus": numa.cpus_text(numa.node_cpus(n, sysfs)),
                "memory": n in memory,
                "available_bytes": numa.node_available_bytes(n, sysfs),
                "free_huge_pages": {
                    name: (host_pages.free_huge_pages(size, n, sysfs) or (None,))[0]
                    for name, size in host_pages.HUGE_PAGE_SETTINGS.items()
                    if size
                },
            }
            for n in nodes or ()
        },
        "numa_sysfs": nodes is not None,
        "gpu": None,
    }
    if cuda:
        index = torch.cuda.current_device()
        try:
            bdf = numa.gpu_pci_bus_id(index)
            layout["gpu"] = {"index": index, "pci": bdf, "node": numa.pci_numa_node(bdf, sysfs)}
        except (RuntimeError, OSError, ValueError) as e:
            layout["gpu"] = {"index": index, "error": str(e)}
    return layout


def near_far(layout: dict, cuda: bool) -> tuple[int, int] | str:
    """``(near node, far node)`` to compare, or why the comparison cannot be measured here."""
    if not cuda:
        return "not measured: no CUDA device (the transfer rate needs a GPU)"
    with_memory = sorted(int(n) for n, v in layout["nodes"].items() if v["memory"])
    if len(with_memory) < 2:
        return f"not measured: this machine has {len(with_memory) or 'no'} NUMA node(s) with memory, so no far node"
    gpu = layout.get("gpu") or {}
    if gpu.get("node") is None:
        why = gpu.get("error") or f"GPU {gpu.get('index')} (PCI {gpu.get('pci')}) reports no NUMA node (-1)"
        return f"not measured: {why}, so near and far are unknown"
    far = next(n for n in with_memory if n != gpu["node"])
    return gpu["node"], far


def measure_setup(nbytes: int, placement: str | int, pages: str, threads: list[int], cuda: bool) -> dict:
    """One cache: mapping, first touch and read-back once, then register + unregister per thread count.

    Each (size, placement, page size) is one ``HostCache(pin=False)``: ``map_s`` (the mapping and its ``mbind``),
    ``touch_s`` (its parallel first touch from threads on the node's CPUs) and where its pages are, read back from
    ``/proc/self/numa_maps`` (not assumed). On CUDA that memory is then registered and unregistered once per thread
    count (``register_host_range``, 1 GiB chunks, threads on the node's CPUs). A reserved page size the machine lacks
    falls back to transparent huge pages: the row says so (``pages`` shows what was used, ``warning`` why). Without
    CUDA nothing is registered: the registration lists are empty and the output says so.
    """
    cache = HostCache(
        BLOCK_BYTES,
        nbytes,
        pin=False,
        numa_node=placement,
        huge_pages=pages,
        device=torch.device("cuda", torch.cuda.current_device()) if cuda else None,
    )
    p = cache.placement
    out = {
        "gib": nbytes / GIB,
        "placement": placement,
        "node": cache.numa.node,
        "why": cache.numa.why,
        "huge_pages": pages,
        "pages_used": cache.huge_pages,
        "warning": " | ".join(cache.warnings) or None,
        "map_s": round(cache.map_seconds, 3),
        "touch_s": round(cache.touch_seconds, 3),
        "touch_gibps": round(nbytes / GIB / max(cache.touch_seconds, 1e-9), 2),
        "populated_by": cache.populated_by,
        "node_bytes": {str(n): b for n, b in p.node_bytes.items()},
        "page_kib": list(p.page_kib),
        "thp_bytes": p.thp_bytes,
        "policies": list(p.policies),
        "placement_read_back": p.describe(),
    }
    t0 = time.perf_counter()
    read_placement(cache.buffer.data_ptr(), cache.nbytes)
    out["read_back_s"] = round(time.perf_counter() - t0, 3)
    runs = []
    if cuda:
        ptr = cache.buffer.data_ptr()
        for t in threads:
            t0 = time.perf_counter()
            ranges = register_host_range(ptr, cache.nbytes, threads=t, what="benchmark buffer", cpus=cache.numa.cpus)
            reg_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            unregister_host_ranges(ranges)
            runs.append(
                {
                    "threads": t,
                    "chunks": len(ranges),
                    "register_s": round(reg_s, 3),
                    "register_gibps": round(nbytes / GIB / reg_s, 2),
                    "unregister_s": round(time.perf_counter() - t0, 3),
                }
            )
    out["registration"] = runs
    cache.close()
    del cache
    gc.collect()
    return out


def measure_transfer(node: int, nbytes: int, repeats: int) -> dict:
    """GB/s of copies between the GPU and a pinned buffer bound to ``node`` (median of ``repeats``), each direction
    one copy per registered chunk (a copy-engine copy must lie inside one registration).

    Near vs far (CUDA, two nodes or more, a GPU that reports its node): a pinned buffer of ``--transfer-gib`` on the
    GPU's node and one on another node, each copied to and from the GPU ``--repeats`` times (copy engine, one copy per
    registered chunk); GB/s is the median. Where that cannot be measured (no CUDA, one node, no node for the GPU) the
    output and the JSON say so and why (:func:`near_far`).
    """
    cache = HostCache(BLOCK_BYTES, nbytes, numa_node=node, pin=True, device=torch.device("cuda"))
    try:
        dev = torch.empty(cache.nbytes, dtype=torch.uint8, device="cuda")
        host = cache.buffer.view(-1)
        base = host.data_ptr()
        # Registered: one copy per chunk; pinned at allocation (registration refused): one allocation, one copy.
        spans = [(p - base, p - base + size) for p, size in cache._registered] or [(0, cache.nbytes)]
        result = {"node": node, "pinned_by": cache.pinned_by, "placement_read_back": cache.placement.describe()}
        for name, to_gpu in (("h2d_gbps", True), ("d2h_gbps", False)):
            rates = []
            for _ in range(repeats + 1):  # the first is a warm-up
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for lo, hi in spans:
                    (dev[lo:hi] if to_gpu else host[lo:hi]).copy_(host[lo:hi] if to_gpu else dev[lo:hi], True)
                end.record()
                end.synchronize()
                rates.append(cache.nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
            result[name] = round(statistics.median(rates[1:]), 2)
        del dev, host
        return result
    finally:
        cache.close()
        gc.collect()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-gib", type=float, nargs="+", default=[8, 32, 64])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 16], help="registration threads (CUDA)")
    ap.add_argument(
        "--placements",
        nargs="+",
        default=["auto", "off"],
        help="numa_node values: auto, off, N, or 'each' (every node)",
    )
    ap.add_argument("--huge-pages", nargs="+", default=["thp", "2MiB"], help="thp, 2MiB, 1GiB, off")
    ap.add_argument("--transfer-gib", type=float, default=4.0, help="buffer size of the near/far transfer test")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    each = [str(n) for n in numa.nodes_with_memory() or ()]
    placements = [numa.numa_setting(p, "--placements") for a in args.placements for p in (each if a == "each" else [a])]
    placements = list(dict.fromkeys(placements))  # 'each' may repeat a node also named
    pages = [host_pages.huge_pages_setting(p, "--huge-pages") for p in args.huge_pages]
    cuda = torch.cuda.is_available()
    if cuda:
        torch.empty(1, device="cuda")  # the context exists before the first registration is timed
    else:
        say("no CUDA: measuring allocation, first touch and placement only; registration needs a GPU", "yellow")
    layout = topology(cuda=cuda)
    nodes = ", ".join(f"node {n}: CPUs {v['cpus'] or '-'}" for n, v in layout["nodes"].items()) or "no NUMA in sysfs"
    gpu = layout["gpu"]
    say(f"NUMA layout: {nodes}" + (f"; GPU {gpu.get('pci', '?')} on node {gpu.get('node')}" if gpu else ""))
    plan = near_far(layout, cuda)
    results: list[dict] = []
    transfer: dict = {"status": plan if isinstance(plan, str) else "measured", "runs": []}
    total = len(args.sizes_gib) * len(placements) * len(pages)

    def write() -> None:
        if args.json:
            doc = {
                "benchmark": "host_cache",
                **machine_info(),
                "device": torch.cuda.get_device_name() if cuda else None,
                "torch": torch.__version__,
                "chunk_bytes": REGISTER_CHUNK_BYTES,
                "registration": "measured" if cuda else "not measured: no CUDA",
                "topology": layout,
                "complete": len(results) == total and (isinstance(plan, str) or len(transfer["runs"]) == 2),
                "results": results,
                "near_far": transfer,
            }
            write_json(args.json, doc)

    for gib in args.sizes_gib:
        nbytes = max(BLOCK_BYTES, int(gib * GIB) // BLOCK_BYTES * BLOCK_BYTES)
        for placement in placements:
            for page in pages:
                say(f"{gib:g} GiB, numa_node={placement!r}, huge_pages={page!r}: mapping, touching, registering")
                try:
                    results.append(measure_setup(nbytes, placement, page, args.threads, cuda))
                except (RuntimeError, OSError, MemoryError, ValueError) as exc:
                    say(f"{gib:g} GiB {placement}/{page} failed: {exc}", "bold red")
                    results.append(
                        {
                            "gib": gib,
                            "placement": placement,
                            "huge_pages": page,
                            "error": f"{type(exc).__name__}: {exc}",
                        }
                    )
                write()
    if isinstance(plan, str):
        say(f"near vs far node: {plan}", "yellow")
    else:
        nbytes = max(BLOCK_BYTES, int(args.transfer_gib * GIB) // BLOCK_BYTES * BLOCK_BYTES)
        for role, node in zip(("near", "far"), plan):
            say(f"transfer rate, {role} node {node}: {nbytes / GIB:g} GiB x {args.repeats}")
            try:
                transfer["runs"].append({"role": role, **measure_transfer(node, nbytes, args.repeats)})
            except (RuntimeError, OSError, MemoryError, ValueError) as exc:
                transfer["runs"].append({"role": role, "node": node, "error": f"{type(exc).__name__}: {exc}"})
            write()
    write()
    rows = []
    for r in results:
        node = "-" if r.get("node") is None else r["node"]
        label = [
            f"{r['gib']:.3g}",
            f"{r['placement']} -> {node}" if "error" not in r else r["placement"],
            r["huge_pages"],
        ]
        if "error" in r:
            rows.append([*label, "-", "-", "-", "-", "-", "-", r["error"][:60]])
            continue
        for reg in r["registration"] or [{}]:
            rows.append(
                [
                    *label,
                    r["pages_used"] if r["pages_used"] == r["huge_pages"] else f"{r['pages_used']} (fallback)",
                    f"{r['map_s']:.2f}",
                    f"{r['touch_s']:.2f} ({r['touch_gibps']:.1f} GiB/s)",
                    reg.get("threads", "n/a"),
                    f"{reg['register_s']:.2f} ({reg['register_gibps']:.1f} GiB/s)" if reg else "n/a",
                    ", ".join(f"N{n} {size_text(b)}" for n, b in r["node_bytes"].items()) or "-",
                    (r["warning"] or "")[:60],
                ]
            )
    print_table(
        "HostCache set-up per placement and page size",
        ["GiB", "numa_node -> node", "huge_pages", "pages used", "map s", "touch s", "threads", "register s",
         "pages per node (read back)", "note"],
        rows,
        note="" if cuda else "no CUDA: registration not measured",
        left=4,
    )  # fmt: skip
    if transfer["runs"]:
        print_table(
            "Transfer rate from the GPU's node (near) and another (far)",
            ["role", "node", "H2D GB/s", "D2H GB/s", "placement"],
            [
                [
                    t["role"],
                    t["node"],
                    t.get("h2d_gbps", "-"),
                    t.get("d2h_gbps", "-"),
                    (t.get("error") or t.get("placement_read_back", ""))[:80],
                ]
                for t in transfer["runs"]
            ],
        )
    failed = any("error" in r for r in results) or any("error" in t for t in transfer["runs"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
