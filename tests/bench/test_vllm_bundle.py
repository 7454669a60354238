"""The bundle of vLLM 0.33's Python code for the GPU machine (tools/gpu/vllm_bundle.py).

Built here from the installed release (each file checked against the wheel's RECORD, the tarball byte-identical from
one build to the next), unpacked with its stand-in for vLLM's compiled extension, then imported in a clean interpreter
that stands in for the GPU image: no site-packages, only torch, Triton and NumPy (with what they require) and the few
packages the image provides that vLLM's worker imports. There, vLLM's own worker runs ``vllm_native``'s host replay
and the bytes are checked, and vLLM's CUDA platform module imports (it does not without the stand-in). The bundle is
built for this interpreter's Python with only the worker's wheels; ``./dev gpu-bundle`` builds the GPU's (3.12).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys
import tarfile

import pytest
from vllm_harness import VLLM_033, vllm_version

from tools.gpu import vllm_bundle

ROOT = pathlib.Path(__file__).resolve().parents[2]

if not VLLM_033:
    pytest.skip(f"builds from an installed vLLM 0.33.0 (.venv-vllm33); found {vllm_version()}", allow_module_level=True)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vb():
    return vllm_bundle


@pytest.fixture(scope="module")
def built(vb, tmp_path_factory):
    """This Python's bundle (the worker's wheels only) and its manifest."""
    out = tmp_path_factory.mktemp("bundle")
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    return out, vb.build(out, (version,), wheels=vb.WORKER_WHEELS)


@pytest.fixture(scope="module")
def site(vb, built, tmp_path_factory):
    dest = tmp_path_factory.mktemp("site") / vb.python_tag()
    path, line = vb.unpack(built[0], dest)
    assert path == dest and "unpacked at" in line and "(reused)" not in line
    assert vb.unpack(built[0], dest)[1].endswith("(reused)")
    return dest


def test_the_bundle_is_the_releases_python_code(vb, built):
    out, manifest = built
    names = tarfile.open(out / manifest["source"]["file"]).getnames()
    assert names == sorted(names) and manifest["source"]["files"] == len(names) > 2500
    assert "vllm/v1/kv_offload/cpu/gpu_worker.py" in names and "vllm/third_party/pynvml.py" in names
    assert [n for n in names if not n.endswith(".py")] == ["vllm-0.33.0.dist-info/METADATA"]
    assert not [n for n in names if n.startswith("vllm/third_party/") and n not in vb.THIRD_PARTY_KEPT]
    record = {f.as_posix() for f in importlib.metadata.distribution("vllm").files}
    every_py = {n for n in record if n.startswith("vllm/") and n.endswith(".py") and "/third_party/" not in n}
    assert every_py <= set(names), "a .py file of the release is missing"
    tag = vb.python_tag()
    assert sorted(manifest["wheels"]) == [tag] and len(manifest["wheels"][tag]) == len(vb.WORKER_WHEELS)
    assert manifest["pins"] == {"vllm": "0.33.0", **vb.WORKER_WHEELS}
    assert manifest["total_bytes"] <= manifest["limit_bytes"] == 40 << 20
    assert "built" not in json.dumps(manifest).lower(), "nothing about the time of the build"


def test_the_tarball_depends_on_its_content_only(vb):
    files = [("vllm/b.py", b"b = 2\n"), ("vllm/a.py", b"a = 1\n")]
    assert vb._tarball(files) == vb._tarball(files[::-1])
    assert vb._tarball(files) != vb._tarball([("vllm/a.py", b"a = 2\n"), files[0]])


def test_a_changed_file_is_refused(vb, built, tmp_path):
    out, manifest = built
    copy = tmp_path / "bundle"
    copy.mkdir()
    (copy / "MANIFEST.json").write_text(json.dumps(manifest))
    data = bytearray((out / manifest["source"]["file"]).read_bytes())
    data[-100] ^= 0xFF
    (copy / manifest["source"]["file"]).write_bytes(bytes(data))
    with pytest.raises(vb.BundleError, match="differs from the manifest"):
        vb.unpack(copy, tmp_path / "site")
    with pytest.raises(vb.BundleError, match="no .*MANIFEST.json: build the bundle with ./dev gpu-bundle"):
        vb.unpack(tmp_path / "nothing", tmp_path / "site")


def _requires(name: str) -> list[str]:
    from packaging.requirements import Requirement

    out = []
    for text in importlib.metadata.requires(name) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(req.name)
    return out


def _image(dest: pathlib.Path, roots: list[str]) -> None:
    """Links the distributions ``roots`` and everything they require, from this environment, into ``dest``."""
    todo, seen = list(roots), set()
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        dist = importlib.metadata.distribution(name)
        for f in dist.files or ():
            top = f.parts[0]
            target = pathlib.Path(dist.locate_file(top))
            if top not in ("..", "__pycache__", "bin") and target.exists() and not (dest / top).exists():
                (dest / top).symlink_to(target)
        todo += _requires(name)


_DRIVER = """
import json, sys
sys.path[:0] = {paths!r}
import torch
from bench.baselines import vllm_native

