"""The CUDA path compiles for Hopper without a GPU, with the access widths the launcher promises.

Triton lowers to PTX on any machine, so this checks what the interpreter cannot: that the kernel type-checks in
compiled mode for every launch shape the launcher picks, and that aligned pages get 16-byte loads and stores.
"""

from __future__ import annotations

import re

import pytest
import torch

import triton_offload as to

# bench/static/compile.py lowers through Triton's AOT entry points (ASTSource, GPUTarget), in every supported Triton.
from bench.static import compile as static_compile
from triton_offload.kernels import copy_blocks, shapes, tables
from triton_offload.plan import Direction

from kv_factory import host_buffer, make_caches

_SCALARS = copy_blocks._NOT_SPECIALIZED  # the launch's runtime scalars, in signature order


def compile_ptx(
    cfg: shapes.LaunchConfig, store: bool, grouped: bool, integrity: bool = False, copy=True, kernel=None
) -> str:
    """The kernel lowered to sm_90 PTX as a launch compiles it (bench/static/compile.py builds the signature from
    what the launch passes); ``kernel``: another version of it (same arguments, without the checks')."""
    return static_compile.compile_variant(cfg, store, grouped, integrity, copy, kernel=kernel).asm["ptx"]


# (id, layout, page, dtype, expected access width in bytes)
SHAPES = [
    ("llama3-8b-64KiB", "block_first", dict(block_size=16, heads=8, head_dim=128), torch.bfloat16, 16),
    ("small-2KiB", "kv_first", dict(block_size=8, heads=1, head_dim=64), torch.bfloat16, 16),
    ("mla-72KiB", "mla", dict(block_size=64, latent=576), torch.bfloat16, 16),
    ("page-20B", "mla", dict(block_size=2, latent=5), torch.float16, 4),
    ("page-6B", "mla", dict(block_size=1, latent=3), torch.float16, 2),
    ("canonical-13B", "canonical", dict(page_bytes=13, pad=3), torch.int8, 1),
]


