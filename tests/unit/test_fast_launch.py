"""The direct launch past Triton's dispatch (triton_offload/fast_launch.py): proven on a canary before use, refused
when it moves other bytes, and the kernel signature that keeps one compiled variant right for every call.

On CPU there is no compiled variant, so the proof is exercised with runners that launch the interpreted kernel
(correctly, or dropping a block); the compiled direct launch itself is tested with -m gpu.
"""

from __future__ import annotations

import inspect
import logging

import numpy as np
import pytest
import torch

import triton_offload as to
from triton_offload import fast_launch
from triton_offload.engine import TransferEngine
from triton_offload.issuers.launcher import CopyLauncher
from triton_offload.kernels import copy_blocks, packing
from triton_offload.kernels.reference import gather_blocks_ref, scatter_blocks_ref
from triton_offload.plan import Direction, TransferPlanner

from kv_factory import SENTINEL, host_buffer, make_caches, random_transfer

PAGE = dict(block_size=2, heads=2, head_dim=4)
STORE, LOAD = Direction.STORE, Direction.LOAD
BOTH_DIRECT = {STORE: "direct", LOAD: "direct"}


def interpreter_runner(corrupt: bool = False):
    """A ``make_runner`` whose runners launch the interpreted kernel with the arguments they are given; with
    ``corrupt``, each program skips its last round of tiles (the kind of silent error a wrong variant would make:
    some blocks never move; the first program's last round always holds live work)."""
    made = []

    def make(launcher, direction):
        num_warps = launcher.config(direction).num_warps

        def run(programs, stream, args):
            run.calls += 1
            if corrupt:  # tiles_per_program, one round short
                args = (*args[:7], args[7] - 1, *args[8:])
            copy_blocks._interpreted_kernel()[(programs,)](
                *args[: -copy_blocks._N_CONST], **copy_blocks._constexprs(args), num_warps=num_warps
            )

        run.calls = 0
        made.append(run)
        return run

    make.made = made
    return make


def setup(layout="block_first", f=2, num_blocks=12, host_blocks=10, groups=None, slots=None):
    caches = make_caches(layout, 3, num_blocks, PAGE, torch.bfloat16, seed=5)
    spec = to.KVCacheSpec(caches, layout, groups=groups, host_slots=slots)
    host = host_buffer(spec, host_blocks, f)
    return caches, spec, host


def test_a_proven_runner_launches_both_directions():
    caches, spec, host = setup()
    launcher = CopyLauncher(spec, host, 2)
    make = interpreter_runner()
    assert fast_launch.enable_fast_launch(launcher, make_runner=make) == BOTH_DIRECT
    store_runner, load_runner = make.made
    proof_calls = store_runner.calls
    g, h = np.array([9, 2, 4]), np.array([7, 3])
    plan = to.plan_transfer(spec, host, g, h, blocks_per_host_block=2, skip=1, direction=STORE)
    launcher.launch(plan, torch.from_numpy(packing.pack_ids(plan)))
    assert store_runner.calls == proof_calls + 1, "the store did not go through the direct runner"
    want = torch.full_like(host, SENTINEL)
    gather_blocks_ref(caches, "block_first", g, want, h, blocks_per_host_block=2, skip=1)
    assert torch.equal(host, want)


@pytest.mark.parametrize(
    "layout,groups,slots",
    [
        pytest.param("kv_first", None, None, id="kv_first"),
        pytest.param("canonical", [[0, 1], [2]], None, id="canonical-groups"),
        pytest.param("canonical", [[0, 1], [2]], to.layouts.HostSlots((48, 40, 40), (0, 1, 2)), id="worker-slots"),
    ],
)
def test_the_canary_proves_every_layout_groups_and_worker_slots(layout, groups, slots):
    if layout == "canonical":
        caches = make_caches("canonical", 3, 12, dict(page_bytes=40, pad=8), torch.int8, seed=2)
        spec = to.KVCacheSpec(caches, "canonical", groups=groups, host_slots=slots)
        host = torch.zeros(10, spec.host_block_bytes(2), dtype=torch.uint8)
    else:
        _, spec, host = setup(layout)
    launcher = CopyLauncher(spec, host, 2)
    verdicts = fast_launch.enable_fast_launch(launcher, make_runner=interpreter_runner())
    assert verdicts == BOTH_DIRECT


