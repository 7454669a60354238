"""The kernel with vLLM's worker-slot host layout (``HostSlots``), against the reference, byte for byte.

The host buffer here is what a vLLM worker sees: a strided view of one worker's slot inside wider rows shared with
other workers, so the bytes around the view (other workers' slots, the padding of each page) must never change.
The byte placement is checked against vLLM's own ``SharedOffloadRegion`` views in ``tests/unit/test_tiering.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import triton_offload as to
from triton_offload.kernels import tables
from triton_offload.kernels.reference import gather_blocks_ref, scatter_blocks_ref
from triton_offload.layouts import HostSlots

from kv_factory import SENTINEL, assert_loaded_exactly, make_caches, random_transfer, sentinel_like, storage_bytes

PAGES = {
    "kv_first": dict(block_size=3, heads=2, head_dim=4),
    "canonical": dict(page_bytes=40, pad=24),
    "mla": dict(block_size=2, latent=10),
}
DTYPES = {"kv_first": torch.bfloat16, "canonical": torch.int8, "mla": torch.float16}


def slot_buffer(spec: to.KVCacheSpec, rows: int, f: int, *, before: int, after: int):
    """(region, view): sentinel rows of ``before + slot + after`` bytes, and the (rows, slot) view at ``before``,
    as a worker's view of its slot in vLLM's shared region."""
    slot = spec.host_block_bytes(f)
    region = torch.full((rows, before + slot + after), SENTINEL, dtype=torch.uint8)
    view = torch.as_strided(region, (rows, slot), (region.stride(0), 1), storage_offset=before)
    return region, view


def slots_for(caches, layout, spare: int, shared: bool) -> HostSlots:
    """One region per layer with ``spare`` padding bytes per page, plus an unused region in the middle; with
    ``shared``, the last two layers share one region (as two views of one tensor in two KV-cache groups would)."""
    spec = to.KVCacheSpec(caches, layout)
    pages = [p + spare for p in spec.page_bytes]
    pages.insert(1, 48)  # a tensor no group offloads still takes its place in the row
    regions = [0] + list(range(2, len(caches) + 1))
    if shared:
        regions[-1] = regions[-2]
    return HostSlots(tuple(pages), tuple(regions))


CASES = [
    pytest.param(layout, f, skip, spare, id=f"{layout}-f{f}-skip{skip}-spare{spare}")
    for layout in PAGES
    for f in (1, 2, 3)
    for skip in range(f)
    for spare in (0, 16)
]


@pytest.mark.parametrize("layout,f,skip,spare", CASES)
def test_slot_round_trip_matches_reference(layout, f, skip, spare):
    caches = make_caches(layout, 3, 9, PAGES[layout], DTYPES[layout], seed=f * 10 + skip)
    slots = slots_for(caches, layout, spare, shared=False)
    spec = to.KVCacheSpec(caches, layout, host_slots=slots)
    assert spec.host_block_bytes(f) == f * sum(slots.pages)
    rng = np.random.default_rng(f * 7 + skip + spare)
    n, rows = 5, 6
    g, h = random_transfer(rng, spec.num_blocks, rows, n, f, skip)
    region, host = slot_buffer(spec, rows, f, before=32, after=16)
    expected_region, expected = slot_buffer(spec, rows, f, before=32, after=16)

    to.gather_blocks(spec, g, host, h, blocks_per_host_block=f, skip=skip)
    gather_blocks_ref(caches, layout, g, expected, h, blocks_per_host_block=f, skip=skip, host_slots=slots)
    assert torch.equal(region, expected_region), "host bytes differ from the reference (or bytes outside the slot)"
    assert not torch.equal(host, torch.full_like(host, SENTINEL)), "nothing was written"

    out = [sentinel_like(t) for t in caches]
    region_before = region.clone()
    out_spec = to.KVCacheSpec(out, layout, host_slots=slots)
    to.scatter_blocks(host, h, out_spec, g, blocks_per_host_block=f, skip=skip)
    assert torch.equal(region, region_before), "a load changed the host"
    assert_loaded_exactly(out, caches, layout, g)
    ref_out = [sentinel_like(t) for t in caches]
    scatter_blocks_ref(host, h, ref_out, layout, g, blocks_per_host_block=f, skip=skip, host_slots=slots)
    assert all(torch.equal(storage_bytes(a), storage_bytes(b)) for a, b in zip(out, ref_out))


@pytest.mark.parametrize("f", [1, 2, 4], ids=lambda f: f"f{f}")
def test_slot_placement_by_hand(f):
    """Independently of the reference: layer i's bytes of the GPU block at position p land at row h[p // f],
    f * (pages before its region) + (p % f) * its page; the rest of each page keeps the sentinel."""
    caches = make_caches("canonical", 2, 6, dict(page_bytes=24, pad=8), torch.int8, seed=f)
    slots = HostSlots((32, 40), (1, 0))  # layer 0 in the second region: row order is the regions', not the layers'
    spec = to.KVCacheSpec(caches, "canonical", host_slots=slots)
    g, h, skip = [4, 1, 3], [2, 0, 1], 1 % f
    h = h[: -(-(skip + len(g)) // f)]
    region, host = slot_buffer(spec, 3, f, before=0, after=0)
    to.gather_blocks(spec, g, host, h, blocks_per_host_block=f, skip=skip)
    want = torch.full_like(host, SENTINEL)
    for i, block in enumerate(g):
        p = skip + i
        for layer, t in enumerate(caches):
            r = slots.regions[layer]
            start = f * sum(slots.pages[:r]) + (p % f) * slots.pages[r]
            want[h[p // f], start : start + 24] = t[block].view(torch.uint8)
    assert torch.equal(host, want)


def test_slot_groups_share_a_region():
    """Two KV-cache groups whose last layers are views of one tensor: both write that tensor's region."""
    caches = make_caches("canonical", 3, 8, dict(page_bytes=32, pad=0), torch.int8, seed=3)
    slots = HostSlots((32, 48, 32), (0, 2, 2))
    spec = to.KVCacheSpec(caches, "canonical", groups=[[0, 1], [2]], host_slots=slots)
    f, skips, sizes = 2, [1, 0], [3, 2]
    g = [5, 0, 2, 7, 6]
    h = [3, 1, 0]  # group 0: ceil((1 + 3) / 2) = 2 host blocks; group 1: 1
    region, host = slot_buffer(spec, 4, f, before=16, after=0)
    expected_region, expected = slot_buffer(spec, 4, f, before=16, after=0)
    to.gather_blocks(spec, g, host, h, blocks_per_host_block=f, skip=skips, group_sizes=sizes)
    gather_blocks_ref(
        caches, "canonical", g, expected, h, blocks_per_host_block=f, skip=skips, groups=[[0, 1], [2]],
        group_sizes=sizes, host_slots=slots,
    )  # fmt: skip
    assert torch.equal(region, expected_region)


