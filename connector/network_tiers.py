"""What vLLM's network tiers need, checked before anything is built (:func:`check_network_tier`): ``p2p`` (peers over
NIXL + ZMQ) and ``obj`` (an S3 object store through NIXL), out-of-tree subclasses of either included; and, at startup,
whether each object store answers at all (:func:`check_reachable`). vLLM reports these late or not at all: its p2p tier
takes ``**kwargs`` and ignores keys it does not know (a misspelt ``prot`` silently binds the default port 5710); its obj
tier hands ``store_config`` to a dataclass (a misspelt key is a bare ``TypeError``); without NIXL the p2p tier fails at
its first peer and the obj tier with ``'NoneType' object is not callable``; an unreachable object store costs about 25 s
of retries in its startup probe, whose error does not name the endpoint; and vLLM 0.32's obj tier dies at its first
finished transfer (see :mod:`.obj_tier`).
"""

from __future__ import annotations

import logging
import socket
import sys
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from numbers import Integral, Real
from typing import Any

from triton_offload._checks import positive_int
from triton_offload.connector.config import describe_unknown

__all__ = ["NIXL_INSTALL", "ObjectStore", "check_network_tier", "check_reachable", "where"]

logger = logging.getLogger(__name__)

NIXL_INSTALL = "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1"
# Bound on the TCP connect that checks an object store at startup.
REACH_TIMEOUT_S = 5.0
_P2P = ("vllm.v1.kv_offload.tiering.p2p.manager", "P2PSecondaryTierManager")
_OBJ = ("vllm.v1.kv_offload.tiering.obj.manager", "ObjectStoreSecondaryTierManager")
_SCHEMES = ("http", "https")


def where(i: int, key: str | None = None) -> str:
    """How a message names ``secondary_tiers[i]`` (and one of its keys)."""
    return f"kv_connector_extra_config['secondary_tiers'][{i}]" + (f"[{key!r}]" if key else "")


@dataclass(frozen=True)
class ObjectStore:
    """An object store a tier will use, as its startup check sees it.

    Attributes:
        where: the tier, as messages name it.
        url: ``scheme://endpoint_override``.
        host, port: what the check connects to (the scheme's port when the endpoint has none).
        store_config: the tier's ``store_config`` items (credentials included: never printed), for the request that
            checks them (:mod:`~triton_offload.connector.s3_probe`); empty: a TCP connect only.
    """

    where: str
    url: str
    host: str
    port: int
    store_config: tuple[tuple[str, str], ...] = field(default=(), repr=False, compare=False)


def _subclass_of(tier_cls: type, base: tuple[str, str]) -> bool:
    # The tier class is imported already, and with it the module of any vLLM class it derives from: no import here.
    module = sys.modules.get(base[0])
    cls = getattr(module, base[1], None)
    return cls is not None and issubclass(tier_cls, cls)


def check_network_tier(
    i: int,
    tier_type: str,
    tier_cls: type,
    tier: Mapping[str, Any],
    *,
    backpressure: dict,
    ignored: list[str],
    accepted: tuple[str, ...],
) -> ObjectStore | None:
    """Checks a ``p2p`` or ``obj`` tier's own keys (any other tier: nothing to do).

    Args:
        i: the tier's index in ``secondary_tiers``.
        tier_type, tier_cls, tier: its ``type``, the class vLLM resolves it to, its configuration.
        backpressure: its backpressure settings merged with the top-level ones, as vLLM merges them.
        ignored: its keys that no named parameter of the tier's constructor takes.
        accepted: the keys those named parameters take, in the constructor's order (the p2p tier takes
            ``**kwargs`` besides and ignores anything else).

    Returns:
        For an object-store tier, the store its startup check connects to; else None.

    Raises:
        ValueError: naming the key: NIXL missing; for p2p, a key vLLM would ignore, a bad ``host``, ``port``,
            ``backends``, ``num_threads`` or ``unbound_store_timeout_s``, or any backpressure (vLLM refuses it for
            p2p); for obj, a ``store_config`` that is not a dict of vLLM's ``ObjStoreConfig`` fields with a
            ``bucket`` and an ``endpoint_override``, a ``scheme`` other than http/https, a bad ``io_threads``, or
            vLLM's own class on vLLM < 0.33.
    """
    if _subclass_of(tier_cls, _P2P):
        _require_nixl(i, tier_type)
        _check_p2p(i, tier_type, tier, backpressure, ignored, accepted)
    elif _subclass_of(tier_cls, _OBJ):
        _require_nixl(i, tier_type)
        return _check_obj(i, tier_type, tier_cls, tier)
    return None


