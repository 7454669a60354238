#!/usr/bin/env python3
"""vLLM 0.33's Python code for a machine that has no vLLM and no network (the GPU machine): built here as one folder
that travels with the working tree (:func:`build`), unpacked there onto ``PYTHONPATH`` (:func:`unpack`). A full vLLM
cannot go there (a 336 MB wheel needing torch 2.14; the GPU image has 2.11), but its offloading path is Python plus one
compiled op, registered by ``bench/baselines/vllm_native.py``. Stdlib only.

    python -m tools.gpu.vllm_bundle build [--out .gpu-bundle] [--python-version 3.12 ...]  # where vLLM 0.33.0 is
    python -m tools.gpu.vllm_bundle unpack [--bundle .gpu-bundle] [--dest DIR] [--lenient]  # prints the folder
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import importlib.metadata
import io
import json
import pathlib
import shutil
import subprocess
import sys
import tarfile

from bench.common.grid import VLLM_VERSION

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_BUNDLE = ROOT / ".gpu-bundle"
DEFAULT_SITE = ROOT / ".gpu-bundle-site"
SOURCE = f"vllm-{VLLM_VERSION}-py.tar.gz"
MANIFEST = "MANIFEST.json"
# Found by importing vLLM's modules with only torch, Triton, NumPy and the GPU image's packages (its published list)
# present; pinned to the versions of .venv-vllm33, where the plugin's tests pass against vLLM 0.33.0.
# vLLM's worker (vllm/v1/kv_offload/cpu/gpu_worker.py, what vllm_native runs) needs these two beyond the image:
WORKER_WHEELS = {"msgspec": "0.22.0", "pyzmq": "27.3.0"}
# vLLM's config, scheduler and connector modules, which the plugin's tests import, pull in its entry points,
# structured outputs and multimodal code at import time; these are what they need beyond the image (typing-extensions
# too: the pydantic pinned here needs >= 4.16).
CONNECTOR_WHEELS = {
    "annotated-types": "0.8.0", "apache-tvm-ffi": "0.1.15.post2", "cachetools": "8.0.1", "cbor2": "6.3.0",
    "fastapi": "0.165.0", "httpcore2": "2.16.2", "httpx2": "2.16.2", "llguidance": "1.9.1", "openai": "3.54.0",
    "openai-harmony": "0.0.8", "opentelemetry-api": "1.45.2", "partial-json-parser": "0.2.1.1.post7",
    "pybase64": "1.5.1", "pydantic": "2.14.3", "pydantic-core": "2.50.4", "sniffio": "1.3.1", "starlette": "1.10.0",
    "truststore": "0.10.5", "typing-extensions": "4.16.0", "typing-inspection": "0.4.5", "xgrammar": "0.2.8",
}  # fmt: skip
WHEELS = {**WORKER_WHEELS, **CONNECTOR_WHEELS}
# What the worker's import chain takes from the GPU image; tests/bench/test_vllm_bundle.py stands these in from the
# local environment when it imitates that image.
IMAGE_PROVIDES = ("packaging", "regex", "requests", "urllib3", "idna", "certifi", "charset-normalizer", "psutil")
# vllm/platforms/cuda.py imports this compiled extension at module level, only to register vLLM's CUDA ops; none of
# them is on the offloading path but swap_blocks_batch, which vllm_native registers. Without the module, vLLM's CUDA
# platform cannot be imported at all.
STUBS = {
    "vllm/_C_stable_libtorch.py": (
        '"""Stand-in added by triton-offload\'s tools/gpu/vllm_bundle.py: vLLM\'s compiled extension (a .so that this\n'
        "bundle does not carry) registers vLLM's CUDA ops when imported. Importing this registers none; an op called\n"
        'without a registration fails with torch\'s own "no such operator" error."""\n'
    ),
}
THIRD_PARTY_KEPT = ("vllm/third_party/__init__.py", "vllm/third_party/pynvml.py")
LIMIT_BYTES = 40 << 20  # the working tree that travels is at most 64 MiB, this folder included
# Platform tags pip matches exactly; the GPU image is x86-64 Linux with a recent glibc.
PLATFORMS = (*(f"manylinux_2_{v}_x86_64" for v in (31, 28, 27, 26, 24, 17)), "manylinux2014_x86_64",
             "manylinux1_x86_64")  # fmt: skip
