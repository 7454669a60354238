"""Ours, as a user runs it: ``triton`` (the Triton kernel: the public ``gather_blocks`` / ``scatter_blocks`` per
transfer, or a ``TransferEngine(path="kernel")`` in the serving loop), ``auto`` (``TransferEngine(path="auto")``:
the engine's own calibration, per-call choice of the kernel or the copy engines, and job tracking), and
``triton_integrity``: the kernel with the integrity checks fused into it (docs/integrity.md), to set beside
``triton`` in the same run."""

from __future__ import annotations

import torch

import triton_offload as to
from bench.baselines.tracked import EngineCalls
from bench.common.case import OffloadTarget, Prepared, TransferCase
from bench.common.env import Env
from triton_offload import integrity
from triton_offload._checks import AUTO, DMA
from triton_offload.checksums import Checksums
from triton_offload.engine import TransferEngine
from triton_offload.issuers import CopyLauncher, IssuerContext
from triton_offload.issuers.factory import build_kernel, kernel_launcher
from triton_offload.kernels.shapes import DEFAULT_NUM_CTAS
from triton_offload.plan import Direction, TransferPlanner
from triton_offload.staging import IdStager

__all__ = [
    "prepare_triton",
    "triton_engine",
    "prepare_triton_size_aware",
    "triton_size_aware_engine",
    "prepare_triton_integrity",
    "triton_integrity_engine",
    "prepare_auto",
    "auto_engine",
]


def _ctas(num_ctas: int | None) -> int | None:
    """The default num_ctas is passed as None, the way a user runs it."""
    return None if num_ctas == DEFAULT_NUM_CTAS else num_ctas


def prepare_triton(case: TransferCase, env: Env, num_ctas: int | None = None, launch_shape: str = "fixed") -> Prepared:
    """One launch of ``triton_offload.gather_blocks`` / ``scatter_blocks`` for all blocks and layers."""
    spec, host, g, h = case.spec, case.host, case.gpu_ids, case.host_ids
    kw = dict(blocks_per_host_block=case.f, skip=case.skip, num_ctas=_ctas(num_ctas), launch_shape=launch_shape)
    if case.store:
        run = lambda: to.gather_blocks(spec, g, host, h, **kw)  # noqa: E731
    else:
        run = lambda: to.scatter_blocks(host, h, spec, g, **kw)  # noqa: E731
    where = "compiled kernel" if env.cuda else "Triton interpreter"
    impl = f"triton_offload.{'gather' if case.store else 'scatter'}_blocks ({where})"
    if launch_shape != "fixed":
        programs = CopyLauncher(spec, host, case.f).ctas(_ctas(num_ctas), launch_shape)
        impl += f", launch_shape={launch_shape!r}: {programs} programs at most"
    return Prepared(run, h, impl)


def prepare_triton_size_aware(case: TransferCase, env: Env, num_ctas: int | None = None) -> Prepared:
    """:func:`prepare_triton` with ``launch_shape="size-aware"``: the programs chosen from the caches' page runs
    (issue 38, section 3), beside the fixed shape's rows of the same run."""
    return prepare_triton(case, env, num_ctas, launch_shape="size-aware")


def triton_engine(target: OffloadTarget, num_ctas: int | None, **engine_args) -> TransferEngine:
    """Ours, as the plugin's worker builds it; ``engine_args`` go to TransferEngine as they are (``path``)."""
    return TransferEngine(target.kv, target.host_buffer, num_ctas=_ctas(num_ctas), **engine_args)


def triton_size_aware_engine(target: OffloadTarget, num_ctas: int | None) -> TransferEngine:
    """``TransferEngine(path="kernel", launch_shape="size-aware")``: the serving loop's form of the size-aware shape."""
    return triton_engine(target, num_ctas, path="kernel", launch_shape="size-aware")


