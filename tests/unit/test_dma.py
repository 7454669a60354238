"""The copy-engine path (triton_offload/issuers/dma.py): descriptors built from the spec's segments, coalesced where
blocks are adjacent on both sides, never across host blocks; on CPU replayed by a memmove stand-in for the driver, so
the bytes they address are checked like the kernel's. And the engine's ``path`` choice (``kernel`` / ``dma`` /
``auto``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import triton_offload as to
from triton_offload.engine import TransferEngine
from triton_offload.issuers.dma import DmaIssuer, DmaPlanner
from triton_offload.kernels.reference import gather_blocks_ref, scatter_blocks_ref
from triton_offload.layouts import HostSlots
from triton_offload.path_choice import Calibration, PathModel
from triton_offload.plan import Direction, TransferPlanner

from kv_factory import SENTINEL, host_buffer, make_caches

PAGES = {
    "kv_first": dict(block_size=2, heads=2, head_dim=4),
    "block_first": dict(block_size=2, heads=2, head_dim=4),
    "mla": dict(block_size=2, latent=6),
}
IDS = {
    "random": lambda n, rng: rng.permutation(16)[:n],
    "contiguous": lambda n, rng: np.arange(3, 3 + n),
    "reversed": lambda n, rng: np.arange(3 + n, 3, -1) - 1,
}


def _spec(kind: str):
    """(caches, spec, layout name, reference kwargs) of a test spec."""
    if kind in PAGES:
        caches = make_caches(kind, 3, 16, PAGES[kind], torch.bfloat16, seed=3)
        return caches, to.KVCacheSpec(caches, kind), kind, {}
    # vLLM's canonical views: three tensors, HMA groups, worker slots (pad: padded pages cannot coalesce).
    pad = 8 if kind == "slots-padded" else 0
    caches = make_caches("canonical", 3, 16, dict(page_bytes=32, pad=pad), torch.int8, seed=4)
    groups = [[0, 1], [2]] if kind != "slots" else None
    slots = HostSlots((32 + pad,) * 3, (0, 1, 2)) if kind.startswith("slots") else None
    regions = (0, 1) if kind == "group-regions" else None  # unequal groups (64, 32 bytes), a region each
    spec = to.KVCacheSpec(caches, "canonical", groups=groups, host_slots=slots, group_regions=regions)
    ref = dict(groups=spec.groups if groups else None, host_slots=slots, group_regions=regions)
    return caches, spec, "canonical", ref


def _round_trip(kind, f, skip, ids_kind, coalesce=True):
    caches, spec, layout, ref_kw = _spec(kind)
    rng = np.random.default_rng(f * 10 + skip)
    n = 5
    grouped = spec.num_groups > 1
    sizes = [3, 2] if grouped else [n]
    skips = [skip, 0] if grouped else skip
    m = sum(math.ceil(((skip if i == 0 else 0) + k) / f) for i, k in enumerate(sizes))
    rows = m + 3
    g = np.asarray(IDS[ids_kind](n, rng), dtype=np.int64)
    h = np.arange(1, 1 + m, dtype=np.int64) if ids_kind != "random" else rng.permutation(rows)[:m]
    kw = dict(skip=skips, group_sizes=sizes if grouped else None)
    ref = dict(blocks_per_host_block=f, skip=skips, group_sizes=sizes if grouped else None, **ref_kw)
    host = host_buffer(spec, rows, f)
    planner = TransferPlanner(spec, rows, f)
    copier = DmaIssuer(spec, host, f, coalesce=coalesce)
    plan = planner.plan(g, h, direction=Direction.STORE, **kw)
    call = copier.issue(plan)
    want = torch.full_like(host, SENTINEL)
    gather_blocks_ref(caches, layout, g, want, h, **ref)
    assert torch.equal(host, want), "store"
    assert call.count == copier.copies(plan)
    # A load into other blocks: only they change.
    dst = np.setdiff1d(np.arange(16), g)[:n]
    before = [c.clone() for c in caches]
    copier.issue(planner.plan(dst, h, direction=Direction.LOAD, **kw))
    got = [c.clone() for c in caches]
    for c, b in zip(caches, before):
        c.copy_(b)
    scatter_blocks_ref(host, h, caches, layout, dst, **ref)
    for a, b in zip(got, caches):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "load"
    return spec, plan, copier, host


@pytest.mark.parametrize("ids_kind", sorted(IDS))
@pytest.mark.parametrize("f,skip", [(1, 0), (2, 1), (4, 3)], ids=lambda v: str(v))
@pytest.mark.parametrize("kind", ["kv_first", "block_first", "mla", "groups", "group-regions", "slots", "slots-padded"])
def test_descriptors_move_exactly_the_reference_bytes(kind, f, skip, ids_kind):
    _round_trip(kind, f, skip, ids_kind)


def test_block_first_merges_k_and_v_into_one_run_per_layer():
    _, spec, _, _ = _spec("block_first")
    planner = DmaPlanner(spec, torch.empty(4, spec.host_block_bytes(1), dtype=torch.uint8), 1)
    assert [len(r) for r in planner.groups] == [3]  # 3 layers, K and V adjacent on both sides
    _, kv_first, _, _ = _spec("kv_first")
    planner = DmaPlanner(kv_first, torch.empty(4, kv_first.host_block_bytes(1), dtype=torch.uint8), 1)
    assert [len(r) for r in planner.groups] == [6]


@pytest.mark.parametrize(
    "ids_kind,f,skip,expect",
    [
        # Worker slots of unpadded pages: a stretch of consecutive GPU blocks in one host block is one copy per
        # tensor, and no copy spans two host blocks.
        ("contiguous", 4, 0, 3 * 2),  # 5 blocks over host rows [0..3], [4]: two stretches per tensor
        ("contiguous", 4, 3, 3 * 2),  # rows [3], [0..3]
        ("contiguous", 1, 0, 3 * 5),  # one block per host block: nothing to merge
        ("reversed", 4, 0, 3 * 5),  # descending GPU ids are not adjacent
        ("random", 4, 0, None),
    ],
)
def test_worker_slots_coalesce_within_a_host_block(ids_kind, f, skip, expect):
    spec, plan, copier, host = _round_trip("slots", f, skip, ids_kind)
    src, dst, sizes = copier.planner.descriptors(plan)
    if expect is not None:
        assert src.size == expect
    row = host.stride(0)
    base = host.data_ptr()
    first_row = (dst.astype(np.int64) - base) // row
    last_row = (dst.astype(np.int64) + sizes.astype(np.int64) - 1 - base) // row
    assert np.array_equal(first_row, last_row), "a copy spans two host blocks (two CUDA registrations)"
    assert int(sizes.sum()) == plan.num_bytes


def test_padded_pages_never_coalesce():
    """A padded page's blocks are not adjacent on the GPU: one copy per block and tensor, however contiguous the ids
    (groups of 3 blocks over tensors 0 and 1, and of 2 blocks over tensor 2)."""
    _, plan, copier, _ = _round_trip("slots-padded", 4, 0, "contiguous")
    assert copier.copies(plan) == 3 * 2 + 2 * 1


@pytest.mark.parametrize("kind", ["slots", "groups", "block_first"])
def test_uncoalesced_descriptors_are_one_per_block_and_run(kind):
    """coalesce=False (a caller that never merges, as vLLM's worker builds them): one copy per block and run, the
    same bytes moved (the round trip checks them against the reference)."""
    spec, plan, copier, _ = _round_trip(kind, 4, 0, "contiguous", coalesce=False)
    runs = [len(r) for r in copier.planner.groups]
    assert copier.copies(plan) == sum(k * n for k, n in zip(plan.sizes, runs))
    src, _, sizes = copier.planner.descriptors(plan)
    assert src.size == copier.copies(plan) and int(sizes.sum()) == plan.num_bytes


# ---------------------------------------------------------------------------------------------------------------
# The engine's path
# ---------------------------------------------------------------------------------------------------------------


def _engine(make_host_cache, f=2, **kw):
    caches, spec, _, _ = _spec("kv_first")
    cache = make_host_cache(spec.host_block_bytes(f), 8 * spec.host_block_bytes(f), pin=False)
    cache.buffer.fill_(SENTINEL)
    return caches, spec, cache, TransferEngine(spec, cache.buffer, blocks_per_host_block=f, **kw)


def test_engine_dma_path_round_trips_and_reports_its_path(make_host_cache):
    caches, spec, cache, eng = _engine(make_host_cache, path="dma")
    eng.submit_store(1, [4, 9, 2], [5, 1], skip=1)
    (res,) = eng.get_finished()
    assert res.ok and res.path == "dma" and res.num_bytes == 3 * spec.bytes_per_block
    want = torch.full_like(cache.buffer, SENTINEL)
    gather_blocks_ref(caches, "kv_first", [4, 9, 2], want, [5, 1], blocks_per_host_block=2, skip=1)
    assert torch.equal(cache.buffer, want)
    eng.submit_load(2, [0, 1, 3], [5, 1], skip=1)
    assert eng.get_finished()[0].path == "dma"
    for c in caches:
        assert torch.equal(c[:, [0, 1, 3]].view(torch.uint8), c[:, [4, 9, 2]].view(torch.uint8))


def _calibration(dma_per_byte: float) -> Calibration:
    """The kernel: 10 us + 1 ns/B; the copy engines: 1 us per descriptor of host time, ``dma_per_byte`` on the GPU."""
    kernel = PathModel(10e-6, 1e-9, 0.0, 5e-6, 0.0)
    dma = PathModel(5e-6, dma_per_byte, 0.0, 2e-6, 1e-6)
    return Calibration({f"{p}/{d}": m for p, m in (("kernel", kernel), ("dma", dma)) for d in ("store", "load")})


def test_engine_auto_takes_the_path_the_calibration_predicts_faster(make_host_cache):
    # The copy engines: half the kernel's fixed GPU time, but 1 us of host time per descriptor (3 layers x 2 runs: 6
    # per block); a call costs host + GPU time. One block (192 B): kernel 5 + 10.2 us, copy engines 8 + 5.1 us; eight
    # blocks (48 descriptors): kernel 5 + 11.5 us, copy engines 50 + 5.8 us.
    caches, spec, cache, eng = _engine(make_host_cache, f=1, path="auto", calibration=_calibration(0.5e-9))
    eng.submit_store(1, [4], [0])
    eng.submit_store(2, list(range(8)), list(range(8)))
    assert {r.job_id: r.path for r in eng.get_finished()} == {1: "dma", 2: "kernel"}
    want = torch.full_like(cache.buffer, SENTINEL)
    gather_blocks_ref(caches, "kv_first", list(range(8)), want, list(range(8)))
    assert torch.equal(cache.buffer, want)
    # Always the kernel when the copy engines are never faster on the GPU.
    _, _, _, slow = _engine(make_host_cache, f=1, path="auto", calibration=_calibration(2e-9))
    slow.submit_store(1, list(range(8)), list(range(8)))
    assert slow.get_finished()[0].path == "kernel"


def test_engine_auto_reports_what_each_path_was_predicted_to_cost(make_host_cache):
    """Each auto job says which path it took and what both were predicted to cost (the chosen one the lower); the
    engine sums them per direction and path, next to the measured seconds, so a GPU run shows whether the choice was
    right. A forced path predicts nothing."""
    cal = _calibration(0.5e-9)
    _, spec, _, eng = _engine(make_host_cache, f=1, path="auto", calibration=cal)
    eng.submit_store(1, [4], [0])
    eng.submit_load(2, list(range(8)), list(range(8)))
    one, eight = eng.get_finished()
    for res, n, descriptors in ((one, 1, 6), (eight, 8, 48)):
        nbytes = n * spec.bytes_per_block
        want = {
            p: cal.models[f"{p}/{res.direction}"].predict(nbytes, d) for p, d in (("kernel", 0), ("dma", descriptors))
        }
        assert res.predicted == pytest.approx(want) and res.path == min(want, key=want.get)
    assert (one.path, eight.path) == ("dma", "kernel")
    totals = eng.path_totals()
    assert totals["store"]["dma"]["jobs"] == 1 and totals["load"]["kernel"]["jobs"] == 1
    assert totals["store"]["dma"]["predicted_seconds"] == pytest.approx(one.predicted["dma"])
    assert totals["load"]["kernel"]["seconds"] == pytest.approx(eight.seconds)
    assert eng.describe_paths().startswith("store: dma 1 jobs ") and "(predicted 0.013 ms)" in eng.describe_paths()
    _, _, _, forced = _engine(make_host_cache, f=1, path="kernel")
    forced.submit_store(1, [4], [0])
    assert forced.get_finished()[0].predicted is None and forced.path_totals() == {}


def test_engine_path_is_checked(make_host_cache):
    with pytest.raises(ValueError, match=r"path = 'fast' must be one of 'auto', 'kernel', 'dma'"):
        _engine(make_host_cache, path="fast")
    with pytest.raises(ValueError, match=r"'auto' calibrates the paths on the GPU"):
        _engine(make_host_cache, path="auto")
    assert _engine(make_host_cache)[3].path == "kernel"  # the CPU default