# vLLM's CUDA platform module imports its compiled extension at module level: without the bundle's stand-in it
# cannot be imported at all; with it, it is.
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm._C_stable_libtorch":
            raise ModuleNotFoundError("No module named 'vllm._C_stable_libtorch'", name=name)

absent = Absent()
sys.meta_path.insert(0, absent)
try:
    import vllm.platforms.cuda
    without_stub = "imported"
except ModuleNotFoundError as exc:
    without_stub = str(exc)
sys.meta_path.remove(absent)  # vLLM adds finders of its own at the front while it imports
import vllm.platforms.cuda

gen = torch.Generator().manual_seed(0)
widths = [48, 96]
pages = [torch.randint(0, 256, (10, w), dtype=torch.uint8, generator=gen) for w in widths]
before = [p.clone() for p in pages]
worker = vllm_native.NativeWorker(pages, 4, 3)
gpu, host = [7, 2, 5, 0, 9], [2, 0]
worker.wait([worker.submit_store(gpu, host, skip=2)])
stored = True
for t, w in enumerate(widths):
    want = torch.zeros(3, 4 * w, dtype=torch.int8)  # vLLM's region starts zeroed; only the stored pages change
    for i, g in enumerate(gpu):
        row, sub = host[(2 + i) // 4], (2 + i) % 4
        want[row, sub * w : (sub + 1) * w] = pages[t][g].view(torch.int8)
    stored = stored and torch.equal(worker.host_views[t], want)
worker.wait([worker.submit_load(host, [1, 3, 4, 6, 8], skip=2)])
loaded = all(torch.equal(p[[1, 3, 4, 6, 8]], b[gpu]) for p, b in zip(pages, before))
others = all(torch.equal(p[[0, 2, 5, 7, 9]], b[[0, 2, 5, 7, 9]]) for p, b in zip(pages, before))
worker.shutdown()
files = sorted({{f for m in list(sys.modules.values()) if (f := getattr(m, "__file__", None) or "").startswith("/")}})
print(json.dumps({{"without_stub": without_stub, "stored": stored, "loaded": loaded,
                  "others": others, "batches": len(worker._swap.stand_in.calls), "files": files}}))
"""


def test_vllms_worker_runs_from_the_bundle_in_a_clean_interpreter(vb, site, tmp_path):
    """No site-packages: the bundle, torch/Triton/NumPy and their requirements, IMAGE_PROVIDES and the project's own
    package. vLLM's worker
    imports from the bundle, vllm_native's host replay stores and loads the right bytes (and only those), vLLM's CUDA
    platform module imports thanks to the stand-in (and not without it), and no module comes from anywhere else."""
    env_dir = tmp_path / "image"
    env_dir.mkdir()
    _image(env_dir, ["torch", "triton", "numpy", *vb.IMAGE_PROVIDES])
    # The project itself is installed on the GPU machine (the benchmark's driver binding is the library's,
    # triton_offload/cuda_driver.py): its package as setup.cfg maps it stands in for that, and the benchmarks run from
    # the repository root.
    package = tmp_path / "installed"
    (package / "triton_offload").mkdir(parents=True)
    for entry in (ROOT / "triton_offload").iterdir():
        (package / "triton_offload" / entry.name).symlink_to(entry)
    for sub in ("kernels", "connector"):
        (package / "triton_offload" / sub).symlink_to(ROOT / sub)
    paths = [str(site), str(env_dir), str(package), str(ROOT)]
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _DRIVER.format(paths=paths)],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)},
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["without_stub"] == "No module named 'vllm._C_stable_libtorch'"
    assert report["stored"] and report["loaded"] and report["others"]
    assert report["batches"] == 2
    stdlib = pathlib.Path(os.__file__).parent
    allowed = (str(site), str(env_dir), str(ROOT / "bench"), str(package), str(stdlib))
    strays = [f for f in report["files"] if not f.startswith(allowed)]
    assert not strays, strays
    assert f"{site}/vllm/v1/kv_offload/cpu/gpu_worker.py" in report["files"]
