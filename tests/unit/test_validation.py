"""Bad input: every case raises before launch, names the bad value, and leaves every byte as it was."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import triton_offload as to
from triton_offload.kernels.reference import gather_blocks_ref, scatter_blocks_ref
from triton_offload.plan import Direction, TransferPlanner

from kv_factory import host_buffer, make_caches, snapshot

PAGE = dict(block_size=2, heads=2, head_dim=4)
STORE, LOAD = Direction.STORE, Direction.LOAD
NUM_BLOCKS, NUM_HOST = 8, 5


@pytest.fixture
def setup():
    caches = make_caches("kv_first", 2, NUM_BLOCKS, PAGE, torch.float16)
    spec = to.KVCacheSpec(caches, "kv_first")
    return caches, spec, host_buffer(spec, NUM_HOST, 2)


# (id, kwargs overriding a valid f=2 transfer of 3 blocks at skip 1, expected error type, message pattern)
BAD = [
    ("gpu-id-out-of-range", dict(g=[1, 8, 2]), ValueError, r"gpu_block_ids\[1\] = 8 is out of range \[0, 8\)"),
    ("gpu-id-negative", dict(g=[1, -1, 2]), ValueError, r"gpu_block_ids\[1\] = -1"),
    ("host-id-out-of-range", dict(h=[0, 5]), ValueError, r"host_block_ids\[1\] = 5 is out of range \[0, 5\)"),
    ("host-id-negative", dict(h=[-3, 1]), ValueError, r"host_block_ids\[0\] = -3"),
    # Ids int64 cannot hold are named as given, not wrapped negative by the cast to int64.
    (
        "gpu-id-uint64-beyond-int64",
        dict(g=np.array([1, 2**64 - 1, 2], dtype=np.uint64)),
        ValueError,
        r"gpu_block_ids\[1\] = 18446744073709551615 is out of range \[0, 8\)",
    ),
    (
        "gpu-id-torch-uint64",
        dict(g=torch.tensor([1, 2, 2**63], dtype=torch.uint64)),
        ValueError,
        r"gpu_block_ids\[2\] = 9223372036854775808 is out of range \[0, 8\)",
    ),
    ("host-id-int-beyond-int64", dict(h=[0, 2**64]), ValueError, r"host_block_ids\[1\] = 18446744073709551616 is out"),
    ("host-id-mixed-uint64", dict(h=[0, 2**64 - 1]), ValueError, r"host_block_ids\[1\] = 18446744073709551615 is out"),
    ("skip-uint64", dict(skip=np.array([2**64 - 1], dtype=np.uint64)), ValueError, r"skip\[0\] = 18446744073709551615"),
    ("too-few-host-ids", dict(h=[0]), ValueError, r"len\(host_block_ids\) = 1, expected .* = 2"),
    ("too-many-host-ids", dict(h=[0, 1, 2]), ValueError, r"len\(host_block_ids\) = 3, expected .* = 2"),
    ("skip-equals-factor", dict(skip=2), ValueError, r"skip = 2 must be in \[0, 2\)"),
    ("skip-negative", dict(skip=-1), ValueError, r"skip = -1"),
    ("factor-zero", dict(f=0), ValueError, r"blocks_per_host_block = 0 must be >= 1"),
    ("float-ids", dict(g=[1.0, 2.0, 3.0]), TypeError, r"gpu_block_ids must hold integers"),
    ("2d-ids", dict(g=np.array([[1, 2, 3]])), ValueError, r"gpu_block_ids must be 1-D"),
    ("num-ctas-zero", dict(num_ctas=0), ValueError, r"num_ctas = 0 must be >= 1"),
]


def _call(direction, caches, host, *, g=(1, 4, 6), h=(3, 0), f=2, skip=1, num_ctas=None, layout="kv_first"):
    if direction == "gather":
        to.gather_blocks(caches, g, host, h, layout=layout, blocks_per_host_block=f, skip=skip, num_ctas=num_ctas)
    else:
        to.scatter_blocks(host, h, caches, g, layout=layout, blocks_per_host_block=f, skip=skip, num_ctas=num_ctas)


def _assert_nothing_written(caches, host, before_caches, before_host):
    assert all(torch.equal(a, b) for a, b in zip(before_caches, snapshot(caches)))
    assert torch.equal(before_host, host)


@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("case", [pytest.param(b[1:], id=b[0]) for b in BAD])
def test_bad_input_raises_and_writes_nothing(setup, direction, case):
    caches, _, host = setup
    kwargs, exc, pattern = case
    before_caches, before_host = snapshot(caches), host.clone()
    with pytest.raises(exc, match=pattern):
        _call(direction, caches, host, **kwargs)
    _assert_nothing_written(caches, host, before_caches, before_host)


def test_valid_call_in_same_setup_writes(setup):
    """Guards the test above: the same call with its defaults does write, in both directions."""
    caches, _, host = setup
    before_host = host.clone()
    _call("gather", caches, host)
    assert not torch.equal(before_host, host)
    before = snapshot(caches)
    host[3].fill_(7)
    _call("scatter", caches, host)
    assert not all(torch.equal(a, b) for a, b in zip(before, snapshot(caches)))


@pytest.mark.parametrize(
    "direction,kwargs,pattern",
    [
        pytest.param(
            "gather", dict(h=[3, 3]), r"host_block_ids holds destination id 3 more than once", id="gather-dup"
        ),
        pytest.param(
            "scatter", dict(g=[1, 4, 1]), r"gpu_block_ids holds destination id 1 more than once", id="load-dup"
        ),
    ],
)
def test_duplicate_destinations(setup, direction, kwargs, pattern):
    caches, _, host = setup
    before_caches, before_host = snapshot(caches), host.clone()
    with pytest.raises(ValueError, match=pattern):
        _call(direction, caches, host, **kwargs)
    _assert_nothing_written(caches, host, before_caches, before_host)


def test_duplicate_sources_are_allowed(setup):
    """Reading a block twice is harmless: repeated GPU ids in a store, repeated host ids in a load, each moving the
    reference's bytes (GPU block 2 into all three positions; host block 3 into all three GPU blocks)."""
    caches, _, host = setup
    kw = dict(blocks_per_host_block=2, skip=1)
    want = host.clone()
    gather_blocks_ref(caches, "kv_first", [2, 2, 2], want, [3, 0], **kw)
    _call("gather", caches, host, g=[2, 2, 2])
    assert torch.equal(host, want)
    want_kv = [c.clone() for c in caches]
    scatter_blocks_ref(host, [3, 3], want_kv, "kv_first", [1, 4, 6], **kw)
    _call("scatter", caches, host, h=[3, 3])
    assert all(torch.equal(a, b) for a, b in zip(snapshot(caches), snapshot(want_kv)))


