"""The benchmark's workloads: real models' KV page shapes, named once, and their cache builders.

A workload fixes the page (bytes per layer per GPU block, K+V), the layer count and the layouts it is measured in;
the number of blocks per transfer is the sweep's other axis. Shapes are built from a dict keyed by layout name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["Workload", "WORKLOADS", "make_caches", "resolve_workloads"]


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
        )


# Per-layer shapes, keyed by layout name (as triton_offload.layouts.Layout writes them out).
_SHAPES = {
    "kv_first": lambda w, nb: (2, nb, w.block_size, w.heads, w.head_dim),
    "block_first": lambda w, nb: (nb, 2, w.block_size, w.heads, w.head_dim),
    "mla": lambda w, nb: (nb, w.block_size, w.latent),
}

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "llama3-8b", 32, ("kv_first", "block_first"), 16, heads=8, head_dim=128,
            note="Llama-3-8B, bf16, block 16: 8 KV heads x 128 -> 64 KiB pages",
        ),
        Workload(
            "llama3-70b-tp8", 80, ("kv_first", "block_first"), 16, heads=1, head_dim=128,
            note="Llama-3-70B at TP 8: 1 KV head per rank -> 8 KiB pages",
        ),
        Workload(
            "deepseek-v3-mla", 61, ("mla",), 64, latent=576,
            note="DeepSeek-V3 MLA, bf16, block 64, latent 512+64 -> 72 KiB pages",
        ),
        Workload(
            "small-page", 32, ("kv_first", "block_first"), 8, heads=1, head_dim=64,
            note="stress case: 2 KiB pages, where per-copy overheads dominate",
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
