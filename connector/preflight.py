"""The plugin's configuration checked before vLLM loads the model. vLLM builds an offloading spec only once the model is
loaded and its KV cache sized (0.32 and 0.33 alike): the engine core builds the executor (the workers load the weights),
then the KV caches, then the scheduler, whose connector builds the spec; each worker builds its connector after loading
and profiling. A mistake found by the spec therefore costs a model load (52-90 s of a 2-core machine) and ends in a long
traceback. vLLM offers no hook that hands a plugin the configuration earlier: its general plugins are called with no
arguments (in ``EngineArgs.__post_init__`` in the front-end process, in ``EngineCore.__init__`` and in each worker
before anything is loaded), and the spec's only earlier classmethod, ``build_metric_definitions``, runs in the front end
after the engine has started. So :func:`install` (called by the package's ``register()``, the general plugin) wraps
``EngineArgs.create_engine_config``: once vLLM has built and checked its own ``VllmConfig`` in the front-end process,
and before any engine process starts, :func:`check_vllm_config` checks our specs' whole configuration as the spec will.
The spec still checks everything again when it is built (the packed budget to the block, per rank), so nothing depends
on the wrapper.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from triton_offload.connector import CONNECTOR_NAME, SPEC_NAME, TIERING_SPEC_NAME
from triton_offload.connector.compat import check_multi_connector
from triton_offload.connector.config import did_you_mean

__all__ = [
    "install",
    "check_vllm_config",
    "check_block_size",
    "check_memory",
    "MemoryFacts",
]

logger = logging.getLogger(__name__)

_MARK = "_triton_offload_preflight"
_CONNECTOR = "OffloadingConnector"
# The connectors whose spec configuration is ours to check: vLLM's, and ours that reports load errors.
_CONNECTORS = (_CONNECTOR, CONNECTOR_NAME)
GiB = 2**30


def install() -> bool:
    """Makes ``EngineArgs.create_engine_config`` run :func:`check_vllm_config` on the config it returns; idempotent.
    Returns whether the check is installed (False, with a debug line, on a vLLM without that method). Without it
    (``VLLM_PLUGINS`` excluding this plugin, a vLLM whose ``EngineArgs`` has no ``create_engine_config``) the errors
    come as before, from the spec."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:  # pragma: no cover - vLLM >= 0.32 has it
        return False
    original = getattr(EngineArgs, "create_engine_config", None)
    if original is None:
        logger.debug("vLLM's EngineArgs has no create_engine_config: the configuration is checked by the spec only")
        return False
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        check_vllm_config(config)
        return config

    setattr(create_engine_config, _MARK, True)
    EngineArgs.create_engine_config = create_engine_config
    return True


def _offloading_configs(kv_transfer_config) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """``(connector name, kv_connector_extra_config)`` of every ``OffloadingConnector`` (or ours) configured: the
    top-level one, or ``MultiConnector``'s children."""
    if kv_transfer_config is None:
        return
    extra = kv_transfer_config.kv_connector_extra_config or {}
    if kv_transfer_config.kv_connector in _CONNECTORS:
        yield kv_transfer_config.kv_connector, extra
    elif kv_transfer_config.kv_connector == "MultiConnector":
        for child in extra.get("connectors", []) or []:
            if isinstance(child, Mapping) and child.get("kv_connector") in _CONNECTORS:
                yield child["kv_connector"], child.get("kv_connector_extra_config") or {}


def check_vllm_config(vllm_config) -> None:
    """Checks every ``OffloadingConnector`` configuration of ``vllm_config`` that names one of our specs, and that
    each names a spec vLLM can build.

    It checks our specs' whole configuration as the spec will: every key, a misspelt one with its closest match, the
    block size against vLLM's when vLLM has fixed it already, an ``fs`` tier's ``root_dir``, the object stores, and
    the budget against the host memory available (with vLLM's own KV cache on its CPU build).

    Raises:
        ValueError: naming the key: an unknown ``spec_name`` (listing the registered ones, with the closest), our
            spec under ``MultiConnector`` on vLLM < 0.33 (:func:`check_multi_connector`), or anything the spec
            would refuse once built (see :func:`check_block_size`, :func:`check_memory` and the specs'
            configuration classes).
        ConnectionError: an ``obj`` tier's store unreachable (``network_tiers.check_reachable``).
    """
    transfer = vllm_config.kv_transfer_config
    for connector, extra in _offloading_configs(transfer):
        spec_cls = _spec_class(extra)
        if spec_cls is not None:
            check_multi_connector(transfer.kv_connector)
            _check_ours(spec_cls, extra, vllm_config, connector)


