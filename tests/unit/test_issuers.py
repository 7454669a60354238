"""The issuer factory (triton_offload/issuers/factory.py): a transfer path is one issuer class plus one entry in
``PATHS``. A stand-in third path, registered there and nowhere else, is accepted by the engine by name, chosen by
``auto`` when its calibration says it is cheapest, and moves the packed format's bytes (the plain-PyTorch reference
does the moving); the built-in paths build through the same factory."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import triton_offload as to
from triton_offload.engine import TransferEngine
from triton_offload.issuers import PATHS, DmaIssuer, IssuerContext, KernelIssuer, build_issuers
from triton_offload.issuers.factory import kernel_launcher
from triton_offload.kernels import reference
from triton_offload.path_choice import Calibration, PathModel
from triton_offload.plan import Direction

from kv_factory import SENTINEL, assert_loaded_exactly, make_caches

PAGE = dict(block_size=2, heads=2, head_dim=4)


class ReferenceIssuer:
    """A third transfer path: each plan moved by kernels/reference.py on the caller's thread."""

    path = "reference"

    def __init__(self, ctx: IssuerContext):
        self.ctx = ctx
        self.issued = 0

    def copies(self, plan) -> int:
        return plan.n_blocks

    def issue(self, plan, stream=None, trace=None):
        spec, f = self.ctx.spec, self.ctx.blocks_per_host_block
        ((g, h, skip),) = plan.groups()
        args = dict(blocks_per_host_block=f, skip=skip)
        if plan.direction is Direction.STORE:
            reference.gather_blocks_ref(spec.kv_caches, spec.layout, g, self.ctx.host_buffer, h, **args)
        else:
            reference.scatter_blocks_ref(self.ctx.host_buffer, h, spec.kv_caches, spec.layout, g, **args)
        self.issued += 1
        return None

    def outcome(self, keep):
        return None

    def release(self, keep, after=None):
        pass


@pytest.fixture
def with_reference_path(monkeypatch):
    """``PATHS`` with the third path registered, as a new path's module would (and only there)."""
    monkeypatch.setitem(PATHS, "reference", ReferenceIssuer)


def _setup(make_host_cache, f=2, blocks=16, host_blocks=10):
    caches = make_caches("kv_first", 3, blocks, PAGE, torch.float16, seed=3)
    spec = to.KVCacheSpec(caches, "kv_first")
    cache = make_host_cache(spec.host_block_bytes(f), num_blocks=host_blocks, pin=False)
    return caches, spec, cache.buffer


def _round_trip(eng: TransferEngine, caches, spec, f, skip=1, n=7, seed=0):
    """A store then a load of the same blocks, checked exactly; returns (the two results, gpu ids, host ids)."""
    rng = np.random.default_rng(seed)
    g = rng.permutation(spec.num_blocks)[:n]
    h = rng.permutation(eng.host_buffer.shape[0])[: math.ceil((skip + n) / f)]
    eng.submit_store(1, g, h, skip=skip)
    originals = [c.clone() for c in caches]
    for c in caches:
        c.untyped_storage().fill_(SENTINEL)
    eng.submit_load(2, g, h, skip=skip)
    results = eng.get_finished()
    assert [(r.job_id, r.ok) for r in results] == [(1, True), (2, True)]
    assert_loaded_exactly(caches, originals, "kv_first", g)
    return results, g, h


def test_a_third_path_registered_in_the_factory_alone_moves_bytes_through_the_engine(
    make_host_cache, with_reference_path
):
    caches, spec, host = _setup(make_host_cache)
    eng = TransferEngine(spec, host, blocks_per_host_block=2, path="reference")
    results, g, h = _round_trip(eng, caches, spec, 2)
    assert {r.path for r in results} == {"reference"}
    issuers = {lane: eng._issuers[lane]["reference"] for lane in eng._issuers}
    assert sum(i.issued for i in issuers.values()) == 2 and len(set(map(id, issuers.values()))) == 3, "one per lane"
    # The rows the third path wrote are the packed format: the kernel writes the same bytes for the same store.
    kernel_host = torch.zeros_like(host)
    kernel = TransferEngine(spec, kernel_host, blocks_per_host_block=2, path="kernel")
    kernel.submit_store(3, g, h, skip=1)
    assert kernel.get_finished()[0].ok
    rows = torch.from_numpy(np.asarray(h))
    assert torch.equal(kernel_host[rows], host[rows])


def test_auto_chooses_a_registered_path_when_its_model_is_cheapest(make_host_cache, with_reference_path):
    caches, spec, host = _setup(make_host_cache)
    cheap, dear = PathModel(1e-6, 0.0, 0.0, 1e-6, 0.0), PathModel(1.0, 0.0, 0.0, 1.0, 0.0)
    models = {
        f"{p}/{d}": (cheap if p == "reference" else dear) for p in ("kernel", "dma", "reference") for d in Direction
    }
    eng = TransferEngine(spec, host, blocks_per_host_block=2, path="auto", calibration=Calibration(models))
    results, _, _ = _round_trip(eng, caches, spec, 2, seed=1)
    assert {r.path for r in results} == {"reference"}
    assert all(set(r.predicted) == {"kernel", "dma", "reference"} for r in results)


def test_a_path_not_in_the_factory_is_refused(make_host_cache):
    _, spec, host = _setup(make_host_cache)
    with pytest.raises(ValueError, match=r"path = 'reference' must be one of 'auto', 'kernel', 'dma'"):
        TransferEngine(spec, host, blocks_per_host_block=2, path="reference")


def test_the_built_in_paths_build_through_the_factory(make_host_cache):
    _, spec, host = _setup(make_host_cache)
    kernel = kernel_launcher(spec, host, 2)
    ctx = IssuerContext(spec, host, 2, kernel.launcher, None, kernel.num_ctas)
    built = build_issuers(ctx, ["dma", "kernel"])
    assert list(built) == ["kernel", "dma"], "the factory's order: the kernel first (auto gives it ties)"
    assert isinstance(built["kernel"], KernelIssuer) and isinstance(built["dma"], DmaIssuer)
    assert built["dma"].checker is None, "no integrity checks: no checksum-only launch after the copies"
