"""What the GPU run (tools/gpu/run.py) can run, and in which order (``python -m tools.gpu.stages`` lists it): the
stages, each one or more commands under one timeout with a coarse estimate, and the fingerprint of the code it
measures (git blob hashes of the folders it declares, computed from the files: the GPU machine's copy has no
``.git``); the ledger (bench/results/gpu-ledger.json) keeps each stage's last run, whose measured seconds replace its
estimate. A run without ``--stages`` puts first the stages that never ran, then those that did not end ok, then those
whose code changed, so consecutive leases cover everything. Stdlib only: it runs before the project is installed."""

from __future__ import annotations

import copy
import hashlib
import json
import pathlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[2]
LEDGER_PATH = ROOT / "bench" / "results" / "gpu-ledger.json"
NEVER = "never ran"
OK = "ok"

# The two GPU tests that start a benchmark in a subprocess (400-500 s timeouts): `gpu-tests-slow`, not `gpu-tests`.
SLOW_TESTS = (
    "tests/bench/test_bench_gpu.py::test_a_small_gpu_run_checks_and_times_every_method",
    "tests/bench/test_bench_serving.py::test_a_short_gpu_serving_run_checks_bytes_and_reports_sane_numbers",
)
# The serving stage: issue 39's decisive preset, then triton with the integrity checks (issue 41) and triton over the
# FP8 host format (issue 63: a host hit's load time beside bf16's).
SERVING_DECISIVE = ("--preset", "decisive")
SERVING_STAGE = (*SERVING_DECISIVE, "--integrity", "--fp8")
# The call-cost stage: fewer calls per row than the benchmark's default (bench/common/grid.py's CALL_COST_CALLS), so it
# fits a first, short lease (issue 56), and the engine's submits also with the integrity checks.
CALL_COST_STAGE_CALLS = 200
CALL_COST_STAGE = ("--integrity", "--calls", str(CALL_COST_STAGE_CALLS))
# The host-memory stage (issue 42): 8 and 32 GiB, the GPU's node and unbound, transparent huge pages, 1 and 8
# registration threads.
HOST_MEMORY_ARGS = ("--sizes-gib", "8", "32", "--threads", "1", "8", "--placements", "auto", "off", "--huge-pages",
                    "thp", "--transfer-gib", "4", "--repeats", "5")  # fmt: skip
# The GPU test files, named (collecting the whole tree cost 10-30 s and let a module that cannot be imported there fail
# the stage): the library's, then, in a process of their own, those that import vLLM's code. tests/bench/test_gpu_run.py
# checks that these and SLOW_TESTS are every file `pytest -m gpu` collects.
GPU_TESTS_CORE = ("tests/gpu/test_gpu_kernels.py", "tests/gpu/test_gpu_fp8.py", "tests/gpu/test_gpu_engine.py",
                  "tests/unit/test_fast_launch.py",
                  "tests/unit/test_integrity.py", "tests/unit/test_integrity_hand_off.py",
                  "tests/unit/test_launch_shape.py", "tests/unit/test_path_choice.py", "tests/unit/test_host_cache.py",
                  "tests/unit/test_host_memory.py")  # fmt: skip
GPU_TESTS_VLLM = ("tests/gpu/test_gpu_tiering.py", "tests/unit/test_connector.py",
                  "tests/unit/test_connector_worker_role.py", "tests/bench/test_bench_vllm_native.py")  # fmt: skip
TEST_TIMEOUT_S, SLOW_TEST_TIMEOUT_S = 45, 480  # per test, under pytest-timeout
PYTEST_PLUGINS = "tools/gpu/pytest_plugins"  # live_junit.py: the JUnit XML rewritten after every test

# What a fingerprint covers: whole folders (their .py files) and files.
LIBRARY = ("triton_offload", "kernels")
BENCH = ("bench/__init__.py", "bench/common", "bench/baselines")  # what every benchmark imports
TRANSFER = (*LIBRARY, *BENCH, "bench/transfer")
SERVING = (*LIBRARY, *BENCH, "bench/serving", "bench/accuracy")  # bench/accuracy: the FP8 method's reference codec
MICRO = (*LIBRARY, *BENCH, "bench/transfer", "bench/micro")

# Until a lease measures a stage: the seconds the time model that sized the stages (retired in issue 57) gave each on an
# H100, times 0.5 (the 2026-11-22 H100 run took about half the model's minutes per part).
INSTALL_S = 40.0  # ./dev gpu run's `pip install -e .` and the vLLM bundle's unpack
MIN_TIMEOUT_S = 60.0
# bench/micro/fp8.py: 14 page/layout cases of ~30 measurements of <= 20 ms each, ~12 s, plus the Triton compiles of
# both kernels per page and direction (about 28) and the start; it starts no page after 70 s (its --time-limit).
FP8_ESTIMATE_S = 60.0


