"""The copy kernel launched past Triton's per-call dispatch, used only where a canary transfer proved it right.

Triton's ``kernel[grid](...)`` binds and specialises every argument, looks the compiled variant up and runs the launch
hooks on every call: tens of microseconds of host time, spent in the thread that launches the model. A launcher can
instead call the compiled variant's own launcher directly (:class:`~triton_offload.kernels._triton_compat.
DirectRunner`). That is right only if Triton would have picked that very variant for every later call, so nothing a
call passes may change the specialisation: the kernel's scalars are typed int64 and never specialised (a scalar
would otherwise switch from i32 to i64 at 2**31 and the old variant would truncate it), the id and table pointers
are not specialised on alignment, and the two data pointers (the KV anchor and the host buffer) are fixed for a
launcher (its :meth:`~triton_offload.kernels.copy_blocks.CopyLauncher.variant_key`).

A wrong variant or a wrong argument protocol would move wrong bytes silently, so the direct launch is proven before
it is used: on a *canary* (a few blocks with the spec's geometry in fresh tensors, never live KV), one store and one
load go through Triton's launch and through the direct launch, with the live launcher's compiled variant and launch
shapes, and must give identical bytes, equal to the plain-PyTorch reference. Any difference or error keeps Triton's
launch for that variant, with a warning naming the reason. Set ``TRITON_OFFLOAD_FAST_LAUNCH=0`` to keep Triton's
launch everywhere.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from triton_offload.kernels import reference
from triton_offload.kernels._triton_compat import DirectRunner
from triton_offload.kernels.copy_blocks import _STATE, CopyLauncher, pack_ids
from triton_offload.layouts import KVCacheSpec

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
    return KVCacheSpec(tensors, spec.layout, groups=spec.groups, host_slots=spec.host_slots)


def _canary_transfer(spec: KVCacheSpec, f: int, store: bool):
    """(gpu ids, host ids, skips, group sizes, host ids per group) of a canary transfer: every group, a skip when
    f > 1, ids out of order; a load writes other GPU blocks than the store read."""
    groups = spec.num_groups
    sizes = [3] + [1] * (groups - 1)
    skips = [1 % f] + [0] * (groups - 1)
    need = [-(-(k + n) // f) for k, n in zip(skips, sizes)]
    extra = list(range(8, 8 + groups - 1)) if store else list(range(8 + groups, 7 + 2 * groups))
    gpu = ([5, 1, 6] if store else [7, 0, 3]) + extra
    host = list(range(sum(need)))[::-1]
    return np.array(gpu, dtype=np.int64), np.array(host, dtype=np.int64), skips, sizes, need


def _reference(spec: KVCacheSpec, store: bool, host: torch.Tensor, gpu, host_ids, f, skips, sizes) -> None:
    copy = reference.gather_blocks_ref if store else reference.scatter_blocks_ref
    kw = dict(blocks_per_host_block=f, skip=skips, groups=spec.groups, group_sizes=sizes, host_slots=spec.host_slots)
    if store:
        copy(spec.kv_caches, spec.layout, gpu, host, host_ids, **kw)
    else:
        copy(host, host_ids, spec.kv_caches, spec.layout, gpu, **kw)


def prove_direct(launcher: CopyLauncher, store: bool, runner, num_ctas: int | None = None) -> str | None:
    """Runs one canary transfer in direction ``store`` through Triton's launch, through ``runner`` and through the
    reference; returns None if all three wrote the same bytes, else what differed. ``runner`` is called as the live
    launcher would call it: ``runner(programs, stream, args)`` with the canary's arguments."""
    spec, f = launcher.spec, launcher.blocks_per_host_block
    canary = canary_spec(spec, _CANARY_BLOCKS + 2 * spec.num_groups)
    gpu, host_ids, skips, sizes, need = _canary_transfer(canary, f, store)
    rows = int(host_ids.max()) + 2
    host = torch.empty(rows, canary.host_block_bytes(f), dtype=torch.uint8, pin_memory=launcher.cuda)
    configs = {store: launcher.config(store)}
    canary_launcher = CopyLauncher(canary, host, f, store=store, configs=configs)
    plan = pack_ids(canary, store, gpu, host_ids, sizes, skips, need)
    ids = torch.from_numpy(plan.ids).to(spec.device)
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
    canary_launcher.set_direct(store, runner)
    via_direct = run(lambda: canary_launcher.launch(plan, ids, num_ctas))
    via_reference = run(lambda: _reference(canary, store, host, gpu, host_ids, f, skips, sizes))
    what = "store" if store else "load"
    if not all(torch.equal(a, b) for a, b in zip(via_direct, via_triton)):
        return f"the direct launch of the {what} wrote other bytes than Triton's launch on the canary"
    if not all(torch.equal(a, b) for a, b in zip(via_triton, via_reference)):
        return f"Triton's launch of the {what} wrote other bytes than the reference on the canary"
    return None


def compiled_runner(launcher: CopyLauncher, store: bool) -> DirectRunner:
    """A direct runner of the variant ``launcher``'s launches in direction ``store`` use (CUDA)."""
    return DirectRunner(launcher.compile_variant(store))


def enable_fast_launch(launcher: CopyLauncher, num_ctas: int | None = None, *, make_runner=None) -> dict[bool, str]:
    """Installs a proven direct launch on ``launcher`` for each of its directions, where possible.

    A variant is proven once per spec (the spec's kernel state keeps the runner, or the reason it is not used), so
    other launchers of the same variant reuse the verdict. Returns, per direction (True: store), :data:`DIRECT` or
    why Triton's launch is kept.

    Args:
        make_runner: ``make_runner(launcher, store) -> runner`` instead of compiling the variant (tests use it to
            prove a runner on CPU, where kernels run through the interpreter and there is no compiled variant).
    """
    if make_runner is None and not launcher.cuda:
        reason = "not applicable: CPU tensors run through Triton's interpreter"
        return {store: reason for store in launcher.directions}
    make_runner = make_runner or compiled_runner
    state = _STATE[launcher.spec]
    verdicts = {}
    for store in launcher.directions:
        key = launcher.variant_key(store)
        known = state.direct.get(key)
        if known is None:
            try:
                runner = make_runner(launcher, store)
                problem = prove_direct(launcher, store, runner, num_ctas)
            except Exception as e:  # a protocol or compile problem: keep Triton's launch, say so
                runner, problem = None, f"{type(e).__name__}: {e}"
            known = state.direct[key] = runner if problem is None else problem
            if problem is not None:
                logger.warning(
                    "triton-offload: the direct launch of the %s kernel is not used (Triton's launch is kept, at "
                    "tens of microseconds more host time per call): %s",
                    "store" if store else "load",
                    problem,
                )
        if isinstance(known, str):
            launcher.set_direct(store, None)
            verdicts[store] = known
        else:
            launcher.set_direct(store, known)
            verdicts[store] = DIRECT
    return verdicts
