"""Worker side of ``TritonTieringOffloadingSpec``: our Triton worker over one worker's slots of vLLM's shared region.
vLLM's tiering keeps its CPU primary tier in a ``SharedOffloadRegion``: one ``/dev/shm`` file that the scheduler (whose
secondary tiers read and write whole chunk rows) and every worker map. A chunk row holds one slot per worker (one slot
in all for the replicated MLA layout); a slot holds, for each canonical tensor in order, ``blocks_per_chunk`` full pages
of that tensor, sub-block j at j x page. :class:`TritonTieringWorker` moves KV between the GPU and exactly those bytes,
with the same kernel as the packed host cache (``HostSlots`` in its segment table), one launch per job for all groups
and layers; the region's file name is handled by :class:`~triton_offload.connector.shm_region.RegionName`.
"""

from __future__ import annotations

import gc
import logging
import time
import weakref

import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from triton_offload.checksums import Checksums
from triton_offload.connector.shm_region import RegionName
from triton_offload.connector.typed_pages import FormatPlan, typed_kv_spec
from triton_offload.connector.worker import TritonOffloadingWorker, canonical_kv_spec
from triton_offload.host.numa import NodeChoice
from triton_offload.host.placement import read_placement
from triton_offload.host.registration import (
    REGISTER_CHUNK_BYTES,
    RegistrationError,
    register_host_range,
    unregister_host_ranges,
)
from triton_offload.host_format import FP8_E4M3
from triton_offload.integrity import OFF, slot_identity

__all__ = ["TritonTieringWorker"]

logger = logging.getLogger(__name__)


