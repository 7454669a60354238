"""The CPU mode: a correctness pass of every method, under the Triton interpreter, with tiny shapes of every
workload's layout. Nothing is timed; every number field of every row is null."""

from __future__ import annotations

from collections import Counter

import torch

from bench.common.env import Env, environment, print_header
from bench.common.grid import grid
from bench.common.report import ProgressBar, print_table, say
from bench.transfer.session import Session, allocate, make_case, method_specs
from bench.transfer.sweep import selected_groups
from triton_offload.kernels.shapes import DEFAULT_NUM_CTAS

__all__ = ["CPU_BLOCKS", "run_cpu"]

# 8 blocks: with 2 layers, every layout has >= 16 descriptors, so vllm033's loads take its SM copy (the Triton
# kernel, run by the interpreter) in every layout, not only kv_first.
CPU_BLOCKS = 8


def run_cpu(args) -> tuple[dict, int]:
    """The interpreter-mode correctness pass; returns the results document and the exit code."""
    device = torch.device("cpu")
    env = Env(device, None, "no CUDA device: the driver's copy calls are replayed on host memory")
    meta = environment(device, env.driver_note)
    print_header(meta, "CPU correctness check (Triton interpreter)")
    say("No CUDA device: checking every method's bytes on CPU. NO BANDWIDTH IS MEASURED.", style="bold yellow")
    n = CPU_BLOCKS
    host_configs = grid(args.quick).host_configs
    run = Session(meta, env, method_specs(sorted({1, DEFAULT_NUM_CTAS}), integrity=getattr(args, "integrity", False)))
    groups = selected_groups(args)
    table: list[list] = []
    with ProgressBar(len(groups) * len(host_configs) * 2 * len(run.specs), "cpu check") as bar:
        for w, layout in groups:
            group = allocate(w.tiny(), layout, n, host_configs, device, args.seed)
            for f, skip in host_configs:
                for store in (True, False):
                    case = make_case(group, n, f, skip, store)
                    line = [w.name, layout, group.spec.page_bytes[0], f"{f}/{skip}", case.direction]
                    for ms in run.specs:
                        bar.describe(f"{w.name}/{layout} f={f} {ms.name}")
                        status, note, prepared = run.check(group, case, ms)
                        run.rows.append(run.row(group, case, ms, prepared and prepared.impl, status, note))
                        line.append(status + ("*" if status == "n/a" else ""))
                        bar.advance()
                    table.append(line)
    print_table(
        f"CPU check: bytes moved by each method vs kernels/reference.py ({n} blocks, tiny shapes of each workload)",
        ["workload", "layout", "page B", "f/skip", "dir", *(ms.name for ms in run.specs)],
        table,
        note="n/a*: needs CUDA (cudaMemcpyAsync / cuMemcpyBatchAsync); its copy plan (src, dst, size per copy) "
        "was replayed with memmove on CPU and moved the right bytes.",
    )
    print_table("Methods (on this machine)", ["method", "implementation"], run.method_impls(), wrap_last=True)
    counts = Counter(r["status"] for r in run.rows)
    say(
        f"{counts['pass']} passed, {counts['FAIL'] + counts['ERROR']} failed, {counts['n/a']} not applicable on CPU. "
        "No bandwidth was measured: this machine has no CUDA device.",
        style="bold red" if run.failures else "bold green",
    )
    note = "correctness only, tiny shapes of every workload's layout; no timing, every number field is null"
    return run.result("cpu-interpreter-check", args, complete=True, note=note), 1 if run.failures else 0
