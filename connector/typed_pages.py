"""The FP8 host format through the vLLM plugin: typed views of vLLM's canonical pages. vLLM hands the worker each
layer's KV cache as int8 pages (:mod:`~triton_offload.connector.worker`); the FP8 kernel needs the elements' dtype
and where each head's K and V lie. Both are read here from the layer's ``AttentionSpec`` (dtype, ``num_kv_heads``,
``head_size``, ``block_size``) and the ``kv_cache_layout`` vLLM resolved (RFC #42082's page ``[H, N, K|V]`` in the
memory order ``LBHNC`` or ``LBNHC``): :func:`page_geometry` describes a page as two halves of equal bytes, each
``tokens x slabs x head_dim`` elements, a slab being one head's K or V, so the library's ``block_first`` layout gives
a scale per (block, layer, head, K/V); an MLA page (one latent of ``kv_lora_rank + qk_rope_head_dim`` per token, one
head, in any layout) is one run, the library's ``mla`` layout, a scale per (block, layer) over the latent, rope part
included. :func:`typed_kv_spec` reinterprets the canonical tensors so. The scheduler
sizes the host rows from the same geometry (:func:`format_plan`), so what cannot be read exactly is refused, naming
the key, before anything is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triton_offload.host_format import FP8_E4M3, NATIVE, ONE_BYTE, QUANTIZABLE, QuantRun
from triton_offload.layouts import KVCacheSpec

__all__ = ["PageGeometry", "FormatPlan", "cpu_platform", "page_geometry", "format_plan", "typed_kv_spec"]

_KEY = f"host_format = {FP8_E4M3!r}"


@dataclass(frozen=True)
class PageGeometry:
    """One layer's page (a GPU block) in elements: two halves of ``tokens x slabs x head_dim``, ``half_stride``
    apart; a slab is one head's K or V. MLA (``halves = 1``): one run of ``tokens x latent``, the latent one slab."""

    dtype: torch.dtype
    tokens: int
    slabs: int
    head_dim: int
    token_stride: int
    slab_stride: int
    half_stride: int
    halves: int = 2

    @property
    def layout(self) -> str:
        """The library layout of :meth:`view`: ``block_first``, or ``mla`` for one run per page."""
        return "block_first" if self.halves == 2 else "mla"

    @property
    def page_bytes(self) -> int:
        return self.halves * self.tokens * self.slabs * self.head_dim * self.dtype.itemsize

    @property
    def host_bytes(self) -> int:
        """The page's bytes in the FP8 host format (per run, K|V halves or the latent: values, a scale per slab)."""
        run = QuantRun(self.tokens, self.slabs, self.head_dim, self.token_stride, self.slab_stride)
        return self.halves * run.host_bytes

    def view(self, pages: torch.Tensor, what: str) -> torch.Tensor:
        """``pages`` (vLLM's int8 ``(num_blocks, page bytes)``) as ``(num_blocks, 2, tokens, slabs, head_dim)`` of
        the cache dtype (the ``block_first`` layout, the halves in the place of K and V), or for MLA
        ``(num_blocks, tokens, latent)`` (the ``mla`` layout)."""
        size = self.dtype.itemsize
        if pages.dim() != 2 or pages.stride(1) != 1 or pages.shape[1] * pages.element_size() < self.page_bytes:
            raise ValueError(f"{_KEY}: {what} is {tuple(pages.shape)}, not pages of {self.page_bytes} bytes")
        byte_offset, block_stride = pages.storage_offset() * pages.element_size(), pages.stride(0)
        if byte_offset % size or block_stride % size:
            raise ValueError(f"{_KEY}: {what} is not aligned to its {self.dtype} elements")
        typed = torch.empty(0, dtype=self.dtype, device=pages.device).set_(pages.untyped_storage())
        if self.halves == 1:
            shape, strides = (pages.shape[0], self.tokens, self.head_dim), (block_stride // size, self.token_stride, 1)
            return typed.as_strided(shape, strides, byte_offset // size)
        return typed.as_strided(
            (pages.shape[0], 2, self.tokens, self.slabs, self.head_dim),
            (block_stride // size, self.half_stride, self.token_stride, self.slab_stride, 1),
            byte_offset // size,
        )


def cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform (whose attention reads a page otherwise than the GPU backends)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def page_geometry(spec, layout: str | None, cpu: bool) -> PageGeometry | None:
    """The page geometry of a layer with vLLM spec ``spec`` under ``kv_cache_layout`` ``layout`` (``cpu``: vLLM's
    CPU platform, whose attention reads a head's page as K rows then V rows); None for an 8-bit cache (its bytes
    move unchanged).

    Raises:
        ValueError: naming the key and what cannot be read exactly (not attention, packed contents, K and V of
            different sizes, a layout whose K and V halves are not described here, an MLA page that is not one
            latent per token: DeepSeek-V4's).
    """
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec

    kind = type(spec).__name__
    mla = isinstance(spec, MLAAttentionSpec)
    if not isinstance(spec, AttentionSpec) or kind == "HiddenStateCacheSpec":
        raise ValueError(f"{_KEY} quantizes attention K/V pages and MLA latents; a {kind} layer is not described")
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    if spec.dtype in ONE_BYTE or quant != "NONE":
        return None  # already 8-bit (kv_cache_dtype="fp8" and its kin): moved as bytes
    if spec.dtype not in QUANTIZABLE:
        raise ValueError(f"{_KEY} quantizes bf16 or fp16 caches; this one is {spec.dtype} (the model's dtype)")
    packed = [f for f in ("num_head_slots", "state_content_bytes") if getattr(spec, f, None) is not None]
    if packed or getattr(spec, "tokens_per_state", 1) != 1 or spec.head_size_v != (0 if mla else spec.head_size):
        raise ValueError(f"{_KEY}: the {kind} page is not plain K|V per head and token ({spec}): not described")
    h, n, d = spec.num_kv_heads, spec.block_size, spec.head_size
    if mla:  # one latent (kv_lora_rank + qk_rope_head_dim) per token: a page is (1, N, D) whatever the layout
        if h != 1 or getattr(spec, "model_version", None) is not None:
            raise ValueError(f"{_KEY}: the {kind} page is not one plain latent per token ({spec}): not described")
        return PageGeometry(spec.dtype, n, 1, d, d, 0, 0, halves=1)
    if layout == "LBHNC" and cpu:  # a head's K then V, each (N, D): cpu_attn views the page (H, 2N, D)
        return PageGeometry(spec.dtype, n, h, d, d, n * d, h * n * d)
    if layout == "LBNHC" and not cpu and n % 2 == 0:  # per token and head, K then V: halves of N/2 tokens
        return PageGeometry(spec.dtype, n // 2, 2 * h, d, 2 * h * d, d, n * h * d)
    raise ValueError(
        f"{_KEY}: kv_cache_layout {layout!r} on the {'CPU' if cpu else 'GPU'} platform (block_size {n}) is not "
        "described: supported are LBHNC on CPU and LBNHC (an even block_size) on a GPU"
    )


@dataclass(frozen=True)
class FormatPlan:
    """What the rows hold, for both sides.

    Attributes:
        host_format: ``"fp8_e4m3"``, or ``"native"`` where the caches are 8-bit already (bytes unchanged).
        pages: per offloaded group, the page geometry of each of its layers (empty with ``"native"``).
        group_bytes: host bytes of one GPU block of each group.
    """

    host_format: str
    pages: tuple[tuple[PageGeometry, ...], ...]
    group_bytes: tuple[int, ...]


def format_plan(geometry, layout: str | None, cpu: bool) -> FormatPlan:
    """The :class:`FormatPlan` of ``host_format="fp8_e4m3"`` for a :class:`~.geometry.KVGeometry` (its layers'
    vLLM specs), or a ``ValueError`` naming the key (:func:`page_geometry`'s, or a mix of 8-bit and wider caches)."""
    if geometry is None:
        raise ValueError(
            f"{_KEY} needs each layer's dtype and heads from vLLM's KV-cache config, which this process could not "
            "read (the plugin's entry point did not run: install the package, or leave host_format at 'native')"
        )
    pages = tuple(tuple(page_geometry(layer.spec, layout, cpu) for layer in g.layers) for g in geometry.groups)
    flat = [p for group in pages for p in group]
    if all(p is None for p in flat):
        return FormatPlan(NATIVE, (), geometry.group_bytes)
    if any(p is None for p in flat):
        raise ValueError(f"{_KEY}: some layers' caches are 8-bit and others not: not described")
    if len({p.layout for p in flat}) > 1:
        raise ValueError(f"{_KEY}: MLA latents beside K/V pages in one model: not described")
    return FormatPlan(FP8_E4M3, pages, tuple(sum(p.host_bytes for p in group) for group in pages))


def typed_kv_spec(kv_caches, plan: FormatPlan, group_regions=None) -> KVCacheSpec:
    """One grouped ``block_first`` spec in the FP8 host format over vLLM's ``CanonicalKVCaches``: a typed view per
    canonical tensor (layers aliasing one tensor share it), in the groups' layer order.

    Raises:
        ValueError: the refs do not name one page per layer of the geometry (a packed allocation), or a page's
            bytes or two aliasing layers' geometries disagree with vLLM's specs.
    """
    refs = kv_caches.group_data_refs
    if len(refs) != len(plan.pages):
        raise ValueError(f"{_KEY}: vLLM handed {len(refs)} groups of pages, its config has {len(plan.pages)}")
    views: list[torch.Tensor] = []
    index: dict[int, tuple[int, PageGeometry]] = {}
    groups: list[list[int]] = []
    for gi, (group_refs, pages) in enumerate(zip(refs, plan.pages)):
        if len(group_refs) != len(pages):
            raise ValueError(
                f"{_KEY}: group {gi} has {len(group_refs)} page refs for {len(pages)} layers (a packed allocation "
                "is not described)"
            )
        members: list[int] = []
        for ref, page in zip(group_refs, pages):
            if ref.page_size_bytes != page.page_bytes:
                raise ValueError(
                    f"{_KEY}: group {gi}'s page of tensor {ref.tensor_idx} is {ref.page_size_bytes} bytes; vLLM's spec "
                    f"gives {page.page_bytes}"
                )
            if ref.tensor_idx not in index:
                tensor = kv_caches.tensors[ref.tensor_idx].tensor
                index[ref.tensor_idx] = (len(views), page)
                views.append(page.view(tensor, f"tensor {ref.tensor_idx}"))
            entry, seen = index[ref.tensor_idx]
            if seen != page:
                raise ValueError(f"{_KEY}: layers sharing tensor {ref.tensor_idx} disagree on its geometry")
            if entry not in members:
                members.append(entry)
        groups.append(members)
    layout = plan.pages[0][0].layout  # one for every page (format_plan)
    return KVCacheSpec(views, layout, groups=groups, group_regions=group_regions, host_format=FP8_E4M3)
