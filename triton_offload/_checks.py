"""Argument checks shared by every layer, the scheduler's pure-Python side included (stdlib only)."""

from __future__ import annotations

import re
from numbers import Integral

__all__ = [
    "positive_int",
    "positive_int_setting",
    "int_in_range",
    "TRANSFER_PATHS",
    "AUTO",
    "KERNEL",
    "DMA",
    "transfer_path",
    "LAUNCH_SHAPES",
    "launch_shape",
    "HOST_FORMATS",
    "FORMAT_VERSIONS",
    "host_format_setting",
]

_DIGITS = re.compile(r"\s*[0-9]+\s*")
# How a transfer may move: chosen per call (triton_offload/path_choice.py), or a path of triton_offload/issuers/
# (the Triton kernel, the copy engines).
TRANSFER_PATHS = ("auto", "kernel", "dma")
AUTO, KERNEL, DMA = TRANSFER_PATHS
# How a kernel launch picks its programs (triton_offload/kernels/copy_blocks.py explains both).
LAUNCH_SHAPES = ("fixed", "size-aware")
# What a packed host row holds (triton_offload/host_format.py): the caches' own bytes, or FP8 values and scales.
HOST_FORMATS = ("native", "fp8_e4m3")
# Each format's version, in the configuration fingerprint (connector/fingerprint.py): bump it when its bytes change.
FORMAT_VERSIONS = {"native": 1, "fp8_e4m3": 1}


def host_format_setting(value, name: str = "host_format") -> str:
    """``value`` if it names a host format; a ``ValueError`` naming ``name`` and the formats otherwise."""
    if value not in HOST_FORMATS:
        raise ValueError(f"unknown {name} {value!r}; supported: {list(HOST_FORMATS)}")
    return value


def positive_int(value, name: str) -> int:
    """``value`` as an int >= 1; a ``ValueError`` naming ``name`` and the value otherwise (bools and floats too).

    For counts and sizes read from configuration, where any wrong value is the same mistake.
    """
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{name} = {value!r} must be a positive int")
    return int(value)


def positive_int_setting(value, name: str) -> int:
    """A configuration value as an int >= 1: an int, or an int written as a string of digits (``"4"``), the way vLLM
    reads its own ``block_size`` (JSON on a command line often quotes numbers). A ``ValueError`` naming ``name`` and
    the value as given otherwise (bools, floats and other strings too)."""
    number = int(value) if isinstance(value, str) and _DIGITS.fullmatch(value) else value
    if isinstance(number, bool) or not isinstance(number, Integral) or number < 1:
        raise ValueError(f"{name} = {value!r} must be a positive int (or one written as a string of digits, e.g. '4')")
    return int(number)


def int_in_range(value, name: str, low: int, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high)`` (no upper bound when ``high`` is None).

    For the public transfer API, where a wrong type and a wrong value are different bugs.

    Raises:
        TypeError: not an integer (bools included).
        ValueError: out of range; the message names the value and the bounds.
    """
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value >= high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{name} = {value} must be {bounds}")
    return int(value)


def transfer_path(value, name: str = "path", choices: tuple[str, ...] = TRANSFER_PATHS) -> str:
    """``value`` if it is one of ``choices`` (default :data:`TRANSFER_PATHS`; an engine's are ``auto`` and its
    issuers' paths); else a ``ValueError`` naming ``name`` and listing them."""
    return _one_of(value, name, choices)


def launch_shape(value, name: str = "launch_shape") -> str:
    """``value`` if it is one of :data:`LAUNCH_SHAPES`; else a ``ValueError`` naming ``name`` and listing them."""
    return _one_of(value, name, LAUNCH_SHAPES)


def _one_of(value, name: str, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``; else a ``ValueError`` naming ``name`` and listing them."""
    if value not in choices:
        raise ValueError(f"{name} = {value!r} must be one of {', '.join(repr(str(c)) for c in choices)}")
    return value


# The integrity checks' setting (docs/integrity.md; triton_offload/integrity.py is the rest of them).
OFF, VERIFY, REQUIRE = "off", "verify", "require"
INTEGRITY_SETTINGS = {
    OFF: "no checksum is computed, stored or checked (the kernel of earlier versions, byte for byte)",
    VERIFY: "stores write a checksum beside each block; loads check it where one is present and load blocks "
    "stored without one unchecked",
    REQUIRE: "as verify, but a block stored without a checksum is a failed load",
}


def integrity_setting(value, name: str = "integrity") -> str:
    """The ``integrity`` setting checked: one of :data:`INTEGRITY_SETTINGS` (case-insensitive).

    Raises:
        ValueError: anything else, naming the value and listing the choices.
    """
    if isinstance(value, str) and value.lower() in INTEGRITY_SETTINGS:
        return value.lower()
    raise ValueError(f"{name} = {value!r} is not one of {sorted(INTEGRITY_SETTINGS)}")
