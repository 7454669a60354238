"""The ``vllm_native`` method (bench/vllm_native.py): vLLM 0.33's own CPUOffloadingWorker over the benchmark's KV
tensors, its compiled ``swap_blocks_batch`` replaced by a ctypes ``cuMemcpyBatchAsync`` with the same attributes.

Without CUDA, vLLM's worker builds its descriptors as on a GPU and the op hands them to a memmove stand-in of the
driver (host replay); the byte checks below are the benchmark's own. The op's marshalling is tested on its own, without
vLLM. Tests that run vLLM's worker need vLLM 0.33.0's Python code (``.venv-vllm33``, or the bundle on the path).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm_harness import VLLM_033

from bench import baselines
from bench.baselines import vllm_native
from bench.common import case, workloads
from bench.common.env import Env
from bench.transfer import session

needs_vllm033 = pytest.mark.skipif(not VLLM_033, reason="needs vLLM 0.33.0's Python code (.venv-vllm33)")
STREAM, ANY = 0x1, 0x3  # CUmemcpySrcAccessOrder
NO_HINT = (0, 0)  # CUmemLocation {CU_MEM_LOCATION_TYPE_INVALID, 0}: vLLM's op zero-initialises its attributes


@pytest.fixture(scope="module")
def mods():
    loaded = [vllm_native, session, baselines, workloads, case]
    yield dict(zip(("vllm_native", "session", "baselines", "workloads", "case"), loaded))


def _descriptors(sizes: list[int]):
    """Pinned-like CPU int64 descriptor tensors over two byte buffers, sources and destinations scattered."""
    src = torch.randint(0, 256, (sum(sizes) + 64,), dtype=torch.uint8)
    dst = torch.full((sum(sizes) + 256,), 0xA5, dtype=torch.uint8)
    src_off = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) + 8
    dst_off = (np.concatenate([[0], np.cumsum(sizes[::-1])[:-1]])[::-1] + 128).astype(np.int64)
    srcs = torch.from_numpy(src.data_ptr() + src_off)
    dsts = torch.from_numpy(dst.data_ptr() + dst_off)
    want = torch.full_like(dst, 0xA5)
    for s, d, n in zip(src_off, dst_off, sizes):
        want[d : d + n] = src[s : s + n]
    return src, dst, want, (srcs, dsts, torch.tensor(sizes, dtype=torch.int64))


def test_the_op_issues_one_batch_with_vllms_attributes(mods):
    """Loads pass is_src_access_order_any (ANY), stores do not (STREAM); no flags, no location hints, one attribute
    entry, the 12.8 ABI (failIdx), and every descriptor's bytes where it says."""
    op = mods["vllm_native"].SwapBlocksBatch.for_host()
    for flag, order in ((True, ANY), (False, STREAM)):
        _, dst, want, args = _descriptors([8, 24, 4096, 16, 8200])
        op(*args, is_src_access_order_any=flag)
        call = op.stand_in.calls[-1]
        assert call["count"] == 5 and call["attrs"] == (order, NO_HINT, NO_HINT, 0)
        assert call["attr_idxs"] == [0] and call["fail_idx"]
        assert torch.equal(dst, want)
    assert len(op.stand_in.calls) == 2


def test_the_op_special_cases_as_vllms_does(mods, monkeypatch):
    """One copy is a single memcpy (no batch call), none is nothing, and VLLM_KV_OFFLOAD_MAX_BATCH_DESCRIPTORS splits
    a batch; descriptors that are not contiguous 1-D int64 CPU tensors of one length are refused."""
    native = mods["vllm_native"]
    op = native.SwapBlocksBatch.for_host()
    _, dst, want, args = _descriptors([40])
    op(*args, True)
    assert op.stand_in.calls == [] and torch.equal(dst, want)
    op(*(a[:0] for a in args))
    assert op.stand_in.calls == []
    monkeypatch.setenv(native.MAX_DESCRIPTORS_ENV, "3")
    split = native.SwapBlocksBatch.for_host()
    _, dst, want, args = _descriptors([8, 16, 24, 32, 40, 48, 56])
    split(*args)
    assert [c["count"] for c in split.stand_in.calls] == [3, 3, 1] and torch.equal(dst, want)
    srcs, dsts, sizes = args
    with pytest.raises(RuntimeError, match="sizes must be a contiguous 1-D int64 CPU tensor"):
        split(srcs, dsts, sizes.to(torch.int32))
    with pytest.raises(RuntimeError, match="7 src_ptrs, 6 dst_ptrs"):
        split(srcs, dsts[:6], sizes)


def _pages(num_blocks: int, widths: list[int], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (num_blocks, w), dtype=torch.uint8, generator=gen) for w in widths]


