"""Pinned staging of the kernel's id buffers on CUDA, reused instead of allocated per call: a transfer's ids are
packed straight into a pinned :class:`IdSlot`, uploaded to its device twin with one asynchronous copy, and the slot is
reused only once the work that reads it has completed (an engine job's end, or a guard event after a public call's
launch, which the next taker queries).
"""

from __future__ import annotations

import collections

import numpy as np
import torch

__all__ = ["IdSlot", "IdStager"]

# The smallest slot: 1024 blocks of one group with their host ids fit; slots grow by powers of two from there.
_MIN_SLOT = 2048


class IdSlot:
    """A pinned int64 buffer, its NumPy view and its device twin, of ``capacity`` elements.

    Attributes:
        guard: an event after the last work that reads the slot, or None when nothing reads it any more.
    """

    def __init__(self, capacity: int, device: torch.device):
        self.capacity = capacity
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self.host_np: np.ndarray = self.host.numpy()
        self.device = torch.empty(capacity, dtype=torch.int64, device=device)
        self.event = torch.cuda.Event()  # no timing: only queried
        self.guard: torch.cuda.Event | None = None
        self._results: tuple[torch.Tensor, np.ndarray] | None = None

    def results(self) -> tuple[torch.Tensor, np.ndarray]:
        """Pinned int64 host memory of ``capacity`` elements (and its NumPy view) that a launch reading this slot
        writes its integrity results into (docs/integrity.md); allocated on first use."""
        if self._results is None:
            res = torch.empty(self.capacity, dtype=torch.int64, pin_memory=True)
            self._results = (res, res.numpy())
        return self._results

    def upload(self, size: int) -> torch.Tensor:
        """The first ``size`` ids on the device, copied asynchronously on the current stream. The source is pinned,
        so the copy never synchronises; the slot must not be reused before the reader's guard completes."""
        dev = self.device[:size]
        dev.copy_(self.host[:size], non_blocking=True)
        return dev


class IdStager:
    """A pool of :class:`IdSlot` for one device.

    Args:
        device: the CUDA device of the ids.
        stream: the stream new slots are allocated on (the engine's side stream of one direction); None for the
            stream current when the pool grows. If a slot is ever dropped while queued work still reads it, the
            caching allocator hands its device memory out again only in that stream's order.
    """

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None):
        self.device = device
        self.stream = stream
        self._free: collections.deque[IdSlot] = collections.deque()

    def take(self, size: int) -> IdSlot:
        """A slot of at least ``size`` elements that nothing reads any more."""
        for _ in range(len(self._free)):
            slot = self._free.popleft()
            if slot.capacity >= size and (slot.guard is None or slot.guard.query()):
                slot.guard = None
                return slot
            self._free.append(slot)  # busy or too small: keep it for later
        # Grows to the largest in-flight working set once, then reuses; powers of two keep the pool small.
        capacity = max(_MIN_SLOT, 1 << max(0, size - 1).bit_length())
        if self.stream is None:
            return IdSlot(capacity, self.device)
        with torch.cuda.stream(self.stream):
            return IdSlot(capacity, self.device)

    def give_back(self, slot: IdSlot, guard: torch.cuda.Event | None = None) -> None:
        """Returns a slot; it is handed out again once ``guard`` (if any) has completed."""
        slot.guard = guard
        self._free.append(slot)
