"""The kernel path: :class:`CopyLauncher` derives, once per spec, what the copy kernel reads (launch shapes, segment
tables, direct runners, kept in a cache private to this module) and launches a plan's ids; :class:`KernelIssuer`
issues a plan by packing its ids into a pinned slot, uploading them and launching (the
:class:`~triton_offload.issuer.Issuer` of ``path="kernel"``).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping

import numpy as np
import torch

from triton_offload._checks import KERNEL
from triton_offload._checks import launch_shape as check_launch_shape
from triton_offload.kernels import copy_blocks
from triton_offload.kernels._triton_compat import launch_hooks_idle
from triton_offload.layouts import KVCacheSpec
from triton_offload.plan import Direction, TransferPlan
from triton_offload.staging import IdSlot, IdStager

__all__ = ["CopyLauncher", "KernelIssuer"]


class _SpecKernelState:
    """What the kernel derives from one spec, built at most once: tables per element size (and f, for worker
    slots), shapes per access width and tuning, and the direct-launch verdict per compiled variant."""

    def __init__(self) -> None:
        self.tables: dict[tuple[int, int], torch.Tensor] = {}
        self.configs: dict[tuple[int, copy_blocks.LaunchTuning], copy_blocks.LaunchConfig] = {}
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
        tunings: per direction, the :class:`~triton_offload.kernels.copy_blocks.LaunchTuning` to launch with; None
            for :data:`~triton_offload.kernels.copy_blocks.DEFAULT_TUNINGS`.
        configs: launch shapes to use instead of those the tunings give, per direction (see :meth:`twin`).
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        host_buffer: torch.Tensor,
        blocks_per_host_block: int,
        direction: Direction | None = None,
        tunings: Mapping[Direction, copy_blocks.LaunchTuning] | None = None,
        configs: Mapping[Direction, copy_blocks.LaunchConfig] | None = None,
    ):
        self.spec, self.host_buffer, self.blocks_per_host_block = spec, host_buffer, blocks_per_host_block
        self.cuda = spec.device.type == "cuda"
        if self.cuda and os.environ.get("TRITON_INTERPRET", "0") == "1":
            raise RuntimeError("TRITON_INTERPRET=1 is set, which cannot run kernels on CUDA tensors: unset it")
        state = _STATE.get(spec)
        if state is None:
            state = _STATE[spec] = _SpecKernelState()
        self._state = state
        tunings = copy_blocks.DEFAULT_TUNINGS if tunings is None else tunings
        width = copy_blocks.access_width(spec, host_buffer)
        self.directions = tuple(Direction) if direction is None else (direction,)
        self._launch_args = {}
        self._direct: dict[Direction, object] = {}
        for d in self.directions:
            cfg = None if configs is None else configs[d]
            if cfg is None:
                cfg = state.configs.get((width, tunings[d]))
            if cfg is None:
                cfg = state.configs[(width, tunings[d])] = copy_blocks.launch_config(spec, width, tunings[d])
            assert cfg.elem * cfg.vec <= width, "a launch shape may not access wider than the buffers allow"
            key = (cfg.elem, copy_blocks.table_key(spec, blocks_per_host_block))
            table = state.tables.get(key)
            if table is None:
                table = state.tables[key] = copy_blocks.build_segment_table(spec, cfg.elem, key[1])
            host_row = host_buffer.stride(0) * host_buffer.element_size() // cfg.elem
            # The anchor (the table's storage as the element type) and the host view are made once, not per launch.
            anchor, host = table.view(cfg.dtype), host_buffer.view(cfg.dtype)
            # A direct launch passes device addresses as ints (the launcher then skips data_ptr and the driver's
            # pointer lookup); the host buffer stays a tensor, so the launcher translates it as Triton's launch does.
            pointers, addresses = (anchor, host, table), (anchor.data_ptr(), host, table.data_ptr())
            self._launch_args[d] = (cfg, pointers, addresses, host_row, d is Direction.STORE)
        self._current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def twin(self, spec: KVCacheSpec, host_buffer: torch.Tensor, direction: Direction | None = None) -> CopyLauncher:
        """A launcher over other tensors of the same geometry (a canary's), for ``direction`` (None: this one's), that
        launches with this one's launch shapes, so both use the same compiled variants."""
        if direction is None and len(self.directions) == 1:
            direction = self.directions[0]
        configs = {d: self.config(d) for d in self.directions}
        return CopyLauncher(spec, host_buffer, self.blocks_per_host_block, direction, configs=configs)

    @property
    def segment_bytes(self) -> float:
        """Mean bytes of the spec's segments (a page's runs, one kernel row each): what the "size-aware" launch
        shape reads (:func:`~triton_offload.kernels.copy_blocks.size_aware_ctas`). Computed once per spec."""
        if self._state.segment_bytes is None:
            segments = self.spec.segments
            self._state.segment_bytes = sum(s.nbytes for s in segments) / len(segments)
        return self._state.segment_bytes

    def ctas(self, num_ctas: int | None, shape: str) -> int | None:
        """The ``num_ctas`` a launch passes for a user's ``num_ctas`` under launch shape ``shape`` (``"fixed"``:
        as given; ``"size-aware"``: by :attr:`segment_bytes`, never above the user's)."""
        if shape == "fixed":
            return num_ctas
        return copy_blocks.size_aware_ctas(self.segment_bytes, num_ctas)

    def config(self, direction: Direction) -> copy_blocks.LaunchConfig:
        return self._launch_args[direction][0]

    def variant_key(self, direction: Direction) -> tuple:
        """What selects the compiled variant of this launcher's launches in one direction: the launch shape and the
        alignment class of the two data pointers (the only arguments Triton specialises)."""
        cfg, (anchor, host, _), _, _, store = self._launch_args[direction]
        return (cfg, store, self.spec.num_groups > 1, anchor.data_ptr() % 16 == 0, host.data_ptr() % 16 == 0)

    def direct_verdict(self, direction: Direction):
        """The spec's verdict on the direct launch of this launcher's variant in ``direction``: a proven runner, why
        Triton's launch is kept (a str), or None if it was never tried."""
        return self._state.direct.get(self.variant_key(direction))

    def record_direct_verdict(self, direction: Direction, verdict) -> None:
        """Keeps ``verdict`` (a proven runner, or why not) for every launcher of this spec and variant."""
        self._state.direct[self.variant_key(direction)] = verdict

    def arguments(self, plan: TransferPlan, ids, num_ctas: int | None = None, direct: bool = False):
        """(programs, every kernel argument) of one launch (:func:`~triton_offload.kernels.copy_blocks.arguments`).
        ``ids`` is the device id buffer (or, ``direct``, its address; the KV anchor and the table are then passed as
        addresses too)."""
        cfg, pointers, addresses, host_row, store = self._launch_args[plan.direction]
        anchor, host, table = addresses if direct else pointers
        n_segs, f = self.spec.segments_per_group, self.blocks_per_host_block
        return copy_blocks.arguments(cfg, anchor, host, table, ids, plan, n_segs, f, host_row, store, num_ctas)

    def compile_variant(self, direction: Direction):
        """The compiled kernel this launcher's launches in one direction use (compiled now if Triton's cache does
        not hold it yet); CUDA only."""
        ids = torch.zeros(1, dtype=torch.int64, device=self.spec.device)
        one = np.zeros(1, dtype=np.int64)
        plan = TransferPlan(direction, one, one, 1, 1, (1,), (0,), (1,), 0)
        _, args = self.arguments(plan, ids)
        return copy_blocks.compile_variant(args, self.config(direction).num_warps)

    def set_direct(self, direction: Direction, runner) -> None:
        """Launches in ``direction`` call ``runner(programs, stream, args)`` instead of Triton's dispatch (None: back
        to the dispatch)."""
        if runner is None:
            self._direct.pop(direction, None)
        else:
            self._direct[direction] = runner

    def direct(self, direction: Direction):
        """The direct runner of ``direction``, or None when its launches go through Triton's dispatch."""
        return self._direct.get(direction)

    def launch(self, plan: TransferPlan, ids: torch.Tensor, num_ctas: int | None = None) -> None:
        """One launch moving ``plan``'s blocks (all layers, all groups), asynchronously on the current stream.

        Args:
            plan: the validated transfer.
            ids: its id buffer (:func:`~triton_offload.kernels.copy_blocks.pack_ids`) as int64 on the spec's device.
            num_ctas: programs to launch at most (the SMs it occupies); None for the default.
        """
        assert ids.dtype == torch.int64 and ids.device == self.spec.device
        runner = self._direct.get(plan.direction)
        if runner is not None and launch_hooks_idle():  # a profiler's launch hooks need Triton's own path
            if self.cuda:
                programs, args = self.arguments(plan, ids.data_ptr(), num_ctas, direct=True)
                runner(programs, self._current_stream(self.spec.device.index), args)
            else:  # a runner under test, on the interpreter: it needs tensors
                programs, args = self.arguments(plan, ids, num_ctas)
                runner(programs, 0, args)
            return
        programs, args = self.arguments(plan, ids, num_ctas)
        copy_blocks.launch(programs, args, self.config(plan.direction).num_warps, self.cuda)


