"""What the GPU run (``./dev gpu run``, tools/gpu/run.py) can run, and in which order: the stages, the fingerprint of
the code each one measures, and the ledger of what the last leases measured.

Stdlib only, and nothing from the project: it runs before the project is installed, and here to plan or merge.

A **stage** is one or more commands with a time model (tools/gpu/parts.py) and a hard timeout. Its **fingerprint** is a
hash over the git blob hashes (``git hash-object``, computed from the files themselves: the GPU machine gets a copy
of the working tree without ``.git``) of the files it declares: the library, and for a benchmark the bench/ modules
its script imports, transitively. The **ledger** (bench/results/gpu-ledger.json, committed) keeps per stage the
device, date, commit, outcome and measured seconds of its last run and the fingerprint it ran at; a run without
``--stages`` puts first the stages that never ran, then those that did not end ok, then those whose code changed
since, so consecutive leases cover everything; a stage's measured seconds replace the model's estimate.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import pathlib
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "ROOT",
    "Stage",
    "STAGES",
    "DEFAULT_ORDER",
    "ALIASES",
    "SLOW_TESTS",
    "SERVING_DECISIVE",
    "SERVING_STAGE",
    "CALL_COST_STAGE",
    "CALL_COST_STAGE_CALLS",
    "LEDGER_PATH",
    "NEVER",
    "resolve_stages",
    "fingerprint",
    "new_ledger",
    "load_ledger",
    "model_factor",
    "Estimate",
    "estimate",
    "order",
    "record_run",
    "merge_ledgers",
]

ROOT = pathlib.Path(__file__).resolve().parents[2]
LEDGER_PATH = ROOT / "bench" / "results" / "gpu-ledger.json"
NEVER = "never ran"
OK = "ok"

# The two GPU tests that start a benchmark in a subprocess (400-500 s timeouts): `gpu-tests-slow`, not `gpu-tests`.
SLOW_TESTS = (
    "tests/bench/test_bench_gpu.py::test_a_small_gpu_run_checks_and_times_every_method",
    "tests/bench/test_bench_serving.py::test_a_short_gpu_serving_run_checks_bytes_and_reports_sane_numbers",
)
# The serving stage's configuration: issue 39's decisive preset (ours, kernel and auto, vs vllm033, vllm_native and
# none; async and sync loads; decode- and prefill-heavy), <= 3 minutes on an H100 by its model.
SERVING_DECISIVE = ("--preset", "decisive")
# The serving stage's options: the decisive configuration, and triton with the integrity checks after it (issue 41:
# their cost per step, beside triton's, until a lease has measured it).
SERVING_STAGE = (*SERVING_DECISIVE, "--integrity")
# The call-cost stage's calls per row: fewer than the benchmark's default (bench/common/grid.py's CALL_COST_CALLS), so
# the stage fits a first, short lease (issue 56); medians over 200 calls still settle.
CALL_COST_STAGE_CALLS = 200
# The call-cost stage's options: the engine's submits also with the integrity checks (their host time per call).
CALL_COST_STAGE = ("--integrity", "--calls", str(CALL_COST_STAGE_CALLS))
# The host-memory stage (issue 42): 8 and 32 GiB, the GPU's node and unbound, transparent huge pages (reserved 2 MiB
# pages are rarely set aside on a lent machine; the benchmark falls back and says so), 1 and 8 registration threads.
HOST_MEMORY_OPTIONS = {"--sizes-gib": ("8", "32"), "--threads": ("1", "8"), "--placements": ("auto", "off"),
                       "--huge-pages": ("thp",), "--transfer-gib": ("4",), "--repeats": ("5",)}  # fmt: skip
HOST_MEMORY_ARGS = tuple(a for flag, values in HOST_MEMORY_OPTIONS.items() for a in (flag, *values))
# The GPU tests, named file by file (collecting the whole tree to select ~40 tests cost 10-30 s and let a module
# that cannot even be imported on the GPU machine, with no GPU test in it, fail the stage): first the library's own
# (kernels, engine, direct launch, copy engines, host memory), then, in a process of their own, those that import
# vLLM's code (the bundle's: its failure to import costs only them). tests/bench/test_gpu_run.py checks that these
# and SLOW_TESTS are every file `pytest -m gpu` collects.
GPU_TESTS_CORE = (
    "tests/gpu/test_gpu_kernels.py",
    "tests/gpu/test_gpu_engine.py",
    "tests/unit/test_fast_launch.py",
    "tests/unit/test_integrity.py",
    "tests/unit/test_launch_shape.py",
    "tests/unit/test_path_choice.py",
    "tests/unit/test_host_cache.py",
    "tests/unit/test_host_memory.py",
)
GPU_TESTS_VLLM = (
    "tests/gpu/test_gpu_tiering.py",
    "tests/unit/test_connector.py",
    "tests/unit/test_connector_worker_role.py",
    "tests/bench/test_bench_vllm_native.py",
)
# Per-test limits under pytest-timeout (a hung test fails alone; the stage's own timeout bounds the rest): the
# longest GPU test took well under a minute on the 11-22 H100 (the whole `pytest -m gpu` 1.8 min).
TEST_TIMEOUT_S = 45
SLOW_TEST_TIMEOUT_S = 480
PYTEST_PLUGINS = "tools/gpu/pytest_plugins"  # live_junit.py: the JUnit XML rewritten after every test

LIBRARY = ("triton_offload", "kernels")


@dataclass(frozen=True)
class Stage:
    """One stage of the GPU run.

    Attributes:
        name: the stage's name (``--stages``, the ledger, file names).
        what: one line: what it runs.
        kind: how its files are read (tools/gpu/summary.py): ``machine``, ``pytest``, ``transfer``, ``launch-shape``,
            ``serving`` or ``call-cost``.
        steps: the commands, run one after another under the stage's one timeout; ``{py}`` is the runner's Python,
            ``{json}``, ``{plot}``, ``{xml}`` the stage's files in the work folder.
        paths: what its fingerprint covers, relative to the repository: a file, a folder (its ``.py`` files), or
            ``imports:bench.X`` (that module, run with ``-m``, and the bench modules it imports, transitively).
        env: variables for its commands; ``{root}`` is the repository, a ``PYTHONPATH`` is prepended to the caller's.
        step_names: what each step is, for the summary (``gpu-tests``: the library's tests, vLLM's); default
            ``step 1``, ``step 2``, ...
        keep_going: a step that fails does not stop the steps after it (the stage still ends ``failed``, naming the
            step); a timeout always ends the stage.
    """

    name: str
    what: str
    kind: str
    steps: tuple[tuple[str, ...], ...]
    paths: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    step_names: tuple[str, ...] = ()
    keep_going: bool = False

    def step_name(self, i: int) -> str:
        return self.step_names[i] if i < len(self.step_names) else f"step {i + 1}"


def _pytest(*args: str, timeout: int, append: bool = False) -> tuple[str, ...]:
    # A module that fails to import costs only its own tests (--continue-on-collection-errors), not the session.
    # ``append``: the step adds its tests to the XML an earlier step of the stage wrote.
    return ("{py}", "-m", "pytest", "-p", "live_junit", "--live-junit", "{xml}", *(("--live-junit-append",) * append),
            "-p", "no:cacheprovider", "-v", "--continue-on-collection-errors", "--timeout", str(timeout),
            *args)  # fmt: skip


def _transfer(part: str, what: str, kind: str = "transfer") -> Stage:
    cmd = ("{py}", "-m", "bench.transfer", "--part", part, "--json", "{json}", "--plot", "{plot}")
    return Stage(part, what, kind, (cmd,), (*LIBRARY, "imports:bench.transfer"))


_TEST_ENV = (("PYTHONPATH", "{root}/" + PYTEST_PLUGINS),)
_TESTED = (*LIBRARY, "connector", "tests", "setup.cfg", PYTEST_PLUGINS)

STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage("machine", "GPU, driver, CUDA, PCIe link, NUMA nodes, CPUs, memory (tools/gpu/machine.py)", "machine",
              (("{py}", "-m", "tools.gpu.machine", "--json", "{json}"),), ("imports:tools.gpu.machine",)),
        Stage("gpu-tests", f"pytest -m gpu over the GPU test files (pytest-timeout {TEST_TIMEOUT_S} s per test): the "
              "library's first, then vLLM's in a process of their own; the two benchmark-subprocess tests deselected",
              "pytest",
              (_pytest("-m", "gpu", *GPU_TESTS_CORE, timeout=TEST_TIMEOUT_S),
               _pytest("-m", "gpu", *GPU_TESTS_VLLM, timeout=TEST_TIMEOUT_S, append=True)),
              (*_TESTED, "bench"), _TEST_ENV, step_names=("the library's GPU tests", "vLLM's GPU tests"),
              keep_going=True),
        Stage("call-cost", f"python -m bench.micro.call_cost {' '.join(CALL_COST_STAGE)}: host time per call at "
              "1024 x 80, direct launch vs Triton's dispatch, the engine's submits also with the integrity checks",
              "call-cost", (("{py}", "-m", "bench.micro.call_cost", *CALL_COST_STAGE, "--json", "{json}"),),
              (*LIBRARY, "imports:bench.micro.call_cost")),
        Stage("serving", f"python -m bench.serving {' '.join(SERVING_STAGE)}: the serving benchmark's decisive "
              "configuration, and triton with the integrity checks",
              "serving", (("{py}", "-m", "bench.serving", *SERVING_STAGE, "--json", "{json}", "--plot", "{plot}"),),
              (*LIBRARY, "imports:bench.serving")),
        _transfer("quick", "bench.transfer --quick --integrity: every workload, 128 blocks, f=4/skip=1, every method "
                  "(auto, vllm033, vllm_native too), the kernel with the integrity checks beside it, short extras"),
        _transfer("launch-shape", "bench.transfer: 2 KiB and 8 KiB pages, 128/1024 blocks, num_ctas 4-32, f 1 and "
                  "4/skip 1: the size-aware launch shape's probe", kind="launch-shape"),
        Stage("serving-shape", "python -m bench.serving --preset launch-shape: the kernel's fixed and size-aware "
              "launch shapes in the serving loop (small pages, Llama-3-70B at TP 8), step slowdown vs no offload",
              "serving", (("{py}", "-m", "bench.serving", "--preset", "launch-shape", "--json", "{json}", "--plot",
                           "{plot}"),), (*LIBRARY, "imports:bench.serving")),
        Stage("host-memory", f"python -m bench.micro.host_cache {' '.join(HOST_MEMORY_ARGS)}: a large host cache's "
              "set-up per NUMA placement (map, first touch, CUDA registration at 1 and 8 threads) and the GPU's near "
              "vs far node", "host-memory",
              (("{py}", "-m", "bench.micro.host_cache", *HOST_MEMORY_ARGS, "--json", "{json}"),),
              ("triton_offload/host_cache.py", "triton_offload/numa.py", "triton_offload/host_pages.py",
               "imports:bench.micro.host_cache")),
        Stage("gpu-tests-slow", "the two benchmark-subprocess GPU tests (a small transfer run, a short serving run)",
              "pytest", (_pytest(*SLOW_TESTS, timeout=SLOW_TEST_TIMEOUT_S),),
              (*LIBRARY, "tests/conftest.py", *(t.split("::")[0] for t in SLOW_TESTS), PYTEST_PLUGINS,
               "imports:bench.transfer", "imports:bench.serving"), _TEST_ENV),
        _transfer("full-small", "bench.transfer small-page: both layouts, 16/128/1024 blocks, both host formats, "
                  "num_ctas 1-32"),
        _transfer("full-70b", "bench.transfer llama3-70b-tp8, the same"),
        _transfer("full-8b", "bench.transfer llama3-8b, the same"),
        _transfer("full-mla", "bench.transfer deepseek-v3-mla, the same"),
        Stage("serving-full", "python -m bench.serving: the default run, three workloads x every method, duplex",
              "serving", (("{py}", "-m", "bench.serving", "--json", "{json}", "--plot", "{plot}"),),
              (*LIBRARY, "imports:bench.serving")),
        _transfer("extras", "bench.transfer --no-sweep: the CPU cost per call and the GEMM interference"),
    )
}  # fmt: skip
# A first lease's priority (issue 38): what decides correctness and the headline numbers first. `machine` always
# runs first, whatever the ledger says: every other stage's numbers are read against it.
DEFAULT_ORDER = tuple(STAGES)
# The names `./dev gpu PART OUTDIR` took before the runner.
ALIASES = {"tests": ("gpu-tests", "gpu-tests-slow")}


def resolve_stages(text: str | None, stages: dict[str, Stage] = STAGES) -> list[str] | None:
    """``"a,b"`` -> the stage names (aliases expanded, repeats dropped); None for None. Unknown names: ValueError."""
    if text is None:
        return None
    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        for name in ALIASES.get(part, (part,)):
            if name not in stages:
                known = ", ".join([*stages, *ALIASES])
                raise ValueError(f"unknown stage {part!r}; stages: {known}")
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError(f"--stages names no stage: {text!r}")
    return names


# -- fingerprints ---------------------------------------------------------------------------------------------------


def git_blob_hash(data: bytes) -> str:
    """What ``git hash-object`` prints for a file with these bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _module_files(root: pathlib.Path, name: str) -> list[pathlib.Path]:
    """The files that make module ``name`` run: its own (a package's ``__init__.py`` and ``__main__.py``) and its
    parent packages' ``__init__.py``."""
    parts = name.split(".")
    files = [root.joinpath(*parts[:i], "__init__.py") for i in range(1, len(parts))]
    path = root.joinpath(*parts)
    return files + ([path / "__init__.py", path / "__main__.py"] if path.is_dir() else [path.with_suffix(".py")])


