"""The kernel path (``"kernel"``): :class:`KernelIssuer` issues a plan as one launch of the copy kernel, its ids
packed straight into a pinned slot, uploaded asynchronously and read by the kernel on the issuing stream. With the
integrity checks, a load's launch also writes what its check found (:func:`load_check`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from triton_offload import integrity
from triton_offload.checksums import LoadCheck
from triton_offload.issuers.launcher import CopyLauncher
from triton_offload.kernels import packing
from triton_offload.plan import Direction, TransferPath, TransferPlan
from triton_offload.staging import IdSlot, IdStager

__all__ = ["KernelIssuer", "load_check"]


class _Checked(NamedTuple):
    """What a launch with the integrity checks holds until it completes: its id slot (CUDA), where its results are
    written, and what reading them needs (the plan names each block of a load's outcome)."""

    slot: IdSlot | None
    res: np.ndarray
    plan: TransferPlan
    blocks_per_host_block: int


def load_check(keep) -> LoadCheck | None:
    """What a completed launch's integrity check found, from what its issue returned: None for a store or a launch
    without checks.

    Raises:
        RuntimeError: the launch completed without writing its results (no program finalised the checks).
    """
    if not isinstance(keep, _Checked) or keep.plan.direction is Direction.STORE:
        return None
    res, plan, f = keep.res, keep.plan, keep.blocks_per_host_block
    if res[0] < 0:
        raise RuntimeError("the integrity check of a load completed without its results")
    if res[0] == 0 and res[1] == 0:
        return LoadCheck(_NONE, _NONE, plan, f)
    status = res[2 : 2 + plan.n_blocks]
    failed, absent = np.flatnonzero(status == integrity.FAILED), np.flatnonzero(status == integrity.ABSENT)
    return LoadCheck(failed, absent, plan, f)


_NONE = np.zeros(0, dtype=np.int64)


class KernelIssuer:
    """Issues plans as one kernel launch each: the ids packed straight into a pinned slot (CUDA), uploaded
    asynchronously on the issuing stream and read there by the kernel; on CPU packed into a fresh array and run
    through the interpreter, synchronously.

    A slot stays with the work that reads it: :meth:`issue` returns it, and :meth:`release` hands it back to the pool
    once that work has completed (or with an event after it, which the next taker queries).

    Args:
        launcher: the launcher of the issued plans' directions.
        stager: the pinned id slots (CUDA); None on CPU.
        num_ctas: the programs each launch passes, already resolved under the launch shape
            (:meth:`CopyLauncher.ctas`); None for the kernel's default.
    """

    path = TransferPath.KERNEL

    def __init__(self, launcher: CopyLauncher, stager: IdStager | None, num_ctas: int | None = None):
        self.launcher, self.stager, self.num_ctas = launcher, stager, num_ctas

    def copies(self, plan: TransferPlan) -> int:
        """0: one launch, whatever the blocks."""
        return 0

    def issue(self, plan: TransferPlan, stream: torch.cuda.Stream | None = None, trace=None):
        """Launches ``plan`` on ``stream`` (None: the current one) and returns the slot its ids were staged in (with
        the integrity checks, with where its results go: :func:`load_check` reads them once it completed)."""
        return self.issue_launch(plan, stream, trace)

    def issue_launch(self, plan: TransferPlan, stream=None, trace=None, copy: bool = True):
        """:meth:`issue`, or with ``copy`` False the checksum-only launch of the same plan (the copy-engine path's
        check, :class:`~triton_offload.issuers.dma.DmaIssuer`)."""
        checks = self.launcher.integrity
        if self.stager is None:
            size = packing.packed_size(plan, checks)
            buf = np.empty(size + (packing.result_size(plan) if checks else 0), dtype=np.int64)
            packing.pack_ids(plan, buf)
            if not checks:
                self.launcher.launch(plan, torch.from_numpy(buf), self.num_ctas)
                return None
            packing.pack_integrity(plan, buf)
            res = buf[size:]
            res[0] = -1  # until the load's last program writes its totals
            self.launcher.launch(plan, torch.from_numpy(buf[:size]), self.num_ctas, torch.from_numpy(res), copy)
            return _Checked(None, res, plan, self.launcher.blocks_per_host_block)
        size = packing.packed_size(plan, checks)
        slot = self.stager.take(size)
        try:
            packing.pack_ids(plan, slot.host_np)
            if checks:
                packing.pack_integrity(plan, slot.host_np)
                res, res_np = slot.results()
                res_np[0] = -1  # the slot's last reader has completed: nothing else writes it now
        except BaseException:
            self.stager.give_back(slot)  # nothing reads it yet
            raise
        if stream is None:
            self._upload_and_launch(plan, slot, size, trace, res if checks else None, copy)
        else:
            with torch.cuda.stream(stream):
                self._upload_and_launch(plan, slot, size, trace, res if checks else None, copy)
        return _Checked(slot, res_np, plan, self.launcher.blocks_per_host_block) if checks else slot

    def _upload_and_launch(self, plan: TransferPlan, slot: IdSlot, size: int, trace, res, copy) -> None:
        # The slot is pinned, so this copy is truly asynchronous; it is not reused before its reader's guard.
        ids = slot.upload(size)
        if trace is not None:
            trace("upload")
        if res is None:
            self.launcher.launch(plan, ids, self.num_ctas)
        else:
            self.launcher.launch(plan, ids, self.num_ctas, res, copy)
        if trace is not None:
            trace("launch")

    def outcome(self, keep) -> LoadCheck | None:
        """What the integrity check of the completed launch that returned ``keep`` found (:func:`load_check`)."""
        return load_check(keep)

    def release(self, keep, after: torch.cuda.Event | None = None) -> None:
        """Hands the launch's slot back to the pool: at once if its launch has completed, else once ``after`` has."""
        slot = keep.slot if isinstance(keep, _Checked) else keep
        if slot is not None:
            self.stager.give_back(slot, after)
