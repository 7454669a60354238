"""One vLLM engine (CPU platform) with a tiering spec and an ``fs`` tier: serves one prompt, prints one JSON line.

Used by tests/test_vllm_tiering_e2e.py, one process per engine, so that two engines share nothing but ``root_dir``:

    # A: serve the prompt cold, wait until its chunks are files under --root, exit
    python tests/vllm_tiering_driver.py --model M --root R --block-size 64 --wait-files 3
    # B: a fresh engine (empty CPU tier) on the same files: the prefix comes back from the fs tier
    python tests/vllm_tiering_driver.py --model M --root R --block-size 64

``--spec native`` runs vLLM's own TieringOffloadingSpec with a test-only worker that writes vLLM's native layout
through its region views (tests/vllm_native_tiering.py). Prints ``TIERING_RESULT {json}``: the greedy tokens, the
cached tokens vLLM reports, the files under --root and the labelled cache-hit metrics.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

from vllm_harness import GPU_BLOCK, tiny_llm

PROMPT_LEN = 200  # 6 full GPU blocks; vLLM always recomputes the last prompt token
SPECS = {
    "ours": {"spec_name": "TritonTieringOffloadingSpec"},
    "native": {"spec_name": "NativeLayoutTestSpec", "spec_module_path": "vllm_native_tiering"},
}


def prompt(seed: int = 1) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(PROMPT_LEN)]


def block_files(root: str) -> list[str]:
    return sorted(glob.glob(os.path.join(root, "**", "*.bin"), recursive=True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model directory; its path is part of the files' namespace")
    ap.add_argument("--root", required=True, help="the fs tier's root_dir")
    ap.add_argument("--block-size", type=int, default=GPU_BLOCK, help="tokens per chunk (host block)")
    ap.add_argument("--spec", choices=sorted(SPECS), default="ours")
    ap.add_argument("--wait-files", type=int, default=0, help="after serving, wait until this many chunk files exist")
    ap.add_argument("--extra", default="{}", help="JSON merged into kv_connector_extra_config")
    ap.add_argument("--umask", help="octal umask for the engine and its processes, e.g. 022 (default: inherited)")
    args = ap.parse_args(argv)
    if args.umask is not None:
        os.umask(int(args.umask, 8))  # before vLLM starts: its processes inherit it
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {
        **SPECS[args.spec],
        "block_size": args.block_size,
        "cpu_bytes_to_use": 4 << 20,
        "secondary_tiers": [{"type": "fs", "root_dir": args.root, "n_read_threads": 2, "n_write_threads": 2}],
        **json.loads(args.extra),
    }
    t0 = time.perf_counter()
    llm = tiny_llm(args.model, extra)
    t_start = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt())], params, use_tqdm=False)[0]
    # Stores reach the CPU tier, then cascade to files, as the engine steps: keep it stepping with prompts too short
    # to fill a block (so they store nothing) until the chunks are files.
    tick = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    deadline = time.monotonic() + 60
    while len(block_files(args.root)) < args.wait_files and time.monotonic() < deadline:
        llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], tick, use_tqdm=False)
        time.sleep(0.05)
    metrics = {}
    wanted = ("vllm:prompt_tokens_cached_by_source", "vllm:kv_offload_tiering_", "vllm:external_prefix_cache_hits")
    for m in llm.get_metrics():
        if m.name.startswith(wanted) and hasattr(m, "value"):
            labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ("model_name", "engine"))
            metrics[f"{m.name}{{{labels}}}" if labels else m.name] = m.value
    result = {
        "spec": args.spec,
        "block_size": args.block_size,
        "tokens": list(out.outputs[0].token_ids),
        "cached": out.num_cached_tokens,
        "files": [os.path.relpath(p, args.root) for p in block_files(args.root)],
        "metrics": metrics,
        "seconds": {"startup": round(t_start - t0, 1), "serve": round(time.perf_counter() - t_start, 1)},
    }
    print("TIERING_RESULT " + json.dumps(result), flush=True)
    # Not vllm_harness.shutdown: the region-file test wants the exit a user gets who never shuts the engine down.
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