@dataclass(frozen=True)
class Stage:
    """One stage: its ``name`` (``--stages``, the ledger, file names), ``what`` it runs, the ``kind`` of files it
    writes (how tools/gpu/summary.py reads them), its ``steps`` (commands run one after another under its one timeout;
    ``{py}`` is the runner's Python, ``{json}``, ``{plot}``, ``{xml}`` its files), ``estimate_s`` (its seconds on an
    H100 until the ledger has measured it), the ``paths`` its fingerprint covers (files, and folders' ``.py`` files),
    ``env`` for its commands (``{root}``: the repository; a ``PYTHONPATH`` goes before the caller's), ``step_names``
    for the summary, and ``keep_going``: a failed step does not stop the next (the stage still fails, naming it)."""

    name: str
    what: str
    kind: str
    steps: tuple[tuple[str, ...], ...]
    estimate_s: float
    paths: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    step_names: tuple[str, ...] = ()
    keep_going: bool = False

    def step_name(self, i: int) -> str:
        return self.step_names[i] if i < len(self.step_names) else f"step {i + 1}"


def pytest_step(*args: str, timeout: int, append: bool = False) -> tuple[str, ...]:
    """A pytest command whose JUnit XML is rewritten after every test; a module that fails to import costs only its own
    tests. ``append``: the step adds its tests to the XML an earlier step of the stage wrote."""
    return ("{py}", "-m", "pytest", "-p", "live_junit", "--live-junit", "{xml}", *(("--live-junit-append",) * append),
            "-p", "no:cacheprovider", "-v", "--continue-on-collection-errors", "--timeout", str(timeout),
            *args)  # fmt: skip


def _transfer(part: str, what: str, estimate_s: float, kind: str = "transfer") -> Stage:
    cmd = ("{py}", "-m", "bench.transfer", "--part", part, "--json", "{json}", "--plot", "{plot}")
    return Stage(part, what, kind, (cmd,), estimate_s, TRANSFER)


def _serving(name: str, args: tuple[str, ...], what: str, estimate_s: float) -> Stage:
    cmd = ("{py}", "-m", "bench.serving", *args, "--json", "{json}", "--plot", "{plot}")
    return Stage(name, f"{' '.join(('python -m bench.serving', *args))}: {what}", "serving", (cmd,), estimate_s,
                 SERVING)  # fmt: skip


TEST_ENV = (("PYTHONPATH", "{root}/" + PYTEST_PLUGINS),)
_TESTED = (*LIBRARY, "connector", "tests", "setup.cfg", PYTEST_PLUGINS, "bench")

STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage("machine", "GPU, driver, CUDA, PCIe link, NUMA nodes, CPUs, memory (tools/gpu/machine.py)", "machine",
              (("{py}", "-m", "tools.gpu.machine", "--json", "{json}"),), 2.5,
              ("tools/gpu/machine.py", "bench/common/results.py")),
        Stage("gpu-tests", f"pytest -m gpu over the GPU test files (pytest-timeout {TEST_TIMEOUT_S} s per test): the "
              "library's first, then vLLM's in a process of their own; the two benchmark-subprocess tests deselected",
              "pytest", (pytest_step("-m", "gpu", *GPU_TESTS_CORE, timeout=TEST_TIMEOUT_S),
                         pytest_step("-m", "gpu", *GPU_TESTS_VLLM, timeout=TEST_TIMEOUT_S, append=True)),
              120, _TESTED, TEST_ENV, ("the library's GPU tests", "vLLM's GPU tests"), keep_going=True),
        Stage("call-cost", f"python -m bench.micro.call_cost {' '.join(CALL_COST_STAGE)}: host time per call at "
              "1024 x 80, direct launch vs Triton's dispatch, the engine's submits also with the integrity checks",
              "call-cost", (("{py}", "-m", "bench.micro.call_cost", *CALL_COST_STAGE, "--json", "{json}"),), 46,
              MICRO),
        # 91 s before triton_fp8 joined it: one more run in 13 per load mode, and its FP8 host cache's set-up.
        _serving("serving", SERVING_STAGE, "the serving benchmark's decisive configuration, triton with the "
                 "integrity checks, and triton over the FP8 host format", 110),
        _transfer("quick", "bench.transfer --quick --integrity: every workload, 128 blocks, f=4/skip=1, every method "
                  "(auto, vllm033, vllm_native too), the kernel with the integrity checks beside it, short extras", 49),
        _transfer("launch-shape", "bench.transfer: 2 KiB and 8 KiB pages, 128/1024 blocks, num_ctas 4-32, f 1 and "
                  "4/skip 1: the size-aware launch shape's probe", 89, kind="launch-shape"),
        _serving("serving-shape", ("--preset", "launch-shape"), "the kernel's fixed and size-aware launch shapes in "
                 "the serving loop (small pages, Llama-3-70B at TP 8), step slowdown vs no offload", 52),
        Stage("host-memory", f"python -m bench.micro.host_cache {' '.join(HOST_MEMORY_ARGS)}: a large host cache's "
              "set-up per NUMA placement (map, first touch, CUDA registration at 1 and 8 threads) and the GPU's near "
              "vs far node", "host-memory",
              (("{py}", "-m", "bench.micro.host_cache", *HOST_MEMORY_ARGS, "--json", "{json}"),), 53, MICRO),
        Stage("gpu-tests-slow", "the two benchmark-subprocess GPU tests (a small transfer run, a short serving run)",
              "pytest", (pytest_step(*SLOW_TESTS, timeout=SLOW_TEST_TIMEOUT_S),), 150, _TESTED, TEST_ENV),
        # Issue 63's speed: after the first lease's priorities, before the long sweeps; short enough that a lease
        # which skips host-memory or gpu-tests-slow for want of time still reaches it.
        Stage("fp8", "python -m bench.micro.fp8: the FP8 host format vs the bf16 copy, store and load, pages 2-256 "
              "KiB, kv_first and block_first, 512 random blocks; FP8 at its default and a few programs and with the "
              "integrity checks; checked on the GPU before timing", "fp8",
              (("{py}", "-m", "bench.micro.fp8", "--json", "{json}", "--plot", "{plot}"),), FP8_ESTIMATE_S, MICRO),
        _transfer("full-small", "bench.transfer small-page: both layouts, 16/128/1024 blocks, both host formats, "
                  "num_ctas 1-32", 59),
        _transfer("full-70b", "bench.transfer llama3-70b-tp8, the same", 83),
        _transfer("full-8b", "bench.transfer llama3-8b, the same", 125),
        _transfer("full-mla", "bench.transfer deepseek-v3-mla, the same", 118),
        _serving("serving-full", (), "the default run, three workloads x every method, duplex", 233),
        _transfer("extras", "bench.transfer --no-sweep: the CPU cost per call and the GEMM interference", 38),
    )
}  # fmt: skip
# A first lease's priority (issue 38): what decides correctness and the headline numbers first. `machine` always runs
# first, whatever the ledger says: every other stage's numbers are read against it.
DEFAULT_ORDER = tuple(STAGES)
ALIASES = {"tests": ("gpu-tests", "gpu-tests-slow")}  # the name `./dev gpu PART OUTDIR` took before the runner


def resolve_stages(text: str | None, stages: dict[str, Stage] = STAGES) -> list[str] | None:
    """``"a,b"`` -> the stage names (aliases expanded, repeats dropped); None for None. Unknown names: ValueError."""
    if text is None:
        return None
    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        for name in ALIASES.get(part, (part,)):
            if name not in stages:
                raise ValueError(f"unknown stage {part!r}; stages: {', '.join([*stages, *ALIASES])}")
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError(f"--stages names no stage: {text!r}")
    return names


def git_blob_hash(data: bytes) -> str:
    """What ``git hash-object`` prints for a file with these bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def stage_files(stage: Stage, root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The files a stage's fingerprint covers: each declared file, and every ``.py`` file under each declared folder."""
    files = set()
    for spec in stage.paths:
        path = root / spec
        files |= {p for p in path.rglob("*.py") if "__pycache__" not in p.parts} if path.is_dir() else {path}
    return sorted(files)


def fingerprint(stage: Stage, root: pathlib.Path = ROOT) -> str:
    """16 hex digits over the stage's commands and the blob hash of every file it covers (a missing file counts as
    missing): the same on any copy of the same files, with or without git."""
    h = hashlib.sha256(repr(stage.steps).encode())
    for f in stage_files(stage, root):
        blob = git_blob_hash(f.read_bytes()) if f.is_file() else "missing"
        h.update(f"{f.relative_to(root).as_posix()} {blob}\n".encode())
    return h.hexdigest()[:16]


# -- the ledger -----------------------------------------------------------------------------------------------------

ENTRY_KEYS = ("outcome", "device", "date", "ran_at", "commit", "seconds", "estimate_s", "fingerprint")


def new_ledger(stages=STAGES) -> dict:
    """A ledger in which every stage never ran."""
    return {
        "about": "per stage of ./dev gpu run, its last run: written by tools/gpu/run.py on the GPU machine and merged "
        "here by ./dev gpu merge; see tools/gpu/stages.py",
        "install": {"seconds": None, "ran_at": None, "device": None},
        "stages": {name: dict(dict.fromkeys(ENTRY_KEYS), outcome=NEVER) for name in stages},
    }


