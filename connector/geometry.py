"""What the scheduler and every worker know identically about the KV caches they offload (:class:`KVGeometry`), and the
host rows built from it (:func:`host_regions`, :func:`region_bytes`). vLLM builds an ``OffloadingConfig`` in each
process that runs an ``OffloadingConnector`` (the engine core's scheduler and every worker) and hands the spec only
that: it carries vLLM's bytes per GPU block (``worker_kv_bytes_per_block``: the whole backing allocation, or the sum of
the groups') but not what one block of each KV-cache group holds, which is what a key of that group costs. The spec
cannot see tensors on the scheduler side, so the two sides must agree on the host rows from something else they both
receive: vLLM's ``KVCacheConfig``, which the connector gets with the ``VllmConfig`` right where it builds the
``OffloadingConfig``. :func:`install` wraps that one call so that :func:`geometry_for` gives the spec a
:class:`KVGeometry` of the config it is built from; without the plugin's entry point (``spec_module_path`` alone) there
is none, and the spec sizes its rows from vLLM's figure as before (with a warning for several groups).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

from triton_offload.connector.config import HOST_REGION_MODES

__all__ = [
    "HOST_REGION_MODES",
    "GroupGeometry",
    "LayerPlacement",
    "KVGeometry",
    "kv_geometry",
    "host_regions",
    "region_bytes",
    "remember",
    "geometry_for",
    "inside_multi_connector",
    "install",
]

logger = logging.getLogger(__name__)

_MARK = "_triton_offload_geometry"


@dataclass(frozen=True)
class LayerPlacement:
    """Where one layer's page of a GPU block is, as vLLM's ``KVCacheTensor`` places it.

    Attributes:
        name: the layer.
        page: the bytes the offloading worker moves per block (the un-padded page, as vLLM's worker role refs it).
        column: where the page starts within a block of the backing allocation, for block-outermost ("packed")
            allocations, whose blocks hold every layer's page side by side; None where the layer is not placed.
        block_stride: bytes between blocks of its ``KVCacheTensor``.
        spec: its vLLM ``KVCacheSpec`` (dtype, heads, ...: the FP8 host format's typed views,
            :mod:`~triton_offload.connector.typed_pages`).
    """

    name: str
    page: int
    column: int | None = None
    block_stride: int | None = None
    spec: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class GroupGeometry:
    """One offloaded KV-cache group.

    Attributes:
        group_id: vLLM's group id (the offload keys of this group carry it).
        kind: the group's KV cache spec class (``FullAttentionSpec``, ``SlidingWindowSpec``, ``MambaSpec``, ...).
        dense: whether vLLM stores a key of this group for every chunk of every request (full attention; a
            sliding-window group too when ``prefix_cache_retention_interval`` is None); otherwise only a few per
            request.
        nbytes: bytes one GPU block of the group moves, as both sides compute it (the sum of its layers' un-padded
            pages; a group of several layer types is counted as the scheduler's copy of the config describes it).
        layers: its layers, with their placement (the worker's copy of the config is exact).
    """

    group_id: int
    kind: str
    dense: bool
    nbytes: int
    layers: tuple[LayerPlacement, ...]


@dataclass(frozen=True)
class KVGeometry:
    """What both sides derive from vLLM's ``KVCacheConfig`` and ``VllmConfig``.

    Attributes:
        groups: the offloaded groups, in vLLM's offloading order (the order of ``OffloadingConfig.groups`` and of a
            transfer's ``group_sizes``).
        retention_interval: ``cache_config.prefix_cache_retention_interval`` (None: dense checkpoints).
        kv_connector: the connector this offloading connector runs under: ``"MultiConnector"`` when it was built as
            one of a ``MultiConnector``'s children, else the configured one (``"OffloadingConnector"``).
        fingerprint: the fields of the configuration fingerprint
            (:func:`~triton_offload.connector.fingerprint.fingerprint_fields`); None where vLLM's config was not given
            or could not be read.
    """

    groups: tuple[GroupGeometry, ...]
    retention_interval: int | None = 0
    kv_connector: str | None = None
    fingerprint: dict | None = field(default=None, compare=False)

    @property
    def group_bytes(self) -> tuple[int, ...]:
        return tuple(g.nbytes for g in self.groups)

    def pool_of_group_id(self) -> dict[int, int]:
        """vLLM group id -> position in ``groups``."""
        return {g.group_id: i for i, g in enumerate(self.groups)}


def _layer_specs(group) -> dict[str, Any]:
    """Each layer's KV cache spec in one group (``UniformTypeKVCacheSpecs`` keeps one per layer)."""
    spec = group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)
    return {name: (per_layer or {}).get(name, spec) for name in group.layer_names}


def _sizing_spec(group):
    """The spec both sides size a group with: the scheduler's copy of vLLM's config replaces a
    ``UniformTypeKVCacheSpecs`` by its first layer's spec (``generate_scheduler_kv_cache_config``), so the workers'
    copy is read the same way."""
    spec = group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)
    return next(iter(per_layer.values())) if per_layer else spec


def _unpadded_page(spec) -> int:
    """The bytes vLLM's offloading worker role refs per block of a layer: an attention layer's un-padded page, a
    Mamba layer's state without the padding that aligns it to attention pages; the page otherwise."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    if isinstance(spec, AttentionSpec):
        return int(spec.unpadded_page_size_bytes)
    if isinstance(spec, MambaSpec) and getattr(spec, "page_size_padded", None) is not None:
        return int(replace(spec, page_size_padded=None).page_size_bytes)
    return int(spec.page_size_bytes)


def _dense(spec, retention_interval: int | None) -> bool:
    """Whether vLLM's offloading scheduler stores a key of a group with this spec for every chunk: its manager keeps
    every block (the base ``reachable_block_mask``, full attention), or sliding-window checkpoints are dense
    (``retention_interval`` None). Mamba groups store boundary states only (their align-mode hand-offs)."""
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    if isinstance(spec, MambaSpec):
        return False
    manager = KVCacheSpecRegistry.get_manager_class(spec)
    if manager is None:
        return False
    if manager.reachable_block_mask.__func__ is SingleTypeKVCacheManager.reachable_block_mask.__func__:
        return True
    return retention_interval is None


def kv_geometry(kv_cache_config, vllm_config=None) -> KVGeometry:
    """The :class:`KVGeometry` of vLLM's ``KVCacheConfig`` (and, for the retention interval and the connector, its
    ``VllmConfig``; None: the defaults)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids

    placed: dict[str, tuple[int, int]] = {}  # layer -> (column in a block, block stride)
    for tensor in kv_cache_config.kv_cache_tensors:
        for index, name in enumerate(tensor.layers):
            placed.setdefault(name, (tensor.offset + index * tensor.layer_stride, tensor.block_stride))
    cache = getattr(vllm_config, "cache_config", None)
    retention = getattr(cache, "prefix_cache_retention_interval", 0) if cache is not None else 0
    groups = []
    for group_id in get_offloading_group_ids(kv_cache_config):
        group = kv_cache_config.kv_cache_groups[group_id]
        sizing = _sizing_spec(group)
        layers = tuple(
            LayerPlacement(name, _unpadded_page(spec), *placed.get(name, (None, None)), spec=spec)
            for name, spec in _layer_specs(group).items()
        )
        groups.append(
            GroupGeometry(
                group_id=group_id,
                kind=type(sizing).__name__,
                dense=_dense(sizing, retention),
                nbytes=_unpadded_page(sizing) * len(group.layer_names),
                layers=layers,
            )
        )
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    connector = "MultiConnector" if _inside.depth else getattr(transfer, "kv_connector", None)
    return KVGeometry(tuple(groups), retention, connector)