def test_the_packed_view_copies_out_the_bytes_it_shows(mods):
    """copy_to writes the table ``to`` builds, part by part, into every column of a sentinel-filled destination, and
    leaves vLLM's region alone; copy_ then copy_to round-trips a table of distinct bytes per column."""
    gen = torch.Generator().manual_seed(1)
    views = [torch.randint(-128, 128, (3, 2 * w), dtype=torch.int8, generator=gen) for w in (16, 40, 8)]
    before = [v.clone() for v in views]
    view = mods["vllm_native"].PackedHostView(views, 2)
    assert view.shape == (6, 64)
    dst = torch.full(view.shape, 0xA5, dtype=torch.uint8)
    view.copy_to(dst)
    assert torch.equal(dst, view.to("cpu"))
    assert all(torch.equal(v, b) for v, b in zip(views, before))
    table = torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=gen)
    view.copy_(table)
    out = torch.full(view.shape, 0xA5, dtype=torch.uint8)
    view.copy_to(out)
    assert torch.equal(out, table)


@needs_vllm033
def test_vllms_worker_builds_the_descriptors_the_op_replays(mods):
    """vLLM's CPUOffloadingWorker, unchanged, over three canonical tensors: a store with f=2 and a skip lands each
    page at vLLM's sub-block, one descriptor per (block, tensor) in one STREAM batch; a load back into other blocks
    is one ANY batch; vLLM reports each job once with its bytes; nothing else changes."""
    native = mods["vllm_native"]
    widths = [64, 128, 64]
    pages = _pages(12, widths)
    before = [p.clone() for p in pages]
    worker = native.NativeWorker(pages, 2, 4)
    assert [tuple(v.shape) for v in worker.host_views] == [(4, 2 * w) for w in widths]
    gpu, host = [5, 1, 9], [2, 0]
    job = worker.submit_store(gpu, host, skip=1)
    call = worker._swap.stand_in.calls[-1]
    assert call["count"] == 3 * len(widths) and call["attrs"][0] == STREAM
    (result,) = worker.poll()
    assert (result.job_id, result.success, result.transfer_size) == (job, True, 3 * sum(widths))
    for t, w in enumerate(widths):
        want = torch.zeros(4, 2 * w, dtype=torch.int8)  # vLLM's region starts zeroed
        for i, g in enumerate(gpu):
            row, sub = host[(1 + i) // 2], (1 + i) % 2
            want[row, sub * w : (sub + 1) * w] = pages[t][g].view(torch.int8)
        assert torch.equal(worker.host_views[t], want), f"tensor {t}"
    job = worker.submit_load(host, [0, 2, 3], skip=1)
    assert worker._swap.stand_in.calls[-1]["attrs"][0] == ANY
    assert [r.job_id for r in worker.wait([job])] == [job] and worker.poll() == []
    worker.warm(False, worker.transfer_specs([0, 2, 3], host, skip=1), 3)  # three more of the same load, waited for
    assert len(worker._swap.stand_in.calls) == 5 and worker.poll() == []
    for t in range(len(widths)):
        expect = before[t].clone()
        expect[[0, 2, 3]] = before[t][gpu]
        assert torch.equal(pages[t], expect)
    worker.shutdown()


@needs_vllm033
def test_ids_that_do_not_fit_are_refused_before_vllm_sees_them(mods):
    native = mods["vllm_native"]
    worker = native.NativeWorker(_pages(8, [32]), 2, 3)
    for gpu, host, skip, match in [
        ([1, 2], [0], 2, "skip=2"),
        ([1, 2, 3], [0], 0, "need ceil"),
        ([1, 8], [0], 0, "gpu_ids must be distinct and in"),
        ([1, 1], [0], 0, "gpu_ids must be distinct"),
        ([1, 2], [3], 0, "host_ids must be distinct and in"),
    ]:
        with pytest.raises(ValueError, match=match):
            worker.submit_store(gpu, host, skip)
    assert worker._swap.stand_in.calls == [] and worker.poll() == []
    with pytest.raises(ValueError, match="dense"):
        native.NativeWorker([torch.zeros(8, 64, dtype=torch.uint8)[:, :32]], 1, 1)
    worker.shutdown()


def _check_all_cases(mods, w, layout):
    """(status, note, impl) of ``vllm_native`` on every host format and direction of a tiny workload (the CPU check)."""
    session = mods["session"]
    env = Env(torch.device("cpu"), None, "no CUDA")
    run = session.Session({}, env, [session.MethodSpec("vllm_native")])
    group = session.allocate(w.tiny(), layout, 8, ((1, 0), (4, 1)), env.device, 0)
    out = []
    for f, skip in ((1, 0), (4, 1)):
        for store in (True, False):
            status, note, prepared = run.check(group, session.make_case(group, 8, f, skip, store), run.specs[0])
            out.append((status, note, prepared and prepared.impl))
    return out


@needs_vllm033
@pytest.mark.parametrize("name", ["llama3-70b-tp8", "deepseek-v3-mla"])
def test_the_benchmarks_byte_check_passes_in_host_replay(mods, name):
    """Every layout (kv_first gives vLLM two canonical tensors per layer), f=1 and f=4 with a skip, both directions:
    the bytes are right (n/a: the copies ran on host memory, nothing can be timed)."""
    w = mods["workloads"].WORKLOADS[name]
    for layout in w.layouts:
        for status, note, impl in _check_all_cases(mods, w, layout):
            assert (
                status == "n/a" and note == "needs CUDA; its copy plan was replayed with memmove on CPU: bytes correct"
            )
            assert "vLLM 0.33.0's own worker" in impl and "memmove stand-in" in impl


@needs_vllm033
def test_the_byte_check_catches_a_wrong_position(mods, monkeypatch):
    """A worker that addresses the host chunks in the wrong order moves every page, to the wrong place: FAIL."""
    original = mods["vllm_native"].NativeWorker.transfer_specs

    def rotated(self, gpu_ids, host_ids, skip=0):
        return original(self, gpu_ids, np.roll(np.asarray(host_ids), 1), skip)

    monkeypatch.setattr(mods["vllm_native"].NativeWorker, "transfer_specs", rotated)
    w = mods["workloads"].WORKLOADS["small-page"]
    results = _check_all_cases(mods, w, "kv_first")
    assert [s for s, _, _ in results] == ["FAIL"] * 4, results
    assert all("blocks differ" in note for _, note, _ in results)


def test_without_vllm_033_the_method_says_why(mods, monkeypatch):
    native = mods["vllm_native"]
    monkeypatch.setattr(native, "_load", lambda: "no vLLM is on the path; build its bundle")
    with pytest.raises(native.VllmUnavailable, match="build its bundle"):
        native.NativeWorker(_pages(4, [16]), 1, 1)
    # The benchmarks' opening of a worker (both vllm_native methods): the reason, as the method's n/a.
    Unavailable = mods["case"].Unavailable
    with pytest.raises(Unavailable, match="^no vLLM is on the path; build its bundle$"):
        native.open_native_worker(_pages(4, [16]), 1, 1, Env(torch.device("cpu"), None, "no CUDA"))
    no_driver = Env(torch.device("cuda"), None, "cannot load libcuda.so.1")
    with pytest.raises(Unavailable, match="^needs the CUDA driver for vLLM's swap_blocks_batch: cannot load libcuda"):
        native.open_native_worker(_pages(4, [16]), 1, 1, no_driver)


@pytest.mark.gpu
@needs_vllm033
def test_on_cuda_vllms_paths_and_the_callers_stream_waits_for_vllms(mods):
    """On the GPU: stores are one STREAM batch, loads of 2 KiB pages vLLM's Triton kernel, of 64 KiB pages one ANY
    batch, each byte-checked; and a timed call ends only when vLLM's own stream has finished the copy."""
    from bench.common.env import open_gpu, release

    session, baselines = mods["session"], mods["baselines"]
    device, stream, env, meta = open_gpu()
    run = session.Session(meta, env, [session.MethodSpec("vllm_native")], stream)
    impls = {}
    for name, layout in (("small-page", "kv_first"), ("llama3-8b", "block_first")):
        group = session.allocate(mods["workloads"].WORKLOADS[name], layout, 256, ((4, 1),), device, 0)
        for store in (True, False):
            case = session.make_case(group, 256, 4, 1, store)
            status, note, prepared = run.check(group, case, run.specs[0])
            assert status == "pass", note
            impls[name, store] = prepared.impl
        case = session.make_case(group, 256, 4, 1, True)
        prepared = baselines.METHODS["vllm_native"].prepare(case, env)
        worker = env.held[case.spec]["native"]
        torch.cuda.synchronize()
        worker.poll()  # the check's jobs
        with torch.cuda.stream(stream):
            torch.cuda._sleep(50_000_000)  # ~25 ms: the copy (512 MiB) cannot start before this ends
            prepared.run()
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        assert len(worker.poll()) == 1, "the caller's stream finished before vLLM's transfer"
        del group, case, prepared, worker
        release(device)
    assert "STREAM" in impls["small-page", True] and "STREAM" in impls["llama3-8b", True]
    assert "Triton" in impls["small-page", False] and "ANY" in impls["llama3-8b", False], impls
