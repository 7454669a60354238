"""The kernel's launcher: :class:`CopyLauncher` derives, once per spec, what the copy kernel reads (launch shapes,
segment tables, direct runners, kept in a cache private to this module) and launches a plan's ids, through Triton's
dispatch or a proven direct runner (:mod:`triton_offload.fast_launch`). With a checksum table every launch also
checksums the blocks it moves (docs/integrity.md).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping

import numpy as np
import torch

from triton_offload.checksums import Checksums
from triton_offload.kernels import copy_blocks, packing, shapes, tables
from triton_offload.kernels._triton_compat import launch_hooks_idle
from triton_offload.layouts import KVCacheSpec
from triton_offload.plan import Direction, TransferPlan

__all__ = ["CopyLauncher"]


class _SpecKernelState:
    """What the kernel derives from one spec, built at most once: tables per element size (and f, for worker
    slots), shapes per access width and tuning, and the direct-launch verdict per compiled variant."""

    def __init__(self) -> None:
        # Segment tables by (element size, f key); the integrity checks' tables by ("checks", element size).
        self.tables: dict[tuple, torch.Tensor] = {}
        self.configs: dict[tuple[int, shapes.LaunchTuning, bool], shapes.LaunchConfig] = {}
        # By CopyLauncher.variant_key: a proven direct runner (triton_offload/fast_launch.py), or why that variant
        # keeps Triton's launch.
        self.direct: dict[tuple, object] = {}
        self.segment_bytes: float | None = None


# Keyed by the spec, held weakly: the spec stays a plain description of the caches, and its kernel state goes with it.
# Only CopyLauncher reads or writes it.
_STATE: weakref.WeakKeyDictionary[KVCacheSpec, _SpecKernelState] = weakref.WeakKeyDictionary()


class CopyLauncher:
    """Launches the copy kernel between one spec's KV caches and one host buffer.

    Everything the kernel reads that does not change per transfer (access width, launch shapes, segment tables,
    host strides) is derived here, once; tables and shapes are shared by every launcher of the same spec. Inputs are
    validated by :mod:`triton_offload.plan`; only internal invariants are asserted here. A launch goes through
    Triton's dispatch unless a direct runner of the compiled variant was installed for its direction
    (:meth:`set_direct`, done by :mod:`triton_offload.fast_launch` once proven).

    Args:
        spec: the prepared KV caches.
        host_buffer: (num_host_blocks, host_block_bytes) uint8/int8, row stride may exceed the row (checked by
            :func:`triton_offload.plan.check_host_buffer`).
        blocks_per_host_block: GPU blocks per host block.
        direction: the one direction this launcher serves (a single public call); None for both (an engine).
        tunings: per direction, the :class:`~triton_offload.kernels.shapes.LaunchTuning` to launch with; None
            for :data:`~triton_offload.kernels.shapes.DEFAULT_TUNINGS`.
        configs: launch shapes to use instead of those the tunings give, per direction (see :meth:`twin`).
        checksums: the integrity checks (:class:`~triton_offload.checksums.Checksums`, checked here against the
            host buffer); with them, every launch also checksums the blocks it moves: a store writes their
            checksums, a load checks them (docs/integrity.md). None: no checks (the kernel compiled exactly as
            without them).
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        host_buffer: torch.Tensor,
        blocks_per_host_block: int,
        direction: Direction | None = None,
        tunings: Mapping[Direction, shapes.LaunchTuning] | None = None,
        configs: Mapping[Direction, shapes.LaunchConfig] | None = None,
        checksums: Checksums | None = None,
    ):
        self.spec, self.host_buffer, self.blocks_per_host_block = spec, host_buffer, blocks_per_host_block
        self.checksums = checksums
        self.cuda = spec.device.type == "cuda"
        if self.cuda and os.environ.get("TRITON_INTERPRET", "0") == "1":
            raise RuntimeError("TRITON_INTERPRET=1 is set, which cannot run kernels on CUDA tensors: unset it")
        state = _STATE.get(spec)
        if state is None:
            state = _STATE[spec] = _SpecKernelState()
        self._state = state
        tunings = shapes.DEFAULT_TUNINGS if tunings is None else tunings
        width = tables.access_width(spec, host_buffer)
        self.directions = tuple(Direction) if direction is None else (direction,)
        self._launch_args = {}
        self._checks: dict[Direction, tuple] = {}
        # By (direction, copy): copy False is the checksum-only launch of the copy-engine path.
        self._direct: dict[tuple[Direction, bool], object] = {}
        if checksums is not None:
            checksums.check_for(host_buffer.shape[0], blocks_per_host_block, spec.num_regions, self.cuda)
        for d in self.directions:
            cfg = None if configs is None else configs[d]
            shape_key = (width, tunings[d], checksums is not None)
            if cfg is None:
                cfg = state.configs.get(shape_key)
            if cfg is None:
                cfg = state.configs[shape_key] = shapes.launch_config(spec, width, tunings[d], checksums is not None)
            assert cfg.elem * cfg.vec <= width, "a launch shape may not access wider than the buffers allow"
            key = (cfg.elem, tables.table_key(spec, blocks_per_host_block))
            table = state.tables.get(key)
            if table is None:
                table = state.tables[key] = tables.build_segment_table(spec, cfg.elem, key[1])
            host_row = host_buffer.stride(0) * host_buffer.element_size() // cfg.elem
            # The anchor (the table's storage as the element type) and the host view are made once, not per launch.
            anchor, host = table.view(cfg.dtype), host_buffer.view(cfg.dtype)
            # A direct launch passes device addresses as ints (the launcher then skips data_ptr and the driver's
            # pointer lookup); the host buffer stays a tensor, so the launcher translates it as Triton's launch does.
            pointers, addresses = (anchor, host, table), (anchor.data_ptr(), host, table.data_ptr())
            self._launch_args[d] = (cfg, pointers, addresses, host_row, d is Direction.STORE)
            if checksums is not None:
                ck = state.tables.get(("checks", cfg.elem))
                if ck is None:
                    ck = state.tables[("checks", cfg.elem)] = tables.build_integrity_table(spec, cfg.elem)
                # The table stays a tensor in a direct launch too (host memory, translated as the host buffer is).
                tab = checksums.table
                self._checks[d] = (ck, ck.data_ptr(), tab, tab.stride(0), checksums.marker(cfg.elem, cfg.vec))
        self._current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def twin(
        self,
        spec: KVCacheSpec,
        host_buffer: torch.Tensor,
        direction: Direction | None = None,
        checksums: Checksums | None = None,
    ) -> CopyLauncher:
        """A launcher over other tensors of the same geometry (a canary's), for ``direction`` (None: this one's), that
        launches with this one's launch shapes, so both use the same compiled variants; with the integrity checks
        where this one has them (``checksums``: the twin's own, required then)."""
        if direction is None and len(self.directions) == 1:
            direction = self.directions[0]
        if (checksums is None) != (self.checksums is None):
            raise ValueError("a twin has a checksum table exactly when its launcher has one")
        configs = {d: self.config(d) for d in self.directions}
        return CopyLauncher(
            spec, host_buffer, self.blocks_per_host_block, direction, configs=configs, checksums=checksums
        )

    @property
    def integrity(self) -> bool:
        """Whether this launcher's launches checksum what they move."""
        return self.checksums is not None

    @property
    def segment_bytes(self) -> float:
        """Mean bytes of the spec's segments (a page's runs, one kernel row each): what the "size-aware" launch
        shape reads (:func:`~triton_offload.kernels.shapes.size_aware_ctas`). Computed once per spec."""
        if self._state.segment_bytes is None:
            segments = self.spec.segments
            self._state.segment_bytes = sum(s.nbytes for s in segments) / len(segments)
        return self._state.segment_bytes

    def ctas(self, num_ctas: int | None, shape: str) -> int | None:
        """The ``num_ctas`` a launch passes for a user's ``num_ctas`` under launch shape ``shape`` (``"fixed"``:
        as given; ``"size-aware"``: by :attr:`segment_bytes`, never above the user's)."""
        if shape == "fixed":
            return num_ctas
        return shapes.size_aware_ctas(self.segment_bytes, num_ctas)

    def config(self, direction: Direction) -> shapes.LaunchConfig:
        return self._launch_args[direction][0]

    def variant_key(self, direction: Direction, copy: bool = True) -> tuple:
        """What selects the compiled variant of this launcher's launches in one direction: the launch shape, the
        alignment class of the two data pointers (the only arguments Triton specialises), and whether it checksums
        (and, then, whether it copies)."""
        cfg, (anchor, host, _), _, _, store = self._launch_args[direction]
        key = (cfg, store, self.spec.num_groups > 1, anchor.data_ptr() % 16 == 0, host.data_ptr() % 16 == 0)
        return key if self.checksums is None else (*key, "integrity", copy)

    def direct_verdict(self, direction: Direction, copy: bool = True):
        """The spec's verdict on the direct launch of this launcher's variant in ``direction``: a proven runner, why
        Triton's launch is kept (a str), or None if it was never tried."""
        return self._state.direct.get(self.variant_key(direction, copy))

    def record_direct_verdict(self, direction: Direction, verdict, copy: bool = True) -> None:
        """Keeps ``verdict`` (a proven runner, or why not) for every launcher of this spec and variant."""
        self._state.direct[self.variant_key(direction, copy)] = verdict

    def arguments(
        self, plan: TransferPlan, ids, num_ctas: int | None = None, direct: bool = False, res=None, copy: bool = True
    ):
        """(programs, every kernel argument) of one launch (:func:`~triton_offload.kernels.copy_blocks.arguments`).
        ``ids`` is the device id buffer (or, ``direct``, its address; the KV anchor and the table are then passed as
        addresses too); with the integrity checks, it holds their part too (:func:`~triton_offload.kernels.
        packing.pack_integrity`), and ``res`` receives a load's results (host memory). ``copy`` False: the
        checksum-only launch."""
        cfg, pointers, addresses, host_row, store = self._launch_args[plan.direction]
        anchor, host, table = addresses if direct else pointers
        n_segs, f = self.spec.segments_per_group, self.blocks_per_host_block
        checks = None
        if self.checksums is not None:
            ck, ck_addr, tab, tab_row, mark = self._checks[plan.direction]
            at_ident, at_sums, _ = packing.integrity_offsets(plan)
            if direct:
                ident, sums = ids + 8 * at_ident, ids + 8 * at_sums
            else:
                ident, sums = ids[at_ident:at_sums], ids[at_sums:]
            checks = copy_blocks.IntegrityArgs(ck_addr if direct else ck, ident, sums, res, tab, tab_row, mark)
        return copy_blocks.arguments(
            cfg, anchor, host, table, ids, plan, n_segs, f, host_row, store, num_ctas, checks, copy
        )

    def compile_variant(self, direction: Direction, copy: bool = True):
        """The compiled kernel this launcher's launches in one direction use (compiled now if Triton's cache does
        not hold it yet); CUDA only."""
        # One block per group: a spec with several groups always plans them all, so its launches are MULTI_GROUP
        # (a constexpr the compiled variant bakes in; the 11-28 H200 run's canary caught a one-group variant).
        groups = self.spec.num_groups
        zeros = np.zeros(groups, dtype=np.int64)
        plan = TransferPlan(direction, zeros, zeros, groups, groups, (1,) * groups, (0,) * groups, (1,) * groups, 0)
        ids = torch.zeros(packing.packed_size(plan, self.integrity), dtype=torch.int64, device=self.spec.device)
        res = (
            torch.zeros(packing.result_size(plan), dtype=torch.int64, pin_memory=self.cuda) if self.integrity else None
        )
        _, args = self.arguments(plan, ids, res=res, copy=copy)
        return copy_blocks.compile_variant(args, self.config(direction).num_warps)

    def set_direct(self, direction: Direction, runner, copy: bool = True) -> None:
        """Launches in ``direction`` call ``runner(programs, stream, args)`` instead of Triton's dispatch (None: back
        to the dispatch)."""
        if runner is None:
            self._direct.pop((direction, copy), None)
        else:
            self._direct[(direction, copy)] = runner

    def direct(self, direction: Direction, copy: bool = True):
        """The direct runner of ``direction``, or None when its launches go through Triton's dispatch."""
        return self._direct.get((direction, copy))

    def launch(
        self, plan: TransferPlan, ids: torch.Tensor, num_ctas: int | None = None, res=None, copy: bool = True
    ) -> None:
        """One launch moving ``plan``'s blocks (all layers, all groups), asynchronously on the current stream.

        Args:
            plan: the validated transfer.
            ids: its id buffer (:func:`~triton_offload.kernels.packing.pack_ids`, and with the integrity checks
                :func:`~triton_offload.kernels.packing.pack_integrity`) as int64 on the spec's device.
            num_ctas: programs to launch at most (the SMs it occupies); None for the default.
            res: with the integrity checks, where a load's results go: int64 host memory of at least
                :func:`~triton_offload.kernels.packing.result_size` elements (pinned on CUDA).
            copy: False: move nothing, only checksum the GPU side of the plan's blocks (with the integrity checks).
        """
        assert ids.dtype == torch.int64 and ids.device == self.spec.device
        assert copy or self.checksums is not None, "a launch that moves nothing must check something"
        runner = self._direct.get((plan.direction, copy))
        if runner is not None and launch_hooks_idle():  # a profiler's launch hooks need Triton's own path
            if self.cuda:
                programs, args = self.arguments(plan, ids.data_ptr(), num_ctas, direct=True, res=res, copy=copy)
                runner(programs, self._current_stream(self.spec.device.index), args)
            else:  # a runner under test, on the interpreter: it needs tensors
                programs, args = self.arguments(plan, ids, num_ctas, res=res, copy=copy)
                runner(programs, 0, args)
            return
        programs, args = self.arguments(plan, ids, num_ctas, res=res, copy=copy)
        copy_blocks.launch(programs, args, self.config(plan.direction).num_warps, self.cuda)
