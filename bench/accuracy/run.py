"""One configuration of the accuracy harness in one vLLM engine, run as ``python -m bench.accuracy.run`` by
``bench.accuracy``'s command (an engine per process): greedy tokens and top-k logprobs per prompt, written as JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

GPU_BLOCK = 32  # tokens per GPU block (CPU attention needs a multiple of 32)
BATCH = 16  # prompts per generate() call; an offloading configuration runs each batch twice
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 8


def block_bytes(model: str) -> int:
    """The model's fp32 KV bytes per GPU block (every layer's K and V)."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * kv_heads * head * GPU_BLOCK * 4


def offload_config(model: str, **changes) -> dict:
    """TritonOffloadingSpec, host block = GPU block, room for two batches of the longest prompts; ``changes`` on
    top."""
    host_blocks = 2 * BATCH * (MAX_MODEL_LEN // GPU_BLOCK)
    base = {
        "spec_name": "TritonOffloadingSpec",
        "block_size": GPU_BLOCK,
        "cpu_bytes_to_use": host_blocks * block_bytes(model),
    }
    return {**base, **changes}


def engine(model: str, extra: dict | None, dtype: str = "float32", more: dict | None = None):
    """``dtype`` (fp32 by default: stable greedy tokens), prefix caching on, a device KV cache of 160 blocks' fp32
    bytes; with ``extra``, vLLM's OffloadingConnector with that ``kv_connector_extra_config``; ``more``: other
    arguments of ``LLM``."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs = dict(
        model=model,
        dtype=dtype,
        block_size=GPU_BLOCK,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=2048,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=160 * block_bytes(model),
        enforce_eager=True,
        seed=0,
    )
    if extra is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )
    return LLM(**{**kwargs, **(more or {})})


def outputs(results) -> list[dict]:
    """Per request: greedy tokens, each step's top-k as ``[token, logprob]`` (best first), the cached tokens."""
    rows = []
    for out in results:
        first = out.outputs[0]
        steps = []
        for step in first.logprobs:
            ranked = sorted(step.items(), key=lambda item: item[1].rank or 0)
            steps.append([[token, round(lp.logprob, 6)] for token, lp in ranked if lp.rank])
        rows.append({"tokens": list(first.token_ids), "top": steps, "cached": out.num_cached_tokens})
    return rows


def run(model: str, extra: dict | None, prompts: list[list[int]], max_tokens: int, top_k: int, **llm) -> list[dict]:
    """Every prompt, BATCH at a time; with offloading each batch twice, the device prefix cache emptied in between,
    keeping the second pass (its prefixes loaded from the host)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engine(model, extra, **llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=top_k, detokenize=False)
    rows = []
    try:
        for start in range(0, len(prompts), BATCH):
            batch = [TokensPrompt(prompt_token_ids=p) for p in prompts[start : start + BATCH]]
            if extra is not None:
                llm.generate(batch, params, use_tqdm=False)
                assert llm.reset_prefix_cache(), "reset_prefix_cache failed"
            rows += outputs(llm.generate(batch, params, use_tqdm=False))
    finally:
        llm.llm_engine.engine_core.shutdown(timeout=120)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--extra", default="null", help="JSON: kv_connector_extra_config, or null for no offloading")
    ap.add_argument("--prompts", type=int, required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--top-k", type=int, required=True)
    ap.add_argument("--lengths", type=int, nargs=2, required=True, help="prompt tokens, at least and at most")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--engine", default="{}", help="JSON: more arguments of vLLM's LLM")
    ap.add_argument("--fp8-codec", choices=("kernel", "torch"), default="kernel")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.fp8_codec == "torch":
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            raise SystemExit("--fp8-codec torch replaces the launcher in this process: the engine must run in it")
        from bench.accuracy import fp8_codec

        fp8_codec.install()
    from transformers import AutoTokenizer

    from bench.accuracy.texts import prompt_set

    prompts = prompt_set(AutoTokenizer.from_pretrained(args.model), args.prompts, *args.lengths)
    t0 = time.perf_counter()
    more = json.loads(args.engine)
    rows = run(args.model, json.loads(args.extra), prompts, args.max_tokens, args.top_k, dtype=args.dtype, more=more)
    seconds = round(time.perf_counter() - t0, 1)
    out = {"seconds": seconds, "prompt_tokens": [len(p) for p in prompts], "rows": rows}
    if args.fp8_codec == "torch":
        out["fp8_codec_cross_checked"] = fp8_codec.cross_checked()
    with open(args.out, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
