"""The FP8 host format's kernel (kernels/fp8_blocks.py) in the static report: its variants for the benchmark's bf16
pages as :class:`~triton_offload.issuers.fp8_launcher.Fp8Launcher` derives them, lowered for a GPU architecture
without a GPU and measured like the copy kernel's (bench/static/sass.py), beside the copy kernel's plain variant of
the same page: registers, spills, the width of the host-side (wire) accesses of the copy loop, and its instructions
per 16 bytes of the cache's own bytes (bf16), so both kernels are counted per the same logical bytes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

import triton_offload as to
from bench.static import sass
from bench.static.compile import CHECK_POINTERS, CHECK_SCALARS, without_checks
from bench.static.variants import PAGES, _layer
from triton_offload.kernels import fp8_blocks

__all__ = ["FP8_PAGES", "Fp8Variant", "fp8_variants", "compile_fp8", "measure_fp8"]

# The benchmark's bf16 workloads (bench/static/variants.py PAGES): the pages the format quantizes.
FP8_PAGES = tuple(p for p in PAGES if p[3] is torch.bfloat16)
_ELEM = {True: "*bf16", False: "*fp16"}


@dataclass(frozen=True)
class Fp8Variant:
    """One compiled variant of the FP8 kernel: its page and the constexprs its launcher derives."""

    page: str
    layout: str
    direction: str
    grouped: bool
    config: tuple  # fp8_blocks.fp8_config: (TOK, DIM, token chunks, heads, bf16, VEC, warps)
    word: int = 0  # with the integrity checks, their word (fp8_blocks.fp8_word_bytes); 0: without

    @property
    def id(self) -> str:
        checked = f"/checked-w{self.word}" if self.word else ""
        return f"{self.page}/fp8-{self.direction}/{'groups' if self.grouped else '1group'}{checked}"


def fp8_variants(pages=FP8_PAGES, checked: bool = False) -> list[Fp8Variant]:
    """Every (page, direction, groups) variant, its constexprs the launcher's own (4 layers of 4 blocks); ``checked``:
    also each one with the integrity checks."""
    out = []
    for name, layout, page, dtype, _ in pages:
        for grouped in (False, True):
            caches = [_layer(layout, 4, page, dtype) for _ in range(4)]
            spec = to.KVCacheSpec(caches, layout, groups=[[0, 2], [1, 3]] if grouped else None, host_format="fp8_e4m3")
            cfg = fp8_blocks.fp8_config(spec, spec.host_block_bytes(1))
            words = (0, fp8_blocks.fp8_word_bytes(spec)) if checked else (0,)
            out += [Fp8Variant(name, layout, d, grouped, cfg, w) for d in ("store", "load") for w in words]
    return out


def compile_fp8(v: Fp8Variant, arch: int = 90, kernel=None):
    """The compiled variant for ``arch``: the scalars int64 and unspecialised, the three data pointers 16-byte
    aligned (torch allocations), as a real launch binds them; without the checks their arguments None, as a launch
    passes them. ``kernel``: another version of the kernel function, without the checks' arguments (the golden copy
    of tests/unit/test_kernel_static_fp8.py)."""
    tok, dim, _, _, bf16, vec, warps = v.config
    fn = JITFunction(kernel or fp8_blocks._fp8_blocks_kernel, do_not_specialize=fp8_blocks._NOT_SPECIALIZED,
                     do_not_specialize_on_alignment=fp8_blocks._ALIGNMENT_NOT_SPECIALIZED)  # fmt: skip
    sig = {"anchor_ptr": _ELEM[bf16], "host_ptr": "*u8", "scale_ptr": "*fp32", "table_ptr": "*i64", "ids_ptr": "*i64"}
    sig |= {name: "i64" for name in fp8_blocks._NOT_SPECIALIZED if name not in CHECK_SCALARS}
    constexprs = {}
    if v.word:
        sig |= {name: "*i64" for name in CHECK_POINTERS} | {name: "i64" for name in CHECK_SCALARS}
    elif kernel is None:
        without_checks(sig, constexprs)
    constexprs |= {"STORE": v.direction == "store", "MULTI_GROUP": v.grouped, "TOK": tok, "DIM": dim, "BF16": bf16,
                   "VEC": vec}  # fmt: skip
    if kernel is None:
        constexprs |= {"INTEGRITY": bool(v.word), "W": v.word or 1}
    sig |= {name: "constexpr" for name in constexprs if name not in sig}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    source = ASTSource(fn, sig, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})


def measure_fp8(v: Fp8Variant, arch: int = 90, kernel=None) -> dict:
    """One variant's numbers: the copy loop is the innermost loop holding the wire-side accesses (a store's FP8
    writes, a load's FP8 reads; the shortest, for a load the integer path of ordinary bf16 heads) and no atomic (the
    checked variants' finalisation writes the checksums); a store's first pass (the head's amax) is the innermost
    loop with loads only; a load's other copy loop is its fp32 path; the item loop is the innermost loop around the
    copy loop (its barriers: the amax's reduction, and what the checks add per item)."""
    usage, text = sass.cubin_facts(compile_fp8(v, arch, kernel).asm["cubin"])
    code = sass.parse_sass(text)
    wire = "STG" if v.direction == "store" else "LDG"
    loops = sorted(sass._loops(code), key=lambda lp: lp[1] - lp[0])
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]

    def facts(lp):
        body = code[lp[0] : lp[1] + 1]
        widths = Counter(i.op for i in body if i.base in ("LDG", "STG"))
        wire_bytes = sum(16 for i in body if i.base == wire and i.op.endswith(".128"))
        return {"instructions": len(body), "accesses": dict(widths), "wire_bytes_per_thread": wire_bytes,
                "barriers": sum(1 for i in body if i.base in sass.BARRIERS),
                "atomics": sum(1 for i in body if i.base in sass.ATOMICS), "span": lp}  # fmt: skip

    loop_facts = [facts(lp) for lp in inner]
    moving = [f for f in loop_facts if not f["atomics"] and any(op.startswith(wire) for op in f["accesses"])]
    wire_loops = sorted(moving, key=lambda f: f["instructions"])
    # A load's copy loop: its integer path (every head but extreme bf16 ones, and no fp16 one); the fp32 path after.
    copy = wire_loops[0] if wire_loops else None
    fp32_path = wire_loops[1] if len(wire_loops) > 1 else None
    amax = next((f for f in loop_facts if f not in wire_loops and not f["atomics"]
                 and any(op.startswith("LDG") for op in f["accesses"])), None)  # fmt: skip
    around = [lp for lp in loops if copy and lp != copy["span"] and lp[0] <= copy["span"][0] <= lp[1]]
    item = facts(min(around, key=lambda lp: lp[1] - lp[0])) if around else None
    # Per 16 bytes of the cache's own 2-byte elements: the loop moves wire_bytes FP8 values, i.e. twice that of bf16.
    per16 = round(copy["instructions"] * 16 / (2 * copy["wire_bytes_per_thread"]), 2) if copy and copy[
        "wire_bytes_per_thread"] else None  # fmt: skip
    wire_ops = [op for op in (copy or {}).get("accesses", {}) if op.startswith(wire)]
    return {
        "variant": v.id, "arch": f"sm_{arch}", "triton": triton.__version__, **usage,
        "spill_stores": sum(1 for i in code if i.base == "STL"), "spill_loads": sum(1 for i in code if i.base == "LDL"),
        "ctas_per_sm": sass.ctas_per_sm(usage["registers"], v.config[-1], usage["shared_bytes"]),
        "wire_accesses": wire_ops, "loop": copy, "amax_loop": amax, "fp32_path_loop": fp32_path, "item_loop": item,
        "loop_instructions_per_16B_logical": per16,
    }  # fmt: skip


def fp8_report(arch: int = 90, print_fn=print) -> list[dict]:
    """Every FP8 variant on ``arch``, without and with the integrity checks, each beside the copy kernel's variant of
    its page, direction, groups and checks (its ``copy_loop_instructions_per_16B``), printed as a table; a checked
    variant's ``item_loop_barriers_added``: the barriers its loop over items has beyond the unchecked one's."""
    from bench.static.report import measure
    from bench.static.variants import variants

    copy = {v.id: v for v in variants(pages=FP8_PAGES) if v.mode in ("plain", "checked")}
    rows, plain_items = [], {}
    print_fn(f"{'variant':<56} {'warps':>5} {'regs':>4} {'spills':>6} {'wire':<12} {'loop/16B':>8} {'2nd/16B':>8} "
             f"{'+bar/item':>9} {'copy kernel':>11}")  # fmt: skip
    for v in fp8_variants(checked=True):
        row = measure_fp8(v, arch)
        twin = copy[f"{v.page}/{v.direction}/{'groups' if v.grouped else '1group'}/{'checked' if v.word else 'plain'}"]
        row["copy_loop_instructions_per_16B"] = (measure(twin, arch).get("loop") or {}).get("instructions_per_16B")
        wire = (row["loop"] or {}).get("wire_bytes_per_thread")
        second = row["amax_loop"] or row["fp32_path_loop"]  # a store's first pass, or a load's fp32 path
        amax16 = round(second["instructions"] * 8 / wire, 2) if second and wire else "-"
        row["second_loop_instructions_per_16B_logical"] = amax16
        bars = (row["item_loop"] or {}).get("barriers")
        key = v.id.split("/checked")[0]
        if not v.word:
            plain_items[key] = bars
        added = row["item_loop_barriers_added"] = bars - plain_items[key] if v.word and bars is not None else "-"
        print_fn(f"{v.id:<56} {v.config[-1]:>5} {row['registers']:>4} {row['spill_stores'] + row['spill_loads']:>6} "
                 f"{','.join(row['wire_accesses']):<12} {row['loop_instructions_per_16B_logical'] or '-':>8} "
                 f"{amax16:>8} {added:>9} {row['copy_loop_instructions_per_16B'] or '-':>11}")  # fmt: skip
        rows.append(row)
    return rows
