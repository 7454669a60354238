"""The seam between choosing how a transfer moves and moving it: an :class:`Issuer` issues a validated
:class:`~triton_offload.plan.TransferPlan` on a stream and says what to hold until it completes, and what a load's
integrity check found. The kernel (:mod:`.kernel`) and the copy engines (:mod:`.dma`) are the two built in; a new
data path is one module with such a class plus one entry in :data:`triton_offload.issuers.factory.PATHS`.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch

from triton_offload.checksums import LoadCheck
from triton_offload.layouts import KVCacheSpec
from triton_offload.plan import TransferPlan

__all__ = ["Issuer", "IssuerContext"]


class Issuer(Protocol):
    """Issues plans between one spec's KV caches and one host buffer.

    Attributes:
        path: the transfer path a job's result reports (``"kernel"``, ``"dma"``: the issuer's key in
            :data:`~triton_offload.issuers.factory.PATHS`).
    """

    path: str

    def copies(self, plan: TransferPlan) -> int:
        """How many copies issuing ``plan`` submits, for the cost model (0: one launch whatever the blocks); cheap,
        nothing is built."""
        ...

    def issue(self, plan: TransferPlan, stream: torch.cuda.Stream | None = None, trace=None) -> Any:
        """Issues ``plan`` asynchronously on ``stream`` (None: the current stream; on CPU the copies run now) and
        returns what must live until they complete (buffers the device still reads). ``trace(step)``, if given, is
        called at each internal step (bench/micro/call_cost.py). Raises before issuing anything it cannot issue."""
        ...

    def outcome(self, keep: Any) -> LoadCheck | None:
        """What the integrity check of the completed work that returned ``keep`` found: None for a store, or without
        the checks. Called once the work has completed, before :meth:`release`."""
        ...

    def release(self, keep: Any, after: torch.cuda.Event | None = None) -> None:
        """Takes back what :meth:`issue` returned: the copies have completed, or will once ``after`` has. Not called
        for a job that failed (its buffers may still be read by queued work)."""
        ...


class IssuerContext(NamedTuple):
    """What every issuer of one engine lane (or of a calibration, or of a public call) is built from (a NamedTuple:
    a public call builds one per call).

    Attributes:
        spec: the prepared KV caches.
        host_buffer: the packed host buffer (checked against the spec).
        blocks_per_host_block: GPU blocks per host block (f).
        launcher: the kernel's launcher (:class:`~triton_offload.issuers.launcher.CopyLauncher`): the kernel path
            launches through it, and with the integrity checks every path checks through it.
        stager: the lane's pinned id slots (:class:`~triton_offload.staging.IdStager`, CUDA); None on CPU.
        num_ctas: the programs each kernel launch passes (already resolved under the launch shape); None for the
            kernel's default.
    """

    spec: KVCacheSpec
    host_buffer: torch.Tensor
    blocks_per_host_block: int
    launcher: Any
    stager: Any = None
    num_ctas: int | None = None
