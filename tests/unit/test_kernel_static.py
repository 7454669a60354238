"""The copy kernel held to its compiled code without a GPU (bench/static, docs/compiler.md): every gated variant
(16-byte pages, sm_90, this suite's Triton) is lowered to SASS and checked against bench/static/budget.json: without
the checks it must not spill and must move its data in 16-byte accesses; its loops may not grow beyond their
instructions per 16 bytes, nor gain a barrier in either loop; with the checks, no spill and a copy loop and a tile loop
of at most twice the plain ones' instructions per 16 bytes; its PTX atomics must keep their semantics. Each gate is
shown to fail on a mutation of the kernel: work added to the copy loop or the checks, a spill, a barrier back in the
tile loop, a relaxed programs-done or shared-block counter."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import textwrap

import pytest

pytest.importorskip("triton.backends.compiler")

from bench.static import budget, report  # noqa: E402
from bench.static.variants import variants  # noqa: E402
from triton_offload.kernels import copy_blocks, integrity_parts  # noqa: E402

BUDGET = json.loads(budget.BUDGET_PATH.read_text())
GATED = [v for v in variants() if budget.gated(v)]


def test_every_gated_variant_has_a_budget():
    assert {v.id for v in GATED} == set(BUDGET["variants"]), "regenerate bench/static/budget.json (budget.make)"


@functools.cache
def _measured(variant):
    """A gated variant's numbers on sm_90, measured once per session: its own budget test and, for a plain variant,
    the checked ones that compare with it."""
    return report.measure(variant, 90)


def _plain(variant):
    """The same page, direction and groups without the checks (``None`` for a plain variant)."""
    if variant.mode == "plain":
        return None
    return _measured(next(v for v in GATED if v.id == variant.id.rsplit("/", 1)[0] + "/plain"))


@pytest.mark.parametrize("variant", GATED, ids=lambda v: v.id)
def test_the_compiled_kernel_keeps_its_budget(variant):
    row = _measured(variant)
    assert budget.problems(row, BUDGET["variants"][variant.id], _plain(variant)) == []


def _replaced(source: str, replacements: list[tuple[str, str]]) -> str:
    for old, new in replacements:
        assert source.count(old) == 1, f"the kernel's source changed: update the mutation ({old!r})"
        source = source.replace(old, new)
    return source


def _mutated(tmp_path, replacements: list[tuple[str, str]], helpers: dict | None = None):
    """The kernel with ``replacements`` made in its source (each must match once), as a function to compile; with
    ``helpers``, also these helpers of kernels/integrity_parts.py (by name, each with its replacements; a helper
    that calls a mutated one is named too, with none, so that it calls the mutation)."""
    source = _replaced(textwrap.dedent(inspect.getsource(copy_blocks._copy_blocks_kernel)), replacements)
    path = tmp_path / "mutated_kernel.py"
    header = (
        "from triton_offload.kernels.copy_blocks import *  # noqa\n"
        "from triton_offload.kernels.copy_blocks import tl, triton, _SUM, FIN  # noqa\n"
        "from triton_offload.kernels.copy_blocks import _lane_step, _finish_program  # noqa\n"
        "from triton_offload.kernels.copy_blocks import _index_terms, _next_step  # noqa\n"
        "from triton_offload.kernels.integrity_parts import _finalize_checksums, _last_to_add, JITFunction  # noqa\n"
    )
    for name, changes in (helpers or {}).items():
        fn = getattr(integrity_parts, f"{name}_fn")
        header += _replaced(inspect.getsource(fn), changes) + f"\n{name} = JITFunction({name}_fn)\n"
    path.write_text(header + source)
    spec = importlib.util.spec_from_file_location("mutated_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._copy_blocks_kernel


def _problems(tmp_path, variant_id: str, replacements, helpers: dict | None = None) -> list[str]:
    variant = next(v for v in GATED if v.id == variant_id)
    kernel = _mutated(tmp_path, replacements, helpers)
    return budget.problems(report.measure(variant, 90, kernel=kernel), BUDGET["variants"][variant_id], _plain(variant))


_STORE = "tl.store(host_ptr + host_off[:, None] + col[None, :], vals, mask=mask)"


def test_work_added_to_the_copy_loop_breaks_its_budget(tmp_path):
    """Six integer operations per word moved, in the loop that moves them (a stand-in for a costlier checksum)."""
    indent = "\n" + " " * 20  # the stores' loop body
    busy = indent.join(["vals = vals * 3 + 1", "vals = vals * 5 + 7", "vals = vals * 9 + 3", ""])
    found = _problems(tmp_path, "llama3-8b.kv_first/store/1group/plain", [(_STORE, busy + _STORE)])
    assert any("loop instructions per 16 B" in p for p in found), found


def test_a_spill_breaks_the_default_path(tmp_path):
    """The row indices back in 64 bits (the kernel before issue 58): 2 KiB pages spill again."""
    wide = [
        ("pid = tl.program_id(0)\n", "pid = tl.program_id(0).to(tl.int64)\n"),
        ("rows = tl.arange(0, ROWS)\n", "rows = tl.arange(0, ROWS).to(tl.int64)\n"),
        ("n_segs32 = n_segs.to(tl.int32)", "n_segs32 = n_segs"),
        ("f32 = blocks_per_host_block.to(tl.int32)", "f32 = blocks_per_host_block"),
        ("n_items = (n_blocks * n_segs).to(tl.int32)", "n_items = n_blocks * n_segs"),
        ("tile = (pid + i * nprog).to(tl.int32)", "tile = pid + i * nprog"),
        ("pos = blk + skip.to(tl.int32)", "pos = blk + skip"),
        ("seg_len = tl.multiple_of(seg_len.to(tl.int32), VEC)", "seg_len = tl.multiple_of(seg_len, VEC)"),
    ]
    found = _problems(tmp_path, "small-page.kv_first/load/1group/plain", wide)
    assert any("spills" in p for p in found), found


_DONE = 'done = tl.atomic_add(sums_ptr + 3 * n_blocks, 1, sem="acq_rel", scope="gpu")'
_BLOCK = 'before = tl.atomic_add(counts_ptr + blk, 1, sem="acq_rel", scope="gpu")'


@pytest.mark.parametrize(
    "variant_id,helpers",
    [
        (
            "small-page.kv_first/load/1group/checked",
            {"_finish_program": [(_DONE, _DONE.replace("acq_rel", "relaxed"))]},
        ),
        (
            "small-page.kv_first/store/1group/checked",
            {"_last_to_add": [(_BLOCK, _BLOCK.replace("acq_rel", "relaxed"))], "_finish_program": []},
        ),
    ],
    ids=["programs-done", "shared-block"],
)
def test_a_relaxed_counter_breaks_the_atomics(tmp_path, variant_id, helpers):
    """The load's programs-done counter, or a shared block's counter, relaxed: the PTX atomics' semantics differ."""
    found = _problems(tmp_path, variant_id, [], helpers)
    assert any("PTX atomics" in p and "relaxed" in p for p in found), found


