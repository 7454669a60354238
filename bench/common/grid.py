"""What the transfer benchmark measures, in one place: the sweep grid of a full run and of ``--quick``, what the
extras measure on, how far ``vllm_native`` is warmed, the GPU run's transfer parts. Stdlib only: the GPU runner
(tools/gpu/) reads it before the project is installed, and :mod:`bench.transfer` runs from it."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "Grid",
    "FULL",
    "QUICK",
    "grid",
    "host_rows",
    "EXTRAS_WORKLOAD",
    "EXTRAS_LAYOUT",
    "EXTRAS_BLOCKS",
    "EXTRAS_BASELINES",
    "NATIVE_WARM_DEPTH",
    "VLLM033_MAX_PAGE_BYTES",
    "CALL_COST_CALLS",
    "PARTS",
    "VLLM_VERSION",
]


@dataclass(frozen=True)
class Grid:
    """One mode's sweep and the sizes of its measurements.

    Attributes:
        num_ctas: the Triton sweep (the kernel's default is always added).
        blocks: blocks per transfer.
        host_configs: (blocks_per_host_block, skip) pairs.
        budget_ms: device time per measurement.
        bursts: (bursts, calls per burst) of the CPU cost per call.
        gemm_runs: (GEMM iterations, repeats) of the interference measurement.
    """

    num_ctas: tuple[int, ...]
    blocks: tuple[int, ...]
    host_configs: tuple[tuple[int, int], ...]
    budget_ms: float
    bursts: tuple[int, int]
    gemm_runs: tuple[int, int]


# Host configurations: plain, and f=4 starting mid-block.
FULL = Grid((1, 2, 4, 8, 16, 32), (16, 128, 1024), ((1, 0), (4, 1)), 100.0, (25, 8), (30, 3))
QUICK = Grid((1, 4, 32), (128,), ((4, 1),), 30.0, (5, 8), (10, 1))


def grid(quick: bool) -> Grid:
    return QUICK if quick else FULL


def host_rows(n: int, f: int, skip: int) -> int:
    """Rows of a case's host view: the ceil((skip + n) / f) a transfer addresses, +1 because torch_staged's
    consecutive host ids start at 1, +1 for an unaddressed row whose sentinel must survive. The sweep's buffers and
    the serving benchmark's are both sized by it."""
    return math.ceil((skip + n) / f) + 2


# The extras (CPU cost per call, GEMM interference): 1024 blocks x 80 layers of Llama-3-70B TP8 pages, Triton at
# every num_ctas of the sweep and these baselines.
EXTRAS_WORKLOAD, EXTRAS_LAYOUT, EXTRAS_BLOCKS = "llama3-70b-tp8", "kv_first", 1024
EXTRAS_BASELINES = ("memcpy_batch", "vllm033", "vllm_native")

# vLLM 0.33's load policy (bench/baselines/vllm033.py applies it): a load takes
# its SM copy when every descriptor is smaller than this (and 8-byte aligned, and there are at least 16).
VLLM033_MAX_PAGE_BYTES = 28 * 1024

# Transfers of vllm_native kept in flight before timing (more than the timer keeps in flight behind its long calls).
NATIVE_WARM_DEPTH = 16

# bench.micro.call_cost's default --calls, run alone; the GPU run's stage passes fewer (tools/gpu/stages.py's
# CALL_COST_STAGE_CALLS).
CALL_COST_CALLS = 400
_NO_EXTRAS = ["--no-overhead", "--no-interference"]
# The transfer benchmark's parts of the GPU run (``--part NAME``: these options first; tools/gpu/ runs them).
PARTS: dict[str, list[str]] = {
    # With the integrity checks' rows beside triton's (issue 41: their cost, until a lease has measured it).
    "quick": ["--quick", "--integrity"],
    # The size-aware launch shape's probe (issue 38, section 3): the 2 KiB and 8 KiB pages at 128 and 1024 blocks,
    # the kernel at 4-32 CTAs beside every baseline and the contiguous peak, both host formats.
    "launch-shape": [
        *("--workloads", "small-page", "llama3-70b-tp8"),
        *("--blocks", "128", "1024"),
        *("--num-ctas", "4", "8", "16", "32"),
        *_NO_EXTRAS,
    ],
    "full-8b": ["--workloads", "llama3-8b", *_NO_EXTRAS],
    "full-70b": ["--workloads", "llama3-70b-tp8", *_NO_EXTRAS],
    "full-mla": ["--workloads", "deepseek-v3-mla", *_NO_EXTRAS],
    "full-small": ["--workloads", "small-page", *_NO_EXTRAS],
    "extras": ["--no-sweep"],
}

# The vLLM release the ``vllm_native`` baseline runs, and tools/gpu/vllm_bundle.py packs for the GPU machine.
VLLM_VERSION = "0.33.0"
