"""The id staging pool's bookkeeping (triton_offload/staging.py) without CUDA: slots stand in for pinned ones."""

from __future__ import annotations

import numpy as np
import pytest

from triton_offload import staging
from triton_offload.staging import IdStager


class FakeSlot:
    """An unpinned stand-in for IdSlot, counting how many were made."""

    made = 0

    def __init__(self, capacity: int, device):
        type(self).made += 1
        self.capacity, self.guard = capacity, None
        self.host_np = np.zeros(capacity, dtype=np.int64)


@pytest.fixture
def stager(monkeypatch) -> IdStager:
    """The real pool on no device (stream None: no CUDA), growing with FakeSlot."""
    monkeypatch.setattr(staging, "IdSlot", FakeSlot)
    monkeypatch.setattr(FakeSlot, "made", 0)
    return IdStager(device=None)


def test_staged_returns_the_slot_it_packed_into(stager):
    plan, slot = stager.staged(lambda stage: stage(5).__setitem__(slice(0, 3), [7, 8, 9]) or "plan")
    assert plan == "plan" and slot.host_np[:3].tolist() == [7, 8, 9]
    assert not stager._free, "a slot in use is not in the pool"


def test_a_plan_that_raises_gives_its_slot_back(stager):
    def bad(stage):
        stage(4)
        raise ValueError("host_block_ids[0] = 99 is out of range")

    with pytest.raises(ValueError, match="out of range"):
        stager.staged(bad)
    assert len(stager._free) == 1
    stager.staged(lambda stage: stage(4))
    assert FakeSlot.made == 1, "the slot given back was reused"
