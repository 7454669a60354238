"""The id staging pool's bookkeeping (triton_offload/staging.py) and how the kernel issuer uses it
(triton_offload/issuers/kernel.py: take a slot, pack the ids into it, give it back if packing raises), without CUDA:
slots stand in for pinned ones and a launcher records what it was handed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import triton_offload as to
from triton_offload import staging
from triton_offload.issuers import kernel as kernel_issuer
from triton_offload.issuers.kernel import KernelIssuer
from triton_offload.kernels import packing
from triton_offload.plan import Direction, TransferPlanner
from triton_offload.staging import IdStager

from kv_factory import make_caches


class FakeSlot:
    """An unpinned stand-in for IdSlot, counting how many were made; its upload is the host array itself."""

    made = 0

    def __init__(self, capacity: int, device):
        type(self).made += 1
        self.capacity, self.guard = capacity, None
        self.host_np = np.zeros(capacity, dtype=np.int64)

    def upload(self, size: int) -> torch.Tensor:
        return torch.from_numpy(self.host_np[:size].copy())


class RecordingLauncher:
    """Records the ids each launch was handed instead of launching."""

    integrity = False

    def __init__(self):
        self.launched = []

    def ctas(self, num_ctas, shape):
        return num_ctas

    def launch(self, plan, ids, num_ctas=None):
        self.launched.append(ids.tolist())


@pytest.fixture
def stager(monkeypatch) -> IdStager:
    """The real pool on no device (stream None: no CUDA), growing with FakeSlot."""
    monkeypatch.setattr(staging, "IdSlot", FakeSlot)
    monkeypatch.setattr(FakeSlot, "made", 0)
    return IdStager(device=None)


@pytest.fixture
def plan():
    spec = to.KVCacheSpec(make_caches("mla", 2, 16, dict(block_size=2, latent=4), torch.float16), "mla")
    return TransferPlanner(spec, 8, 2).plan([7, 8, 9], [4, 1], direction=Direction.STORE, skip=1)


def test_issue_packs_into_the_slot_it_returns(stager, plan):
    launcher = RecordingLauncher()
    slot = KernelIssuer(launcher, stager).issue(plan)
    assert slot.host_np[:5].tolist() == [7, 8, 9, 4, 1] == packing.pack_ids(plan).tolist()
    assert launcher.launched == [[7, 8, 9, 4, 1]], "the launch read the slot's ids"
    assert not stager._free, "a slot in use is not in the pool"


def test_a_pack_that_raises_gives_its_slot_back(stager, plan, monkeypatch):
    def bad(plan, out=None):
        raise ValueError("host_block_ids[0] = 99 is out of range")

    issuer = KernelIssuer(RecordingLauncher(), stager)
    with monkeypatch.context() as m:
        m.setattr(kernel_issuer.packing, "pack_ids", bad)
        with pytest.raises(ValueError, match="out of range"):
            issuer.issue(plan)
    assert len(stager._free) == 1 and issuer.launcher.launched == []
    issuer.release(issuer.issue(plan))
    assert FakeSlot.made == 1, "the slot given back was reused"


def test_a_released_slot_waits_for_its_guard(stager, plan):
    """A public call gives its slot back with an event after its launch: the next taker skips it until the event
    has completed."""

    class Guard:
        done = False

        def query(self):
            return self.done

    issuer, guard = KernelIssuer(RecordingLauncher(), stager), Guard()
    first = issuer.issue(plan)
    issuer.release(first, guard)
    second = issuer.issue(plan)
    assert second is not first and FakeSlot.made == 2
    issuer.release(second)
    guard.done = True
    assert {id(issuer.issue(plan)), id(issuer.issue(plan))} == {id(first), id(second)}