def test_a_runner_that_moves_other_bytes_is_refused_and_tritons_launch_kept(caplog):
    caches, spec, host = setup()
    launcher = CopyLauncher(spec, host, 2)
    make = interpreter_runner(corrupt=True)
    with caplog.at_level(logging.WARNING, logger="triton_offload.fast_launch"):
        verdicts = fast_launch.enable_fast_launch(launcher, make_runner=make)
    assert verdicts[STORE] == "the direct launch of the store wrote other bytes than Triton's launch on the canary"
    assert verdicts[LOAD] == "the direct launch of the load wrote other bytes than Triton's launch on the canary"
    assert "direct launch of the store kernel is not used" in caplog.text
    assert launcher.direct(STORE) is None and launcher.direct(LOAD) is None
    calls = [r.calls for r in make.made]
    g, h = np.array([9, 2, 4]), np.array([7, 3])
    plan = to.plan_transfer(spec, host, g, h, blocks_per_host_block=2, skip=1, direction=STORE)
    launcher.launch(plan, torch.from_numpy(packing.pack_ids(plan)))
    assert [r.calls for r in make.made] == calls, "a refused runner was used"
    want = torch.full_like(host, SENTINEL)
    gather_blocks_ref(caches, "block_first", g, want, h, blocks_per_host_block=2, skip=1)
    assert torch.equal(host, want)


def test_a_runner_that_cannot_be_built_is_reported():
    _, spec, host = setup()
    launcher = CopyLauncher(spec, host, 1, STORE)

    def broken(launcher, direction):
        raise RuntimeError("this Triton launches differently")

    verdicts = fast_launch.enable_fast_launch(launcher, make_runner=broken)
    assert verdicts == {STORE: "RuntimeError: this Triton launches differently"}


def test_the_verdict_is_kept_per_compiled_variant():
    """A second launcher of the same spec and variant reuses the proof instead of running a canary again."""
    _, spec, host = setup()
    make = interpreter_runner()
    first = CopyLauncher(spec, host, 2, STORE)
    fast_launch.enable_fast_launch(first, make_runner=make)
    second = CopyLauncher(spec, host, 2, STORE)
    assert fast_launch.enable_fast_launch(second, make_runner=make) == {STORE: "direct"}
    assert len(make.made) == 1 and second.direct(STORE) is make.made[0]


def test_engine_reports_its_launch_paths(make_host_cache, monkeypatch):
    _, spec, _ = setup()
    cache = make_host_cache(spec.host_block_bytes(1), 4 * spec.host_block_bytes(1), pin=False)
    eng = TransferEngine(spec, cache.buffer)
    assert set(eng.launch_paths.values()) == {"not applicable: CPU tensors run through Triton's interpreter"}
    assert TransferEngine(spec, cache.buffer, fast_launch=False).launch_paths == {
        "store": "turned off",
        "load": "turned off",
    }
    monkeypatch.setenv(fast_launch.FAST_LAUNCH_ENV, "0")
    assert set(TransferEngine(spec, cache.buffer).launch_paths.values()) == {"turned off"}


def test_one_compiled_variant_serves_every_call():
    """What the direct launch relies on: the scalars are int64 and never specialised (a value of 1, or one past
    2**31, would otherwise pick another variant), and only the two data pointers are specialised on alignment."""
    from triton.runtime.jit import JITFunction  # triton.jit is the interpreter under TRITON_INTERPRET=1

    kernel = JITFunction(copy_blocks._copy_blocks_kernel, **copy_blocks._JIT_OPTIONS)
    params = {p.name: p for p in kernel.params}
    scalars = copy_blocks._NOT_SPECIALIZED
    checks = ["ck_ptr", "ident_ptr", "sums_ptr", "res_ptr", "tab_ptr"]  # the integrity checks' pointers
    assert [p.name for p in kernel.params if not p.is_constexpr][4:] == scalars[:-2] + checks + scalars[-2:]
    for name in scalars:
        assert params[name].annotation_type == "i64" and params[name].do_not_specialize, name
    assert {n for n, p in params.items() if p.do_not_specialize_on_alignment} == {"table_ptr", "ids_ptr", *checks}
    assert [n for n, p in params.items() if p.is_constexpr] == list(copy_blocks._CONSTEXPRS)


# ---------------------------------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------------------------------

GPU_PAGE = dict(block_size=16, heads=1, head_dim=128)  # 8 KiB pages, as Llama-3-70B at TP 8


