"""The serving benchmark's loop shapes, load modes, run plans (the default run and the named presets) and sizing
rules, and the step-time estimate that sized the shapes, in one place. Stdlib only: the GPU runner reads it before the
project is installed, and :mod:`bench.serving` runs from it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from bench.common.results import INTEGRITY_METHOD

__all__ = [
    "LoopShape",
    "GPU_SHAPES",
    "CPU_SHAPES",
    "SHAPE_NAMES",
    "LOAD_MODES",
    "SYNC",
    "ASYNC",
    "RunPlan",
    "FULL_PLAN",
    "CPU_PLAN",
    "PRESETS",
    "with_integrity",
    "with_method",
    "FP8_METHOD",
    "h100_step_seconds",
    "SERVING_WORKLOADS",
    "DEFAULT_METHODS",
    "DUPLEX_METHODS",
    "RUN_LAST",
    "TRITON_CTAS",
    "DEFAULT_ROUNDS",
    "PREFIXES",
    "LOAD_REGIONS",
    "HOST_RING_STEPS",
    "CONTIGUOUS_REPEATS",
    "DUPLEX_REPEATS",
    "GATE_US",
    "KV_READ_MIN_BYTES",
    "RingSizes",
    "ring_sizes",
]

# How an arriving request's cached prefix is loaded (docs/benchmarks.md, "Load modes"):
# * async: vLLM 0.33's default (``sync_load_budget_bytes`` = 0): the load is submitted after the step's forward pass is
#   queued, the other requests keep running, and the request joins the batch after the step whose ``get_finished``
#   reported its load;
# * sync: vLLM 0.33's budgeted option (``sync_load_budget_bytes`` > 0): the load is submitted ``expedited`` before
#   the forward pass, and the worker waits for it.
ASYNC, SYNC = "async", "sync"
LOAD_MODES = (ASYNC, SYNC)


@dataclass(frozen=True)
class LoopShape:
    """What one run of the step loop does.

    Attributes:
        name: the shape's name (``prefill-heavy``, ``decode-heavy``), in the rows and on the command line.
        prefill: prefill tokens per step (one chunk of a long prompt); a multiple of the block size (0: none).
        decode: decode requests per step, one token each.
        context: tokens of context each decode request's attention reads per layer (the loop reads that many bytes
            of KV per layer; 0: no attention read).
        prefix_tokens: tokens of the arriving request's prefix that the host cache holds; a positive multiple of the
            block size.
        load_every: a request arrives (and its prefix is loaded) every this many steps, from the first.
        steps: measured steps of one run (a method runs once per round).
        warmup: steps run first in every run and not recorded (kernel compiles, cuBLAS heuristics, the pipeline).
    """

    name: str
    prefill: int
    decode: int
    context: int
    prefix_tokens: int
    load_every: int
    steps: int
    warmup: int

    @property
    def tokens(self) -> int:
        return self.prefill + self.decode

    def check(self, block_size: int) -> None:
        """Raises ValueError naming the first setting that cannot run with ``block_size``-token blocks."""
        if self.prefill < 0 or self.prefill % block_size:
            raise ValueError(f"prefill = {self.prefill} must be a multiple of the block size {block_size} (0: none)")
        if self.prefix_tokens < block_size or self.prefix_tokens % block_size:
            raise ValueError(f"prefix_tokens = {self.prefix_tokens} must be a positive multiple of the block size "
                             f"{block_size}")  # fmt: skip
        for name, value, low in (("decode", self.decode, 0), ("context", self.context, 0),
                                 ("load_every", self.load_every, 1), ("steps", self.steps, 1),
                                 ("warmup", self.warmup, 1)):  # fmt: skip
            if value < low:
                raise ValueError(f"{name} = {value} must be >= {low}")
        if self.prefill // block_size + self.decode // block_size < 1:
            raise ValueError(f"prefill = {self.prefill} and decode = {self.decode} complete no block of "
                             f"{block_size} tokens per step: there would be nothing to store")  # fmt: skip


# An H100's rates, for the shapes' step estimate: bf16 products at 400 TFLOP/s (about half the dense peak), weight and
# KV reads at 2.5 TB/s (peak 3.35), 10 us per kernel launch from Python, six kernels a layer (the four products and
# two KV writes) and the attention read where there is one.
H100_MATMUL_FLOPS, H100_MEM_BPS, LAUNCH_S, KERNELS_PER_LAYER = 400e12, 2.5e12, 10e-6, 6


def h100_step_seconds(w, shape: LoopShape) -> float:
    """One step of ``shape`` on workload ``w`` (bench/common/workloads.py) on an H100, by the rates above: its products'
    FLOPs, its weight and KV reads, or its launches, whichever takes longest."""
    m = w.model
    weights = 2 * w.num_layers * sum(k * n for k, n in m.matmuls().values())
    kv_read = 2 * 2 * shape.decode * shape.context * m.kv_width * w.num_layers  # K and V, bf16
    kernels = KERNELS_PER_LAYER + (1 if shape.context else 0)
    return max(shape.tokens * m.flops_per_token() * w.num_layers / H100_MATMUL_FLOPS,
               (weights + kv_read) / H100_MEM_BPS, w.num_layers * kernels * LAUNCH_S)  # fmt: skip


# prefill-heavy: a 2048-token prefill chunk (vLLM's default max_num_batched_tokens for chunked prefill) beside 64
# decodes, a request with a 4096-token cached prefix every 4th step: dense GEMMs, 45-90 ms on an H100.
# decode-heavy: 256 decodes, each reading 512 tokens of KV per layer (a bandwidth-bound read, as attention does), a
# request with an 8192-token cached prefix every 4th step: weight and KV reads, about 10 ms on an H100
# (h100_step_seconds: 12.5 ms for Llama-3-8B), and loads of 1 GiB for Llama-3-8B (7x the link demand of prefill-heavy).
GPU_SHAPES = {
    "prefill-heavy": LoopShape("prefill-heavy", 2048, 64, 0, 4096, 4, 20, 3),
    "decode-heavy": LoopShape("decode-heavy", 0, 256, 512, 8192, 4, 40, 4),
}
# The CPU check: tiny shapes (block size 2). 16 prefix tokens = 8 blocks x 2 layers = 16 descriptors, so vllm033's
# loads take its SM copy (run by the Triton interpreter), as at the small pages on a GPU.
CPU_SHAPES = {
    "prefill-heavy": LoopShape("prefill-heavy", 8, 4, 0, 16, 2, 6, 2),
    "decode-heavy": LoopShape("decode-heavy", 0, 6, 4, 16, 2, 6, 2),
}
SHAPE_NAMES = tuple(GPU_SHAPES)

# The workloads with model dimensions (workloads.ModelDims); DeepSeek's MLA attention is not modelled.
SERVING_WORKLOADS = ("llama3-8b", "llama3-70b-tp8", "small-page")
# Every method of a run, in table order (bench.baselines.METHODS holds each of them).
DEFAULT_METHODS = ("none", "triton", "triton_size_aware", "auto", "vllm033", "vllm_native", "memcpy_batch")
# The methods the duplex figure is measured for, where the run has them: our kernel (at its default num_ctas) and the
# copy engines.
DUPLEX_METHODS = ("triton", "memcpy_batch")
# The methods run last in every round, after every other (triton_integrity included), in this order: the least-proven
# paths, whose sticky CUDA fault would cost the runs after it (vllm_native: a ctypes stand-in for vLLM 0.33's compiled
# op, never run on a GPU yet). Each is still bracketed by ``none`` (the next round's, or the closing one).
RUN_LAST = ("vllm_native",)
# triton's num_ctas besides the kernel's default in the full run.
TRITON_CTAS = (2, 8)
# Rounds of a run: every method once per round, ``none`` first in each and once more at the end, the order reversed
# in every other round (so a linear drift cancels out of the methods' means) but RUN_LAST's always last; the ``none``
# runs measure the drift.
DEFAULT_ROUNDS = 2


@dataclass(frozen=True)
class RunPlan:
    """What one invocation of ``python -m bench.serving`` runs.

    Attributes:
        cases: (workload, shape name) pairs, each one set-up; run in this order.
        shapes: the shapes by name (GPU_SHAPES or CPU_SHAPES, with any overrides).
        methods: method names, in table order.
        triton_ctas: triton's num_ctas besides the default.
        load_modes: ASYNC and/or SYNC; each case runs every mode.
        rounds: rounds per (case, mode).
        duplex: measure the duplex figure (once per workload, in its first case).
    """

    cases: tuple[tuple[str, str], ...]
    shapes: dict
    methods: tuple[str, ...]
    triton_ctas: tuple[int, ...]
    load_modes: tuple[str, ...]
    rounds: int
    duplex: bool = True

    def shape(self, name: str) -> LoopShape:
        return self.shapes[name]

    def with_shapes(self, **fields) -> RunPlan:
        """The plan with every shape's ``fields`` replaced (command-line overrides)."""
        shapes = {n: dataclasses.replace(s, **fields) for n, s in self.shapes.items()}
        return dataclasses.replace(self, shapes=shapes)

    def runs_per_mode(self) -> int:
        """Loop runs of one (case, load mode): ``rounds`` of every point, plus the closing ``none``."""
        points = len(self.methods) + (len(set(self.triton_ctas)) if "triton" in self.methods else 0)
        return self.rounds * points + ("none" in self.methods)


