"""What the specs check about the vLLM they run in, at construction (and :mod:`.preflight` before the model loads):
our specs under ``MultiConnector`` need vLLM >= 0.33; and, for a failed host-memory check in a worker, how much host
memory vLLM's own KV cache took already. Below both the specs and the preflight, which imports them.
"""

from __future__ import annotations

__all__ = ["MULTI_CONNECTOR_MIN_VLLM", "check_multi_connector", "host_memory_note"]

GiB = 2**30
# The first vLLM whose offloading scheduler records every block allocation (vLLM #46951): before it, our spec under
# MultiConnector can store KV another connector is already writing over.
MULTI_CONNECTOR_MIN_VLLM = (0, 33)


def _release(version: str) -> tuple[int, ...]:
    """``(major, minor, ...)`` of a version string such as ``0.33.0``, ``0.32.0+cpu`` or ``0.33.1rc1.dev5``."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release
    except InvalidVersion:
        return tuple(int(p) for p in version.split(".")[:2] if p.isdigit())


def check_multi_connector(kv_connector: str | None, version: str | None = None) -> None:
    """Refuses our specs under ``MultiConnector`` on a vLLM older than 0.33.

    vLLM 0.32's offloading scheduler returns from ``update_state_after_alloc`` before recording a request's new
    blocks when the offloading connector has no hit for it (``num_external_tokens == 0``), and records only scheduled
    requests' blocks elsewhere. Under ``MultiConnector`` a request that waits for another connector's KV (not
    scheduled) can then be given a block whose store is still pending: the store is not flushed, the other
    connector writes the block while the store reads it, and the host block holds a mix of two requests' KV, loaded
    later as a hit. vLLM 0.33 records the allocation whatever the hit (vLLM #46951).

    Args:
        kv_connector: the configured ``kv_connector`` (only ``"MultiConnector"`` is checked).
        version: vLLM's version; None: the installed one.

    Raises:
        ValueError: ``MultiConnector`` on vLLM < 0.33, naming the version, the defect and the fix.
    """
    if kv_connector != "MultiConnector":
        return
    if version is None:
        import vllm

        version = vllm.__version__
    if _release(version)[:2] >= MULTI_CONNECTOR_MIN_VLLM:
        return
    raise ValueError(
        f"triton-offload under MultiConnector needs vLLM >= 0.33; this is vLLM {version}, whose offloading scheduler "
        "does not record a request's blocks when the offloading connector has no hit for it, so another connector "
        "can write a block whose store is still reading it and the host cache keeps the mix as a hit (vLLM #46951, "
        "fixed in vLLM 0.33). Upgrade vLLM to 0.33 or later, or use OffloadingConnector alone (kv_connector = "
        "'OffloadingConnector')"
    )


def host_memory_note(kv_caches) -> str:
    """For a failed host-memory check in a worker: how much host memory vLLM's own KV cache took already, and which
    flag sets it ("" where the KV cache is in device memory). ``kv_caches``: vLLM's ``CanonicalKVCaches``."""
    tensors = [t.tensor for t in kv_caches.tensors]
    if not tensors or tensors[0].device.type != "cpu":
        return ""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    taken = sum(storages.values())
    return (
        f". vLLM's own KV cache took {taken} bytes ({taken / GiB:.2f} GiB) of host memory in this process: on "
        "vLLM's CPU build it is set by --kv-cache-memory-bytes (or VLLM_CPU_KVCACHE_SPACE, in GiB); without either, "
        "vLLM reserves --gpu-memory-utilization (default 0.92) of MemTotal for itself and its KV cache takes what "
        "the model leaves"
    )
