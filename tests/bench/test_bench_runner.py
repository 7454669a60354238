"""`./dev gpu run OUTDIR` (and `./dev gpu PART OUTDIR`, one stage of it), the GPU machine's one command: without CUDA
it refuses in one line before installing anything (unless --dry-run, which prints the plan anywhere); with CUDA it
installs once, then hands over to tools/gpu/run.py (tests/bench/test_gpu_run.py); every stage's estimate fits a
lease."""

from __future__ import annotations

import datetime
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from bench.common import grid, results, workloads
from bench.transfer import cli as bench_transfer
from tools.gpu import stages

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _fake_python3(tmp_path: pathlib.Path) -> pathlib.Path:
    """A python3 without site-packages (so without torch, as a bare machine's might be) that logs every call."""
    real = shutil.which("python3") or sys.executable
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "python3"
    shim.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls.log"}\nexec {real} -S -E "$@"\n')
    shim.chmod(0o755)
    return bin_dir


def _env(tmp_path: pathlib.Path, bin_dir: pathlib.Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_OFFLOAD_VENV")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    return env


@pytest.mark.parametrize(
    "args",
    [
        ["tests"],
        ["quick"],
        ["full-8b"],
        ["serving"],
        ["call-cost"],
        ["no-such-part"],
        ["run"],
        ["run", "--stages", "quick"],
    ],
    ids=lambda a: "-".join(a),
)
def test_without_cuda_the_runner_says_so_in_one_line_and_installs_nothing(tmp_path, args):
    out = tmp_path / "out"
    argv = [args[0], str(out), *args[1:]] if args[0] == "run" else [args[0], str(out)]
    proc = subprocess.run(["bash", str(ROOT / "dev"), "gpu", *argv], capture_output=True, text=True,
                          env=_env(tmp_path, _fake_python3(tmp_path)), timeout=60)  # fmt: skip
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stdout + proc.stderr
    assert "no CUDA device" in lines[0] and "nothing installed" in lines[0]
    calls = (tmp_path / "calls.log").read_text()
    assert "pip" not in calls and "tools.gpu.run" not in calls  # only the CUDA probe ran
    assert not out.exists()


def _cuda_python3(tmp_path: pathlib.Path) -> pathlib.Path:
    """A python3 that says it has CUDA and the project installed, runs tools/gpu/run.py's ``check`` for real, and only
    logs whatever else it is asked to run (the runner itself included)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "python3"
    shim.write_text(
        f"""#!/bin/sh
echo "$@" >> {tmp_path / "calls.log"}
case "$1" in
  -) cat > /dev/null; exit 0 ;;  # the CUDA probe
  -c) exec {sys.executable} "$@" ;;  # "installed from this checkout?" (not here: it is, into .venv) and the clock
  -m) [ "$2 $3" = "tools.gpu.run check" ] && exec {sys.executable} "$@"; echo "would run: $*"; exit 0 ;;
  *) echo "would run: $*"; exit 0 ;;