def load_ledger(path: pathlib.Path = LEDGER_PATH, stages=STAGES) -> dict:
    """The ledger at ``path`` (a new one where there is none), with an entry for every stage."""
    ledger = json.loads(path.read_text()) if path.is_file() else new_ledger(stages)
    ledger.setdefault("install", new_ledger(())["install"])
    for name, entry in new_ledger(stages)["stages"].items():
        ledger.setdefault("stages", {}).setdefault(name, entry)
    return ledger


class Estimate(NamedTuple):
    seconds: float  # expected
    source: str  # where that comes from
    timeout_s: float


def estimate(stage: Stage, ledger: dict) -> Estimate:
    """Its measured seconds where its last run ended ok; otherwise its estimate, or as long as a run that did not finish
    already took. The timeout: twice that, at least a minute."""
    entry = ledger["stages"].get(stage.name) or {"outcome": NEVER}
    if entry["outcome"] == OK and entry.get("seconds"):
        seconds, source = float(entry["seconds"]), f"measured {entry.get('date')} on {entry.get('device')}"
    elif (entry.get("seconds") or 0.0) > stage.estimate_s:
        seconds, source = float(entry["seconds"]), f"its last run ({entry['outcome']}) took that long"
    else:
        seconds, source = stage.estimate_s, "estimate (no ok run yet)"
    return Estimate(seconds, source, max(MIN_TIMEOUT_S, 2 * seconds))


# The queue's groups, first to last. A code change does not rank with "never ran": every library fix changes the
# fingerprint of the stages that measure the library, and the last stages in the priority would never be reached.
QUEUE = ("never ran", "not ok", "code changed", "ok at this code")


def _why_first(entry: dict, current: str) -> tuple[int, str]:  # an index into QUEUE, and why
    if entry["outcome"] == NEVER:
        return 0, NEVER
    if entry["outcome"] != OK:
        return 1, f"last run {entry['outcome']} ({entry.get('date')})"
    if entry.get("fingerprint") != current:
        return 2, f"code changed since its last run ({entry.get('date')})"
    return 3, f"ok at this code ({entry.get('date')})"


def order(ledger: dict, fingerprints: dict[str, str], chosen: list[str] | None = None,
          default: tuple[str, ...] = DEFAULT_ORDER) -> list[tuple[str, str]]:  # fmt: skip
    """(stage, why there) in run order: ``machine`` first; then ``chosen`` (``--stages``) as given, or else the
    stages by :data:`QUEUE` group, each group in the default priority."""
    first = default[0]
    if chosen is not None:
        return [(first, "always first")] + [(n, "asked for") for n in chosen if n != first]
    ranked = sorted((_why_first(ledger["stages"][n], fingerprints[n]), i, n) for i, n in enumerate(default[1:]))
    return [(first, "always first"), *((name, why) for (_, why), _, name in ranked)]


def record_run(ledger: dict, name: str, **fields) -> None:
    """The stage's last run, replacing what the ledger had (fields: :data:`ENTRY_KEYS`)."""
    unknown = set(fields) - set(ENTRY_KEYS)
    if unknown:
        raise KeyError(f"not ledger fields: {sorted(unknown)}")
    ledger["stages"][name] = dict(dict.fromkeys(ENTRY_KEYS), **fields)


def merge_ledgers(committed: dict, returned: dict, fill_commit: Callable[[str, dict], str | None] | None = None
                  ) -> tuple[dict, list[str]]:  # fmt: skip
    """``committed`` updated with every stage ``returned`` ran later (by ``ran_at``), and the install's time; returns
    the merged ledger and the stages taken. ``fill_commit(name, entry)`` may give a commit for an entry that has none
    (the GPU machine's copy has no ``.git``)."""
    merged = copy.deepcopy(committed)
    taken = []
    for name, entry in returned.get("stages", {}).items():
        mine = merged["stages"].get(name) or {"ran_at": None}
        if entry.get("ran_at") and (mine.get("ran_at") or "") < entry["ran_at"]:
            entry = dict(entry)
            if not entry.get("commit") and fill_commit:
                entry["commit"] = fill_commit(name, entry)
            merged["stages"][name] = entry
            taken.append(name)
    inst = returned.get("install") or {}
    if inst.get("ran_at") and (merged["install"].get("ran_at") or "") < inst["ran_at"]:
        merged["install"] = dict(inst)
    return merged, taken


def main() -> int:
    for name in DEFAULT_ORDER:
        print(f"{name:<15} ~{STAGES[name].estimate_s / 60:.1f} min  {STAGES[name].what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
