"""Runs a real vLLM (CPU platform) with the fault-injecting test spec (tests/e2e/offload_fault_plugin.py); prints one
JSON line.

Used by tests/e2e/test_vllm_faults.py. Scenarios:

* ``no-room``: a host cache of 4 blocks and a prompt of 6 blocks, so the manager cannot place its store
  (``prepare_store`` returns None); then a prompt of 3 blocks, which is stored and loaded back.
* ``fail-store``: the second store job fails on the worker.
* ``fail-load``: the first load job fails on the worker.

Prints ``FAULT_RESULT {json}``: per probe, the greedy tokens and the cached tokens vLLM reports, and the exception
``generate`` raised, if any. With ``--no-offload`` the same prompts run without the connector (the reference).

From the repository root, with tests/ on PYTHONPATH (the drivers import the shared vllm_harness):

    TRITON_OFFLOAD_FAULT_RECORD=/tmp/rec.jsonl python tests/e2e/vllm_fault_driver.py --scenario fail-store
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

from vllm_harness import GPU_BLOCK, GPU_BLOCK_BYTES, build_tiny_llama, print_result, shutdown, tiny_llm

SCENARIOS = {
    "no-room": {"cpu_bytes_to_use": 4 * GPU_BLOCK_BYTES, "fault": None},
    "fail-store": {"cpu_bytes_to_use": "16MiB", "fault": "store:2"},
    "fail-load": {"cpu_bytes_to_use": "16MiB", "fault": "load:1"},
}


def run(llm, params, probes: list[dict], label: str, ids: list[int], reset: bool = False) -> None:
    from vllm.inputs import TokensPrompt

    if reset:  # empty the device prefix cache: what is cached next comes from the host
        assert llm.reset_prefix_cache(), "reset_prefix_cache failed"
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    probes.append({"label": label, "tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    ap.add_argument("--no-offload", action="store_true", help="the same engine without the connector (reference)")
    args = ap.parse_args(argv)
    scenario = SCENARIOS[args.scenario]
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if scenario["fault"] and not args.no_offload:
        os.environ["TRITON_OFFLOAD_FAULT"] = scenario["fault"]  # read by the plugin in the worker process

    from vllm import SamplingParams

    extra = None
    if not args.no_offload:
        extra = {
            "spec_name": "FaultInjectingSpec",
            "spec_module_path": "offload_fault_plugin",
            "block_size": GPU_BLOCK,
            "cpu_bytes_to_use": scenario["cpu_bytes_to_use"],
        }
    rng = random.Random(7)
    p_long = [rng.randrange(3, 512) for _ in range(200)]  # 6 full blocks
    p_short = [rng.randrange(3, 512) for _ in range(100)]  # 3 full blocks
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    probes: list[dict] = []
    raised = None
    with tempfile.TemporaryDirectory(prefix="tiny_llama_") as model_dir:
        build_tiny_llama(model_dir)
        llm = tiny_llm(model_dir, extra)

        try:
            if args.scenario == "no-room":
                run(llm, params, probes, "long", p_long)  # 6 blocks > 4 host blocks: every offer refused
                run(llm, params, probes, "long_again", p_long, reset=True)  # nothing on the host: computed again
                run(llm, params, probes, "short", p_short)  # 3 blocks fit
                run(llm, params, probes, "short_from_host", p_short, reset=True)
            elif args.scenario == "fail-store":
                run(llm, params, probes, "first", p_long)  # store job 1 succeeds
                run(llm, params, probes, "second", p_short)  # store job 2 fails
                run(llm, params, probes, "after", p_long)  # never reached: the engine has stopped
            else:
                run(llm, params, probes, "first", p_long)
                run(llm, params, probes, "load", p_long, reset=True)  # load job 1 fails
                run(llm, params, probes, "after", p_short)
        except Exception as e:  # the engine stopped: report it, as the test expects for injected faults
            raised = f"{type(e).__name__}: {e}"
        print_result("FAULT_RESULT", {"scenario": args.scenario, "probes": probes, "raised": raised})
        if raised is None:
            shutdown(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
