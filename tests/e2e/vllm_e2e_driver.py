"""Runs a real vLLM (CPU platform) with TritonOffloadingSpec through scripted scenarios; prints one JSON line.

Used by tests/e2e/test_vllm_e2e.py, one subprocess per configuration (vLLM takes ~15 s to start, so each configuration
runs all its scenarios in one ``LLM``). Prints ``E2E_RESULT {json}``: per probe, the cached tokens vLLM reports
(device prefix cache plus offload hits), whether the greedy tokens equal those of the prompt's cold run, and with
``--model`` (the real model: real text prompts) the text.

From the repository root, with tests/ on PYTHONPATH (the drivers import the shared vllm_harness):

    python tests/e2e/vllm_e2e_driver.py --config f1    # host block = GPU block, budget of 14 host blocks: eviction
    python tests/e2e/vllm_e2e_driver.py --config f2    # host block = 2 GPU blocks: partial hits, skip, connector reset
    python tests/e2e/vllm_e2e_driver.py --config hybrid  # sliding-window + full-attention model: two KV-cache groups
    python tests/e2e/vllm_e2e_driver.py --config f1 --model "$(python -m triton_offload.models)"  # the real model
    python tests/e2e/vllm_e2e_driver.py --config fp8   # bf16 model, host_format fp8_e4m3: ~2x the rows, lossy hits,
                                                       # the integrity checks: a corrupted FP8 block is recomputed
"""

from __future__ import annotations

import argparse
import json
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
    output,
    print_result,
    prompt_ids,
    shutdown,
    tiny_llm,
)

PROMPT_LEN = 200  # 6 full GPU blocks; vLLM always recomputes the last prompt token


