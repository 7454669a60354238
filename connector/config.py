"""The plugin's configuration: ``kv_connector_extra_config`` parsed once into a frozen dataclass
(:class:`TritonOffloadConfig`), in plain Python with no vLLM import, so it can be tested and reused without vLLM
installed. Keys are checked as vLLM checks its own configuration (:func:`check_keys`): an unknown key is an error
(vLLM's config classes forbid extra fields, and an unknown engine argument stops ``vllm serve``), with a "did you mean"
from the keys the spec reads; ``"unknown_keys": "warn"`` turns that into a warning, for keys a newer vLLM may add.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from triton_offload._checks import (
    OFF,
    REQUIRE,
    host_format_setting,
    integrity_setting,
    positive_int,
    positive_int_setting,
    transfer_path,
)
from triton_offload.connector import SPEC_NAME
from triton_offload.host.numa import numa_setting
from triton_offload.host.pages import check_settings, huge_pages_setting, pinning_setting
from triton_offload.policies import POLICIES, policy_name

__all__ = [
    "TritonOffloadConfig",
    "parse_size",
    "engine_settings",
    "check_keys",
    "missing_key",
    "did_you_mean",
    "describe_unknown",
    "OUR_KEYS",
    "VLLM_KEYS",
    "UNKNOWN_KEYS",
]

logger = logging.getLogger(__name__)

# Decimal units are powers of 1000 and binary ones powers of 1024, as everywhere else ("1.5GB" is 1.5e9 bytes).
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")
_UNIT_NAMES = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"

# Keys this spec reads.
OUR_KEYS = frozenset(
    {
        "cpu_bytes_to_use",
        "eviction_policy",
        "num_ctas",
        "transfer_path",
        "numa_node",
        "huge_pages",
        "pinning",
        "integrity",
        "host_regions",
        "host_format",
    }
)
# How a host row is shared by the KV-cache groups (connector/geometry.py, docs/vllm.md "Hybrid models").
HOST_REGION_MODES = ("auto", "per_group", "shared")
# Keys vLLM's OffloadingConnector reads itself, whatever the spec (block_size becomes blocks_per_chunk).
VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "offload_prompt_only",
        "self_describing_kv_events",
        "canonical_layout",
        "sync_load_budget_bytes",
    }
)
# What to do with a key the spec does not read: "error" (the default, as vLLM does with unknown config fields) or
# "warn" (logged and ignored: for keys of a newer vLLM, or a configuration shared with vLLM's own specs).
UNKNOWN_KEYS = "unknown_keys"
_UNKNOWN_KEY_MODES = ("error", "warn")
# Keys of vLLM's own CPUOffloadingSpec that no spec of ours reads: named as such when they turn up.
_VLLM_CPU_SPEC_KEYS = frozenset({"store_threshold", "max_tracker_size"})


def did_you_mean(key: str, known: Iterable[str]) -> str | None:
    """The known key ``key`` is most likely a misspelling of (difflib's closest match), or None."""
    known = sorted(known)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.7)
    if close:
        return close[0]
    # A shortened name ("endpoint" for "endpoint_override") scores low on similarity but is as likely a slip.
    extended = [k for k in known if len(key) >= 4 and k.startswith(key)]
    return extended[0] if len(extended) == 1 else None


def describe_unknown(unknown: Iterable[str], known: Iterable[str]) -> str:
    """``'eviction_polcy' (did you mean 'eviction_policy'?), 'foo'``: unknown keys for a message, each with the known
    key it most likely misspells."""
    known = list(known)
    described = []
    for key in unknown:
        guess = did_you_mean(str(key), known)
        if guess is not None:
            described.append(f"{key!r} (did you mean {guess!r}?)")
        elif key in _VLLM_CPU_SPEC_KEYS:
            described.append(f"{key!r} (a key of vLLM's CPUOffloadingSpec)")
        else:
            described.append(repr(key))
    return ", ".join(described)


def check_keys(extra: Mapping[str, Any], known: Iterable[str], spec_name: str, where: str = "") -> None:
    """Refuses (or, with ``"unknown_keys": "warn"``, logs) the keys of ``extra`` outside ``known``.

    Args:
        extra: a ``kv_connector_extra_config`` (or one of its nested dicts).
        known: the keys the spec reads there (vLLM's connector's keys included).
        spec_name: the spec, as messages name it.
        where: how messages name ``extra`` (default: ``kv_connector_extra_config``).

    Raises:
        ValueError: an unknown key while ``unknown_keys`` is ``"error"`` (the default), naming each with its closest
            known key ("did you mean ...?") and listing the keys the spec reads; a bad ``unknown_keys``.
    """
    known = set(known) | {UNKNOWN_KEYS}
    mode = extra.get(UNKNOWN_KEYS, "error")
    if mode not in _UNKNOWN_KEY_MODES:
        raise ValueError(f"{UNKNOWN_KEYS} = {mode!r} must be one of {', '.join(map(repr, _UNKNOWN_KEY_MODES))}")
    unknown = sorted(set(extra) - known)
    if not unknown:
        return
    message = (
        f"{where or 'kv_connector_extra_config'} has key(s) {spec_name} does not read: "
        f"{describe_unknown(unknown, known)}. "
        f"It reads: {', '.join(sorted(known))}"
    )
    if mode == "error":
        raise ValueError(
            f'{message}. Fix the key, or set "{UNKNOWN_KEYS}": "warn" to run with it ignored (a warning names it)'
        )
    logger.warning("%s; ignored (%s = 'warn')", message, UNKNOWN_KEYS)