_MTIME = 1_700_000_000  # every tar member's time: a fixed date, so builds are byte-identical


class BundleError(RuntimeError):
    """The bundle cannot be built or used; the message says what to do."""


def python_tag(version: str | None = None) -> str:
    """``3.12`` -> ``cp312``; the running interpreter's tag when no version is given."""
    major, minor = (version.split(".")[:2]) if version else sys.version_info[:2]
    return f"cp{major}{minor}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _vllm_distribution() -> importlib.metadata.Distribution:
    try:
        dist = importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        raise BundleError(f"no vLLM installed in {sys.executable}: build the bundle with the interpreter of "
                          f".venv-vllm33 (./dev setup), where vllm=={VLLM_VERSION} is installed") from None  # fmt: skip
    if dist.version != VLLM_VERSION:
        raise BundleError(f"{sys.executable} has vllm {dist.version}; the bundle is vLLM {VLLM_VERSION}")
    return dist


def select_files(dist: importlib.metadata.Distribution) -> list[importlib.metadata.PackagePath]:
    """The installed wheel's files that go into the bundle, sorted: vLLM's ``.py`` files outside ``third_party/``,
    :data:`THIRD_PARTY_KEPT`, and the wheel's METADATA."""

    def wanted(name: str) -> bool:
        code = name.startswith("vllm/") and name.endswith(".py")
        return name.endswith(".dist-info/METADATA") or code and (not name.startswith("vllm/third_party/")
                                                                 or name in THIRD_PARTY_KEPT)  # fmt: skip

    return sorted((f for f in dist.files or () if wanted(f.as_posix())), key=lambda f: f.as_posix())


def _read_checked(dist, f: importlib.metadata.PackagePath) -> bytes:
    """A file's bytes, after checking them against the wheel's RECORD (sha256, urlsafe base64 without padding)."""
    data = pathlib.Path(dist.locate_file(f)).read_bytes()
    if f.hash is None or f.hash.mode != "sha256":
        raise BundleError(f"{f} has no sha256 in vLLM's RECORD: cannot check that it is the release's file")
    got = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    if got != f.hash.value:
        raise BundleError(f"{dist.locate_file(f)} differs from vLLM {VLLM_VERSION}'s RECORD: reinstall vllm")
    return data