def test_packed_format_unchanged_by_the_generalisation():
    """Without host_slots every segment's host stride is the packed sub-block and its region offset 0: the table the
    kernel reads places bytes exactly as the packed format always did."""
    caches = make_caches("kv_first", 2, 4, PAGES["kv_first"], torch.bfloat16)
    spec = to.KVCacheSpec(caches, "kv_first")
    assert {s.host_stride for s in spec.segments} == {spec.bytes_per_block}
    assert {s.host_region for s in spec.segments} == {0}
    assert tables.table_key(spec, 3) == tables.table_key(spec, 1), "the packed table must not depend on f"
    table = tables.build_segment_table(spec, 1, 3)
    assert table[:, 3].tolist() == [spec.bytes_per_block] * len(spec.segments)
    assert table[:, 4].tolist() == [s.host_offset for s in spec.segments]


def test_bad_host_slots_are_refused():
    caches = make_caches("canonical", 2, 4, dict(page_bytes=32, pad=0), torch.int8)
    with pytest.raises(ValueError, match="names a region for 1 entries, but there are 2"):
        to.KVCacheSpec(caches, "canonical", host_slots=HostSlots((32,), (0,)))
    with pytest.raises(ValueError, match="entry 1 moves 32 bytes per block, more than the 16-byte page"):
        to.KVCacheSpec(caches, "canonical", host_slots=HostSlots((32, 16), (0, 1)))
    with pytest.raises(ValueError, match="each must index pages"):
        HostSlots((32,), (0, 1))
    spec = to.KVCacheSpec(caches, "canonical", host_slots=HostSlots((32, 32), (0, 1)))
    wrong = torch.zeros(2, 2 * 32, dtype=torch.uint8)  # one region's worth of f=2 rows, not two
    with pytest.raises(ValueError, match=r"host_buffer must be \(num_host_blocks, 128\)"):
        to.gather_blocks(spec, [0], wrong, [0], blocks_per_host_block=2)