esac
"""
    )
    shim.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize(
    "argv, runner_args",
    [
        (["run", "{out}"], ""),
        (["run", "{out}", "--budget", "300", "--stages", "quick,gpu-tests"], " --budget 300 --stages quick,gpu-tests"),
        (["quick", "{out}"], " --stages quick"),
        (["tests", "{out}"], " --stages tests"),
    ],
    ids=["run", "run-options", "part", "alias"],
)
def test_with_cuda_dev_installs_once_then_hands_over_to_the_runner(tmp_path, argv, runner_args):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(ROOT / "dev"), "gpu", *(a.format(out=out) for a in argv)], capture_output=True,
                          text=True, env=_env(tmp_path, _cuda_python3(tmp_path)), timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # (pip is called only where the project is not installed from this checkout; the shim does not run it)
    calls = [line for line in (tmp_path / "calls.log").read_text().splitlines() if "tools.gpu.run" in line]
    check, run = calls
    assert check == f"-m tools.gpu.run check {out}{runner_args}"
    prefix = f"-m tools.gpu.run run {out}{runner_args} --t0 "
    assert run.startswith(prefix) and float(run[len(prefix) :]) > 1.7e9  # the budget counts from before the install
    # The install's output is kept in OUTDIR for the runner to pack: the bundle's absence (a fresh clone), or, where
    # .gpu-bundle/ was built, its unpack, lenient on a lease (the shim only logs it).
    if (ROOT / ".gpu-bundle" / "MANIFEST.json").is_file():
        unpack = f"-m tools.gpu.vllm_bundle unpack --bundle {ROOT}/.gpu-bundle --lenient"
        assert unpack in (tmp_path / "calls.log").read_text().splitlines()
    else:
        assert "no .gpu-bundle/" in (out / "install.log").read_text()


def test_with_cuda_a_bad_option_is_refused_before_installing(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(ROOT / "dev"), "gpu", "run", str(out), "--stages", "quik"], capture_output=True,
                          text=True, env=_env(tmp_path, _cuda_python3(tmp_path)), timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "unknown stage 'quik'" in proc.stderr
    assert not out.exists()


def test_the_dry_run_prints_the_plan_anywhere_and_runs_nothing(tmp_path):
    """No CUDA here, and a python3 without torch: --dry-run still plans (from the committed ledger and the stages'
    estimates), installs and runs nothing."""
    out = tmp_path / "out"
    bin_dir = _fake_python3(tmp_path)
    proc = subprocess.run(["bash", str(ROOT / "dev"), "gpu", "run", str(out), "--dry-run"], capture_output=True,
                          text=True, env=_env(tmp_path, bin_dir), timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split()[2] for line in proc.stdout.splitlines() if re.match(r"\[gpu-run\] +\d+ ", line)]
    assert sorted(rows) == sorted(stages.STAGES) and rows[0] == "machine"
    assert "nothing was run: --dry-run" in proc.stdout and not out.exists()
    assert f"-m tools.gpu.run run {out} --dry-run" in (tmp_path / "calls.log").read_text()  # python3 planned
    end = float(re.search(r"expected end ~(\d+) s of 540 s", proc.stdout).group(1))
    assert end <= 540


def test_the_runner_wants_an_outdir():
    proc = subprocess.run(["bash", str(ROOT / "dev"), "gpu", "quick"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage: ./dev gpu run OUTDIR" in proc.stderr


def test_every_stage_fits_a_lease_alone_and_the_full_parts_sweep_everything():
    """Each stage's estimate (until a lease measures it) fits the default budget after the install and the machine
    stage; together the full-* parts are the whole sweep: every workload once, and the extras once."""
    room = 540 - stages.INSTALL_S - stages.STAGES["machine"].estimate_s - 10
    assert all(0 < s.estimate_s <= room for s in stages.STAGES.values()), room
    swept = [a[a.index("--workloads") + 1] for n, a in grid.PARTS.items() if n.startswith("full-")]
    assert sorted(swept) == sorted(workloads.WORKLOADS)
    assert [n for n, a in grid.PARTS.items() if "--no-overhead" not in a and "--quick" not in a] == ["extras"]
    # Every transfer part is a stage that runs it.
    for name in grid.PARTS:
        assert stages.STAGES[name].steps == (("{py}", "-m", "bench.transfer", "--part", name, "--json", "{json}",
                                              "--plot", "{plot}"),)  # fmt: skip


def test_the_stages_cli(capsys):
    assert stages.main() == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert list(listed) == list(stages.DEFAULT_ORDER)
    assert "python -m bench.serving --preset decisive" in listed["serving"] and "pytest -m gpu" in listed["gpu-tests"]
    assert "python -m bench.micro.call_cost" in listed["call-cost"] and "~2.0 min" in listed["gpu-tests"]


def test_result_names_are_device_date_part():
    stem = results.result_stem("NVIDIA H100 80GB HBM3", "full-70b", datetime.date(2026, 11, 22))
    assert stem == "nvidia-h100-80gb-hbm3-2026-11-22-full-70b"


def test_each_part_expands_to_valid_benchmark_options():
    args = {name: vars(bench_transfer.parse_args(["--part", name, "--json", "x.json"])) for name in grid.PARTS}
    assert args["quick"]["quick"] and args["quick"]["budget_ms"] == 30.0
    assert args["full-70b"]["workloads"] == ["llama3-70b-tp8"] and args["full-70b"]["no_interference"]
    assert args["full-70b"]["budget_ms"] == 100.0 and not args["full-70b"]["quick"]
    assert args["extras"]["no_sweep"] and not args["extras"]["no_overhead"]
    assert all(a["json"] == "x.json" for a in args.values())