def _spec_class(extra: Mapping[str, Any]):
    """Our spec class that ``extra`` selects (subclasses included), or None for anyone else's; an unknown name is an
    error here, where vLLM's factory would report only "Unsupported spec type" once the model is loaded."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    name = extra.get("spec_name", "CPUOffloadingSpec")
    registered = sorted(OffloadingSpecFactory._registry)
    if name not in registered and extra.get("spec_module_path") is None:
        guess = did_you_mean(str(name), registered)
        raise ValueError(
            f"kv_connector_extra_config['spec_name'] = {name!r} is not an offloading spec vLLM knows"
            + (f" (did you mean {guess!r}?)" if guess else "")
            + f"; registered: {', '.join(registered)}. A spec of another package needs its 'spec_module_path' "
            "(vLLM would stop with 'Unsupported spec type' once the model is loaded)"
        )
    if name not in (SPEC_NAME, TIERING_SPEC_NAME) and extra.get("spec_module_path") is None:
        return None  # vLLM's own specs, or another plugin's: theirs to check
    try:
        spec_cls = OffloadingSpecFactory.get_spec_cls(extra)  # what vLLM does in the front end anyway (its metrics)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"kv_connector_extra_config['spec_module_path'] = {extra.get('spec_module_path')!r} does not give "
            f"spec_name {name!r}: {type(e).__name__}: {e}"
        ) from e
    from triton_offload.connector.spec import TritonOffloadingSpec
    from triton_offload.connector.tiering import TritonTieringOffloadingSpec

    return spec_cls if issubclass(spec_cls, (TritonOffloadingSpec, TritonTieringOffloadingSpec)) else None


def _check_ours(spec_cls, extra: Mapping[str, Any], vllm_config, connector: str = _CONNECTOR) -> None:
    from triton_offload.connector.config import TritonOffloadConfig
    from triton_offload.connector.tiering import TritonTieringOffloadingSpec

    gpu_block = gpu_block_tokens(vllm_config)
    f = check_block_size(extra, gpu_block)
    if issubclass(spec_cls, TritonTieringOffloadingSpec):
        from triton_offload.connector.network_tiers import check_reachable
        from triton_offload.connector.tiering_config import TritonTieringConfig

        cfg = TritonTieringConfig.from_extra_config(extra)
        check_reachable(cfg.object_stores)
        what = "the CPU tier (one /dev/shm region in host memory)"
    else:
        cfg = TritonOffloadConfig.from_extra_config(
            extra, blocks_per_host_block=f or 1, gpu_block_tokens=gpu_block if f else None
        )
        what = "the host cache"
    if connector != CONNECTOR_NAME:
        from triton_offload.connector.load_errors import check_reporting

        check_reporting(None, cfg.integrity)
    parallel = vllm_config.parallel_config
    if getattr(parallel, "nnodes", 1) <= 1 and getattr(parallel, "data_parallel_size", 1) <= 1:
        check_memory(cfg.cpu_bytes_to_use, what, MemoryFacts.read(vllm_config))
    logger.info("triton-offload: %s configuration checked before the model loads", spec_cls.__name__)


def gpu_block_tokens(vllm_config) -> int | None:
    """Tokens per GPU (KV-cache) block where vLLM has fixed it by the time its config is built, else None.

    vLLM picks the block size of a model whose size the user left open from its attention backend in the engine
    process (after this check), and may change any block size of a hybrid (attention + Mamba) model or one with
    per-layer KV dtypes there; on its CPU build the platform fixes it (128 unless ``--block-size``) when the config is
    built. With decode context parallelism a host block spans more tokens: not checked here either.
    """
    cache, model = vllm_config.cache_config, vllm_config.model_config
    if model is None or getattr(model, "is_hybrid", False) or getattr(cache, "kv_cache_dtype_skip_layers", None):
        return None
    if getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) > 1:
        return None
    from vllm.platforms import current_platform

    if getattr(cache, "user_specified_block_size", False) or current_platform.is_cpu():
        return int(cache.block_size)
    return None


def check_block_size(extra: Mapping[str, Any], gpu_block: int | None) -> int | None:
    """The block-size factor vLLM will derive from ``block_size`` / ``blocks_per_chunk`` (None where it cannot be
    known yet), refusing what vLLM would refuse after the model load.

    Raises:
        ValueError: both keys given; ``block_size`` not a multiple of the GPU block size ``gpu_block``, naming both
            and the values that would do; a value that is not a positive int.
    """
    from triton_offload._checks import positive_int_setting

    if extra.get("block_size") is not None and extra.get("blocks_per_chunk") is not None:
        raise ValueError(
            "kv_connector_extra_config has both 'block_size' and 'blocks_per_chunk': give one (vLLM refuses both)"
        )
    if extra.get("blocks_per_chunk") is not None:
        return positive_int_setting(extra["blocks_per_chunk"], "blocks_per_chunk")
    if extra.get("block_size") is None:
        return 1 if gpu_block is not None else None
    tokens = positive_int_setting(extra["block_size"], "block_size")
    if gpu_block is None:
        return None
    if tokens % gpu_block:
        multiples = ", ".join(str(gpu_block * k) for k in range(1, 4))
        raise ValueError(
            f"kv_connector_extra_config['block_size'] = {extra['block_size']!r} tokens must be a multiple of vLLM's "
            f"KV-cache block size, {gpu_block} tokens here: use {multiples}, ..., or change vLLM's --block-size "
            "(on vLLM's CPU build it is 128 unless --block-size says otherwise, and a multiple of 32)"
        )
    return tokens // gpu_block


class MemoryFacts:
    """What the early memory check needs: this machine's memory and how vLLM will size its own KV cache in host
    memory (its CPU build keeps the KV cache in RAM; on a GPU it lives in device memory).

    Attributes:
        total, available: ``MemTotal`` and ``MemAvailable`` of /proc/meminfo, in bytes (None where unreadable).
        cpu_kv_bytes: on vLLM's CPU build, the KV-cache size the user set (``--kv-cache-memory-bytes``, or
            ``VLLM_CPU_KVCACHE_SPACE`` in GiB); None otherwise.
        cpu_utilization: on vLLM's CPU build without a set size, ``--gpu-memory-utilization``: the fraction of
            ``MemTotal`` vLLM reserves for itself, its KV cache taking what the model leaves; None otherwise.
    """

    def __init__(self, total, available, cpu_kv_bytes=None, cpu_utilization=None):
        self.total, self.available = total, available
        self.cpu_kv_bytes, self.cpu_utilization = cpu_kv_bytes, cpu_utilization

    @classmethod
    def read(cls, vllm_config) -> MemoryFacts:
        from vllm.platforms import current_platform

        info = _meminfo()
        kv = utilization = None
        if current_platform.is_cpu():
            kv = vllm_config.cache_config.kv_cache_memory_bytes  # VLLM_CPU_KVCACHE_SPACE lands here too
            if kv is None:
                utilization = vllm_config.cache_config.gpu_memory_utilization
        return cls(info.get("MemTotal"), info.get("MemAvailable"), kv, utilization)


def _meminfo() -> dict[str, int]:
    try:
        with open("/proc/meminfo") as f:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.rstrip().endswith("kB")}
    except (OSError, ValueError, IndexError):
        return {}


def check_memory(budget: int, what: str, facts: MemoryFacts) -> None:
    """Refuses a budget this machine cannot hold beside vLLM's own KV cache in host memory.

    Conservative: the model's weights and vLLM's other memory are not counted, so a budget passed here may still be
    refused by the spec's own check (to the host block, per rank) when it allocates.

    Raises:
        ValueError: ``budget`` (plus vLLM's CPU KV cache) exceeds ``MemAvailable``; the message names ``what``, the
            bytes, the memory available, vLLM's share and the flag that sets it.
    """
    if facts.available is None:
        return
    if facts.cpu_kv_bytes is not None:
        vllm_bytes = facts.cpu_kv_bytes
        theirs = (
            f" beside the {vllm_bytes / GiB:.2f} GiB vLLM's CPU build allocates for its own KV cache "
            "(--kv-cache-memory-bytes, or VLLM_CPU_KVCACHE_SPACE in GiB)"
        )
        fix = "lower cpu_bytes_to_use or vLLM's KV cache (--kv-cache-memory-bytes), or free host memory"
    elif facts.cpu_utilization is not None and facts.total is not None:
        vllm_bytes = int(facts.cpu_utilization * facts.total)
        theirs = (
            f" beside the {vllm_bytes / GiB:.2f} GiB vLLM's CPU build reserves for itself (--gpu-memory-utilization = "
            f"{facts.cpu_utilization:g} of {facts.total / GiB:.2f} GiB MemTotal: the model, and a KV cache taking "
            "the rest)"
        )
        fix = (
            "size vLLM's own KV cache with --kv-cache-memory-bytes (e.g. --kv-cache-memory-bytes 1G; or "
            "VLLM_CPU_KVCACHE_SPACE=1, in GiB), or lower cpu_bytes_to_use"
        )
    else:
        vllm_bytes, theirs = 0, ""
        fix = "lower cpu_bytes_to_use, or free host memory"
    if budget + vllm_bytes <= facts.available:
        return
    raise ValueError(
        f"cpu_bytes_to_use = {budget} bytes ({budget / GiB:.2f} GiB) for {what} does not fit in this machine's host "
        f"memory{theirs}: "
        f"{facts.available / GiB:.2f} GiB are available (MemAvailable in /proc/meminfo). {fix[0].upper()}{fix[1:]}"
    )
