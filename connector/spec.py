"""``TritonOffloadingSpec``: the vLLM ``OffloadingSpec`` that wires our manager and transfer engine into vLLM. vLLM
builds the spec once in each process that runs an ``OffloadingConnector``: the engine core calls only
:meth:`~TritonOffloadingSpec.get_manager`, each worker only :meth:`~TritonOffloadingSpec.get_worker`. Both sides must
agree on the host rows without talking to each other, so they are computed here, in ``__init__``, from values both
receive identically: the budget, the world size and the bytes one GPU block of each KV-cache group moves (read from
vLLM's ``KVCacheConfig``, :mod:`~triton_offload.connector.geometry`; vLLM's own bytes per GPU block where that is not
available).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from triton_offload.connector import route_logs_through_vllm
from triton_offload.connector.compat import check_multi_connector, host_memory_note
from triton_offload.connector.config import TritonOffloadConfig
from triton_offload.connector.geometry import KVGeometry, geometry_for, host_regions, region_bytes
from triton_offload.connector.load_errors import check_reporting, integrity_metric_definitions, reporting_connector
from triton_offload.connector.manager import METRICS, TritonOffloadingManager
from triton_offload.host.budget import check_host_memory, host_blocks_for_budget

if TYPE_CHECKING:
    from triton_offload.connector.typed_pages import FormatPlan

__all__ = ["TritonOffloadingSpec"]

logger = logging.getLogger(__name__)

_INFO_KEYS = (
    "triton_offload_host_blocks",
    "triton_offload_blocks_per_host_block",
    "triton_offload_eviction_policy",
    "triton_offload_host_format",
    "triton_offload_host_tokens",
    "triton_offload_native_host_blocks",
)


class TritonOffloadingSpec(OffloadingSpec):
    """KV-cache offloading to a packed host cache, one Triton launch per transfer job.

    ``kv_connector_extra_config`` keys: ``cpu_bytes_to_use`` (required; bytes or ``"40GiB"``, for the whole
    instance), ``block_size`` (tokens per host block, read by vLLM), ``eviction_policy`` (``lru`` | ``arc``),
    ``num_ctas``, ``transfer_path``, ``numa_node``, ``huge_pages``, ``pinning``, ``integrity``, ``host_regions``,
    ``host_format``. See
    :class:`~triton_offload.connector.config.TritonOffloadConfig`.

    Host rows: a row holds ``f`` GPU blocks of one key per host *region*; each KV-cache group's keys live in one
    region, sized for its largest group (:func:`~triton_offload.connector.geometry.host_regions`), so the budget is
    divided by ``f x`` the regions' bytes, not by vLLM's bytes per block (which counts every group of a model whose
    groups sit on separate tensors: vLLM's #56871).
    """

    # True when TritonOffloadingConnector built this spec: it reports the blocks failing an integrity check to vLLM as
    # load errors (vLLM's OffloadingConnector asserts every transfer succeeds, so the checks need ours).
    reports_load_errors = False

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {
            METRICS["hit_blocks"]: OffloadingCounterMetadata(
                documentation="Host blocks loaded back to the GPU (offload hits), all KV-cache groups."
            ),
            METRICS["stored_blocks"]: OffloadingCounterMetadata(documentation="Host blocks stored from the GPU."),
            METRICS["evicted_blocks"]: OffloadingCounterMetadata(
                documentation="Host blocks evicted to make room for new stores."
            ),
            METRICS["cached_blocks"]: OffloadingGaugeMetadata(documentation="Host blocks holding loadable KV now."),
            **integrity_metric_definitions(),
        }

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:  # vLLM >= 0.33
        return _INFO_KEYS

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        route_logs_through_vllm()
        self.reports_load_errors = reporting_connector()
        block_tokens = set(self.tokens_per_block)
        self.offload_config = TritonOffloadConfig.from_extra_config(
            self.extra_config,
            blocks_per_host_block=self.blocks_per_chunk,
            gpu_block_tokens=block_tokens.pop() if len(block_tokens) == 1 else None,
        )
        if config.worker_kv_bytes_per_block <= 0:
            raise ValueError(
                f"vLLM reports worker_kv_bytes_per_block = {config.worker_kv_bytes_per_block}: no KV cache to offload"
            )
        self.geometry = self._geometry(config)
        if self.geometry is not None:
            check_multi_connector(self.geometry.kv_connector)
        self.format_plan = self._format_plan(config)
        self._size_rows(config)
        self._manager: TritonOffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    @staticmethod
    def _geometry(config: OffloadingConfig) -> KVGeometry | None:
        """The KV-cache groups' bytes read from vLLM's config (connector/geometry.py), if they describe exactly the
        groups of ``config``."""
        geometry = geometry_for(config)
        if geometry is None:
            return None
        if tuple(g.group_id for g in geometry.groups) != tuple(g.group_id for g in config.groups):
            logger.warning(
                "triton-offload: the KV-cache groups read from vLLM's config (%s) are not the offloaded ones (%s): "
                "host rows are sized from vLLM's bytes per block",
                [g.group_id for g in geometry.groups],
                [g.group_id for g in config.groups],
            )
            return None
        return geometry

    def _format_plan(self, config: OffloadingConfig) -> FormatPlan | None:
        """With ``host_format = "fp8_e4m3"``, what the rows hold, read from vLLM's specs (connector/typed_pages.py);
        refused where they cannot be read exactly (before anything is allocated)."""
        if self.offload_config.host_format == "native":
            return None
        from triton_offload.connector.typed_pages import cpu_platform, format_plan  # torch: not before it is used

        plan = format_plan(self.geometry, config.kv_cache_layout, cpu_platform())
        if plan.host_format == "native":
            logger.info("triton-offload: host_format = 'fp8_e4m3' with an 8-bit KV cache: its bytes move unchanged")
        return plan

    def _size_rows(self, config: OffloadingConfig) -> None:
        """The host rows: each group's region, the bytes of a row, and how many rows this rank's share of the
        budget holds (the same on the scheduler and on every worker), in the host format and in the native one."""
        f, world_size = self.blocks_per_chunk, max(1, config.parallel.world_size)
        self.native_host_blocks = None
        if self.geometry is not None:
            geometry = self.geometry
            if self.format_plan is not None:  # region choice and sizes from the host format's bytes
                groups = tuple(replace(g, nbytes=b) for g, b in zip(geometry.groups, self.format_plan.group_bytes))
                geometry = replace(geometry, groups=groups)
            regions = host_regions(geometry, self.offload_config.host_regions)
            self.region_bytes = region_bytes(geometry.group_bytes, regions)
            self.group_regions = regions if len(self.region_bytes) > 1 else None
            self.sized_from = "the KV-cache groups' bytes per block"
            self.budget_block_bytes = f * sum(self.region_bytes)
            if self.format_plan is not None:  # the rows the native format would give, for the log
                native = f * sum(region_bytes(self.geometry.group_bytes, regions))
                self.native_host_blocks = self.offload_config.cpu_bytes_to_use // world_size // native
        else:
            # vLLM's bytes per GPU block are those of the whole backing allocation (padding included), an upper
            # bound on the packed bytes a worker moves per block; for groups on separate tensors, or vLLM's branch
            # that sums the groups' bytes, it counts every group, so a row would hold one group's bytes in G x
            # theirs. Both sides know it before any worker has its tensors.
            self.region_bytes, self.group_regions = (config.worker_kv_bytes_per_block,), None
            self.sized_from = "vLLM's worker_kv_bytes_per_block"
            self.budget_block_bytes = config.worker_kv_bytes_per_block * f
            if len(config.groups) > 1:
                logger.warning(
                    "triton-offload: %d KV-cache groups, but their bytes per block are not known here (the plugin's "
                    "entry point did not run in this process, e.g. spec_module_path without the installed package): "
                    "host rows are sized from vLLM's worker_kv_bytes_per_block = %d, which for groups on separate "
                    "tensors counts all of them, so the cache may hold 1/%d of the keys the budget allows",
                    len(config.groups),
                    config.worker_kv_bytes_per_block,
                    len(config.groups),
                )
        self.num_host_blocks = host_blocks_for_budget(
            self.offload_config.cpu_bytes_to_use, self.budget_block_bytes, world_size
        )
        self.num_regions = len(self.region_bytes)
        if self.native_host_blocks is None:
            self.native_host_blocks = self.num_host_blocks

    def budget_note(self) -> str | None:
        """A warning when this rank's share of ``cpu_bytes_to_use`` cannot be used: less than 95 % of it fits in
        whole rows (None otherwise)."""
        share = self.offload_config.cpu_bytes_to_use // max(1, self.config.parallel.world_size)
        used = self.num_host_blocks * self.budget_block_bytes
        if used >= 0.95 * share:
            return None
        return (
            f"cpu_bytes_to_use = {self.offload_config.cpu_bytes_to_use} bytes gives this rank {share} bytes, but only "
            f"{self.num_host_blocks} rows of {self.budget_block_bytes} bytes fit ({used} bytes, "
            f"{100 * used / share:.1f} %): the rest is less than one row. A row is block_size / GPU block size = "
            f"{self.blocks_per_chunk} GPU block(s) of every host region ({list(self.region_bytes)} bytes per block); "
            "raise the budget or lower block_size to use it"
        )

    def format_facts(self) -> tuple[str, int, int]:
        """(the host rows' format, the tokens a region of them holds, the rows the native format would give for the
        same budget)."""
        tokens = self.num_host_blocks * self.blocks_per_chunk * max(self.tokens_per_block)
        fmt = "native" if self.format_plan is None else self.format_plan.host_format
        return fmt, tokens, self.native_host_blocks

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            cfg = self.offload_config
            check_reporting(self, cfg.integrity)
            pools, pool_of = self.num_regions, None
            if self.group_regions is not None:
                # An offload key ends with its vLLM group id (4 bytes, big-endian): its pool is its group's region.
                region_of = {g.group_id: r for g, r in zip(self.config.groups, self.group_regions)}

                def pool_of(key, _region_of=region_of):
                    return _region_of[int.from_bytes(key[-4:], "big")]

            facts = (self.num_host_blocks, cfg.blocks_per_host_block, cfg.eviction_policy, *self.format_facts())
            self._manager = TritonOffloadingManager(
                self.num_host_blocks,
                cfg.eviction_policy,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                info=dict(zip(_INFO_KEYS, facts)),
                identities=cfg.integrity != "off",
                pools=pools,
                pool_of=pool_of,
            )
            note = self.budget_note()
            if note is not None:
                logger.warning("triton-offload: %s", note)
            logger.info(
                "triton-offload scheduler: %d host rows of %d GPU block(s) (GPU block tokens %s) for %d rank(s), "
                "%d bytes per row (host regions %s of KV-cache groups %s, sized from %s), %d keys in all, "
                "host format %s: %d tokens per region (native: %s rows), "
                "cpu_bytes_to_use=%d, eviction_policy=%s, integrity checks %s, kv events %s. Counters: vLLM metrics "
                "vllm:triton_offload_{hit,stored,evicted,cached}_blocks and vllm:kv_offload_{load,store}_bytes; "
                "totals are logged at shutdown",
                self.num_host_blocks,
                cfg.blocks_per_host_block,
                list(self.tokens_per_block),
                self.config.parallel.world_size,
                self.budget_block_bytes,
                list(self.region_bytes),
                list(self.group_regions or (0,) * len(self.config.groups)),
                self.sized_from,
                self.num_host_blocks * self.num_regions,
                *self.format_facts(),
                cfg.cpu_bytes_to_use,
                cfg.eviction_policy,
                cfg.checks if cfg.checks == cfg.integrity else f"{cfg.checks} (integrity={cfg.integrity!r})",
                "on" if self.kv_events_config.enable_kv_cache_events else "off",
            )
        return self._manager

    @staticmethod
    def _worker_class() -> type[OffloadingWorker]:
        """The worker built by :meth:`get_worker`; a subclass of ours may substitute another (the fault tests do)."""
        from triton_offload.connector.worker import TritonOffloadingWorker  # torch/Triton: worker processes only

        return TritonOffloadingWorker

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            check_reporting(self, self.offload_config.integrity)
            # This rank's share, checked when it is allocated: ranks on one machine allocate one after another or at
            # once, so each sees what the others left (or will take).
            world_size = max(1, self.config.parallel.world_size)
            try:
                check_host_memory(
                    self.num_host_blocks * self.budget_block_bytes,
                    f"cpu_bytes_to_use = {self.offload_config.cpu_bytes_to_use} bytes (for the whole instance; this "
                    f"rank's share, 1/{world_size})",
                )
            except ValueError as e:
                raise ValueError(f"{e}{host_memory_note(kv_caches)}") from None
            self._worker = self._worker_class()(
                kv_caches,
                num_host_blocks=self.num_host_blocks,
                blocks_per_host_block=self.offload_config.blocks_per_host_block,
                num_ctas=self.offload_config.num_ctas,
                transfer_path=self.offload_config.transfer_path,
                budget_block_bytes=self.budget_block_bytes,
                group_regions=self.group_regions,
                geometry=self.geometry,
                numa_node=self.offload_config.numa_node,
                huge_pages=self.offload_config.huge_pages,
                pinning=self.offload_config.pinning,
                integrity=self.offload_config.checks,
                format_plan=self.format_plan,
            )
        return self._worker