def _cross(workloads, shapes) -> tuple[tuple[str, str], ...]:
    return tuple((w, s) for w in workloads for s in shapes)


# The default run: every workload in both shapes, both load modes, every method (triton also at 2 and 8 CTAs).
FULL_PLAN = RunPlan(_cross(SERVING_WORKLOADS, SHAPE_NAMES), GPU_SHAPES, DEFAULT_METHODS, TRITON_CTAS, LOAD_MODES,
                    DEFAULT_ROUNDS)  # fmt: skip
# The CPU check: the same at tiny shapes, one round (nothing is timed, so there is no drift to measure).
CPU_PLAN = dataclasses.replace(FULL_PLAN, shapes=CPU_SHAPES, rounds=1, duplex=False)

# The decisive configuration for the GPU run (<= 3 min on an H100 by the time model that sized it, start-up included;
# the GPU run's ledger keeps what a lease measures): ours (kernel and auto) against vLLM 0.33's data path, its own
# worker and no offload, at the default CTAs, both load modes; Llama-3-8B in both shapes (64 KiB pages: the binding case
# of the store interference, vllm033 on the copy engines both ways) and Llama-3-70B at TP 8 decode-heavy (8 KiB pages:
# vllm033's loads take its SM copy, here against a busy GPU). Fewer steps per run than the full run; two rounds bracket
# every method with none. The decisive case, Llama-3-70B at TP 8 decode-heavy, runs first, so a lease cut short (or a
# CUDA context lost) still has it.
PRESETS = {
    "decisive": RunPlan(
        (("llama3-70b-tp8", "decode-heavy"), ("llama3-8b", "decode-heavy"), ("llama3-8b", "prefill-heavy")),
        {
            "decode-heavy": dataclasses.replace(GPU_SHAPES["decode-heavy"], steps=30, warmup=4),
            "prefill-heavy": dataclasses.replace(GPU_SHAPES["prefill-heavy"], steps=12, warmup=3),
        },
        ("none", "triton", "auto", "vllm033", "vllm_native"),
        (),
        LOAD_MODES,
        DEFAULT_ROUNDS,
    ),
    # The size-aware launch shape's serving check (issue 38, section 3): the kernel's two shapes and no offload, at
    # the pages where the shapes differ (2 KiB: 16 programs instead of 4; Llama-3-70B at TP 8 in kv_first: 4 KiB runs,
    # 8 programs), both shapes, both load modes: the step slowdown must not rise where the transfers gain.
    "launch-shape": RunPlan(
        (("small-page", "decode-heavy"), ("small-page", "prefill-heavy"), ("llama3-70b-tp8", "decode-heavy")),
        {
            "decode-heavy": dataclasses.replace(GPU_SHAPES["decode-heavy"], steps=30, warmup=4),
            "prefill-heavy": dataclasses.replace(GPU_SHAPES["prefill-heavy"], steps=12, warmup=3),
        },
        ("none", "triton", "triton_size_aware"),
        (),
        LOAD_MODES,
        DEFAULT_ROUNDS,
        duplex=False,
    ),
}


