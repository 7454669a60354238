"""Where the pages of host memory really are, read back from ``/proc/<pid>/numa_maps`` (and ``smaps`` for transparent
huge pages), never assumed: per node, page sizes, memory policies. Stdlib only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from triton_offload.host.numa import read_file

__all__ = ["Placement", "read_placement", "size_text"]


@dataclass(frozen=True)
class Placement:
    """Where the pages of an address range are, read back from ``/proc/<pid>/numa_maps`` (and ``smaps`` for
    transparent huge pages).

    Attributes:
        nbytes: the range's size.
        node_bytes: resident bytes per node (pages not yet faulted in are on no node).
        page_kib: the kernel page sizes of the mappings (``kernelpagesize_kB``: 2048 or 1048576 for reserved huge
            pages; transparent huge pages show 4).
        thp_bytes: bytes mapped by transparent huge pages (``AnonHugePages`` + ``ShmemPmdMapped``).
        policies: the mappings' memory policies as numa_maps shows them (``"bind:1"``, ``"default"``).
        shared_vma: a mapping that holds the range also holds other memory: its counts were scaled to the range's
            share (an estimate).
        error: why nothing could be read (None when read).
    """

    nbytes: int
    node_bytes: dict[int, int] = field(default_factory=dict)
    page_kib: tuple[int, ...] = ()
    thp_bytes: int = 0
    policies: tuple[str, ...] = ()
    shared_vma: bool = False
    error: str | None = None

    @property
    def resident(self) -> int:
        return sum(self.node_bytes.values())

    def describe(self) -> str:
        """One phrase for logs: ``"node 1: 40.00 GiB (100.0%); policy bind:1; 2048 KiB pages"``."""
        if self.error is not None:
            return f"placement unknown ({self.error})"
        if not self.node_bytes:
            return "no pages resident (numa_maps shows none for this range)"
        nodes = ", ".join(
            f"node {n}: {size_text(b)} ({100 * b / max(1, self.nbytes):.1f}%)"
            for n, b in sorted(self.node_bytes.items())
        )
        pages = "/".join(f"{k} KiB" for k in self.page_kib) + " pages"
        if self.thp_bytes:
            pages += f", {size_text(self.thp_bytes)} in transparent huge pages"
        est = " (estimated: the mapping shares a VMA with other memory)" if self.shared_vma else ""
        return f"{nodes}; policy {'/'.join(self.policies) or '?'}; {pages}{est}"


def size_text(nbytes: float) -> str:
    """Bytes for a log line: ``"40.00 GiB"``, ``"12.0 MiB"``, ``"512 KiB"``."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**10:.0f} KiB"


def _vmas(maps_text: str, start: int, end: int) -> dict[int, int]:
    """``{vma start: vma end}`` of the mappings overlapping ``[start, end)``."""
    out = {}
    for line in maps_text.splitlines():
        lo, _, hi = line.split(" ", 1)[0].partition("-")
        lo_i, hi_i = int(lo, 16), int(hi, 16)
        if lo_i < end and hi_i > start:
            out[lo_i] = hi_i
    return out


def _smaps_thp(smaps_text: str, vmas: dict[int, int]) -> dict[int, int]:
    """Transparent-huge-page bytes per VMA start, for the VMAs in ``vmas``."""
    out: dict[int, int] = {}
    current = None
    for line in smaps_text.splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):
            lo = int(head.partition("-")[0], 16)
            current = lo if lo in vmas else None
        elif current is not None and head in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"):
            out[current] = out.get(current, 0) + int(line.split()[1]) * 1024
    return out


def read_placement(address: int, nbytes: int, *, proc: str = "/proc/self") -> Placement:
    """Pages per node of ``[address, address + nbytes)``, read back from ``numa_maps`` (every mapping that overlaps
    the range; a mapping that extends past it is counted in proportion, and flagged). Never raises: a kernel
    without ``numa_maps`` (built without NUMA) gives a Placement whose ``error`` says so."""
    end = address + nbytes
    maps = read_file(os.path.join(proc, "maps"))
    numa_maps = read_file(os.path.join(proc, "numa_maps"))
    if maps is None or numa_maps is None:
        return Placement(nbytes, error=f"{proc}/numa_maps is not readable (a kernel without NUMA support?)")
    vmas = _vmas(maps, address, end)
    smaps = read_file(os.path.join(proc, "smaps")) or ""
    thp = _smaps_thp(smaps, vmas)
    node_bytes: dict[int, float] = {}
    page_kib: set[int] = set()
    policies: list[str] = []
    thp_total = 0.0
    shared = False
    for line in numa_maps.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        start = int(parts[0], 16)
        if start not in vmas:
            continue
        vma_end = vmas[start]
        overlap = min(vma_end, end) - max(start, address)
        share = overlap / (vma_end - start)
        shared |= share < 1
        fields = dict(p.split("=", 1) for p in parts[2:] if "=" in p)
        kib = int(fields.get("kernelpagesize_kB", 4))
        page_kib.add(kib)
        if parts[1] not in policies:
            policies.append(parts[1])
        for k, v in fields.items():
            if k.startswith("N") and k[1:].isdigit():
                node_bytes[int(k[1:])] = node_bytes.get(int(k[1:]), 0) + int(v) * kib * 1024 * share
        thp_total += thp.get(start, 0) * share
    return Placement(
        nbytes,
        {n: int(b) for n, b in sorted(node_bytes.items())},
        tuple(sorted(page_kib)),
        int(thp_total),
        tuple(policies),
        shared,
    )