@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize(
    "make_host,pattern",
    [
        pytest.param(
            lambda s: torch.zeros(5, s.host_block_bytes(2) + 1, dtype=torch.uint8),
            r"host_buffer must be \(num_host_blocks, 256\)",
            id="wrong-row-bytes",
        ),
        pytest.param(
            lambda s: torch.zeros(5, s.host_block_bytes(1), dtype=torch.uint8),
            r"host_buffer must be \(num_host_blocks, 256\) for 2 block\(s\) of 128 bytes, got shape \(5, 128\)",
            id="factor-mismatch",
        ),
        pytest.param(
            lambda s: torch.zeros(5, s.host_block_bytes(2), dtype=torch.float16),
            r"host_buffer must be uint8 or int8, got torch.float16",
            id="wrong-dtype",
        ),
        pytest.param(
            lambda s: torch.zeros(5 * s.host_block_bytes(2), dtype=torch.uint8), r"got shape \(1280,\)", id="1-d"
        ),
        pytest.param(
            lambda s: torch.zeros(s.host_block_bytes(2), 5, dtype=torch.uint8).t(),
            r"rows must be contiguous",
            id="column-major",
        ),
    ],
)
def test_bad_host_buffer(setup, direction, make_host, pattern):
    caches, spec, _ = setup
    host = make_host(spec)
    before_caches, before_host = snapshot(caches), host.clone()
    with pytest.raises(ValueError, match=pattern):
        _call(direction, caches, host)
    _assert_nothing_written(caches, host, before_caches, before_host)


