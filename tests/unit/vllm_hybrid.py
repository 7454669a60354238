"""Hybrid-model KV caches as vLLM 0.33 lays them out, for the plugin's capacity and byte tests: a ``KVCacheConfig``
of several KV-cache groups (full attention, sliding window, Mamba state), one flat allocation viewed per layer by vLLM's
own ``create_kv_cache_views``, groups overlaid on the same bytes (vLLM's HMA), on bytes of their own (the layout of
vLLM's #56871), or packed side by side in every block (DeepSeek-V4's path). The views need vLLM 0.33's KV cache
layouts; the configs alone (``HybridKV(..., views=False)``) work with vLLM 0.32 too."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

BLOCK_TOKENS = 16


def full(page: int = 1024, padded: int | None = None) -> FullAttentionSpec:
    """Full attention with ``page`` bytes per block (2 KV heads, fp16), padded to ``padded`` bytes to overlay."""
    head = page // (2 * 2 * BLOCK_TOKENS * 2)
    return FullAttentionSpec(
        block_size=BLOCK_TOKENS, num_kv_heads=2, head_size=head, dtype=torch.float16, page_size_padded=padded
    )


def sliding(page: int = 1024, window: int = 2 * BLOCK_TOKENS) -> SlidingWindowSpec:
    head = page // (2 * 2 * BLOCK_TOKENS * 2)
    return SlidingWindowSpec(
        block_size=BLOCK_TOKENS, num_kv_heads=2, head_size=head, dtype=torch.float16, sliding_window=window
    )


def mamba(state: int = 300, padded: int = 1024) -> MambaSpec:
    """A Mamba-like state of ``state`` bytes per block, padded to ``padded`` to overlay attention pages."""
    return MambaSpec(
        block_size=BLOCK_TOKENS,
        shapes=((state // 2,),),
        dtypes=(torch.float16,),
        page_size_padded=padded,
        mamba_cache_mode="align",
    )


@dataclass(frozen=True)
class Case:
    """KV-cache groups (a spec and a layer count each) and how they share the allocation: ``"overlaid"`` (vLLM's
    HMA: every group's tensors on the same bytes), ``"disjoint"`` (each group on bytes of its own) or ``"packed"``
    (every layer of every group side by side in each block)."""

    groups: tuple[tuple[object, int], ...]
    placement: str


class HybridKV:
    """One allocation of ``num_blocks`` blocks laid out as ``case`` says, vLLM's ``KVCacheConfig`` of it and one
    view per layer from ``create_kv_cache_views``.

    Attributes:
        config: the ``KVCacheConfig``.
        raw: the flat int8 allocation (random bytes).
        views: layer name -> its view.
        names: per group, its layer names.
    """

    def __init__(self, case: Case, num_blocks: int, seed: int = 0, device: str = "cpu", views: bool = True):
        self.case, self.num_blocks = case, num_blocks
        self.names = [[f"g{gi}l{i}" for i in range(n)] for gi, (_, n) in enumerate(case.groups)]
        pages = [spec.page_size_bytes for spec, _ in case.groups]
        tensors, layouts = [], []
        if case.placement == "overlaid":
            size = max(p * n for p, (_, n) in zip(pages, case.groups)) * num_blocks
            for page, names in zip(pages, self.names):
                tensors.append(KVCacheTensor(size, names, layer_stride=num_blocks * page, block_stride=page))
                layouts.append(KVCacheLayout.LBHNC)
        elif case.placement == "disjoint":
            size = sum(p * n for p, (_, n) in zip(pages, case.groups)) * num_blocks
            offset = 0
            for (_, n), page, names in zip(case.groups, pages, self.names):
                tensors.append(KVCacheTensor(size, names, num_blocks * page, page, offset=offset))
                layouts.append(KVCacheLayout.LBHNC)
                offset += n * num_blocks * page
        elif case.placement == "packed":
            block = sum(p * n for p, (_, n) in zip(pages, case.groups))
            size, offset = block * num_blocks, 0
            for (_, n), page, names in zip(case.groups, pages, self.names):
                tensors.append(KVCacheTensor(size, names, layer_stride=page, block_stride=block, offset=offset))
                layouts.append(KVCacheLayout.BLHNC)
                offset += n * page
        else:
            raise ValueError(case.placement)
        from vllm.v1.kv_cache_interface import create_kv_cache_views  # vLLM 0.33's layouts

        self.views: dict[str, torch.Tensor] = {}
        if views:
            gen = torch.Generator().manual_seed(seed)
            self.raw = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=gen).to(device)
            for (spec, _), tensor, layout in zip(case.groups, tensors, layouts):
                made = create_kv_cache_views(self.raw, spec, num_blocks, layout, tensor)
                self.views.update(zip(tensor.layers, made))
        groups = [KVCacheGroupSpec(names, spec) for (spec, _), names in zip(case.groups, self.names)]
        self.config = KVCacheConfig(num_blocks, tensors, groups)

    def block_bytes(self, group: int, blocks) -> torch.Tensor:
        """(len(blocks), bytes) uint8 on the CPU: each block of ``group``, its layers' bytes one after another, read
        through vLLM's views (the bytes a GPU block of the group holds, padding excluded)."""
        rows = []
        for b in blocks:
            rows.append(torch.cat([self.views[n][b].reshape(-1).view(torch.uint8).cpu() for n in self.names[group]]))
        return torch.stack(rows)


def vllm_config(extra: dict, *, retention_interval: int | None = 0):
    """The fields of a ``VllmConfig`` that vLLM's ``build_offloading_config``, its worker role and our geometry
    read, for a tiny fp16 model with 2 KV heads, on one rank (what an ``OffloadingConnector`` sees, also as a
    ``MultiConnector``'s child)."""
    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra, engine_id="test"
    )
    cache = CacheConfig(block_size=BLOCK_TOKENS)
    cache.prefix_cache_retention_interval = retention_interval
    return SimpleNamespace(
        kv_transfer_config=transfer,
        parallel_config=ParallelConfig(),
        cache_config=cache,
        model_config=SimpleNamespace(
            use_mla=False, get_total_num_kv_heads=lambda: 2, model="tiny", max_model_len=1024, dtype=torch.float16
        ),
        use_v2_model_runner=False,
        kv_events_config=None,
        speculative_config=None,
    )
