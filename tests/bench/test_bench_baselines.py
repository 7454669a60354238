"""The one registry of methods (bench/baselines/) on CPU, where its forms differ from the serving loop's: the transfer
benchmark's ``vllm033`` is vLLM 0.33's policy as the serving loop's is (a batch load reads its source in any order),
and its ``auto`` is TransferEngine's own jobs, whose failure is an error, not a number."""

from __future__ import annotations

import pytest
import torch

from bench.baselines import METHODS, vllm033
from bench.common.env import Env
from bench.common.verify import check_method
from bench.common.workloads import WORKLOADS
from bench.transfer import session

STREAM, ANY = 0x1, 0x3  # CUmemcpySrcAccessOrder


@pytest.fixture(scope="module")
def group():
    """A tiny two-layer cache: 2 blocks of block_first pages are 4 descriptors, below the SM copy's 16."""
    return session.allocate(WORKLOADS["llama3-8b"].tiny(), "block_first", 4, ((1, 0),), torch.device("cpu"), 0)


def test_the_transfer_benchmarks_vllm033_reads_a_batch_load_in_any_order(group, monkeypatch):
    """vLLM 0.33's swap_blocks_batch (transfer_async: is_src_access_order_any = not gpu_to_cpu): a load's host source
    in any order, a store's GPU source in stream order, in the transfer benchmark as in the serving loop
    (tests/bench/test_bench_serving_plan.py); the memmove stand-in records the attributes each batch was handed."""
    made = []
    real = vllm033.batch_issuer
    monkeypatch.setattr(vllm033, "batch_issuer", lambda *args: made.append(real(*args)) or made[-1])
    env = Env(torch.device("cpu"), None, "cpu")
    orders = {}
    for store in (True, False):
        case = session.make_case(group, 2, 1, 0, store)
        prepared = METHODS["vllm033"].prepare(case, env)
        assert prepared.impl.startswith("batch: ") and prepared.emulated
        assert check_method(case, prepared, group.expected[:2]) is None  # the bytes, either way
        orders[case.direction] = made[-1].stand_in.calls[-1]["attrs"][0]
    assert orders == {"store": STREAM, "load": ANY}


def test_auto_is_the_engines_jobs_and_a_failed_job_raises(group, monkeypatch):
    """``auto`` runs TransferEngine's jobs (without CUDA its copy-engine path, replayed by memmove): the right bytes,
    the engine's own time per call; a job that fails raises at the call instead of being timed."""
    env = Env(torch.device("cpu"), None, "cpu")
    case = session.make_case(group, 3, 1, 0, True)
    prepared = METHODS["auto"].prepare(case, env)
    assert prepared.emulated and "replayed with memmove" in prepared.impl
    assert check_method(case, prepared, group.expected[:3]) is None
    prepared.run()
    times = prepared.device_ms(2)  # the check's call and this one
    assert len(times) == 2 and all(t > 0 for t in times)
    from triton_offload.issuers.dma import DmaIssuer

    def broken(self, plan, stream=None, trace=None):
        raise RuntimeError("the copy engines refused")

    monkeypatch.setattr(DmaIssuer, "issue", broken)
    with pytest.raises(RuntimeError, match=r"store job \d+ failed: RuntimeError\('the copy engines refused'\)"):
        prepared.run()
