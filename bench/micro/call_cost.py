#!/usr/bin/env python3
"""Where the host time of one transfer call goes, at 1024 blocks x 80 layers (Llama-3-70B TP8 pages, kv_first): the
whole public ``gather_blocks`` / ``scatter_blocks`` call and ``TransferEngine.submit_store`` / ``submit_load`` (the vLLM
plugin's path), each with the direct launch (triton_offload/fast_launch.py) and with Triton's dispatch, in one run; the
steps of a submit as timed *inside* real calls (the engine's trace hook), so they add up to the whole; and the steps of
a public call timed alone. Medians, p99 and minimum over ``--calls`` calls (:func:`timed`); each row says what its
launches went through (:func:`launch_used`), and the JSON is rewritten after each measurement (:func:`main`).

    python -m bench.micro.call_cost [--json PATH]     # on a GPU
    python -m bench.micro.call_cost --tiny            # any machine: a tiny shape (on CPU the launch is the interpreter)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

import triton_offload as to
from bench.common.grid import CALL_COST_CALLS
from bench.common.results import machine_info, write_json
from bench.common.timing import stats_us
from bench.common.workloads import WORKLOADS, make_caches
from triton_offload.checksums import Checksums
from triton_offload.engine import TransferEngine
from triton_offload.fast_launch import DIRECT, FAST_LAUNCH_ENV, enable_fast_launch
from triton_offload.host.cache import HostCache
from triton_offload.issuers.launcher import CopyLauncher
from triton_offload.kernels._triton_compat import launch_hooks_idle
from triton_offload.kernels.packing import pack_ids
from triton_offload.plan import Direction, check_host_buffer
from triton_offload.transfer import planner_for

BURST = 8
# The engine's trace points in order (triton_offload/engine.py): each step is the time from the previous point.
ENGINE_STEPS = {
    "plan": "plan: validation",
    "fence": "fence: event on the compute stream + wait",
    "upload": "upload: start event + stream switch + packing into the pinned slot + id copy",
    "launch": "launch: kernel launch",
    "done": "end event + bookkeeping",
}
PUBLIC_STEPS, PUBLIC_CALLS = "public steps", "public calls"
ENGINE_SUBMITS, ENGINE_TRACE = "engine submits", "engine submit steps (inside the calls above)"
# A row's "launch": what its launches went through: DIRECT ("direct"), or
TRITON_DISPATCH = "triton dispatch"  # the row did not ask for the direct launch
REFUSED = "direct refused: "  # it asked; followed by why Triton's dispatch ran instead

Sections = dict[str, dict[str, dict]]


def launch_used(asked: bool, verdict) -> str:
    """A row's ``launch``: :data:`TRITON_DISPATCH` where the direct launch was not asked for, else ``verdict``
    (:func:`~triton_offload.fast_launch.enable_fast_launch`'s, per direction: DIRECT or why not) as DIRECT or
    :data:`REFUSED` with the reason. A launch hook (a profiler's) also keeps Triton's launch
    (CopyLauncher.launch).

    Every row says what its launches went through (``launch``): ``direct``, ``triton dispatch`` (the row did not ask
    for the direct launch) or ``direct refused: <why>`` (it asked, and the canary refused it, or it cannot apply: on
    CPU); None for a step that launches nothing. A row's name says what it asked for."""
    if not asked:
        return TRITON_DISPATCH
    if verdict != DIRECT:
        return REFUSED + str(verdict)
    if not launch_hooks_idle():
        return REFUSED + "a launch hook is installed, and CopyLauncher.launch then takes Triton's launch"
    return DIRECT


def public_launch(s: Setup, direction: Direction, fast: bool) -> str:
    """What the public calls' launches in ``direction`` went through, as triton_offload/transfer.py decides: on CPU
    Triton's launch (the interpreter) always; on CUDA the direct launch where the spec's verdict on its variant
    (recorded by the first call that asked, kept per spec by CopyLauncher) is a proven runner."""
    if s.device.type != "cuda":
        return launch_used(fast, "not applicable: the public calls on CPU always take Triton's launch (interpreter)")
    verdict = CopyLauncher(s.spec, s.host, 1, direction).direct_verdict(direction)
    if verdict is None:
        verdict = "never proven: no call asked for it"
    return launch_used(fast, verdict if isinstance(verdict, str) else DIRECT)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, calls: int, drain=None) -> dict:
    """Host time of ``fn()``, called in bursts of BURST; ``drain()`` (default: a device synchronize, or waiting for
    the engine's jobs) runs before each burst and at the end, outside the timing, so the GPU's queue stays short.
    Returns :func:`timing.stats_us` plus p99."""
    drain = drain or (lambda: _sync(device))
    ts = []
    for i in range(calls):
        if i % BURST == 0:
            drain()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    drain()
    return {**stats_us(ts), "p99_us": round(float(np.quantile(ts, 0.99)) * 1e6, 2)}


@dataclasses.dataclass
class Setup:
    device: torch.device
    spec: to.KVCacheSpec
    host: torch.Tensor
    cache: HostCache
    g: np.ndarray
    h: np.ndarray


def setup(tiny: bool) -> Setup:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    w = WORKLOADS["llama3-70b-tp8"]
    n, num_blocks, host_blocks = (8, 20, 12) if tiny else (1024, 2100, 1100)
    if tiny:
        w = dataclasses.replace(w.tiny(), num_layers=4)
    spec = to.KVCacheSpec(make_caches(w, "kv_first", num_blocks, device), "kv_first")
    cache = HostCache(spec.host_block_bytes(1), num_blocks=host_blocks, pin=device.type == "cuda")
    rng = np.random.default_rng(0)
    g = rng.permutation(num_blocks)[:n].astype(np.int64)
    h = rng.permutation(host_blocks)[:n].astype(np.int64)
    return Setup(device, spec, cache.buffer, cache, g, h)


def public_calls(s: Setup, calls: int, fast: bool) -> dict[str, dict]:
    """The whole public calls, with the direct launch on or off (the environment switch the calls read; the caller's
    setting, or its absence, is put back afterwards)."""
    prior = os.environ.get(FAST_LAUNCH_ENV)
    os.environ[FAST_LAUNCH_ENV] = "1" if fast else "0"
    try:
        gather = lambda: to.gather_blocks(s.spec, s.g, s.host, s.h)  # noqa: E731
        scatter = lambda: to.scatter_blocks(s.host, s.h, s.spec, s.g)  # noqa: E731
        gather(), scatter()  # compiles, proves the direct launch, fills the staging pool
        _sync(s.device)
        label = "direct launch" if fast else "Triton's dispatch"
        return {
            f"gather_blocks, {label}": {
                **timed(gather, s.device, calls),
                "launch": public_launch(s, Direction.STORE, fast),
            },
            f"scatter_blocks, {label}": {
                **timed(scatter, s.device, calls),
                "launch": public_launch(s, Direction.LOAD, fast),
            },
        }
    finally:
        if prior is None:
            os.environ.pop(FAST_LAUNCH_ENV, None)
        else:
            os.environ[FAST_LAUNCH_ENV] = prior


def public_steps(s: Setup, calls: int, launches: bool) -> dict[str, dict]:
    """Steps of a public call (a store) timed alone: the checks, the planning, the launcher; with ``launches`` (on
    CUDA) also the direct launch's verdict lookup and the launch alone, direct (if not refused) and through Triton's
    dispatch."""
    planner = planner_for(s.spec, s.host.shape[0], 1)
    staging = np.empty(4 * len(s.g) + 16, dtype=np.int64)
    out = {
        "check_host_buffer": timed(lambda: check_host_buffer(s.spec, s.host, 1), s.device, calls),
        "plan: validation + packing": timed(
            lambda: pack_ids(planner.plan(s.g, s.h, direction=Direction.STORE), staging), s.device, calls
        ),
        "CopyLauncher(...)": timed(lambda: CopyLauncher(s.spec, s.host, 1, Direction.STORE), s.device, calls),
    }
    out = {name: {**st, "launch": None} for name, st in out.items()}  # none of them launches
    if launches:
        launcher = CopyLauncher(s.spec, s.host, 1, Direction.STORE)
        used = launch_used(True, enable_fast_launch(launcher)[Direction.STORE])
        lookup = timed(lambda: enable_fast_launch(launcher), s.device, calls)
        out["enable_fast_launch (its verdict known)"] = {**lookup, "launch": used}
        plan = planner.plan(s.g, s.h, direction=Direction.STORE)
        ids = torch.from_numpy(pack_ids(plan)).to(s.device)
        out["launch alone, direct"] = {**timed(lambda: launcher.launch(plan, ids), s.device, calls), "launch": used}
        launcher.set_direct(Direction.STORE, None)
        dispatch = timed(lambda: launcher.launch(plan, ids), s.device, calls)
        out["launch alone, Triton's dispatch"] = {**dispatch, "launch": TRITON_DISPATCH}
    return out


def engine_calls(s: Setup, calls: int, fast: bool, integrity: bool = False) -> tuple[dict[str, dict], dict[str, dict]]:
    """Both submits, whole; and the steps of each, from the trace of the same calls. ``integrity``: with the integrity
    checks (``"verify"`` Checksums: a checksum table, each host block named by its id), labelled so. Each row's
    ``launch`` comes from the engine's verdict for its direction (``launch_paths``)."""
    checks = {}
    if integrity:
        checks = {"checksums": Checksums.allocate("verify", s.host.shape[0], 1, pin=s.device.type == "cuda")}
    eng = TransferEngine(s.spec, s.host, fast_launch=fast, path="kernel", **checks)
    job, queued = [0], []
    marks: list[tuple[str, int]] = []
    eng.trace = lambda step: marks.append((step, time.perf_counter_ns()))

    def drain() -> None:  # waits for the burst's jobs outside the timing, as the synchronize does above
        if queued:
            eng.wait(queued)
            assert all(r.ok for r in eng.get_finished())
            queued.clear()

    label = engine_label(fast, integrity)
    whole, steps = {}, {}
    for name, submit, direction in (
        ("submit_store", eng.submit_store, Direction.STORE),
        ("submit_load", eng.submit_load, Direction.LOAD),
    ):

        def one(submit=submit):
            job[0] += 1
            submit(job[0], s.g, s.h)
            queued.append(job[0])

        one()  # compiles this direction
        drain()
        marks.clear()
        used = launch_used(fast, eng.launch_paths[direction])
        whole[f"engine.{name}, {label}"] = {**timed(one, s.device, calls, drain), "launch": used}
        traced = _trace_steps(marks, f"engine.{name}, {label}")
        steps.update({k: {**st, "launch": used} for k, st in traced.items()})
    eng.shutdown()
    return whole, steps


def engine_label(fast: bool, integrity: bool) -> str:
    return ("direct launch" if fast else "Triton's dispatch") + (", integrity verify" if integrity else "")


def _trace_steps(marks: list[tuple[str, int]], prefix: str) -> dict[str, dict]:
    """Median (and p99) microseconds of each traced step over the calls in ``marks``."""
    per_step: dict[str, list[float]] = {}
    prev = None  # the previous mark's time; None before the first call's "submit"
    for step, t in marks:
        if step == "submit":
            prev = t
            continue
        if prev is None:
            continue
        per_step.setdefault(step, []).append((t - prev) / 1e9)
        prev = t
    return {f"{prefix} / {ENGINE_STEPS.get(k, k)}": stats_us(v) for k, v in per_step.items()}


def _engine_phase(fast: bool, integrity: bool, whole: bool) -> Callable[[Setup, int], Sections]:
    def run(s: Setup, calls: int) -> Sections:
        submits, steps = engine_calls(s, calls, fast, integrity)
        return {ENGINE_SUBMITS: submits, ENGINE_TRACE: steps} if whole else {ENGINE_TRACE: steps}

    return run


def phases(tiny: bool, integrity: bool, cuda: bool) -> list[tuple[str, Callable[[Setup, int], Sections]]]:
    """The run's measurements, in order: (name, ``fn(setup, calls)`` -> the rows it measured, by section). On CPU only
    the steps before the launch mean anything (the kernel runs in Triton's interpreter), and they are reported alone:
    planning (validation and packing) is the part the CPU target is set on."""
    out = [(PUBLIC_STEPS, lambda s, calls: {PUBLIC_STEPS: public_steps(s, calls, cuda)})]
    if cuda:
        public = lambda s, calls: {PUBLIC_CALLS: {**public_calls(s, calls, True), **public_calls(s, calls, False)}}  # noqa: E731
        out.append((PUBLIC_CALLS, public))
        engines = [(True, False), (False, False)] + ([(True, True)] if integrity else [])
    elif tiny:
        # The interpreter runs the kernel inside the call (seconds at the full shape): the engine's calls run only at
        # the tiny shape, to check the trace; their numbers mean nothing.
        engines = [(False, False)] + ([(False, True)] if integrity else [])
    else:
        engines = []
    # The integrity checks' host cost: the same submits, with them (issue 41). On CPU only their steps are kept.
    out += [(f"engine submits, {engine_label(f, i)}", _engine_phase(f, i, whole=cuda)) for f, i in engines]
    return out


def run_phases(tiny: bool, calls: int, integrity: bool = False) -> Iterator[tuple[str, Sections]]:
    """Runs :func:`phases` one by one, yielding each one's name and rows as it finishes."""
    s = setup(tiny)
    try:
        for name, measure_one in phases(tiny, integrity, s.device.type == "cuda"):
            yield name, measure_one(s, calls)
    finally:
        s.cache.close()


def merge(sections: Sections, new: Sections) -> None:
    for title, rows in new.items():
        sections.setdefault(title, {}).update(rows)


def measure(tiny: bool, calls: int, integrity: bool = False) -> Sections:
    sections: Sections = {}
    for _, new in run_phases(tiny, calls, integrity):
        merge(sections, new)
    return sections


def print_rows(new: Sections) -> None:
    for title, rows in new.items():
        print(f"\n{title}")
        for name, st in rows.items():
            print(
                f"  {name:<78} median {st['median_us']:8.1f} us  p80 {st['p80_us']:8.1f}  min {st['min_us']:8.1f}"
                f"  launch: {st['launch'] or '-'}"
            )
    sys.stdout.flush()  # a kill keeps what was printed


def main(argv: list[str] | None = None) -> int:
    """The run is a series of measurements (:func:`phases` names them); the JSON is rewritten after each,
    ``complete`` false and ``done`` / ``left`` naming the measurements finished and still to run (and ``error`` where
    one raised), so a run killed part-way leaves what it measured; the last write sets ``complete``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (any machine; CPU runs the interpreter)")
    ap.add_argument("--calls", type=int, default=CALL_COST_CALLS)
    ap.add_argument("--json", metavar="PATH", help="write every row and the machine as JSON, after each measurement")
    ap.add_argument("--integrity", action="store_true", help="also the engine's submits with the integrity checks")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    where = torch.cuda.get_device_name() if cuda else "CPU (no CUDA: the steps before the launch only)"
    shape = "tiny" if args.tiny else "1024 blocks x 80 layers"
    print(f"host time per call, {shape}, {where}", flush=True)
    doc = {
        "benchmark": "call_cost",
        **machine_info(),
        "device": where,
        "torch": torch.__version__,
        "shape": shape,
        "calls": args.calls,
        "integrity": args.integrity,
        "complete": False,
        "done": [],
        "left": [name for name, _ in phases(args.tiny, args.integrity, cuda)],
        "sections": {},
    }

    def save() -> None:
        if args.json:
            write_json(args.json, doc)

    save()  # a kill before the first measurement still leaves the machine and the plan
    try:
        for name, new in run_phases(args.tiny, args.calls, args.integrity):
            print_rows(new)
            merge(doc["sections"], new)
            doc["done"].append(name)
            doc["left"].remove(name)
            save()
    except BaseException as e:
        doc["error"] = f"{doc['left'][0] if doc['left'] else 'after the last measurement'}: {type(e).__name__}: {e}"
        save()
        raise
    doc["complete"] = True
    save()
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
