"""The accuracy harness (``python -m bench.accuracy``): what a KV format or an offload path does to a real model's
output. Every configuration serves the same real-text prompts (``texts``: 248 at most, 256 to 448 tokens) with greedy
decoding and the top-k logprobs of each step, in an engine of its own (``run``: vLLM's CPU or GPU build,
SmolLM2-135M-Instruct from triton_offload.models by default); one with offloading runs each batch of prompts twice,
emptying the device prefix cache in between, and keeps the second pass, whose prefixes came back from the host.
``compare`` sets each configuration against the reference: token agreement, the first divergence, and a KL estimate
over the top-k where the two still share a context. Lossless offloading agrees 100 %
(tests/e2e/test_accuracy_harness.py, with a deliberately perturbed KV that it must catch).

    python -m bench.accuracy --prompts 200 --out acc.json   # off vs offload: ~40 min on 2 busy cores (8: ~3 min)
    python -m bench.accuracy --prompts 8 --compare offload 'p={"spec_name": "PerturbingSpec",
        "spec_module_path": "integrity_plugin"}'                                      # PYTHONPATH=tests/e2e
"""
