"""Packed rows with host regions (``KVCacheSpec(..., group_regions=...)``): a host row holds f sub-blocks of each
region's bytes, region after region, and a host id names one key per region; groups may share a region. Against the
reference and by hand, byte for byte, on CPU under the Triton interpreter; the copy-engine path's descriptors for the
same layout are checked in tests/unit/test_dma.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import triton_offload as to
from triton_offload.kernels.reference import gather_blocks_ref, scatter_blocks_ref
from triton_offload.plan import Direction, TransferPlanner

from kv_factory import SENTINEL, host_buffer, make_caches, sentinel_like, storage_bytes

GROUPS = [[0, 2], [1], [3]]  # 192, 40 and 24 bytes per GPU block: unequal, as attention next to a state group
REGIONS = (0, 1, 2)  # a region per group


def _caches(seed=0):
    caches = make_caches("canonical", 2, 12, dict(page_bytes=96, pad=32), torch.int8, seed=seed)
    caches.insert(1, make_caches("canonical", 1, 12, dict(page_bytes=40), torch.int8, seed=seed + 1)[0])
    caches += make_caches("canonical", 1, 12, dict(page_bytes=24, pad=8), torch.int8, seed=seed + 2)
    return caches


def test_a_row_holds_each_group_at_its_own_size():
    spec = to.KVCacheSpec(_caches(), "canonical", groups=GROUPS, group_regions=REGIONS)
    assert spec.group_bytes == (192, 40, 24) and spec.bytes_per_block == 192
    assert spec.host_block_bytes(3) == 3 * 256, "a row is f x every group's bytes, not f x the largest x groups"
    assert spec.key_bytes(3) == (576, 120, 72)
    shared = to.KVCacheSpec(_caches(), "canonical", groups=GROUPS)
    assert shared.key_bytes(3) == (576,) * 3, "one row per key, sized for the largest group"
    one = to.KVCacheSpec(_caches()[:1], "canonical", group_regions=(0,))
    assert one.group_regions is None and one.host_block_bytes(2) == 2 * 96, "one region: the plain packed format"
    borrow = to.KVCacheSpec(_caches(), "canonical", groups=GROUPS, group_regions=(0, 1, 1))
    assert borrow.region_bytes == (192, 40) and borrow.key_bytes(2) == (384, 80, 80)
    with pytest.raises(ValueError, match="regions must be numbered 0, 1, ... without a gap"):
        to.KVCacheSpec(_caches(), "canonical", groups=GROUPS, group_regions=(0, 2, 2))
    with pytest.raises(ValueError, match="one region number"):
        to.KVCacheSpec(_caches(), "canonical", groups=GROUPS, group_regions=(0, 1))


@pytest.mark.parametrize(
    "f,skips,sizes",
    [(1, [0, 0, 0], [3, 2, 1]), (2, [1, 0, 1], [4, 3, 1]), (3, [2, 1, 0], [2, 4, 3]), (2, [0, 1, 0], [2, 0, 1])],
    ids=["f1", "f2-skips-1-0-1", "f3-skips-2-1-0", "f2-empty-group"],
)
def test_round_trip_matches_reference_with_one_id_shared_by_groups(f, skips, sizes):
    """One launch for three groups; the groups' host ids overlap (row 1 holds a key of every group), as the manager
    hands them out from one block pool per group. Host bytes equal the reference's, rows never addressed keep the
    sentinel, and the load writes exactly the addressed blocks."""
    caches = _caches(seed=f)
    spec = to.KVCacheSpec(caches, "canonical", groups=GROUPS, group_regions=REGIONS)
    rng = np.random.default_rng(f)
    counts = [-(-(k + n) // f) if n else 0 for k, n in zip(skips, sizes)]
    rows = 6
    h = np.concatenate([np.r_[1, rng.permutation(np.arange(2, rows))][:c] for c in counts]).astype(np.int64)
    g = rng.permutation(spec.num_blocks)[: sum(sizes)]
    kw = dict(blocks_per_host_block=f, skip=skips, group_sizes=sizes)
    host, want = host_buffer(spec, rows, f), host_buffer(spec, rows, f)
    to.gather_blocks(spec, g, host, h, **kw)
    gather_blocks_ref(caches, "canonical", g, want, h, groups=GROUPS, group_regions=REGIONS, **kw)
    assert torch.equal(host, want)
    assert bool((host[[0]] == SENTINEL).all()), "a row no group addressed was written"
    out, ref = [sentinel_like(t) for t in caches], [sentinel_like(t) for t in caches]
    to.scatter_blocks(host, h, to.KVCacheSpec(out, "canonical", groups=GROUPS, group_regions=REGIONS), g, **kw)
    scatter_blocks_ref(host, h, ref, "canonical", g, groups=GROUPS, group_regions=REGIONS, **kw)
    assert all(torch.equal(storage_bytes(a), storage_bytes(b)) for a, b in zip(out, ref))


def test_placement_by_hand_and_other_groups_untouched():
    """Independently of the reference: group k's GPU block at position p lands at row h[p // f], byte
    f * (bytes of the groups before k) + (p % f) * (group k's bytes); a store of one group leaves every byte of the
    other groups' regions of the same rows as it was."""
    caches, f = _caches(seed=7), 2
    spec = to.KVCacheSpec(caches, "canonical", groups=GROUPS, group_regions=REGIONS)
    gb = spec.group_bytes
    host = host_buffer(spec, 4, f)
    host[2] = torch.arange(host.shape[1], dtype=torch.int64).to(torch.uint8)  # another key's bytes in the row
    before = host.clone()
    g, h, skip = [5, 9, 3], [2, 0], 1  # group 1 only: positions 1, 2, 3 -> rows 2, 0, 0
    to.gather_blocks(spec, g, host, h, blocks_per_host_block=f, skip=[0, skip, 0], group_sizes=[0, 3, 0])
    want = before.clone()
    start = f * gb[0]
    for i, block in enumerate(g):
        p = skip + i
        at = start + (p % f) * gb[1]
        want[h[p // f], at : at + gb[1]] = caches[1][block, :40].view(torch.uint8)
    assert torch.equal(host, want), "a byte outside group 1's sub-blocks changed, or one of them is wrong"


def test_destinations_are_distinct_per_group_not_across_groups():
    spec = to.KVCacheSpec(_caches(), "canonical", groups=GROUPS, group_regions=REGIONS)
    planner = TransferPlanner(spec, 4, 1)
    plan = planner.plan([1, 2, 3], [3, 3, 3], direction=Direction.STORE, group_sizes=[1, 1, 1])
    assert plan.host_ids.tolist() == [3, 3, 3], "one row, one key per group"
    with pytest.raises(ValueError, match="destination id 2 more than once in host region 0"):
        planner.plan([1, 2, 3], [2, 2, 0], direction=Direction.STORE, group_sizes=[2, 0, 1])
    sharing = TransferPlanner(to.KVCacheSpec(_caches(), "canonical", groups=GROUPS, group_regions=(0, 1, 1)), 4, 1)
    assert sharing.plan([1, 2, 3], [3, 2, 3], direction=Direction.STORE, group_sizes=[1, 1, 1]).n_host == 3
    with pytest.raises(ValueError, match="destination id 3 more than once in host region 1"):
        sharing.plan([1, 2, 3], [0, 3, 3], direction=Direction.STORE, group_sizes=[1, 1, 1])
    shared = TransferPlanner(to.KVCacheSpec(_caches(), "canonical", groups=GROUPS), 4, 1)
    with pytest.raises(ValueError, match="destination id 3 more than once"):
        shared.plan([1, 2, 3], [3, 3, 3], direction=Direction.STORE, group_sizes=[1, 1, 1])


def test_groups_sharing_a_region_round_trip():
    """A small group borrowing a larger group's region (as a Mamba-like group whose keys are few borrows the
    attention region): its bytes start each sub-block of that region, the rest of the sub-block keeps what it held;
    the region's two groups never share an id in one store."""
    caches, f = _caches(seed=11), 2
    regions = (0, 1, 1)
    spec = to.KVCacheSpec(caches, "canonical", groups=GROUPS, group_regions=regions)
    g, h = [4, 7, 1, 9, 2], [3, 0, 1, 2]  # group sizes 2, 1, 2 with skips 0, 1, 1: rows 3 | 0 | 1, 2
    kw = dict(blocks_per_host_block=f, skip=[0, 1, 1], group_sizes=[2, 1, 2])
    host, want = host_buffer(spec, 4, f), host_buffer(spec, 4, f)
    to.gather_blocks(spec, g, host, h, **kw)
    gather_blocks_ref(caches, "canonical", g, want, h, groups=GROUPS, group_regions=regions, **kw)
    assert torch.equal(host, want)
    region1 = host[:, f * 192 :].reshape(4, f, 40)
    assert torch.equal(region1[1, 1, :24], caches[3][9, :24].view(torch.uint8)), "group 2's block 0: row 1, sub 1"
    assert bool((region1[1, 1, 24:] == SENTINEL).all()), "the borrowed sub-block's tail must keep its bytes"
    assert bool((region1[1, 0] == SENTINEL).all()), "before the skip: untouched"
    out, ref = [sentinel_like(t) for t in caches], [sentinel_like(t) for t in caches]
    to.scatter_blocks(host, h, to.KVCacheSpec(out, "canonical", groups=GROUPS, group_regions=regions), g, **kw)
    scatter_blocks_ref(host, h, ref, "canonical", g, groups=GROUPS, group_regions=regions, **kw)
    assert all(torch.equal(storage_bytes(a), storage_bytes(b)) for a, b in zip(out, ref))


def test_host_slots_and_group_regions_are_exclusive():
    from triton_offload.layouts import HostSlots

    caches = _caches()
    with pytest.raises(ValueError, match="host_slots and group_regions are two host layouts"):
        to.KVCacheSpec(caches, "canonical", groups=GROUPS, host_slots=HostSlots((128,) * 4, (0, 1, 2, 3)),
                       group_regions=REGIONS)  # fmt: skip
