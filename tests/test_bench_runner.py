"""`./dev gpu PART OUTDIR`, the GPU machine's runner: without CUDA it refuses in one line before installing anything,
and every part it runs is sized by bench/parts.py's time model to finish in under 8 minutes on an H100."""

from __future__ import annotations

import datetime
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from bench_modules import bench_modules

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _fake_python3(tmp_path: pathlib.Path) -> pathlib.Path:
    """A python3 without site-packages (so without torch, as a bare machine's might be) that logs every call."""
    real = shutil.which("python3") or sys.executable
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "python3"
    shim.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls.log"}\nexec {real} -S -E "$@"\n')
    shim.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("part", ["tests", "quick", "full-8b", "serving", "call-cost", "no-such-part"])
def test_without_cuda_the_runner_says_so_in_one_line_and_installs_nothing(tmp_path, part):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_OFFLOAD_VENV")}
    env["PATH"] = f"{_fake_python3(tmp_path)}:{env['PATH']}"
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(ROOT / "dev"), "gpu", part, str(out)], capture_output=True, text=True, env=env, timeout=60
    )
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stdout + proc.stderr
    assert "no CUDA device" in lines[0] and "nothing installed" in lines[0]
    calls = (tmp_path / "calls.log").read_text()
    assert "pip" not in calls and "parts.py" not in calls  # only the CUDA probe ran
    assert not out.exists()


def _cuda_python3(tmp_path: pathlib.Path) -> pathlib.Path:
    """A python3 that says it has CUDA and the project installed, runs bench/parts.py for real (but names the
    files with a fixed stem), and only logs whatever else it is asked to run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "python3"
    shim.write_text(
        f"""#!/bin/sh
echo "$@" >> {tmp_path / "calls.log"}
case "$1" in
  -) cat > /dev/null; exit 0 ;;  # the CUDA probe
  -c) exit 0 ;;  # "installed from this checkout?"
  */parts.py) [ "$2" = stem ] && {{ echo "gpu-2026-01-01-$3"; exit 0; }}; exec {sys.executable} "$@" ;;
  *) echo "would run: $*"; exit 0 ;;
esac
"""
    )
    shim.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize(
    "part, command",
    [
        ("serving", "bench/serving.py --json {out}/gpu-2026-01-01-serving.json --plot "
         "{out}/gpu-2026-01-01-serving.png"),
        ("call-cost", "bench/call_cost.py --json {out}/gpu-2026-01-01-call-cost.json"),
        ("quick", "bench/bench_transfer.py --part quick --json {out}/gpu-2026-01-01-quick.json --plot "
         "{out}/gpu-2026-01-01-quick.png"),
    ],
)  # fmt: skip
def test_with_cuda_each_part_runs_its_script_into_outdir(tmp_path, part, command):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_OFFLOAD_VENV")}
    env["PATH"] = f"{_cuda_python3(tmp_path)}:{env['PATH']}"
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(ROOT / "dev"), "gpu", part, str(out)], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [line for line in (tmp_path / "calls.log").read_text().splitlines() if line.startswith(str(ROOT))]
    assert calls == [f"{ROOT}/bench/parts.py check {part}", f"{ROOT}/bench/parts.py stem {part}",
                     f"{ROOT}/{command.format(out=out)}"]  # fmt: skip
    assert "would run" in (out / f"gpu-2026-01-01-{part}.log").read_text()


def test_the_runner_wants_a_part_and_an_outdir():
    proc = subprocess.run(["bash", str(ROOT / "dev"), "gpu", "quick"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage: ./dev gpu PART OUTDIR" in proc.stderr


@pytest.fixture(scope="module")
def parts():
    with bench_modules("parts") as (module,):
        yield module


def test_every_part_is_estimated_under_8_minutes(parts):
    names = [parts.TEST_PART, *parts.PARTS, parts.SERVING_PART, parts.CALL_COST_PART]
    estimates = {name: parts.estimate_seconds(name) for name in names}
    assert all(60 < s < parts.LIMIT_S for s in estimates.values()), estimates
    # Together the parts are the whole sweep: every workload once, and the extras once.
    with bench_modules("workloads") as (workloads,):
        swept = [a[a.index("--workloads") + 1] for a in parts.PARTS.values() if "--workloads" in a]
        assert sorted(swept) == sorted(workloads.WORKLOADS)
    assert [n for n, a in parts.PARTS.items() if "--no-overhead" not in a and "--quick" not in a] == ["extras"]


def test_the_parts_cli(parts, capsys):
    assert parts.main(["args", "full-mla"]) == 0
    assert capsys.readouterr().out.split() == parts.PARTS["full-mla"]
    assert parts.main(["check", "tests"]) == 0 and parts.main(["check", "serving"]) == 0
    assert parts.main(["check", "full"]) == 2
    assert "full-small" in capsys.readouterr().err
    assert parts.main(["list"]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert set(listed) == {parts.TEST_PART, *parts.PARTS, parts.SERVING_PART, parts.CALL_COST_PART}
    assert listed["serving"].endswith("bench/serving.py") and listed["tests"].endswith("pytest -m gpu")
    assert listed["call-cost"].endswith("bench/call_cost.py")


def test_result_names_are_device_date_part():
    with bench_modules("results") as (results,):
        stem = results.result_stem("NVIDIA H100 80GB HBM3", "full-70b", datetime.date(2026, 11, 22))
    assert stem == "nvidia-h100-80gb-hbm3-2026-11-22-full-70b"


def test_each_part_expands_to_valid_benchmark_options():
    with bench_modules("bench_transfer", "parts") as (bench_transfer, parts):
        args = {name: vars(bench_transfer.parse_args(["--part", name, "--json", "x.json"])) for name in parts.PARTS}
    assert args["quick"]["quick"] and args["quick"]["budget_ms"] == 30.0
    assert args["full-70b"]["workloads"] == ["llama3-70b-tp8"] and args["full-70b"]["no_interference"]
    assert args["full-70b"]["budget_ms"] == 100.0 and not args["full-70b"]["quick"]
    assert args["extras"]["no_sweep"] and not args["extras"]["no_overhead"]
    assert all(a["json"] == "x.json" for a in args.values())


def test_the_time_model_uses_the_sm_copy_threshold(parts):
    with bench_modules("sm_copy") as (sm_copy,):
        assert parts.SM_COPY_MAX_PAGE_BYTES == sm_copy.MAX_PAGE_BYTES


def test_the_time_model_counts_the_default_num_ctas():
    """The sweep always adds the kernel's default num_ctas; parts.py (which cannot import the kernel) counts the
    Triton points from the grids, so the default must be in both for its estimates to hold."""
    from triton_offload.kernels.copy_blocks import DEFAULT_NUM_CTAS

    with bench_modules("grid") as (grid,):
        assert DEFAULT_NUM_CTAS in grid.FULL.num_ctas and DEFAULT_NUM_CTAS in grid.QUICK.num_ctas
