"""The integrity checks of one host buffer as one value (docs/integrity.md): :class:`Checksums`, the setting
(``"verify"`` or ``"require"``) with the checksum table kept beside the blocks, built and validated once (by the host
cache, the tiering worker's slot, or a caller) and passed down as it is: the engine, the kernel's launcher and its
canary read it, and a finished load's :class:`LoadCheck` becomes the blocks that failed
under it (:meth:`Checksums.failures`). The checksum itself, the row marker and the block identities are
:mod:`triton_offload.integrity` (NumPy only, for the scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from triton_offload import integrity
from triton_offload._checks import positive_int
from triton_offload.plan import TransferPlan

__all__ = ["Checksums", "LoadCheck", "BlockRefs", "NO_BLOCKS"]


class BlockRefs(NamedTuple):
    """Some blocks of one transfer, each named as its caller named it.

    Attributes:
        positions: their positions in the plan's GPU ids.
        gpu_ids: each one's GPU block.
        host_ids: the host block each one was moved from (or to).
        identities: the identity each one was checked under (its host block's; the host id without identities).
        groups: each one's KV-cache group.
    """

    positions: np.ndarray
    gpu_ids: np.ndarray
    host_ids: np.ndarray
    identities: np.ndarray
    groups: np.ndarray


_NONE = np.zeros(0, dtype=np.int64)
NO_BLOCKS = BlockRefs(_NONE, _NONE, _NONE, _NONE, _NONE)


class LoadCheck(NamedTuple):
    """What the integrity check of one load found (docs/integrity.md).

    Attributes:
        failed: positions in the plan's GPU ids of the blocks whose bytes do not match their stored checksum.
        absent: positions of the blocks whose host row holds no checksum (stored without the checks).
        plan: the load's plan, which names each position's blocks (:meth:`blocks`); None: positions only.
        blocks_per_host_block: the plan's f (the position rule).
    """

    failed: np.ndarray
    absent: np.ndarray
    plan: TransferPlan | None = None
    blocks_per_host_block: int = 1

    def blocks(self, positions: np.ndarray) -> BlockRefs:
        """The blocks at ``positions`` of the plan's GPU ids, each with its host block and identity."""
        plan = self.plan
        if plan is None:
            raise ValueError("this LoadCheck carries no plan: only positions are known")
        positions = np.asarray(positions, dtype=np.int64)
        where = plan.host_index(self.blocks_per_host_block)[positions]
        host = plan.host_ids[where]
        ident = host if plan.identities is None else plan.identities[where]
        groups = np.repeat(np.arange(len(plan.sizes), dtype=np.int64), plan.sizes)[positions]
        return BlockRefs(positions, plan.gpu_ids[positions], host, ident, groups)


@dataclass(frozen=True, eq=False)
class Checksums:
    """The integrity checks of one host buffer.

    Attributes:
        setting: ``"verify"`` (a block stored without a checksum loads unchecked) or ``"require"`` (it fails).
        table: int64 host memory, one row per host block of ``regions x (1 + f)``: per host region of the row (a row
            holds one key per region, ``KVCacheSpec.num_regions``) its marker, then one checksum per sub-block;
            contiguous within rows (rows may be further apart: the tiering worker's trailers), pinned where the
            kernels run on CUDA (they read and write it from the GPU).
        blocks_per_host_block: f, the GPU blocks of a host block.
        regions: the host regions of a row.

    Raises:
        ValueError / TypeError: at construction, a setting that is not a check (``"off"`` is no value at all: pass
            None) or a table of the wrong type, shape or strides, naming what differs.
    """

    setting: str
    table: torch.Tensor
    blocks_per_host_block: int
    regions: int = 1

    def __post_init__(self) -> None:
        setting = integrity.integrity_setting(self.setting)
        if setting == integrity.OFF:
            raise ValueError("integrity = 'off' has no checksums: pass checksums=None")
        object.__setattr__(self, "setting", setting)
        positive_int(self.blocks_per_host_block, "blocks_per_host_block")
        positive_int(self.regions, "checksum regions (host regions of a row)")
        table = self.table
        if not isinstance(table, torch.Tensor):
            raise TypeError(f"the checksum table must be a torch.Tensor, got {type(table).__name__}")
        width = self.regions * (1 + self.blocks_per_host_block)
        if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != width:
            raise ValueError(
                f"the checksum table must be int64 of shape (host blocks, {width}), got {table.dtype} "
                f"{tuple(table.shape)}"
            )
        if table.device.type != "cpu" or table.stride(1) != 1 or (table.shape[0] > 1 and table.stride(0) < width):
            raise ValueError(
                f"the checksum table must be host memory with contiguous, disjoint rows, got {table.device} with "
                f"strides {table.stride()}"
            )

    @classmethod
    def allocate(cls, setting: str, num_blocks: int, blocks_per_host_block: int, *, pin: bool, regions: int = 1):
        """A zeroed table (no checksum yet) for ``num_blocks`` host blocks, page-locked when ``pin``: a separate small
        allocation (``8 * regions * (1 + f)`` bytes per host block), not part of the blocks' rows."""
        positive_int(num_blocks, "num_blocks")
        positive_int(blocks_per_host_block, "blocks_per_host_block")
        positive_int(regions, "checksum regions (host regions of a row)")
        table = torch.zeros((num_blocks, regions * (1 + blocks_per_host_block)), dtype=torch.int64, pin_memory=pin)
        return cls(setting, table, blocks_per_host_block, regions)

    @property
    def require(self) -> bool:
        return self.setting == integrity.REQUIRE

    def check_for(self, num_host_blocks: int, blocks_per_host_block: int, regions: int, cuda: bool) -> None:
        """Raises ValueError unless this table fits a host buffer of ``num_host_blocks`` rows of f sub-blocks and
        ``regions`` regions, and is pinned where the kernels run on CUDA."""
        if (blocks_per_host_block, regions) != (self.blocks_per_host_block, self.regions):
            raise ValueError(
                f"the checksums are for f = {self.blocks_per_host_block} and {self.regions} region(s) per row, the "
                f"host buffer has f = {blocks_per_host_block} and {regions}"
            )
        if self.table.shape[0] != num_host_blocks:
            raise ValueError(f"the checksum table has {self.table.shape[0]} rows, the host buffer {num_host_blocks}")
        if cuda and not self.table.is_pinned():
            raise ValueError("the checksum table must be pinned (page-locked) memory when the KV caches are on CUDA")

    def marker(self, word_bytes: int, group_words: int) -> int:
        """The row marker a store writes for words of ``word_bytes`` in groups of ``group_words``
        (:func:`triton_offload.integrity.marker`)."""
        return integrity.marker(self.blocks_per_host_block, word_bytes, group_words)

    def failures(self, check: LoadCheck | None) -> tuple[BlockRefs, int]:
        """(the blocks of a finished load whose check failed, blocks loaded unchecked) under this setting:
        ``"require"`` counts a block stored without a checksum as failed, ``"verify"`` loads it unchecked. Each
        failed block comes with its GPU block, the host block it came from and the identity it was checked under."""
        if check is None:
            return NO_BLOCKS, 0
        if self.require:
            positions = np.union1d(check.failed, check.absent) if check.absent.size else check.failed
            return check.blocks(positions), 0
        return check.blocks(check.failed), int(check.absent.size)

    def __repr__(self) -> str:
        return (f"Checksums({self.setting!r}, {tuple(self.table.shape)} table, f={self.blocks_per_host_block}, "
                f"regions={self.regions})")  # fmt: skip
