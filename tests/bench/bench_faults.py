"""A fault injected into the benchmarks' baselines, for the tests that show a method moving wrong bytes fails a run."""

from __future__ import annotations

import numpy as np

from triton_offload.issuers.dma import DmaPlanner


def short_uncoalesced_copies(monkeypatch, nbytes: int, direction: str | None = None) -> None:
    """The last copy of every transfer (in ``direction``; None: both) that a planner built with ``coalesce=False``
    describes stops ``nbytes`` short, never writing out of bounds (a sentinel tail stays): the baselines' descriptors
    (memcpy_batch, memcpy_per_block, vllm033), not the engine's copy-engine path, which asks for coalescing."""
    init, descriptors = DmaPlanner.__init__, DmaPlanner.descriptors

    def recording_init(self, spec, host_buffer, blocks_per_host_block, coalesce=True):
        init(self, spec, host_buffer, blocks_per_host_block, coalesce)
        self.uncoalesced = not coalesce

    def short(self, plan):
        src, dst, sizes = descriptors(self, plan)
        if getattr(self, "uncoalesced", False) and direction in (None, plan.direction):
            sizes = sizes.copy()
            sizes[-1] -= np.uint64(nbytes)
        return src, dst, sizes

    monkeypatch.setattr(DmaPlanner, "__init__", recording_init)
    monkeypatch.setattr(DmaPlanner, "descriptors", short)