def prepare_triton_integrity(case: TransferCase, env: Env, num_ctas: int | None = None) -> Prepared:
    """The kernel with the integrity checks (``"verify"``), issued as the public call issues ``triton``'s
    launch (a plan, the ids packed into a pinned slot and uploaded, one launch, the slot given back behind an event),
    with the checks added: each host block named by its id, a checksum table, and one launch that copies and
    checksums, each program writing its blocks' checksums into the table (a store) or checking them (a load). So the
    two rows differ by the checks alone, in device time and in host time per call.

    A load case's table holds no checksums (the byte check writes the host bytes directly), so every block is
    "absent" rather than "verified": the kernel does the same work either way (each block's checksum is computed,
    then compared with the table's entry or found to have none). On CPU a launch's outcome is read at once, and a
    block it flags fails the method's byte check."""
    direction = Direction.STORE if case.store else Direction.LOAD
    checks = Checksums.allocate(integrity.VERIFY, case.host.shape[0], case.f, pin=env.cuda)
    # The direct launch where a canary proves it, as the public call makes it.
    kernel = kernel_launcher(
        case.spec, case.host, case.f, direction=direction, checksums=checks, num_ctas=_ctas(num_ctas)
    )
    stager = IdStager(case.device) if env.cuda else None
    issuer = build_kernel(IssuerContext(case.spec, case.host, case.f, kernel.launcher, stager, kernel.num_ctas))
    planner = TransferPlanner(case.spec, case.host.shape[0], case.f)
    g, h, skip = case.gpu_ids, case.host_ids, case.skip

    def run() -> None:
        keep = issuer.issue(planner.plan(g, h, direction=direction, skip=skip, identities=h))
        if env.cuda:  # reused once the launch has read the ids and written its results
            after = torch.cuda.Event()
            after.record()
            issuer.release(keep, after)
        else:  # synchronous: its outcome is known; a check that flags an intact block fails the method's check
            check = issuer.outcome(keep)
            issuer.release(keep)
            if check is not None and check.failed.size:
                raise RuntimeError(f"the integrity check flagged intact blocks at positions {check.failed.tolist()}")

    where = "compiled kernel" if env.cuda else "Triton interpreter"
    return Prepared(run, h, f"the kernel with the integrity checks fused ({where}): one launch per call")


def triton_integrity_engine(target: OffloadTarget, num_ctas: int | None) -> TransferEngine:
    """``triton``'s engine with the integrity checks: ``TransferEngine(path="kernel", checksums=...)``, ``"verify"``
    with a checksum table beside the host cache (its own, where the cache was made with one)."""
    checks = target.host_cache.checksums
    if checks is None:
        checks = Checksums.allocate(
            integrity.VERIFY, target.host_buffer.shape[0], 1, pin=target.kv.device.type == "cuda"
        )
    return triton_engine(target, num_ctas, path="kernel", checksums=checks)


def prepare_auto(case: TransferCase, env: Env, num_ctas: int | None = None) -> Prepared:
    """``TransferEngine(path="auto")`` over the case's caches and host buffer, one job per call, timed by the
    engine's job events. Its calibration is made once per spec and f (by the first engine; the next ones of the run
    are given it) and recorded in ``env.calibrations``. Without CUDA nothing can be calibrated: the engine's
    copy-engine path (auto's other half; the kernel is the ``triton`` rows') runs, its descriptors replayed by
    memmove, and is byte-checked like every method."""
    if not env.cuda:
        engine = TransferEngine(case.spec, case.host, blocks_per_host_block=case.f, path=DMA)
        impl = "copy-engine path (triton_offload.issuers.dma) replayed with memmove: no CUDA to calibrate on"
        return EngineCalls(engine, case, impl).prepared
    by_f = env.held.setdefault(case.spec, {}).setdefault("auto", {})
    calibration = by_f.get(case.f)
    engine = TransferEngine(case.spec, case.host, blocks_per_host_block=case.f, path=AUTO, calibration=calibration)
    if calibration is None:
        by_f[case.f] = engine.calibration
        env.calibrations.append({"spec": repr(case.spec), "blocks_per_host_block": case.f,
                                 **engine.calibration.to_dict()})  # fmt: skip
    impl = "TransferEngine(path='auto'), per call its calibration's choice; this case: {paths}"
    return EngineCalls(engine, case, impl).prepared


def auto_engine(target: OffloadTarget, num_ctas: int | None) -> TransferEngine:
    """The engine as a user gets it on CUDA: ``path="auto"``, calibrated at creation. Without CUDA nothing can be
    calibrated, so the engine's copy-engine path (auto's other half; the kernel is the ``triton`` row) runs, its
    descriptors replayed by memmove, and is byte-checked like every method."""
    path = AUTO if target.kv.device.type == "cuda" else DMA
    return triton_engine(target, num_ctas, path=path)
