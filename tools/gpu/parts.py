"""The GPU run's parts and the time model that sizes them: the stages of ``./dev gpu run`` (tools/gpu/run.py) that
each finish in under 8 minutes on an H100, and the benchmark options of the transfer-benchmark parts.

    python -m tools.gpu.parts list          # every part with its estimated minutes, in the runner's default priority
    python -m tools.gpu.parts args PART     # the bench.transfer arguments of a transfer-benchmark part

The parts in :data:`PARTS` (bench/common/grid.py) are ``python -m bench.transfer`` with the part's options; the
others are the machine facts, the GPU tests (``gpu-tests``: ``pytest -m gpu`` but the two benchmark-subprocess
tests, which ``gpu-tests-slow`` runs), ``python -m bench.serving`` (``serving``: its decisive preset;
``serving-full``: the default run) and ``python -m bench.micro.call_cost``. tools/gpu/stages.py says what each runs;
this module only estimates.

The estimate is a model, not a measurement (the first H100 run, 2026-11-22, took about half of it: docs/gpu-run.md;
the runner scales the model by what its ledger measured, and uses a part's own measured time once it has one):
per case and method, the device time of the calls GpuTimer makes (a warm-up, an estimate, then samples until the
100 ms budget is spent, at least 3, at most 100) at the rates below, plus the flush and sleep before each sample,
the byte check (host buffer passes over the link and a host memset), the allocation of each workload, and a fixed
start-up (torch import, CUDA init, the C++ helper's build, Triton compiles). The rates are the pessimistic ends of
the ranges the GPU-readiness review used: a 50 GB/s link, 3 GB/s per Triton program, 3 us per cudaMemcpyAsync,
0.1 us per batched descriptor. The serving part's model (:func:`serving_plan_seconds`, for the full run and each
preset, :func:`serving_preset_seconds`): each step at 400 TFLOP/s of bf16 matrix products (about half an H100's dense
peak), 2.5 TB/s for its weight and KV reads, or 10 us per kernel launch from Python, whichever is longest; each sync
load's stall at the link rate; the checks between steps (the step's stored blocks and each loaded region read on the
device, their launches); every run of every round and load mode, the closing ``none`` included; the byte-exact check
of each point's last run at 2 GB/s (an index on the host, a pageable copy up); the contiguous copy and the duplex
samples; and each workload and shape's set-up (weights, caches, pinning the host cache).
``vllm_native`` moves bytes as ``vllm033`` does, but a call also costs vLLM's own descriptor building on the host
(longer than the timer hides at many layers, so it is counted as the call's time when larger), and every host
format of every size allocates vLLM's own pinned region.
"""

from __future__ import annotations

import dataclasses
import sys

from bench.common.grid import (
    CALL_COST_CALLS,
    EXTRAS_BASELINES,
    EXTRAS_BLOCKS,
    EXTRAS_WORKLOAD,
    FULL,
    NATIVE_WARM_DEPTH,
    PARTS,
    QUICK,
    VLLM033_MAX_PAGE_BYTES,
    Grid,
    host_rows,
)
from bench.common.results import BASELINE_ORDER, INTEGRITY_METHOD
from bench.common.workloads import WORKLOADS
from bench.serving.config import (
    CONTIGUOUS_REPEATS,
    DUPLEX_METHODS,
    DUPLEX_REPEATS,
    FULL_PLAN,
    GATE_US,
    LOAD_REGIONS,
    PREFIXES,
    PRESETS,
    SYNC,
    RunPlan,
    ring_sizes,
    with_integrity,
)
from tools.gpu.stages import CALL_COST_STAGE, CALL_COST_STAGE_CALLS, SERVING_STAGE, STAGES
from triton_offload.kernels.copy_blocks import DEFAULT_NUM_CTAS, size_aware_ctas

__all__ = [
    "MACHINE_PART",
    "TEST_PART",
    "SLOW_TEST_PART",
    "SERVING_PART",
    "SERVING_FULL_PART",
    "SERVING_SHAPE_PART",
    "HOST_MEMORY_PART",
    "CALL_COST_PART",
    "PARTS",
    "LIMIT_S",
    "estimate_seconds",
    "part_names",
    "serving_plan_seconds",
    "serving_preset_seconds",
    "serving_stage_plan",
]