def _tarball(files: list[tuple[str, bytes]]) -> bytes:
    """A gzip-compressed tar of (name, bytes), byte-identical for identical input: sorted names, fixed times and
    owners, no gzip timestamp."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), _MTIME, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=9, mtime=0) as gz:
        gz.write(raw.getvalue())
    return out.getvalue()


def _download_wheels(dest: pathlib.Path, version: str, pins: dict[str, str]) -> list[pathlib.Path]:
    """``pins`` for CPython ``version`` on x86-64 Linux, through pip (its cache is used)."""
    dest.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", version]
    cmd += ["--implementation", "cp", *(a for p in PLATFORMS for a in ("--platform", p)), "-d", str(dest)]
    cmd += [f"{name}=={pin}" for name, pin in pins.items()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode:
        raise BundleError(f"pip could not download {pins} for Python {version}:\n{proc.stdout}{proc.stderr}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != len(pins):
        raise BundleError(f"expected one wheel per pin {pins}, got {[w.name for w in wheels]}")
    return wheels


def build(out: pathlib.Path = DEFAULT_BUNDLE, python_versions: tuple[str, ...] = ("3.12",), include: set | None = None,
          wheels: dict[str, str] | None = None, limit_bytes: int = LIMIT_BYTES) -> dict:  # fmt: skip
    """Builds the bundle into ``out`` (replacing what a previous build put there) from the vLLM installed in this
    interpreter, with wheels for every ``major.minor`` in ``python_versions``; returns the manifest. ``include``: only
    these vLLM files (for tests); ``wheels``: the pins (default :data:`WHEELS`); a bundle over ``limit_bytes`` is an
    error.

    The bundle holds ``vllm-0.33.0-py.tar.gz`` (every ``.py`` file of the installed release but ``vllm/third_party/``
    other than its ``pynvml.py``, and the wheel's ``METADATA``, each checked against the wheel's ``RECORD``, written
    with sorted names and fixed times so the same release gives the same bytes), ``wheels/<cpXY>/`` (:data:`WHEELS`,
    what vLLM's modules on the tests' paths import beyond the GPU image, pinned, per Python asked for) and
    ``MANIFEST.json`` (versions, hashes, sizes).
    """
    pins = WHEELS if wheels is None else wheels
    dist = _vllm_distribution()
    chosen = [f for f in select_files(dist) if include is None or f.as_posix() in include or f.name == "METADATA"]
    if include is not None and len(chosen) != len(include) + 1:
        missing = sorted(set(include) - {f.as_posix() for f in chosen})
        raise BundleError(f"not files of vLLM {VLLM_VERSION}'s bundle: {missing[:5]}")
    source = _tarball([(f.as_posix(), _read_checked(dist, f)) for f in chosen])
    for old in (out / SOURCE, out / MANIFEST):
        old.unlink(missing_ok=True)
    shutil.rmtree(out / "wheels", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / SOURCE).write_bytes(source)
    fetched: dict[str, list[dict]] = {}
    for version in python_versions:
        tag = python_tag(version)
        found = _download_wheels(out / "wheels" / tag, version, pins)
        fetched[tag] = [{"file": w.name, "sha256": _sha256(w.read_bytes()), "bytes": w.stat().st_size} for w in found]
    total = len(source) + sum(w["bytes"] for ws in fetched.values() for w in ws)
    manifest = {"vllm": VLLM_VERSION, "wheels": fetched, "pins": {"vllm": VLLM_VERSION, **pins}, "stubs": sorted(STUBS),
                "total_bytes": total, "limit_bytes": limit_bytes,
                "source": {"file": SOURCE, "sha256": _sha256(source), "bytes": len(source), "files": len(chosen),
                           "from": f"vllm {VLLM_VERSION} as installed from PyPI; every file checked against the "
                           "wheel's RECORD"}}  # fmt: skip
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    if total > limit_bytes:
        raise BundleError(f"the bundle is {total / 2**20:.1f} MiB, over its limit of {limit_bytes / 2**20:.0f} MiB")
    return manifest


def describe(manifest: dict, tag: str | None = None) -> str:
    """One line: what a bundle holds (for ``tag``, or every Python it has wheels for)."""
    src = manifest["source"]
    line = f"vLLM {manifest['vllm']} ({src['files']} files, sha256 {src['sha256'][:12]})"
    tags = [tag] if tag else sorted(manifest["wheels"])
    if tag and tag not in manifest["wheels"]:
        line += f" with this environment's packages (the bundle has no wheels for {tag})"
    else:
        line += f" + {len(manifest['pins']) - 1} pinned wheels for {'/'.join(tags)}"
    return f"{line}: {manifest['total_bytes'] / 2**20:.1f} MiB (limit {manifest['limit_bytes'] / 2**20:.0f} MiB)"


def read_manifest(bundle: pathlib.Path) -> dict:
    path = bundle / MANIFEST
    if not path.is_file():
        raise BundleError(f"no {path}: build the bundle with ./dev gpu-bundle")
    return json.loads(path.read_text())


def _check(path: pathlib.Path, sha256: str) -> None:
    if not path.is_file() or _sha256(path.read_bytes()) != sha256:
        raise BundleError(f"{path} is missing or differs from the manifest: rebuild the bundle (./dev gpu-bundle)")


def _extract(tar_path: pathlib.Path, dest: pathlib.Path) -> None:
    with tarfile.open(tar_path, "r:gz") as tar:
        for member in tar.getmembers():
            name = pathlib.PurePosixPath(member.name)
            if not member.isfile() or name.is_absolute() or ".." in name.parts:
                raise BundleError(f"{tar_path}: unexpected member {member.name!r}")
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)


def unpack(bundle: pathlib.Path = DEFAULT_BUNDLE, dest: pathlib.Path | None = None) -> tuple[pathlib.Path, str]:
    """Unpacks ``bundle`` for the running Python into ``dest`` (default ``.gpu-bundle-site/<cpXY>``), checking every
    hash; a folder already unpacked from the same manifest is reused. Returns (the folder to put first on
    ``PYTHONPATH``, a line saying what it holds). It checks every hash, extracts the code, installs the wheels with pip
    (``--no-index --target``) and adds :data:`STUBS` for compiled extensions vLLM imports unconditionally; the one
    compiled op the path calls is registered by ``bench/baselines/vllm_native.py``."""
    manifest = read_manifest(bundle)
    tag = python_tag()
    dest = dest or DEFAULT_SITE / tag
    stamp = _sha256(json.dumps(manifest, sort_keys=True).encode())
    marker = dest / ".unpacked-from"
    line = describe(manifest, tag)
    if marker.is_file() and marker.read_text() == stamp:
        return dest, f"{line}, unpacked at {dest} (reused)"
    _check(bundle / manifest["source"]["file"], manifest["source"]["sha256"])
    entries = manifest["wheels"].get(tag, [])  # none: the environment's own packages serve (a local CPU check)
    wheels = [bundle / "wheels" / tag / w["file"] for w in entries]
    for path, w in zip(wheels, entries):
        _check(path, w["sha256"])
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    _extract(bundle / manifest["source"]["file"], dest)
    if wheels:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        cmd += ["--no-cache-dir", "--target", str(dest), *map(str, wheels)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode:
            raise BundleError(f"pip could not install the bundle's wheels into {dest}:\n{proc.stdout}{proc.stderr}")
    for name, text in STUBS.items():
        (dest / name).write_text(text)
    marker.write_text(stamp)
    return dest, f"{line}, unpacked at {dest}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the bundle from the vLLM installed in this interpreter")
    b.add_argument("--out", type=pathlib.Path, default=DEFAULT_BUNDLE)
    b.add_argument("--python-version", action="append", metavar="X.Y", help="Python to fetch wheels for (repeat); "
                   "default 3.12, the GPU image's")  # fmt: skip
    u = sub.add_parser("unpack", help="unpack for this interpreter; prints the folder for PYTHONPATH")
    u.add_argument("--bundle", type=pathlib.Path, default=DEFAULT_BUNDLE)
    u.add_argument("--dest", type=pathlib.Path)
    u.add_argument("--lenient", action="store_true", help="a bundle that cannot be unpacked is a warning (exit 0, no "
                   "folder printed, nothing left half-unpacked): a GPU lease goes on without vLLM's code")  # fmt: skip
    args = p.parse_args(argv)
    try:
        if args.cmd == "build":
            manifest = build(args.out, tuple(dict.fromkeys(args.python_version or ["3.12"])))
            print(f"[vllm-bundle] {args.out}: {describe(manifest)}", file=sys.stderr)
        else:
            dest, line = unpack(args.bundle, args.dest)
            print(f"[vllm-bundle] {line}", file=sys.stderr)
            print(dest)
    except (BundleError, OSError, ValueError, KeyError, tarfile.TarError) as exc:
        if args.cmd == "unpack" and args.lenient:
            shutil.rmtree(args.dest or DEFAULT_SITE / python_tag(), ignore_errors=True)
            print(f"[vllm-bundle] WARNING: the bundle could not be unpacked ({type(exc).__name__}: {exc}); going on "
                  "without vLLM's code: vLLM's tests skip, vllm_native is not available", file=sys.stderr)  # fmt: skip
            return 0
        print(f"[vllm-bundle] {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