class KernelIssuer:
    """Issues plans as one kernel launch each: the ids packed straight into a pinned slot (CUDA), uploaded
    asynchronously on the issuing stream and read there by the kernel; on CPU packed into a fresh array and run
    through the interpreter, synchronously.

    A slot stays with the work that reads it: :meth:`issue` returns it, and :meth:`release` hands it back to the pool
    once that work has completed (or with an event after it, which the next taker queries).

    Args:
        launcher: the launcher of the issued plans' directions.
        stager: the pinned id slots (CUDA); None on CPU.
        num_ctas: programs each launch may occupy; None for the kernel's default.
        launch_shape: ``"fixed"`` (``num_ctas`` programs, or the default's) or ``"size-aware"`` (by the spec's page
            runs, at most ``num_ctas``): :mod:`triton_offload.kernels.copy_blocks` explains both.
    """

    path = KERNEL

    def __init__(
        self,
        launcher: CopyLauncher,
        stager: IdStager | None,
        num_ctas: int | None = None,
        launch_shape: str = "fixed",
    ):
        self.launcher, self.stager = launcher, stager
        self.launch_shape = check_launch_shape(launch_shape)
        # Fixed per spec, so chosen once: a launch pays nothing for the shape.
        self.num_ctas = launcher.ctas(num_ctas, self.launch_shape)

    def descriptors(self, plan: TransferPlan) -> int:
        """None: one launch, whatever the blocks."""
        return 0

    def issue(self, plan: TransferPlan, stream: torch.cuda.Stream | None = None, trace=None) -> IdSlot | None:
        """Launches ``plan`` on ``stream`` (None: the current one) and returns the slot its ids were staged in."""
        if self.stager is None:
            self.launcher.launch(plan, torch.from_numpy(copy_blocks.pack_ids(plan)), self.num_ctas)
            return None
        size = copy_blocks.packed_size(plan)
        slot = self.stager.take(size)
        try:
            copy_blocks.pack_ids(plan, slot.host_np)
        except BaseException:
            self.stager.give_back(slot)  # nothing reads it yet
            raise
        if stream is None:
            self._upload_and_launch(plan, slot, size, trace)
        else:
            with torch.cuda.stream(stream):
                self._upload_and_launch(plan, slot, size, trace)
        return slot

    def _upload_and_launch(self, plan: TransferPlan, slot: IdSlot, size: int, trace) -> None:
        # The slot is pinned, so this copy is truly asynchronous; it is not reused before its reader's guard.
        ids = slot.upload(size)
        if trace is not None:
            trace("upload")
        self.launcher.launch(plan, ids, self.num_ctas)
        if trace is not None:
            trace("launch")

    def release(self, slot: IdSlot | None, after: torch.cuda.Event | None = None) -> None:
        """Hands ``slot`` back to the pool: at once if its launch has completed, else once ``after`` has."""
        if slot is not None:
            self.stager.give_back(slot, after)