def missing_key(key: str, extra: Mapping[str, Any], what: str) -> str:
    """The message for a required ``key`` absent from ``extra``: ``what`` it is, and the present key that looks like
    a misspelling of it, if any."""
    close = [k for k in extra if isinstance(k, str) and did_you_mean(k, [key]) == key]
    hint = f" (found {close[0]!r}: a misspelling of {key!r}?)" if close else ""
    return f"kv_connector_extra_config needs {key!r}: {what}{hint}"


def engine_settings(extra: Mapping[str, Any]) -> tuple[int | None, str | None]:
    """``(num_ctas, transfer_path)`` of a ``kv_connector_extra_config``, checked (None where a key is absent, for the
    engine's default): the two keys both specs hand to the transfer engine.

    Raises:
        ValueError: naming the key, as :func:`~triton_offload._checks.positive_int_setting` and
            :func:`~triton_offload._checks.transfer_path` do.
    """
    num_ctas = extra.get("num_ctas")
    if num_ctas is not None:
        num_ctas = positive_int_setting(num_ctas, "num_ctas")
    path = extra.get("transfer_path")
    if path is not None:
        path = transfer_path(path, "transfer_path")
    return num_ctas, path


def parse_size(value: Any, key: str = "size") -> int:
    """Bytes from an int, a whole float, a digit string or a human-readable size (``"40GiB"``, ``"1.5GB"``).

    Raises:
        ValueError: anything else, a non-positive size, or a size that is not a whole number of bytes; the message
            names ``key`` and the accepted forms.
    """
    accepted = f"a positive number of bytes, or a string such as '40GiB' or '1.5GB' (units: {_UNIT_NAMES})"
    if isinstance(value, bool):
        raise ValueError(f"{key} = {value!r} is not a size; expected {accepted}")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, float):
        # JSON on a command line turns 4e10 into a float; accept it when it is a whole number of bytes.
        if not value.is_integer():
            raise ValueError(f"{key} = {value!r} is not a whole number of bytes; expected {accepted}")
        nbytes = int(value)
    elif isinstance(value, str):
        match = _SIZE.fullmatch(value)
        unit = match and _UNITS.get(match.group(2).lower())
        if unit is None:
            raise ValueError(f"{key} = {value!r} is not a size; expected {accepted}")
        try:
            exact = Decimal(match.group(1)) * unit
        except InvalidOperation:  # pragma: no cover - the pattern only admits decimal numbers
            raise ValueError(f"{key} = {value!r} is not a size; expected {accepted}") from None
        if exact != exact.to_integral_value():
            raise ValueError(f"{key} = {value!r} is {exact} bytes, not a whole number of bytes")
        nbytes = int(exact)
    else:
        raise ValueError(f"{key} = {value!r} ({type(value).__name__}) is not a size; expected {accepted}")
    if nbytes <= 0:
        raise ValueError(f"{key} = {value!r} must be positive; expected {accepted}")
    return nbytes


