"""Every results file records the code it measured: the commit and whether the checkout differed from it."""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

from bench.common import results

ROOT = pathlib.Path(__file__).resolve().parents[2]


def git(cwd, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def test_machine_info_records_the_commit_of_this_checkout():
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout (an installed copy): the commit is 'unknown' there, tested below")
    info = results.machine_info()
    assert re.fullmatch(r"[0-9a-f]{40}", info["commit"]) and info["commit"] == git(ROOT, "rev-parse", "HEAD")
    assert isinstance(info["dirty"], bool)


def test_a_changed_tracked_file_makes_the_source_dirty(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "kernel.py").write_text("x = 1\n")
    git(tmp_path, "add", "kernel.py")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "measured code")
    clean = results.source_info(tmp_path)
    (tmp_path / "notes.txt").write_text("untracked: not measured code\n")
    untracked = results.source_info(tmp_path)
    (tmp_path / "kernel.py").write_text("x = 2\n")
    dirty = results.source_info(tmp_path)
    assert clean == untracked == {"commit": git(tmp_path, "rev-parse", "HEAD"), "dirty": False}
    assert dirty == {"commit": clean["commit"], "dirty": True}


def test_outside_a_checkout_the_commit_is_unknown(tmp_path):
    assert results.source_info(tmp_path) == {"commit": "unknown", "dirty": None}
