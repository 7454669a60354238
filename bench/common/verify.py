"""Byte-exact checks of every method, run once on fresh destinations before anything of it is timed
(:func:`check_method`). The expected bytes come from ``kernels/reference.py`` (plain indexing, no address arithmetic),
so they check the kernel and the baselines' descriptor arithmetic independently. Destinations start as a sentinel
(:data:`SENTINEL`), so bytes a method failed to write show; bytes it wrote where it should not are caught too (the
sentinel outside the addressed host sub-blocks, a checksum of every GPU block that was not addressed).
"""

from __future__ import annotations

import numpy as np
import torch

from bench.common.case import Prepared, TransferCase
from triton_offload.kernels.reference import gather_blocks_ref

__all__ = ["SENTINEL", "reference_blocks", "where_in_block", "check_method"]

SENTINEL = 0xA5


def reference_blocks(spec, gpu_ids: np.ndarray, device: torch.device) -> torch.Tensor:
    """(n, bytes_per_block) uint8 on ``device``: each block's packed bytes, all layers, from the reference."""
    n = int(gpu_ids.size)
    out = torch.empty((n, spec.bytes_per_block), dtype=torch.uint8, device=device)
    if n:
        gather_blocks_ref(spec.kv_caches, spec.layout, gpu_ids, out, np.arange(n), blocks_per_host_block=1, skip=0)
    return out


def where_in_block(segments, offset: int) -> str:
    """Where byte ``offset`` of a packed block lies, as ``"layer L, byte B of its run"``; ``segments``: the spec's
    segments (or the runs merged from them), each with its ``layer`` and ``host_offset`` in the block."""
    seg = max((s for s in segments if s.host_offset <= offset), key=lambda s: s.host_offset)
    return f"layer {seg.layer}, byte {offset - seg.host_offset} of its run"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _describe(got: torch.Tensor, want: torch.Tensor, case: TransferCase, ids: np.ndarray, what: str) -> str:
    """Where the first wrong byte is: position, GPU block, layer and run, so a wrong stride or offset is obvious."""
    diff = got != want
    bad = diff.any(dim=1).nonzero().flatten()
    i = int(bad[0])
    off = int(diff[i].nonzero()[0])
    return (
        f"{what}: {bad.numel()} of {case.n} blocks differ; first at position {i} (GPU block {int(ids[i])}), "
        f"byte {off} of the block = {where_in_block(case.runs, off)}: "
        f"got {int(got[i, off]):#04x}, expected {int(want[i, off]):#04x}"
    )


def _slot_rows(case: TransferCase, host_ids: np.ndarray, device: torch.device) -> torch.Tensor:
    """Index of each GPU block's sub-block in the (num_host_blocks * f, bytes_per_block) view of the host buffer: the
    packed format's position rule (block i at position p = skip + i: host block ``host_ids[p // f]``, sub-block
    ``p % f``), stated here as the check's own, apart from the planners it checks."""
    pos = case.skip + np.arange(case.n, dtype=np.int64)
    return torch.from_numpy(host_ids[pos // case.f] * case.f + pos % case.f).to(device)


def block_checksums(case: TransferCase) -> torch.Tensor:
    """(num_blocks,) int64: the sum of every block's bytes over all runs, to spot writes to blocks not addressed."""
    return sum(r.view.sum(dim=1, dtype=torch.int64) for r in case.runs)


def _host_subs(case: TransferCase, prepared: Prepared):
    """The method's host sub-blocks: the case's packed buffer, or the method's own region seen the same way."""
    return case.host.view(-1, case.bytes_per_block) if prepared.host_subs is None else prepared.host_subs


def _check_store(case: TransferCase, prepared: Prepared, expected: torch.Tensor) -> str | None:
    device = expected.device
    subs = _host_subs(case, prepared)
    _sync(case.device)  # nothing may still be writing the host buffer
    subs.fill_(SENTINEL)
    prepared.run()
    _sync(case.device)
    got_all = subs.to(device)
    idx = _slot_rows(case, prepared.host_ids, device)
    got = got_all[idx]
    if not torch.equal(got, expected):
        return _describe(got, expected, case, case.gpu_ids, "wrong host bytes")
    untouched = torch.ones(got_all.shape[0], dtype=torch.bool, device=device)
    untouched[idx] = False
    stray = (got_all[untouched] != SENTINEL).any(dim=1).nonzero().flatten()
    if stray.numel():
        row = int(untouched.nonzero().flatten()[stray[0]])
        return f"wrote host sub-block {row} (host block {row // case.f}, sub-block {row % case.f}), not addressed"
    return None


def _check_load(case: TransferCase, prepared: Prepared, expected: torch.Tensor) -> str | None:
    device = expected.device
    subs = _host_subs(case, prepared)
    _sync(case.device)
    idx = _slot_rows(case, prepared.host_ids, device)
    staged = torch.full(subs.shape, SENTINEL, dtype=torch.uint8, device=device)
    staged[idx] = expected
    subs.copy_(staged)
    dest = torch.from_numpy(case.gpu_ids).to(case.device)
    for r in case.runs:
        r.view.index_fill_(0, dest, SENTINEL)
    before = block_checksums(case)
    _sync(case.device)
    prepared.run()
    _sync(case.device)
    got = reference_blocks(case.spec, case.gpu_ids, device)
    if not torch.equal(got, expected):
        return _describe(got, expected, case, case.gpu_ids, "wrong GPU bytes")
    others = torch.ones_like(before, dtype=torch.bool)
    others[dest] = False
    changed = ((before != block_checksums(case)) & others).nonzero().flatten()
    if changed.numel():
        return f"changed GPU block {int(changed[0])}, which was not addressed ({changed.numel()} such blocks)"
    if not torch.equal(subs.to(device), staged):
        return "a load changed the host buffer"
    return None


def _check_contiguous(case: TransferCase, prepared: Prepared, expected: torch.Tensor) -> str | None:
    """The peak copy: the same number of bytes, one contiguous range each side."""
    host = case.host.view(-1)[: case.total_bytes]
    dev = case.staging[: case.total_bytes]
    want = expected.reshape(-1)
    _sync(case.device)
    if case.store:
        dev.copy_(want)
        host.fill_(SENTINEL)
    else:
        host.copy_(want)
        dev.fill_(SENTINEL)
    _sync(case.device)
    prepared.run()
    _sync(case.device)
    got = host.to(want.device) if case.store else dev.to(want.device)
    return None if torch.equal(got, want) else "the contiguous copy moved wrong bytes"


def check_method(case: TransferCase, prepared: Prepared, expected: torch.Tensor) -> str | None:
    """Runs ``prepared`` once into sentinel-filled destinations; returns None when every byte is right, else what is
    wrong. ``expected``: (n, bytes_per_block) reference bytes of ``case.data_ids``."""
    if prepared.host_ids is None:
        return _check_contiguous(case, prepared, expected)
    return _check_store(case, prepared, expected) if case.store else _check_load(case, prepared, expected)