# The FP8 host format's serving method (issue 63), run on request (``--fp8``) beside triton.
FP8_METHOD = "triton_fp8"


def with_integrity(plan: RunPlan) -> RunPlan:
    """``plan`` with the kernel with the integrity checks (``triton_integrity``, docs/integrity.md) run after its
    methods, at the default num_ctas, so its step times stand beside triton's (``--integrity``); unchanged where the
    plan has it."""
    return with_method(plan, INTEGRITY_METHOD)


def with_method(plan: RunPlan, method: str) -> RunPlan:
    """``plan`` with ``method`` run after its methods (``--integrity``, ``--fp8``); unchanged where the plan has it."""
    if method in plan.methods:
        return plan
    return dataclasses.replace(plan, methods=(*plan.methods, method))


# Distinct cached prefixes and GPU regions the arrivals rotate through: consecutive loads write different bytes into
# a region than the load before, so a skipped load shows in the byte check.
PREFIXES, LOAD_REGIONS = 3, 2
# The host store ring holds this many steps' stores: each store's host blocks are checked when it completes, and at
# the end every host block of the ring is compared, byte for byte, with the GPU block it was last stored from.
HOST_RING_STEPS = 8
# Samples of the contiguous pinned copy a load is compared with, and of each duplex point (alone and both ways).
CONTIGUOUS_REPEATS, DUPLEX_REPEATS = 10, 5
# Both transfers of a duplex sample wait for a GPU sleep this long, so both are queued before either starts (a batch
# of 8192 descriptors takes ~4 ms to submit).
GATE_US = 20_000.0
# The decode-heavy attention read goes through a buffer at least this large (and twice one layer's read), so
# consecutive layers read different bytes and none of it comes from the L2 cache (50 MB on an H100).
KV_READ_MIN_BYTES = 512 << 20


