"""One vLLM engine (CPU platform) with a tiering spec and its secondary tiers: serves prompts, prints one JSON line.

Used by the tiering end-to-end tests, one process per engine, so that engines share nothing but their tiers (run
from the repository root with tests/ on PYTHONPATH: the drivers import the shared vllm_harness):

    # fs, A: serve the prompt cold, wait until its 3 chunks are files under --root, exit
    python tests/e2e/vllm_tiering_driver.py --model M --root R --block-size 64 --wait-stored 3
    # fs, B: a fresh engine (empty CPU tier) on the same files: the prefix comes back from the fs tier
    python tests/e2e/vllm_tiering_driver.py --model M --root R --block-size 64
    # p2p, A: serve prompts 1 and 2, print the result, keep serving peers until the file STOP exists
    python tests/e2e/vllm_tiering_driver.py --model M --tiers '[{"type": "p2p", "port": 5701, ...}]' \
        --requests '[{"prompt": 1}, {"prompt": 2}]' --serve-until STOP
    # p2p, B: prompt 1, fetched from A's CPU tier
    python tests/e2e/vllm_tiering_driver.py --model M --tiers '[{"type": "p2p", "port": 5702, ...}]' \
        --requests '[{"prompt": 1, "kv_transfer_params": {"remote_kv_source": {"kv_request_id": "r1",
        "remote_host": "127.0.0.1", "remote_port": 5701}}}]'

``--spec native`` runs vLLM's own TieringOffloadingSpec with a test-only worker that writes vLLM's native layout
through its region views (tests/e2e/vllm_native_tiering.py). A real model's folder (triton_offload.models) as
``--model`` gets real text prompts (tests/texts.py). Prints ``TIERING_RESULT {json}``: per request the greedy
tokens (and the real model's text), the cached tokens vLLM reports, its finish reason and the seconds it took; the
model's KV bytes per GPU block; the chunks each tier holds (fs:
files, obj: objects; null for others), the labelled cache-hit metrics (and the integrity checks' counters) and the
``/dev/shm`` files the engine's processes use. ``--variants`` runs several engines one after the other in this process
(vLLM's in-process engine), each with its own changes to the model's config.json (made in place, undone after it), to
the engine's arguments and to the extra config, and prints their requests under ``"variants"``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

from vllm_harness import (
    GPU_BLOCK,
    TIERING_RESULT,
    block_bytes,
    dump_stacks_on_request,
    is_real,
    output,
    print_result,
    prompt_ids,
    shm_files,
    tiny_llm,
)

PROMPT_LEN = 200  # 6 full GPU blocks; vLLM always recomputes the last prompt token
SPECS = {
    "ours": {"spec_name": "TritonTieringOffloadingSpec"},
    "native": {"spec_name": "NativeLayoutTestSpec", "spec_module_path": "vllm_native_tiering"},
}
STEP_PAUSE_S = 0.01  # a serving producer's pause between engine steps (see --serve-until)


def prompt(model: str, seed: int = 1) -> list[int]:
    """A ``PROMPT_LEN``-token prompt for ``model``; prompts of different seeds share no leading block."""
    return prompt_ids(model, seed, PROMPT_LEN)


def stored_chunks(tier: dict) -> list[str] | None:
    """What a secondary tier holds, by name: an ``fs`` tier's block files (relative to ``root_dir``), an object
    store's object keys (through boto3, with the tier's own ``store_config``); None for other tiers."""
    if tier["type"] == "fs":
        root = tier["root_dir"]
        return sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "**", "*.bin"), recursive=True))
    store = tier.get("store_config")
    if store is None:
        return None
    import boto3

    s3 = boto3.client(
        "s3",
        endpoint_url=f"{store.get('scheme', 'http')}://{store['endpoint_override']}",
        aws_access_key_id=store.get("access_key") or None,
        aws_secret_access_key=store.get("secret_key") or None,
        region_name=store.get("region") or "us-east-1",
    )
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=store["bucket"])
    return sorted(o["Key"] for page in pages for o in page.get("Contents", ()))


def scramble_region(llm) -> int:
    """XORs the first 256 bytes of every chunk row of the engine's CPU tier (the shared region, through the tiering
    manager's view of it) with 0x55; returns the rows. Needs vLLM's in-process engine (the scheduler in this
    process)."""
    import numpy as np

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise SystemExit("--scramble-region needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (the in-process engine)")
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    view = scheduler.connector.connector_scheduler.manager.primary_tier.get_kv_memoryview()
    rows = np.frombuffer(view.cast("B"), dtype=np.uint8).reshape(view.shape[0], -1)
    rows[:, :256] ^= 0x55
    return int(rows.shape[0])


def engine(args, extra: dict, **overrides):
    """The engine over ``args.model`` with ``extra`` as its ``kv_connector_extra_config`` (``overrides``: more
    arguments of ``tiny_llm``)."""
    if args.connector == "OffloadingConnector" and args.policy is None:
        return tiny_llm(args.model, extra, **overrides)
    from vllm.config import KVTransferConfig

    policy = {} if args.policy is None else {"kv_load_failure_policy": args.policy}
    transfer = KVTransferConfig(
        kv_connector=args.connector, kv_role="kv_both", kv_connector_extra_config=extra, **policy
    )
    return tiny_llm(args.model, None, kv_transfer_config=transfer, **overrides)


def serve(llm, requests: list[dict], model: str) -> list[dict]:
    """Serves each request one after the other: its greedy tokens (and a real model's text), cached tokens, finish
    reason and time."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    served = []
    for request in requests:
        extra_args = {"kv_transfer_params": request["kv_transfer_params"]} if "kv_transfer_params" in request else None
        params = SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=is_real(model), extra_args=extra_args
        )
        t = time.monotonic()  # CLOCK_MONOTONIC: comparable with other processes' on this machine
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt(model, request["prompt"]))], params, use_tqdm=False)
        served.append(
            {
                "prompt": request["prompt"],
                **output(out[0]),
                "seconds": round(time.monotonic() - t, 2),
                "span": [t, time.monotonic()],
            }
        )
    return served


