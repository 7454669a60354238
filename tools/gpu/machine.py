#!/usr/bin/env python3
"""The GPU run's ``machine`` stage: what the numbers of every other stage are read against.

    python -m tools.gpu.machine [--json PATH]

The GPUs (name, driver, memory, PCIe link width and generation now and at most) from ``nvidia-smi``; the driver's
CUDA version from its banner; per GPU its PCIe link speed and width and NUMA node from sysfs; the NUMA nodes with
their CPUs and memory; the CPU count (and the CPUs this process may use); free host memory; torch's CUDA build and
device. It records what it can and says what it could not: without CUDA (or without torch) it says "no CUDA" and
still ends with status 0. Stdlib only; torch is imported if present.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys

from bench.common.results import machine_info, write_json

SMI_FIELDS = (
    "index", "name", "driver_version", "pci.bus_id", "memory.total", "memory.free", "pcie.link.gen.current",
    "pcie.link.gen.max", "pcie.link.width.current", "pcie.link.width.max",
)  # fmt: skip
PCI_FILES = ("current_link_speed", "current_link_width", "max_link_speed", "max_link_width", "numa_node",
             "local_cpulist")  # fmt: skip
NVIDIA_VENDOR = "0x10de"


def _read(path: pathlib.Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def nvidia_smi(run=subprocess.run) -> tuple[list[dict], str | None, str | None]:
    """(GPUs, the driver's CUDA version, why nothing was read)."""
    try:
        q = run(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=30)  # fmt: skip
        banner = run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return [], None, "nvidia-smi not found"
    except (OSError, subprocess.SubprocessError) as exc:
        return [], None, f"nvidia-smi failed: {exc}"
    if q.returncode != 0:
        return [], None, f"nvidia-smi exited {q.returncode}: {(q.stderr or q.stdout).strip()[:300]}"
    gpus = [dict(zip(SMI_FIELDS, (v.strip() for v in line.split(",")))) for line in q.stdout.splitlines() if line]
    m = re.search(r"CUDA Version:\s*([\d.]+)", banner.stdout or "")
    return gpus, m and m.group(1), None


def sysfs_pci_id(bus_id: str) -> str:
    """nvidia-smi's ``00000000:18:00.0`` -> sysfs's ``0000:18:00.0``."""
    domain, rest = bus_id.lower().split(":", 1)
    return f"{domain[-4:]}:{rest}"


def pci_facts(pci_id: str, sys_root: pathlib.Path) -> dict:
    dev = sys_root / "bus" / "pci" / "devices" / pci_id
    return {"pci_id": pci_id, **{name: _read(dev / name) for name in PCI_FILES}}


def nvidia_pci_ids(sys_root: pathlib.Path) -> list[str]:
    """NVIDIA display/3D controllers in sysfs (for when nvidia-smi is missing)."""
    out = []
    for dev in sorted((sys_root / "bus" / "pci" / "devices").glob("*")):
        if _read(dev / "vendor") == NVIDIA_VENDOR and (_read(dev / "class") or "").startswith("0x03"):
            out.append(dev.name)
    return out


def numa_nodes(sys_root: pathlib.Path) -> dict[str, dict]:
    nodes = {}
    for node in sorted((sys_root / "devices" / "system" / "node").glob("node[0-9]*")):
        meminfo = _read(node / "meminfo") or ""
        m = re.search(r"MemTotal:\s*(\d+) kB", meminfo)
        free = re.search(r"MemFree:\s*(\d+) kB", meminfo)
        nodes[node.name] = {
            "cpulist": _read(node / "cpulist"),
            "mem_total_gib": m and round(int(m.group(1)) / 2**20, 1),
            "mem_free_gib": free and round(int(free.group(1)) / 2**20, 1),
        }
    return nodes


def host_memory(proc_root: pathlib.Path) -> dict:
    info = _read(proc_root / "meminfo") or ""
    out = {}
    for key in ("MemTotal", "MemAvailable", "HugePages_Total", "Hugepagesize"):
        m = re.search(rf"^{key}:\s*(\d+)", info, re.M)
        if m:
            out[key] = round(int(m.group(1)) / 2**20, 1) if key.startswith("Mem") else int(m.group(1))
    return {"mem_total_gib": out.get("MemTotal"), "mem_available_gib": out.get("MemAvailable"),
            "hugepages_total": out.get("HugePages_Total"), "hugepage_kib": out.get("Hugepagesize")}  # fmt: skip


def torch_facts() -> dict:
    try:
        import torch
    except Exception as exc:  # any import failure is a fact to record, not a reason to stop
        return {"error": f"torch not importable: {exc!r}"[:300]}
    out = {"version": torch.__version__, "cuda_build": torch.version.cuda, "available": False}
    try:
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            out.update(available=True, device_count=torch.cuda.device_count(), device=p.name,
                       sms=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                       memory_gib=round(p.total_memory / 2**30, 1))  # fmt: skip
    except Exception as exc:
        out["error"] = f"torch.cuda failed: {exc!r}"[:300]
    return out


def collect(
    run=subprocess.run, sys_root=pathlib.Path("/sys"), proc_root=pathlib.Path("/proc"), torch_info=None
) -> dict:
    """Every fact this machine gives; ``notes`` says what it could not read."""
    notes = []
    gpus, driver_cuda, why = nvidia_smi(run)
    if why:
        notes.append(why)
    ids = [sysfs_pci_id(g["pci.bus_id"]) for g in gpus if g.get("pci.bus_id")] or nvidia_pci_ids(sys_root)
    pci = [pci_facts(i, sys_root) for i in ids]
    t = torch_facts() if torch_info is None else torch_info
    cuda = bool(t.get("available"))
    if not cuda:
        notes.append("no CUDA: " + (t.get("error") or "torch.cuda.is_available() is False"))
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    device = t.get("device") or (gpus[0]["name"] if gpus else None)
    return {
        "benchmark": "machine",
        **machine_info(),
        "device": device,
        "cuda": cuda,
        "driver": gpus[0]["driver_version"] if gpus else None,
        "driver_cuda": driver_cuda,
        "torch": t,
        "gpus": gpus,
        "pci": pci,
        "gpu_numa_node": pci[0]["numa_node"] if pci else None,
        "numa_nodes": numa_nodes(sys_root),
        "cpus": os.cpu_count(),
        "cpus_usable": usable,
        "memory": host_memory(proc_root),
        "notes": notes,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="write the facts as JSON")
    args = ap.parse_args(argv)
    facts = collect()
    link = ", ".join(f"{p['pci_id']}: {p['current_link_speed']} x{p['current_link_width']} (max {p['max_link_speed']} "
                     f"x{p['max_link_width']}), NUMA node {p['numa_node']}" for p in facts["pci"])  # fmt: skip
    print(f"device: {facts['device'] or 'none'} | driver {facts['driver']} (CUDA {facts['driver_cuda']}) | torch "
          f"{facts['torch'].get('version')} (CUDA {facts['torch'].get('cuda_build')})")  # fmt: skip
    print(f"PCIe: {link or 'no NVIDIA device in sysfs'} (an idle link may run below its maximum speed)")
    print(
        f"NUMA nodes: {len(facts['numa_nodes'])} | CPUs {facts['cpus']} (usable {facts['cpus_usable']}) | host "
        f"memory {facts['memory']['mem_available_gib']} of {facts['memory']['mem_total_gib']} GiB available"
    )
    for note in facts["notes"]:
        print(f"note: {note}")
    if args.json:
        write_json(args.json, facts)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