@dataclass(frozen=True)
class RingSizes:
    """Blocks of one run.

    Attributes:
        gpu_ring: GPU blocks the steps write (allocated round-robin).
        host_ring: host blocks the stores go to (round-robin).
        prefix_blocks: blocks of one cached prefix (one load).
        gpu_blocks: every GPU block: the ring and the load regions.
        host_blocks: every host block: the store ring and the cached prefixes.
        max_per_step: most GPU blocks one step stores (and allocates, but the first: see ring_sizes).
    """

    gpu_ring: int
    host_ring: int
    prefix_blocks: int
    gpu_blocks: int
    host_blocks: int
    max_per_step: int


def ring_sizes(shape: LoopShape, block_size: int) -> RingSizes:
    """The ring sizes that keep every host block of the store ring checkable at the end.

    A step stores between ``prefill / bs + floor(decode / bs)`` and ``a = prefill / bs + ceil(decode / bs)`` blocks
    and allocates at most ``a``, but the first step, which also gives every decode request its first block (``decode``
    more). The host ring holds HOST_RING_STEPS steps of the fewest stores, so its last stores come from at most
    HOST_RING_STEPS + 1 steps; a decode block was allocated at most ``bs`` steps before it was stored. A GPU ring of
    ``(HOST_RING_STEPS + bs + 3) * a + decode`` blocks is then not reallocated under any of them, nor while a decode
    request still fills it.
    """
    per_prefill = shape.prefill // block_size
    most = per_prefill + math.ceil(shape.decode / block_size)
    host_ring = HOST_RING_STEPS * (per_prefill + shape.decode // block_size)
    gpu_ring = (HOST_RING_STEPS + block_size + 3) * most + shape.decode
    prefix = shape.prefix_tokens // block_size
    return RingSizes(gpu_ring, host_ring, prefix, gpu_ring + LOAD_REGIONS * prefix, host_ring + PREFIXES * prefix, most)
