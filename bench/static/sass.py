"""What a compiled variant's code says about its speed, read from its cubin (``cuobjdump -res-usage``, ``-sass``) and
PTX: registers, spills, shared memory, CTAs per SM, the width of every global load and store, the steady copy loop
(the innermost loop holding the data accesses: its instructions per 16 bytes moved, and the bytes a warp has in
flight before it first uses one), and the barriers, fences and atomics in the loop and outside it, with the atomics'
memory semantics from the PTX. Heuristics on SASS text, stated where they apply; docs/compiler.md says what each
number means."""

from __future__ import annotations

import math
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass

from bench.static.compile import tool

__all__ = ["Instr", "parse_sass", "res_usage", "analyse", "ctas_per_sm", "ptx_sync"]

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_REG = re.compile(r"\bR(\d+)\b")
# SASS suffix of a global access of each width (4 bytes: none of the sized ones).
_SIZED = re.compile(r"\.(128|64|U16|S16|U8|S8)\b")
_WIDTH_SUFFIX = {16: "128", 8: "64", 2: ("U16", "S16"), 1: ("U8", "S8")}
# Per SM, sm_90 and sm_100 alike: 64 K registers (allocated 256 per warp at a time), 2048 threads, 32 CTAs, 228 KiB
# of shared memory (1 KiB of it reserved per CTA).
SM_REGISTERS, SM_THREADS, SM_CTAS, SM_SHARED, CTA_RESERVED_SHARED = 65536, 2048, 32, 228 * 1024, 1024
BARRIERS = ("BAR",)
FENCES = ("MEMBAR", "FENCE", "ERRBAR", "CCTL")
ATOMICS = ("ATOM", "ATOMG", "RED", "REDG", "ATOMS")


@dataclass(frozen=True)
class Instr:
    addr: int
    pred: str
    op: str
    operands: str

    @property
    def base(self) -> str:
        return self.op.split(".")[0]


def parse_sass(text: str) -> list[Instr]:
    """The instructions of ``cuobjdump -sass`` output (one function), NOPs left out."""
    out = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m and m.group(3) != "NOP":
            out.append(Instr(int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4).strip()))
    return out


def _run(name: str, *args: str) -> str:
    return subprocess.run([tool(name), *args], capture_output=True, text=True, check=True).stdout


def res_usage(cubin_path: str) -> dict:
    """REG, STACK, SHARED and LOCAL of the cubin's kernel (``cuobjdump -res-usage``)."""
    text = _run("cuobjdump", "-res-usage", cubin_path)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if m is None:
        raise ValueError(f"no resource usage in cuobjdump's output: {text[-500:]}")
    return dict(zip(("registers", "stack_bytes", "shared_bytes", "local_bytes"), map(int, m.groups())))