def _kernel_lines(first: str, last: str) -> tuple[str, str]:
    """The kernel's (dedented) source from the line starting with ``first`` to the one starting with ``last``, and
    their indentation."""
    lines = textwrap.dedent(inspect.getsource(copy_blocks._copy_blocks_kernel)).splitlines()
    i = next(k for k, line in enumerate(lines) if line.strip().startswith(first))
    j = next(k for k in range(i, len(lines)) if lines[k].strip().startswith(last))
    return "\n".join(lines[i : j + 1]), lines[i][: len(lines[i]) - len(lines[i].lstrip())]


def test_a_barrier_back_in_the_tile_loop_breaks_the_checks_budget(tmp_path):
    """The partial sums added from the rows' [ROWS] layout (the kernel before issue 59's fix): the compiler moves them
    into another layout through shared memory, with barriers in every tile."""
    old, pad = _kernel_lines("grp = tl.arange(0, CHUNK // VEC)[None, :]", "tl.atomic_add(sums_ptr + odd, part_b")
    one_d = (f'{pad}tl.atomic_add(sums_ptr + 2 * blk, part_a, mask=live, sem="relaxed", scope="gpu")\n'
             f'{pad}tl.atomic_add(sums_ptr + 2 * blk + 1, part_b, mask=live, sem="relaxed", scope="gpu")')  # fmt: skip
    found = _problems(tmp_path, "llama3-8b.kv_first/store/1group/checked", [(old, one_d)])
    assert any("barriers in the tile loop" in p for p in found), found


def test_work_added_to_the_checks_breaks_twice_the_plain_tile(tmp_path):
    """The checked tile loop is held to twice the plain one's instructions per 16 bytes (the budget itself was made
    from the kernel as it is): six xor-shifts per word before the checksum's step break it."""
    changes = []
    for vals in ("vals_a", "vals_b"):  # a checked load's two steps a trip
        old, pad = _kernel_lines(f"step_a, step_b = _lane_step({vals},", "step_a, step_b = _lane_step(")
        changes.append((old, "".join(f"{pad}{vals} = {vals} ^ ({vals} >> {k})\n" for k in (3, 5, 7, 11, 13, 17)) + old))
    found = _problems(tmp_path, "deepseek-v3-mla.mla/load/1group/checked", changes)
    assert any("x plain" in p for p in found), found


def test_work_added_to_the_checks_breaks_twice_the_plain_copy_loop(tmp_path):
    """The checked copy loop is held to twice the plain one's instructions per 16 bytes (issue 59): a lane term xored
    with a constant on the 8B model's pages (the shortest plain loop: 11.12 per 16 B, the checked 21.75; mutated 24.75)
    breaks it, within the slack of the loop's own budget, which alone would let it pass."""
    old, pad = _kernel_lines("step_a, step_b = _lane_step(vals,", "step_a, step_b = _lane_step(")  # the stores' loop
    busy = f"{old}\n{pad}step_b = step_b ^ 0x5555"
    found = _problems(tmp_path, "llama3-8b.kv_first/store/1group/checked", [(old, busy)])
    assert any("copy loop" in p and "x plain" in p for p in found), found
    assert not any("loop instructions per 16 B" in p for p in found), found


@pytest.mark.parametrize("variant_id", ["page-6B/store/1group/plain", "canonical-13B/load/1group/plain"])
def test_narrow_pages_do_not_spill(variant_id):
    """Pages of 2- and 1-byte words: a tile of at most one row per thread and tile / 4 elements (kernels/shapes.py);
    with 8192 rows a tile they spilled 2.5-3.7 KiB per thread."""
    variant = next(v for v in variants() if v.id == variant_id)
    row = report.measure(variant, 90)
    assert (row["stack_bytes"], row["spill_stores"], row["spill_loads"]) == (0, 0, 0), row["config"]
    assert row["config"]["rows"] <= 32 * row["config"]["num_warps"]
