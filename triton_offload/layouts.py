"""GPU KV-cache layouts and their byte segments.

Every layout is named once, in :data:`LAYOUTS`; everything else (segments, sizes, validation) is derived from the
per-layer tensors themselves: ``data_ptr``, strides and element size. A layer contributes one byte *segment* per
K/V half (one for MLA and canonical views): a base address, a stride between blocks and the number of bytes one block
holds. The packed host format (DESIGN.md) lays a GPU block out as the concatenation of its segments in layer order,
K before V, so a prepared :class:`KVCacheSpec` is all the kernels need.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Layout", "LayoutDims", "Segment", "KVCacheSpec", "prepare_kv", "resolve_layout"]


@dataclass(frozen=True)
class LayoutDims:
    """Where the block and K/V dims sit in a per-layer tensor of one layout.

    Attributes:
        ndim: number of dims of a layer tensor.
        block_dim: the ``num_blocks`` dim.
        kv_dim: the dim of size 2 that splits K and V, or None (MLA, canonical).
        shape: the shape, written out for error messages.
    """

    ndim: int
    block_dim: int
    kv_dim: int | None
    shape: str


class Layout(enum.Enum):
    """The supported per-layer GPU layouts (see DESIGN.md)."""

    KV_FIRST = LayoutDims(5, block_dim=1, kv_dim=0, shape="(2, num_blocks, block_size, num_kv_heads, head_dim)")
    BLOCK_FIRST = LayoutDims(5, block_dim=0, kv_dim=1, shape="(num_blocks, 2, block_size, num_kv_heads, head_dim)")
    MLA = LayoutDims(3, block_dim=0, kv_dim=None, shape="(num_blocks, block_size, latent_dim)")
    # vLLM >= 0.32 hands a spec one int8 view per tensor; stride(0) may exceed the page (padded or packed pages).
    CANONICAL = LayoutDims(2, block_dim=0, kv_dim=None, shape="(num_blocks, page_size_bytes)")

    @property
    def dims(self) -> LayoutDims:
        return self.value

    @property
    def label(self) -> str:
        return self.name.lower()


LAYOUTS = {layout.label: layout for layout in Layout}


def resolve_layout(layout: str | Layout) -> Layout:
    """Returns the :class:`Layout` for a name or a Layout; an unknown name lists the supported ones."""
    if isinstance(layout, Layout):
        return layout
    if isinstance(layout, str) and layout.lower() in LAYOUTS:
        return LAYOUTS[layout.lower()]
    raise ValueError(f"unknown layout {layout!r}; supported: {sorted(LAYOUTS)}")


@dataclass(frozen=True)
class Segment:
    """One contiguous run of bytes per GPU block: block ``b`` lives at ``base + b * block_stride``.

    Attributes:
        layer: index of the layer tensor it comes from.
        base: address of block 0's bytes.
        block_stride: bytes between consecutive blocks.
        nbytes: bytes per block.
        host_offset: offset of these bytes inside a packed GPU-sized sub-block on the host.
    """

    layer: int
    base: int
    block_stride: int
    nbytes: int
    host_offset: int


def _dense_block_bytes(t: torch.Tensor, inner_dims: Sequence[int], layer: int) -> int:
    """Bytes of one block's inner dims, checking that they tile one contiguous byte run.

    The inner dims may be permuted in memory (an engine that stores heads before tokens, say); the bytes are then
    moved in memory order, which is what the packed format means by "the tensor's own element order".
    """
    dims = sorted((d for d in inner_dims if t.shape[d] != 1), key=lambda d: t.stride(d))
    expected = 1
    for d in dims:
        if t.stride(d) != expected:
            raise ValueError(
                f"layer {layer}: a block's elements are not one contiguous run (shape {tuple(t.shape)}, strides "
                f"{t.stride()}); dim {d} has stride {t.stride(d)}, expected {expected}"
            )
        expected *= t.shape[d]
    return math.prod(t.shape[d] for d in inner_dims) * t.element_size()


class KVCacheSpec:
    """Per-layer KV tensors of one layout, prepared once: segments, sizes and the kernels' segment table.

    Build it once per engine (the cost is a Python loop over layers) and pass it instead of the tensor list: each
    transfer then costs only the id validation and one launch.

    Args:
        kv_caches: per layer, a tensor of ``layout``'s shape; all on one device, all with the same ``num_blocks``.
            Layers may differ in page size (hybrid models). Any dtype; bytes are moved.
        layout: a :class:`Layout` or its name (``kv_first``, ``block_first``, ``mla``, ``canonical``).
        groups: KV-cache groups (vLLM's hybrid-model groups), as lists of indices into ``kv_caches``. A GPU block
            of group g holds exactly the layers of group g, and its packed host sub-block holds those layers in
            the order given. Every group's sub-block has the same stride on the host, ``bytes_per_block``, the
            largest group's. Default: one group of all layers in order.
    """

    def __init__(
        self, kv_caches: Sequence[torch.Tensor], layout: str | Layout, *, groups: Sequence[Sequence[int]] | None = None
    ):
        self.layout = resolve_layout(layout)
        if isinstance(kv_caches, torch.Tensor) or len(kv_caches) == 0:
            raise ValueError("kv_caches must be a non-empty sequence of per-layer tensors")
        dims = self.layout.dims
        self.device = kv_caches[0].device
        self.num_blocks = None
        # Per layer: its (base, block stride, bytes) byte runs, K then V.
        runs: list[list[tuple[int, int, int]]] = []
        for i, t in enumerate(kv_caches):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"layer {i}: expected a torch.Tensor, got {type(t).__name__}")
            if t.device != self.device:
                raise ValueError(f"layer {i} is on {t.device}, layer 0 on {self.device}: all layers share one device")
            if t.dim() != dims.ndim:
                raise ValueError(f"layer {i}: {self.layout.label} expects {dims.shape}, got shape {tuple(t.shape)}")
            if dims.kv_dim is not None and t.shape[dims.kv_dim] != 2:
                raise ValueError(
                    f"layer {i}: dim {dims.kv_dim} must be 2 (K and V) for {self.layout.label} {dims.shape}, "
                    f"got shape {tuple(t.shape)}"
                )
            n = t.shape[dims.block_dim]
            if self.num_blocks is None:
                self.num_blocks = n
            elif n != self.num_blocks:
                raise ValueError(f"layer {i} has {n} blocks, layer 0 has {self.num_blocks}: layers must match")
            inner = [d for d in range(dims.ndim) if d not in (dims.block_dim, dims.kv_dim)]
            nbytes = _dense_block_bytes(t, inner, i)
            esize = t.element_size()
            halves = [0] if dims.kv_dim is None else [0, 1]
            kv_step = 0 if dims.kv_dim is None else t.stride(dims.kv_dim) * esize
            runs.append([(t.data_ptr() + half * kv_step, t.stride(dims.block_dim) * esize, nbytes) for half in halves])
        groups = [list(range(len(kv_caches)))] if groups is None else [list(g) for g in groups]
        group_segments = []
        for gi, layers in enumerate(groups):
            if not layers:
                raise ValueError(f"group {gi} is empty: every group needs at least one layer")
            if len(set(layers)) != len(layers) or not all(0 <= i < len(kv_caches) for i in layers):
                raise ValueError(f"group {gi} = {layers}: indices must be distinct layers in [0, {len(kv_caches)})")
            offset, segs = 0, []
            for i in layers:
                for base, stride, nbytes in runs[i]:
                    segs.append(Segment(i, base, stride, nbytes, offset))
                    offset += nbytes
            group_segments.append(tuple(segs))
        self.kv_caches = list(kv_caches)
        self.num_layers = len(kv_caches)
        self.groups = tuple(tuple(g) for g in groups)
        self.num_groups = len(groups)
        self.group_segments = tuple(group_segments)
        # Rows per group in the segment table: the largest group's segment count (others are padded).
        self.segments_per_group = max(len(segs) for segs in group_segments)
        self.segments = tuple(s for segs in group_segments for s in segs)
        self.group_bytes = tuple(sum(s.nbytes for s in segs) for segs in group_segments)
        self.bytes_per_block = max(self.group_bytes)
        self.max_segment_bytes = max(s.nbytes for s in self.segments)
        self._layer_page_bytes = tuple(sum(r[2] for r in layer_runs) for layer_runs in runs)
        # Largest power of two (at most 16) dividing every GPU address, stride, size and host offset: the widest
        # access the kernel may use. Computed once: the per-call path must not loop over layers.
        self.alignment = math.gcd(
            16,
            self.bytes_per_block,
            *(math.gcd(s.base, s.block_stride, s.nbytes, s.host_offset) for s in self.segments),
        )
        self._tables: dict = {}
        self.launch_configs: dict = {}  # kernels/copy_blocks.py caches its launch shapes here

    def host_block_bytes(self, blocks_per_host_block: int = 1) -> int:
        """Bytes of one packed host block holding ``blocks_per_host_block`` GPU blocks of all layers."""
        return blocks_per_host_block * self.bytes_per_block

    @property
    def page_bytes(self) -> tuple[int, ...]:
        """Bytes per block of each layer (K+V), in layer order."""
        return self._layer_page_bytes

    def segment_table(self, anchor_align: int) -> torch.Tensor:
        """The kernels' int64 table, (num_groups * segments_per_group, 4): gpu offset from the table's own address,
        block stride, bytes, host offset -- all in units of ``anchor_align`` bytes. Groups with fewer segments are
        padded with zero-length rows, which the kernel masks out entirely. Built once per unit size and cached.
        """
        table = self._tables.get(anchor_align)
        if table is None:
            width = self.segments_per_group
            rows = []
            for segs in self.group_segments:
                rows += [[s.base, s.block_stride, s.nbytes, s.host_offset] for s in segs]
                rows += [[self.segments[0].base, 0, 0, 0]] * (width - len(segs))
            table = torch.empty((len(rows), 4), dtype=torch.int64, device=self.device)
            # GPU addresses are stored relative to the table itself, which the kernel receives as its anchor
            # pointer: Triton then needs no integer-to-pointer cast, and the interpreter sees plain addresses.
            anchor = table.data_ptr()
            assert anchor % anchor_align == 0, "torch allocations are at least 64-byte aligned"
            values = torch.tensor(rows, dtype=torch.int64)
            values[:, 0] -= anchor
            values //= anchor_align
            table.copy_(values)
            if self.device.type == "cuda":
                # The table is finished before any stream reads it: later launches on any stream (the engine's
                # store and load streams) need no ordering against the stream that happened to build it.
                torch.cuda.current_stream(self.device).synchronize()
            self._tables[anchor_align] = table
        return table

    def __repr__(self) -> str:
        pages = sorted(set(self.page_bytes))
        return (
            f"KVCacheSpec(layout={self.layout.label}, layers={self.num_layers}, num_blocks={self.num_blocks}, "
            f"page_bytes={pages if len(pages) > 1 else pages[0]}, bytes_per_block={self.bytes_per_block}, "
            f"groups={self.num_groups}, "
            f"device={self.device})"
        )


def prepare_kv(kv_caches: Sequence[torch.Tensor] | KVCacheSpec, layout: str | Layout | None = None) -> KVCacheSpec:
    """Returns a :class:`KVCacheSpec`, building one from tensors or checking a prepared one against ``layout``."""
    if isinstance(kv_caches, KVCacheSpec):
        if layout is not None and resolve_layout(layout) is not kv_caches.layout:
            raise ValueError(f"layout {layout!r} does not match the prepared spec's {kv_caches.layout.label!r}")
        return kv_caches
    if layout is None:
        raise ValueError(f"a layout is required with raw tensors; supported: {sorted(LAYOUTS)}")
    return KVCacheSpec(kv_caches, layout)