def ctas_per_sm(registers: int, warps: int, shared_bytes: int) -> int:
    """Resident CTAs per SM by registers, threads, the CTA limit and shared memory (sm_90 / sm_100)."""
    per_warp = math.ceil(registers * 32 / 256) * 256
    by_regs = SM_REGISTERS // (per_warp * warps) if registers else SM_CTAS
    by_smem = SM_SHARED // (shared_bytes + CTA_RESERVED_SHARED)
    return min(SM_CTAS, SM_THREADS // (32 * warps), by_regs, by_smem)


def _is_data(ins: Instr, width: int) -> bool:
    """A global load or store of the data's access width (4 bytes: no size suffix)."""
    if ins.base not in ("LDG", "STG"):
        return False
    sized = _SIZED.search(ins.op)
    if width == 4:
        return sized is None
    want = _WIDTH_SUFFIX.get(width)
    return sized is not None and sized.group(1) in ((want,) if isinstance(want, str) else want)


def _loops(code: list[Instr]) -> list[tuple[int, int]]:
    """(first, last) instruction index of each loop: a branch back to an earlier address."""
    index = {ins.addr: i for i, ins in enumerate(code)}
    out = []
    for i, ins in enumerate(code):
        if ins.base == "BRA":
            m = re.search(r"0x([0-9a-f]+)", ins.operands)
            if m and int(m.group(1), 16) < ins.addr and int(m.group(1), 16) in index:
                out.append((index[int(m.group(1), 16)], i))
    return out


def _sources(ins: Instr) -> set[int]:
    """Registers an instruction reads (a store, reduction or branch reads all its operands; others skip the first)."""
    parts = [p.strip() for p in ins.operands.split(",")]
    reads = parts if ins.base in ("STG", "ST", "STS", "STL", "RED", "REDG") else parts[1:]
    return {int(r) for p in reads for r in _REG.findall(p)}


def _inflight(body: list[Instr], width: int) -> int:
    """Data bytes a thread's loads put in flight in ``body`` before an instruction first reads one's result."""
    pending: set[int] = set()
    nbytes = 0
    regs = max(1, width // 4)
    for ins in body:
        if pending & _sources(ins):
            break
        if ins.base == "LDG" and _is_data(ins, width):
            first = int(_REG.search(ins.operands).group(1))
            pending |= set(range(first, first + regs))
            nbytes += width
    return nbytes


def _counts(code: list[Instr], prefixes: tuple[str, ...]) -> dict[str, int]:
    return dict(Counter(i.op for i in code if i.base in prefixes))


def analyse(sass_text: str, width: int, n_chunks: int, copy: bool = True) -> dict:
    """The variant's numbers from its SASS: ``width`` is its data access width, ``n_chunks`` the chunk loop's trips
    per tile row for its page, ``copy`` False for the checksum-only launch (it stores no data: its loop is found by
    its loads)."""
    code = parse_sass(sass_text)
    accesses = Counter(i.op for i in code if i.base in ("LDG", "STG", "LDL", "STL"))
    data_stores = [k for k, i in enumerate(code) if i.base == "STG" and _is_data(i, width)]
    data_loads = [k for k, i in enumerate(code) if i.base == "LDG" and _is_data(i, width)]
    anchor = data_stores if copy else data_loads
    loops = _loops(code)
    inner = min((lp for lp in loops if any(lp[0] <= k <= lp[1] for k in anchor)), key=lambda lp: lp[1] - lp[0],
                default=None)  # fmt: skip
    out: dict = {"instructions": len(code), "global_accesses": dict(accesses),
                 "spill_stores": sum(1 for i in code if i.base == "STL"),
                 "spill_loads": sum(1 for i in code if i.base == "LDL")}  # fmt: skip
    if inner is None:
        return out | {"loop": None}
    outer = min((lp for lp in loops if lp[0] <= inner[0] and lp[1] >= inner[1] and lp != inner),
                key=lambda lp: lp[1] - lp[0], default=None)  # fmt: skip
    body = code[inner[0] : inner[1] + 1]
    loop_bytes = sum(width for i in body if i.base == "LDG" and _is_data(i, width))
    loop = {"instructions": len(body), "data_bytes_per_thread": loop_bytes,
            "instructions_per_16B": round(len(body) * 16 / loop_bytes, 2) if loop_bytes else None,
            "inflight_bytes_per_warp": 32 * _inflight(body, width),
            "barriers": _counts(body, BARRIERS), "fences": _counts(body, FENCES),
            "atomics": _counts(body, ATOMICS)}  # fmt: skip
    tile = None
    if outer is not None:
        outer_only = (outer[1] - outer[0] + 1) - len(body)
        per_tile = outer_only + len(body) * n_chunks
        tile_code = code[outer[0] : outer[1] + 1]
        tile = {"instructions_outside_inner": outer_only, "instructions_per_16B": (
            round(per_tile * 16 / (loop_bytes * n_chunks), 2) if loop_bytes else None),
            "barriers": _counts(tile_code, BARRIERS), "fences": _counts(tile_code, FENCES),
            "atomics": _counts(tile_code, ATOMICS)}  # fmt: skip
    inside = set(range(inner[0], inner[1] + 1))
    rest = [i for k, i in enumerate(code) if k not in inside]
    return out | {
        "loop": loop,
        "tile_loop": tile,
        "outside_loop": {
            "barriers": _counts(rest, BARRIERS),
            "fences": _counts(rest, FENCES),
            "atomics": _counts(rest, ATOMICS),
        },
    }


_ATOMIC_OPS = ("add", "exch", "cas", "max", "min", "and", "or", "xor", "inc", "dec")


def ptx_sync(ptx: str) -> dict:
    """The PTX's synchronisation, counted: each atomic with its memory semantics and scope
    (``atom.global.acq_rel.gpu.add.u64``: sem ``acq_rel``, scope ``gpu``; an atom without them is PTX's default,
    ``relaxed`` at ``gpu`` scope), the fences and the barriers."""
    atoms: Counter = Counter()
    for m in re.finditer(r"\b(atom|red)\.global((?:\.[a-z0-9_]+)*)", ptx):
        quals = m.group(2).split(".")[1:]
        sem = next((q for q in quals if q in ("relaxed", "acquire", "release", "acq_rel", "sc")), "relaxed")
        scope = next((q for q in quals if q in ("cta", "gpu", "sys", "cluster")), "gpu")
        op = next(
            (q for q in quals if q in ("add", "exch", "cas", "max", "min", "and", "or", "xor", "inc", "dec")), "?"
        )
        atoms[f"{m.group(1)}.{op} sem={sem} scope={scope}"] += 1
    fences = Counter(m.group(0) for m in re.finditer(r"\b(fence|membar)(\.[a-z0-9_]+)+", ptx))
    return {"atomics": dict(atoms), "fences": dict(fences), "barriers": len(re.findall(r"\bbar\.sync\b", ptx))}


def cubin_facts(cubin: bytes) -> tuple[dict, str]:
    """(resource usage, SASS text) of a cubin, through a temporary file (the tools read files)."""
    fd, path = tempfile.mkstemp(suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        return res_usage(path), _run("cuobjdump", "-sass", path)
    finally:
        os.unlink(path)
