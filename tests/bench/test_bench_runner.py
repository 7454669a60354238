"""`./dev gpu run OUTDIR` (and `./dev gpu PART OUTDIR`, one stage of it), the GPU machine's one command: without CUDA
it refuses in one line before installing anything (unless --dry-run, which prints the plan anywhere); with CUDA it
installs once, then hands over to tools/gpu/run.py (tests/bench/test_gpu_run.py); every part is sized by
tools/gpu/parts.py's time model to finish in under 8 minutes on an H100."""

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
from tools.gpu import parts, stages

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
    """No CUDA here: --dry-run still plans (from the committed ledger and the time model), installs and runs nothing."""
    out = tmp_path / "out"
    bin_dir = tmp_path / "bin"  # python3: this interpreter (torch, no CUDA), whatever the machine's python3 is
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls.log"}\nexec {sys.executable} "$@"\n')
    (bin_dir / "python3").chmod(0o755)
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


def test_every_part_is_estimated_under_8_minutes():
    estimates = {name: parts.estimate_seconds(name) for name in parts.part_names()}
    assert all(0 < s < parts.LIMIT_S for s in estimates.values()), estimates
    assert all(60 < s for name, s in estimates.items() if name != parts.MACHINE_PART), estimates
    # Together the full-* parts are the whole sweep: every workload once, and the extras once.
    swept = [a[a.index("--workloads") + 1] for n, a in parts.PARTS.items() if n.startswith("full-")]
    assert sorted(swept) == sorted(workloads.WORKLOADS)
    assert [n for n, a in parts.PARTS.items() if "--no-overhead" not in a and "--quick" not in a] == ["extras"]


def test_the_launch_shape_part_is_estimated_from_its_own_grid():
    """Its options (two workloads, 128/1024 blocks, 4 CTA counts) are what the model counts: more than the 70B part
    alone at those sizes, less than the two full parts together."""
    est = parts.estimate_seconds("launch-shape")
    assert (
        parts.estimate_seconds("full-70b")
        < est
        < parts.estimate_seconds("full-70b") + parts.estimate_seconds("full-small")
    )


def test_the_parts_cli(capsys):
    assert parts.main(["args", "full-mla"]) == 0
    assert capsys.readouterr().out.split() == parts.PARTS["full-mla"]
    assert parts.main(["args", "gpu-tests"]) == 2
    assert "full-small" in capsys.readouterr().err
    assert parts.main(["list"]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert set(listed) == set(parts.part_names())
    assert "python -m bench.serving --preset decisive" in listed["serving"] and "pytest -m gpu" in listed["gpu-tests"]
    assert "python -m bench.micro.call_cost" in listed["call-cost"]


def test_result_names_are_device_date_part():
    stem = results.result_stem("NVIDIA H100 80GB HBM3", "full-70b", datetime.date(2026, 11, 22))
    assert stem == "nvidia-h100-80gb-hbm3-2026-11-22-full-70b"


def test_each_part_expands_to_valid_benchmark_options():
    args = {name: vars(bench_transfer.parse_args(["--part", name, "--json", "x.json"])) for name in parts.PARTS}
    assert args["quick"]["quick"] and args["quick"]["budget_ms"] == 30.0
    assert args["full-70b"]["workloads"] == ["llama3-70b-tp8"] and args["full-70b"]["no_interference"]
    assert args["full-70b"]["budget_ms"] == 100.0 and not args["full-70b"]["quick"]
    assert args["extras"]["no_sweep"] and not args["extras"]["no_overhead"]
    assert all(a["json"] == "x.json" for a in args.values())


def test_the_time_model_counts_the_default_num_ctas():
    """The sweep always adds the kernel's default num_ctas; tools/gpu/parts.py (which cannot import the kernel) counts
    the Triton points from the grids, so the default must be in both for its estimates to hold."""
    from triton_offload.kernels.copy_blocks import DEFAULT_NUM_CTAS

    assert DEFAULT_NUM_CTAS in grid.FULL.num_ctas and DEFAULT_NUM_CTAS in grid.QUICK.num_ctas
