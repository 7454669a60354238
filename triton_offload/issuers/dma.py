"""The copy-engine path: a transfer as one ``cuMemcpyBatchAsync`` of (src, dst, bytes) descriptors, no SMs used.
Descriptors come from the spec's segments, merged into *runs* where adjacent on both sides and coalesced across
consecutive blocks where a run's blocks are adjacent too, never across host blocks (one CUDA registration each);
docs/design.md ("The copy-engine path and auto") says when this path wins. On CPU the same descriptors are replayed
by a memmove stand-in for the driver, so the bytes this path would move are tested like the kernel's. With the
integrity checks, a checksum-only launch of the kernel over the GPU side of the blocks follows the copies on the same
stream (docs/integrity.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from triton_offload.cuda_driver import FLAG_PREFER_OVERLAP_WITH_COMPUTE, BatchIssuer
from triton_offload.layouts import KVCacheSpec, Segment
from triton_offload.plan import Direction, TransferPath, TransferPlan

__all__ = ["GroupRuns", "group_runs", "DmaPlanner", "DmaIssuer"]


@dataclass(frozen=True)
class GroupRuns:
    """One KV-cache group's runs as arrays (one entry per run), the host placement already scaled by f.

    Attributes:
        base: GPU address of block 0's bytes.
        block_stride: bytes between GPU blocks.
        nbytes: bytes per block.
        host_stride: bytes between sub-blocks of a host block.
        host_start: offset of sub-block 0's bytes in a host block's row.
        coalesce: the run's blocks are adjacent on both sides, so consecutive blocks may share a descriptor.
    """

    base: np.ndarray
    block_stride: np.ndarray
    nbytes: np.ndarray
    host_stride: np.ndarray
    host_start: np.ndarray
    coalesce: np.ndarray

    def __len__(self) -> int:
        return int(self.base.size)


def _adjacent(a: Segment, b: Segment) -> bool:
    """b continues a on the GPU and on the host, for every block and sub-block."""
    return (
        a.block_stride == b.block_stride
        and a.base + a.nbytes == b.base
        and a.host_stride == b.host_stride
        and a.host_region == b.host_region
        and a.host_offset + a.nbytes == b.host_offset
    )


def group_runs(spec: KVCacheSpec, blocks_per_host_block: int) -> list[GroupRuns]:
    """Each group's segments merged into runs (:class:`GroupRuns`), for host blocks of ``blocks_per_host_block``."""
    f = blocks_per_host_block
    out = []
    for segs in spec.group_segments:
        runs: list[list[int]] = []  # base, block stride, bytes, host stride, host start
        last: Segment | None = None
        for s in segs:
            if last is not None and _adjacent(last, s):
                runs[-1][2] += s.nbytes
            else:
                runs.append([s.base, s.block_stride, s.nbytes, s.host_stride, f * s.host_region + s.host_offset])
            last = s
        a = np.array(runs, dtype=np.int64).reshape(-1, 5)
        coalesce = (a[:, 1] == a[:, 2]) & (a[:, 3] == a[:, 2])
        out.append(GroupRuns(a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4], coalesce))
    return out