def configs(block: int) -> dict[str, dict]:
    """The configurations for a model of ``block`` KV bytes per GPU block (vllm_harness.block_bytes)."""
    return {
        # Host block = GPU block; room for 14 host blocks, fewer than three prompts of 6 blocks each.
        "f1": {"block_size": GPU_BLOCK, "cpu_bytes_to_use": 14 * block, "eviction_policy": "lru"},
        # Host block = 2 GPU blocks; a budget given as a string, ample for every prompt here (11 rows of the real
        # model are stored: 31 MiB).
        "f2": {
            "block_size": 2 * GPU_BLOCK,
            "cpu_bytes_to_use": "16MiB" if block <= 1 << 16 else "64MiB",
            "num_ctas": 4,
        },
        # A hybrid model (sliding window + full attention), host block = 2 GPU blocks, a host region per KV-cache
        # group: room for 5 rows, fewer than the 3 + 3 full-attention keys of two prompts (one row also holds a
        # sliding-window key): the second prompt's store evicts the first's tail, in its group's pool only.
        "hybrid": {"block_size": 2 * GPU_BLOCK, "cpu_bytes_to_use": 5 * 4 * block // 2, "host_regions": "per_group"},
        # The FP8 host format on a bf16 model (LLM_OVERRIDES): the budget of 14 native rows (bf16 blocks are half
        # the fp32 ``block``) holds 27 FP8 rows, so three prompts of 6 blocks all stay on the host. With the
        # integrity checks, through the test plugin whose worker flips a host bit on command (integrity_plugin.py),
        # and our connector (CONNECTORS), which reports the failed blocks to vLLM.
        "fp8": {
            "block_size": GPU_BLOCK,
            "cpu_bytes_to_use": 14 * block // 2,
            "host_format": "fp8_e4m3",
            "integrity": "verify",
            "spec_name": "CorruptingSpec",
            "spec_module_path": "integrity_plugin",
        },
    }


CONFIG_NAMES = ("f1", "f2", "hybrid", "fp8")
# Engine settings per configuration (the others: tiny_llm's fp32), and the connector where not vLLM's own (with
# vLLM's recompute policy for failed loads).
LLM_OVERRIDES = {"fp8": {"dtype": "bfloat16"}}
CONNECTORS = {"fp8": "TritonOffloadingConnector"}
# The hybrid model's sliding window, in tokens (2 GPU blocks).
SLIDING_WINDOW = 2 * GPU_BLOCK


class Runner:
    def __init__(self, llm, seed: int, model_dir: str, logprobs: int | None = None):
        from vllm import SamplingParams

        self.llm, self.model_dir, self.real = llm, model_dir, is_real(model_dir)
        self.rng = random.Random(seed)
        self.seed = seed
        self.params = SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=self.real, logprobs=logprobs
        )
        self.cold: dict[str, list[int]] = {}  # prompt name -> tokens of its first run
        self.probes: list[dict] = []

    def prompt(self, prefix: list[int] = (), length: int = PROMPT_LEN) -> list[int]:
        """The next prompt: real text from the next passage on (the real model), else random ids."""
        if self.real:
            self.seed += 1
            return prompt_ids(self.model_dir, self.seed, length, prefix)
        return list(prefix) + [self.rng.randrange(3, 512) for _ in range(length - len(prefix))]

    def run(self, label: str, name: str, ids: list[int]) -> dict:
        """Generates for one prompt; the first run of a name is its reference, later runs are compared to it."""
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        raw = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], self.params, use_tqdm=False)[0]
        out = output(raw)
        ref = self.cold.setdefault(name, out["tokens"])
        probe = {"label": label, "prompt": name, "cached": out["cached"], "match": out["tokens"] == ref}
        probe["seconds"] = round(time.perf_counter() - t0, 2)
        if self.real:
            probe["text"] = out["text"]
        if self.params.logprobs is not None:  # how far it agrees, and the first token's top log-probabilities
            probe["agree"] = next((i for i, (a, b) in enumerate(zip(out["tokens"], ref)) if a != b), len(ref))
            probe["top"] = {str(t): lp.logprob for t, lp in raw.outputs[0].logprobs[0].items()}
        self.probes.append(probe)
        return probe

    def reset_device(self) -> None:
        """Empties the GPU (here: CPU) prefix cache only, so what a probe finds cached comes from the host cache."""
        assert self.llm.reset_prefix_cache(), "reset_prefix_cache failed"

    def probe(self, label: str, name: str, ids: list[int], corrupt: dict | None = None) -> dict:
        """Runs a prompt after emptying the device prefix cache; ``corrupt``: first a corruption order for the
        load it makes (integrity_plugin.py)."""
        self.reset_device()
        if corrupt is not None:
            with open(os.environ["TRITON_OFFLOAD_CORRUPT"], "w") as f:
                json.dump(corrupt, f)
        return self.run(label, name, ids)


def scenario_f1(r: Runner) -> None:
    a, b, c = r.prompt(), r.prompt(), r.prompt()
    r.run("a_cold", "a", a)
    r.probe("a_offload_hit", "a", a)  # all 6 blocks from the host
    r.run("b_cold", "b", b)
    r.run("c_cold", "c", c)  # 18 blocks > 14: evicts a's 4 least recently used blocks, its tail
    r.probe("c_after_eviction", "c", c)  # loads (so uses) all of c
    # a's 2 head blocks survive; its 4 tail blocks are recomputed and stored again, evicting b's tail (the least
    # recently used), not a's own head blocks just loaded.
    r.probe("a_after_eviction", "a", a)
    r.probe("b_after_a_restored", "b", b)  # b's 2 head blocks; storing its tail again evicts c's tail, now the oldest
    r.probe("c_last", "c", c)


def scenario_f2(r: Runner) -> None:
    p = r.prompt()
    r.run("p_cold", "p", p)
    r.probe("p_offload_hit", "p", p)  # 3 host blocks of 64 tokens
    r.probe("q_shares_100", "q", r.prompt(p[:100]))  # 1 whole host block shared: 64 tokens, not 96 (3 GPU blocks)
    r.probe("s_shares_32", "s", r.prompt(p[:GPU_BLOCK]))  # puts p's first GPU block in the device prefix cache
    r.run("p_load_skip_1", "p", p)  # device holds 1 block: the load starts mid host block (skip 1)
    assert r.llm.reset_prefix_cache(reset_connector=True), "reset_prefix_cache(reset_connector=True) failed"
    r.run("p_after_connector_reset", "p", p)  # host cache emptied: computed from scratch


