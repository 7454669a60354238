"""vLLM's ``OffloadingConfig`` as its connector builds one, for the plugin's unit tests (imports vLLM)."""

from __future__ import annotations

import dataclasses

from vllm.v1.kv_offload import config as vcfg


def build(cls, **kw):
    """A vLLM config dataclass from the fields this vLLM version has (0.33 added some, with defaults)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in kw.items() if k in names})


def offloading_config(
    extra_config: dict,
    *,
    groups,
    worker_bytes: int,
    f: int,
    tokens: int = 16,
    world_size: int = 1,
    rank: int = 0,
    events: bool = False,
    engine_id: str = "test",
    replicated: bool = False,
):
    """An ``OffloadingConfig`` with one group config per entry of ``groups`` (each a tuple of layer indices), a
    tiny fp16 model, ``f`` GPU blocks per chunk and tensor parallelism ``world_size`` (this process is ``rank``)."""
    return build(
        vcfg.OffloadingConfig,
        groups=tuple(
            build(
                vcfg.OffloadingGroupConfig, tokens_per_block=tokens, layer_names=tuple(f"l{i}" for i in g), group_id=gi
            )
            for gi, g in enumerate(groups)
        ),
        worker_kv_bytes_per_block=worker_bytes,
        enable_kv_cache_events=events,
        extra_config=extra_config,
        engine_id=engine_id,
        model=build(vcfg.OffloadingModelConfig, name="tiny", dtype="float16", max_model_len=1024),
        cache=vcfg.OffloadingCacheConfig(tokens_per_hash=tokens, blocks_per_chunk=f),
        parallel=vcfg.OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=not replicated,
        ),
        replicated_layout=replicated,
    )
