#!/usr/bin/env python3
"""The GPU run's ``machine`` stage (``python -m tools.gpu.machine [--json PATH]``): what every other stage's numbers
are read against. The GPUs from ``nvidia-smi`` (name, driver, memory, PCIe link now and at most) and the driver's CUDA
version; per GPU its PCIe link and NUMA node from sysfs; the NUMA nodes' CPUs and memory; the CPUs; free host memory;
torch's CUDA build and device. It records what it can and says what it could not: without CUDA (or torch) it says
"no CUDA" and still ends with status 0. Stdlib only; torch is imported if present."""

from __future__ import annotations

import argparse
import json
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
    devices = sorted((sys_root / "bus" / "pci" / "devices").glob("*"))
    return [d.name for d in devices
            if _read(d / "vendor") == NVIDIA_VENDOR and (_read(d / "class") or "").startswith("0x03")]  # fmt: skip


def _meminfo(text: str, key: str, gib: bool = True) -> float | int | None:
    """A ``/proc/meminfo``-style field (kB, or a count), in GiB where ``gib``."""
    m = re.search(rf"^(?:Node \d+ )?{key}:\s*(\d+)", text, re.M)
    return m and (round(int(m.group(1)) / 2**20, 1) if gib else int(m.group(1)))


def numa_nodes(sys_root: pathlib.Path) -> dict[str, dict]:
    nodes = sorted((sys_root / "devices" / "system" / "node").glob("node[0-9]*"))
    return {n.name: {"cpulist": _read(n / "cpulist"), "mem_total_gib": _meminfo(_read(n / "meminfo") or "", "MemTotal"),
                     "mem_free_gib": _meminfo(_read(n / "meminfo") or "", "MemFree")} for n in nodes}  # fmt: skip


def host_memory(proc_root: pathlib.Path) -> dict:
    info = _read(proc_root / "meminfo") or ""
    return {"mem_total_gib": _meminfo(info, "MemTotal"), "mem_available_gib": _meminfo(info, "MemAvailable"),
            "hugepages_total": _meminfo(info, "HugePages_Total", False),
            "hugepage_kib": _meminfo(info, "Hugepagesize", False)}  # fmt: skip


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


def collect(run=subprocess.run, sys_root=pathlib.Path("/sys"), proc_root=pathlib.Path("/proc"), torch_info=None):
    """Every fact this machine gives; ``notes`` says what it could not read."""
    gpus, driver_cuda, why = nvidia_smi(run)
    notes = [why] if why else []
    ids = [sysfs_pci_id(g["pci.bus_id"]) for g in gpus if g.get("pci.bus_id")] or nvidia_pci_ids(sys_root)
    pci = [pci_facts(i, sys_root) for i in ids]
    t = torch_facts() if torch_info is None else torch_info
    if not t.get("available"):
        notes.append("no CUDA: " + (t.get("error") or "torch.cuda.is_available() is False"))
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    return {"benchmark": "machine", **machine_info(), "device": t.get("device") or (gpus[0]["name"] if gpus else None),
            "cuda": bool(t.get("available")), "driver": gpus[0]["driver_version"] if gpus else None,
            "driver_cuda": driver_cuda, "torch": t, "gpus": gpus, "pci": pci,
            "gpu_numa_node": pci[0]["numa_node"] if pci else None, "numa_nodes": numa_nodes(sys_root),
            "cpus": os.cpu_count(), "cpus_usable": usable, "memory": host_memory(proc_root),
            "notes": notes}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="write the facts as JSON")
    args = ap.parse_args(argv)
    facts = collect()
    print(json.dumps(facts, indent=1, default=str))  # the stage's log; an idle link may run below its maximum speed
    if args.json:
        write_json(args.json, facts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
