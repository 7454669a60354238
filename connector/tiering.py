"""``TritonTieringOffloadingSpec``: vLLM's tiering (CPU primary tier plus ``fs`` / ``obj`` / ``p2p`` / ... secondary
tiers) with our Triton worker as its GPU <-> CPU step. Scheduler side, everything is vLLM's ``TieringOffloadingSpec``,
unchanged: its ``TieringOffloadingManager``, its ``SharedOffloadRegion`` and its secondary tiers. Worker side,
:class:`~triton_offload.connector.tiering_worker.TritonTieringWorker` replaces vLLM's ``CPUOffloadingWorker`` (DMA
batches, CUDA only): one kernel launch per job, writing exactly the bytes vLLM's worker would, in this worker's slots of
the same region. So blocks that reach a secondary tier are byte-compatible with vLLM's native tiering: two instances,
one on each, may share an ``fs`` ``root_dir`` (its namespace does not include the spec's name) with
``"config_fingerprint": "off"`` (by default ours carries the configuration fingerprint). What differs from vLLM's spec,
all at startup, is listed in the class's docstring.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    LookupResult,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from triton_offload.connector import TIERING_SPEC_NAME, route_logs_through_vllm
from triton_offload.connector.compat import check_multi_connector, host_memory_note
from triton_offload.connector.fingerprint import INFO_KEY, spec_fingerprint, with_fingerprint_label
from triton_offload.connector.fs_root import make_private_root_dir, warn_if_shared
from triton_offload.connector.geometry import geometry_for
from triton_offload.connector.load_errors import check_reporting, integrity_metric_definitions, reporting_connector
from triton_offload.connector.network_tiers import check_reachable, where
from triton_offload.connector.shm_region import RegionName, region_paths, unlink_paths
from triton_offload.connector.tiering_config import TritonTieringConfig
from triton_offload.host.budget import check_host_memory
from triton_offload.host.numa import check_node_memory, choose_node, run_on_node
from triton_offload.host_format import FORMAT_VERSIONS, FP8_E4M3, NATIVE
from triton_offload.integrity import OFF, VERSION, CarriesIdentities, digests_of_keys

__all__ = ["TIERING_SPEC_NAME", "TritonTieringOffloadingSpec"]

logger = logging.getLogger(__name__)

# What the packed layout adds to the model name the secondary tiers build their namespace from (vLLM's FileMapper:
# fs directory names, obj keys, the p2p handshake): its rows are not vLLM's, and must never be read as vLLM's.
PACKED_NAMESPACE = "+triton-offload-packed-v1"
# With the integrity checks, the tiers' namespace (vLLM's FileMapper names files and objects, and p2p peers compare
# it, from the model name) gets this suffix: the rows carry trailers, so their files and objects must never mix with
# those of a layout without them (vLLM's fs tier deletes a file shorter than a row).
INTEGRITY_NAMESPACE = f"+triton-offload-integrity-v{VERSION}"
# With host_format = "fp8_e4m3", another suffix (whatever config_fingerprint says: "off" or a label would otherwise
# let a native engine read FP8 rows): the rows hold FP8 values and scales, in that format's version.
FP8_NAMESPACE = f"+triton-offload-{FP8_E4M3}-v{FORMAT_VERSIONS[FP8_E4M3]}"
# Bytes between the trailer's entries and the slot's start are aligned to this.
_TRAILER_ALIGN = 16


def trailer_bytes(blocks_per_chunk: int) -> int:
    """Bytes of a worker slot's trailer with the integrity checks: the row marker and one checksum per sub-block
    (int64 each), rounded up to 16 bytes."""
    return -(-8 * (1 + blocks_per_chunk) // _TRAILER_ALIGN) * _TRAILER_ALIGN


def _check_region_memory(nbytes: int, setting: str, kv_caches: CanonicalKVCaches) -> None:
    try:
        check_host_memory(nbytes, setting)
    except ValueError as e:
        raise ValueError(f"{e}{host_memory_note(kv_caches)}") from None


class TritonTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's tiering with the Triton worker as its GPU <-> CPU step.

    ``kv_connector_extra_config``: every key of vLLM's ``TieringOffloadingSpec`` (``cpu_bytes_to_use``,
    ``eviction_policy``, ``cache_policy_module_path``, ``secondary_tiers``, ``backpressure``, ...; see
    :data:`TIERING_KEYS` and docs/tiering.md) plus ``num_ctas``, ``transfer_path`` and ``numa_node``
    (:data:`OUR_TIERING_KEYS`).

    Differences from vLLM's spec, all at startup: the configuration is checked before anything is allocated, with a
    ``ValueError`` naming the key (vLLM reports a bad tier late, some as a bare ``TypeError``); an ``fs`` tier's
    missing ``root_dir`` is created 0700, so its KV files are private (:mod:`~triton_offload.connector.fs_root`), and a
    shared existing one is warned of; ``cpu_bytes_to_use`` also takes sizes such as ``"40GiB"`` and is checked against
    the memory available; ``num_ctas`` and ``transfer_path`` are ours; ``canonical_layout`` is refused (the Triton
    worker writes vLLM's direct worker-slot layout only); the network tiers' keys are checked too, and an object store
    that does not answer stops the startup naming it (:mod:`~triton_offload.connector.network_tiers`); the CPU platform
    is supported (the kernels run through Triton's interpreter); the region's ``/dev/shm`` file is removed on every
    exit path (:class:`~triton_offload.connector.shm_region.RegionName`); and the tiers' namespace (and, with the
    integrity checks, each block's identity) carries the configuration's fingerprint (``config_fingerprint``:
    :mod:`~triton_offload.connector.fingerprint`), so blocks another configuration of the model stored are misses.
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        # vLLM may build the metrics (front-end process) before any spec exists: check the configuration first, so a
        # bad tier is reported the same way everywhere.
        TritonTieringConfig.from_extra_config(extra_config)
        return {**super().build_metric_definitions(extra_config), **integrity_metric_definitions()}

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:  # vLLM >= 0.33
        """vLLM's labels of ``vllm:kv_offload_config_info`` and the configuration fingerprint's digest."""
        return (*super().config_info_keys(extra_config), INFO_KEY)

    def __init__(self, config: OffloadingConfig):
        route_logs_through_vllm()
        self.tiering_config = cfg = TritonTieringConfig.from_extra_config(config.extra_config)  # refuses canonical
        self.reports_load_errors = reporting_connector()
        self.geometry = geometry_for(config)
        if self.geometry is not None:
            check_multi_connector(self.geometry.kv_connector)
        self.format_plan = self._format_plan(config)
        host_format = NATIVE if self.format_plan is None else self.format_plan.host_format
        # vLLM's spec reads int(cpu_bytes_to_use): hand it the parsed size ("40GiB" is ours).
        config = replace(config, extra_config={**config.extra_config, "cpu_bytes_to_use": cfg.cpu_bytes_to_use})
        self.fingerprint = spec_fingerprint(
            config,
            None if self.geometry is None else self.geometry.fingerprint,
            cfg.config_fingerprint,
            host_layout=cfg.host_layout,
            integrity=OFF if cfg.integrity == OFF else f"v{VERSION}",
            blocks_per_chunk=config.cache.blocks_per_chunk,
            host_format=host_format,
        )
        if self.fingerprint is not None:
            # The tiers' namespace (fs directories, obj keys, the p2p handshake) is built from the model name: blocks
            # of another configuration are then misses, never loads.
            name = config.model.name + self.fingerprint.namespace
            config = replace(config, model=replace(config.model, name=name))
        if cfg.host_layout == "packed":
            if self.geometry is None or len(self.geometry.groups) != len(config.groups):
                raise ValueError(
                    "host_layout = 'packed' sizes the rows from the KV-cache groups' bytes, which this process could "
                    "not read from vLLM's config (the plugin's entry point did not run: install the package, or "
                    "leave host_layout at 'worker_slots')"
                )
            # The secondary tiers name what they persist after the model (vLLM's FileMapper, also the p2p
            # handshake): packed rows get a namespace of their own, never read as vLLM's worker slots.
            config = replace(config, model=replace(config.model, name=config.model.name + PACKED_NAMESPACE))
        if host_format == FP8_E4M3:
            config = replace(config, model=replace(config.model, name=config.model.name + FP8_NAMESPACE))
        if cfg.integrity != OFF:
            # Another namespace for the tiers (files, objects, peers): the rows of this layout carry trailers.
            config = replace(config, model=replace(config.model, name=config.model.name + INTEGRITY_NAMESPACE))
        super().__init__(config)
        self.native_chunks = self.num_chunks
        if cfg.host_layout == "packed":
            self._size_packed_rows(config)
        self.trailer_bytes = 0
        if cfg.integrity != OFF and config.worker_kv_bytes_per_block > 0:
            self._add_trailers()  # after the packed rows are sized: the trailer follows either slot's pages
        if config.worker_kv_bytes_per_block > 0 and self.num_chunks <= 0:
            raise ValueError(
                f"cpu_bytes_to_use = {cfg.cpu_bytes_to_use} bytes is less than one chunk of "
                f"{self.kv_bytes_per_chunk} bytes (blocks_per_chunk = {self.blocks_per_chunk}, every worker's slot)"
            )
        # Once the rest is checked, and before vLLM's fs tier (built by get_manager) creates them with the umask
        # and fills them with KV files.
        for i, root in cfg.root_dirs:
            make_private_root_dir(root, where(i, "root_dir"))
        self._publish_cpu_info()  # once, from the rows as sized above (packed, trailers), with the fingerprint's label
        self._worker: OffloadingWorker | None = None

    def _add_trailers(self) -> None:
        """The integrity checks' layout (version 1): each worker slot grows by a trailer after its pages, which holds
        the slot's row marker and one checksum per sub-block, so that every tier carries them with the bytes. vLLM
        sized the slots and rows from ``worker_kv_bytes_per_block``; both sides recompute them the same way here.

        The CPU tier keeps the number of chunks vLLM gave it from ``cpu_bytes_to_use``: the checks must never cost an
        intact chunk its place (issue 41, "nothing lost"), so the region grows by what the trailers add to each row
        (the trailer and the rounding of the row to a memory page: at most 4 KiB + 48 bytes per chunk), as the host
        cache spec's checksum table is kept outside its budget. The region's actual size is what is checked against
        the machine's memory (``create_worker``)."""
        copies = max(1, self.kv_bytes_per_chunk // max(1, self.cpu_page_size_per_worker))
        num_copies = 1 if self.replicated_layout else max(1, self.config.parallel.world_size)
        assert copies >= num_copies, "vLLM's rows hold one slot per copy"
        unchecked = self.kv_bytes_per_chunk
        self.trailer_bytes = trailer_bytes(self.blocks_per_chunk)
        pages = -(-self.cpu_page_size_per_worker // _TRAILER_ALIGN) * _TRAILER_ALIGN
        self.cpu_page_size_per_worker = pages + self.trailer_bytes
        self.kv_bytes_per_chunk = -(-num_copies * self.cpu_page_size_per_worker // self.BLOCK_SIZE_ALIGNMENT) * (
            self.BLOCK_SIZE_ALIGNMENT
        )
        if self.kv_bytes_per_chunk != unchecked:
            logger.info(
                "triton-offload tiering: the integrity checks' trailers grow each row from %d to %d bytes; the CPU "
                "tier keeps its %d chunks, so its region is %d bytes (cpu_bytes_to_use = %d)",
                unchecked,
                self.kv_bytes_per_chunk,
                self.num_chunks,
                self.num_chunks * self.kv_bytes_per_chunk,
                self.tiering_config.cpu_bytes_to_use,
            )

    def format_facts(self) -> tuple[str, int, int]:
        """(the rows' host format, the tokens the CPU tier holds, the chunks the native format would give for the same
        ``cpu_bytes_to_use``)."""
        fmt = NATIVE if self.format_plan is None else self.format_plan.host_format
        return fmt, self.num_chunks * self.blocks_per_chunk * max(self.tokens_per_block), self.native_chunks

    def _format_plan(self, config: OffloadingConfig):
        """With ``host_format = "fp8_e4m3"``, what the packed rows hold, read from vLLM's specs
        (connector/typed_pages.py, as TritonOffloadingSpec does); refused where they cannot be read exactly. None for
        the native format."""
        if self.tiering_config.host_format == NATIVE:
            return None
        from triton_offload.connector.typed_pages import cpu_platform, format_plan  # torch: not before it is used

        plan = format_plan(self.geometry, config.kv_cache_layout, cpu_platform())
        if plan.host_format == NATIVE:
            logger.info(
                "triton-offload tiering: host_format = 'fp8_e4m3' with an 8-bit KV cache: its bytes move unchanged"
            )
        return plan

    def _size_packed_rows(self, config: OffloadingConfig) -> None:
        """vLLM sized the region from ``worker_kv_bytes_per_block``: one worker slot holds every canonical tensor's
        page, so a key of one KV-cache group reserves every group's bytes (vLLM's #56871). Packed rows hold one key
        of f blocks of the largest group instead (vLLM's manager keeps one pool of slots for every group), in the
        host format's bytes (``native_chunks``: the chunks the native format would give, for the log)."""
        f = self.blocks_per_chunk
        group_bytes = self.geometry.group_bytes if self.format_plan is None else self.format_plan.group_bytes
        self.cpu_page_size_per_worker = f * max(group_bytes)
        self.kv_bytes_per_chunk = self._chunk_bytes(config, self.cpu_page_size_per_worker)
        self.num_chunks = self.tiering_config.cpu_bytes_to_use // self.kv_bytes_per_chunk
        native = self._chunk_bytes(config, f * max(self.geometry.group_bytes))
        self.native_chunks = self.tiering_config.cpu_bytes_to_use // native

    def _chunk_bytes(self, config: OffloadingConfig, slot_bytes: int) -> int:
        """A chunk row of every worker's slot (one when replicated), aligned as vLLM's region aligns rows."""
        from vllm.utils.math_utils import round_up

        copies = 1 if self.replicated_layout else max(1, config.parallel.world_size)
        return round_up(slot_bytes * copies, self.BLOCK_SIZE_ALIGNMENT)

    def _publish_cpu_info(self) -> None:
        """vLLM >= 0.33 publishes the CPU tier's capacity as metrics (``cpu_info``): from the rows as sized here."""
        if hasattr(self, "cpu_info"):
            from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo

            info = CPUOffloadingInfo.from_config(self.config, self.num_chunks, self.kv_bytes_per_chunk)
            self.cpu_info = with_fingerprint_label(info, self.fingerprint)

    def get_manager(self) -> OffloadingManager:
        """vLLM's ``TieringOffloadingManager``, unchanged, once every object store has answered; then the region's
        name is dropped (see ``RegionName``). With the integrity checks, its load and store specs also carry each
        chunk's identity (its key's: :func:`attach_identities`)."""
        if self._manager is not None:
            return self._manager
        check_reporting(self, self.tiering_config.integrity)
        path = f"/dev/shm/vllm_offload_{self._engine_id}.mmap"  # SharedOffloadRegion's name for this engine
        for i, root in self.tiering_config.root_dirs:  # once per instance: only the scheduler builds the tiers
            warn_if_shared(root, where(i, "root_dir"))
        try:
            check_reachable(self.tiering_config.object_stores)
            manager = super().get_manager()
            if self.tiering_config.integrity != OFF:
                attach_identities(manager, b"" if self.fingerprint is None else self.fingerprint.person)
        except BaseException:
            # The engine will not start: the region's workers may have created the name, nobody needs it now.
            unlink_paths([path])
            raise
        region: SharedOffloadRegion = self._scheduler_mmap
        if getattr(region, "_creator", False):
            # Workers have not mapped it yet (not vLLM's startup order, but possible outside an engine): keep the
            # name for them; vLLM's cleanup removes it at shutdown, the guard if this process dies first.
            self._region_name = RegionName(region, take_over=False)
        else:
            # vLLM builds the scheduler after every worker has registered its KV caches (so mapped the region):
            # nobody opens it by name any more.
            unlink_paths(region_paths(region))
        logger.info(
            "triton-offload tiering scheduler: %d chunks of %d GPU block(s) (%d bytes per row, all workers; %s), "
            "host format %s: %d tokens in the CPU tier (native: %d chunks), eviction_policy=%s, secondary tiers %s; "
            "region %s",
            self.num_chunks,
            self.blocks_per_chunk,
            self.kv_bytes_per_chunk,
            "vLLM's worker slots"
            if self.tiering_config.host_layout == "worker_slots"
            else "packed rows of the largest KV-cache group",
            *self.format_facts(),
            self.tiering_config.eviction_policy,
            list(self.tiering_config.secondary_tiers),
            region.mmap_path,
        )
        return manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        # vLLM's CPUOffloadingSpec.get_worker refuses platforms other than CUDA/XPU: ours runs anywhere Triton does.
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    @staticmethod
    def _worker_class() -> type[OffloadingWorker]:
        """The worker built by :meth:`create_worker`; a subclass of ours may substitute another (tests do)."""
        from triton_offload.connector.tiering_worker import TritonTieringWorker  # torch/Triton: workers only

        return TritonTieringWorker

    def create_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        check_reporting(self, self.tiering_config.integrity)

        # Replicated MLA (every TP rank holds the same latent): one copy, slot 0, as vLLM's tiering does. Only rank 0
        # stores (vLLM's connector acks the others' stores); every rank loads from slot 0.
        slot = 0 if self.replicated_layout else self.config.parallel.rank
        setting = (
            f"cpu_bytes_to_use = {self.tiering_config.cpu_bytes_to_use} bytes (the CPU tier of the whole instance: "
            f"one /dev/shm region for its {max(1, self.config.parallel.world_size)} worker(s), in host memory)"
        )
        # vLLM's constructor maps the region and touches this worker's slots itself: it runs on a thread of the
        # GPU's node, under a memory policy bound to it, so those pages are allocated there (docs/host-memory.md).
        node = choose_node(self.tiering_config.numa_node, kv_caches.tensors[0].tensor.device)
        check_node_memory(
            node,
            self.num_chunks * self.cpu_page_size_per_worker,
            "this worker's slots of the shared region",
        )
        region = run_on_node(
            node,
            lambda: SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=slot,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
                # The worker that creates the region checks it whole against RAM, before sizing the file (whose
                # pages are host memory: /dev/shm may be larger than what is free).
                creator_memory_check=lambda nbytes: _check_region_memory(nbytes, setting, kv_caches),
            ),
            bind_thread=True,
            name="region",
        )
        name = RegionName(region, take_over=True)
        try:
            return self._worker_class()(
                kv_caches,
                region=region,
                name=name,
                slot_offset=slot * self.cpu_page_size_per_worker,
                slot_bytes=self.cpu_page_size_per_worker,
                blocks_per_chunk=self.blocks_per_chunk,
                geometry=self.geometry if self.tiering_config.host_layout == "packed" else None,
                num_ctas=self.tiering_config.num_ctas,
                transfer_path=self.tiering_config.transfer_path,
                numa=node,
                integrity=self.tiering_config.integrity,
                trailer_bytes=self.trailer_bytes,
                slot=slot,
                format_plan=self.format_plan,
            )
        except BaseException:
            try:
                region.cleanup()
            finally:
                name.release()
            raise


class IdentifiedChunks(CarriesIdentities, CPULoadStoreSpec):
    """vLLM's CPU-tier chunk ids, with the identity of each chunk's key (the integrity checks): what the tiering
    manager's specs become with them, so that the workers mix the keys into the checksums."""

    def __init__(self, block_ids, identities):
        super().__init__(block_ids)
        self.identities = identities


# Keys marked bad by failed checks that a tiering manager remembers (the oldest are forgotten beyond it).
MAX_BAD_KEYS = 1 << 16


def attach_identities(manager: OffloadingManager, person: bytes = b"") -> None:
    """Makes vLLM's tiering manager hand its load and store specs over with each chunk's key identity
    (:class:`IdentifiedChunks`, :func:`triton_offload.integrity.identities_of_keys`, personalised with the
    configuration fingerprint's ``person``: a chunk another configuration stored fails its check), and gives it
    ``discard_failed(chunk_ids)``: the keys of chunks whose bytes failed an integrity check become misses (vLLM's CPU
    tier has no way to drop one, and would otherwise hand the same bad bytes to the retried request forever), until
    the CPU tier stores them anew (once it evicted the bad chunk, a request's store brings fresh bytes). The
    manager is vLLM's, unchanged otherwise: three of its methods are wrapped on this instance. Each loaded chunk id is
    remembered with its key and where it was loaded from (``chunk_sources``), for messages about failed checks.
    A load hashes only the keys its chunks did not get from this manager's stores (``chunk_digests``: chunk -> its
    last stored key and that key's digest; chunks promoted from a secondary tier are filled by vLLM's own calls)."""
    prepare_load, prepare_store, lookup = manager.prepare_load, manager.prepare_store, manager.lookup
    sources: dict[int, tuple] = {}
    bad: dict[bytes, None] = {}
    known: dict[int, tuple] = {}  # at most one entry per CPU chunk

    def load(keys, req_context):
        keys = list(keys)
        spec = prepare_load(keys, req_context)
        digests = []
        for chunk, key in zip(spec.block_ids.tolist(), keys):
            source = manager.get_load_source(key, req_context)
            sources[chunk] = (key, getattr(source, "value", source))
            got = known.get(chunk)
            if got is None or got[0] != key:
                got = known[chunk] = (key, digests_of_keys((key,), person))
            digests.append(got[1])
        if len(sources) > 4 * len(keys) + 4096:  # a bound: only the latest loads are ever asked about
            for chunk in list(sources)[: len(sources) // 2]:
                del sources[chunk]
        return IdentifiedChunks(spec.block_ids, b"".join(digests))

    def store(keys, req_context):
        out = prepare_store(keys, req_context)
        if out is None:
            return None
        for key in out.keys_to_store:  # stored anew (the bad chunk was evicted meanwhile): its fresh bytes may hit
            bad.pop(key, None)
        digests = digests_of_keys(out.keys_to_store, person)
        for i, (chunk, key) in enumerate(zip(out.store_spec.block_ids.tolist(), out.keys_to_store)):
            known[chunk] = (key, digests[8 * i : 8 * i + 8])
        return replace(out, store_spec=IdentifiedChunks(out.store_spec.block_ids, digests))

    def checked_lookup(key, req_context, *args, **kwargs):
        if key in bad:
            return LookupResult.MISS
        return lookup(key, req_context, *args, **kwargs)

    def discard_failed(chunk_ids) -> list:
        keys = [sources[c][0] for c in dict.fromkeys(chunk_ids) if c in sources]
        for key in keys:
            bad[key] = None
        while len(bad) > MAX_BAD_KEYS:
            del bad[next(iter(bad))]
        return keys

    manager.prepare_load, manager.prepare_store, manager.lookup = load, store, checked_lookup
    manager.discard_failed, manager.chunk_sources, manager.chunk_digests = discard_failed, sources, known
