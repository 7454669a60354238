"""The copy kernel's variants as the launcher picks them: per page class (the benchmark's workloads, and pages whose
addresses allow only 4-, 2- or 1-byte accesses) the :class:`~triton_offload.kernels.shapes.LaunchConfig` a
:class:`~triton_offload.issuers.launcher.CopyLauncher` derives for each direction, times one KV-cache group or
several, times the integrity modes (off, checked and copied, checksum only; the checked launches have a shape of
their own)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

import triton_offload as to
from triton_offload.checksums import Checksums
from triton_offload.issuers.launcher import CopyLauncher
from triton_offload.kernels.shapes import LaunchConfig
from triton_offload.plan import Direction

__all__ = ["PAGES", "MODES", "Variant", "variants", "page_spec"]

# (name, layout, page geometry, dtype, the access width in bytes its addresses allow). The first seven are the
# benchmark's workloads in their layouts (bench/common/workloads.py): a page's segments are what the kernel moves per
# row (K and V apart in kv_first, side by side in block_first).
PAGES = (
    ("llama3-8b.kv_first", "kv_first", dict(block_size=16, heads=8, head_dim=128), torch.bfloat16, 16),
    ("llama3-8b.block_first", "block_first", dict(block_size=16, heads=8, head_dim=128), torch.bfloat16, 16),
    ("llama3-70b-tp8.kv_first", "kv_first", dict(block_size=16, heads=1, head_dim=128), torch.bfloat16, 16),
    ("llama3-70b-tp8.block_first", "block_first", dict(block_size=16, heads=1, head_dim=128), torch.bfloat16, 16),
    ("small-page.kv_first", "kv_first", dict(block_size=8, heads=1, head_dim=64), torch.bfloat16, 16),
    ("small-page.block_first", "block_first", dict(block_size=8, heads=1, head_dim=64), torch.bfloat16, 16),
    ("deepseek-v3-mla.mla", "mla", dict(block_size=64, latent=576), torch.bfloat16, 16),
    ("page-20B", "mla", dict(block_size=2, latent=5), torch.float16, 4),
    ("page-6B", "mla", dict(block_size=1, latent=3), torch.float16, 2),
    ("canonical-13B", "canonical", dict(page_bytes=13, pad=3), torch.int8, 1),
)
# (name, INTEGRITY, COPY): the plain copy; the copy with the integrity checks fused; the copy-engine path's
# checksum-only launch.
MODES = (("plain", False, True), ("checked", True, True), ("checksum-only", True, False))


@dataclass(frozen=True)
class Variant:
    """One compiled variant of the copy kernel (its constexprs and launch shape)."""

    page: str
    layout: str
    segment_bytes: int
    width: int
    direction: str
    grouped: bool
    mode: str
    config: LaunchConfig

    @property
    def id(self) -> str:
        return f"{self.page}/{self.direction}/{'groups' if self.grouped else '1group'}/{self.mode}"

    @property
    def store(self) -> bool:
        return self.direction == "store"

    @property
    def integrity(self) -> bool:
        return self.mode != "plain"

    @property
    def copy(self) -> bool:
        return self.mode != "checksum-only"

    def to_dict(self) -> dict:
        return {**asdict(self), "id": self.id, "config": asdict(self.config)}


def _layer(layout: str, num_blocks: int, page: dict, dtype: torch.dtype) -> torch.Tensor:
    if layout == "kv_first":
        return torch.zeros((2, num_blocks, page["block_size"], page["heads"], page["head_dim"]), dtype=dtype)
    if layout == "block_first":
        return torch.zeros((num_blocks, 2, page["block_size"], page["heads"], page["head_dim"]), dtype=dtype)
    if layout == "mla":
        return torch.zeros((num_blocks, page["block_size"], page["latent"]), dtype=dtype)
    base = torch.zeros((num_blocks, page["page_bytes"] + page.get("pad", 0)), dtype=torch.int8)
    return base[:, : page["page_bytes"]]


def page_spec(layout: str, page: dict, dtype: torch.dtype, grouped: bool = False) -> to.KVCacheSpec:
    """A small spec (4 layers of 4 blocks) with the page geometry: the launch shape depends on nothing else."""
    caches = [_layer(layout, 4, page, dtype) for _ in range(4)]
    return to.KVCacheSpec(caches, layout, groups=[[0, 2], [1, 3]] if grouped else None)


def variants(pages=PAGES, modes=MODES) -> list[Variant]:
    """Every (page, direction, groups, mode) variant, its launch shape the launcher's own."""
    out = []
    for name, layout, page, dtype, width in pages:
        for grouped in (False, True):
            spec = page_spec(layout, page, dtype, grouped)
            host = torch.zeros((2, spec.host_block_bytes(1)), dtype=torch.uint8)
            checks = Checksums.allocate("verify", 2, 1, pin=False, regions=spec.num_regions)
            launchers = {False: CopyLauncher(spec, host, 1), True: CopyLauncher(spec, host, 1, checksums=checks)}
            seg = max(s.nbytes for s in spec.segments)
            for d in Direction:
                for mode, integrity, _ in modes:
                    cfg = launchers[integrity].config(d)
                    assert cfg.elem * cfg.vec == width, (name, cfg)
                    out.append(Variant(name, layout, seg, width, str(d), grouped, mode, cfg))
    return out
