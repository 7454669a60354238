"""The FP8 host format's kernel held to its compiled code without a GPU (bench/static/fp8.py): for every bf16 page of
the static report, in both directions, on sm_90 with this suite's Triton, it must not spill and its copy loop must
move the wire-side (host) bytes in 16-byte accesses, a store's without a barrier. Instruction counts are reported
(``python -m bench.static --fp8``), not gated: the kernel is not yet measured on a GPU."""

from __future__ import annotations

import pytest

pytest.importorskip("triton.backends.compiler")

from bench.static.fp8 import fp8_variants, measure_fp8  # noqa: E402

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
