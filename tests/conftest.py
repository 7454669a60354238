"""Test setup: kernels on CPU tensors run under Triton's interpreter; `gpu` tests need CUDA."""

import os

import pytest
import torch

# Set before any test module imports triton, so the interpreter also covers Triton's @jit standard library. CPU
# tensors go through the interpreter regardless (kernels/copy_blocks.py); on a CUDA machine the variable stays unset
# so the `gpu` tests compile real kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
