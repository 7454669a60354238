"""The id staging pool's bookkeeping (triton_offload/staging.py) without CUDA: slots stand in for pinned ones."""

from __future__ import annotations

import numpy as np
import pytest

from triton_offload.staging import IdStager


class FakeSlot:
    def __init__(self, capacity: int):
        self.capacity, self.guard = capacity, None
        self.host_np = np.zeros(capacity, dtype=np.int64)


class FakeStager(IdStager):
    def __init__(self):
        super().__init__(device=None)
        self.made = 0

    def take(self, size: int):
        if self._free:
            return self._free.popleft()
        self.made += 1
        return FakeSlot(max(size, 8))


def test_staged_returns_the_slot_it_packed_into():
    stager = FakeStager()
    plan, slot = stager.staged(lambda stage: stage(5).__setitem__(slice(0, 3), [7, 8, 9]) or "plan")
    assert plan == "plan" and slot.host_np[:3].tolist() == [7, 8, 9]
    assert not stager._free, "a slot in use is not in the pool"


def test_a_plan_that_raises_gives_its_slot_back():
    stager = FakeStager()

    def bad(stage):
        stage(4)
        raise ValueError("host_block_ids[0] = 99 is out of range")

    with pytest.raises(ValueError, match="out of range"):
        stager.staged(bad)
    assert len(stager._free) == 1
    stager.staged(lambda stage: stage(4))
    assert stager.made == 1, "the slot given back was reused"
