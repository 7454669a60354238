"""What every transfer method sees: one case (:class:`TransferCase`) and what a method returns once prepared
(:class:`Prepared`); and what the serving benchmark's engines move blocks between (:class:`OffloadTarget`). A method
``prepare``s a case once -- descriptor arrays, bound functions, everything that is not the transfer itself -- and
returns a :class:`Prepared` whose ``run()`` issues one transfer asynchronously on the current stream.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import triton_offload as to
from bench.common.env import Env
from triton_offload.host.cache import HostCache
from triton_offload.issuers.dma import DmaPlanner, group_runs
from triton_offload.plan import Direction, TransferPlan, TransferPlanner

__all__ = ["Run", "byte_runs", "TransferCase", "Prepared", "Unavailable", "memmove_replay", "OffloadTarget"]


@dataclass(frozen=True)
class Run:
    """One run of the library's descriptor planner (:func:`triton_offload.issuers.dma.group_runs`: a block's contiguous
    bytes in one layer) as the checks and the torch baselines see it.

    Attributes:
        layer: the layer it belongs to.
        host_offset: where it starts in a packed block.
        view: (num_blocks, nbytes) uint8 view of the run in the cache tensor.
    """

    layer: int
    host_offset: int
    view: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.view.shape[1]


def _byte_view(t: torch.Tensor, base: int, rows: int, row_stride: int, nbytes: int) -> torch.Tensor:
    """A (rows, nbytes) uint8 view of t's storage whose row 0 starts at address ``base``."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    return flat.as_strided((rows, nbytes), (row_stride, 1), base - storage.data_ptr())


def byte_runs(spec: to.KVCacheSpec) -> list[Run]:
    """The library's runs of the spec (its descriptors' per-block copies), with a byte view of each."""
    first = {s.base: s for s in spec.segments}  # a run starts where its first segment does
    out = []
    for runs in group_runs(spec, 1):
        for base, stride, nbytes, host_start in zip(*(a.tolist() for a in (runs.base, runs.block_stride, runs.nbytes,
                                                                            runs.host_start))):  # fmt: skip
            layer = first[base].layer
            out.append(Run(layer, host_start, _byte_view(spec.kv_caches[layer], base, spec.num_blocks, stride, nbytes)))
    return out


@dataclass
class TransferCase:
    """One transfer as every method sees it.

    Every method moves the same bytes: GPU block ``gpu_ids[i]`` of every layer to packed position ``skip + i`` of the
    host buffer (host block ``host_ids[p // f]``, sub-block ``p % f``), or back. The case is planned and its copies are
    described by the library (:class:`~triton_offload.plan.TransferPlanner`,
    :class:`~triton_offload.issuers.dma.DmaPlanner`): a block moves as a few contiguous *runs*, one per layer where the
    layer's K and V of a block are adjacent (block_first, mla), one per K and per V where they are not (kv_first).

    Attributes:
        spec: the prepared KV caches.
        runs: :func:`byte_runs` of the spec.
        host: (num_host_blocks, f * bytes_per_block) uint8 view of the pinned host buffer (row stride = row size).
        gpu_ids: (n,) distinct GPU block ids: the sources of a store, the destinations of a load.
        host_ids: (ceil((skip + n) / f),) distinct random host block ids.
        f: GPU blocks per host block.
        skip: sub-blocks of the first host block left alone.
        store: True for GPU -> host.
        staging: flat uint8 device buffer of at least n * bytes_per_block (torch_staged, peak).
        data_ids: the GPU blocks whose bytes the transfer carries: gpu_ids for a store; for a load, the blocks a
            previous store packed into the host buffer (used by the checks only).
    """

    spec: to.KVCacheSpec
    runs: list[Run]
    host: torch.Tensor
    gpu_ids: np.ndarray
    host_ids: np.ndarray
    f: int
    skip: int
    store: bool
    staging: torch.Tensor
    data_ids: np.ndarray

    @property
    def n(self) -> int:
        return int(self.gpu_ids.size)

    @property
    def bytes_per_block(self) -> int:
        return self.spec.bytes_per_block

    @property
    def total_bytes(self) -> int:
        return self.n * self.bytes_per_block

    @property
    def device(self) -> torch.device:
        return self.spec.device

    @property
    def direction(self) -> str:
        return "store" if self.store else "load"

    @property
    def contiguous_host_ids(self) -> np.ndarray:
        """Consecutive host ids 1..m: what a method that needs one contiguous host range is given."""
        return np.arange(1, 1 + self.host_ids.size, dtype=np.int64)

    def plan(self) -> TransferPlan:
        """The case as the library plans it (checked by :class:`~triton_offload.plan.TransferPlanner`)."""
        planner = TransferPlanner(self.spec, self.host.shape[0], self.f)
        return planner.plan(self.gpu_ids, self.host_ids, direction=Direction(self.direction), skip=self.skip)

    def descriptors(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(src, dst, bytes) of every contiguous copy, as uint64 arrays: the library's descriptors, one per run and
        block, run-major (``DmaPlanner(coalesce=False)``), as vLLM's worker builds them."""
        return DmaPlanner(self.spec, self.host, self.f, coalesce=False).descriptors(self.plan())

    def contiguous_host_region(self) -> torch.Tensor:
        """(n, bytes_per_block) view of the host bytes that positions skip..skip+n-1 of :attr:`contiguous_host_ids`
        occupy: one contiguous range because the rows are consecutive and a row is f sub-blocks."""
        start = (int(self.contiguous_host_ids[0]) * self.f + self.skip) * self.bytes_per_block
        return self.host.view(-1)[start : start + self.total_bytes].view(self.n, self.bytes_per_block)


@dataclass
class Prepared:
    """A method bound to one case.

    Attributes:
        run: issues the transfer, asynchronously on the current stream.
        host_ids: the host blocks it addresses, or None for a contiguous copy (peak).
        impl: how it is implemented here, for the output.
        emulated: a CUDA-only method replayed on CPU with memmove: its copy plan is checked, it is never timed.
        host_subs: where the method keeps host blocks when not in ``case.host``: a ``(rows * f, bytes_per_block)``
            table of packed sub-blocks with ``shape``, ``fill_``, ``copy_`` and ``to`` (``vllm_native``'s region).
        device_ms: for a method that times its own transfers (an engine's jobs, on a stream of its own):
            ``device_ms(k)`` waits for every call so far and returns the device milliseconds of the last ``k``, which
            the timer then uses instead of its events; None: the timer's events bracket each call.
    """

    run: Callable[[], None]
    host_ids: np.ndarray | None
    impl: str
    emulated: bool = False
    host_subs: object | None = None
    device_ms: Callable[[int], list[float]] | None = None


class Unavailable(Exception):
    """The method cannot run on this machine; the message says why."""


def memmove_replay(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> Callable[[], None]:
    """Runs a copy plan with memmove on host addresses: how the CPU check exercises the memcpy baselines' address
    arithmetic, which is the part of them that can be wrong."""
    plan = list(zip(dst.tolist(), src.tolist(), sizes.tolist()))

    def run() -> None:
        for d, s, n in plan:
            ctypes.memmove(d, s, n)

    return run


@dataclass
class OffloadTarget:
    """What the serving benchmark's engines move blocks between: one worker's KV caches and its host cache.

    Attributes:
        kv: the prepared KV caches.
        host_cache: the pinned (on CUDA) packed host buffer, one GPU block per host block.
        env: the machine (the CUDA driver for the batch methods).
    """

    kv: to.KVCacheSpec
    host_cache: HostCache
    env: Env

    @property
    def host_buffer(self) -> torch.Tensor:
        return self.host_cache.buffer
