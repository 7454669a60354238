#!/usr/bin/env python3
"""Standalone benchmark of triton-offload's gather/scatter against today's ways and the PCIe link's own peak. On a CUDA
machine, for each workload, layout, transfer size, host-block factor and direction, the same blocks are moved by every
method in one run on one GPU, each after a byte-exact check on that very case; then the host cost of one call and the
GEMM slowdown caused by concurrent transfers are measured, and the targets are printed (PASS/FAIL). Without CUDA it runs
a correctness pass of every method under the Triton interpreter, with tiny shapes of every workload, and measures no
bandwidth. See bench/README.md and docs/benchmarks.md; the package's docstring names its modules' roles.

    python -m bench.transfer [--quick | --part PART] [--json PATH] [--plot PATH] [--save]
                             [--workloads NAME ...] [--layouts NAME ...] [--blocks N ...] [--num-ctas C ...]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

from bench.common.grid import FULL, PARTS, QUICK, grid
from bench.common.plot import plot_results
from bench.common.report import say
from bench.common.results import result_stem, write_json
from bench.common.timing import HIDE_US
from bench.common.workloads import WORKLOADS
from bench.transfer.cpu_check import run_cpu
from bench.transfer.sweep import run_gpu
from triton_offload.kernels.shapes import DEFAULT_NUM_CTAS

RESULTS_DIR = pathlib.Path(__file__).resolve().parents[1] / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.transfer",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="a short run: 128 blocks, f=4/skip=1, one layout per model")
    p.add_argument("--part", choices=sorted(PARTS), help="a part of the GPU run (tools/gpu/stages.py): preset options")
    p.add_argument("--json", metavar="PATH", help="write every row, the extras and the targets as JSON (rewritten "
                   "after every workload/layout group, so a killed run keeps what it measured)")  # fmt: skip
    p.add_argument("--plot", metavar="PATH", help="write a PNG of GB/s vs page size per method, with the peak")
    p.add_argument("--save", action="store_true", help="write both to bench/results/<device>-<date>[-<part>].json/.png")
    p.add_argument("--workloads", nargs="+", metavar="NAME", help=f"subset of {sorted(WORKLOADS)}")
    p.add_argument("--layouts", nargs="+", choices=("kv_first", "block_first", "mla"), help="subset of layouts")
    p.add_argument("--blocks", nargs="+", type=int, metavar="N", help=f"blocks per transfer (default {FULL.blocks})")
    p.add_argument("--num-ctas", nargs="+", type=int, metavar="C", help=f"Triton sweep (default {FULL.num_ctas})")
    p.add_argument("--budget-ms", type=float, default=None, help="device time per measurement "
                   f"(default {FULL.budget_ms:g}, quick {QUICK.budget_ms:g})")  # fmt: skip
    p.add_argument("--hide-us", type=float, default=HIDE_US, help="GPU sleep after each flush, hiding that much "
                   f"more of a call's host work (default {HIDE_US:g}; 0: flush only)")  # fmt: skip
    p.add_argument("--gemm-size", type=int, default=8192, help="M = N = K of the interference GEMM")
    p.add_argument("--no-sweep", action="store_true", help="skip the transfer sweep (only the extras)")
    p.add_argument("--no-overhead", action="store_true", help="skip the CPU-cost measurement")
    p.add_argument("--no-interference", action="store_true", help="skip the GEMM interference measurement")
    p.add_argument("--cpu-check", action="store_true", help="run the CPU correctness check even with CUDA present")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--integrity",
        action="store_true",
        help="also run triton_integrity: the kernel with the integrity "
        "checks (issue 41), at the default num_ctas, beside triton in the same run",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    part = p.parse_known_args(argv)[0].part
    # A part's presets come first, so options given with it still apply.
    args = p.parse_args(PARTS[part] + argv if part else argv)
    if args.budget_ms is None:
        args.budget_ms = grid(args.quick).budget_ms
    for name, values in (("--blocks", args.blocks), ("--num-ctas", args.num_ctas)):
        if values and min(values) < 1:
            p.error(f"{name} values must be >= 1, got {values}")
    if args.no_sweep and args.no_overhead and args.no_interference:
        p.error("--no-sweep with --no-overhead and --no-interference leaves nothing to run")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    json_path, plot_path = args.json, args.plot

    def checkpoint(doc: dict) -> None:
        if json_path:
            write_json(json_path, doc)

    if torch.cuda.is_available() and not args.cpu_check:
        if args.save:
            stem = RESULTS_DIR / result_stem(torch.cuda.get_device_name(), args.part)
            json_path, plot_path = json_path or f"{stem}.json", plot_path or f"{stem}.png"
        result, code = run_gpu(args, checkpoint)
    else:
        if args.save:
            say("--save: nothing to save without a GPU (the CPU check measures nothing)", "yellow")
        result, code = run_cpu(args)
    if json_path:
        write_json(json_path, result)
        say(f"wrote {json_path}")
    if plot_path:
        why = plot_results(result["rows"], plot_path, f"{result['device']} -- triton-offload", DEFAULT_NUM_CTAS)
        say(why or f"wrote {plot_path}")
    return code


if __name__ == "__main__":
    sys.exit(main())
