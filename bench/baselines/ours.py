"""Ours, as a user runs it: ``triton`` (the Triton kernel: the public ``gather_blocks`` / ``scatter_blocks`` per
transfer, or a ``TransferEngine(path="kernel")`` in the serving loop) and ``auto`` (``TransferEngine(path="auto")``:
the engine's own calibration, per-call choice of the kernel or the copy engines, and job tracking)."""

from __future__ import annotations

import triton_offload as to
from bench.baselines.tracked import EngineCalls
from bench.common.case import OffloadTarget, Prepared, TransferCase
from bench.common.env import Env
from triton_offload._checks import AUTO, DMA
from triton_offload.engine import TransferEngine
from triton_offload.kernel_issuer import CopyLauncher
from triton_offload.kernels.copy_blocks import DEFAULT_NUM_CTAS

__all__ = [
    "prepare_triton",
    "triton_engine",
    "prepare_triton_size_aware",
    "triton_size_aware_engine",
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


def prepare_auto(case: TransferCase, env: Env, num_ctas: int | None = None) -> Prepared:
    """``TransferEngine(path="auto")`` over the case's caches and host buffer, one job per call, timed by the
    engine's job events. Its calibration is made once per spec and f (by the first engine; the next ones of the run
    are given it) and recorded in ``env.calibrations``. Without CUDA nothing can be calibrated: the engine's
    copy-engine path (auto's other half; the kernel is the ``triton`` rows') runs, its descriptors replayed by
    memmove, and is byte-checked like every method."""
    if not env.cuda:
        engine = TransferEngine(case.spec, case.host, blocks_per_host_block=case.f, path=DMA)
        impl = "copy-engine path (triton_offload.dma) replayed with memmove: no CUDA to calibrate on"
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
