"""vLLM's ``OffloadingConfig`` as its connector builds one, and the keys, request contexts and worker calls the
plugin's unit tests drive it with, as vLLM's connector does (imports vLLM)."""

from __future__ import annotations

import dataclasses
import inspect

from vllm.v1.kv_offload import config as vcfg
from vllm.v1.kv_offload.base import ReqContext, make_offload_key


def worker_role_missing() -> str | None:
    """Why this vLLM cannot run the worker-role tests, or None: they need 0.33's KV cache layouts
    (``create_kv_cache_views``) and its connector worker role (sync loads). A test module skips with the reason, so
    that the skip names the module."""
    import pytest

    kv_iface = pytest.importorskip("vllm.v1.kv_cache_interface")
    if not hasattr(kv_iface, "create_kv_cache_views"):
        return "needs vLLM 0.33's KV cache layouts (create_kv_cache_views)"
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob

    if "sync" not in {f.name for f in dataclasses.fields(TransferJob)}:
        return "needs vLLM 0.33's connector worker role (sync loads)"
    return None


def key(i: int, group: int = 0) -> bytes:
    """vLLM's ``OffloadKey`` for block ``i`` of KV-cache group ``group``."""
    return make_offload_key(i.to_bytes(4, "big") * 8, group)


def ctx(name: str = "r", positions: dict | None = None) -> ReqContext:
    """A request's ``ReqContext``, with the end token of each key in ``positions`` recorded as vLLM records it."""
    rc = ReqContext(req_id=name)
    for k, pos in (positions or {}).items():
        rc.set_offload_key_position(k, pos)
    return rc


def submit_load(worker, job_id, src, dst, *, expedited: bool) -> None:
    """``worker.submit_load``, with vLLM 0.33's ``expedited`` flag where the API has it; the submission must succeed."""
    kwargs = {"expedited": expedited} if "expedited" in inspect.signature(type(worker).submit_load).parameters else {}
    assert worker.submit_load(job_id, src, dst, **kwargs)


def finished(worker) -> list:
    """Waits for every job (ids below 1000) and returns the worker's results."""
    worker.wait(set(range(1000)))
    return worker.get_finished()


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