def gpu_engine(make_host_cache, f=2, fast=True, num_blocks=700, host_blocks=400, layers=6):
    """An engine on the kernel path (the one these tests launch; auto, the CUDA default, may take the copy engines)."""
    caches = make_caches("kv_first", layers, num_blocks, GPU_PAGE, torch.bfloat16, device="cuda", seed=7)
    spec = to.KVCacheSpec(caches, "kv_first")
    cache = make_host_cache(spec.host_block_bytes(f), host_blocks * spec.host_block_bytes(f))
    cache.buffer.fill_(SENTINEL)
    eng = TransferEngine(spec, cache.buffer, blocks_per_host_block=f, fast_launch=fast, path="kernel")
    return caches, spec, cache, eng


@pytest.mark.gpu
def test_gpu_engine_launches_direct_and_moves_the_same_bytes(make_host_cache):
    """Transfers whose scalars span 1 to hundreds (which Triton's dispatch would once have specialised apart) move
    the same bytes through the direct launch as through Triton's, both ways, and as the reference."""
    caches, spec, fast_cache, fast = gpu_engine(make_host_cache)
    assert fast.launch_paths == {"store": "direct", "load": "direct"}
    slow_caches, _, slow_cache, slow = gpu_engine(make_host_cache, fast=False)  # caches of its own, the same bytes
    rng = np.random.default_rng(0)
    job = 0
    for n, skip in [(1, 0), (1, 1), (2, 1), (333, 1), (600, 0)]:
        g, h = random_transfer(rng, spec.num_blocks, 400, n, 2, skip)
        for eng in (fast, slow):
            job += 1
            eng.submit_store(job, g, h, skip=skip)
            eng.wait([job])
            assert all(r.ok for r in eng.get_finished())
        assert torch.equal(fast_cache.buffer, slow_cache.buffer), f"n={n} skip={skip}"
        want = slow_cache.buffer.clone()
        gather_blocks_ref(caches, "kv_first", g, want, h, blocks_per_host_block=2, skip=skip)
        assert torch.equal(fast_cache.buffer, want)
        dst = rng.permutation(spec.num_blocks)[:n]
        want_caches = [c.clone() for c in caches]
        scatter_blocks_ref(want, h, want_caches, "kv_first", dst, blocks_per_host_block=2, skip=skip)
        for eng, offset in ((fast, 1000), (slow, 2000)):  # each into its own caches (the same bytes so far)
            eng.submit_load(job + offset, dst, h, skip=skip)
            eng.wait([job + offset])
            assert all(r.ok for r in eng.get_finished())
        for a, b, w in zip(caches, slow_caches, want_caches):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"load n={n} skip={skip}"
            assert torch.equal(a.view(torch.uint8), w.view(torch.uint8)), f"load n={n} skip={skip} vs the reference"
    fast.shutdown()
    slow.shutdown()


@pytest.mark.gpu
def test_gpu_a_wrong_variant_is_refused(make_host_cache):
    """The canary catches a runner of the wrong compiled variant (the load kernel offered for stores)."""
    caches, _, cache, eng = gpu_engine(make_host_cache, fast=False)
    # A spec of its own over the same caches: no verdict of the engine's spec applies, so this launcher proves its own.
    spec = to.KVCacheSpec(caches, "kv_first")
    launcher = CopyLauncher(spec, cache.buffer, 2, STORE)

    def wrong(launcher, direction):
        other = CopyLauncher(launcher.spec, launcher.host_buffer, 2)
        return fast_launch.compiled_runner(other, LOAD if direction is STORE else STORE)

    verdict = fast_launch.enable_fast_launch(launcher, make_runner=wrong)[STORE]
    assert verdict != fast_launch.DIRECT and "other bytes" in verdict
    eng.shutdown()


@pytest.mark.gpu
def test_gpu_launch_hooks_take_tritons_path(make_host_cache):
    """A profiler's launch hook sees every launch: while one is installed, launches go through Triton's dispatch."""
    from triton import knobs

    caches, spec, cache, eng = gpu_engine(make_host_cache)
    assert eng.launch_paths["store"] == "direct"
    seen = []
    hook = knobs.runtime.launch_enter_hook
    hook.add(seen.append)
    try:
        eng.submit_store(1, [3, 4], [5])
        eng.wait([1])
    finally:
        hook.remove(seen.append)
    assert len(seen) == 1 and all(r.ok for r in eng.get_finished())
    eng.shutdown()


