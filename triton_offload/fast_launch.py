"""The copy kernel launched past Triton's per-call dispatch (tens of microseconds of host time saved per call), used
only where a canary transfer proved it right: on a few fresh blocks of the spec's geometry, one store and one load go
through Triton's launch, through the direct launch and through the plain-PyTorch reference, and must give identical
bytes; otherwise Triton's launch is kept with a warning saying why. docs/design.md ("Host cost per call") explains why
one compiled variant serves every call. ``TRITON_OFFLOAD_FAST_LAUNCH=0`` keeps Triton's launch everywhere.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from triton_offload.checksums import Checksums
from triton_offload.kernels import packing, reference
from triton_offload.kernels._triton_compat import DirectRunner
from triton_offload.layouts import KVCacheSpec
from triton_offload.plan import Direction, TransferPlanner

if TYPE_CHECKING:  # the launcher's package builds issuers with this module's direct launch
    from triton_offload.issuers.launcher import CopyLauncher

__all__ = ["FAST_LAUNCH_ENV", "fast_launch_default", "enable_fast_launch", "prove_direct", "canary_spec", "DIRECT"]

logger = logging.getLogger(__name__)

FAST_LAUNCH_ENV = "TRITON_OFFLOAD_FAST_LAUNCH"
# What enable_fast_launch reports for a direction whose launches go direct; anything else says why not.
DIRECT = "direct"
# Canary size: enough blocks for several tiles and programs at real page counts, few enough to cost microseconds.
_CANARY_BLOCKS = 8
_SENTINEL = 0x5A


def fast_launch_default() -> bool:
    """Whether engines and public calls try the direct launch: yes unless ``TRITON_OFFLOAD_FAST_LAUNCH=0``."""
    return os.environ.get(FAST_LAUNCH_ENV, "1") != "0"


def canary_spec(spec: KVCacheSpec, num_blocks: int = _CANARY_BLOCKS) -> KVCacheSpec:
    """A spec with ``spec``'s layout, dtypes, per-block geometry, groups and host placement, over fresh random
    tensors of ``num_blocks`` blocks. Each is contiguous, so every alignment it offers is at least the live one's
    (a block's bytes divide its stride) and the live launch shapes are valid for it."""
    block_dim = spec.layout.dims.block_dim
    gen = torch.Generator(device=spec.device).manual_seed(0)
    tensors = []
    for t in spec.kv_caches:
        shape = list(t.shape)
        shape[block_dim] = num_blocks
        c = torch.empty(shape, dtype=t.dtype, device=t.device)
        c.view(torch.uint8).random_(0, 256, generator=gen)
        tensors.append(c)
    return KVCacheSpec(
        tensors, spec.layout, groups=spec.groups, host_slots=spec.host_slots, group_regions=spec.group_regions
    )


def _canary_transfer(spec: KVCacheSpec, f: int, direction: Direction):
    """(gpu ids, host ids, skips, group sizes) of a canary transfer: every group, a skip when f > 1, ids out of
    order; a load writes other GPU blocks than the store read."""
    groups = spec.num_groups
    sizes = [3] + [1] * (groups - 1)
    skips = [1 % f] + [0] * (groups - 1)
    need = [-(-(k + n) // f) for k, n in zip(skips, sizes)]
    store = direction is Direction.STORE
    extra = list(range(8, 8 + groups - 1)) if store else list(range(8 + groups, 7 + 2 * groups))
    gpu = ([5, 1, 6] if store else [7, 0, 3]) + extra
    host = list(range(sum(need)))[::-1]
    return np.array(gpu, dtype=np.int64), np.array(host, dtype=np.int64), skips, sizes


def _reference(spec: KVCacheSpec, direction: Direction, host: torch.Tensor, gpu, host_ids, f, skips, sizes) -> None:
    kw = dict(
        blocks_per_host_block=f,
        skip=skips,
        groups=spec.groups,
        group_sizes=sizes,
        host_slots=spec.host_slots,
        group_regions=spec.group_regions,
    )
    if direction is Direction.STORE:
        reference.gather_blocks_ref(spec.kv_caches, spec.layout, gpu, host, host_ids, **kw)
    else:
        reference.scatter_blocks_ref(host, host_ids, spec.kv_caches, spec.layout, gpu, **kw)


def _canary_checks(launcher: CopyLauncher, canary: KVCacheSpec, host: torch.Tensor, plan, direction: Direction):
    """With the integrity checks: the canary's checksum table, identities and what a correct launch must leave
    there. A store must write the reference checksums; a load must find them: the canary's host rows are filled as a
    correct store would fill them (reference bytes and checksums, from other GPU blocks), then one block's bytes are
    changed (it must fail) and, with two host rows or more, another row's marker is cleared (its blocks are absent).
    Returns (table, identities, expected table after a store, expected load results)."""
    from triton_offload import integrity

    f = launcher.blocks_per_host_block
    store = direction is Direction.STORE
    cfg = launcher.config(direction)
    word, group = cfg.elem, cfg.vec
    mark = integrity.marker(f, word, group)
    table = torch.zeros(host.shape[0], canary.num_regions * (1 + f), dtype=torch.int64, pin_memory=launcher.cuda)
    rng = np.random.default_rng(2)
    identities = rng.integers(-(2**63), 2**63 - 1, size=plan.n_host, dtype=np.int64)
    groups, sizes, skips = canary.groups, list(plan.sizes), list(plan.skips)
    src = plan.gpu_ids if store else np.array([i for i in range(canary.num_blocks) if i not in set(plan.gpu_ids)])
    src = src[: plan.n_blocks]
    kw = dict(blocks_per_host_block=f, skip=skips, groups=groups, group_sizes=sizes)
    rows, cols, sums = reference.checksums_ref(
        canary.kv_caches,
        canary.layout,
        src,
        plan.host_ids,
        word_bytes=word,
        group_words=group,
        identities=identities,
        group_regions=canary.group_regions,
        **kw,
    )
    marks = cols - cols % (1 + f)  # each block's region's marker in its row
    expected = torch.zeros_like(table)
    expected[torch.from_numpy(rows), torch.from_numpy(marks)] = mark
    expected[torch.from_numpy(rows), torch.from_numpy(cols)] = torch.from_numpy(sums)
    if store:
        return table, identities, expected, None
    # What a correct store would have left: the bytes (reference) and their checksums.
    reference.gather_blocks_ref(
        canary.kv_caches,
        canary.layout,
        src,
        host,
        plan.host_ids,
        host_slots=canary.host_slots,
        group_regions=canary.group_regions,
        **kw,
    )
    table.copy_(expected)
    status = np.zeros(plan.n_blocks, dtype=np.int64)
    status[0] = integrity.FAILED
    table[int(rows[0]), int(cols[0])] ^= 1  # block 0's stored checksum no longer matches its bytes
    other = np.flatnonzero(rows != rows[0])
    if other.size:
        # That row's key (in the block's region) was stored without checksums: its blocks are absent.
        o = other[0]
        table[int(rows[o]), int(marks[o])] = 0
        status[(rows == rows[o]) & (marks == marks[o])] = integrity.ABSENT
    results = np.concatenate([[np.sum(status == integrity.FAILED), np.sum(status == integrity.ABSENT)], status])
    return table, identities, None, results


def prove_direct(
    launcher: CopyLauncher, direction: Direction, runner, num_ctas: int | None = None, copy: bool = True
) -> str | None:
    """Runs one canary transfer in ``direction`` through Triton's launch, through ``runner`` and through the
    reference; returns None if all three wrote the same bytes (and, with the integrity checks, the same checksums
    and load results), else what differed. ``runner`` is called as the live launcher would call it:
    ``runner(programs, stream, args)`` with the canary's arguments. ``copy`` False: the checksum-only launch."""
    spec, f = launcher.spec, launcher.blocks_per_host_block
    store = direction is Direction.STORE
    canary = canary_spec(spec, _CANARY_BLOCKS + 2 * spec.num_groups)
    gpu, host_ids, skips, sizes = _canary_transfer(canary, f, direction)
    rows = int(host_ids.max()) + 2
    host = torch.empty(rows, canary.host_block_bytes(f), dtype=torch.uint8, pin_memory=launcher.cuda)
    plan = TransferPlanner(canary, rows, f).plan(gpu, host_ids, direction=direction, skip=skips, group_sizes=sizes)
    if not store:  # a load reads host blocks with something to load
        host.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(1))
    checks = None
    if launcher.integrity:
        table, identities, expected_table, expected_results = _canary_checks(launcher, canary, host, plan, direction)
        plan = plan._replace(identities=identities)
        checks = table
    twin_checks = None
    if checks is not None:  # the canary's own table, under the launcher's setting
        twin_checks = Checksums(launcher.checksums.setting, checks, launcher.blocks_per_host_block, canary.num_regions)
    canary_launcher = launcher.twin(canary, host, direction, checksums=twin_checks)
    size = packing.packed_size(plan, launcher.integrity)
    packed = np.zeros(size, dtype=np.int64)
    packing.pack_ids(plan, packed)
    if launcher.integrity:
        packing.pack_integrity(plan, packed)
    ids_start = torch.from_numpy(packed).to(spec.device)
    ids = ids_start.clone()
    res = torch.zeros(packing.result_size(plan), dtype=torch.int64, pin_memory=launcher.cuda)
    if copy:
        dst_bytes = [host] if store else [t.view(torch.uint8) for t in canary.kv_caches]
    else:  # the checksum-only launch reads what the copies left on the GPU: a load's blocks hold the host's bytes
        dst_bytes = []
        if not store:
            _reference(canary, direction, host, gpu, host_ids, f, skips, sizes)
    if launcher.integrity:
        dst_bytes = [*dst_bytes, checks]
    start = [b.clone() for b in dst_bytes]

    def run(how) -> list[torch.Tensor]:
        for b, s in zip(dst_bytes, start):
            b.copy_(s)
        if store and copy:
            host.fill_(_SENTINEL)  # unwritten bytes show
        ids.copy_(ids_start)  # the sums start at zero
        res.fill_(-1)
        how()
        if launcher.cuda:
            torch.cuda.synchronize(spec.device)
        return [b.clone() for b in dst_bytes] + ([res.clone()] if launcher.integrity and not store else [])

    def launch():
        canary_launcher.launch(plan, ids, num_ctas, res if launcher.integrity else None, copy)

    via_triton = run(launch)
    canary_launcher.set_direct(direction, runner, copy)
    via_direct = run(launch)
    if copy:
        via_reference = run(lambda: _reference(canary, direction, host, gpu, host_ids, f, skips, sizes))
    else:
        via_reference = list(via_triton)
    if launcher.integrity:  # what the checks must leave: the table after a store, the results of a load
        if store:
            via_reference[-1] = expected_table
        else:
            # A load leaves the table alone, and its results are the expected ones (the reference writes none).
            via_reference[-2], via_reference[-1] = start[-1], torch.from_numpy(expected_results)
    what = f"{direction}{'' if copy else ' (checksum only)'}"
    if not all(torch.equal(a, b) for a, b in zip(via_direct, via_triton)):
        return f"the direct launch of the {what} wrote other bytes than Triton's launch on the canary"
    if not all(torch.equal(a, b) for a, b in zip(via_triton, via_reference)):
        return f"Triton's launch of the {what} wrote other bytes than the reference on the canary"
    return None


def compiled_runner(launcher: CopyLauncher, direction: Direction, copy: bool = True) -> DirectRunner:
    """A direct runner of the variant ``launcher``'s launches in ``direction`` use (CUDA)."""
    return DirectRunner(launcher.compile_variant(direction, copy))


def enable_fast_launch(
    launcher: CopyLauncher, num_ctas: int | None = None, *, make_runner=None
) -> dict[Direction, str]:
    """Installs a proven direct launch on ``launcher`` for each of its directions, where possible.

    A variant is proven once per spec (the launcher keeps the runner, or the reason it is not used, for every
    launcher of the spec and variant), so other launchers of the same variant reuse the verdict. Returns, per
    direction, :data:`DIRECT` or why Triton's launch is kept.

    Args:
        make_runner: ``make_runner(launcher, direction) -> runner`` instead of compiling the variant (tests use it to
            prove a runner on CPU, where kernels run through the interpreter and there is no compiled variant).
    """
    if make_runner is None and not launcher.cuda:
        reason = "not applicable: CPU tensors run through Triton's interpreter"
        return {d: reason for d in launcher.directions}
    make_runner = make_runner or compiled_runner
    verdicts = {}
    # With the integrity checks, the copy-engine path's checksum-only launches (copy False) are proven too.
    variants = [(d, True) for d in launcher.directions]
    if launcher.integrity:
        variants += [(d, False) for d in launcher.directions]
    for d, copy in variants:
        known = launcher.direct_verdict(d, copy)
        if known is None:
            try:
                runner = make_runner(launcher, d) if copy else make_runner(launcher, d, copy=False)
                problem = prove_direct(launcher, d, runner, num_ctas, copy)
            except Exception as e:  # a protocol or compile problem: keep Triton's launch, say so
                runner, problem = None, f"{type(e).__name__}: {e}"
            known = runner if problem is None else problem
            launcher.record_direct_verdict(d, known, copy)
            if problem is not None:
                logger.warning(
                    "triton-offload: the direct launch of the %s kernel%s is not used (Triton's launch is kept, at "
                    "tens of microseconds more host time per call): %s",
                    d,
                    "" if copy else " (checksum only)",
                    problem,
                )
        if isinstance(known, str):
            launcher.set_direct(d, None, copy)
        else:
            launcher.set_direct(d, known, copy)
        if copy:
            verdicts[d] = known if isinstance(known, str) else DIRECT
    return verdicts
