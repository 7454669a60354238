"""The transfer methods the benchmark compares, behind one small interface.

A method ``prepare``s a :class:`TransferCase` once -- descriptor arrays, bound functions, everything that is not the
transfer itself -- and returns a :class:`Prepared` whose ``run()`` issues one transfer asynchronously on the current
stream. Methods are looked up by exact name in :data:`METHODS`.

Every method moves the same bytes: GPU block ``gpu_ids[i]`` of every layer to packed position ``skip + i`` of the
host buffer (host block ``host_ids[p // f]``, sub-block ``p % f``), or back. The copy-engine baselines move a block
as a few contiguous *runs*: one per layer when the layer's K and V of a block are adjacent (block_first, mla), one
per K and per V when they are not (kv_first). The runs come from the prepared ``KVCacheSpec``, not from layout names.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import triton_offload as to
from triton_offload.kernels.copy_blocks import DEFAULT_NUM_CTAS

# isort: split
# Sibling modules: bench/ is on sys.path when this runs as a script (it is not a package).
from cuda_api import CudaApi

__all__ = ["Run", "runs_of", "TransferCase", "Env", "Prepared", "Unavailable", "METHODS", "BASELINE_NAMES"]


@dataclass(frozen=True)
class Run:
    """One contiguous run of bytes per GPU block: block ``b`` at ``base + b * block_stride``, ``nbytes`` long.

    Attributes:
        layer: layer index.
        base: address of block 0's run.
        block_stride: bytes between blocks.
        nbytes: bytes per block.
        host_offset: offset of the run inside a packed GPU-sized sub-block.
        view: (num_blocks, nbytes) uint8 view of the run in the cache tensor.
    """

    layer: int
    base: int
    block_stride: int
    nbytes: int
    host_offset: int
    view: torch.Tensor


def _byte_view(t: torch.Tensor, base: int, rows: int, row_stride: int, nbytes: int) -> torch.Tensor:
    """A (rows, nbytes) uint8 view of t's storage whose row 0 starts at address ``base``."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    return flat.as_strided((rows, nbytes), (row_stride, 1), base - storage.data_ptr())