def wait_stored(llm, tiers: list[dict], chunks: int) -> None:
    """Stores reach the CPU tier, then cascade to the secondary tiers, as the engine steps: keeps it stepping with
    prompts too short to fill a block (so they store nothing) until each fs or obj tier holds ``chunks`` chunks."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tick = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    deadline = time.monotonic() + 60

    def waiting() -> bool:
        return any(len(held) < chunks for held in map(stored_chunks, tiers) if held is not None)

    while waiting() and time.monotonic() < deadline:
        llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], tick, use_tqdm=False)
        time.sleep(0.05)


def read_metrics(llm) -> dict:
    """The labelled cache-hit metrics, vLLM's tiering metrics and the integrity checks' counters."""
    metrics = {}
    wanted = ("vllm:prompt_tokens_cached_by_source", "vllm:kv_offload_tiering_", "vllm:external_prefix_cache_hits",
              "vllm:triton_offload_integrity_")  # fmt: skip
    for m in llm.get_metrics():
        if m.name.startswith(wanted) and hasattr(m, "value"):
            labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ("model_name", "engine"))
            metrics[f"{m.name}{{{labels}}}" if labels else m.name] = m.value
    return metrics


def _merge(base: dict, patch: dict) -> dict:
    return {**base, **{k: _merge(base.get(k, {}), v) if isinstance(v, dict) else v for k, v in patch.items()}}


def variant(args, extra: dict, spec: dict, tiers: list[dict]) -> dict:
    """One engine of ``--variants``, in this process: ``spec["config"]`` merged into the model's config.json (in
    place: the model keeps its path, part of the tiers' namespace) until the engine is shut down, ``spec["engine"]``
    passed to ``tiny_llm``, ``spec["extra"]`` merged into the extra config; serves ``args.requests``, then waits for
    ``spec["wait_stored"]`` chunks (or ``spec["wait_new"]`` more than the tiers held before it)."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise SystemExit("--variants needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (the in-process engine)")
    path = os.path.join(args.model, "config.json")
    with open(path) as f:
        original = f.read()
    try:
        with open(path, "w") as f:
            json.dump(_merge(json.loads(original), spec.get("config", {})), f, indent=2)
        t0 = time.perf_counter()
        held = min((len(c) for c in map(stored_chunks, tiers) if c is not None), default=0)
        llm = engine(args, {**extra, **spec.get("extra", {})}, **spec.get("engine", {}))
        served = serve(llm, json.loads(args.requests), args.model)
        wait_stored(llm, tiers, spec.get("wait_stored", 0) or held + spec.get("wait_new", -held))
        result = {"name": spec["name"], "requests": served, "stored": [stored_chunks(t) for t in tiers]}
        result["seconds"] = round(time.perf_counter() - t0, 1)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
        return result
    finally:
        with open(path, "w") as f:
            f.write(original)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model directory; its path is part of the tiers' namespace")
    ap.add_argument("--root", help="an fs tier's root_dir: the tiers are then [fs at --root]")
    ap.add_argument("--tiers", help="JSON: the secondary_tiers list, instead of --root")
    ap.add_argument("--block-size", type=int, default=GPU_BLOCK, help="tokens per chunk (host block)")
    ap.add_argument("--spec", choices=sorted(SPECS), default="ours")
    ap.add_argument(
        "--requests",
        default='[{"prompt": 1}]',
        help="JSON list, served one after the other: {'prompt': seed, 'kv_transfer_params': {...}}",
    )
    ap.add_argument(
        "--wait-stored",
        type=int,
        default=0,
        help="after serving, wait until each fs or obj tier holds this many chunks",
    )
    ap.add_argument("--serve-until", help="after printing the result, keep the engine up until this file exists")
    ap.add_argument("--serve-timeout", type=float, default=300, help="bound on --serve-until, seconds")
    ap.add_argument("--extra", default="{}", help="JSON merged into kv_connector_extra_config")
    ap.add_argument("--engine", default="{}", help="JSON: more arguments of tiny_llm (e.g. hf_overrides)")
    ap.add_argument(
        "--variants",
        help="JSON list of engines run one after the other in this process (in-process engine): {'name': ..., "
        "'config': config.json changes, 'engine': tiny_llm arguments, 'extra': extra config, 'wait_stored': n, "
        "'wait_new': n}",
    )
    ap.add_argument("--umask", help="octal umask for the engine and its processes, e.g. 022 (default: inherited)")
    ap.add_argument("--connector", default="OffloadingConnector", help="kv_connector (TritonOffloadingConnector)")
    ap.add_argument("--policy", choices=["recompute", "fail"], help="kv_load_failure_policy (default: vLLM's)")
    ap.add_argument(
        "--scramble-region",
        action="store_true",
        help="after serving (in-process engine), change the first 256 bytes of every chunk row of this engine's CPU "
        "tier in place: what its peers then fetch is corrupted (the integrity checks' p2p test)",
    )
    args = ap.parse_args(argv)
    dump_stacks_on_request()  # a producer that stops answering its peers says where it is (Background.state)
    if args.umask is not None:
        os.umask(int(args.umask, 8))  # before vLLM starts: its processes inherit it

    if (args.root is None) == (args.tiers is None):
        ap.error("give --root or --tiers")
    tiers = (
        json.loads(args.tiers)
        if args.tiers
        else [{"type": "fs", "root_dir": args.root, "n_read_threads": 2, "n_write_threads": 2}]
    )
    extra = {
        **SPECS[args.spec],
        "block_size": args.block_size,
        # 64 tiny GPU blocks; 32 of the real model (of 1440 KiB: A3 of the p2p test holds 3 prompts in chunks of 3)
        "cpu_bytes_to_use": max(4 << 20, 32 * block_bytes(args.model)),
        "secondary_tiers": tiers,
        **json.loads(args.extra),
    }
    if args.variants:
        print_result(TIERING_RESULT, {"variants": [variant(args, extra, v, tiers) for v in json.loads(args.variants)]})
        return 0
    t0 = time.perf_counter()
    llm = engine(args, extra, **json.loads(args.engine))
    t_start = time.perf_counter()
    served = serve(llm, json.loads(args.requests), args.model)
    wait_stored(llm, tiers, args.wait_stored)
    metrics = read_metrics(llm)
    result = {
        "spec": args.spec,
        "block_size": args.block_size,
        "block_bytes": block_bytes(args.model),
        "requests": served,
        "stored": [stored_chunks(tier) for tier in tiers],
        "metrics": metrics,
        "shm": shm_files(os.getpgid(0)),  # the /dev/shm files this engine's processes map or hold open now
        "seconds": {"startup": round(t_start - t0, 1), "serve": round(time.perf_counter() - t_start, 1)},
    }
    if args.scramble_region:
        result["scrambled_rows"] = scramble_region(llm)
    print_result(TIERING_RESULT, result)
    if args.serve_until:
        # Serving peers (a p2p producer): the tiers answer them once per engine step. vLLM's multiprocess engine core
        # steps back to back for as long as a p2p tier lives, and its worker spins on the step queue, about two cores
        # all the time (tests/e2e/test_vllm_p2p_e2e.py), which starves the other engines of a test on a 2-core machine.
        # So a producer runs vLLM's in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), stepped here.
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            ap.error("--serve-until needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (the in-process engine)")
        deadline = time.monotonic() + args.serve_timeout
        while not os.path.exists(args.serve_until) and time.monotonic() < deadline:
            llm.llm_engine.step()
            time.sleep(STEP_PAUSE_S)
    # Not vllm_harness.shutdown: the region-file test wants the exit a user gets who never shuts the engine down.
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
