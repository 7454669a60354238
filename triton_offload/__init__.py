"""triton-offload: KV-cache offloading for LLM serving on Triton kernels. One launch moves any number of
non-contiguous GPU KV blocks, all layers at once, into a packed pinned host buffer (:func:`gather_blocks`) or back
(:func:`scatter_blocks`). The top level is lazy: ``import triton_offload.manager`` (or ``.policies``), which the
serving scheduler's process does, imports neither torch nor Triton; the names below are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "Layout": "triton_offload.layouts",
    "KVCacheSpec": "triton_offload.layouts",
    "prepare_kv": "triton_offload.layouts",
    "Direction": "triton_offload.plan",
    "gather_blocks": "triton_offload.transfer",
    "scatter_blocks": "triton_offload.transfer",
    "host_block_bytes": "triton_offload.transfer",
    "plan_transfer": "triton_offload.transfer",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from triton_offload.layouts import KVCacheSpec, Layout, prepare_kv  # noqa: F401
    from triton_offload.plan import Direction  # noqa: F401
    from triton_offload.transfer import (  # noqa: F401
        gather_blocks,
        host_block_bytes,
        plan_transfer,
        scatter_blocks,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
