"""The ``auto`` path's decision (triton_offload/path_choice.py): models fitted from calibration points, the choice
per call, and on a GPU (-m gpu) the calibration itself and the three paths moving identical bytes."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

import triton_offload as to
from triton_offload._checks import transfer_path
from triton_offload.calibrate import calibration_transfers
from triton_offload.engine import TransferEngine
from triton_offload.fast_launch import canary_spec
from triton_offload.issuers.dma import DmaIssuer
from triton_offload.kernels.reference import gather_blocks_ref
from triton_offload.path_choice import Calibration, PathModel, fit
from triton_offload.plan import Direction, TransferPlanner

from kv_factory import SENTINEL, make_caches, random_transfer

STORE, LOAD = Direction.STORE, Direction.LOAD


def _points(model: PathModel, path: str, direction: Direction, shapes) -> list[dict]:
    return [
        dict(path=path, direction=direction, bytes=b, descriptors=d, gpu_s=model.gpu_s(b, d), host_s=model.host_s(d))
        for b, d in shapes
    ]


def test_fit_recovers_linear_costs():
    kernel = PathModel(12e-6, 0.02e-9, 0.0, 40e-6, 0.0)
    dma = PathModel(8e-6, 0.018e-9, 3e-9, 6e-6, 0.6e-6)
    points = _points(kernel, "kernel", STORE, [(1 << 20, 0), (8 << 20, 0)])
    # Random ids (a descriptor per block and run) and contiguous ones (fewer, larger), at two sizes.
    points += _points(dma, "dma", STORE, [(1 << 20, 640), (8 << 20, 5120), (1 << 20, 40), (8 << 20, 320)])
    models = fit(points)
    for got, want in ((models["kernel/store"], kernel), (models["dma/store"], dma)):
        for name in PathModel.__dataclass_fields__:
            assert getattr(got, name) == pytest.approx(getattr(want, name), rel=1e-6, abs=1e-15), name
    assert set(models) == {"kernel/store", "dma/store"}


def test_fit_of_proportional_bytes_and_descriptors_predicts_calls_of_that_proportion():
    """Without coalescing, bytes and descriptors grow together: the split between them is not identifiable, but every
    call of the same proportion is predicted right."""
    dma = PathModel(8e-6, 0.018e-9, 3e-9, 6e-6, 0.6e-6)
    per_block = (80 * 8192, 160)  # bytes and descriptors of one block
    shapes = [(n * per_block[0], n * per_block[1]) for n in (16, 128, 16, 128)]
    model = fit(_points(dma, "dma", LOAD, shapes))["dma/load"]
    for n in (1, 1024, 5000):
        b, d = n * per_block[0], n * per_block[1]
        assert model.predict(b, d) == pytest.approx(dma.predict(b, d), rel=1e-6)


def test_negative_slopes_are_clamped():
    points = [
        dict(path="kernel", direction="store", bytes=1 << 20, descriptors=0, gpu_s=30e-6, host_s=5e-6),
        dict(path="kernel", direction="store", bytes=8 << 20, descriptors=0, gpu_s=20e-6, host_s=5e-6),
    ]
    assert fit(points)["kernel/store"].gpu_per_byte == 0.0


def test_choose_takes_the_lower_prediction_ties_to_the_kernel():
    kernel = PathModel(10e-6, 1e-9, 0.0, 5e-6, 0.0)
    dma = PathModel(10e-6, 0.9e-9, 0.0, 0.0, 1e-6)
    cal = Calibration({"kernel/store": kernel, "kernel/load": kernel, "dma/store": dma, "dma/load": dma})
    # 1 MB: kernel 1010 us; copy engines 910 us on the GPU, but 100 descriptors are 100 us of host time: dma.
    assert cal.choose(STORE, 10**6, {"kernel": 0, "dma": 100}) == "dma"
    # 2000 descriptors: 2000 us of host time, more than the kernel's 1010 us: kernel.
    assert cal.choose(LOAD, 10**6, {"kernel": 0, "dma": 2000}) == "kernel"
    same = Calibration({"kernel/store": kernel, "dma/store": kernel})
    assert same.choose(STORE, 10**6, {"kernel": 0, "dma": 0}) == "kernel"
    alone = Calibration({"kernel/store": kernel}, note="no copy-engine path")
    assert alone.choose(STORE, 10**9, {"kernel": 0, "dma": 1}) == "kernel"
    assert "dma/store" in cal.to_dict()["models"] and "ns/descriptor" in cal.describe()


def test_a_call_is_priced_as_its_submission_plus_its_copies():
    """A transfer's copies cannot start before they are submitted: the copy engines' 28 us of host time add to their
    10 us on the GPU (38 us), which the kernel's 5 + 30 us beats. Priced as the larger of the two (28 us against
    30 us), the copy engines looked faster."""
    kernel = PathModel(30e-6, 0.0, 0.0, 5e-6, 0.0)
    dma = PathModel(10e-6, 0.0, 0.0, 4e-6, 1e-6)
    assert dma.predict(1 << 20, 24) == pytest.approx(38e-6) and kernel.predict(1 << 20, 0) == pytest.approx(35e-6)
    cal = Calibration({"kernel/store": kernel, "dma/store": dma})
    assert cal.choose(STORE, 1 << 20, {"kernel": 0, "dma": 24}) == "kernel"


def test_transfer_path_names_the_accepted_paths():
    assert [transfer_path(p) for p in ("auto", "kernel", "dma")] == ["auto", "kernel", "dma"]
    with pytest.raises(ValueError, match="path = 'DMA' must be one of 'auto', 'kernel', 'dma'"):
        transfer_path("DMA")


# ---------------------------------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------------------------------


# Calibration's wall-time bound, with room over the < 1 s it aims at (a cold Triton compile is excluded: the engine
# compiles its launches before it calibrates).
@pytest.mark.parametrize("groups, f", [(None, 1), (None, 2), ([[0, 1], [2]], 1), ([[0], [1], [2]], 2)])
def test_calibration_transfers_are_valid_and_move_every_group(groups, f):
    """What calibrate() plans is valid for the spec, hybrid (several groups) included: at CUDA engine creation a
    transfer the planner refuses would fail the worker."""
    caches = make_caches("block_first", 3, 8, dict(block_size=2, heads=2, head_dim=4), torch.bfloat16)
    spec = to.KVCacheSpec(caches, "block_first", groups=groups)
    n_max = 20
    canary = canary_spec(spec, 2 * n_max)
    rows = math.ceil(n_max / f) + spec.num_groups
    host = torch.zeros(rows, canary.host_block_bytes(f), dtype=torch.uint8)
    planner, dma = TransferPlanner(canary, rows, f), DmaIssuer(canary, host, f)
    seen = []
    for n, contiguous, g, h, sizes in calibration_transfers(spec.num_groups, f, n_max, rows, np.random.default_rng(0)):
        seen.append((n, contiguous))
        if spec.num_groups == 1:
            assert sizes is None
        else:
            assert len(sizes) == spec.num_groups and sum(sizes) == n
            if n == n_max:  # every group moves, as a hybrid model's transfers do
                assert min(sizes) > 0, sizes
        per_group = [n] if sizes is None else sizes
        for direction in Direction:
            plan = planner.plan(g, h, direction=direction, group_sizes=sizes)
            assert plan.n_blocks == n and plan.n_host == h.size and dma.copies(plan) > 0
            assert plan.num_bytes == sum(k * b for k, b in zip(per_group, canary.group_bytes))
    assert seen == [(2, False), (2, True), (n_max, False), (n_max, True)]


CALIBRATION_BOUND_S = 3.0


@pytest.mark.gpu
@pytest.mark.parametrize(
    "layout,page",
    [
        pytest.param("kv_first", dict(block_size=8, heads=1, head_dim=64), id="2KiB"),
        pytest.param("block_first", dict(block_size=16, heads=8, head_dim=128), id="64KiB"),
    ],
)
def test_gpu_paths_move_identical_bytes_and_auto_calibrates_in_bound(layout, page, make_host_cache):
    caches = make_caches(layout, 8, 300, page, torch.bfloat16, device="cuda", seed=2)
    spec = to.KVCacheSpec(caches, layout)
    f, rng = 2, np.random.default_rng(3)
    hosts = {}
    for path in ("kernel", "dma", "auto"):
        cache = make_host_cache(spec.host_block_bytes(f), 160 * spec.host_block_bytes(f))
        cache.buffer.fill_(SENTINEL)
        t0 = time.perf_counter()
        eng = TransferEngine(spec, cache.buffer, blocks_per_host_block=f, path=path)
        if path == "auto":
            assert eng.calibration.seconds < CALIBRATION_BOUND_S, eng.calibration.to_dict()
            assert set(eng.calibration.models) == {"kernel/store", "kernel/load", "dma/store", "dma/load"}
            print(f"auto ({layout}): engine built in {time.perf_counter() - t0:.3f} s; {eng.calibration.describe()}")
        hosts[path] = (cache, eng)
    # The host buffers keep every earlier job's rows: the expectation accumulates the same stores.
    want = torch.full_like(hosts["kernel"][0].buffer, SENTINEL)
    for job, n in enumerate((1, 17, 250)):
        g, h = random_transfer(rng, 300, 160, n, f, 1)
        for path, (_, eng) in hosts.items():
            eng.submit_store(job, g, h, skip=1)
            eng.wait([job])
            (res,) = eng.get_finished()
            assert res.ok and (res.path == path or path == "auto"), res
        gather_blocks_ref(caches, layout, g, want, h, blocks_per_host_block=f, skip=1)
        for path, (cache, _) in hosts.items():
            assert torch.equal(cache.buffer, want), f"{path}, {n} blocks"
    loaded = {}
    for path, (_, eng) in hosts.items():
        before = [c.clone() for c in caches]
        eng.submit_load(99, np.arange(250), h, skip=1)
        eng.wait([99])
        assert eng.get_finished()[0].ok
        loaded[path] = [c.clone() for c in caches]
        for c, b in zip(caches, before):
            c.copy_(b)
    for path in ("dma", "auto"):
        for a, b in zip(loaded[path], loaded["kernel"]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), path
