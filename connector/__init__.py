"""The vLLM plugin (installed as ``triton_offload.connector``): ``TritonOffloadingSpec`` for vLLM's
``OffloadingConnector``, and ``TritonTieringOffloadingSpec``, vLLM's tiering (fs / obj / p2p secondary tiers) with our
worker as its GPU <-> CPU step (docs/tiering.md); ``TritonOffloadingConnector``, vLLM's connector reporting blocks that
fail their integrity check as load errors (docs/integrity.md). Use it with ``kv_connector_extra_config={"spec_name":
"TritonOffloadingSpec", "cpu_bytes_to_use": "8GiB", ...}``: the name resolves through :func:`register`, which vLLM calls
in each of its processes through the ``vllm.general_plugins`` entry point of this package, and ``"spec_module_path":
"triton_offload.connector"`` also works without the entry point. Importing this package does not import vLLM (the core
never needs it, and the configuration parser, :mod:`triton_offload.connector.config`, works without it); the spec
classes import vLLM when first used.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

__all__ = [
    "CONNECTOR_NAME",
    "SPEC_NAME",
    "TIERING_SPEC_NAME",
    "register",
    "route_logs_through_vllm",
    "TritonOffloadingSpec",
    "TritonTieringOffloadingSpec",
    "TritonOffloadingConnector",
]

SPEC_NAME = "TritonOffloadingSpec"
_SPEC_MODULE = "triton_offload.connector.spec"
TIERING_SPEC_NAME = "TritonTieringOffloadingSpec"
_TIERING_MODULE = "triton_offload.connector.tiering"
# Every spec this package registers: name -> module.
_SPECS = {SPEC_NAME: _SPEC_MODULE, TIERING_SPEC_NAME: _TIERING_MODULE}
# vLLM's OffloadingConnector reporting failed integrity checks as load errors (docs/integrity.md).
CONNECTOR_NAME = "TritonOffloadingConnector"
_CONNECTOR_MODULE = "triton_offload.connector.load_errors"
_LAZY = {**_SPECS, CONNECTOR_NAME: _CONNECTOR_MODULE}


def _require_vllm() -> None:
    try:
        import vllm.v1.kv_offload.base  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"{SPEC_NAME} needs vLLM >= 0.32 (the vllm.v1.kv_offload API): pip install 'triton-offload[vllm]' ({e})"
        ) from e


def route_logs_through_vllm() -> None:
    """Sends our package's log records to vLLM's handlers, at vLLM's level.

    vLLM configures only its own ``vllm`` logger, so without this our INFO lines (host cache size, counters) would be
    dropped inside vLLM's processes. Does nothing when vLLM's logging is off or ours is configured already.
    """
    ours, theirs = logging.getLogger("triton_offload"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


def register() -> None:
    """Registers ``TritonOffloadingSpec`` and ``TritonTieringOffloadingSpec`` with vLLM's ``OffloadingSpecFactory``;
    safe to call more than once.

    vLLM calls general plugins once per process, sometimes more than once, and ``register_spec`` refuses a name
    that is already taken, so an existing registration is left as it is. It makes vLLM keep the KV-cache groups'
    bytes for our specs where it builds their configuration (:mod:`~triton_offload.connector.geometry`). In the
    front-end process it also makes vLLM check our configuration as soon as it has built its own, before the model
    loads (:mod:`~triton_offload.connector.preflight`).
    """
    _require_vllm()
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    route_logs_through_vllm()
    # Every process that builds an offloading connector (the engine core, each worker): the spec needs the bytes of
    # each KV-cache group, which vLLM's config carries only where the connector builds it (connector/geometry.py).
    from triton_offload.connector import geometry

    geometry.install()
    if "vllm.engine.arg_utils" in sys.modules:
        # The front-end process (vLLM calls this from EngineArgs, which builds the engine's config there): check our
        # configuration once that config is built, before any engine process loads the model (preflight.py).
        from triton_offload.connector.preflight import install

        install()
    for name, module in _SPECS.items():
        if name in getattr(OffloadingSpecFactory, "_registry", {}):
            continue
        try:
            OffloadingSpecFactory.register_spec(name, module, name)
        except ValueError:  # registered meanwhile under the same name: nothing to do
            pass
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in getattr(KVConnectorFactory, "_registry", {}):
        try:
            KVConnectorFactory.register_connector(CONNECTOR_NAME, _CONNECTOR_MODULE, CONNECTOR_NAME)
        except ValueError:  # registered meanwhile
            pass


def __getattr__(name: str) -> Any:
    # Lazy, so that `import triton_offload.connector` works without vLLM while vLLM's factory can still resolve
    # getattr(module, "TritonOffloadingSpec") for spec_module_path="triton_offload.connector".
    if name in _LAZY:
        _require_vllm()
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