def scenario_hybrid(r: Runner) -> None:
    p, q = r.prompt(), r.prompt()
    r.run("p_cold", "p", p)
    r.probe("p_offload_hit", "p", p)  # every group's keys of p from the host: 3 host blocks of 64 tokens
    r.run("q_cold", "q", q)  # stores q: the full-attention pool holds 5 keys, so p's tail key goes
    r.probe("q_offload_hit", "q", q)
    r.probe("p_after_eviction", "p", p)  # p's head survives in the full-attention pool; its tail is recomputed


def scenario_fp8(r: Runner) -> None:
    prompts = {name: r.prompt() for name in "abc"}
    for name, ids in prompts.items():
        r.run(f"{name}_cold", name, ids)  # 18 blocks: more than 14 native rows, fewer than 27 FP8 ones
    for name, ids in prompts.items():
        r.probe(f"{name}_offload_hit", name, ids)  # every block from the host, dequantized (and checked)
    # A bit of a's first host block flipped (a stored FP8 value) just before the load reads it: the block fails its
    # check, and vLLM recomputes from it on, i.e. the whole prompt: the cold tokens exactly.
    r.probe("a_corrupted", "a", prompts["a"], corrupt={"block": 0, "byte": 777, "bit": 3})


SCENARIOS = {"f1": scenario_f1, "f2": scenario_f2, "hybrid": scenario_hybrid, "fp8": scenario_fp8}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=CONFIG_NAMES, required=True)
    ap.add_argument("--model", help="a model folder (the real model) instead of the tiny model built here")
    ap.add_argument("--spec-module-path", default=None, help="use spec_module_path instead of the plugin's name")
    ap.add_argument("--extra", default="{}", help="JSON merged into kv_connector_extra_config")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.model and args.config == "hybrid":
        ap.error("--config hybrid builds its own (hybrid) tiny model")
    with tempfile.TemporaryDirectory(prefix="tiny_llama_") as scratch:
        model_dir = args.model or scratch
        if not args.model:
            build_tiny_llama(model_dir, sliding_window=SLIDING_WINDOW if args.config == "hybrid" else None)
        block = block_bytes(model_dir)
        extra = {"spec_name": "TritonOffloadingSpec", **configs(block)[args.config], **json.loads(args.extra)}
        if args.spec_module_path:
            extra["spec_module_path"] = args.spec_module_path
        t_model = time.perf_counter()
        overrides = dict(LLM_OVERRIDES.get(args.config, {}))
        if args.config in CONNECTORS:
            from vllm.config import KVTransferConfig

            overrides["kv_transfer_config"] = KVTransferConfig(
                kv_connector=CONNECTORS[args.config], kv_role="kv_both", kv_connector_extra_config=extra,
                kv_load_failure_policy="recompute",
            )  # fmt: skip
            # The workers (vLLM's processes, started below) read the corruption orders from here.
            os.environ.setdefault("TRITON_OFFLOAD_CORRUPT", os.path.join(scratch, "order"))
        llm = tiny_llm(model_dir, extra, **overrides)
        t_llm = time.perf_counter()
        runner = Runner(llm, seed=1, model_dir=model_dir, logprobs=5 if args.config == "fp8" else None)
        SCENARIOS[args.config](runner)
        t_runs = time.perf_counter()
        metrics = offload_metrics(llm)
        result = {
            "config": args.config,
            "model": "real" if runner.real else "tiny",
            "block_bytes": block,
            "extra_config": extra,
            "probes": runner.probes,
            "metrics": metrics,
            "seconds": {
                "startup": round(t_llm - t0, 1),
                "model": round(t_model - t0, 1),
                "scenarios": round(t_runs - t_llm, 1),
            },
        }
        print_result("E2E_RESULT", result)
        shutdown(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
