"""The FP8 host format (host_format="fp8_e4m3") on CPU under the Triton interpreter: the stored FP8 bytes and scales
against kernels/reference_fp8.py bit for bit, the restored values against it and within E4M3's bound, every layout,
the factor with skips, groups; 8-bit caches moved as bytes; what is refused, with nothing written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import triton_offload as to
from triton_offload.kernels.reference import gather_blocks_ref
from triton_offload.kernels.reference_fp8 import gather_fp8_ref, quantize_head, scatter_fp8_ref
from triton_offload.layouts import HostSlots

from kv_factory import SENTINEL, host_buffer, random_transfer, sentinel_like, snapshot, storage_bytes

FP8 = "fp8_e4m3"
SHAPES = {  # small (the interpreter is slow); head_dim not a power of two where it can find bugs
    "kv_first": lambda nb: (2, nb, 3, 2, 6),
    "block_first": lambda nb: (nb, 2, 3, 2, 8),
    "mla": lambda nb: (nb, 3, 10),
}


def make(layout: str, num_blocks: int, dtype: torch.dtype, seed: int, layers: int = 2) -> list[torch.Tensor]:
    """Caches of normal values whose magnitude varies per head by up to 2**+-12, with the format's edge cases: a head
    of zeros (with a -0.0), NaN, +-Inf, elements 2**-14 below their head's max (E4M3 subnormals after scaling), a
    head whose max is exactly 448 * 2**-3, an E4M3 tie, the dtype's largest value; bf16 heads of tiny and huge
    scales."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        shape = SHAPES[layout](num_blocks)
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        heads = x.unsqueeze(-2) if layout == "mla" else x  # (..., tokens, heads, head_dim)
        heads.mul_(2.0 ** torch.randint(-12, 13, heads.shape[:-3] + (1, heads.shape[-2], 1), generator=gen))
        first = heads.view(-1, *heads.shape[-3:])  # (blocks x halves, tokens, heads, head_dim)
        first[0, :, 0] = 0.0
        first[0, 1, 0, 0] = -0.0
        first[1, 0, 0, 1] = float("nan")
        first[1, 2, 0, 0], first[2, 1, 0, 2] = float("inf"), float("-inf")
        first[3, :, 0] *= 2.0**-14
        first[3, 0, 0, 0] = 3.0 * 2.0 ** float(torch.randint(-4, 4, ()))
        first[4, :, 0] = first[4, :, 0].clamp(-10, 10)
        first[4, 0, 0, 0] = 448.0 * 2.0**-3
        first[5, 1, 0, 1] = 1.0625 * first[5, :, 0].abs().max()  # a tie in a head scaled by a power of two
        if dtype is torch.bfloat16:  # heads at bf16's extremes: a load restores them on the fp32 path
            first[6, :, 0] = first[6, :, 0] * 2.0**-122  # scale 2**-124
            first[7, :, 0] = first[7, :, 0].clamp(-1, 1) * 3.0e38  # scale 2**120
        # The dtype's largest value rounds up to 2**16 (fp16) or 2**128 (bf16) in E4M3: restored, it is clamped.
        first[7, 0, 0, 0] = torch.finfo(dtype).max
        out.append(x.to(dtype))
    return out