def _nixl_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("nixl") is not None


def _require_nixl(i: int, tier_type: str) -> None:
    if not _nixl_installed():
        raise ValueError(f"{where(i)} (type {tier_type!r}) needs NIXL, which is not installed: {NIXL_INSTALL}")


def _positive_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and value > 0


def _check_p2p(
    i: int, tier_type: str, tier: Mapping[str, Any], backpressure: dict, ignored: list[str], accepted: tuple[str, ...]
) -> None:
    if ignored:
        raise ValueError(
            f"{where(i)} (type {tier_type!r}) has unknown key(s) {describe_unknown(ignored, accepted)} (vLLM's p2p "
            f"tier would ignore them silently); it accepts {list(accepted)}"
        )
    if backpressure or "backpressure" in tier:
        raise ValueError(
            f"{where(i, 'backpressure')}: vLLM's p2p tier takes no backpressure (a dropped store would leave the "
            "peer waiting for its load timeout). A top-level 'backpressure' applies to every tier: set it on the "
            "other tiers' own entries instead"
        )
    host = tier.get("host")
    if host is not None and (not isinstance(host, str) or not host or any(c.isspace() for c in host)):
        raise ValueError(
            f"{where(i, 'host')} = {host!r} must be the address this instance binds and peers dial, e.g. '10.0.0.5'"
        )
    port = tier.get("port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, Integral) or not 0 < port < 65536):
        raise ValueError(f"{where(i, 'port')} = {port!r} must be a TCP port, an int in [1, 65535]")
    backends = tier.get("backends")
    if backends is not None and (
        not isinstance(backends, list) or not backends or not all(isinstance(b, str) and b for b in backends)
    ):
        raise ValueError(f"{where(i, 'backends')} = {backends!r} must be a list of NIXL backend names, e.g. ['UCX']")
    if tier.get("num_threads") is not None:
        positive_int(tier["num_threads"], where(i, "num_threads"))
    pause = tier.get("progress_pause_us")  # P2PTier's (p2p_tier.py); vLLM's own tier has no such key
    if pause is not None and (isinstance(pause, bool) or not isinstance(pause, Integral) or pause < 0):
        raise ValueError(
            f"{where(i, 'progress_pause_us')} = {pause!r} must be an int >= 0: microseconds NIXL's progress thread "
            "pauses between idle polls (0: no pause)"
        )
    timeout = tier.get("unbound_store_timeout_s")
    if timeout is not None and not _positive_number(timeout):
        raise ValueError(f"{where(i, 'unbound_store_timeout_s')} = {timeout!r} must be a positive number of seconds")


def _check_obj(i: int, tier_type: str, tier_cls: type, tier: Mapping[str, Any]) -> ObjectStore:
    from vllm.v1.kv_offload.tiering.obj.config import ObjStoreConfig

    _refuse_vllm032_obj(i, tier_type, tier_cls)
    store = tier["store_config"]  # present: the generic check requires the constructor's required keys
    accepted = [f.name for f in fields(ObjStoreConfig)]
    if not isinstance(store, Mapping):
        raise ValueError(
            f"{where(i, 'store_config')} = {store!r} must be a dict with 'bucket' and 'endpoint_override' (and any "
            f"of {accepted})"
        )
    unknown = sorted(set(store) - set(accepted))
    if unknown:
        raise ValueError(
            f"{where(i, 'store_config')} has unknown key(s) {describe_unknown(unknown, accepted)}; it accepts "
            f"{accepted}"
        )
    for key in ("bucket", "endpoint_override"):
        if not isinstance(store.get(key), str) or not store[key]:
            raise ValueError(
                f"{where(i, 'store_config')}[{key!r}] = {store.get(key)!r} must be a non-empty string"
                + (" such as 's3.example.com' or '10.0.0.7:9000'" if key == "endpoint_override" else "")
            )
    wrong = [key for key, value in store.items() if not isinstance(value, str)]
    if wrong:
        raise ValueError(f"{where(i, 'store_config')}: {wrong} must be strings")
    scheme = store.get("scheme", "http")
    if scheme not in _SCHEMES:
        raise ValueError(f"{where(i, 'store_config')}['scheme'] = {scheme!r} must be one of {list(_SCHEMES)}")
    if tier.get("io_threads") is not None:
        positive_int(tier["io_threads"], where(i, "io_threads"))
    endpoint = store["endpoint_override"]
    url = endpoint if "://" in endpoint else f"{scheme}://{endpoint}"
    try:
        parts = urllib.parse.urlsplit(url)
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:  # a bad port
        raise ValueError(
            f"{where(i, 'store_config')}['endpoint_override'] = {endpoint!r} is not host[:port]: {e}"
        ) from e
    if not host:
        raise ValueError(f"{where(i, 'store_config')}['endpoint_override'] = {endpoint!r} has no host")
    return ObjectStore(where(i), url, host, port, tuple(sorted(store.items())))


def _refuse_vllm032_obj(i: int, tier_type: str, tier_cls: type) -> None:
    import vllm
    from packaging.version import Version

    if tier_cls.__module__ == _OBJ[0] and Version(vllm.__version__).release < (0, 33):
        raise ValueError(
            f"{where(i, 'type')} = {tier_type!r}: vLLM {vllm.__version__}'s obj tier stops the engine at its first "
            "finished transfer (it builds its NIXL agent without capture_telemetry: NIXL_ERR_NO_TELEMETRY). Use "
            "{'type': 'ObjectStoreTier', 'module_path': 'triton_offload.connector.obj_tier', ...} with the same keys "
            "(vLLM 0.33's behaviour and object names), or vLLM >= 0.33"
        )


def check_reachable(stores: tuple[ObjectStore, ...], timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Connects to each object store once (TCP, at most ``timeout_s`` each) before vLLM builds its tier, then asks it
    for a missing object with the tier's credentials (:func:`~triton_offload.connector.s3_probe.probe_store`: a
    warning when the tier has none).

    A store reached through a proxy (``https_proxy`` / ``http_proxy`` apply to it) is left to vLLM's own probe.

    Raises:
        ConnectionError: naming the tier, the endpoint and the OS error.
        PermissionError: the store refuses the tier's credentials (HTTP 403), naming the endpoint and the key id.
        ValueError: the bucket does not exist, or the store refuses the request otherwise.
    """
    from triton_offload.connector.s3_probe import probe_store

    proxies = urllib.request.getproxies()
    for store in stores:
        scheme = urllib.parse.urlsplit(store.url).scheme
        if proxies.get(scheme) and not urllib.request.proxy_bypass(store.host):
            logger.info("%s: %s is reached through a proxy; its reachability is left to vLLM", store.where, store.url)
            continue
        try:
            socket.create_connection((store.host, store.port), timeout=timeout_s).close()
        except OSError as e:
            raise ConnectionError(
                f"{store.where}: the object store {store.url} is unreachable from this host ({e}; a TCP connect to "
                f"{store.host}:{store.port} with a {timeout_s:g} s timeout). Check store_config's endpoint_override "
                "and scheme, and that the store listens there"
            ) from e
        if store.store_config:
            probe_store(store.where, store.url, dict(store.store_config))