def runs_of(spec: to.KVCacheSpec) -> list[Run]:
    """The spec's segments, with segments of one layer merged where they are adjacent both on the GPU and on the host
    (K and V of a block_first block): the fewest contiguous copies a copy-engine baseline can issue per block."""
    merged: list[list[int]] = []  # [layer, base, stride, nbytes, host_offset]
    for s in spec.segments:
        last = merged[-1] if merged else None
        if (
            last is not None
            and last[0] == s.layer
            and last[2] == s.block_stride
            and last[1] + last[3] == s.base
            and last[4] + last[3] == s.host_offset
        ):
            last[3] += s.nbytes
        else:
            merged.append([s.layer, s.base, s.block_stride, s.nbytes, s.host_offset])
    return [
        Run(
            layer,
            base,
            stride,
            nbytes,
            host_off,
            _byte_view(spec.kv_caches[layer], base, spec.num_blocks, stride, nbytes),
        )
        for layer, base, stride, nbytes, host_off in merged
    ]


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
    def contiguous_host_ids(self) -> np.ndarray:
        """Consecutive host ids 1..m: what a method that needs one contiguous host range is given."""
        return np.arange(1, 1 + self.host_ids.size, dtype=np.int64)

    def slots(self, host_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(host row, sub-block) of each GPU block: position skip + i, as DESIGN.md defines."""
        pos = self.skip + np.arange(self.n, dtype=np.int64)
        return host_ids[pos // self.f], pos % self.f

    def copy_plan(self, host_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(src, dst, size) of every contiguous copy, block-major, as uint64 arrays of addresses and byte counts."""
        assert self.host.stride(0) == self.f * self.bytes_per_block and self.host.stride(1) == 1
        rows, subs = self.slots(host_ids)
        host_block = self.host.data_ptr() + rows * self.host.stride(0) + subs * self.bytes_per_block  # (n,)
        base = np.array([r.base for r in self.runs], dtype=np.int64)
        stride = np.array([r.block_stride for r in self.runs], dtype=np.int64)
        host_off = np.array([r.host_offset for r in self.runs], dtype=np.int64)
        gpu = base[None, :] + self.gpu_ids[:, None] * stride[None, :]  # (n, runs)
        host = host_block[:, None] + host_off[None, :]
        sizes = np.broadcast_to(np.array([r.nbytes for r in self.runs], dtype=np.int64), gpu.shape)
        src, dst = (gpu, host) if self.store else (host, gpu)
        return (
            src.reshape(-1).astype(np.uint64),
            dst.reshape(-1).astype(np.uint64),
            sizes.reshape(-1).astype(np.uint64),
        )

    def contiguous_host_region(self) -> torch.Tensor:
        """(n, bytes_per_block) view of the host bytes that positions skip..skip+n-1 of :attr:`contiguous_host_ids`
        occupy: one contiguous range because the rows are consecutive and a row is f sub-blocks."""
        start = (int(self.contiguous_host_ids[0]) * self.f + self.skip) * self.bytes_per_block
        return self.host.view(-1)[start : start + self.total_bytes].view(self.n, self.bytes_per_block)


@dataclass
class Env:
    """What the methods may use on this machine.

    Attributes:
        device: where the caches live.
        api: cuda-python access, None without CUDA or without cuda-python.
        api_note: which cuda-python, or why not.
        stream_handle: raw handle of the benchmark's (non-default) CUDA stream; 0 on CPU.
    """

    device: torch.device
    api: CudaApi | None
    api_note: str
    stream_handle: int = 0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class Prepared:
    """A method bound to one case.

    Attributes:
        run: issues the transfer, asynchronously on the current stream.
        host_ids: the host blocks it addresses, or None for a contiguous copy (peak).
        impl: how it is implemented here, for the output.
        emulated: a CUDA-only method replayed on CPU with memmove: its copy plan is checked, it is never timed.
    """

    run: Callable[[], None]
    host_ids: np.ndarray | None
    impl: str
    emulated: bool = False


class Unavailable(Exception):
    """The method cannot run on this machine; the message says why."""


def _memmove_replay(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> Callable[[], None]:
    """Runs a copy plan with memmove on host addresses: how the CPU check exercises the memcpy baselines' address
    arithmetic, which is the part of them that can be wrong."""
    plan = list(zip(dst.tolist(), src.tolist(), sizes.tolist()))

    def run() -> None:
        for d, s, n in plan:
            ctypes.memmove(d, s, n)

    return run


class Triton:
    """Ours: one launch of triton_offload.gather_blocks / scatter_blocks for all blocks and layers."""

    def __init__(self, num_ctas: int | None = None):
        self.num_ctas = num_ctas

    @property
    def effective_ctas(self) -> int:
        return DEFAULT_NUM_CTAS if self.num_ctas is None else self.num_ctas

    def prepare(self, case: TransferCase, env: Env) -> Prepared:
        spec, host, g, h = case.spec, case.host, case.gpu_ids, case.host_ids
        kw = dict(blocks_per_host_block=case.f, skip=case.skip, num_ctas=self.num_ctas)
        if case.store:
            run = lambda: to.gather_blocks(spec, None, g, host, h, **kw)
        else:
            run = lambda: to.scatter_blocks(host, h, spec, None, g, **kw)
        where = "compiled kernel" if env.cuda else "Triton interpreter"
        return Prepared(run, h, f"triton_offload.{'gather' if case.store else 'scatter'}_blocks ({where})")


class MemcpyPerBlock:
    """The original design: one cudaMemcpyAsync per block per run (per K and per V where they are apart)."""

    def prepare(self, case: TransferCase, env: Env) -> Prepared:
        src, dst, sizes = case.copy_plan(case.host_ids)
        if not env.cuda:
            return Prepared(_memmove_replay(src, dst, sizes), case.host_ids, "memmove replay (no CUDA)", emulated=True)
        if env.api is not None:
            copy_each = env.api.memcpy_each(env.stream_handle)
            s, d, n = src.tolist(), dst.tolist(), sizes.tolist()
            return Prepared(lambda: copy_each(s, d, n), case.host_ids, f"cudaMemcpyAsync via {env.api_note}")
        return Prepared(self._torch_views(case), case.host_ids, f"torch copy_ on views ({env.api_note})")

    @staticmethod
    def _torch_views(case: TransferCase) -> Callable[[], None]:
        """The fallback without cuda-python: copy_(non_blocking=True) between prebuilt views, one per copy."""
        host_flat = case.host.view(-1)
        rows, subs = case.slots(case.host_ids)
        pairs = []
        for i, g in enumerate(case.gpu_ids.tolist()):
            block_off = int(rows[i]) * case.host.stride(0) + int(subs[i]) * case.bytes_per_block
            for r in case.runs:
                host_view = host_flat[block_off + r.host_offset : block_off + r.host_offset + r.nbytes]
                gpu_view = r.view[g]
                pairs.append((gpu_view, host_view) if case.store else (host_view, gpu_view))

        def run() -> None:
            for s, d in pairs:
                d.copy_(s, non_blocking=True)

        return run


class MemcpyBatch:
    """vLLM 0.33's store path: one cuMemcpyBatchAsync with every (src, dst, size) descriptor."""

    def prepare(self, case: TransferCase, env: Env) -> Prepared:
        src, dst, sizes = case.copy_plan(case.host_ids)
        if not env.cuda:
            return Prepared(_memmove_replay(src, dst, sizes), case.host_ids, "memmove replay (no CUDA)", emulated=True)
        if env.api is None:
            raise Unavailable(f"needs cuda-python: {env.api_note}")
        reason = env.api.batch_unavailable()
        if reason:
            raise Unavailable(reason)
        run = env.api.memcpy_batch(src.tolist(), dst.tolist(), sizes.tolist(), case.store, env.stream_handle)
        return Prepared(run, case.host_ids, f"cuMemcpyBatchAsync via {env.api_note}")


class TorchStaged:
    """Gather on the GPU with index_select (per run) into one contiguous (n, bytes_per_block) staging buffer in packed
    order, then one copy_ to pinned memory; the reverse for loads (one copy_, then index_copy_ per run).

    One copy_ needs one contiguous host range, so this method is given consecutive host blocks
    (:attr:`TransferCase.contiguous_host_ids`); the others get random ones.
    """

    def prepare(self, case: TransferCase, env: Env) -> Prepared:
        n, bpb = case.n, case.bytes_per_block
        staging = case.staging[: n * bpb].view(n, bpb)
        host_region = case.contiguous_host_region()
        cols = [staging[:, r.host_offset : r.host_offset + r.nbytes] for r in case.runs]
        views = [r.view for r in case.runs]
        g_np, device = case.gpu_ids, case.device

        def store() -> None:
            g = torch.from_numpy(g_np).to(device, non_blocking=True)
            for view, col in zip(views, cols):
                torch.index_select(view, 0, g, out=col)
            host_region.copy_(staging, non_blocking=True)

        def load() -> None:
            g = torch.from_numpy(g_np).to(device, non_blocking=True)
            staging.copy_(host_region, non_blocking=True)
            for view, col in zip(views, cols):
                view.index_copy_(0, g, col)

        impl = f"index_select/index_copy_ per run + one copy_, {len(case.runs)} runs"
        return Prepared(store if case.store else load, case.contiguous_host_ids, impl)


class Peak:
    """The link's practical ceiling: one contiguous pinned copy_ of the same number of bytes."""

    def prepare(self, case: TransferCase, env: Env) -> Prepared:
        host = case.host.view(-1)[: case.total_bytes]
        dev = case.staging[: case.total_bytes]
        if case.store:
            run = lambda: host.copy_(dev, non_blocking=True)
        else:
            run = lambda: dev.copy_(host, non_blocking=True)
        return Prepared(run, None, "one contiguous copy_ (cudaMemcpyAsync)" if env.cuda else "one contiguous copy_")


# Baselines by exact name; "triton" is built per num_ctas by the driver.
METHODS = {
    "triton": Triton,
    "memcpy_per_block": MemcpyPerBlock,
    "memcpy_batch": MemcpyBatch,
    "torch_staged": TorchStaged,
    "peak": Peak,
}
BASELINE_NAMES = ("memcpy_batch", "memcpy_per_block", "torch_staged")