def assert_same_values(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit for bit, except that NaN need only be NaN (its payload is not specified)."""
    nan = a.isnan()
    assert torch.equal(nan, b.isnan()), "NaN positions differ"
    assert torch.equal(torch.where(nan, 0, a).view(torch.int16), torch.where(nan, 0, b).view(torch.int16))


def round_trip(caches, layout, *, f, skip, n, num_ctas=None, seed=0):
    """Stores n random blocks and checks the host bytes against the reference (padding and unaddressed rows keep the
    sentinel), loads them into sentinel caches and checks the values against the reference's, within the bound, and
    that exactly the addressed blocks changed. Returns the spec."""
    rng = np.random.default_rng(seed)
    spec = to.KVCacheSpec(caches, layout, host_format=FP8)
    num_host = (skip + n) // f + 2
    g, h = random_transfer(rng, spec.num_blocks, num_host, n, f, skip)
    # The edge cases of make() live in blocks 0..5: every one of them moves, in a random order.
    g = rng.permutation(np.r_[0:6, np.setdiff1d(g, np.arange(6))[: n - 6]]) if n >= 6 else g
    before = snapshot(caches)
    host = host_buffer(spec, num_host, f)
    expected = host.clone()
    to.gather_blocks(spec, g, host, h, blocks_per_host_block=f, skip=skip, num_ctas=num_ctas)
    gather_fp8_ref(caches, layout, g, expected, h, blocks_per_host_block=f, skip=skip)
    assert torch.equal(host, expected), f"{int((host != expected).sum())} host bytes differ from the reference"
    assert bool((host[np.setdiff1d(np.arange(num_host), h)] == SENTINEL).all())
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(caches))), "a store changed its source"

    out, ref = [sentinel_like(t) for t in caches], [sentinel_like(t) for t in caches]
    to.scatter_blocks(host, h, out, g, layout=layout, blocks_per_host_block=f, skip=skip, host_format=FP8,
                      num_ctas=num_ctas)  # fmt: skip
    assert torch.equal(host, expected), "a load changed its source"
    scatter_fp8_ref(expected, h, ref, layout, g, blocks_per_host_block=f, skip=skip)
    for a, b in zip(out, ref):
        assert_same_values(a, b)
        assert torch.equal(storage_bytes(a) == SENTINEL, storage_bytes(b) == SENTINEL)
    check_bound(caches, out, layout, g)
    return spec


def check_bound(caches, out, layout, g):
    """E4M3 with a power-of-two scale s per head: a finite x restores as x' with |x' - x| <= 2**-4 |x| (a normal
    E4M3 value: 3 mantissa bits, half an ulp) or <= 2**-10 s (an E4M3 subnormal: half of 2**-9 s), plus fp16's own
    rounding in its subnormal range (2**-25); non-finite elements restore as NaN."""
    blocks = torch.as_tensor(np.asarray(g))
    for src, dst in zip(caches, out):
        x = (src[:, blocks] if layout == "kv_first" else src[blocks]).double()
        y = (dst[:, blocks] if layout == "kv_first" else dst[blocks]).double()
        finite = torch.isfinite(x)
        assert bool(y[~finite].isnan().all()), "NaN and Inf restore as NaN"
        heads = x.unsqueeze(-2) if layout == "mla" else x
        amax = torch.where(heads.isfinite(), heads.abs(), 0).amax(dim=(-3, -1), keepdim=True)
        scale = (amax / 448).clamp(min=2.0**-126) * 2  # an upper bound of each head's power-of-two scale
        scale = scale.squeeze(-2) if layout == "mla" else scale
        bound = 2.0**-4 * x.abs() + 2.0**-10 * scale.expand_as(x) + 2.0**-25
        err = (y - x).abs()
        assert bool((err[finite] <= bound[finite]).all()), f"worst excess {float((err - bound)[finite].max())}"


CASES = [
    pytest.param(layout, dtype, f, skip, id=f"{layout}-{name}-f{f}-skip{skip}")
    for layout in SHAPES
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16))
    for f, skip in ((1, 0), (3, 2))
]


@pytest.mark.parametrize("layout,dtype,f,skip", CASES)
def test_round_trip(layout, dtype, f, skip):
    caches = make(layout, 9, dtype, seed=f + skip)
    round_trip(caches, layout, f=f, skip=skip, n=7, seed=skip)


def test_more_items_than_programs_and_many_token_chunks():
    """A head of more tokens than one step holds (several token chunks, the last partial), few programs."""
    gen = torch.Generator().manual_seed(3)
    caches = [torch.randn(4, 2, 70, 1, 64, generator=gen).to(torch.bfloat16) for _ in range(2)]
    caches[0][1, 0, 69, 0, 3] = 100.0  # the head's max in its last chunk
    round_trip(caches, "block_first", f=2, skip=1, n=3, num_ctas=3)


def test_groups_with_their_own_skips_and_host_ids():
    """Two KV-cache groups of different heads: each block lands in its group's host block at its own skip, in
    sub-blocks of the largest group's FP8 bytes."""
    gen = torch.Generator().manual_seed(5)
    caches = [torch.randn(8, 2, 2, h, 8, generator=gen).to(torch.float16) for h in (2, 2, 1)]
    groups = [[0, 1], [2]]
    spec = to.KVCacheSpec(caches, "block_first", groups=groups, host_format=FP8)
    f = 2
    host = host_buffer(spec, 6, f)
    expected = host.clone()
    g0, h0, g1, h1 = [3, 5, 0], [4, 1], [7, 2], [2]
    to.gather_blocks(spec, g0 + g1, host, h0 + h1, blocks_per_host_block=f, skip=[1, 0], group_sizes=[3, 2])
    ref_groups = [(groups[0], g0, h0, 1), (groups[1], g1, h1, 0)]
    gather_fp8_ref(caches, "block_first", None, expected, None, blocks_per_host_block=f, groups=ref_groups)
    assert torch.equal(host, expected)
    out, ref = [sentinel_like(t) for t in caches], [sentinel_like(t) for t in caches]
    spec_out = to.KVCacheSpec(out, "block_first", groups=groups, host_format=FP8)
    to.scatter_blocks(host, h0 + h1, spec_out, g0 + g1, blocks_per_host_block=f, skip=[1, 0], group_sizes=[3, 2])
    scatter_fp8_ref(host, None, ref, "block_first", None, blocks_per_host_block=f, groups=ref_groups)
    for a, b in zip(out, ref):
        assert_same_values(a, b)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8])