MACHINE_PART = "machine"  # GPU, driver, PCIe link, NUMA, CPUs, memory (tools/gpu/machine.py)
TEST_PART = "gpu-tests"  # `pytest -m gpu` but the two benchmark-subprocess tests
SLOW_TEST_PART = "gpu-tests-slow"  # those two: tests/bench/test_bench_gpu.py's and test_bench_serving.py's GPU runs
SERVING_PART = "serving"  # bench.serving's decisive preset (issue 39); the parts in PARTS run bench.transfer
SERVING_FULL_PART = "serving-full"  # bench.serving's default run: three workloads x every method, duplex
SERVING_SHAPE_PART = "serving-shape"  # bench.serving's launch-shape preset: the kernel's two launch shapes
HOST_MEMORY_PART = "host-memory"  # bench.micro.host_cache with tools/gpu/stages.py's HOST_MEMORY_ARGS
CALL_COST_PART = "call-cost"  # bench.micro.call_cost: host time per call, direct launch vs Triton's dispatch
# bench.micro.call_cost's rows that each issue --calls transfers (the stage's CALL_COST_STAGE_CALLS) of 1024 blocks x
# 80 layers of 8 KiB pages: the public calls and engine submits, each with the direct launch and with Triton's
# dispatch, and the launch alone twice; with --integrity (the stage's CALL_COST_STAGE) also both engine submits with
# the integrity checks.
CALL_COST_ROWS = 10
CALL_COST_INTEGRITY_ROWS = 2
LIMIT_S = 8 * 60  # each part must fit a 10-minute call with room for the install and a cold start

# The time model (see the module docstring).
LINK_BPS = 50e9
PER_PROGRAM_BPS = 3e9
COPY_ISSUE_S = 3e-6
BATCH_DESCRIPTOR_S = 0.1e-6
SAMPLE_OVERHEAD_S = 0.3e-3 + 0.2e-3  # flush + sleep, and the host's per-sample work
HOST_MEMSET_BPS = 10e9
INSTALL_S = 40.0  # ./dev gpu run's `pip install -e .` and the vLLM bundle's unpack (the review's 20-40 s)
STARTUP_S = 60.0  # torch import and CUDA init, the C++ helper, Triton compiles (per process)
MACHINE_S = 5.0  # nvidia-smi, sysfs and a torch import
# `pytest -m gpu` (the GPU-readiness review of 11-26: 4-8 minutes in all, of which collection 10-30 s, cold Triton
# compiles 0.5-1.5 min, the two benchmark subprocesses 1-3 min each, everything else under a minute).
TESTS_S = 2 * 60.0  # all but the two benchmark subprocesses
SLOW_TESTS_S = 2 * 2 * 60.0  # the two benchmark subprocesses
GEMM_S = 1.6e-3  # one 8192^3 bf16 GEMM on an H100
CALIBRATE_S = 2.0  # auto's calibration, once per layout and f (path_choice.calibrate: < 1 s aimed at, 3 s tested)
MATMUL_FLOPS = 400e12  # the serving step's bf16 products on an H100 (dense peak ~990e12)
MEM_BPS = 2.5e12  # the decode step's weight and KV reads, and the checks' device reads, on an H100 (peak 3.35e12)
LAUNCH_S = 10e-6  # one kernel launch from Python
KERNELS_PER_LAYER = 6  # the serving step's four products and two KV writes (and the attention read, where there is one)
CHECK_BPS = 2e9  # the serving byte check: host index + pageable copy up + compare; the prefixes' byte sums
CHECK_OPS_PER_PAGE = 3  # a per-job check's ops per K or V page of each layer: the id upload, the gather, the sum
# vLLM's transfer_async per call: per canonical tensor (run) and per descriptor, measured in host replay on the
# 2-core CI-class VM (10-14 us per tensor at 16-1024 blocks; a GPU machine's host is faster).
NATIVE_RUN_S = 12e-6
NATIVE_DESCRIPTOR_S = 0.01e-6
PIN_BPS = 5e9  # allocating and zeroing pinned host memory


