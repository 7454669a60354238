"""``TritonTieringOffloadingSpec``'s configuration: the keys it reads (vLLM's tiering keys and ours), each checked
before anything is allocated with a ``ValueError`` naming the key (:class:`TritonTieringConfig`), a secondary tier's
keys against the constructor vLLM will call, an ``fs`` tier's ``root_dir`` and the network tiers' keys. vLLM's tier
and policy registries are imported only when a configuration is checked.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from triton_offload._checks import host_format_setting
from triton_offload.connector import TIERING_SPEC_NAME
from triton_offload.connector.config import (
    VLLM_KEYS,
    check_keys,
    describe_unknown,
    did_you_mean,
    engine_settings,
    missing_key,
    parse_size,
)
from triton_offload.connector.fingerprint import AUTO, fingerprint_setting
from triton_offload.connector.fs_root import check_root_dir
from triton_offload.connector.network_tiers import ObjectStore, check_network_tier, where
from triton_offload.host.numa import numa_setting
from triton_offload.integrity import OFF, integrity_setting

__all__ = ["TIERING_KEYS", "OUR_TIERING_KEYS", "HOST_LAYOUTS", "TritonTieringConfig"]

# Keys vLLM's TieringOffloadingSpec reads (0.32 and 0.33), with their meaning; docs/tiering.md is the user-facing copy.
TIERING_KEYS = {
    "cpu_bytes_to_use": "the CPU primary tier for the whole instance (the shared region), split across workers",
    "eviction_policy": "the primary tier's eviction: 'lru', 'arc', or a CachePolicy registered with vLLM",
    "cache_policy_module_path": "module to import an out-of-tree eviction_policy class from",
    "secondary_tiers": "list of tiers below the CPU: dicts with 'type' and that tier's own keys",
    "backpressure": "default backpressure settings for every secondary tier (a tier's own 'backpressure' wins)",
    "store_threshold": "refused by vLLM's tiering when >= 2 (a CPU-spec-only filter)",
    "tier_poll_interval_s": "vLLM >= 0.33: seconds between polls of the secondary tiers by a background thread",
}
# Ours.
OUR_TIERING_KEYS = {
    "num_ctas": "programs per transfer launch: the SMs a transfer takes from the model",
    "transfer_path": "'auto' (per call, the faster of the kernel and the copy engines), 'kernel' or 'dma'",
    "numa_node": "'auto' (each worker's slots on its GPU's node), a node number, or 'off'",
    "integrity": "'off', 'verify' or 'require': checksums in a trailer of each worker slot (docs/integrity.md)",
    "host_layout": "'worker_slots' (vLLM's bytes, shared with its own worker) or 'packed' (a row per key sized for "
    "the largest KV-cache group, ours on both ends)",
    "config_fingerprint": "'auto' (the configuration's fingerprint in the tiers' namespace and block identities), "
    "'off' (vLLM's namespace alone) or a label shared by configurations whose KV is the same",
    "host_format": "'native' (the cache's own bytes) or 'fp8_e4m3' (bf16 / fp16 caches as FP8 rows, about half the "
    "bytes in every tier; with host_layout = 'packed')",
}
HOST_LAYOUTS = ("worker_slots", "packed")
# Keys of TritonOffloadingSpec that cannot apply to vLLM's shared region, with the reason given when they are set.
_REFUSED_KEYS = {
    "huge_pages": (
        "the region is vLLM's /dev/shm file (tmpfs), mapped by name by the scheduler and every worker: reserved huge "
        "pages would need hugetlbfs, and its transparent huge pages follow "
        "/sys/kernel/mm/transparent_hugepage/shmem_enabled. Remove the key (or use TritonOffloadingSpec)"
    ),
    "pinning": (
        "the region must be registered (cudaHostRegister): memory pinned at allocation (cudaHostAlloc) cannot be "
        "shared with the scheduler's secondary tiers. Remove the key (or use TritonOffloadingSpec, whose pinning = "
        "'auto' falls back to cudaHostAlloc)"
    ),
}
# Passed by SecondaryTierFactory itself, never from the tier's configuration.
_FACTORY_ARGS = frozenset({"self", "offloading_spec", "primary_kv_view", "tier_type", "backpressure_detector"})
# Popped from a tier's configuration by SecondaryTierFactory before the rest reaches the tier's constructor.
_TIER_META_KEYS = frozenset({"type", "module_path", "backpressure"})


def _check_backpressure(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} = {value!r} must be a dict, e.g. {{'backpressure_cls': 'EMABackpressureDetector'}}")
    return dict(value)


def _check_tier(i: int, tier: Any, default_backpressure: dict | None) -> tuple[str, str | None, ObjectStore | None]:
    """Checks one ``secondary_tiers`` entry the way vLLM will use it; returns its type, for a file-system tier its
    ``root_dir``, and for an object-store tier the store to check at startup."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    if not isinstance(tier, Mapping):
        raise ValueError(f"{where(i)} = {tier!r} must be a dict with a 'type' key (e.g. {{'type': 'fs', ...}})")
    tier_type = tier.get("type")
    if not isinstance(tier_type, str) or not tier_type:
        raise ValueError(f"{where(i, 'type')} is missing or not a string; supported types: {_tier_types()}")
    try:
        tier_cls = SecondaryTierFactory.get_tier_class(dict(tier))
    except (ValueError, ImportError, AttributeError) as e:
        raise ValueError(f"{where(i, 'type')} = {tier_type!r} is not a usable secondary tier: {e}") from e
    params = inspect.signature(tier_cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    # In the constructor's order: the p2p check lists them as vLLM's signature does.
    named = tuple(
        n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n not in _FACTORY_ARGS
    )
    required = sorted(n for n in named if params[n].default is inspect.Parameter.empty)
    given = set(tier) - _TIER_META_KEYS
    missing = [n for n in required if n not in given]
    if missing:
        slips = {k: did_you_mean(k, missing) for k in given.difference(named)}
        found = [f"found {k!r}: a misspelling of {m!r}?" for k, m in sorted(slips.items()) if m is not None]
        raise ValueError(
            f"{where(i)} (type {tier_type!r}) needs {', '.join(repr(m) for m in missing)}"
            + (": the directory shared by every instance that reads these blocks" if missing == ["root_dir"] else "")
            + (f" ({'; '.join(found)})" if found else "")
        )
    unknown = sorted(given.difference(named))
    if unknown and not takes_any:
        raise ValueError(
            f"{where(i)} (type {tier_type!r}) has unknown key(s) {describe_unknown(unknown, named)}; it accepts "
            f"{sorted(named)} plus 'backpressure' and 'module_path'"
        )
    # vLLM merges the top-level default under the tier's own settings, then requires a detector class.
    own = _check_backpressure(tier.get("backpressure"), where(i, "backpressure"))
    merged = {**(default_backpressure or {}), **own}
    store = check_network_tier(i, tier_type, tier_cls, tier, backpressure=merged, ignored=unknown, accepted=named)
    if (merged or "backpressure" in tier) and "backpressure_cls" not in merged:
        raise ValueError(
            f"{where(i, 'backpressure')} (merged with the top-level 'backpressure') needs 'backpressure_cls', "
            "e.g. 'EMABackpressureDetector'"
        )
    root_dir = None
    if issubclass(tier_cls, FileSystemTierManager):
        root_dir = check_root_dir(tier["root_dir"], where(i, "root_dir"))
    return tier_type, root_dir, store


def _check_host_format(extra: Mapping[str, Any], layout: str, path: str | None) -> str:
    """``host_format``, refused where the rows cannot hold it: FP8 rows are ours (``host_layout = "packed"``; vLLM's
    worker slots hold the cache's own bytes), and not with the copy engines (``transfer_path = "dma"``)."""
    host_format = host_format_setting(extra.get("host_format", "native"))
    if host_format == "native":
        return host_format
    if layout != "packed":
        raise ValueError(
            f"host_format = {host_format!r} needs host_layout = 'packed' with {TIERING_SPEC_NAME}: vLLM's worker "
            "slots (host_layout = 'worker_slots', the default) hold the cache's own bytes. Set both"
        )
    if path == "dma":
        raise ValueError(
            f"host_format = {host_format!r} does not work with transfer_path = 'dma' (the copy engines cannot "
            f"quantize) in {TIERING_SPEC_NAME}"
        )
    return host_format


def _tier_types() -> list[str]:
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    return sorted(SecondaryTierFactory._registry)


@dataclass(frozen=True)
class TritonTieringConfig:
    """What ``TritonTieringOffloadingSpec`` checks and reads from ``kv_connector_extra_config``.

    Attributes:
        cpu_bytes_to_use: the CPU primary tier for the whole instance, in bytes.
        eviction_policy: the primary tier's eviction policy name.
        secondary_tiers: the type of each secondary tier, in order.
        num_ctas: programs per transfer launch; None for the kernel's default.
        root_dirs: ``(index in secondary_tiers, root_dir)`` of each file-system (``fs``) tier.
        transfer_path: ``"auto"``, ``"kernel"`` or ``"dma"``; None for the engine's default.
        object_stores: the object stores of the ``obj`` tiers, checked for reachability at startup.
        numa_node: ``"auto"``, a node number or ``"off"``: where each worker's slots of the region are placed.
        integrity: ``"off"``, ``"verify"`` or ``"require"`` (docs/integrity.md).
        host_layout: ``"worker_slots"`` (vLLM's, byte-compatible with its own worker and every instance running it)
            or ``"packed"`` (our packed rows, sized for the largest KV-cache group: see docs/tiering.md).
        config_fingerprint: ``"auto"``, ``"off"`` or a label (:func:`~triton_offload.connector.fingerprint.
            fingerprint_setting`).
        host_format: ``"native"`` or ``"fp8_e4m3"`` (packed rows only): what the rows every tier carries hold.
    """

    cpu_bytes_to_use: int
    eviction_policy: str = "lru"
    secondary_tiers: tuple[str, ...] = ()
    num_ctas: int | None = None
    root_dirs: tuple[tuple[int, str], ...] = ()
    transfer_path: str | None = None
    object_stores: tuple[ObjectStore, ...] = ()
    numa_node: str | int = "auto"
    integrity: str = OFF
    host_layout: str = "worker_slots"
    config_fingerprint: str = AUTO
    host_format: str = "native"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> TritonTieringConfig:
        """Checks every key before anything is allocated.

        Raises:
            ValueError: naming the key: a missing or bad ``cpu_bytes_to_use``; a ``secondary_tiers`` that is not a
                list of dicts; a tier whose ``type`` vLLM does not know, that lacks a key its constructor requires
                (``root_dir`` for ``fs``) or has one it does not take; an ``fs`` ``root_dir`` that cannot be a
                directory (a file, or a path through one); a ``backpressure`` without ``backpressure_cls``; an
                unknown ``eviction_policy``; ``store_threshold >= 2``; ``canonical_layout``; a bad ``num_ctas`` or
                ``transfer_path``; a ``p2p`` or ``obj`` tier's own mistakes (``network_tiers.check_network_tier``);
                a bad ``numa_node`` or ``config_fingerprint``; a ``host_format`` the rows cannot hold
                (:func:`_check_host_format`); ``huge_pages`` or ``pinning`` (they cannot apply to the shared region);
                a key this spec does not read (``config.check_keys``: unless ``"unknown_keys": "warn"``).
        """
        # TritonOffloadingSpec's keys that cannot apply here are known: they are refused below with the reason.
        check_keys(extra, set(TIERING_KEYS) | set(OUR_TIERING_KEYS) | set(_REFUSED_KEYS) | VLLM_KEYS, TIERING_SPEC_NAME)
        if extra.get("cpu_bytes_to_use") is None:
            raise ValueError(
                missing_key(
                    "cpu_bytes_to_use",
                    extra,
                    "the CPU primary tier for the whole instance, in bytes or as a string such as '40GiB'",
                )
            )
        cpu_bytes = parse_size(extra["cpu_bytes_to_use"], "cpu_bytes_to_use")
        if extra.get("canonical_layout"):
            raise ValueError(
                f"canonical_layout = {extra['canonical_layout']!r} is not supported by {TIERING_SPEC_NAME}: the Triton "
                "worker writes vLLM's direct worker-slot layout only. Remove the key (or use vLLM's own "
                "TieringOffloadingSpec, CUDA only)"
            )
        num_ctas, path = engine_settings(extra)
        numa_node = numa_setting(extra.get("numa_node", "auto"))
        checks = integrity_setting(extra.get("integrity", OFF))
        fingerprint = fingerprint_setting(extra.get("config_fingerprint", AUTO))
        layout = extra.get("host_layout", "worker_slots")
        if layout not in HOST_LAYOUTS:
            raise ValueError(
                f"host_layout = {layout!r} is not supported; accepted: {', '.join(map(repr, HOST_LAYOUTS))} "
                "(docs/tiering.md, 'Hybrid models')"
            )
        host_format = _check_host_format(extra, layout, path)
        for key, why in _REFUSED_KEYS.items():
            if key in extra:
                raise ValueError(f"{key} = {extra[key]!r} is not supported by {TIERING_SPEC_NAME}: {why}")
        threshold = extra.get("store_threshold", 0)
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold >= 2:
            raise ValueError(
                f"store_threshold = {threshold!r} is not supported by vLLM's tiering (only the CPU spec filters stores)"
            )
        policy = extra.get("eviction_policy", "lru")
        from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

        try:
            CachePolicyFactory.get_cache_policy_cls(policy, extra.get("cache_policy_module_path"))
        except (ValueError, ImportError, AttributeError, TypeError) as e:
            raise ValueError(f"eviction_policy = {policy!r} is not usable: {e}") from e
        tiers = extra.get("secondary_tiers", [])
        if not isinstance(tiers, list):
            raise ValueError(
                f"kv_connector_extra_config['secondary_tiers'] = {tiers!r} must be a list of tier dicts, e.g. "
                "[{'type': 'fs', 'root_dir': '/mnt/shared/kv'}]"
            )
        default_bp = _check_backpressure(extra.get("backpressure"), "kv_connector_extra_config['backpressure']")
        checked = [_check_tier(i, tier, default_bp) for i, tier in enumerate(tiers)]
        root_dirs = tuple((i, root) for i, (_, root, _) in enumerate(checked) if root is not None)
        types, stores = tuple(t for t, _, _ in checked), tuple(s for _, _, s in checked if s is not None)
        ours = (numa_node, checks, layout, fingerprint, host_format)
        return cls(cpu_bytes, policy, types, num_ctas, root_dirs, path, stores, *ours)