class TritonTieringWorker(TritonOffloadingWorker):
    """Stores and loads of one worker into its slots of vLLM's shared region, each as ONE launch of our kernel.

    The placement of every tensor is checked at startup against vLLM's own ``create_next_worker_view``, so a vLLM
    whose layout differs fails here instead of writing bytes other instances would misread.

    Args:
        kv_caches: the worker's canonical KV caches.
        region: this worker's ``SharedOffloadRegion`` (mapped; owned by this worker from now on).
        name: the region's :class:`RegionName`, released at shutdown.
        slot_offset: bytes from a chunk row's start to this worker's slot (rank x slot size; 0 when replicated).
        slot_bytes: bytes vLLM reserves per worker slot (``cpu_page_size_per_worker``).
        blocks_per_chunk: GPU blocks per chunk (f).
        num_ctas: programs per launch; None for the kernel's default.
        transfer_path: ``"auto"``, ``"kernel"`` or ``"dma"``; None for the engine's default.
        pin: register the region with CUDA (default: when the KV caches are on CUDA).
        numa: the node this worker's slots were placed on (the spec built the region on it); the registering threads
            run on its CPUs. None: not bound.
        integrity: ``"off"``, ``"verify"`` or ``"require"`` (docs/integrity.md): with the checks, the last
            ``trailer_bytes`` of the slot hold its row marker and checksums, and each chunk's identity is mixed with
            ``slot`` (the rank's slot: a slot's bytes and trailer copied into another's fail).
        geometry: for the packed layout (``host_layout = "packed"``), the KV-cache groups read from vLLM's config:
            this worker's slot holds our packed format (one key of f blocks of the largest group) instead of vLLM's
            worker slot. None: vLLM's worker slot, checked against vLLM's own views.
        format_plan: with ``host_format = "fp8_e4m3"`` (packed rows only), the spec's plan: the pages move as typed
            views, quantized (connector/typed_pages.py); None, or an 8-bit cache's plan: the canonical pages' bytes.
    """

    tier = "CPU tier"

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        *,
        region: SharedOffloadRegion,
        name: RegionName,
        slot_offset: int,
        slot_bytes: int,
        blocks_per_chunk: int,
        num_ctas: int | None = None,
        transfer_path: str | None = None,
        pin: bool | None = None,
        numa: NodeChoice | None = None,
        integrity: str = OFF,
        trailer_bytes: int = 0,
        slot: int = 0,
        geometry=None,
        format_plan: FormatPlan | None = None,
    ) -> None:
        self.region, self.name = region, name
        self.integrity, self.slot = integrity, slot
        if (integrity != OFF) != (trailer_bytes > 0):
            raise ValueError(f"integrity = {integrity!r} with a {trailer_bytes}-byte trailer: the spec sizes both")
        self.numa = numa or NodeChoice("off", None, why="not bound")
        # Unregistered at shutdown, or by the finalizer (which holds no reference to the worker) if it is dropped.
        self._registered: list[tuple[int, int]] = []
        self._finalizer = weakref.finalize(self, unregister_host_ranges, self._registered)
        packed = geometry is not None
        if format_plan is not None and format_plan.host_format == FP8_E4M3:
            if not packed:
                raise ValueError("host_format = 'fp8_e4m3' writes packed rows: the spec passes the geometry with it")
            self.kv = typed_kv_spec(kv_caches, format_plan)
        else:
            self.kv = canonical_kv_spec(kv_caches, worker_slots=not packed, geometry=geometry)
        self.blocks_per_host_block = f = blocks_per_chunk
        used = self.kv.host_block_bytes(f)
        if used > slot_bytes - trailer_bytes:
            pages = f"pages {list(self.kv.host_slots.pages)}" if not packed else f"groups {list(self.kv.group_bytes)}"
            raise ValueError(
                f"the canonical tensors take {used} bytes per chunk ({f} x {pages}), more than the "
                f"{slot_bytes - trailer_bytes}-byte worker slot the spec sized"
            )
        num_chunks = region.num_chunks
        row = region.total_size_bytes // num_chunks
        self._slot_views(slot_offset, slot_bytes, trailer_bytes, used, row)
        if not packed:  # vLLM's worker slot: placed exactly as vLLM's own worker would place its views
            self._check_against_vllm_views(kv_caches, slot_offset, row)
        # Read back before registration: until then this process maps only the pages it touched, its own slots
        # (registration faults in every worker's).
        self.placement = read_placement(region.base_tensor.data_ptr(), region.total_size_bytes)
        t0 = time.perf_counter()
        self.pinned = self.kv.device.type == "cuda" if pin is None else pin
        if self.pinned:
            self._register_region(row)
        try:
            self._start_engine(self.host, num_ctas, transfer_path, self.checksums)
        except BaseException:
            unregister_host_ranges(self._registered)  # the caller releases the region and its name
            raise
        logger.info(
            "triton-offload tiering worker: shared region %s, %d chunks x %d-byte rows, this worker's slot at byte "
            "%d (%d of %d bytes used, host format %s); %s; this worker's pages: %s; %s; %s; num_ctas=%s, transfer "
            "path %s",
            name.paths[0],
            num_chunks,
            row,
            slot_offset,
            used,
            slot_bytes,
            self.kv.host_format,
            self.numa.why,
            self.placement.describe(),
            f"pinned in {len(self._registered)} chunk(s) in {time.perf_counter() - t0:.3f} s"
            if self.pinned
            else "pageable (no CUDA)",
            self.kv,
            "kernel default" if num_ctas is None else num_ctas,
            self.engine.path,
        )

    def _slot_views(self, slot_offset: int, slot_bytes: int, trailer_bytes: int, used: int, row: int) -> None:
        """This worker's slot of every chunk row as the host buffer (``host``: rows of ``used`` bytes) and, with the
        integrity checks, the slot's trailer as the checksum table (``checksums``: int64 rows of 1 + f, the row
        marker then each sub-block's checksum; None without)."""
        region, f = self.region, self.blocks_per_host_block
        base = region.base_tensor
        self.host = torch.as_strided(base, (region.num_chunks, used), (row, 1), storage_offset=slot_offset)
        self.checksums = None
        if trailer_bytes:
            start = slot_offset + slot_bytes - trailer_bytes
            assert start % 8 == 0 and row % 8 == 0, "the spec aligns trailers to 16 bytes"
            words = base.view(torch.int64)
            shape, strides = (region.num_chunks, 1 + f), (row // 8, 1)
            table = torch.as_strided(words, shape, strides, storage_offset=start // 8)
            self.checksums = Checksums(self.integrity, table, f)

    def _register_region(self, row: int) -> None:
        """Registers the whole region with CUDA, from threads on this worker's node, in chunks of whole rows (no
        transfer straddles two registrations). The kernels dereference the region from the GPU, so pageable memory is
        not an option (vLLM's DMA worker can fall back; we cannot): a refusal stops the startup, once."""
        region = self.region
        try:
            ranges = register_host_range(
                region.base_tensor.data_ptr(),
                region.total_size_bytes,
                chunk_bytes=max(1, REGISTER_CHUNK_BYTES // row) * row,
                what="shared offload region",
                cpus=self.numa.cpus,
                device=self.kv.device.index if self.kv.device.type == "cuda" else None,
            )
        except RegistrationError as e:
            raise RuntimeError(
                f"{e}. TritonTieringOffloadingSpec cannot run without it: its kernels read the region through the "
                "registration, and memory pinned at allocation (cudaHostAlloc, what TritonOffloadingSpec falls back "
                "to with pinning = 'auto') cannot be shared with the scheduler's tiers. Where cudaHostRegister is "
                "refused (Confidential Computing mode, some containers), use spec_name TritonOffloadingSpec"
            ) from e
        self._registered.extend(ranges)

    def _identities(self, spec):
        # Each rank's slot of a chunk is its own: its identity is the chunk's key's, mixed with the slot.
        return slot_identity(super()._identities(spec), self.slot)

    def _check_against_vllm_views(self, kv_caches: CanonicalKVCaches, slot_offset: int, row: int) -> None:
        """vLLM's worker takes one view per canonical tensor, in order, of f pages; ours must start where each of
        those starts (the views also check, with vLLM's own assertion, that the slot holds them all)."""
        f = self.blocks_per_host_block
        if getattr(self.region, "_worker_offset", slot_offset) != slot_offset:
            raise ValueError(f"the region's worker slot starts at byte {self.region._worker_offset}, not {slot_offset}")
        pages = self.kv.host_slots.pages
        host0 = self.host.data_ptr()
        for ti, t in enumerate(kv_caches.tensors):
            view = self.region.create_next_worker_view(t.page_size_bytes * f)
            ours = host0 + f * sum(pages[:ti])
            if view.data_ptr() != ours or view.stride(0) != row:
                raise ValueError(
                    f"canonical tensor {ti}: vLLM's worker view starts at byte {view.data_ptr() - host0} of the slot "
                    f"with row stride {view.stride(0)}, ours at {ours - host0} with {row}: the layouts disagree"
                )

    def shutdown(self) -> None:
        t0 = time.perf_counter()
        try:
            self.engine.shutdown()
        finally:
            # Unregister before the mapping goes away; release the name whatever happened.
            try:
                unregister_host_ranges(self._registered)
                # Our views of the mapping (ours, the engine's and its launcher's) must go before vLLM closes it: it
                # cannot close a buffer still exported. The interpreter's launches leave reference cycles holding
                # views, hence the collection.
                self.host = self.engine = self.checksums = None
                gc.collect()
                self.region.cleanup()
            finally:
                self.name.release()
            logger.info(
                "triton-offload tiering worker totals: %s (drained in %.3f s)", self.stats, time.perf_counter() - t0
            )