def _transfer_s(method: str, ctas: int | None, nbytes: int, copies: int, store: bool, page: int, runs: int) -> float:
    link = nbytes / LINK_BPS
    if method == INTEGRITY_METHOD:  # the kernel at the default num_ctas; its checks' cost is what the run measures
        return _transfer_s("triton", DEFAULT_NUM_CTAS, nbytes, copies, store, page, runs)
    if method == "triton":
        return nbytes / min(LINK_BPS, ctas * PER_PROGRAM_BPS)
    if method == "triton_size_aware":  # by the page: its runs are page / 2 (kv_first) or more, never fewer programs
        return nbytes / min(LINK_BPS, size_aware_ctas(page) * PER_PROGRAM_BPS)
    if method == "memcpy_per_block":
        return max(link, copies * COPY_ISSUE_S)
    if method == "vllm_native":
        host = runs * NATIVE_RUN_S + copies * NATIVE_DESCRIPTOR_S
        return max(host, _transfer_s("vllm033", None, nbytes, copies, store, page, runs))
    if method == "vllm033" and not store and page < VLLM033_MAX_PAGE_BYTES:
        return nbytes / min(LINK_BPS, 12 * PER_PROGRAM_BPS)
    if method in ("memcpy_batch", "vllm033"):
        return max(link, copies * BATCH_DESCRIPTOR_S)
    return link  # peak, torch_staged (its GPU-side gather is ~1% of the link time), auto (the faster path)


def _measure_s(t: float, budget_s: float) -> float:
    samples = max(3, min(100, int(budget_s / max(t, 1e-6))))
    return (2 + samples) * t + samples * SAMPLE_OVERHEAD_S


def _host_bytes(n: int, f: int, skip: int, block_bytes: int) -> int:
    return host_rows(n, f, skip) * f * block_bytes  # as session.allocate / make_case size it


def _sweep_s(workloads, grid: Grid, one_layout: bool, integrity: bool = False) -> float:
    checked = [(INTEGRITY_METHOD, None)] if integrity else []
    methods = [("triton", c) for c in grid.num_ctas] + checked + [(m, None) for m in BASELINE_ORDER]
    budget_s = grid.budget_ms / 1e3
    total = 0.0
    for w in workloads:
        layouts = w.layouts[:1] if one_layout else w.layouts
        for layout in layouts:
            runs = w.num_layers * (2 if layout == "kv_first" else 1)
            block_bytes = w.num_layers * w.page_bytes
            host_bytes = max(_host_bytes(grid.blocks[-1], f, skip, block_bytes) for f, skip in grid.host_configs)
            total += 2.0 + host_bytes / PIN_BPS  # allocation: pinning runs at a few GB/s
            total += CALIBRATE_S * len(grid.host_configs)  # auto's calibrations
            for n in grid.blocks:
                nbytes = n * block_bytes
                for f, skip in grid.host_configs:
                    # A check fills the case's host view, moves it over the link a few times and compares on the GPU.
                    case_host = _host_bytes(n, f, skip, block_bytes)
                    check = 4 * case_host / LINK_BPS + case_host / HOST_MEMSET_BPS + 0.02
                    total += case_host / PIN_BPS  # vllm_native: vLLM's own region, one per host format and size
                    for store in (True, False):
                        for method, c in methods:
                            t = _transfer_s(method, c, nbytes, n * runs, store, w.page_bytes, runs)
                            total += _measure_s(t, budget_s) + check
                            if method == "vllm_native":
                                total += NATIVE_WARM_DEPTH * t  # vLLM's pools warmed before the check
    return total


def _extras_s(grid: Grid) -> float:
    w = WORKLOADS[EXTRAS_WORKLOAD]
    t = EXTRAS_BLOCKS * w.num_layers * w.page_bytes / LINK_BPS  # 640 MiB per call, link-bound
    points = len(grid.num_ctas) + len(EXTRAS_BASELINES)  # triton at every num_ctas, and the baselines
    checks = 2 * points * (6 * t + 0.05)
    bursts, per_burst = grid.bursts
    overhead = 2 * bursts * per_burst * t
    iters, repeats = grid.gemm_runs
    inter = 2 * points * (4 * t + repeats * 1.3 * iters * GEMM_S * 2)
    return checks + overhead + inter


def _serving_step_s(w, shape) -> float:
    """One serving step on an H100 by the model: its products' FLOPs, its weight and KV reads, or its launches."""
    m = w.model
    weights = 2 * w.num_layers * sum(k * n for k, n in m.matmuls().values())
    kv_read = 2 * 2 * shape.decode * shape.context * m.kv_width * w.num_layers  # K and V, bf16
    kernels = KERNELS_PER_LAYER + (1 if shape.context else 0)
    return max(shape.tokens * m.flops_per_token() * w.num_layers / MATMUL_FLOPS, (weights + kv_read) / MEM_BPS,
               w.num_layers * kernels * LAUNCH_S)  # fmt: skip


