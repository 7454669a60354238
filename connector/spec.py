"""``TritonOffloadingSpec``: the vLLM ``OffloadingSpec`` that wires our manager and transfer engine into vLLM.

vLLM builds the spec once in each process that runs an ``OffloadingConnector``: the engine core calls only
:meth:`~TritonOffloadingSpec.get_manager`, each worker only :meth:`~TritonOffloadingSpec.get_worker`. Both sides
must agree on the number of host blocks without talking to each other, so it is computed here, in ``__init__``,
from values both receive identically: the budget, the world size and vLLM's bytes per GPU block.
"""

from __future__ import annotations

import logging
from typing import Any

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
from triton_offload.connector.config import TritonOffloadConfig
from triton_offload.connector.load_errors import check_reporting, integrity_metric_definitions, reporting_connector
from triton_offload.connector.manager import METRICS, TritonOffloadingManager
from triton_offload.connector.preflight import host_memory_note
from triton_offload.host_cache import check_host_memory, host_blocks_for_budget

__all__ = ["TritonOffloadingSpec"]

logger = logging.getLogger(__name__)

_INFO_KEYS = ("triton_offload_host_blocks", "triton_offload_blocks_per_host_block", "triton_offload_eviction_policy")


class TritonOffloadingSpec(OffloadingSpec):
    """KV-cache offloading to a packed host cache, one Triton launch per transfer job.

    ``kv_connector_extra_config`` keys: ``cpu_bytes_to_use`` (required; bytes or ``"40GiB"``, for the whole
    instance), ``block_size`` (tokens per host block, read by vLLM), ``eviction_policy`` (``lru`` | ``arc``),
    ``num_ctas``, ``transfer_path``, ``numa_node``, ``huge_pages``, ``pinning``, ``integrity``. See
    :class:`~triton_offload.connector.config.TritonOffloadConfig`.
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
        # vLLM's bytes per GPU block are those of the whole backing allocation (padding included), an upper bound
        # on the packed bytes a worker moves per block. Both sides know it before any worker has its tensors.
        self.budget_block_bytes = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        self.num_host_blocks = host_blocks_for_budget(
            self.offload_config.cpu_bytes_to_use, self.budget_block_bytes, max(1, config.parallel.world_size)
        )
        self._manager: TritonOffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            cfg = self.offload_config
            check_reporting(self, cfg.integrity)
            self._manager = TritonOffloadingManager(
                self.num_host_blocks,
                cfg.eviction_policy,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                info=dict(zip(_INFO_KEYS, (self.num_host_blocks, cfg.blocks_per_host_block, cfg.eviction_policy))),
                identities=cfg.integrity != "off",
            )
            logger.info(
                "triton-offload scheduler: %d host blocks of %d GPU block(s) (GPU block tokens %s) for %d rank(s), "
                "cpu_bytes_to_use=%d, eviction_policy=%s, kv events %s. Counters: vLLM metrics "
                "vllm:triton_offload_{hit,stored,evicted,cached}_blocks and vllm:kv_offload_{load,store}_bytes; "
                "totals are logged at shutdown",
                self.num_host_blocks,
                cfg.blocks_per_host_block,
                list(self.tokens_per_block),
                self.config.parallel.world_size,
                cfg.cpu_bytes_to_use,
                cfg.eviction_policy,
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
                numa_node=self.offload_config.numa_node,
                huge_pages=self.offload_config.huge_pages,
                pinning=self.offload_config.pinning,
                integrity=self.offload_config.integrity,
            )
        return self._worker
