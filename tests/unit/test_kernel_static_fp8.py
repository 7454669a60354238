"""The FP8 host format's kernel held to its compiled code without a GPU (bench/static/fp8.py): for every bf16 page of
the static report, in both directions, on sm_90 with this suite's Triton, it must not spill and its copy loop must
move the wire-side (host) bytes in 16-byte accesses, a store's without a barrier; without the integrity checks it is
the code of before them; with them it keeps its accesses and adds no barrier per item (where a head's row fits a
warp). Instruction counts are reported (``python -m bench.static --fp8``), gated loosely: the kernel is not yet
measured on a GPU."""

from __future__ import annotations

import dataclasses
import re

import pytest

pytest.importorskip("triton.backends.compiler")

from bench.static.compile import drop_unused_check_scalars  # noqa: E402
from bench.static.fp8 import compile_fp8, fp8_variants, measure_fp8  # noqa: E402
from triton_offload.kernels import fp8_blocks  # noqa: E402

ONE_GROUP = [v for v in fp8_variants() if not v.grouped]


@pytest.mark.parametrize("variant", ONE_GROUP, ids=lambda v: v.id)
def test_no_spill_and_16_byte_wire_accesses(variant):
    row = measure_fp8(variant, 90)
    assert row["spill_stores"] == row["spill_loads"] == row["stack_bytes"] == row["local_bytes"] == 0
    assert variant.config[5] == 16, "the page's offsets allow 16-byte accesses"
    wire = "STG.E.128" if variant.direction == "store" else "LDG.E.128"
    assert row["wire_accesses"] == [wire], row["loop"]
    assert row["loop"]["wire_bytes_per_thread"] >= 16  # one or more 16-byte accesses per thread and step
    if variant.direction == "store":
        assert row["loop"]["barriers"] == 0
        assert row["amax_loop"] is not None, "a store's first pass (the head's amax) is a loop of its own"
    else:  # the integer path of ordinary bf16 heads, and the fp32 path, each with 16-byte wire reads
        assert row["fp32_path_loop"]["accesses"].get(wire, 0) >= 1


def _code_only(ptx: str) -> str:
    """PTX without its debug information (source lines, file names, inlined-call scope labels): what runs."""
    ptx = ptx.split("\t.section\t.debug", 1)[0]
    return "\n".join(line for line in ptx.splitlines() if not re.match(r"\s*(\.(loc|file)\b|\$L__tmp\d+:)", line))


SAME_CODE = [v for v in fp8_variants() if v.page in ("llama3-8b.block_first", "small-page.kv_first")]


@pytest.mark.parametrize("variant", SAME_CODE, ids=lambda v: v.id)
def test_without_the_checks_the_kernel_is_the_same_code_as_before_them(variant):
    """INTEGRITY False and the checks' arguments NO_INTEGRITY: the compiled kernel is the one of the commit before the
    checks existed (tests/unit/golden_fp8_kernel.py), instruction for instruction; only the two typed check scalars
    stay in its parameter list, and nothing reads them."""
    import golden_fp8_kernel

    ours = compile_fp8(variant).asm["ptx"]
    assert "atom" not in ours
    first = 5 + len(fp8_blocks._NOT_SPECIALIZED) - 2  # the golden kernel's: 5 pointers and the scalars but two
    ours = drop_unused_check_scalars(_code_only(ours), "_fp8_blocks_kernel", first)
    assert ours == _code_only(compile_fp8(variant, kernel=golden_fp8_kernel._fp8_blocks_kernel).asm["ptx"])


CHECKED = [v for v in fp8_variants(checked=True) if v.word and not v.grouped]


@pytest.mark.parametrize("variant", CHECKED, ids=lambda v: v.id)
def test_with_the_checks_the_data_path_keeps_its_accesses_and_barriers(variant):
    """The checked variants: no spill, the same 16-byte wire accesses, no atomic in the copy loop (a program adds its
    sums once its block changes), at most 1.6x the unchecked copy loop's instructions, and no barrier added to the
    loop over items, except where a head's row spans two warps (MLA's 576-wide latent: DIM // VEC > 32, a known gap,
    docs/integrity.md)."""
    row = measure_fp8(variant, 90)
    plain = measure_fp8(dataclasses.replace(variant, word=0), 90)
    assert row["spill_stores"] == row["spill_loads"] == row["stack_bytes"] == row["local_bytes"] == 0
    assert row["wire_accesses"] == plain["wire_accesses"] and row["loop"]["atomics"] == 0
    assert row["loop_instructions_per_16B_logical"] <= 1.6 * plain["loop_instructions_per_16B_logical"]
    assert row["item_loop"]["atomics"] > 0, "the sums are added in the loop over items"
    wide = variant.config[1] // variant.config[5] > 32
    extra = row["item_loop"]["barriers"] - plain["item_loop"]["barriers"]
    assert extra == 0 or wide and extra <= 4, (row["item_loop"], plain["item_loop"])
    if variant.direction == "store":
        assert row["loop"]["barriers"] == 0
