"""The policies by name: :data:`POLICIES`, :func:`policy_name` and :func:`make_policy` (names are case-insensitive)."""

from __future__ import annotations

from collections.abc import Callable

from triton_offload.policies.arc import ARCPolicy
from triton_offload.policies.base import EvictionPolicy
from triton_offload.policies.lru import LRUPolicy

__all__ = ["POLICIES", "policy_name", "make_policy"]

POLICIES: dict[str, Callable[..., EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def policy_name(name: str) -> str:
    """The canonical (lower-case) name of a policy in :data:`POLICIES`; names are case-insensitive (``"ARC"``).

    Raises:
        ValueError: not a supported name; the message names it and lists the supported ones.
    """
    if not isinstance(name, str) or name.lower() not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; supported: {', '.join(sorted(POLICIES))}")
    return name.lower()


def make_policy(name: str, capacity: int, slots: int | None = None, keys=None, pool: int = 0) -> EvictionPolicy:
    """Builds the policy registered under ``name`` (see :func:`policy_name`) for ``capacity`` resident slots, the
    slots being ints in ``[0, slots)`` (default ``[0, capacity)``); a policy with ghosts keeps them in ``keys`` (the
    manager's key table, ``pool`` its pool's index; default: a table of its own).

    Raises:
        ValueError: ``name`` is not a supported policy (the message lists them), or ``capacity`` is not a positive
            int.
    """
    return POLICIES[policy_name(name)](capacity, slots, keys, pool)