def test_eight_bit_caches_move_as_bytes(dtype):
    """vLLM's kv_cache_dtype="fp8" caches: the format moves their bytes unchanged, in the native row size."""
    raw = torch.randint(0, 256, (2, 2, 7, 2, 2, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    caches = [raw[i].view(dtype) for i in range(2)]
    spec = to.KVCacheSpec(caches, "kv_first", host_format=FP8)
    assert spec.quant is None and spec.host_block_bytes(2) == to.KVCacheSpec(caches, "kv_first").host_block_bytes(2)
    host = host_buffer(spec, 4, 2)
    expected = host.clone()
    to.gather_blocks(spec, [6, 0, 3], host, [2, 0], blocks_per_host_block=2, skip=1)
    gather_blocks_ref(caches, "kv_first", [6, 0, 3], expected, [2, 0], blocks_per_host_block=2, skip=1)
    assert torch.equal(host, expected)


def test_row_size_and_placement():
    """A run's host bytes: its values padded to 16, then one fp32 scale per head padded to 16; vLLM's usual pages
    (16 tokens, 8 heads, head_dim 128 or 64, bf16) store in 0.501x and 0.504x of their bytes."""
    for head_dim, ratio in ((128, 16384 / (16384 + 32)), (64, 8192 / (8192 + 32))):
        caches = [torch.zeros(2, 2, 16, 8, head_dim, dtype=torch.bfloat16)]
        native = to.host_block_bytes(caches, "kv_first")
        fp8 = to.host_block_bytes(caches, "kv_first", host_format=FP8)
        assert fp8 == 2 * (16 * 8 * head_dim + 32) and native / fp8 == pytest.approx(2 * ratio)
    caches = [torch.zeros(3, 3, 10, dtype=torch.float16)]  # MLA: 30 values -> 32, one scale -> 16
    assert to.host_block_bytes(caches, "mla", 2, host_format=FP8) == 2 * 48


def test_hand_computed_codes():
    """E4M3 codes computed by hand, independent of torch's conversion: the max maps to 448 (0x7E) exactly, ties round
    to even, 2**-14 below the max is an E4M3 subnormal, NaN and Inf store 0x7F, -0.0 keeps its sign."""
    x = torch.tensor([448.0, 1.0625, 1.1875, -(2.0**-6) * 0.75, 448 * 2.0**-14, float("nan"), float("-inf"), -0.0])
    codes, scale = quantize_head(x.to(torch.bfloat16))
    assert scale == 1.0
    assert codes.tolist() == [0x7E, 0x38, 0x3A, 0x86, 0x0E, 0x7F, 0x7F, 0x80]
    caches = [x.to(torch.bfloat16).view(1, 1, 8).expand(2, 1, 8).contiguous()]
    spec = to.KVCacheSpec(caches, "mla", host_format=FP8)
    host = host_buffer(spec, 1, 1)
    to.gather_blocks(spec, [1], host, [0])
    assert host[0, :8].tolist() == codes.tolist() and host[0, 16:20].view(torch.float32).item() == 1.0
    assert bool((host[0, 8:16] == SENTINEL).all()), "padding is not written"


@pytest.mark.parametrize(
    "caches,layout,kwargs,match",
    [
        pytest.param([torch.zeros(2, 2, 2, 1, 4)], "kv_first", {}, "quantizes bf16 or fp16", id="fp32"),
        pytest.param([torch.zeros(2, 8, dtype=torch.int8)], "canonical", {}, "canonical", id="canonical"),
        pytest.param(
            [torch.zeros(2, 2, 2, 1, 4, dtype=torch.float16), torch.zeros(2, 2, 2, 1, 4, dtype=torch.bfloat16)],
            "kv_first",
            {},
            "one dtype",
            id="mixed-dtypes",
        ),
        pytest.param(
            [torch.zeros(2, 2, 4, 1, 2, dtype=torch.float16).transpose(-1, -3)],
            "kv_first",
            {},
            "contiguous",
            id="head-dim-strided",
        ),
        pytest.param(
            [torch.zeros(2, 2, 2, 1, 4, dtype=torch.float16)],
            "kv_first",
            {"host_slots": HostSlots((64,), (0,))},
            "host_slots",
            id="worker-slots",
        ),
    ],
)
def test_refused(caches, layout, kwargs, match):
    with pytest.raises(ValueError, match=match):
        to.KVCacheSpec(caches, layout, host_format=FP8, **kwargs)


def test_refused_calls_write_nothing():
    caches = [torch.ones(2, 4, 2, 1, 4, dtype=torch.float32)]
    host = torch.full((2, 64), SENTINEL, dtype=torch.uint8)
    with pytest.raises(ValueError, match="quantizes bf16 or fp16"):
        to.gather_blocks(caches, [0], host, [0], layout="kv_first", host_format=FP8)
    with pytest.raises(ValueError, match="unknown host_format 'fp4'"):
        to.gather_blocks(caches, [0], host, [0], layout="kv_first", host_format="fp4")
    spec = to.KVCacheSpec([c.half() for c in caches], "kv_first", host_format=FP8)
    with pytest.raises(ValueError, match="does not match the prepared spec"):
        to.gather_blocks(spec, [0], host, [0], host_format="native")
    with pytest.raises(ValueError, match="host_buffer must be"):  # a native-sized buffer for an FP8 spec
        to.gather_blocks(spec, [0], torch.full((2, 128), SENTINEL, dtype=torch.uint8), [0])
    assert bool((host == SENTINEL).all())


def test_engine_moves_the_format_through_the_kernel():
    """The transfer engine (CPU): auto takes the kernel, the only path that quantizes; a store and a load by job id
    give the reference's bytes and values; the copy engines are refused by name; with the integrity checks the store
    writes the same bytes, and a marker for each row it wrote (tests/unit/test_integrity_fp8.py checks the rest)."""
    from triton_offload.checksums import Checksums
    from triton_offload.engine import TransferEngine

    caches = make("block_first", 6, torch.bfloat16, seed=9, layers=1)
    spec = to.KVCacheSpec(caches, "block_first", host_format=FP8)
    host = host_buffer(spec, 3, 2)
    eng = TransferEngine(spec, host, blocks_per_host_block=2, path="auto", calibration=None)
    assert eng.path == "kernel"
    eng.submit_store(1, [4, 0, 2], [2, 0], skip=1)
    assert [r.ok for r in eng.get_finished()] == [True]
    expected = torch.full_like(host, SENTINEL)
    gather_fp8_ref(caches, "block_first", [4, 0, 2], expected, [2, 0], blocks_per_host_block=2, skip=1)
    assert torch.equal(host, expected)
    out = [sentinel_like(t) for t in caches]
    ref = [sentinel_like(t) for t in caches]
    load_eng = TransferEngine(to.KVCacheSpec(out, "block_first", host_format=FP8), host, blocks_per_host_block=2)
    load_eng.submit_load(2, [1, 5, 3], [2, 0], skip=1)
    assert [r.ok for r in load_eng.get_finished()] == [True]
    scatter_fp8_ref(host, [2, 0], ref, "block_first", [1, 5, 3], blocks_per_host_block=2, skip=1)
    assert_same_values(out[0], ref[0])
    with pytest.raises(ValueError, match="copy engines move bytes unchanged"):
        TransferEngine(spec, host, blocks_per_host_block=2, path="dma")
    checks = Checksums.allocate("verify", 3, 2, pin=False, regions=spec.num_regions)
    checked = torch.full_like(host, SENTINEL)
    eng = TransferEngine(spec, checked, blocks_per_host_block=2, checksums=checks)
    eng.submit_store(3, [4, 0, 2], [2, 0], skip=1)
    assert [r.ok for r in eng.get_finished()] == [True]
    assert torch.equal(checked, host), "the checks change no stored byte"
    assert checks.table[[2, 0], 0].tolist() == [checks.marker(4, 1)] * 2 and checks.table[1].tolist() == [0, 0, 0]


def test_heads_before_tokens_in_memory():
    """An engine storing a block's heads before its tokens: the values keep the run's memory order on the host, each
    head still scaled on its own."""
    gen = torch.Generator().manual_seed(11)
    base = [torch.randn(5, 2, 2, 3, 8, generator=gen).to(torch.bfloat16) for _ in range(2)]
    base[0][:, :, :, 1] *= 1000  # one head far larger than the other
    caches = [t.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4) for t in base]
    assert not caches[0].is_contiguous()
    round_trip(caches, "block_first", f=1, skip=0, n=3)


def test_host_regions_hold_each_group_in_its_own_compressed_bytes():
    """group_regions: a row holds f sub-blocks of each region's FP8 bytes, region after region; a host id names one
    key per region. Each region's bytes equal the reference's for its group alone."""
    gen = torch.Generator().manual_seed(13)
    caches = [torch.randn(6, 2, 2, h, 8, generator=gen).to(torch.bfloat16) for h in (2, 1)]
    spec = to.KVCacheSpec(caches, "block_first", groups=[[0], [1]], group_regions=[0, 1], host_format=FP8)
    f, sizes = 2, []
    for i in range(2):
        sizes.append(to.KVCacheSpec([caches[i]], "block_first", host_format=FP8).host_block_bytes(1))
    assert spec.host_block_bytes(f) == f * sum(sizes) == f * (2 * (32 + 16) + 2 * (16 + 16))
    host = host_buffer(spec, 3, f)
    g0, g1 = [5, 1, 2], [0, 4]
    to.gather_blocks(spec, g0 + g1, host, [2, 0, 2, 1], blocks_per_host_block=f, skip=[0, 1], group_sizes=[3, 2])
    start = 0
    for i, (g, h, skip) in enumerate(((g0, [2, 0], 0), (g1, [2, 1], 1))):
        want = torch.full((3, f * sizes[i]), SENTINEL, dtype=torch.uint8)
        gather_fp8_ref([caches[i]], "block_first", g, want, h, blocks_per_host_block=f, skip=skip)
        assert torch.equal(host[:, start : start + f * sizes[i]], want), f"region {i}"
        start += f * sizes[i]
    out = [sentinel_like(t) for t in caches]
    spec_out = to.KVCacheSpec(out, "block_first", groups=[[0], [1]], group_regions=[0, 1], host_format=FP8)
    to.scatter_blocks(host, [2, 0, 2, 1], spec_out, g0 + g1, blocks_per_host_block=f, skip=[0, 1], group_sizes=[3, 2])
    for i, g in enumerate((g0, g1)):
        ref = [sentinel_like(caches[i])]
        region = host[:, sum(f * s for s in sizes[:i]) :][:, : f * sizes[i]].contiguous()
        scatter_fp8_ref(region, [2, 0] if i == 0 else [2, 1], ref, "block_first", g, blocks_per_host_block=f,
                        skip=[0, 1][i])  # fmt: skip
        assert_same_values(out[i], ref[0])


def test_too_many_heads_for_one_launch_is_refused():
    """The kernel counts (block, run, head) items in 32 bits: a transfer of 2**31 or more is refused before launch."""
    from types import SimpleNamespace

    from triton_offload.kernels.fp8_blocks import fp8_arguments

    cfg = (16, 128, 1, 8, True, 16, 4)
    plan = SimpleNamespace(n_blocks=2**24, n_host=1, sizes=(1,), skips=(0,), direction="store")
    assert fp8_arguments(cfg, None, None, None, None, None, plan, 15, 1, 64, None)[0] == 16  # 2**31 - 2**27 items
    with pytest.raises(ValueError, match="too many heads"):
        fp8_arguments(cfg, None, None, None, None, None, plan, 16, 1, 64, None)