def host_regions(geometry: KVGeometry, mode: str = "auto") -> tuple[int, ...]:
    """The host region of each offloaded group (``KVCacheSpec(group_regions=...)``).

    Host regions (docs/vllm.md, "Hybrid models"): a host row holds one key per *region*, and a region is sized for the
    largest of its groups. Every offloaded group of vLLM stores keys at its own rate: a full-attention group one key
    per chunk of every request; a sliding-window or Mamba group, by default (``--prefix-cache-retention-interval 0``),
    only at a request's replay boundary and shared-prefix junctions, so a few keys per request. Giving such a group a
    region in every row would reserve bytes its few keys never fill, so ``"auto"`` gives each *dense* group (one key
    per chunk) a region of its own and lets each sparse group borrow the region of the smallest dense group that holds
    it.

    ``"per_group"``: a region each. ``"shared"``: one region for all (a row per key, sized for the largest group;
    vLLM's own layout since its #56953). ``"auto"``: a region for each dense group, in order; each sparse group
    shares the region of the smallest dense group at least its size (the largest dense group's if none is); no dense
    group: one region.
    """
    if mode not in HOST_REGION_MODES:
        raise ValueError(f"host_regions = {mode!r}; supported: {', '.join(HOST_REGION_MODES)}")
    groups = geometry.groups
    if mode == "per_group":
        return tuple(range(len(groups)))
    dense = [i for i, g in enumerate(groups) if g.dense]
    if mode == "shared" or not dense:
        return (0,) * len(groups)
    region = {gi: r for r, gi in enumerate(dense)}
    out = []
    for i, g in enumerate(groups):
        if i in region:
            out.append(region[i])
            continue
        fits = [d for d in dense if groups[d].nbytes >= g.nbytes]
        host = min(fits, key=lambda d: groups[d].nbytes) if fits else max(dense, key=lambda d: groups[d].nbytes)
        out.append(region[host])
    return tuple(out)


