"""One benchmark run's state, shared by both modes: the methods (:class:`MethodSpec`), one workload's buffers
(:class:`Group`), the cases built from them, the byte check of a method on a case, and the rows and the result
document every row and check lands in."""

from __future__ import annotations

import contextlib
import gc
import math
import platform
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import triton

import triton_offload as to
from triton_offload.kernels.copy_blocks import DEFAULT_NUM_CTAS

# isort: split
# Sibling modules: bench/ is on sys.path when this runs as a script (it is not a package).
from baselines import METHODS, Triton
from case import Env, Prepared, TransferCase, Unavailable, runs_of
from cuda_driver import driver_info, load_driver
from grid import host_rows
from report import say
from results import BASELINE_ORDER, machine_info, new_row
from timing import Timing, gbps
from verify import check_method, reference_blocks
from workloads import Workload, make_caches

__all__ = [
    "BASELINE_ORDER",
    "MethodSpec",
    "method_specs",
    "Group",
    "allocate",
    "make_case",
    "release",
    "environment",
    "open_gpu",
    "FatalCudaError",
    "Session",
]


@dataclass(frozen=True)
class MethodSpec:
    """A row label of the sweep: the JSON ``method`` and ``num_ctas`` and how to build the method."""

    label: str
    num_ctas: int | None
    factory: Callable[[], object]

    @property
    def name(self) -> str:
        return f"triton[{self.num_ctas}]" if self.label == "triton" else self.label


def triton_spec(num_ctas: int) -> MethodSpec:
    """Triton at ``num_ctas``; the default is run as ``num_ctas=None``, the way a user calls it."""
    return MethodSpec("triton", num_ctas, lambda: Triton(None if num_ctas == DEFAULT_NUM_CTAS else num_ctas))


def method_specs(ctas: list[int], baselines=BASELINE_ORDER, integrity: bool = False) -> list[MethodSpec]:
    """Triton at every given num_ctas, with ``integrity`` the integrity checks' variant at the default num_ctas
    (``triton_integrity``, issue 41), then the baselines."""
    checked = [MethodSpec("triton_integrity", None, METHODS["triton_integrity"])] if integrity else []
    return [triton_spec(c) for c in ctas] + checked + [MethodSpec(name, None, METHODS[name]) for name in baselines]


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
    return Group(w, layout, spec, runs_of(spec), host_flat, staging, g_src, g_dst, expected, rng)


def make_case(group: Group, n: int, f: int, skip: int, store: bool) -> TransferCase:
    bpb = group.spec.bytes_per_block
    m = math.ceil((skip + n) / f)
    rows = host_rows(n, f, skip)
    host = group.host_flat[: rows * f * bpb].view(rows, f * bpb)
    host_ids = group.rng.permutation(rows)[:m].astype(np.int64)
    gpu_ids = (group.g_src if store else group.g_dst)[:n]
    return TransferCase(group.spec, group.runs, host, gpu_ids, host_ids, f, skip, store, group.staging, group.g_src[:n])


def release(device: torch.device) -> None:
    """Frees what the last group held, device and pinned host memory both, before the next is allocated."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        # PyTorch caches pinned blocks too; names differ across versions.
        empty_host = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or getattr(
            torch._C, "_host_emptyCache", None
        )
        if empty_host is not None:
            empty_host()


def environment(device: torch.device, driver_note: str) -> dict:
    """The machine and versions a results file records."""
    info = {
        **machine_info(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "triton_offload": to.__version__,
        "cuda_driver_api": driver_note,
        "default_num_ctas": DEFAULT_NUM_CTAS,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=torch.cuda.get_device_name(device), sms=props.multi_processor_count, **driver_info())
    else:
        info.update(device=f"cpu ({platform.machine()})", sms=None, driver=None, driver_cuda=None)
    return info


def open_gpu() -> tuple[torch.device, torch.cuda.Stream, Env, dict]:
    """What every GPU measurement starts from: the current device (its primary context created), the benchmark's
    own stream, the methods' :class:`Env` and the run's :func:`environment`."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.empty(1, device=device)  # creates the primary context on this thread before the driver API looks for it
    stream = torch.cuda.Stream(device)  # not the legacy default stream: cuMemcpyBatchAsync rejects that one
    driver, driver_note = load_driver(device.index)
    return device, stream, Env(device, driver, driver_note, stream.cuda_stream), environment(device, driver_note)


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


class FatalCudaError(RuntimeError):
    """The CUDA context is unusable (a sticky error such as an illegal address): nothing after it can be measured."""


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
                prepared = ms.factory().prepare(case, self.env)
                impls = self.impls.setdefault(ms.name, [])
                if prepared.impl not in impls:
                    impls.append(prepared.impl)
                problem = check_method(case, prepared, group.expected[: case.n])
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