@pytest.mark.parametrize("grouped", [False, True], ids=["1group", "groups"])
@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("layout,page,dtype,width", [pytest.param(*s[1:], id=s[0]) for s in SHAPES])
def test_compiles_for_hopper_with_expected_access_width(layout, page, dtype, width, store, grouped):
    caches = make_caches(layout, 2, 4, page, dtype)
    spec = to.KVCacheSpec(caches, layout)
    host = host_buffer(spec, 2, 1)
    assert tables.access_width(spec, host) == width
    tuning = shapes.DEFAULT_TUNINGS[Direction.STORE if store else Direction.LOAD]
    cfg = shapes.launch_config(spec, width, tuning)
    assert cfg.elem * cfg.vec == width
    # A tile holds as many elements as 4-byte words fill the tuning's bytes, in at most one row per thread (narrow
    # pages: more spilled kilobytes per thread).
    threads = 32 * cfg.num_warps
    assert cfg.rows * cfg.chunk <= tuning.tile_bytes // 4 and cfg.rows <= threads
    if width == 16:
        assert cfg.rows * cfg.chunk * cfg.elem == tuning.tile_bytes
    ptx = compile_ptx(cfg, store, grouped)
    data_ld = re.findall(r"ld\.global(?:\.[a-z]+)*(?:\.v(\d))?\.b(\d+)", ptx)
    data_st = re.findall(r"st\.global(?:\.[a-z]+)*(?:\.v(\d))?\.b(\d+)", ptx)
    widest = lambda found: max(int(v or 1) * int(b) // 8 for v, b in found)  # noqa: E731
    # Stores only move data, so their widest access is the data path's; loads also read the 8-byte ids and table.
    assert widest(data_st) == width, data_st
    assert widest(data_ld) == max(width, 8), data_ld
    if width == 16:
        assert len(re.findall(r"ld\.global(?:\.[a-z]+)*\.v4\.b32", ptx)) >= 1
        # Every data load is 16 bytes: ROWS*CHUNK elements over the program's threads, 4 per access.
        assert len(re.findall(r"st\.global(?:\.[a-z]+)*\.v4\.b32", ptx)) == cfg.rows * cfg.chunk // (4 * threads)


@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("layout,page,dtype", [pytest.param(*s[1:4], id=s[0]) for s in SHAPES[:3]])
def test_real_pages_split_into_whole_chunks(layout, page, dtype, store):
    """Every step of a real model's page moves a full chunk: no step runs partly masked (the 72 KiB MLA page once
    took 3 steps of 32 KiB, the last a quarter full)."""
    spec = to.KVCacheSpec(make_caches(layout, 2, 4, page, dtype), layout)
    tuning = shapes.DEFAULT_TUNINGS[Direction.STORE if store else Direction.LOAD]
    cfg = shapes.launch_config(spec, tables.access_width(spec, host_buffer(spec, 2, 1)), tuning)
    assert cfg.n_chunks * cfg.chunk * cfg.elem == spec.max_segment_bytes, cfg
    assert cfg.rows * cfg.chunk * cfg.elem == tuning.tile_bytes


def _code_only(ptx: str) -> str:
    """PTX without its debug information (source lines, file names): what runs."""
    ptx = ptx.split("\t.section\t.debug", 1)[0]
    return "\n".join(line for line in ptx.splitlines() if not re.match(r"\s*\.(loc|file)\b", line))


@pytest.mark.parametrize("grouped", [False, True], ids=["1group", "groups"])
@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("layout,page,dtype", [pytest.param(*s[1:4], id=s[0]) for s in SHAPES[:3]])
def test_without_the_integrity_checks_the_kernel_is_the_same_code_as_before_them(layout, page, dtype, store, grouped):
    """Without the checks (NO_INTEGRITY, INTEGRITY False) Triton drops their pointers, and the compiled kernel is the
    one of the commit before the checks existed (tests/unit/golden_copy_kernel.py), instruction for instruction; only
    the two typed scalars stay in its parameter list, and nothing reads them."""
    import golden_copy_kernel

    spec = to.KVCacheSpec(make_caches(layout, 2, 4, page, dtype), layout)
    tuning = shapes.DEFAULT_TUNINGS[Direction.STORE if store else Direction.LOAD]
    cfg = shapes.launch_config(spec, tables.access_width(spec, host_buffer(spec, 2, 1)), tuning)
    ours = compile_ptx(cfg, store, grouped)
    before = compile_ptx(cfg, store, grouped, kernel=golden_copy_kernel._copy_blocks_kernel)
    assert "atom" not in ours
    # The golden kernel's parameters: the 4 pointers and the scalars but the checks' two.
    ours = static_compile.drop_unused_check_scalars(_code_only(ours), "_copy_blocks_kernel", 4 + len(_SCALARS) - 2)
    assert ours == _code_only(before)


@pytest.mark.parametrize("copy", [True, False], ids=["fused", "checksum-only"])
@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("layout,page,dtype", [pytest.param(*s[1:4], id=s[0]) for s in SHAPES[:2]])
def test_with_the_integrity_checks_the_data_path_keeps_its_access_width(layout, page, dtype, store, copy):
    """The checked kernel still moves 16-byte words, sums with integer atomics, and the checksum-only launch (the
    copy-engine path's check) writes no data."""
    spec = to.KVCacheSpec(make_caches(layout, 2, 4, page, dtype), layout)
    tuning = shapes.DEFAULT_TUNINGS[Direction.STORE if store else Direction.LOAD]
    cfg = shapes.launch_config(spec, tables.access_width(spec, host_buffer(spec, 2, 1)), tuning)
    ptx = compile_ptx(cfg, store, False, integrity=True, copy=copy)
    assert len(re.findall(r"ld\.global(?:\.[a-z]+)*\.v4\.b32", ptx)) >= 1
    assert re.search(r"atom\.global(?:\.[a-z_]+)*\.add\.[us]64", ptx)
    wide_stores = len(re.findall(r"st\.global(?:\.[a-z]+)*\.v4\.b32", ptx))
    steps = 1 if store else 2  # a checked load's loop moves two steps a trip (each read a step ahead)
    assert wide_stores == (steps * cfg.rows * cfg.chunk // (4 * 32 * cfg.num_warps) if copy else 0)
