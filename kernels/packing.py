"""The kernel's id buffer: a :class:`~triton_offload.plan.TransferPlan` as the copy kernel reads it (the GPU and host
ids, and with several KV-cache groups each block's group and each group's first block, skip and first host id), and
what the integrity checks add to it (each host id's identity, zeroed lane sums) and where a load's results go.
"""

from __future__ import annotations

import numpy as np

from triton_offload.plan import TransferPlan

__all__ = ["packed_size", "integrity_offsets", "result_size", "pack_ids", "pack_integrity"]


def packed_size(plan: TransferPlan, integrity: bool = False) -> int:
    """Elements of the kernel's id buffer for ``plan``; with ``integrity``, also its identities and zeroed sums
    (:func:`integrity_offsets`)."""
    n, m = plan.n_blocks, plan.n_host
    size = n + m if len(plan.sizes) == 1 else 2 * n + m + 3 * len(plan.sizes)
    return size + m + _sums_size(n) if integrity else size


def _sums_size(n_blocks: int) -> int:
    """Elements of the integrity checks' sums part (zeroed): two lane sums and a counter per GPU block, then the
    programs-done counter and a load's two totals (the kernels' _finish_program reads them at these offsets)."""
    return 3 * n_blocks + 3


def integrity_offsets(plan: TransferPlan) -> tuple[int, int, int]:
    """Where the integrity checks' parts of an id buffer start (elements): the identities (one per host id), the
    lane sums and counters (:func:`_sums_size`), and the end of what is uploaded."""
    ident = packed_size(plan)
    sums = ident + plan.n_host
    return ident, sums, sums + _sums_size(plan.n_blocks)


def result_size(plan: TransferPlan) -> int:
    """Elements of a load's integrity results: failed and absent counts, then each block's status."""
    return 2 + plan.n_blocks


def pack_ids(plan: TransferPlan, out: np.ndarray | None = None) -> np.ndarray:
    """The kernel's id buffer of ``plan``, in ``out`` (a 1-D int64 array of at least :func:`packed_size` elements,
    e.g. a pinned staging slot) or a new array: the n GPU ids, the m host ids and, with several KV-cache groups, each
    GPU block's group and, per group, (index of its first GPU block, skip, index of its first host id). Returns the
    packed prefix of ``out``."""
    n, m, sizes = plan.n_blocks, plan.n_host, plan.sizes
    size = n + m if len(sizes) == 1 else 2 * n + m + 3 * len(sizes)  # packed_size, inlined: it runs per call
    out = np.empty(size, dtype=np.int64) if out is None else out[:size]
    out[:n] = plan.gpu_ids
    out[n : n + m] = plan.host_ids
    if len(sizes) > 1:
        out[n + m : 2 * n + m] = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
        first_block = np.cumsum(sizes) - sizes
        first_host = np.cumsum(plan.host_counts) - plan.host_counts
        out[2 * n + m :] = np.stack([first_block, plan.skips, first_host], axis=1).reshape(-1)
    return out


def pack_integrity(plan: TransferPlan, out: np.ndarray) -> np.ndarray:
    """Packs what the integrity checks add to ``plan``'s id buffer into ``out`` after :func:`pack_ids`' part: each
    host id's identity (the plan's, or the host id itself where it has none) and zeroed lane sums, counters and totals.
    Returns the packed prefix of ``out`` (what is uploaded)."""
    ident, sums, end = integrity_offsets(plan)
    out[ident:sums] = plan.host_ids if plan.identities is None else plan.identities
    out[sums:end] = 0
    return out[:end]