class DmaPlanner:
    """Descriptors of transfers between one spec and one host buffer, f fixed. Building is vectorised over runs and
    blocks (NumPy, no Python loop over blocks or layers).

    Args:
        spec: the prepared KV caches.
        host_buffer: (num_host_blocks, row bytes) uint8/int8, already checked against the spec.
        blocks_per_host_block: GPU blocks per host block (f).
        coalesce: merge adjacent blocks' copies where the layout allows (False: one descriptor per block and run,
            as a caller that never merges, such as vLLM's own worker, builds them).
    """

    def __init__(self, spec: KVCacheSpec, host_buffer: torch.Tensor, blocks_per_host_block: int, coalesce=True):
        self.spec = spec
        self.f = blocks_per_host_block
        self.host_ptr = host_buffer.data_ptr()
        self.row_bytes = host_buffer.stride(0) * host_buffer.element_size()
        self.groups = group_runs(spec, blocks_per_host_block)
        if not coalesce:
            self.groups = [dataclasses.replace(r, coalesce=np.zeros_like(r.coalesce)) for r in self.groups]
        self.coalesces = any(bool(r.coalesce.any()) for r in self.groups)

    def _layout(self, g: np.ndarray, h: np.ndarray, skip: int):
        """(host row of each block, sub-block of each block, starts of the coalescable stretches)."""
        pos = skip + np.arange(g.size, dtype=np.int64)
        rows, sub = h[pos // self.f], pos % self.f
        cont = (g[1:] == g[:-1] + 1) & (rows[1:] == rows[:-1]) & (sub[1:] == sub[:-1] + 1)
        starts = np.flatnonzero(np.concatenate(([True], ~cont)))
        return rows, sub, starts

    def count(self, plan: TransferPlan) -> int:
        """How many descriptors :meth:`descriptors` would build for ``plan`` (cheap: no addresses are computed)."""
        total = 0
        for runs, (g, h, skip) in zip(self.groups, plan.groups()):
            if not g.size:
                continue
            merged = int(runs.coalesce.sum()) if self.coalesces else 0
            stretches = self._layout(g, h, skip)[2].size if merged else 0
            total += (len(runs) - merged) * g.size + merged * stretches
        return total

    def descriptors(self, plan: TransferPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(src, dst, bytes) of every copy of ``plan``, as uint64 arrays: run-major within each group."""
        srcs, dsts, sizes = [], [], []
        for runs, (g, h, skip) in zip(self.groups, plan.groups()):
            if not g.size:
                continue
            rows, sub, starts = self._layout(g, h, skip)
            gpu = runs.base[:, None] + g[None, :] * runs.block_stride[:, None]  # (runs, n)
            host = (self.host_ptr + rows * self.row_bytes)[None, :] + (
                sub[None, :] * runs.host_stride[:, None] + runs.host_start[:, None]
            )
            nbytes = np.broadcast_to(runs.nbytes[:, None], gpu.shape)
            if starts.size < g.size and runs.coalesce.any():
                lengths = np.diff(np.append(starts, g.size))
                keep = ~runs.coalesce
                srcs += [gpu[keep].ravel(), gpu[runs.coalesce][:, starts].ravel()]
                dsts += [host[keep].ravel(), host[runs.coalesce][:, starts].ravel()]
                sizes += [nbytes[keep].ravel(), (runs.nbytes[runs.coalesce][:, None] * lengths[None, :]).ravel()]
            else:
                srcs.append(gpu.ravel())
                dsts.append(host.ravel())
                sizes.append(nbytes.ravel())
        gpu_addr, host_addr, nbytes = (np.concatenate(a).view(np.uint64) for a in (srcs, dsts, sizes))
        return (gpu_addr, host_addr, nbytes) if plan.direction is Direction.STORE else (host_addr, gpu_addr, nbytes)


class DmaIssuer:
    """Issues plans as one ``cuMemcpyBatchAsync`` each (CUDA), or replays their descriptors with memmove (CPU): the
    :class:`~triton_offload.issuers.base.Issuer` of ``path="dma"``.

    Every copy reads its source in stream order (``srcAccessOrder = STREAM``): a store's KV may still be being written
    by work queued before it, a load's host block by an earlier transfer; the batch prefers copy engines that overlap
    with compute.

    Args:
        checker: with the integrity checks, the kernel issuer (its launcher has the checksum table) whose
            checksum-only launch follows each batch on the same stream: it reads the GPU side of the plan's blocks,
            after the copies (a load's destination must hold what was copied; a store's source is unchanged by them),
            and writes (store) or checks (load) the checksums as the kernel path does.

    Raises:
        CudaError: on CUDA, the driver has no ``cuMemcpyBatchAsync`` (before 12.8).
    """

    path = TransferPath.DMA

    def __init__(
        self, spec: KVCacheSpec, host_buffer: torch.Tensor, blocks_per_host_block: int, coalesce=True, checker=None
    ):
        self.planner = DmaPlanner(spec, host_buffer, blocks_per_host_block, coalesce)
        self.device = spec.device
        self.checker = checker
        self._batch = BatchIssuer(spec.device, FLAG_PREFER_OVERLAP_WITH_COMPUTE)

    def copies(self, plan: TransferPlan) -> int:
        """The plan's descriptors (:meth:`DmaPlanner.count`)."""
        return self.planner.count(plan)

    def issue(self, plan: TransferPlan, stream: torch.cuda.Stream | None = None, trace=None):
        """Builds ``plan``'s descriptors and issues them on ``stream`` (None: the current one; on CPU the copies run
        now), then the checksum-only launch where there is a ``checker``. Returns what the device still reads: the
        call (its descriptor arrays, which the driver reads until the copies complete) and the check's slot."""
        src, dst, nbytes = self.planner.descriptors(plan)
        if not self._batch.cuda:
            call = self._batch.call(src, dst, nbytes, plan.direction is Direction.STORE, 0)
            call()
            return call if self.checker is None else (call, self.checker.issue_launch(plan, None, trace, copy=False))
        # The driver call acts in the current context: the caches' device's, whichever device is current.
        with torch.cuda.device(self.device):
            handle = (stream if stream is not None else torch.cuda.current_stream(self.device)).cuda_stream
            call = self._batch.call(src, dst, nbytes, plan.direction is Direction.STORE, handle)
            call()
        if self.checker is None:
            return call
        if trace is not None:
            trace("batch")
        # Same stream, after the batch: the check reads what the copies wrote (loads) or what they read (stores).
        return call, self.checker.issue_launch(plan, stream, trace, copy=False)

    def outcome(self, keep):
        """What the integrity check of a completed load found (None without checks or for a store)."""
        return None if self.checker is None else self.checker.outcome(keep[1])

    def release(self, keep, after=None) -> None:
        """The descriptor arrays go with the call; the check's id slot goes back to its pool."""
        if self.checker is not None:
            self.checker.release(keep[1], after)
