"""GPU KV-cache layouts and their byte segments: every layout is named once (:data:`LAYOUTS`), and everything else
(segments, sizes, validation) is derived from the per-layer tensors' addresses, strides and element sizes. A layer
contributes one *segment* per K/V half (one for MLA and canonical views), and the packed host format lays a GPU block
out as its segments in layer order, so a prepared :class:`KVCacheSpec` describes everything the kernel moves. The
packed rows hold one key per *region* (by default one region, sized for the largest group; with ``group_regions``,
several, each sized for its groups), and :class:`HostSlots` describes the other host format it writes, vLLM's worker
slots (docs/design.md, sections 3-4).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from triton_offload.host_format import NATIVE, host_run_bytes, quant_runs

__all__ = ["Layout", "LayoutDims", "Segment", "HostSlots", "KVCacheSpec", "prepare_kv", "resolve_layout"]


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
    """The supported per-layer GPU layouts (docs/design.md, "Layouts")."""

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
class HostSlots:
    """vLLM's worker-slot host layout (``SharedOffloadRegion.create_next_worker_view``), instead of the packed one.

    A host row (one host block of f GPU blocks) is a sequence of *regions*, one per entry of ``pages``: region r
    holds f sub-blocks of ``pages[r]`` bytes, sub-block j at offset ``j * pages[r]`` in the region, and starts at
    ``f * sum(pages[:r])`` in the row. Entry i of the KV caches lives in region ``regions[i]``: its bytes for a GPU
    block (K then V where it has both) start at the beginning of the sub-block. Entries may share a region (views of
    one tensor with different page lengths, in different KV-cache groups), and a region may hold no entry (a tensor
    that is not offloaded still takes its place in the row).

    Attributes:
        pages: bytes per sub-block of each region, in row order (vLLM: each canonical tensor's ``page_size_bytes``,
            padding included).
        regions: for each entry of the KV caches, the index of its region.
    """

    pages: tuple[int, ...]
    regions: tuple[int, ...]

    def __post_init__(self):
        if not self.pages or any(p <= 0 for p in self.pages):
            raise ValueError(f"HostSlots pages = {self.pages}: expected one positive size per region")
        if any(not 0 <= r < len(self.pages) for r in self.regions):
            raise ValueError(f"HostSlots regions = {self.regions}: each must index pages [0, {len(self.pages)})")


@dataclass(frozen=True)
class Segment:
    """One contiguous run of bytes per GPU block: block ``b`` lives at ``base + b * block_stride``.

    On the host, the run of the GPU block at sub-block ``j`` of a host block of ``f`` sub-blocks starts at
    ``f * host_region + j * host_stride + host_offset`` in the host block's row. Packed format: ``host_region = 0``,
    ``host_stride`` the bytes of a packed sub-block (the largest group's); packed with ``group_regions``:
    ``host_region`` the bytes per GPU block of the regions before its group's, ``host_stride`` its region's bytes;
    :class:`HostSlots`: ``host_region`` the bytes of the regions before this one per sub-block, ``host_stride`` the
    region's page.

    Attributes:
        layer: index of the layer tensor it comes from.
        base: address of block 0's bytes.
        block_stride: bytes between consecutive blocks.
        nbytes: bytes per block.
        host_offset: offset of these bytes inside a GPU-sized sub-block on the host.
        host_stride: bytes between consecutive sub-blocks of one host block.
        host_region: the start of this run's host region, in bytes per GPU block of the host block (times f).
        host_nbytes: bytes of the run on the host: ``nbytes`` but in a quantizing host format
            (:mod:`triton_offload.host_format`).
    """

    layer: int
    base: int
    block_stride: int
    nbytes: int
    host_offset: int
    host_stride: int
    host_region: int
    host_nbytes: int = -1

    def __post_init__(self):
        if self.host_nbytes < 0:
            object.__setattr__(self, "host_nbytes", self.nbytes)


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


# The widest access one GPU thread makes (a 128-bit load or store); alignments are capped there.
MAX_ACCESS_BYTES = 16


def _layer_runs(t: torch.Tensor, i: int, layout: Layout) -> list[tuple[int, int, int]]:
    """One layer tensor's byte runs per block, K then V (one for MLA and canonical): (base, block stride, bytes).

    Raises:
        TypeError / ValueError: not a tensor, or not of ``layout``'s shape (the message names the layer).
    """
    dims = layout.dims
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"layer {i}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims.ndim:
        raise ValueError(f"layer {i}: {layout.label} expects {dims.shape}, got shape {tuple(t.shape)}")
    if dims.kv_dim is not None and t.shape[dims.kv_dim] != 2:
        raise ValueError(
            f"layer {i}: dim {dims.kv_dim} must be 2 (K and V) for {layout.label} {dims.shape}, "
            f"got shape {tuple(t.shape)}"
        )
    inner = [d for d in range(dims.ndim) if d not in (dims.block_dim, dims.kv_dim)]
    nbytes = _dense_block_bytes(t, inner, i)
    esize = t.element_size()
    halves = [0] if dims.kv_dim is None else [0, 1]
    kv_step = 0 if dims.kv_dim is None else t.stride(dims.kv_dim) * esize
    return [(t.data_ptr() + half * kv_step, t.stride(dims.block_dim) * esize, nbytes) for half in halves]


def _region_bytes(group_bytes: Sequence[int], regions: Sequence[int] | None) -> tuple[int, ...]:
    """Bytes of one sub-block of each host region: the largest of its groups' (one region when ``regions`` is
    None).

    Raises:
        ValueError: ``regions`` does not give each group a region, or leaves a region number unused.
    """
    if regions is None:
        return (max(group_bytes),)
    regions = list(regions)
    if len(regions) != len(group_bytes) or any(type(r) is not int or r < 0 for r in regions):
        raise ValueError(
            f"group_regions = {regions}: expected one region number (an int >= 0) per group, {len(group_bytes)}"
        )
    count = max(regions) + 1
    if set(regions) != set(range(count)):
        raise ValueError(f"group_regions = {regions}: regions must be numbered 0, 1, ... without a gap")
    return tuple(max(b for b, r in zip(group_bytes, regions) if r == region) for region in range(count))


def _group_segments(
    runs: list[list[tuple[int, int, int]]],
    pages: list[int],
    groups: list[list[int]],
    host_slots: HostSlots | None,
    group_regions: Sequence[int] | None = None,
    host_runs: list[list[int]] | None = None,
) -> tuple[tuple[Segment, ...], ...]:
    """Each group's segments in packed order (its layers in the order given, K before V), with their host placement:
    packed (one sub-block of the largest group's bytes, the layers side by side), packed in its region of the row
    (``group_regions``: sub-blocks of the region's bytes) or ``host_slots``. ``pages[i]`` is entry i's bytes per
    block (the sum of its runs); ``host_runs[i]`` its runs' host bytes (None: as on the GPU)."""
    host_runs = host_runs or [[nbytes for _, _, nbytes in r] for r in runs]
    host_pages = [sum(h) for h in host_runs]
    for gi, layers in enumerate(groups):
        if not layers:
            raise ValueError(f"group {gi} is empty: every group needs at least one layer")
        if len(set(layers)) != len(layers) or not all(0 <= i < len(runs) for i in layers):
            raise ValueError(f"group {gi} = {layers}: indices must be distinct layers in [0, {len(runs)})")
    if host_slots is not None and len(host_slots.regions) != len(runs):
        raise ValueError(f"host_slots names a region for {len(host_slots.regions)} entries, but there are {len(runs)}")
    if host_slots is not None and group_regions is not None:
        raise ValueError("host_slots and group_regions are two host layouts: give one")
    group_bytes = [sum(host_pages[i] for i in layers) for layers in groups]
    region_bytes = _region_bytes(group_bytes, group_regions)
    out = []
    for gi, layers in enumerate(groups):
        offset, segs = 0, []
        region = 0 if group_regions is None else group_regions[gi]
        for i in layers:
            if host_slots is not None:
                # Each entry's bytes start its own region's sub-block, whatever the group holds before it.
                slot = host_slots.regions[i]
                offset, host_stride, host_region = 0, host_slots.pages[slot], sum(host_slots.pages[:slot])
                if pages[i] > host_stride:
                    raise ValueError(
                        f"entry {i} moves {pages[i]} bytes per block, more than the "
                        f"{host_stride}-byte page of its host region {slot}"
                    )
            else:
                # The group's region of the row: f sub-blocks of the region's bytes, after the earlier regions'.
                host_stride, host_region = region_bytes[region], sum(region_bytes[:region])
            for (base, stride, nbytes), host_nbytes in zip(runs[i], host_runs[i]):
                segs.append(Segment(i, base, stride, nbytes, offset, host_stride, host_region, host_nbytes))
                offset += host_nbytes
        out.append(tuple(segs))
    return tuple(out)


class KVCacheSpec:
    """Per-layer KV tensors of one layout, described once as byte segments: a plain description of the caches.

    Build it once per engine (the cost is a Python loop over layers) and pass it instead of the tensor list: each
    transfer then costs only the id validation and one launch. What the kernel derives from it (segment tables,
    launch shapes) lives with the kernel, in :mod:`triton_offload.kernels.copy_blocks`.

    Args:
        kv_caches: per layer, a tensor of ``layout``'s shape; all on one device, all with the same ``num_blocks``.
            Layers may differ in page size (hybrid models). Any dtype; bytes are moved.
        layout: a :class:`Layout` or its name (``kv_first``, ``block_first``, ``mla``, ``canonical``).
        groups: KV-cache groups (vLLM's hybrid-model groups), as lists of indices into ``kv_caches``. A GPU block
            of group g holds exactly the layers of group g, and its packed host sub-block holds those layers in
            the order given. Every group's sub-block has the same stride on the host, ``bytes_per_block``, the
            largest group's (unless ``group_regions``). Default: one group of all layers in order.
        host_slots: lay the host rows out as vLLM's worker slots (:class:`HostSlots`, one region index per entry
            of ``kv_caches``) instead of the packed format. The GPU side and the bytes moved are the same.
        group_regions: packed rows with several regions: for each group, the number of the host region its keys
            live in (0, 1, ...; groups may share one). A row (host block) holds, region after region, ``f``
            sub-blocks of each region's bytes (the largest of its groups'), and a host block id names one key *per
            region*: the caller keeps a block pool per region, and the same id in two regions is two keys of one
            row. With a region per group a key costs exactly its group's bytes, however unequal the groups
            (docs/design.md, "Host rows and regions"). None, or every group in region 0: the plain packed format.
        host_format: what the packed rows hold (:mod:`triton_offload.host_format`): ``"native"``, the caches' own
            bytes, or ``"fp8_e4m3"``, bf16 / fp16 caches as FP8 values and per-head scales (8-bit caches move
            unchanged). Not with ``host_slots`` (vLLM's worker slots hold the caches' own bytes).
    """

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        layout: str | Layout,
        *,
        groups: Sequence[Sequence[int]] | None = None,
        host_slots: HostSlots | None = None,
        group_regions: Sequence[int] | None = None,
        host_format: str = NATIVE,
    ):
        self.layout = resolve_layout(layout)
        if isinstance(kv_caches, torch.Tensor) or len(kv_caches) == 0:
            raise ValueError("kv_caches must be a non-empty sequence of per-layer tensors")
        self.device = kv_caches[0].device
        block_dim = self.layout.dims.block_dim
        runs = [_layer_runs(t, i, self.layout) for i, t in enumerate(kv_caches)]
        for i, t in enumerate(kv_caches):
            if t.device != self.device:
                raise ValueError(f"layer {i} is on {t.device}, layer 0 on {self.device}: all layers share one device")
            if t.shape[block_dim] != kv_caches[0].shape[block_dim]:
                raise ValueError(
                    f"layer {i} has {t.shape[block_dim]} blocks, layer 0 has {kv_caches[0].shape[block_dim]}: "
                    "layers must match"
                )
        self.num_blocks = kv_caches[0].shape[block_dim]
        groups = [list(range(len(kv_caches)))] if groups is None else [list(g) for g in groups]
        self.kv_caches = list(kv_caches)
        self.num_layers = len(kv_caches)
        self.groups = tuple(tuple(g) for g in groups)
        self.num_groups = len(groups)
        self.host_slots = host_slots
        if group_regions is not None and set(group_regions) == {0} and len(group_regions) == len(groups):
            group_regions = None  # one region: the plain packed format
        self.group_regions = None if group_regions is None else tuple(group_regions)
        pages = [sum(nbytes for _, _, nbytes in layer_runs) for layer_runs in runs]
        self.host_format = host_format
        # Per layer, the FP8 kernel's run geometry; None: the bytes move unchanged (the copy kernel).
        self.quant = quant_runs(self.kv_caches, self.layout.label, host_format)
        if self.quant is not None and host_slots is not None:
            raise ValueError(f"host_format {host_format!r} writes packed rows: not with host_slots")
        host_runs = host_run_bytes(self.quant, [[nbytes for _, _, nbytes in r] for r in runs])
        self.group_segments = _group_segments(runs, pages, groups, host_slots, self.group_regions, host_runs)
        # Rows per group in the kernel's segment table: the largest group's segment count (others are padded).
        self.segments_per_group = max(len(segs) for segs in self.group_segments)
        self.segments = tuple(s for segs in self.group_segments for s in segs)
        self.group_bytes = tuple(sum(s.nbytes for s in segs) for segs in self.group_segments)
        self.bytes_per_block = max(self.group_bytes)
        # Bytes of one sub-block of each host region (one region, the largest group's, unless group_regions), in
        # the host format's bytes.
        host_group_bytes = tuple(sum(s.host_nbytes for s in segs) for segs in self.group_segments)
        self.region_bytes = _region_bytes(host_group_bytes, self.group_regions)
        self.num_regions = len(self.region_bytes)
        self.max_segment_bytes = max(s.nbytes for s in self.segments)
        if self.max_segment_bytes >= 2**31:  # the kernel masks a row's elements with 32-bit lengths
            raise ValueError(f"a page of {self.max_segment_bytes} bytes is too large: the kernel moves pages < 2 GiB")
        self._layer_page_bytes = tuple(pages)
        # Largest power of two (at most MAX_ACCESS_BYTES) dividing every GPU address, stride, size and host position:
        # the widest access the kernel may use. Computed once: the per-call path must not loop over layers.
        self.alignment = math.gcd(
            MAX_ACCESS_BYTES,
            *self.region_bytes,
            *(
                math.gcd(s.base, s.block_stride, s.nbytes, s.host_offset, s.host_stride, s.host_region)
                for s in self.segments
            ),
        )

    def host_block_bytes(self, blocks_per_host_block: int = 1) -> int:
        """Bytes of one host block (a row of the host buffer) holding ``blocks_per_host_block`` GPU blocks of all
        layers (with :class:`HostSlots`: every region, ``f * sum(pages)``; with ``group_regions``: every group's
        region, ``f * sum(group_bytes)``)."""
        if self.host_slots is not None:
            return blocks_per_host_block * sum(self.host_slots.pages)
        return blocks_per_host_block * sum(self.region_bytes)

    def key_bytes(self, blocks_per_host_block: int = 1) -> tuple[int, ...]:
        """Host bytes one key of each group occupies: its whole row, except with ``group_regions``, where a row
        holds one key per region and a key occupies its group's region (``f * region_bytes[region]``)."""
        if self.group_regions is not None:
            return tuple(blocks_per_host_block * self.region_bytes[r] for r in self.group_regions)
        return (self.host_block_bytes(blocks_per_host_block),) * self.num_groups

    @property
    def page_bytes(self) -> tuple[int, ...]:
        """Bytes per block of each layer (K+V), in layer order."""
        return self._layer_page_bytes

    def __repr__(self) -> str:
        pages = sorted(set(self.page_bytes))
        host = "" if self.host_slots is None else "host=worker slots, "
        if self.group_regions is not None:
            host = f"host regions {list(self.region_bytes)} of groups {list(self.group_regions)}, "
        return (
            f"KVCacheSpec(layout={self.layout.label}, layers={self.num_layers}, num_blocks={self.num_blocks}, "
            f"page_bytes={pages if len(pages) > 1 else pages[0]}, bytes_per_block={self.bytes_per_block}, "
            f"groups={self.num_groups}, {host}device={self.device})"
        )


def prepare_kv(
    kv_caches: Sequence[torch.Tensor] | KVCacheSpec, layout: str | Layout | None = None, host_format: str | None = None
) -> KVCacheSpec:
    """Returns a :class:`KVCacheSpec`, building one from tensors (``host_format`` None: ``"native"``) or checking a
    prepared one against ``layout`` and ``host_format``."""
    if isinstance(kv_caches, KVCacheSpec):
        if layout is not None and resolve_layout(layout) is not kv_caches.layout:
            raise ValueError(f"layout {layout!r} does not match the prepared spec's {kv_caches.layout.label!r}")
        if host_format is not None and host_format != kv_caches.host_format:
            raise ValueError(
                f"host_format {host_format!r} does not match the prepared spec's {kv_caches.host_format!r}"
            )
        return kv_caches
    if layout is None:
        raise ValueError(f"a layout is required with raw tensors; supported: {sorted(LAYOUTS)}")
    return KVCacheSpec(kv_caches, layout, host_format=host_format or NATIVE)