def region_bytes(group_bytes, regions) -> tuple[int, ...]:
    """Bytes of one sub-block of each region: the largest of its groups'."""
    count = max(regions) + 1
    return tuple(max(b for b, r in zip(group_bytes, regions) if r == k) for k in range(count))


# -- capture -----------------------------------------------------------------------------------------------------

# vLLM's MultiConnector builds each child with a copy of the config whose kv_transfer_config is the child's own, so
# a child cannot tell from its config that it runs under MultiConnector: the wrapped constructor says so meanwhile.
_inside = threading.local()
_inside.depth = 0


@contextlib.contextmanager
def inside_multi_connector():
    """While a ``MultiConnector`` builds its children (in this thread)."""
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        yield
    finally:
        _inside.depth -= 1


# id(OffloadingConfig) -> (a weak reference to it, its geometry). vLLM builds a spec right after its config, in the
# same thread; the entry is dropped with the config.
_CAPTURED: dict[int, tuple[weakref.ref, KVGeometry]] = {}


def remember(config, kv_cache_config, vllm_config=None) -> KVGeometry:
    """Computes and keeps the geometry of the ``OffloadingConfig`` ``config`` vLLM built from these configs, for
    :func:`geometry_for` (what the wrapper does; tests call it with configs of their own)."""
    geometry = kv_geometry(kv_cache_config, vllm_config)
    if vllm_config is not None:
        from triton_offload.connector.fingerprint import fingerprint_fields

        try:
            geometry = replace(geometry, fingerprint=fingerprint_fields(vllm_config, kv_cache_config, config))
        except Exception as e:  # the spec falls back to what the OffloadingConfig says, and warns
            logger.warning("triton-offload: could not read the configuration fingerprint from vLLM's config: %r", e)
    key = id(config)
    _CAPTURED[key] = (weakref.ref(config, lambda _, key=key: _CAPTURED.pop(key, None)), geometry)
    return geometry


def geometry_for(config) -> KVGeometry | None:
    """The geometry kept for ``config`` by :func:`remember`, or None."""
    entry = _CAPTURED.get(id(config))
    if entry is None or entry[0]() is not config:
        return None
    return entry[1]


def install() -> bool:
    """Wraps vLLM's ``offloading_connector.build_offloading_config`` so that every ``OffloadingConfig`` has its
    :class:`KVGeometry` (:func:`geometry_for`), and ``MultiConnector.__init__`` so that it says its children run
    under it; idempotent. Returns whether the first is installed. That call gets the ``KVCacheConfig`` with the
    ``VllmConfig`` in vLLM 0.32 and 0.33 (vLLM's own fix, #56953, carries per-group bytes in the offloading config
    instead)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1 import offloading_connector
    except ImportError as e:  # pragma: no cover - vLLM >= 0.32 has it
        logger.debug("no vLLM offloading connector to wrap (%s): host rows are sized from vLLM's figure", e)
        return False
    _wrap_multi_connector()
    original = getattr(offloading_connector, "build_offloading_config", None)
    if original is None:
        logger.debug("vLLM's offloading connector has no build_offloading_config: host rows sized from vLLM's figure")
        return False
    if getattr(original, _MARK, False):
        return True

    def build_offloading_config(vllm_config, kv_cache_config, *args, **kwargs):
        config = original(vllm_config, kv_cache_config, *args, **kwargs)
        try:
            remember(config, kv_cache_config, vllm_config)
        except Exception as e:  # never in the way of vLLM's own specs; ours then size from vLLM's figure
            logger.warning("triton-offload: could not read the KV-cache groups' bytes from vLLM's config: %s", e)
        return config

    build_offloading_config.__wrapped__ = original
    setattr(build_offloading_config, _MARK, True)
    offloading_connector.build_offloading_config = build_offloading_config
    return True


def _wrap_multi_connector() -> None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    except ImportError:  # pragma: no cover - vLLM >= 0.32 has it
        return
    original = MultiConnector.__init__
    if getattr(original, _MARK, False):
        return

    def __init__(self, *args, **kwargs):  # noqa: N807 - the wrapped constructor
        with inside_multi_connector():
            original(self, *args, **kwargs)

    __init__.__wrapped__ = original
    setattr(__init__, _MARK, True)
    MultiConnector.__init__ = __init__
