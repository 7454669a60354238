"""What every transfer method sees: one case (:class:`TransferCase`), the machine (:class:`Env`), and what a method
returns once prepared (:class:`Prepared`).

A method ``prepare``s a case once -- descriptor arrays, bound functions, everything that is not the transfer itself --
and returns a :class:`Prepared` whose ``run()`` issues one transfer asynchronously on the current stream.

Every method moves the same bytes: GPU block ``gpu_ids[i]`` of every layer to packed position ``skip + i`` of the
host buffer (host block ``host_ids[p // f]``, sub-block ``p % f``), or back. The copy-engine baselines move a block
as a few contiguous *runs*: one per layer when the layer's K and V of a block are adjacent (block_first, mla), one
per K and per V when they are not (kv_first). The runs come from the prepared ``KVCacheSpec``'s segments, not from
layout names.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import triton_offload as to
from triton_offload.layouts import Segment

__all__ = ["Run", "runs_of", "TransferCase", "copy_plan", "Prepared", "Unavailable", "memmove_replay"]


@dataclass(frozen=True)
class Run(Segment):
    """A :class:`~triton_offload.layouts.Segment` (merged with its neighbours where they are adjacent on both sides),
    with a byte view of it for the checks and the torch baselines.

    Attributes:
        view: (num_blocks, nbytes) uint8 view of the run in the cache tensor.
    """

    view: torch.Tensor


def _byte_view(t: torch.Tensor, base: int, rows: int, row_stride: int, nbytes: int) -> torch.Tensor:
    """A (rows, nbytes) uint8 view of t's storage whose row 0 starts at address ``base``."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    return flat.as_strided((rows, nbytes), (row_stride, 1), base - storage.data_ptr())


def runs_of(spec: to.KVCacheSpec) -> list[Run]:
    """The spec's segments, with segments of one layer merged where they are adjacent both on the GPU and on the host
    (K and V of a block_first block): the fewest contiguous copies a copy-engine baseline can issue per block."""
    merged: list[Segment] = []
    for s in spec.segments:
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.layer == s.layer
            and last.block_stride == s.block_stride
            and last.base + last.nbytes == s.base
            and last.host_offset + last.nbytes == s.host_offset
        ):
            merged[-1] = dataclasses.replace(last, nbytes=last.nbytes + s.nbytes)
        else:
            merged.append(s)
    views = [_byte_view(spec.kv_caches[s.layer], s.base, spec.num_blocks, s.block_stride, s.nbytes) for s in merged]
    return [Run(**dataclasses.asdict(s), view=v) for s, v in zip(merged, views)]


@dataclass
class TransferCase:
    """One transfer as every method sees it.

    Attributes:
        spec: the prepared KV caches.
        runs: :func:`runs_of` the spec.
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

    def slots(self, host_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(host row, sub-block) of each GPU block: position skip + i (the packed format's position rule)."""
        return slots(host_ids, self.n, self.f, self.skip)

    def copy_plan(self, host_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(src, dst, size) of every contiguous copy, block-major, as uint64 arrays of addresses and byte counts."""
        return copy_plan(self.runs, self.host, self.gpu_ids, host_ids, f=self.f, skip=self.skip, store=self.store)

    def contiguous_host_region(self) -> torch.Tensor:
        """(n, bytes_per_block) view of the host bytes that positions skip..skip+n-1 of :attr:`contiguous_host_ids`
        occupy: one contiguous range because the rows are consecutive and a row is f sub-blocks."""
        start = (int(self.contiguous_host_ids[0]) * self.f + self.skip) * self.bytes_per_block
        return self.host.view(-1)[start : start + self.total_bytes].view(self.n, self.bytes_per_block)


def slots(host_ids: np.ndarray, n: int, f: int, skip: int) -> tuple[np.ndarray, np.ndarray]:
    """(host row, sub-block) of each of n GPU blocks: position skip + i (the packed format's position rule)."""
    pos = skip + np.arange(n, dtype=np.int64)
    return host_ids[pos // f], pos % f


def copy_plan(
    runs: list[Run], host: torch.Tensor, gpu_ids: np.ndarray, host_ids: np.ndarray, *, f: int, skip: int, store: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src, dst, size) of every contiguous copy of a transfer, block-major, as uint64 arrays of addresses and byte
    counts: vectorised over the runs (no Python loop over blocks or layers), as a worker builds its descriptors.

    Args:
        runs: :func:`runs_of` the KV caches.
        host: (num_host_blocks, f * bytes_per_block) uint8 host buffer, rows contiguous.
        gpu_ids: (n,) GPU block ids; position ``skip + i`` of the host blocks ``host_ids`` holds block ``gpu_ids[i]``.
    """
    bytes_per_block = host.shape[1] // f
    assert host.stride(0) == f * bytes_per_block and host.stride(1) == 1
    rows, subs = slots(host_ids, gpu_ids.size, f, skip)
    host_block = host.data_ptr() + rows * host.stride(0) + subs * bytes_per_block  # (n,)
    base = np.array([r.base for r in runs], dtype=np.int64)
    stride = np.array([r.block_stride for r in runs], dtype=np.int64)
    host_off = np.array([r.host_offset for r in runs], dtype=np.int64)
    gpu = base[None, :] + gpu_ids[:, None] * stride[None, :]  # (n, runs)
    host_addr = host_block[:, None] + host_off[None, :]
    sizes = np.broadcast_to(np.array([r.nbytes for r in runs], dtype=np.int64), gpu.shape)
    src, dst = (gpu, host_addr) if store else (host_addr, gpu)
    return (
        src.reshape(-1).astype(np.uint64),
        dst.reshape(-1).astype(np.uint64),
        sizes.reshape(-1).astype(np.uint64),
    )


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
    """

    run: Callable[[], None]
    host_ids: np.ndarray | None
    impl: str
    emulated: bool = False
    host_subs: object | None = None


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
