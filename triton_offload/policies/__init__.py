"""Eviction policies for the host KV cache, one per file (LRU, ARC) behind one interface (:class:`EvictionPolicy`) and
a registry by name (:func:`make_policy`). Pure Python on purpose: this runs in the serving scheduler's process, which
must not import torch or vLLM for it.
"""

from triton_offload.policies.arc import ARCPolicy
from triton_offload.policies.base import EvictionPolicy
from triton_offload.policies.factory import POLICIES, make_policy, policy_name
from triton_offload.policies.lru import LRUPolicy

__all__ = ["EvictionPolicy", "LRUPolicy", "ARCPolicy", "POLICIES", "make_policy", "policy_name"]