@pytest.mark.gpu
def test_gpu_public_calls_reuse_staging_only_after_their_launch(make_host_cache):
    """64 public gathers queued back to back, each with other ids, behind a long GPU sleep: every id slot is
    reused only once the launch that read it has run, so every host block holds what its own call asked for."""
    caches, spec, cache, _ = gpu_engine(make_host_cache, f=1, host_blocks=200)
    host = cache.buffer
    rng = np.random.default_rng(1)
    calls = [(rng.permutation(spec.num_blocks)[:3], np.arange(3 * i, 3 * i + 3)) for i in range(64)]
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    for g, h in calls:
        to.gather_blocks(spec, g, host, h)
    torch.cuda.synchronize()
    want = torch.full_like(host, SENTINEL)
    for g, h in calls:
        gather_blocks_ref(caches, "kv_first", g, want, h)
    assert torch.equal(host, want)
    verdict = CopyLauncher(spec, host, 1, STORE).direct_verdict(STORE)
    assert verdict is not None and not isinstance(verdict, str), "the public call did not launch directly"


def _typed_but_none(fn, args: tuple) -> list[str]:
    """The parameters of kernel function ``fn`` that carry a (non-constexpr) type annotation but get None in ``args``.
    Triton types such a parameter by its annotation whatever the value, and its compiled launcher cannot convert None
    to an integer: every launch raised TypeError on the 11-28 H200 run (the interpreter accepts it)."""
    params = list(inspect.signature(fn).parameters.values())
    assert len(params) == len(args)
    return [
        p.name
        for p, a in zip(params, args)
        if a is None and p.annotation is not inspect.Parameter.empty and "constexpr" not in str(p.annotation)
    ]


@pytest.mark.parametrize("fp8", [False, True], ids=["copy", "fp8"])
def test_a_launch_without_the_checks_gives_every_typed_parameter_a_value(fp8):
    from triton_offload.issuers.fp8_launcher import Fp8Launcher
    from triton_offload.kernels import fp8_blocks

    caches = make_caches("kv_first", 2, 12, dict(block_size=2, heads=2, head_dim=8), torch.bfloat16, seed=5)
    spec = to.KVCacheSpec(caches, "kv_first", host_format="fp8_e4m3" if fp8 else "native")
    host = host_buffer(spec, 10, 2)
    launcher = (Fp8Launcher if fp8 else CopyLauncher)(spec, host, 2)
    for d in Direction:
        plan = TransferPlanner(spec, 10, 2).plan(np.array([3, 1, 4]), np.array([5, 2]), direction=d, skip=1)
        ids = torch.from_numpy(packing.pack_ids(plan))
        _, args = launcher.arguments(plan, ids)
        kernel = fp8_blocks._fp8_blocks_kernel if fp8 else copy_blocks._copy_blocks_kernel
        assert _typed_but_none(kernel, args) == []


@pytest.mark.parametrize("integrity", [False, True], ids=["plain", "checks"])
@pytest.mark.parametrize("groups", [None, [[0, 2], [1]]], ids=["1group", "groups"])
def test_the_direct_launchs_variant_is_the_one_live_launches_dispatch_to(monkeypatch, groups, integrity):
    """The compiled variant a direct runner launches bakes in the constexprs of the launch it was compiled from: they
    must be the live launches' (a several-group spec always launches MULTI_GROUP; the 11-28 H200 run's canary refused
    a one-group variant offered for a grouped spec), and so must the arguments Triton compiles out (None)."""
    from triton_offload.checksums import Checksums

    _, spec, host = setup(groups=groups)
    checks = Checksums.allocate("verify", 10, 2, pin=False, regions=spec.num_regions) if integrity else None
    launcher = CopyLauncher(spec, host, 2, checksums=checks)
    compiled_from = []
    monkeypatch.setattr(copy_blocks, "compile_variant", lambda args, num_warps: compiled_from.append(args))
    sizes = None if groups is None else [2, 1]
    for d in Direction:
        for copy in (True, False) if integrity else (True,):
            launcher.compile_variant(d, copy)
            variant = compiled_from.pop()
            plan = TransferPlanner(spec, 10, 2).plan(
                np.array([3, 1, 4]), np.array([5, 2, 7, 6][: 2 if groups is None else 3]), direction=d, skip=1,
                group_sizes=sizes,
            )  # fmt: skip
            size = packing.packed_size(plan, integrity)
            ids = torch.zeros(size, dtype=torch.int64)
            res = torch.zeros(packing.result_size(plan), dtype=torch.int64) if integrity else None
            _, live = launcher.arguments(plan, ids, res=res, copy=copy)
            assert copy_blocks._constexprs(variant) == copy_blocks._constexprs(live)
            assert [a is None for a in variant] == [a is None for a in live]
