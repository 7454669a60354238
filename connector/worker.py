"""Worker side: vLLM's ``OffloadingWorker`` over our :class:`~triton_offload.engine.TransferEngine` and host cache
(:class:`TritonOffloadingWorker`). vLLM hands the worker its KV caches once, canonicalised (``CanonicalKVCaches``): a
list of int8 tensors ``(num_blocks, page_size_bytes)`` (stride(0) may exceed the page) and, per offloaded KV-cache
group, one ref per layer naming a tensor and the un-padded bytes to move. They become one grouped ``canonical``
:class:`~triton_offload.layouts.KVCacheSpec` (:func:`canonical_kv_spec`); after that every job is one engine submission,
so one kernel launch for all groups, layers and blocks. For a packed allocation (vLLM's DeepSeek-V4 path hands every
group the whole block of every layer) the groups' own pages are found from vLLM's config
(:mod:`~triton_offload.connector.geometry`), so a key stores and moves only its group's bytes. In the FP8 host format
the pages are typed views instead (:mod:`~triton_offload.connector.typed_pages`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from triton_offload.connector.geometry import KVGeometry
from triton_offload.connector.typed_pages import FormatPlan, typed_kv_spec
from triton_offload.engine import LOAD, TransferEngine
from triton_offload.host.cache import HostCache
from triton_offload.host_format import FP8_E4M3
from triton_offload.integrity import OFF
from triton_offload.layouts import HostSlots, KVCacheSpec

__all__ = ["canonical_kv_spec", "LoadError", "TritonOffloadingWorker"]


@dataclass(frozen=True)
class LoadError:
    """The blocks of one load job that failed their integrity check (docs/integrity.md), as this worker saw them.

    Attributes:
        job_id: vLLM's load job.
        gpu_block_ids: the GPU blocks the job wrote them into (vLLM must not use them).
        host_block_ids: the host blocks (chunks) they came from, one per GPU block.
        identities: the identity each was loaded under (its key's), one per GPU block.
        tier: where the worker read them: ``"host cache"`` or ``"CPU tier"`` (vLLM's shared region).
        regions: with host regions (``KVCacheSpec.group_regions``), the region of each host block's key, one per
            GPU block (a row holds one key per region); empty without.
        key_slots: the scheduler's name of each one's key, one per GPU block: its host block id, or with regions
            ``region x rows + host block id`` (``TritonOffloadingManager.key_slots``); empty: the host block ids.
    """

    job_id: int
    gpu_block_ids: tuple[int, ...]
    host_block_ids: tuple[int, ...]
    identities: tuple[int, ...]
    tier: str
    regions: tuple[int, ...] = ()
    key_slots: tuple[int, ...] = ()


logger = logging.getLogger(__name__)


def canonical_kv_spec(
    kv_caches: CanonicalKVCaches,
    *,
    worker_slots: bool = False,
    group_regions=None,
    geometry: KVGeometry | None = None,
) -> KVCacheSpec:
    """One grouped ``canonical`` spec for vLLM's canonical KV caches.

    Each distinct (tensor, un-padded page) pair becomes one entry, sliced to the page so padding is never moved.
    Refs of one group that name the same tensor (layers aliasing one allocation) are moved once, with the largest
    page any of them names; the same tensor may appear in several groups (HMA groups overlaying one another).
    With ``worker_slots``, the host side is vLLM's worker-slot layout (``CPUOffloadingWorker`` over a
    ``SharedOffloadRegion``): a region per canonical tensor, in order, of f full (padded) pages each. Otherwise the
    packed format, with ``group_regions`` (one host region number per group) where given.

    A packed allocation reaches here as one tensor whose whole block every group refs (vLLM's worker role does that
    for block-outermost layouts, DeepSeek-V4's): with ``geometry`` each group then moves only its own layers' pages
    of the block (:func:`packed_group_views`), as vLLM's own worker does since its #56953.

    Raises:
        ValueError: a group without refs, a ref to a tensor that does not exist, or a page larger than its tensor.
    """
    if not worker_slots and geometry is not None:
        split = packed_group_views(kv_caches, geometry)
        if split is not None:
            views, groups = split
            return KVCacheSpec(views, "canonical", groups=groups, group_regions=group_regions)
    tensors = kv_caches.tensors
    views: list[torch.Tensor] = []
    regions: list[int] = []  # the canonical tensor of each entry: its host region in the worker-slot layout
    index: dict[tuple[int, int], int] = {}
    groups: list[list[int]] = []
    for gi, refs in enumerate(kv_caches.group_data_refs):
        pages: dict[int, int] = {}  # tensor index -> bytes to move, in first-seen (layer) order
        for ref in refs:
            if not 0 <= ref.tensor_idx < len(tensors):
                raise ValueError(f"group {gi}: ref to tensor {ref.tensor_idx}, but there are {len(tensors)} tensors")
            pages[ref.tensor_idx] = max(pages.get(ref.tensor_idx, 0), ref.page_size_bytes)
        if not pages:
            raise ValueError(f"KV-cache group {gi} has no layers to offload")
        members = []
        for ti, page in pages.items():
            tensor = tensors[ti].tensor
            if not 0 < page <= tensor.shape[1]:
                raise ValueError(
                    f"group {gi}: page of {page} bytes for tensor {ti} of shape {tuple(tensor.shape)}; expected "
                    f"0 < page <= {tensor.shape[1]}"
                )
            key = (ti, page)
            if key not in index:
                index[key] = len(views)
                views.append(tensor[:, :page])
                regions.append(ti)
            members.append(index[key])
        groups.append(members)
    slots = HostSlots(tuple(t.page_size_bytes for t in tensors), tuple(regions)) if worker_slots else None
    return KVCacheSpec(
        views, "canonical", groups=groups, host_slots=slots, group_regions=None if worker_slots else group_regions
    )


def packed_group_views(
    kv_caches: CanonicalKVCaches, geometry: KVGeometry
) -> tuple[list[torch.Tensor], list[list[int]]] | None:
    """For a packed allocation (one canonical tensor whose whole block every group refs), each group's own bytes:
    ``(views, groups)``, a view of the tensor per run of the group's layers' pages that lie side by side in a block
    (``geometry`` places each layer's page in the block), shared by groups that name the same run. None when the
    caches are not in that form, or ``geometry`` does not place every layer inside the block (then the whole block
    is moved, as before)."""
    tensors, refs = kv_caches.tensors, kv_caches.group_data_refs
    if len(tensors) != 1 or len(refs) != len(geometry.groups) or len(refs) < 2:
        return None
    slab = tensors[0].tensor
    width = slab.shape[1]
    if any([(r.tensor_idx, r.page_size_bytes) for r in group] != [(0, width)] for group in refs):
        return None
    views: list[torch.Tensor] = []
    index: dict[tuple[int, int], int] = {}
    groups: list[list[int]] = []
    for group in geometry.groups:
        runs: list[list[int]] = []  # [column, bytes], the group's layers in order, adjacent pages merged
        for layer in group.layers:
            if layer.column is None or layer.block_stride != width or not 0 <= layer.column <= width - layer.page:
                logger.info(
                    "triton-offload: layer %s of KV-cache group %d is not placed inside the packed block of %d bytes "
                    "(column %s, block stride %s): every group moves the whole block",
                    layer.name,
                    group.group_id,
                    width,
                    layer.column,
                    layer.block_stride,
                )
                return None
            if runs and runs[-1][0] + runs[-1][1] == layer.column:
                runs[-1][1] += layer.page
            else:
                runs.append([layer.column, layer.page])
        members = []
        for column, nbytes in runs:
            if (column, nbytes) not in index:
                index[(column, nbytes)] = len(views)
                views.append(slab[:, column : column + nbytes])
            members.append(index[(column, nbytes)])
        groups.append(members)
    return views, groups


class TritonOffloadingWorker(OffloadingWorker):
    """Stores and loads of one worker, each as ONE launch of our kernel, into a packed host cache.

    Args:
        kv_caches: the worker's canonical KV caches.
        num_host_blocks: host blocks, the same number the scheduler's manager hands out.
        blocks_per_host_block: GPU blocks per host block (vLLM's ``blocks_per_chunk``).
        num_ctas: programs per launch; None for the kernel's default.
        transfer_path: ``"auto"``, ``"kernel"`` or ``"dma"``; None for the engine's default.
        budget_block_bytes: the bytes per host block the budget was divided by; a row that is larger, or much
            smaller, is warned of.
        group_regions: the host region of each KV-cache group (``KVCacheSpec(group_regions=...)``), as the
            scheduler's manager keeps one block pool per region; None: one region.
        geometry: the KV-cache groups read from vLLM's config, to split a packed allocation per group.
        numa_node, huge_pages, pinning: where and how the host cache is allocated and pinned (:class:`HostCache`;
            ``"auto"`` places it on the node of this rank's GPU).
        integrity: ``"off"``, ``"verify"`` or ``"require"`` (docs/integrity.md): with the checks, the host cache keeps
            a checksum table, and the blocks of a load that fail their check are reported by
            :meth:`take_load_errors` (the connector hands them to vLLM as load errors), never as loaded.
        format_plan: with ``host_format = "fp8_e4m3"``, the spec's plan: the pages are then moved as typed views
            (connector/typed_pages.py), quantized; None, or an 8-bit cache's plan: the canonical pages' bytes.
    """

    # Where this worker's host blocks are, for messages about them.
    tier = "host cache"

    # Test hook: a subclass may name another engine class (the spec's ``_worker_class`` picks the subclass).
    # tests/e2e/offload_fault_plugin.py uses both to make one transfer fail inside the engine, to check that a failure
    # stops vLLM and is never reported as a success.
    engine_class: type[TransferEngine] = TransferEngine

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        *,
        num_host_blocks: int,
        blocks_per_host_block: int,
        num_ctas: int | None = None,
        transfer_path: str | None = None,
        budget_block_bytes: int | None = None,
        group_regions=None,
        geometry: KVGeometry | None = None,
        numa_node: str | int = "auto",
        huge_pages: str = "thp",
        pinning: str = "auto",
        integrity: str = OFF,
        format_plan: FormatPlan | None = None,
    ) -> None:
        self.integrity = integrity
        if format_plan is not None and format_plan.host_format == FP8_E4M3:
            self.kv = typed_kv_spec(kv_caches, format_plan, group_regions)
        else:
            self.kv = canonical_kv_spec(kv_caches, group_regions=group_regions, geometry=geometry)
        self.blocks_per_host_block = f = blocks_per_host_block
        host_block_bytes = self.kv.host_block_bytes(f)
        if budget_block_bytes is not None and host_block_bytes > budget_block_bytes:
            logger.warning(
                "a packed host block takes %d bytes, more than the %d bytes per block the budget was divided by: "
                "the host cache exceeds its share of cpu_bytes_to_use",
                host_block_bytes,
                budget_block_bytes,
            )
        elif budget_block_bytes is not None and host_block_bytes < 0.95 * budget_block_bytes:
            # The scheduler counted more bytes per row than this worker's tensors move (padding, layers that alias
            # one another): the rows it sized hold less than the budget allows.
            logger.warning(
                "a packed host block takes %d bytes, %.1f %% of the %d bytes per block the budget was divided by "
                "(%s): %d of this rank's bytes of cpu_bytes_to_use are not used",
                host_block_bytes,
                100 * host_block_bytes / budget_block_bytes,
                budget_block_bytes,
                self.kv,
                num_host_blocks * (budget_block_bytes - host_block_bytes),
            )
        # The scheduler fixed the block count from the budget; the buffer must have exactly that many rows.
        self.host_cache = HostCache(
            host_block_bytes,
            num_blocks=num_host_blocks,
            pin=self.kv.device.type == "cuda",
            numa_node=numa_node,
            huge_pages=huge_pages,
            pinning=pinning,
            device=self.kv.device,
            integrity=integrity,
            checksum_blocks=f,
            checksum_regions=self.kv.num_regions,
        )
        try:
            self._start_engine(self.host_cache.buffer, num_ctas, transfer_path, self.host_cache.checksums)
        except BaseException:
            self.host_cache.close()
            raise
        logger.info(
            "triton-offload worker: host cache %.3f GiB = %d blocks x %d bytes (%d GPU blocks of %d bytes each, "
            "host format %s), %s (%s); %s; num_ctas=%s, transfer path %s",
            self.host_cache.nbytes / 2**30,
            num_host_blocks,
            host_block_bytes,
            f,
            self.kv.bytes_per_block,
            self.kv.host_format,
            "pinned" if self.host_cache.pinned else "pageable (no CUDA)",
            self.host_cache.describe(),
            self.kv,
            "kernel default" if num_ctas is None else num_ctas,
            self.engine.path,
        )

    def _start_engine(
        self, host_buffer: torch.Tensor, num_ctas: int | None, transfer_path: str | None, checksums=None
    ) -> None:
        """The transfer engine between ``self.kv`` and ``host_buffer`` (with the integrity checks, ``checksums`` is
        their :class:`~triton_offload.checksums.Checksums`), and the counters :meth:`get_finished` keeps."""
        checks = {} if checksums is None else {"checksums": checksums}
        self.engine = self.engine_class(
            self.kv,
            host_buffer,
            blocks_per_host_block=self.blocks_per_host_block,
            num_ctas=num_ctas,
            path=transfer_path,
            **checks,
        )
        self.num_ctas = num_ctas
        self.stats = {"store_jobs": 0, "load_jobs": 0, "stored_bytes": 0, "loaded_bytes": 0, "seconds": 0.0}
        # In the FP8 host format, each group's host bytes per GPU block: a job's bytes over the link (what vLLM's
        # kv_offload byte counters report), beside its GPU bytes (the stats' stored / loaded_bytes). None: the same.
        self._wire_group_bytes = None
        if self.kv.quant is not None:
            self._wire_group_bytes = tuple(sum(s.host_nbytes for s in segs) for segs in self.kv.group_segments)
            self.stats |= {"stored_wire_bytes": 0, "loaded_wire_bytes": 0}
        self._wire_bytes: dict[tuple[bool, int], int] = {}
        if self.integrity != OFF:
            self.stats |= {"failed_checks": 0, "unchecked_blocks": 0}
        self._load_errors: list[LoadError] = []
        self._unchecked = 0

    def _host_ids(self, spec: LoadStoreSpec):
        if not isinstance(spec, BlockIDsLoadStoreSpec) or isinstance(spec, GPULoadStoreSpec):
            raise TypeError(f"expected the host block ids of TritonOffloadingSpec's manager, got {spec!r}")
        return spec.block_ids

    def _identities(self, spec: LoadStoreSpec):
        """The identities the scheduler gave the host blocks (their keys'), with the integrity checks."""
        identities = getattr(spec, "identities", None)
        if identities is None:
            raise TypeError(
                f"integrity = {self.integrity!r}, but the scheduler's spec carries no block identities ({spec!r}): "
                "the scheduler and the workers must run the same version and configuration"
            )
        return identities

    def _submit(
        self, job_id: int, gpu: GPULoadStoreSpec, host: LoadStoreSpec, store: bool, expedited: bool = False
    ) -> bool:
        f = self.blocks_per_host_block
        # block_indices[g] is the position of group g's first GPU block in its request: mid host block when the
        # device prefix cache already holds part of a host block (loads) or the leading blocks are null (stores).
        skips = [int(b) % f for b in gpu.block_indices]
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "%s job %d: gpu %s, group_sizes %s, skips %s, host %s",
                "store" if store else "load",
                job_id,
                gpu.block_ids.tolist(),
                list(gpu.group_sizes),
                skips,
                self._host_ids(host).tolist(),
            )
        host_ids, sizes = self._host_ids(host), list(gpu.group_sizes)
        if self._wire_group_bytes is not None:
            self._wire_bytes[(store, job_id)] = sum(n * b for n, b in zip(sizes, self._wire_group_bytes))
        # The identities only with the checks: an engine without them need not take the argument (tests' engines).
        identities = None if self.integrity == OFF else self._identities(host)
        checks = {} if identities is None else {"identities": identities}
        if store:
            self.engine.submit_store(job_id, gpu.block_ids, host_ids, skip=skips, group_sizes=sizes, **checks)
        else:
            self.engine.submit_load(
                job_id, gpu.block_ids, host_ids, skip=skips, group_sizes=sizes, expedited=expedited, **checks
            )
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, src_spec, dst_spec, store=True)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        # vLLM 0.33 marks a synchronous load (budgeted by sync_load_budget_bytes) expedited and then waits for it, and
        # only for it (worker.wait(sync job ids)), before the step's forward pass. It goes on a lane of its own, as
        # vLLM's own worker gives it a handler and stream of their own: on the load lane it would wait for every
        # asynchronous load submitted earlier, and the whole step with it. vLLM 0.32 never passes the flag.
        return self._submit(job_id, dst_spec, src_spec, store=False, expedited=expedited)

    def get_finished(self) -> list[TransferResult]:
        out = []
        for r in self.engine.get_finished():
            is_load = r.direction == LOAD
            if not r.ok:
                # vLLM cannot handle a failed job (it asserts success), and reporting success would hand the model
                # garbage KV: stop loudly instead.
                logger.error("triton-offload %s job %d failed: %s", r.direction, r.job_id, r.error)
                raise RuntimeError(f"triton-offload {r.direction} job {r.job_id} failed: {r.error}")
            self.stats["load_jobs" if is_load else "store_jobs"] += 1
            self.stats["loaded_bytes" if is_load else "stored_bytes"] += r.num_bytes
            wire = self._wire_bytes.pop((not is_load, r.job_id), r.num_bytes)
            if self._wire_group_bytes is not None:
                self.stats["loaded_wire_bytes" if is_load else "stored_wire_bytes"] += wire
            self.stats["seconds"] += r.seconds
            if is_load and self.integrity != OFF:
                self._checked(r)
            # vLLM's kv_offload_{load,store}_bytes: the bytes moved between the GPU and the host (docs/vllm.md).
            out.append(TransferResult(job_id=r.job_id, success=True, transfer_size=wire, transfer_time=r.seconds))
        return out

    def _checked(self, result) -> None:
        """Keeps the blocks of a finished load that failed their integrity check, for :meth:`take_load_errors`: the
        engine's result names each one's GPU block, host block and identity."""
        failed, unchecked = self.engine.load_failures(result)
        self._unchecked += unchecked
        self.stats["unchecked_blocks"] += unchecked
        if not failed.positions.size:
            return
        self.stats["failed_checks"] += int(failed.positions.size)
        regions, slots = (), ()
        if self.kv.group_regions is not None:  # a row holds one key per region: the scheduler names it by both
            region = np.asarray(self.kv.group_regions)[failed.groups]
            regions = tuple(int(r) for r in region)
            slots = tuple(int(k) for k in region * self.engine.host_buffer.shape[0] + failed.host_ids)
        self._load_errors.append(
            LoadError(
                result.job_id,
                tuple(int(b) for b in failed.gpu_ids),
                tuple(int(h) for h in failed.host_ids),
                tuple(int(i) for i in failed.identities),
                self.tier,
                regions,
                slots,
            )
        )

    def take_load_errors(self) -> tuple[list[LoadError], int]:
        """(the load errors found since the last call, blocks loaded unchecked since then): what the connector
        reports to vLLM and counts. A load's errors are here once :meth:`get_finished` reported the job."""
        errors, self._load_errors = self._load_errors, []
        unchecked, self._unchecked = self._unchecked, 0
        return errors, unchecked

    def wait(self, job_ids: Iterable[int]) -> None:
        # vLLM may pass ids of jobs this worker never saw or already reported; the engine ignores those.
        self.engine.wait(job_ids)

    def shutdown(self) -> None:
        t0 = time.perf_counter()
        try:
            self.engine.shutdown()
        finally:
            self.host_cache.close()
            logger.info("triton-offload worker totals: %s (drained in %.3f s)", self.stats, time.perf_counter() - t0)
