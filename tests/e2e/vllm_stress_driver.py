"""Stress run of a real vLLM (CPU platform) with TritonOffloadingSpec under heavy eviction; prints one JSON line.

Used by tests/e2e/test_vllm_stress.py, one subprocess per configuration. A few hundred token-id prompts drawn from a
dozen shared prefixes of different lengths, with random suffixes, are generated in large batches (many requests in
flight), twice: pass 2 runs them again in another order after ``reset_prefix_cache()`` empties the device prefix
cache, so what it finds cached comes from the host. The host cache holds about a quarter of the working set. With
``--model`` (the real model's folder, triton_offload.models), the prompts are real text (tests/texts.py: prefixes
cut from the passages, suffixes from others) and their texts are reported too. Prints ``STRESS_RESULT {json}``:
every prompt's greedy tokens per pass, the cached tokens vLLM reports per pass, and vLLM's metrics after each pass.
With ``--no-offload`` the same engine runs without the connector: the reference.

From the repository root, with tests/ on PYTHONPATH (the drivers import the shared vllm_harness):

    python tests/e2e/vllm_stress_driver.py --policy lru
    python tests/e2e/vllm_stress_driver.py --no-offload          # reference outputs
    python tests/e2e/vllm_stress_driver.py --policy arc --tp 2   # tensor parallel: one host cache per rank
    python tests/e2e/vllm_stress_driver.py --model "$(python -m triton_offload.models)" --num-prompts 32
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

from vllm_harness import (
    GPU_BLOCK,
    block_bytes,
    build_tiny_llama,
    is_real,
    offload_metrics,
    print_result,
    prompt_ids,
    shutdown,
    tiny_llm,
)

# A dozen shared prefixes, whole blocks and not, 1 to 12 blocks long.
PREFIX_LENS = (32, 40, 64, 90, 128, 150, 192, 210, 256, 300, 352, 384)
NUM_PROMPTS = 192
SUFFIX_LENS = (8, 96)  # random suffix length range, so prompts end anywhere in a block
MAX_TOKENS = 4
BATCH = 64  # prompts per generate() call; vLLM keeps max_num_seqs of them running at once
MAX_NUM_SEQS = 32
# Device KV cache in blocks: a dozen running prompts' worth, so the device prefix cache keeps little beyond the running
# requests and lookups go to the host cache in both passes, not only after the reset.
KV_CACHE_BLOCKS = 128


def make_prompts(num_prompts: int = NUM_PROMPTS, seed: int = 1234, model: str | None = None) -> list[list[int]]:
    """Random ids; with a real ``model``, real text: the prefixes cut from the passages (one passage on from each
    other), each suffix a piece of another passage."""
    rng = random.Random(seed)
    if model is None:
        prefixes = [[rng.randrange(3, 512) for _ in range(n)] for n in PREFIX_LENS]
    else:
        prefixes = [prompt_ids(model, i, n) for i, n in enumerate(PREFIX_LENS)]
    prompts = []
    for _ in range(num_prompts):
        prefix = prefixes[rng.randrange(len(prefixes))]
        n = rng.randint(*SUFFIX_LENS)
        if model is None:
            prompts.append(prefix + [rng.randrange(3, 512) for _ in range(n)])
        else:
            text = prompt_ids(model, rng.randrange(100), 200)
            start = rng.randrange(200 - n)
            prompts.append(prefix + text[start : start + n])
    return prompts


def working_set_blocks(prompts: list[list[int]]) -> int:
    """Distinct full GPU blocks of all prompts (a block is identified by the tokens up to its end, as its hash)."""
    return len({tuple(p[: (i + 1) * GPU_BLOCK]) for p in prompts for i in range(len(p) // GPU_BLOCK)})


def run_pass(llm, params, prompts: list[list[int]], order: list[int]) -> tuple[dict, dict, dict]:
    """Generates for the prompts in ``order``, BATCH per generate() call; greedy tokens, cached tokens and texts (the
    real model's; None without a tokenizer) by index."""
    from vllm.inputs import TokensPrompt

    tokens, cached, texts = {}, {}, {}
    for start in range(0, len(order), BATCH):
        idx = order[start : start + BATCH]
        outs = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in idx], params, use_tqdm=False)
        for i, out in zip(idx, outs):
            tokens[i] = list(out.outputs[0].token_ids)
            cached[i] = out.num_cached_tokens
            texts[i] = out.outputs[0].text or None
    return tokens, cached, texts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", choices=("lru", "arc"), default="lru")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--no-offload", action="store_true", help="the same engine without the connector (reference)")
    ap.add_argument("--host-fraction", type=float, default=0.25, help="host blocks as a fraction of the working set")
    ap.add_argument("--kv-blocks", type=int, default=KV_CACHE_BLOCKS, help="device KV cache, in GPU blocks")
    ap.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    ap.add_argument("--model", help="a model folder (the real model: real text) instead of the tiny model built here")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory(prefix="tiny_llama_") as scratch:
        model_dir = args.model or scratch
        if not args.model:
            build_tiny_llama(model_dir)
        real, block = is_real(model_dir), block_bytes(model_dir)
        prompts = make_prompts(args.num_prompts, model=model_dir if real else None)
        ws = working_set_blocks(prompts)
        host_blocks = max(1, round(ws * args.host_fraction))
        extra = None
        if not args.no_offload:
            # The whole model's bytes per block: with TP each rank holds its share of the heads and of the budget.
            extra = {
                "spec_name": "TritonOffloadingSpec",
                "block_size": GPU_BLOCK,
                "cpu_bytes_to_use": host_blocks * block,
                "eviction_policy": args.policy,
            }
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=real)
        order2 = list(range(len(prompts)))
        random.Random(99).shuffle(order2)
        llm = tiny_llm(
            model_dir,
            extra,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=2048,
            kv_cache_memory_bytes=args.kv_blocks * block // args.tp,
            tensor_parallel_size=args.tp,
        )
        t_llm = time.perf_counter()

        passes = []
        for order in (list(range(len(prompts))), order2):
            t = time.perf_counter()
            tokens, cached, texts = run_pass(llm, params, prompts, order)
            passes.append(
                {
                    "tokens": [tokens[i] for i in range(len(prompts))],
                    "texts": [texts[i] for i in range(len(prompts))],
                    "cached": [cached[i] for i in range(len(prompts))],
                    "metrics": offload_metrics(llm),
                    "seconds": round(time.perf_counter() - t, 1),
                }
            )
            assert llm.reset_prefix_cache(), "reset_prefix_cache failed"
        # Store completions reach the scheduler one engine step after the worker finishes them: step once more
        # (a prompt shorter than a block stores nothing) so the accounting logged at shutdown has none in flight.
        for _ in range(2):
            llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], params, use_tqdm=False)
        result = {
            "policy": None if args.no_offload else args.policy,
            "tp": args.tp,
            "model": "real" if real else "tiny",
            "block_bytes": block,
            "extra_config": extra,
            "num_prompts": len(prompts),
            "working_set_blocks": ws,
            "host_blocks": None if args.no_offload else host_blocks,
            "passes": passes,
            "seconds": {"startup": round(t_llm - t0, 1), "total": round(time.perf_counter() - t0, 1)},
        }
        print_result("STRESS_RESULT", result)
        # Shut the engine down here, so the scheduler logs its final counters before this process exits.
        shutdown(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
