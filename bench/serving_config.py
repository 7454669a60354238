"""The serving benchmark's loop shape and sizing rules, in one place. Stdlib only: ``parts.py`` sizes the GPU runner's
``serving`` part from it before the project is installed, and ``serving.py`` runs from it."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "LoopShape",
    "GPU_LOOP",
    "CPU_LOOP",
    "SERVING_WORKLOADS",
    "DEFAULT_METHODS",
    "PREFIXES",
    "LOAD_REGIONS",
    "HOST_RING_STEPS",
    "CONTIGUOUS_REPEATS",
    "DUPLEX_REPEATS",
    "GATE_US",
    "RingSizes",
    "ring_sizes",
]


@dataclass(frozen=True)
class LoopShape:
    """What one run of the step loop does.

    Attributes:
        prefill: prefill tokens per step (one chunk of a long prompt); a positive multiple of the block size.
        decode: decode requests per step, one token each.
        prefix_tokens: tokens of the arriving request's prefix that the host cache holds; a positive multiple of the
            block size.
        load_every: a request arrives (and its prefix is loaded) every this many steps, from the first.
        steps: measured steps per method.
        warmup: steps run first and not recorded (kernel compiles, cuBLAS heuristics, first-touch of pools).
        triton_ctas: num_ctas the triton method also runs at, besides the kernel's default.
    """

    prefill: int
    decode: int
    prefix_tokens: int
    load_every: int
    steps: int
    warmup: int
    triton_ctas: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return self.prefill + self.decode

    def check(self, block_size: int) -> None:
        """Raises ValueError naming the first setting that cannot run with ``block_size``-token blocks."""
        for name, value in (("prefill", self.prefill), ("prefix_tokens", self.prefix_tokens)):
            if value < block_size or value % block_size:
                raise ValueError(f"{name} = {value} must be a positive multiple of the block size {block_size}")
        for name, value, low in (("decode", self.decode, 0), ("load_every", self.load_every, 1),
                                 ("steps", self.steps, 1), ("warmup", self.warmup, 1)):  # fmt: skip
            if value < low:
                raise ValueError(f"{name} = {value} must be >= {low}")
        if any(c < 1 for c in self.triton_ctas):
            raise ValueError(f"triton num_ctas = {list(self.triton_ctas)} must all be >= 1")


# A 2048-token prefill chunk (vLLM's default max_num_batched_tokens for chunked prefill) beside 64 decodes; a request
# with a 4096-token cached prefix every 4th step.
GPU_LOOP = LoopShape(2048, 64, 4096, 4, 150, 8, (2, 8))
# The CPU check: tiny shapes (block size 2). 16 prefix tokens = 8 blocks x 2 layers = 16 descriptors, so vllm033's
# loads take its SM copy (run by the Triton interpreter), as at the small pages on a GPU.
CPU_LOOP = LoopShape(8, 4, 16, 2, 6, 2, (2, 8))

# The workloads with model dimensions (workloads.ModelDims); DeepSeek's MLA attention is not modelled.
SERVING_WORKLOADS = ("llama3-8b", "llama3-70b-tp8", "small-page")
# Every method of a run, in table order (serving_methods.METHODS holds each of them).
DEFAULT_METHODS = ("none", "triton", "auto", "vllm033", "vllm_native", "dma")

# Distinct cached prefixes and GPU regions the arrivals rotate through: consecutive loads write different bytes into
# a region than the load before, so a skipped load shows in the byte check.
PREFIXES, LOAD_REGIONS = 3, 2
# The host store ring holds this many steps' stores: at the end every host block of it is byte-checked against the
# GPU block it was last stored from.
HOST_RING_STEPS = 8
# Samples of the contiguous pinned copy a load is compared with, and of each duplex point (alone and both ways).
CONTIGUOUS_REPEATS, DUPLEX_REPEATS = 10, 5
# Both transfers of a duplex sample wait for a GPU sleep this long, so both are queued before either starts (a batch
# of 8192 descriptors takes ~4 ms to submit).
GATE_US = 20_000.0


@dataclass(frozen=True)
class RingSizes:
    """Blocks of one run.

    Attributes:
        gpu_ring: GPU blocks the steps write (allocated round-robin).
        host_ring: host blocks the stores go to (round-robin).
        prefix_blocks: blocks of one cached prefix (one load).
        gpu_blocks: every GPU block: the ring and the load regions.
        host_blocks: every host block: the store ring and the cached prefixes.
        max_per_step: most GPU blocks one step allocates (and stores).
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
    and allocates at most ``a``. The host ring holds HOST_RING_STEPS steps of the fewest stores, so its last stores
    come from at most HOST_RING_STEPS + 1 steps; a decode block was allocated at most ``bs`` steps before it was
    stored. A GPU ring of ``(HOST_RING_STEPS + bs + 3) * a`` blocks is then not reallocated under any of them.
    """
    per_prefill = shape.prefill // block_size
    most = per_prefill + math.ceil(shape.decode / block_size)
    host_ring = HOST_RING_STEPS * (per_prefill + shape.decode // block_size)
    gpu_ring = (HOST_RING_STEPS + block_size + 3) * most
    prefix = shape.prefix_tokens // block_size
    return RingSizes(gpu_ring, host_ring, prefix, gpu_ring + LOAD_REGIONS * prefix, host_ring + PREFIXES * prefix, most)
