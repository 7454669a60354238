"""Test setup: kernels on CPU tensors run under Triton's interpreter; `gpu` tests need CUDA."""

import os

import pytest
import torch

# Set before any test module imports triton, so the interpreter also covers Triton's @jit standard library. CPU
# tensors go through the interpreter regardless (kernels/copy_blocks.py); on a CUDA machine the variable stays unset
# so the `gpu` tests compile real kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """Where the KV caches live: CPU (the kernels under the interpreter) or CUDA (compiled, pinned host cache)."""
    return request.param


@pytest.fixture
def make_host_cache():
    """Builds HostCaches and closes every one at teardown, also when the test fails: a pinned cache left registered
    after its memory is unmapped would make CUDA treat the next mapping at that address as pinned."""
    from triton_offload.host.cache import HostCache

    made = []

    def make(*args, **kwargs):
        made.append(HostCache(*args, **kwargs))
        return made[-1]

    yield make
    for cache in made:
        cache.close()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The end-to-end tests' tiny random-weight Llama (tests/vllm_harness.py), one directory per test module: engines
    that share KV must name the same model path, part of the tiers' namespace."""
    import vllm_harness

    path = tmp_path_factory.mktemp("model") / "tiny_llama"
    vllm_harness.build_tiny_llama(str(path))
    return path


@pytest.fixture(scope="session")
def real_model():
    """The real model's folder (tests/real_model.py: made once per cache directory; skipped, or failed in CI, where it
    cannot be made), for the end-to-end tests where the text matters."""
    import real_model as real

    return real.real_model()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