def test_mismatched_layer_block_counts():
    caches = make_caches("kv_first", 1, 8, PAGE, torch.float16) + make_caches("kv_first", 1, 9, PAGE, torch.float16)
    with pytest.raises(ValueError, match=r"layer 1 has 9 blocks, layer 0 has 8"):
        to.KVCacheSpec(caches, "kv_first")
    with pytest.raises(ValueError, match=r"layer 1 has 9 blocks"):
        to.gather_blocks(caches, [0], torch.zeros(1, 64, dtype=torch.uint8), [0], layout="kv_first")


@pytest.mark.parametrize(
    "layout,tensor,pattern",
    [
        pytest.param("kv_first", torch.zeros(3, 4, 2, 2, 4), r"dim 0 must be 2 \(K and V\)", id="kv-dim-not-2"),
        pytest.param(
            "block_first", torch.zeros(4, 2, 2, 4), r"block_first expects \(num_blocks, 2, block_size", id="wrong-ndim"
        ),
        pytest.param("mla", torch.zeros(4, 8, 6)[:, :, :3], r"not one contiguous run", id="sliced-latent"),
        pytest.param(
            "paged",
            torch.zeros(4, 8),
            re.escape("unknown layout 'paged'; supported: ['block_first', 'canonical', 'kv_first', 'mla']"),
            id="unknown-layout",
        ),
    ],
)
def test_bad_layer_tensors(layout, tensor, pattern):
    with pytest.raises(ValueError, match=pattern):
        to.KVCacheSpec([tensor], layout)


def test_layers_on_different_devices_or_empty():
    with pytest.raises(ValueError, match="non-empty sequence"):
        to.KVCacheSpec([], "mla")
    with pytest.raises(ValueError, match="non-empty sequence"):
        to.KVCacheSpec(torch.zeros(4, 2, 3), "mla")
    with pytest.raises(TypeError, match="layer 1: expected a torch.Tensor, got list"):
        to.KVCacheSpec([torch.zeros(4, 2, 3), [1]], "mla")


def test_prepared_spec_layout_mismatch(setup):
    caches, spec, host = setup
    with pytest.raises(ValueError, match="does not match the prepared spec's 'kv_first'"):
        to.gather_blocks(spec, [0], host, [0], layout="mla", blocks_per_host_block=2)


@pytest.fixture
def grouped():
    caches = make_caches("kv_first", 3, NUM_BLOCKS, PAGE, torch.float16)
    spec = to.KVCacheSpec(caches, "kv_first", groups=[[0, 1], [2]])
    return caches, spec, host_buffer(spec, NUM_HOST, 2)


# (id, kwargs of a grouped transfer of 3 + 1 blocks, f=2, expected message)
BAD_GROUPED = [
    ("sizes-missing", dict(group_sizes=None), r"group_sizes is required: the KV caches have 2 groups"),
    ("sizes-wrong-length", dict(group_sizes=[4]), r"len\(group_sizes\) = 1, expected one per KV-cache group = 2"),
    ("sizes-wrong-sum", dict(group_sizes=[2, 1]), r"group_sizes = \[2, 1\] sum to 3, but there are 4 GPU ids"),
    ("sizes-negative", dict(group_sizes=[5, -1]), r"group_sizes = \[5, -1\] must be >= 0"),
    ("host-count", dict(h=[0, 1, 2, 3]), r"len\(host_block_ids\) = 4, expected per group .* = \[2, 1\], 3 in all"),
    ("skip-per-group-range", dict(skip=[1, 2]), r"skip\[1\] = 2 must be in \[0, 2\)"),
    ("skip-wrong-length", dict(skip=[1, 0, 0]), r"len\(skip\) = 3, expected one per KV-cache group = 2"),
]


@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("case", [pytest.param(b[1:], id=b[0]) for b in BAD_GROUPED])
def test_bad_grouped_transfer_raises_and_writes_nothing(grouped, direction, case):
    caches, spec, host = grouped
    kwargs, pattern = case
    call = dict(g=[1, 4, 6, 2], h=[3, 0, 1], skip=[1, 0], group_sizes=[3, 1]) | kwargs
    before_caches, before_host = snapshot(caches), host.clone()
    with pytest.raises(ValueError, match=pattern):
        if direction == "gather":
            to.gather_blocks(
                spec,
                call["g"],
                host,
                call["h"],
                blocks_per_host_block=2,
                skip=call["skip"],
                group_sizes=call["group_sizes"],
            )
        else:
            to.scatter_blocks(
                host,
                call["h"],
                spec,
                call["g"],
                blocks_per_host_block=2,
                skip=call["skip"],
                group_sizes=call["group_sizes"],
            )
    _assert_nothing_written(caches, host, before_caches, before_host)


