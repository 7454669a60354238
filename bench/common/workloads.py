"""The benchmark's workloads: real models' KV page shapes, named once (:data:`WORKLOADS`), and their cache builders
(:func:`make_caches`). A workload fixes the page (bytes per layer per GPU block, K+V), the layer count and the layouts
it is measured in; the number of blocks per transfer is the sweep's other axis. Shapes are built from a dict keyed by
layout name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["ModelDims", "Workload", "WORKLOADS", "make_caches", "resolve_workloads"]


@dataclass(frozen=True)
class ModelDims:
    """One transformer layer's matrix shapes on one GPU (after tensor parallelism): what the serving benchmark's step
    computes (``bench/serving/model.py``). The KV heads and head size must be the workload's.

    Attributes:
        hidden: model width.
        q_heads: query heads per GPU.
        kv_heads: KV heads per GPU.
        head_dim: elements per head.
        intermediate: MLP width per GPU.
        gated: the MLP has a gate and an up projection (SwiGLU: one fused matmul of width 2 x intermediate); else
            one up projection.
        source: the model and where its numbers come from.
    """

    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    gated: bool = True
    source: str = ""

    @property
    def q_width(self) -> int:
        return self.q_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Elements of K (or of V) per token."""
        return self.kv_heads * self.head_dim

    @property
    def up_width(self) -> int:
        return (2 if self.gated else 1) * self.intermediate

    def matmuls(self) -> dict[str, tuple[int, int]]:
        """Weight shapes (in, out) of the layer's matrix products, in the order a step runs them."""
        return {
            "qkv": (self.hidden, self.q_width + 2 * self.kv_width),
            "o": (self.q_width, self.hidden),
            "gate_up" if self.gated else "up": (self.hidden, self.up_width),
            "down": (self.intermediate, self.hidden),
        }

    def flops_per_token(self) -> int:
        """Matrix-product FLOPs of one token through one layer (2 per multiply-add)."""
        return sum(2 * k * n for k, n in self.matmuls().values())


@dataclass(frozen=True)
class Workload:
    """One model's KV cache geometry.

    Attributes:
        name: the fixed name used in tables, JSON and on the command line.
        num_layers: layer tensors in the cache.
        layouts: the layouts it is measured in (``mla`` for latent caches, both K/V layouts otherwise).
        block_size: tokens per GPU block.
        heads: KV heads per rank (K/V layouts).
        head_dim: elements per head (K/V layouts).
        latent: latent width (MLA).
        dtype: element type; bytes are moved regardless.
        note: where the shape comes from.
        model: the layer the serving benchmark computes (None: not in it; MLA's attention is not modelled).
    """

    name: str
    num_layers: int
    layouts: tuple[str, ...]
    block_size: int
    heads: int = 0
    head_dim: int = 0
    latent: int = 0
    dtype: torch.dtype = torch.bfloat16
    note: str = ""
    model: ModelDims | None = None

    def layer_shape(self, layout: str, num_blocks: int) -> tuple[int, ...]:
        return _SHAPES[layout](self, num_blocks)

    @property
    def page_bytes(self) -> int:
        """Bytes per layer per GPU block, K+V (or the latent)."""
        esize = torch.empty((), dtype=self.dtype).element_size()
        if self.latent:
            return self.block_size * self.latent * esize
        return 2 * self.block_size * self.heads * self.head_dim * esize

    def tiny(self) -> Workload:
        """The same layouts and dtype at a size the Triton interpreter runs in milliseconds (the CPU check)."""
        return dataclasses.replace(
            self,
            num_layers=2,
            block_size=2,
            heads=min(self.heads, 2),
            head_dim=8 if self.head_dim else 0,
            latent=12 if self.latent else 0,
            model=_tiny_model(min(self.heads, 2), self.model.gated) if self.model else None,
        )


# Per-layer shapes, keyed by layout name (as triton_offload.layouts.Layout writes them out).
_SHAPES = {
    "kv_first": lambda w, nb: (2, nb, w.block_size, w.heads, w.head_dim),
    "block_first": lambda w, nb: (nb, 2, w.block_size, w.heads, w.head_dim),
    "mla": lambda w, nb: (nb, w.block_size, w.latent),
}


def _tiny_model(kv_heads: int, gated: bool) -> ModelDims:
    """A layer small enough for the CPU check, with the tiny workload's KV heads and head size (8)."""
    return ModelDims(32, 2, kv_heads, 8, 48, gated, source="tiny shapes for the CPU check")


# Numbers from each model's Hugging Face config.json (hidden_size, num_attention_heads, num_key_value_heads,
# intermediate_size); per GPU = divided by the tensor-parallel degree.
WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "llama3-8b", 32, ("kv_first", "block_first"), 16, heads=8, head_dim=128,
            note="Llama-3-8B, bf16, block 16: 8 KV heads x 128 -> 64 KiB pages",
            model=ModelDims(4096, 32, 8, 128, 14336, source="Llama-3-8B: hidden 4096, 32 q / 8 KV heads x 128, "
                            "intermediate 14336 (SwiGLU)"),
        ),
        Workload(
            "llama3-70b-tp8", 80, ("kv_first", "block_first"), 16, heads=1, head_dim=128,
            note="Llama-3-70B at TP 8: 1 KV head per rank -> 8 KiB pages",
            model=ModelDims(8192, 8, 1, 128, 3584, source="Llama-3-70B at TP 8, per GPU: hidden 8192, 64/8 q heads, "
                            "8/8 KV heads x 128, intermediate 28672/8 (SwiGLU)"),
        ),
        Workload(
            "deepseek-v3-mla", 61, ("mla",), 64, latent=576,
            note="DeepSeek-V3 MLA, bf16, block 64, latent 512+64 -> 72 KiB pages",
        ),
        Workload(
            "small-page", 32, ("kv_first", "block_first"), 8, heads=1, head_dim=64,
            note="stress case: 2 KiB pages, where per-copy overheads dominate",
            model=ModelDims(4544, 71, 1, 64, 18176, gated=False, source="Falcon-7B (32 layers, multi-query: one "
                            "KV head of 64; hidden 4544, 71 q heads, MLP 4 x 4544, no gate) at block 8: 2 KiB pages"),
        ),
    )
}  # fmt: skip


def resolve_workloads(names: list[str] | None) -> list[Workload]:
    """Workloads by exact name (all when None); an unknown name lists the supported ones."""
    if not names:
        return list(WORKLOADS.values())
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; supported: {sorted(WORKLOADS)}")
    return [WORKLOADS[n] for n in names]


def make_caches(
    workload: Workload, layout: str, num_blocks: int, device: torch.device | str, seed: int = 0
) -> list[torch.Tensor]:
    """Per-layer tensors of ``layout`` filled with random bytes, so a block moved to the wrong place shows.

    Random bytes include NaN patterns: every check compares bytes, never values.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    caches = []
    for _ in range(workload.num_layers):
        t = torch.empty(workload.layer_shape(layout, num_blocks), dtype=workload.dtype, device=device)
        t.view(torch.uint8).random_(0, 256, generator=gen)
        caches.append(t)
    return caches
