"""vLLM's ``obj`` tier (KV chunks as S3 objects, through NIXL's OBJ plugin) as vLLM 0.33 builds it, for vLLM 0.32. vLLM
0.32's ``ObjectStoreSecondaryTierManager`` creates its NIXL agent without ``capture_telemetry=True`` and then reads
every finished transfer's telemetry, which NIXL refuses (``NIXL_ERR_NO_TELEMETRY``): the scheduler dies at the first
chunk stored or loaded. Its object names also leave the chunk size out (``blocks_per_file`` stays 1), so instances with
different ``block_size`` would read each other's objects as if they were their own size. vLLM 0.33 fixes both;
:class:`ObjectStoreTier` is vLLM 0.32's class with the same two changes, and nothing else
(``TritonTieringOffloadingSpec`` refuses ``"type": "obj"`` on vLLM < 0.33, naming this class).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.obj import manager as vllm_obj

__all__ = ["ObjectStoreTier"]


@contextlib.contextmanager
def _agents_capture_telemetry():
    """NIXL agents that vLLM's obj module creates meanwhile capture per-transfer telemetry (vLLM 0.33's setting).

    The module looks ``nixl_agent_config`` up at call time, so the constructor below sees the wrapped one; tiers are
    built one at a time by the scheduler, and the original is put back before anything else runs.
    """
    make = vllm_obj.nixl_agent_config
    vllm_obj.nixl_agent_config = functools.partial(make, capture_telemetry=True)
    try:
        yield
    finally:
        vllm_obj.nixl_agent_config = make


class ObjectStoreTier(vllm_obj.ObjectStoreSecondaryTierManager):
    """vLLM's object-store tier with NIXL telemetry on and object names that include the chunk size (vLLM 0.33).

    Use it as an out-of-tree tier class::

        "secondary_tiers": [{"type": "ObjectStoreTier", "module_path": "triton_offload.connector.obj_tier",
                             "store_config": {"bucket": "kv", "endpoint_override": "s3.example:9000", ...}}]

    It takes exactly the keys of vLLM's ``obj`` tier. On vLLM 0.33 it behaves as ``"type": "obj"`` does, and writes
    the same object names.
    """

    @functools.wraps(vllm_obj.ObjectStoreSecondaryTierManager.__init__)  # same keys, same checks of them
    def __init__(self, *args, **kwargs):
        with _agents_capture_telemetry():
            super().__init__(*args, **kwargs)
        bound = inspect.signature(super().__init__).bind(*args, **kwargs)
        bound.apply_defaults()
        spec, prefix = bound.arguments["offloading_spec"], bound.arguments["prefix"]
        # vLLM 0.33's names: blocks_per_file = blocks_per_chunk joins the hashed fields of the prefix directory.
        self._file_mapper = FileMapper.from_offloading_spec(
            f"{prefix}/" if prefix else "",
            spec,
            blocks_per_file=spec.blocks_per_chunk,
            parallel_agnostic=True,
        )
