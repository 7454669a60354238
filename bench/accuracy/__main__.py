"""The accuracy harness's command: runs the reference and each configuration to compare in an engine of its own
(``python -m bench.accuracy.run``), then compares (``bench.accuracy.compare``), prints one line per configuration and
writes everything as JSON. A configuration is ``off`` (no offloading), ``offload`` (TritonOffloadingSpec, host block =
GPU block) or ``NAME=JSON`` (:func:`configuration`)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from bench.accuracy.compare import compare
from bench.accuracy.run import offload_config
from bench.accuracy.texts import LENGTHS
from bench.common.results import machine_info

ROOT = pathlib.Path(__file__).resolve().parents[2]


def configuration(spec: str, model: str) -> tuple[str, dict | None, dict]:
    """``off``, ``offload`` or ``NAME=JSON`` as (name, kv_connector_extra_config or None, engine arguments). NAME=JSON
    goes over ``offload``'s extra config, but for two keys of its own: ``"engine"``, more arguments of vLLM's ``LLM``
    (e.g. ``{"kv_cache_dtype": "fp8"}``), and ``"offload": false``, no connector at all."""
    if spec == "off":
        return "off", None, {}
    if spec == "offload":
        return "offload", offload_config(model), {}
    name, sep, changes = spec.partition("=")
    if not sep:
        raise SystemExit(f"a configuration is off, offload or NAME=JSON, not {spec!r}")
    changes = json.loads(changes)
    engine, offload = changes.pop("engine", {}), changes.pop("offload", True)
    if not isinstance(engine, dict) or not isinstance(offload, bool):
        raise SystemExit(f'{name}: "engine" takes an object of LLM arguments and "offload" true or false')
    if not offload and changes:
        raise SystemExit(f'{name}: "offload": false takes no extra config, got {sorted(changes)}')
    return name, offload_config(model, **changes) if offload else None, engine


def run_one(model: str, extra: dict | None, engine: dict, args, out: pathlib.Path) -> dict:
    """One configuration in its own process (vLLM: one engine per process); its JSON."""
    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    # vLLM's in-process engine: a configuration's process is its engine's (an engine core process of its own costs
    # ~15 s more per configuration on a 2-core machine: another interpreter importing torch and vLLM, and its exit).
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "bench.accuracy.run", "--model", model, "--extra", json.dumps(extra)]
    cmd += ["--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens), "--top-k", str(args.top_k)]
    cmd += ["--lengths", *map(str, args.lengths), "--dtype", args.dtype, "--engine", json.dumps(engine)]
    cmd += ["--fp8-codec", args.fp8_codec]
    subprocess.run([*cmd, "--out", str(out)], check=True, cwd=ROOT, env=env, timeout=args.timeout)
    return json.loads(out.read_text())


def summary_line(name: str, ref: str, s: dict, top_k: int) -> str:
    return (
        f"{name} vs {ref}: token agreement {s['token_agreement']:.2%}, identical prompts {s['prompts_identical']:.2%}, "
        f"diverged {s['diverged_prompts']} (first at {s['first_divergence_min']}), top-{top_k} KL mean "
        f"{s['kl_mean']:.3g} max {s['kl_max']:.3g}, cached tokens {s['cached_tokens']}"
    )


def report_of(args, names: list[str], results: dict, summaries: dict) -> dict:
    """The report of the configurations that finished (the reference first) and their ``summaries`` against it;
    ``not_finished``: the others."""
    ref = names[0]
    report = {
        "model": args.model,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "top_k": args.top_k,
        "dtype": args.dtype,
        "lengths": args.lengths,
        "fp8_codec": args.fp8_codec,
        "date": time.strftime("%Y-%m-%d"),
        **machine_info(),  # where, and from which commit
        "reference": ref,
        "summaries": dict(summaries),
        "not_finished": [n for n in names if n not in results],
    }
    report["seconds"] = {name: r["seconds"] for name, r in results.items()}
    report["results"] = results
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a model folder (default: SmolLM2-135M-Instruct, triton_offload.models)")
    ap.add_argument("--prompts", type=int, default=200, help="how many of bench/accuracy/texts.py's prompts")
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--top-k", type=int, default=5, help="logprobs kept per step")
    ap.add_argument("--lengths", type=int, nargs=2, default=LENGTHS, metavar=("SHORTEST", "LONGEST"),
                    help="prompt tokens, at least and at most (default: %(default)s)")  # fmt: skip
    ap.add_argument("--dtype", default="float32", help="the model's dtype (bfloat16 for an FP8 host format)")
    ap.add_argument("--reference", default="off")
    ap.add_argument("--compare", nargs="+", default=["offload"], help="off, offload or NAME=JSON (over offload's)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per configuration")
    ap.add_argument("--fp8-codec", choices=("kernel", "torch"), default="kernel",
                    help="torch: FP8 host rows by bench/accuracy/fp8_codec.py (the kernel's bytes, whole-tensor "
                    "PyTorch; its first launches checked against the kernel), for CPU runs")  # fmt: skip
    ap.add_argument("--out", help="write the results (configurations, summaries, every output) here as JSON")
    args = ap.parse_args(argv)
    if args.model is None:
        from triton_offload.models import smollm2

        args.model = str(smollm2())
    configs = [configuration(spec, args.model) for spec in [args.reference, *args.compare]]
    names, results, summaries = [c[0] for c in configs], {}, {}
    with tempfile.TemporaryDirectory(prefix="accuracy-") as tmp:
        for i, (name, extra, engine) in enumerate(configs):
            out = pathlib.Path(tmp) / f"{i}.json"
            results[name] = {"extra_config": extra, "engine": engine, **run_one(args.model, extra, engine, args, out)}
            if i:  # each configuration compared once, as it finishes
                summaries[name] = compare(results[names[0]]["rows"], results[name]["rows"])
                print(summary_line(name, names[0], summaries[name], args.top_k), flush=True)
            if args.out:  # after every configuration: a run stopped later keeps what finished
                report = report_of(args, names, results, summaries)
                pathlib.Path(args.out).write_text(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
