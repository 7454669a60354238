"""bench/micro/integrity_lanes.py, the detection experiment behind integrity version 3 (docs/integrity.md): its
version 3 is the reference's (triton_offload/integrity.py) term for term, and on a small sample it shows what the
committed runs (bench/results/integrity-lanes-*.json) show at 10^6 and 10^7: version 3's low lane sees sign bits
flipped in two groups, which version 2's misses half the time, and neither misses them on both lanes."""

from __future__ import annotations

import numpy as np

from bench.micro import integrity_lanes as lanes
from triton_offload import integrity


def test_the_experiments_version_3_is_the_reference():
    rng = np.random.default_rng(3)
    for g in (1, 2, 4):
        blocks = rng.integers(0, 256, size=(5, 64 * g), dtype=np.uint8)
        words = blocks.view("<u4").astype(np.uint64).reshape(5, -1, g)
        j = np.arange(words.shape[1], dtype=np.uint64)[None, :]
        a, b = lanes.terms_v3(words, j)
        ref_a, ref_b = integrity.lane_sums(blocks, 4, g)
        assert (a.sum(axis=1, dtype=np.uint64) & lanes._U32 == ref_a).all()
        assert (b.sum(axis=1, dtype=np.uint64) & lanes._U32 == ref_b).all()


def test_sign_bits_in_two_groups_on_a_small_sample():
    what, groups, g, bits, change = lanes.PATTERNS[0]
    assert what.startswith("sign bit")
    v2 = lanes.misses(lanes.terms_v2, 20_000, groups, g, bits, change, seed=5)
    v3 = lanes.misses(lanes.terms_v3, 20_000, groups, g, bits, change, seed=5)
    assert 9_000 < v2["lane_a"] < 11_000 and v2["both"] == 0  # lane a alone: half
    assert v3["lane_a"] < 100 and v3["both"] == 0
