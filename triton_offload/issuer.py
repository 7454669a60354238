"""The seam between choosing how a transfer moves and moving it: an :class:`Issuer` issues a validated
:class:`~triton_offload.plan.TransferPlan` on a stream and says what to hold until it completes. The kernel
(:class:`~triton_offload.kernel_issuer.KernelIssuer`) and the copy engines (:class:`~triton_offload.dma.DmaIssuer`)
are the two today; a new data path (another vendor's copy API, a Grace-coherent memcpy) is a third class with these
three methods, which the engine, the calibration and the job tracker take as they take the two.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from triton_offload.plan import TransferPlan

__all__ = ["Issuer"]


class Issuer(Protocol):
    """Issues plans between one spec's KV caches and one host buffer.

    Attributes:
        path: the name a job's result reports (:data:`~triton_offload._checks.TRANSFER_PATHS`: ``"kernel"``,
            ``"dma"``).
    """

    path: str

    def descriptors(self, plan: TransferPlan) -> int:
        """How many copies issuing ``plan`` submits, for the cost model (0: one launch whatever the blocks); cheap,
        nothing is built."""
        ...

    def issue(self, plan: TransferPlan, stream: torch.cuda.Stream | None = None, trace=None) -> Any:
        """Issues ``plan`` asynchronously on ``stream`` (None: the current stream; on CPU the copies run now) and
        returns what must live until they complete (buffers the device still reads). ``trace(step)``, if given, is
        called at each internal step (bench/micro/call_cost.py). Raises before issuing anything it cannot issue."""
        ...

    # An issuer that checks what it moves (the integrity checks, docs/integrity.md) also has
    # ``outcome(keep) -> LoadCheck | None``: what the check of the completed work found; the job tracker calls it
    # before ``release``.

    def release(self, keep: Any, after: torch.cuda.Event | None = None) -> None:
        """Takes back what :meth:`issue` returned: the copies have completed, or will once ``after`` has. Not called
        for a job that failed (its buffers may still be read by queued work)."""
        ...
