"""How transfers move: one :class:`Issuer` per transfer path (the Triton kernel, the copy engines), built by name
from :data:`PATHS` (:mod:`.factory`)."""

from triton_offload.issuers.base import Issuer, IssuerContext
from triton_offload.issuers.dma import DmaIssuer, DmaPlanner
from triton_offload.issuers.factory import PATHS, PathUnavailable, build_issuers, kernel_launcher
from triton_offload.issuers.kernel import KernelIssuer
from triton_offload.issuers.launcher import CopyLauncher

__all__ = [
    "Issuer",
    "IssuerContext",
    "CopyLauncher",
    "KernelIssuer",
    "DmaIssuer",
    "DmaPlanner",
    "PATHS",
    "PathUnavailable",
    "build_issuers",
    "kernel_launcher",
]