def bench_imports(name: str, root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The files of module ``name`` (``bench.transfer``) and of every ``bench`` module it imports (absolute imports, at
    any depth of the code), transitively; the GPU run's own modules (tools/) measure nothing and are not followed."""
    seen: list[pathlib.Path] = []
    todo, done = [name], set()
    while todo:
        module = todo.pop()
        if module in done:
            continue
        done.add(module)
        for path in _module_files(root, module):
            if path in seen or not path.is_file():
                continue
            seen.append(path)
            for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    # ``from bench.common import case`` imports the submodule ``bench.common.case``.
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                todo += [n for n in names if n == "bench" or n.startswith("bench.")]
    return seen


def _files(root: pathlib.Path, spec: str) -> list[pathlib.Path]:
    if spec.startswith("imports:"):
        return bench_imports(spec.removeprefix("imports:"), root)
    path = root / spec
    if path.is_dir():
        return [p for p in path.rglob("*.py") if "__pycache__" not in p.parts]
    return [path]


def fingerprint(stage: Stage, root: pathlib.Path = ROOT) -> str:
    """16 hex digits over the stage's commands and the blob hash of every file it declares (a missing file counts as
    missing): the same on any copy of the same files, with or without git."""
    h = hashlib.sha256(repr(stage.steps).encode())
    files = {f for spec in stage.paths for f in _files(root, spec)}
    for f in sorted(files):
        blob = git_blob_hash(f.read_bytes()) if f.is_file() else "missing"
        h.update(f"{f.relative_to(root).as_posix()} {blob}\n".encode())
    return h.hexdigest()[:16]


# -- the ledger -----------------------------------------------------------------------------------------------------

ENTRY_KEYS = ("outcome", "device", "date", "ran_at", "commit", "seconds", "model_s", "fingerprint")
# Before any run of the runner: the 2026-11-22 H100 run took about half the model's minutes per part (docs/gpu-run.md,
# "The one command of a lease": 1.8/6, 1/1.4, 1.7/3.4, 1.1/2.3, 1.5/3.3, 1/1.7, 0.7/1.2).
SEED_FACTOR = {"value": 0.5, "from": "the 2026-11-22 H100 run: measured / modelled minutes per part, median ~0.5"}


def new_ledger(stages: dict[str, Stage] = STAGES) -> dict:
    """A ledger in which every stage never ran."""
    return {
        "about": "per stage of ./dev gpu run, its last run: written by tools/gpu/run.py on the GPU machine and merged "
        "here by ./dev gpu merge; see tools/gpu/stages.py",
        "model_factor_seed": dict(SEED_FACTOR),
        "install": {"seconds": None, "ran_at": None, "device": None},
        "stages": {name: dict(dict.fromkeys(ENTRY_KEYS), outcome=NEVER) for name in stages},
    }


def load_ledger(path: pathlib.Path = LEDGER_PATH, stages: dict[str, Stage] = STAGES) -> dict:
    """The ledger at ``path`` (a new one where there is none), with an entry for every stage."""
    ledger = json.loads(path.read_text()) if path.is_file() else new_ledger(stages)
    fresh = new_ledger(stages)
    for key in ("model_factor_seed", "install"):
        ledger.setdefault(key, fresh[key])
    for name, entry in fresh["stages"].items():
        ledger.setdefault("stages", {}).setdefault(name, entry)
    return ledger


def model_factor(ledger: dict) -> tuple[float, str]:
    """Measured over modelled seconds, summed over the stages whose last run ended ok (so the long stages weigh most;
    clamped to 0.2-3); the seed until one has."""
    done = [e for e in ledger["stages"].values() if e["outcome"] == OK and e.get("seconds") and e.get("model_s")]
    if not done:
        seed = ledger["model_factor_seed"]
        return float(seed["value"]), f"seed: {seed['from']}"
    ratio = sum(e["seconds"] for e in done) / sum(e["model_s"] for e in done)
    return min(3.0, max(0.2, ratio)), f"measured / modelled seconds over the {len(done)} stages last run ok"


@dataclass(frozen=True)
class Estimate:
    """A stage's expected seconds (and where that comes from) and its hard timeout."""

    seconds: float
    source: str
    timeout_s: float
    model_s: float


MIN_TIMEOUT_S = 60.0


def estimate(name: str, ledger: dict, model_s: float) -> Estimate:
    """Measured seconds where the last run ended ok; otherwise the model times the ledger's factor (at least as long
    as a run that did not finish already took). The timeout: twice that, at least the model itself and a minute."""
    entry = ledger["stages"].get(name) or {"outcome": NEVER}
    factor, _ = model_factor(ledger)
    if entry["outcome"] == OK and entry.get("seconds"):
        seconds, source = float(entry["seconds"]), f"measured {entry.get('date')} on {entry.get('device')}"
    else:
        seconds, source = model_s * factor, f"model {model_s:.0f} s x {factor:.2f}"
        ran = entry.get("seconds") or 0.0
        if ran > seconds:
            seconds, source = float(ran), f"its last run ({entry['outcome']}) took that long"
    return Estimate(seconds, source, max(MIN_TIMEOUT_S, 2 * seconds, model_s), model_s)


# The queue's groups, first to last: a stage that never ran, then one whose last run did not end ok, then one whose
# code changed since an ok run, then the rest. A code change does not rank with "never ran": every library fix
# changes the fingerprint of the stages that measure the library, and the stages last in the priority would never
# be reached (issue 56).
QUEUE = ("never ran", "not ok", "code changed", "ok at this code")


def _why_first(entry: dict, current: str) -> tuple[int, str]:
    """The stage's group in the queue (an index into :data:`QUEUE`) and why."""
    if entry["outcome"] == NEVER:
        return 0, NEVER
    if entry["outcome"] != OK:
        return 1, f"last run {entry['outcome']} ({entry.get('date')})"
    if entry.get("fingerprint") != current:
        return 2, f"code changed since its last run ({entry.get('date')})"
    return 3, f"ok at this code ({entry.get('date')})"


def order(
    ledger: dict,
    fingerprints: dict[str, str],
    chosen: list[str] | None = None,
    default: tuple[str, ...] = DEFAULT_ORDER,
) -> list[tuple[str, str]]:
    """(stage, why there) in run order. ``chosen`` (``--stages``): those, as given, after ``machine``. Otherwise
    ``machine``, then the stages that never ran, then those that did not end ok, then those whose fingerprint
    changed, then the rest (:data:`QUEUE`), each group in the default priority."""
    first = default[0]
    if chosen is not None:
        return [(first, "always first")] + [(n, "asked for") for n in chosen if n != first]
    ranked = [(_why_first(ledger["stages"][name], fingerprints[name]), i, name) for i, name in enumerate(default[1:])]
    return [(first, "always first"), *((name, why) for (_, why), _, name in sorted(ranked))]


def record_run(ledger: dict, name: str, **fields) -> None:
    """The stage's last run, replacing what the ledger had (fields: :data:`ENTRY_KEYS`)."""
    unknown = set(fields) - set(ENTRY_KEYS)
    if unknown:
        raise KeyError(f"not ledger fields: {sorted(unknown)}")
    ledger["stages"][name] = dict(dict.fromkeys(ENTRY_KEYS), **fields)


def merge_ledgers(
    committed: dict, returned: dict, fill_commit: Callable[[str, dict], str | None] | None = None
) -> tuple[dict, list[str]]:
    """``committed`` updated with every stage ``returned`` ran later (by ``ran_at``), and the install's time; returns
    the merged ledger and the stages taken. ``fill_commit(name, entry)`` may give a commit for an entry that has
    none (the GPU machine's copy has no ``.git``)."""
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
