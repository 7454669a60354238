"""The FP8 host format's launcher: :class:`Fp8Launcher` derives, once per spec and host buffer, what the FP8 kernel
(``kernels/fp8_blocks.py``) reads and launches a plan's ids through Triton's dispatch, in the place of a
:class:`~triton_offload.issuers.launcher.CopyLauncher` for specs whose ``host_format`` quantizes. With a checksum
table every launch also checksums the bytes it stores or reads on the host (docs/integrity.md). Not yet offered: the
direct launch.
"""

from __future__ import annotations

import os

import torch

from triton_offload.checksums import Checksums
from triton_offload.kernels import fp8_blocks, packing, tables
from triton_offload.kernels.copy_blocks import IntegrityArgs
from triton_offload.layouts import KVCacheSpec
from triton_offload.plan import Direction, TransferPlan

__all__ = ["Fp8Launcher"]


class Fp8Launcher:
    """Launches the FP8 kernel between one quantizing spec's KV caches and one host buffer.

    Args:
        spec: the prepared KV caches, with a quantizing ``host_format`` (``spec.quant`` set).
        host_buffer: (num_host_blocks, host_block_bytes) uint8/int8, checked by
            :func:`triton_offload.plan.check_host_buffer`; its row stride a multiple of 4 bytes (the scales are
            fp32).
        blocks_per_host_block: GPU blocks per host block.
        direction: the one direction served; None for both.
        checksums: the integrity checks (:class:`~triton_offload.checksums.Checksums`, checked against the host
            buffer): every launch also checksums the bytes it stores (a store writes the checksums) or reads (a load
            checks them), the FP8 values and scales of each block in words of :func:`~triton_offload.kernels.
            fp8_blocks.fp8_word_bytes`; None: no checks (the kernel compiled exactly as without them).
    """

    def __init__(self, spec: KVCacheSpec, host_buffer: torch.Tensor, blocks_per_host_block: int,
                 direction: Direction | None = None, checksums: Checksums | None = None):  # fmt: skip
        assert spec.quant is not None, "a spec whose host format moves bytes takes the copy kernel"
        self.checksums = checksums
        self.cuda = spec.device.type == "cuda"
        if self.cuda and os.environ.get("TRITON_INTERPRET", "0") == "1":
            raise RuntimeError("TRITON_INTERPRET=1 is set, which cannot run kernels on CUDA tensors: unset it")
        row = host_buffer.stride(0) * host_buffer.element_size()
        if row % 4 or host_buffer.data_ptr() % 4:
            raise ValueError(f"host_buffer rows must be 4-byte aligned for {spec.host_format!r}, row stride {row}")
        self.spec, self.host_buffer, self.blocks_per_host_block = spec, host_buffer, blocks_per_host_block
        self.directions = tuple(Direction) if direction is None else (direction,)
        self.cfg = fp8_blocks.fp8_config(spec, row)
        self.table = fp8_blocks.build_fp8_table(spec, blocks_per_host_block)
        self.anchor = self.table.view(spec.kv_caches[0].dtype)
        self.host = host_buffer.view(torch.uint8)
        # The scales' view of the same bytes: (rows, row stride / 4) fp32 from the buffer's start.
        self.scales = torch.as_strided(host_buffer.view(torch.uint8), (row * host_buffer.shape[0],), (1,)).view(
            torch.float32
        )
        self.host_row = row
        self.word = fp8_blocks.fp8_word_bytes(spec)
        self._checks = None
        if checksums is not None:
            checksums.check_for(host_buffer.shape[0], blocks_per_host_block, spec.num_regions, self.cuda)
            runs = spec.quant
            ck = tables.build_integrity_table(spec, self.word, lambda s: fp8_blocks.fp8_stream_bytes(runs[s.layer]))
            tab = checksums.table
            self._checks = (ck, tab, tab.stride(0), checksums.marker(self.word, 1))

    @property
    def integrity(self) -> bool:
        """Whether this launcher's launches checksum what they store or read."""
        return self.checksums is not None

    def ctas(self, num_ctas: int | None, shape: str) -> int | None:
        """The ``num_ctas`` a launch passes: as given (one launch shape: the FP8 kernel is not tuned yet)."""
        return num_ctas

    def direct(self, direction: Direction, copy: bool = True):
        return None

    def arguments(self, plan: TransferPlan, ids, num_ctas: int | None = None, res=None):
        """(programs, every kernel argument) of one launch (:func:`~.fp8_blocks.fp8_arguments`); with the integrity
        checks, ``ids`` holds their part too (:func:`~triton_offload.kernels.packing.pack_integrity`) and ``res``
        receives a load's results (host memory), as for the copy kernel."""
        checks = None
        if self._checks is not None:
            ck, tab, tab_row, mark = self._checks
            at_ident, at_sums, _ = packing.integrity_offsets(plan)
            checks = IntegrityArgs(ck, ids[at_ident:at_sums], ids[at_sums:], res, tab, tab_row, mark)
        return fp8_blocks.fp8_arguments(self.cfg, self.anchor, self.host, self.scales, self.table, ids, plan,
                                        self.spec.segments_per_group, self.blocks_per_host_block, self.host_row,
                                        num_ctas, checks, self.word)  # fmt: skip

    def launch(self, plan: TransferPlan, ids: torch.Tensor, num_ctas: int | None = None, res=None, copy=True) -> None:
        """One launch moving ``plan``'s blocks (all layers, all groups), asynchronously on the current stream; with
        the integrity checks, ``res`` as for :meth:`~triton_offload.issuers.launcher.CopyLauncher.launch`."""
        assert ids.dtype == torch.int64 and ids.device == self.spec.device
        assert copy, "the FP8 kernel always moves the blocks (the copy engines cannot quantize)"
        programs, args = self.arguments(plan, ids, num_ctas, res)
        fp8_blocks.fp8_launch(programs, args, self.cfg[-1], self.cuda)
