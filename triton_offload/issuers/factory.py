"""The transfer paths by name, and how each one's issuer is built: :data:`PATHS` maps a path to a builder taking an
:class:`~triton_offload.issuers.base.IssuerContext`. The engine (one issuer per path and lane), the calibration of
``auto`` (over canary blocks), the public calls and the benchmarks all build issuers here, so a new path is one
module with an :class:`~triton_offload.issuers.base.Issuer` plus one entry in :data:`PATHS`. The kernel's launcher,
with its direct launch where a canary proves it, is made by :func:`kernel_launcher`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import torch

from triton_offload.cuda_driver import CudaError
from triton_offload.fast_launch import DIRECT, enable_fast_launch, fast_launch_default
from triton_offload.issuers.base import Issuer, IssuerContext
from triton_offload.issuers.dma import DmaIssuer
from triton_offload.issuers.fp8_launcher import Fp8Launcher
from triton_offload.issuers.kernel import KernelIssuer
from triton_offload.issuers.launcher import CopyLauncher
from triton_offload.layouts import KVCacheSpec
from triton_offload.plan import Direction, TransferPath

__all__ = ["PATHS", "PathUnavailable", "build_kernel", "build_dma", "build_issuers", "KernelSetup", "kernel_launcher"]

logger = logging.getLogger(__name__)


class PathUnavailable(RuntimeError):
    """A builder's path cannot run here (the copy engines without ``cuMemcpyBatchAsync``): ``auto`` goes on without
    it; asked for by name, it is an error."""


def build_kernel(ctx: IssuerContext) -> KernelIssuer:
    """The kernel path: one launch of the copy kernel per plan."""
    return KernelIssuer(ctx.launcher, ctx.stager, ctx.num_ctas)


def build_dma(ctx: IssuerContext) -> DmaIssuer:
    """The copy-engine path; with the integrity checks, a checksum-only kernel launch follows each batch on its
    stream, through the lane's own id slots.

    Raises:
        PathUnavailable: the driver has no ``cuMemcpyBatchAsync`` (CUDA < 12.8).
    """
    if ctx.spec.quant is not None:
        raise PathUnavailable(
            f"the copy engines move bytes unchanged: host_format {ctx.spec.host_format!r} needs the kernel"
        )
    checker = build_kernel(ctx) if ctx.launcher.integrity else None
    try:
        return DmaIssuer(ctx.spec, ctx.host_buffer, ctx.blocks_per_host_block, checker=checker)
    except CudaError as e:
        raise PathUnavailable(f"the copy-engine path needs cuMemcpyBatchAsync (CUDA >= 12.8): {e}") from e


# The paths by name, the kernel first (``auto`` gives it ties).
PATHS: dict[str, Callable[[IssuerContext], Issuer]] = {TransferPath.KERNEL: build_kernel, TransferPath.DMA: build_dma}


def build_issuers(
    ctx: IssuerContext, paths: Iterable[str], builders: Mapping[str, Callable[[IssuerContext], Issuer]] = PATHS
) -> dict[str, Issuer]:
    """The issuers of ``paths`` over ``ctx``, in ``builders``' order. A builder may raise :class:`PathUnavailable`:
    the caller decides what that means."""
    wanted = set(paths)
    return {path: build(ctx) for path, build in builders.items() if path in wanted}


class KernelSetup(NamedTuple):
    """The kernel's launcher, the programs its launches pass (``num_ctas`` resolved under the launch shape), and
    per direction :data:`~triton_offload.fast_launch.DIRECT` or why its launches go through Triton's dispatch."""

    launcher: CopyLauncher | Fp8Launcher
    num_ctas: int | None
    launch_paths: dict[Direction, str]


def kernel_launcher(
    spec: KVCacheSpec,
    host_buffer: torch.Tensor,
    blocks_per_host_block: int,
    *,
    direction: Direction | None = None,
    tunings=None,
    checksums=None,
    num_ctas: int | None = None,
    launch_shape: str = "fixed",
    fast_launch: bool | None = None,
) -> KernelSetup:
    """A :class:`CopyLauncher` (for ``direction``, None: both) with the direct launch installed where a canary
    proves it (``fast_launch`` None follows ``TRITON_OFFLOAD_FAST_LAUNCH``; proven once per spec and compiled
    variant, then a lookup). Its tables and shapes are built now, synchronously, on the caller's stream. A spec whose
    host format quantizes gets an :class:`Fp8Launcher` (Triton's dispatch, one launch shape)."""
    if spec.quant is not None:
        fp8 = Fp8Launcher(spec, host_buffer, blocks_per_host_block, direction, checksums)
        return KernelSetup(fp8, num_ctas, {d: f"host_format {spec.host_format}" for d in fp8.directions})
    launcher = CopyLauncher(spec, host_buffer, blocks_per_host_block, direction, tunings, checksums=checksums)
    ctas = launcher.ctas(num_ctas, launch_shape)
    if fast_launch is None:
        fast_launch = fast_launch_default()
    if fast_launch:
        paths = enable_fast_launch(launcher, ctas)
    else:
        paths = {d: "turned off" for d in launcher.directions}
    return KernelSetup(launcher, ctas, paths)


def describe_launch_paths(paths: Mapping[Direction, str]) -> str:
    """``store launches direct, load launches through Triton's dispatch (why)``, for a log."""
    return ", ".join(
        f"{d} launches " + ("direct" if v == DIRECT else f"through Triton's dispatch ({v})") for d, v in paths.items()
    )
