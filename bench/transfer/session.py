"""One benchmark run's state, shared by both modes: the methods (:class:`MethodSpec`), one workload's buffers
(:class:`Group`), the cases built from them, the byte check of a method on a case, and the rows and the result
document every row and check lands in."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch

import triton_offload as to
from bench.baselines import METHODS
from bench.common.case import Prepared, TransferCase, Unavailable, byte_runs
from bench.common.env import Env, FatalCudaError
from bench.common.grid import host_rows
from bench.common.report import say
from bench.common.results import BASELINE_ORDER, INTEGRITY_METHOD, new_row
from bench.common.timing import Timing, gbps
from bench.common.verify import check_method, reference_blocks
from bench.common.workloads import Workload, make_caches

__all__ = [
    "BASELINE_ORDER",
    "MethodSpec",
    "method_specs",
    "Group",
    "allocate",
    "make_case",
    "Session",
]


@dataclass(frozen=True)
class MethodSpec:
    """A row label of the sweep: the JSON ``method`` (a name of :data:`bench.baselines.METHODS`) and ``num_ctas``."""

    label: str
    num_ctas: int | None = None

    @property
    def name(self) -> str:
        return f"triton[{self.num_ctas}]" if self.label == "triton" else self.label

    def prepare(self, case: TransferCase, env: Env) -> Prepared:
        """The method bound to ``case`` (:meth:`bench.baselines.Method.prepare`)."""
        return METHODS[self.label].prepare(case, env, self.num_ctas)


def method_specs(ctas: list[int], baselines=BASELINE_ORDER, integrity: bool = False) -> list[MethodSpec]:
    """Triton at every given num_ctas; with ``integrity``, right after it the kernel with the integrity checks at the
    default num_ctas (``triton_integrity``: docs/integrity.md), to compare with ``triton`` at that num_ctas in the
    same run; then the baselines."""
    checked = [MethodSpec(INTEGRITY_METHOD)] if integrity else []
    return [MethodSpec("triton", c) for c in ctas] + checked + [MethodSpec(name) for name in baselines]


@dataclass
class Group:
    """One workload in one layout: caches, host buffer, staging buffer, block ids and the reference bytes."""

    workload: Workload
    layout: str
    spec: to.KVCacheSpec
    runs: list
    host_flat: torch.Tensor
    staging: torch.Tensor
    g_src: np.ndarray
    g_dst: np.ndarray
    expected: torch.Tensor
    rng: np.random.Generator


def allocate(w: Workload, layout: str, n_max: int, host_configs, device: torch.device, seed: int) -> Group:
    """Caches with room for disjoint store sources and load destinations, one pinned host buffer sized for the
    largest transfer of any host configuration (each case is a view of it), and the expected bytes."""
    num_blocks = 2 * n_max + 16
    spec = to.KVCacheSpec(make_caches(w, layout, num_blocks, device, seed), layout)
    bpb = spec.bytes_per_block
    host_bytes = max(host_rows(n_max, f, skip) * f for f, skip in host_configs) * bpb
    host_flat = torch.empty(host_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    staging = torch.empty(n_max * bpb, dtype=torch.uint8, device=device)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(num_blocks).astype(np.int64)  # random, non-contiguous ids
    g_src, g_dst = perm[:n_max], perm[n_max : 2 * n_max]
    expected = reference_blocks(spec, g_src, device)
    return Group(w, layout, spec, byte_runs(spec), host_flat, staging, g_src, g_dst, expected, rng)


def make_case(group: Group, n: int, f: int, skip: int, store: bool) -> TransferCase:
    bpb = group.spec.bytes_per_block
    m = math.ceil((skip + n) / f)
    rows = host_rows(n, f, skip)
    host = group.host_flat[: rows * f * bpb].view(rows, f * bpb)
    host_ids = group.rng.permutation(rows)[:m].astype(np.int64)
    gpu_ids = (group.g_src if store else group.g_dst)[:n]
    return TransferCase(group.spec, group.runs, host, gpu_ids, host_ids, f, skip, store, group.staging, group.g_src[:n])


def _labels(group: Group, case: TransferCase, ms: MethodSpec) -> dict:
    """What names one method on one case, in a check entry and in a row."""
    return {
        "workload": group.workload.name,
        "layout": group.layout,
        "direction": case.direction,
        "method": ms.label,
        "num_ctas": ms.num_ctas,
        "blocks": case.n,
        "blocks_per_host_block": case.f,
        "skip": case.skip,
    }


class Session:
    """Everything one benchmark run accumulates."""

    def __init__(self, meta: dict, env: Env, specs: list[MethodSpec], stream: torch.cuda.Stream | None = None):
        self.meta, self.env, self.specs = meta, env, specs
        # Checks run on the benchmark's stream, as the timings do (None on CPU).
        self.stream_context = (lambda: torch.cuda.stream(stream)) if stream is not None else contextlib.nullcontext
        self.rows: list[dict] = []
        self.checks: list[dict] = []
        self.failures: list[dict] = []
        self.impls: dict[str, list[str]] = {}  # method -> every implementation it used (vllm033 has two)
        self.skipped: dict[str, str] = {}  # method -> why it cannot run on this machine
        self.peak_cache: dict = {}

    def check(self, group: Group, case: TransferCase, ms: MethodSpec) -> tuple[str, str, Prepared | None]:
        """(status, note, prepared) of one method on one case, recorded (:meth:`record_check`): pass, FAIL (wrong
        bytes), ERROR (raised), n/a (cannot run here). The prepared method is returned for timing, which only a
        ``pass`` allows."""
        status, note, prepared = self._verify(group, case, ms)
        self.record_check(group, case, ms, status, note)
        return status, note, prepared

    def _verify(self, group: Group, case: TransferCase, ms: MethodSpec) -> tuple[str, str, Prepared | None]:
        try:
            with self.stream_context():  # buffers a method allocates belong to the stream that uses them
                prepared = ms.prepare(case, self.env)
                engine_timed = prepared.device_ms is not None
                if not engine_timed:
                    self._record_impl(ms, prepared)
                problem = check_method(case, prepared, group.expected[: case.n])
                if engine_timed:  # an engine's call: waited for and reported, with the path it took
                    prepared.device_ms(1)
                    self._record_impl(ms, prepared)
        except Unavailable as exc:
            return "n/a", str(exc), None
        except Exception as exc:  # a CUDA error or an ABI mismatch: the method cannot be trusted, say so loudly
            if not self.env.alive():
                raise FatalCudaError(f"{ms.name} on {group.workload.name}/{group.layout}: {exc}") from exc
            return "ERROR", f"{type(exc).__name__}: {exc}", None
        if problem is not None:
            return "FAIL", problem, prepared
        if prepared.emulated:
            return "n/a", "needs CUDA; its copy plan was replayed with memmove on CPU: bytes correct", prepared
        return "pass", "", prepared

    def _record_impl(self, ms: MethodSpec, prepared: Prepared) -> None:
        impls = self.impls.setdefault(ms.name, [])
        if prepared.impl not in impls:
            impls.append(prepared.impl)

    def record_check(self, group: Group, case: TransferCase, ms: MethodSpec, status: str, note: str) -> None:
        entry = {**_labels(group, case, ms), "status": status, "note": note}
        self.checks.append(entry)
        if status == "n/a" and self.env.cuda and ms.name not in self.skipped:
            self.skipped[ms.name] = note
            say(f"skipping {ms.name}: {note}", "yellow")
        if status in ("FAIL", "ERROR"):
            self.failures.append(entry)
            say(f"{status}: {ms.name} {group.workload.name}/{group.layout} {case.direction}: {note}", "bold red")

    def row(self, group: Group, case: TransferCase, ms: MethodSpec, impl, status, note, timing: Timing | None = None):
        """A :data:`results.ROW_KEYS` row for one method on one case; the timing fields stay None without samples."""
        row = new_row(
            device=self.meta["device"],
            **_labels(group, case, ms),
            impl=impl,
            page_bytes=group.spec.page_bytes[0],
            num_layers=group.spec.num_layers,
            total_bytes=case.total_bytes,
            status=status,
            note=note or None,
        )
        if timing is not None:
            row.update(timing.fields())
            row["gbps"] = round(gbps(case.total_bytes, row["median_ms"]), 3)
        return row

    def method_impls(self) -> list[tuple[str, str]]:
        """(method, implementation) for every implementation each method used, for the methods table."""
        return [(m, impl) for m, impls in self.impls.items() for impl in impls]

    def result(self, mode: str, args, complete: bool, **sections) -> dict:
        """The results document: the envelope both benchmarks share, then this run's sections."""
        return {
            "benchmark": "transfer",
            "mode": mode,
            "complete": complete,
            **self.meta,
            "args": dict(vars(args)),
            "rows": self.rows,
            "verification": self.checks,
            "methods": {name: " | ".join(impls) for name, impls in self.impls.items()},
            "skipped_methods": self.skipped,
            "failures": self.failures,
            **sections,
        }