def test_valid_grouped_call_writes(grouped):
    """Guards the test above: its valid baseline transfer does write."""
    caches, spec, host = grouped
    before = host.clone()
    to.gather_blocks(spec, [1, 4, 6, 2], host, [3, 0, 1], blocks_per_host_block=2, skip=[1, 0], group_sizes=[3, 1])
    assert not torch.equal(before, host)


@pytest.mark.parametrize(
    "groups,pattern",
    [
        pytest.param([[0], []], r"group 1 is empty", id="empty"),
        pytest.param([[0, 0]], r"group 0 = \[0, 0\]: indices must be distinct layers in \[0, 3\)", id="dup"),
        pytest.param([[0, 3]], r"group 0 = \[0, 3\]", id="out-of-range"),
    ],
)
def test_bad_groups(groups, pattern):
    caches = make_caches("kv_first", 3, NUM_BLOCKS, PAGE, torch.float16)
    with pytest.raises(ValueError, match=pattern):
        to.KVCacheSpec(caches, "kv_first", groups=groups)


def test_planner_finds_every_duplicate_destination_across_calls():
    """The planner finds duplicated destinations by scattering positions into marks it keeps between calls: stale
    marks of earlier calls must neither hide a duplicate nor invent one. Checked against a set, on random calls."""
    caches = make_caches("kv_first", 1, 64, PAGE, torch.float16)
    spec = to.KVCacheSpec(caches, "kv_first")
    planner = TransferPlanner(spec, 40, 1)
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(1, 40))
        ids = rng.integers(0, 40, n) if trial % 2 else rng.permutation(40)[:n]
        dup = len(set(ids.tolist())) < n
        # (direction, gpu ids, host ids): the destinations are the host ids of a store, the GPU ids of a load.
        for direction, g, h in ((STORE, rng.integers(0, 64, n), ids), (LOAD, ids, rng.integers(0, 40, n))):
            if dup:
                first = next(int(v) for i, v in enumerate(ids) if v in ids[i + 1 :])
                with pytest.raises(ValueError, match=rf"holds destination id {first} more than once"):
                    planner.plan(g, h, direction=direction)
            else:
                plan = planner.plan(g, h, direction=direction)
                assert (plan.gpu_ids.tolist(), plan.host_ids.tolist()) == (g.tolist(), h.tolist())


def test_huge_and_negative_ids_are_out_of_range(setup):
    """The range check reads ids as unsigned: a negative id is larger than any limit, never below it."""
    _, spec, host = setup
    for bad in (-(2**63), -1, 2**62):
        with pytest.raises(ValueError, match=rf"gpu_block_ids\[1\] = {bad} is out of range"):
            to.plan_transfer(spec, host, [0, bad, 1], [0, 1], blocks_per_host_block=2, skip=1, direction=STORE)


def test_a_transfer_of_more_rows_than_the_kernel_indexes_in_32_bits_is_refused():
    """The kernel's row indices (block x segment) are int32: the planner refuses, naming the limit, a transfer of
    more than 2**31 - 1 rows, before anything is moved."""
    from triton_offload.plan import MAX_ROWS

    caches = [torch.zeros(2, 8, 2, 1, 4, dtype=torch.float16) for _ in range(3)]
    spec = to.KVCacheSpec(caches, "kv_first")
    planner = TransferPlanner(spec, 8, 1)
    assert planner.max_blocks == MAX_ROWS // spec.segments_per_group == (2**31 - 1) // 6
    planner.max_blocks = 3  # the same check at a size a test can build
    with pytest.raises(ValueError, match=r"len\(gpu_block_ids\) = 4 is more than one transfer moves: at most 3 blocks"):
        planner.plan(np.arange(4), np.arange(4), direction=to.Direction.STORE)
    assert planner.plan(np.arange(3), np.arange(3), direction=to.Direction.STORE).n_blocks == 3
