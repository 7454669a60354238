"""The copy kernel launched past Triton's per-call dispatch (tens of microseconds of host time saved per call), used
only where a canary transfer proved it right: on a few fresh blocks of the spec's geometry, one store and one load go
through Triton's launch, through the direct launch and through the plain-PyTorch reference, and must give identical
bytes; otherwise Triton's launch is kept with a warning saying why. docs/design.md ("Host cost per call") explains why
one compiled variant serves every call. ``TRITON_OFFLOAD_FAST_LAUNCH=0`` keeps Triton's launch everywhere.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from triton_offload.kernel_issuer import CopyLauncher
from triton_offload.kernels import copy_blocks, reference
from triton_offload.kernels._triton_compat import DirectRunner
from triton_offload.layouts import KVCacheSpec
from triton_offload.plan import Direction, TransferPlanner

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


def prove_direct(launcher: CopyLauncher, direction: Direction, runner, num_ctas: int | None = None) -> str | None:
    """Runs one canary transfer in ``direction`` through Triton's launch, through ``runner`` and through the
    reference; returns None if all three wrote the same bytes, else what differed. ``runner`` is called as the live
    launcher would call it: ``runner(programs, stream, args)`` with the canary's arguments."""
    spec, f = launcher.spec, launcher.blocks_per_host_block
    store = direction is Direction.STORE
    canary = canary_spec(spec, _CANARY_BLOCKS + 2 * spec.num_groups)
    gpu, host_ids, skips, sizes = _canary_transfer(canary, f, direction)
    rows = int(host_ids.max()) + 2
    host = torch.empty(rows, canary.host_block_bytes(f), dtype=torch.uint8, pin_memory=launcher.cuda)
    canary_launcher = launcher.twin(canary, host, direction)
    plan = TransferPlanner(canary, rows, f).plan(gpu, host_ids, direction=direction, skip=skips, group_sizes=sizes)
    ids = torch.from_numpy(copy_blocks.pack_ids(plan)).to(spec.device)
    if not store:  # a load reads host blocks with something to load
        host.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(1))
    dst_bytes = [host] if store else [t.view(torch.uint8) for t in canary.kv_caches]
    start = [b.clone() for b in dst_bytes]

    def run(how) -> list[torch.Tensor]:
        for b, s in zip(dst_bytes, start):
            b.copy_(s)
        if store:
            host.fill_(_SENTINEL)  # unwritten bytes show
        how()
        if launcher.cuda:
            torch.cuda.synchronize(spec.device)
        return [b.clone() for b in dst_bytes]

    via_triton = run(lambda: canary_launcher.launch(plan, ids, num_ctas))
    canary_launcher.set_direct(direction, runner)
    via_direct = run(lambda: canary_launcher.launch(plan, ids, num_ctas))
    via_reference = run(lambda: _reference(canary, direction, host, gpu, host_ids, f, skips, sizes))
    if not all(torch.equal(a, b) for a, b in zip(via_direct, via_triton)):
        return f"the direct launch of the {direction} wrote other bytes than Triton's launch on the canary"
    if not all(torch.equal(a, b) for a, b in zip(via_triton, via_reference)):
        return f"Triton's launch of the {direction} wrote other bytes than the reference on the canary"
    return None


def compiled_runner(launcher: CopyLauncher, direction: Direction) -> DirectRunner:
    """A direct runner of the variant ``launcher``'s launches in ``direction`` use (CUDA)."""
    return DirectRunner(launcher.compile_variant(direction))


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
    for d in launcher.directions:
        known = launcher.direct_verdict(d)
        if known is None:
            try:
                runner = make_runner(launcher, d)
                problem = prove_direct(launcher, d, runner, num_ctas)
            except Exception as e:  # a protocol or compile problem: keep Triton's launch, say so
                runner, problem = None, f"{type(e).__name__}: {e}"
            known = runner if problem is None else problem
            launcher.record_direct_verdict(d, known)
            if problem is not None:
                logger.warning(
                    "triton-offload: the direct launch of the %s kernel is not used (Triton's launch is kept, at "
                    "tens of microseconds more host time per call): %s",
                    d,
                    problem,
                )
        if isinstance(known, str):
            launcher.set_direct(d, None)
            verdicts[d] = known
        else:
            launcher.set_direct(d, known)
            verdicts[d] = DIRECT
    return verdicts