@dataclass(frozen=True)
class TritonOffloadConfig:
    """What ``TritonOffloadingSpec`` takes from ``kv_connector_extra_config``, validated.

    Attributes:
        cpu_bytes_to_use: host cache budget for the whole instance, split evenly across ranks (required).
        blocks_per_host_block: GPU blocks per host block (f), as vLLM derived it from ``block_size`` (or
            ``blocks_per_chunk``); 1 when neither is set.
        eviction_policy: ``"lru"`` or ``"arc"``.
        num_ctas: programs one transfer launch may occupy (the SMs taken from the model); None for the kernel's
            default.
        transfer_path: ``"auto"``, ``"kernel"`` or ``"dma"`` (triton_offload/path_choice.py); None for the engine's
            default (``"auto"`` on CUDA, ``"kernel"`` on CPU).
        numa_node: ``"auto"`` (each rank's cache on its GPU's node), a node number, or ``"off"``
            (triton_offload/host/numa.py, docs/host-memory.md).
        huge_pages: ``"thp"``, ``"2MiB"``, ``"1GiB"`` or ``"off"`` (triton_offload/host/pages.py).
        pinning: ``"auto"``, ``"register"`` or ``"alloc"`` (how a CUDA host cache is pinned).
        integrity: ``"off"``, ``"verify"`` or ``"require"``: the integrity checks (docs/integrity.md); either of the
            last two checks as ``"require"`` here (:attr:`checks`).
        host_regions: ``"auto"``, ``"per_group"`` or ``"shared"``: which KV-cache groups' keys share a region of
            the host rows (connector/geometry.py).
        host_format: ``"native"`` or ``"fp8_e4m3"``: what the host rows hold (triton_offload/host_format.py); the
            spec reads what FP8 needs from vLLM's specs (connector/typed_pages.py).
    """

    cpu_bytes_to_use: int
    blocks_per_host_block: int = 1
    eviction_policy: str = "lru"
    num_ctas: int | None = None
    transfer_path: str | None = None
    numa_node: str | int = "auto"
    huge_pages: str = "thp"
    pinning: str = "auto"
    integrity: str = OFF
    host_regions: str = "auto"
    host_format: str = "native"

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any], *, blocks_per_host_block: int, gpu_block_tokens: int | None = None
    ) -> TritonOffloadConfig:
        """Parses and checks the keys; an unknown key is an error, or a warning with ``"unknown_keys": "warn"``
        (:func:`check_keys`: a typo must not pass silently).

        Args:
            extra: ``kv_connector_extra_config`` as vLLM passes it to the spec.
            blocks_per_host_block: vLLM's ``blocks_per_chunk``, the block-size factor it derived.
            gpu_block_tokens: tokens per GPU block, to cross-check ``block_size``; None skips the check.

        Raises:
            ValueError: a missing ``cpu_bytes_to_use``, a bad value of any key (or ``huge_pages`` other than
                ``'thp'`` with ``pinning = 'alloc'``) or an unknown key, naming the key and what is accepted.
        """
        check_keys(extra, OUR_KEYS | VLLM_KEYS, SPEC_NAME)
        if extra.get("cpu_bytes_to_use") is None:
            raise ValueError(
                missing_key(
                    "cpu_bytes_to_use",
                    extra,
                    "the host cache budget for the whole instance, in bytes or as a string such as '40GiB'",
                )
            )
        cpu_bytes = parse_size(extra["cpu_bytes_to_use"], "cpu_bytes_to_use")
        policy = extra.get("eviction_policy", "lru")
        try:
            policy = policy_name(policy)
        except ValueError:
            raise ValueError(
                f"eviction_policy = {policy!r} is not supported; accepted: {', '.join(sorted(POLICIES))}"
            ) from None
        num_ctas, path = engine_settings(extra)
        numa_node = numa_setting(extra.get("numa_node", "auto"))
        huge_pages = huge_pages_setting(extra.get("huge_pages", "thp"))
        pinning = pinning_setting(extra.get("pinning", "auto"))
        check_settings(huge_pages, pinning)
        checks = integrity_setting(extra.get("integrity", OFF))
        regions = extra.get("host_regions", "auto")
        if regions not in HOST_REGION_MODES:
            raise ValueError(
                f"host_regions = {regions!r} is not supported; accepted: {', '.join(map(repr, HOST_REGION_MODES))} "
                "(how the KV-cache groups of a hybrid model share the host rows; docs/vllm.md)"
            )
        host_format = host_format_setting(extra.get("host_format", "native"))
        if host_format != "native" and path == "dma":  # before the model loads (preflight)
            raise ValueError(
                f"host_format = {host_format!r} does not work with transfer_path = 'dma' (the copy engines cannot "
                "quantize)"
            )
        f = positive_int(blocks_per_host_block, "blocks_per_chunk (the block-size factor vLLM passed)")
        block_size = extra.get("block_size")
        if block_size is not None:
            block_size = positive_int_setting(block_size, "block_size")
        if block_size is not None and gpu_block_tokens is not None and block_size != f * gpu_block_tokens:
            # vLLM derives f from block_size itself; a mismatch means the config was assembled inconsistently.
            raise ValueError(
                f"block_size = {block_size!r} tokens, but vLLM passed blocks_per_chunk = {f} for GPU blocks of "
                f"{gpu_block_tokens} tokens ({f * gpu_block_tokens} tokens per host block)"
            )
        return cls(cpu_bytes, f, policy, num_ctas, path, numa_node, huge_pages, pinning, checks, regions, host_format)

    @property
    def checks(self) -> str:
        """The setting the worker checks with: ``"require"`` whenever the checks are on. Within one process every row
        is stored by this spec's own worker, with its checksums: a row that has none was corrupted, never written by
        a writer without the checks, so ``"verify"`` would load it unchecked for no reason (docs/integrity.md)."""
        return OFF if self.integrity == OFF else REQUIRE
