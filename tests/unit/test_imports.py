"""The scheduler side stays light: vLLM's engine-core process imports our manager and policies, which are pure
Python; importing them must not load torch or Triton (seconds of start-up and hundreds of MiB), nor patch Triton."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import sys
import {modules}
heavy = sorted(m for m in ("torch", "triton", "numpy", "vllm") if m in sys.modules)
print(",".join(heavy))
"""


def _heavy_modules_after(*modules: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(modules=", ".join(modules))],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


@pytest.mark.parametrize(
    "modules",
    [
        ("triton_offload",),
        ("triton_offload.manager", "triton_offload.policies"),
        ("triton_offload.connector", "triton_offload.connector.config"),
    ],
    ids=["package", "manager+policies", "connector-config"],
)
def test_scheduler_modules_import_neither_torch_nor_triton(modules):
    assert _heavy_modules_after(*modules) == ""


def test_public_names_still_resolve_lazily():
    """The lazy top level still offers the library API, importing torch only when it is used."""
    probe = (
        "import sys, triton_offload as to\n"
        "assert 'torch' not in sys.modules\n"
        "assert to.KVCacheSpec.__name__ == 'KVCacheSpec' and callable(to.gather_blocks)\n"
        "assert 'torch' in sys.modules\n"
        "assert set(to.__all__) <= set(dir(to))\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=120)