def serving_plan_seconds(plan: RunPlan) -> float:
    """The model's seconds for one serving run (``bench/serving/cli.py``) of ``plan``, start-up excluded."""
    total = 0.0
    seen = set()
    for name, shape_name in plan.cases:
        w, shape = WORKLOADS[name], plan.shape(shape_name)
        block_bytes = w.num_layers * w.page_bytes
        sizes = ring_sizes(shape, w.block_size)
        weights = 2 * w.num_layers * sum(k * n for k, n in w.model.matmuls().values())
        host_bytes = sizes.host_blocks * block_bytes
        prefix_bytes = sizes.prefix_blocks * block_bytes
        # Allocation, normal_, pinning; the cached prefixes made on the device and copied down through pageable
        # memory.
        setup = 2.0 + weights / 100e9 + host_bytes / PIN_BPS + PREFIXES * prefix_bytes / CHECK_BPS
        load = prefix_bytes / LINK_BPS
        step = _serving_step_s(w, shape)
        # Between steps: the stored blocks' sums on the device (a gather and a sum), launch by launch.
        pages = 2 * w.num_layers
        check = 2 * sizes.max_per_step * block_bytes / MEM_BPS + pages * CHECK_OPS_PER_PAGE * LAUNCH_S
        chunks = -(-sizes.prefix_blocks // 128)  # serving_check.CHECK_CHUNK blocks per gather
        region_check = 2 * prefix_bytes / MEM_BPS + pages * CHECK_OPS_PER_PAGE * LAUNCH_S * chunks
        steps = shape.warmup + shape.steps
        arrivals = -(-steps // shape.load_every)
        reset = sizes.host_ring * block_bytes / HOST_MEMSET_BPS
        for mode in plan.load_modes:
            run = reset + steps * (step + check) + arrivals * region_check + (arrivals * load if mode == SYNC else 0)
            total += plan.runs_per_mode() * run
        points = (plan.runs_per_mode() - ("none" in plan.methods)) // plan.rounds  # the byte-exact check: once each
        # The store ring and the cached prefixes read on the host; the load regions compared on the device.
        exact = (sizes.host_ring + PREFIXES * sizes.prefix_blocks) * block_bytes / CHECK_BPS
        exact += 2 * LOAD_REGIONS * prefix_bytes / MEM_BPS
        total += setup + points * exact
        if "auto" in plan.methods:
            total += CALIBRATE_S  # once per set-up: its engine is kept for every run
        if "vllm_native" in plan.methods:
            total += 2 * host_bytes / PIN_BPS  # vLLM pins a region as large as the host cache; the mirror into it
        total += (1 + CONTIGUOUS_REPEATS) * load  # the contiguous copy of this shape's prefix
        if name not in seen:  # once per workload: the duplex
            seen.add(name)
            if plan.duplex:
                duplex = sum(m in plan.methods for m in DUPLEX_METHODS)
                total += duplex * (1 + 3 * DUPLEX_REPEATS) * (GATE_US * 1e-6 + 2 * load)
    return total


def serving_preset_seconds(name: str) -> float:
    """The model's seconds for ``bench/serving/cli.py --preset NAME`` on an H100, start-up included (one process).

    Raises:
        ValueError: an unknown preset (the known ones are listed).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown serving preset {name!r}; presets: {sorted(PRESETS)}")
    return STARTUP_S + serving_plan_seconds(PRESETS[name])


def _serving_s() -> float:
    return serving_plan_seconds(FULL_PLAN)


def _call_cost_s(integrity: bool, calls: int = CALL_COST_CALLS) -> float:
    """bench.micro.call_cost with ``--calls calls`` (the stage passes CALL_COST_STAGE_CALLS)."""
    w = WORKLOADS["llama3-70b-tp8"]
    transfer = 1024 * w.num_layers * w.page_bytes / LINK_BPS
    allocate = 2100 * w.num_layers * w.page_bytes / PIN_BPS  # the caches' random fill and the pinned host cache
    rows = CALL_COST_ROWS + (CALL_COST_INTEGRITY_ROWS if integrity else 0)
    return allocate + rows * calls * transfer


def serving_stage_plan() -> RunPlan:
    """What the runner's ``serving`` stage runs (tools/gpu/stages.py's SERVING_STAGE): the decisive preset, with
    triton_integrity after its methods when the stage asks for ``--integrity``."""
    plan = PRESETS[SERVING_STAGE[SERVING_STAGE.index("--preset") + 1]]
    return with_integrity(plan) if "--integrity" in SERVING_STAGE else plan


def _host_memory_s() -> float:
    """bench.micro.host_cache with HOST_MEMORY_ARGS: per size, placement and page size a first touch and a
    registration per thread count (pinning-bound, counted at PIN_BPS each), then the near/far copies (4 GiB pinned
    per node, repeats + 1 each way)."""
    from tools.gpu.stages import HOST_MEMORY_OPTIONS as values  # stdlib only

    sizes = sum(float(v) for v in values["--sizes-gib"]) * 2**30
    combos = len(values["--placements"]) * len(values["--huge-pages"])
    setup = combos * sizes * (1 / HOST_MEMSET_BPS + len(values["--threads"]) / PIN_BPS)
    gib = float(values["--transfer-gib"][0]) * 2**30
    near_far = 2 * (gib / PIN_BPS + 2 * (int(values["--repeats"][0]) + 1) * gib / LINK_BPS)
    return setup + near_far


def part_names() -> list[str]:
    """Every part this model estimates."""
    return [MACHINE_PART, TEST_PART, SLOW_TEST_PART, SERVING_PART, SERVING_SHAPE_PART, SERVING_FULL_PART,
            CALL_COST_PART, HOST_MEMORY_PART, *PARTS]  # fmt: skip


def _sweep_args(args: list[str]) -> tuple[list, Grid, bool, bool]:
    """The workloads, grid, one-layout flag and integrity flag a bench.transfer part's options select."""

    def values(flag: str) -> list[str]:
        if flag not in args:
            return []
        rest = args[args.index(flag) + 1 :]
        return rest[: next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]

    quick = "--quick" in args
    g = QUICK if quick else FULL
    if values("--blocks"):
        g = dataclasses.replace(g, blocks=tuple(int(v) for v in values("--blocks")))
    if values("--num-ctas"):
        g = dataclasses.replace(g, num_ctas=tuple(int(v) for v in values("--num-ctas")))
    workloads = [WORKLOADS[n] for n in values("--workloads")] or list(WORKLOADS.values())
    return workloads, g, quick, "--integrity" in args


def estimate_seconds(part: str) -> float:
    """The model's seconds for one part, start-up included."""
    if part == MACHINE_PART:
        return MACHINE_S
    if part == TEST_PART:  # a process per step: the library's tests, vLLM's
        return STARTUP_S * len(STAGES[TEST_PART].steps) + TESTS_S
    if part == SLOW_TEST_PART:
        return STARTUP_S + SLOW_TESTS_S
    if part == SERVING_PART:
        return STARTUP_S + serving_plan_seconds(serving_stage_plan())
    if part == HOST_MEMORY_PART:
        return STARTUP_S + _host_memory_s()
    if part == SERVING_SHAPE_PART:
        return serving_preset_seconds("launch-shape")
    if part == SERVING_FULL_PART:
        return STARTUP_S + _serving_s()
    if part == CALL_COST_PART:
        return STARTUP_S + _call_cost_s("--integrity" in CALL_COST_STAGE, CALL_COST_STAGE_CALLS)
    args = PARTS[part]
    if part == "extras":
        return STARTUP_S + _extras_s(FULL)
    workloads, g, quick, integrity = _sweep_args(args)
    work = _sweep_s(workloads, g, one_layout=quick, integrity=integrity)
    if quick:
        work += _extras_s(QUICK)
    return STARTUP_S + work


def main(argv: list[str]) -> int:
    if argv[:1] == ["list"]:
        # What each part runs, in the runner's default priority (tools/gpu/stages.py, stdlib only).
        from tools.gpu.stages import DEFAULT_ORDER, STAGES

        for name in DEFAULT_ORDER:
            print(f"{name:<15} ~{estimate_seconds(name) / 60:.1f} min  {STAGES[name].what}")
        return 0
    if len(argv) == 2 and argv[0] == "args":
        if argv[1] not in PARTS:
            print(f"not a bench.transfer part: {argv[1]!r}; those are: {' '.join(PARTS)}", file=sys.stderr)
            return 2
        print(" ".join(PARTS[argv[1]]))
        return 0
    print("usage: python -m tools.gpu.parts {list | args PART}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
