"""The transfer benchmark's torch baselines: ``torch_staged`` (a GPU-side gather into a contiguous staging buffer,
then one pinned ``copy_``) and ``peak`` (one contiguous pinned ``copy_`` of the same bytes: the link's practical
ceiling)."""

from __future__ import annotations

import numpy as np
import torch

from bench.common.case import Prepared, TransferCase
from bench.common.env import Env

__all__ = ["prepare_staged", "prepare_peak"]


def prepare_staged(case: TransferCase, env: Env, num_ctas: int | None = None) -> Prepared:
    """Gather on the GPU with index_select (per run) into one contiguous (n, bytes_per_block) staging buffer in packed
    order, then one copy_ to pinned memory; the reverse for loads (one copy_, then index_copy_ per run).

    One copy_ needs one contiguous host range, so this method is given consecutive host blocks
    (:attr:`TransferCase.contiguous_host_ids`); the others get random ones.
    """
    n, bpb = case.n, case.bytes_per_block
    staging = case.staging[: n * bpb].view(n, bpb)
    host_region = case.contiguous_host_region()
    cols = [staging[:, r.host_offset : r.host_offset + r.nbytes] for r in case.runs]
    views = [r.view for r in case.runs]
    device = case.device
    # Uploaded on every call, from pinned memory: from pageable memory the copy may synchronise with the stream.
    ids = torch.from_numpy(np.ascontiguousarray(case.gpu_ids))
    ids = ids.pin_memory() if env.cuda else ids

    def store() -> None:
        g = ids.to(device, non_blocking=True)
        for view, col in zip(views, cols):
            torch.index_select(view, 0, g, out=col)
        host_region.copy_(staging, non_blocking=True)

    def load() -> None:
        g = ids.to(device, non_blocking=True)
        staging.copy_(host_region, non_blocking=True)
        for view, col in zip(views, cols):
            view.index_copy_(0, g, col)

    impl = "index_select / index_copy_ per run + one copy_"
    return Prepared(store if case.store else load, case.contiguous_host_ids, impl)


def prepare_peak(case: TransferCase, env: Env, num_ctas: int | None = None) -> Prepared:
    """The link's practical ceiling: one contiguous pinned copy_ of the same number of bytes."""
    host = case.host.view(-1)[: case.total_bytes]
    dev = case.staging[: case.total_bytes]
    if case.store:
        run = lambda: host.copy_(dev, non_blocking=True)  # noqa: E731
    else:
        run = lambda: dev.copy_(host, non_blocking=True)  # noqa: E731
    return Prepared(run, None, "one contiguous copy_ (cudaMemcpyAsync)" if env.cuda else "one contiguous copy_")
