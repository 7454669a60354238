"""TritonTieringOffloadingSpec on CUDA: the shared region is registered with the driver, and the compiled kernel and
the copy-engine path write vLLM's worker-slot layout. Run with -m gpu (needs vLLM's CUDA build)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="needs vLLM >= 0.32 with its tiering package")

import tiering_factory as tt  # noqa: E402
from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm_configs import finished  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


@pytest.mark.parametrize("path", ["kernel", "dma"])  # each pinned: auto would let a calibration pick
@pytest.mark.parametrize("f", [1, 2], ids=lambda f: f"f{f}")
def test_pinned_region_store_and_load_on_cuda(f, path):
    cpu_kv = tt.kv_caches(seed=f)
    kv = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t.tensor.cuda(), t.page_size_bytes) for t in cpu_kv.tensors], cpu_kv.group_data_refs
    )
    config = tt.make_config(
        {"cpu_bytes_to_use": 16 * 4096 * f, "transfer_path": path}, num_groups=2, worker_bytes=sum(tt.PAGES), f=f
    )
    spec = OffloadingSpecFactory.create_spec(config)
    worker = spec.get_worker(kv)
    region, views = tt.vllm_views(config, spec, 0)
    try:
        assert worker.pinned and worker.host.is_pinned(), "the kernels need the region registered with CUDA"
        whole = region.base_tensor
        whole.view(torch.uint8).fill_(tt.SENTINEL)
        before = whole.clone()
        gpu, sizes, firsts = [3, 7, 1, 9, 4], [3, 2], [1, 0]
        chunks = [5, 2, 6, 0, 7][: sum(-(-(b % f + n) // f) for b, n in zip(firsts, sizes))]
        assert worker.submit_store(0, GPULoadStoreSpec(gpu, sizes, firsts), CPULoadStoreSpec(chunks))
        assert finished(worker)[0].success
        assert torch.equal(whole, tt.expected_store(before, views, cpu_kv, gpu, sizes, firsts, chunks, f))
        dst = [10, 11, 2, 5, 8]
        assert worker.submit_load(1, CPULoadStoreSpec(chunks), GPULoadStoreSpec(dst, sizes, firsts))
        assert finished(worker)[0].success
        g0 = 0
        for g, n in enumerate(sizes):
            for ref in kv.group_data_refs[g]:
                t = kv.tensors[ref.tensor_idx].tensor
                for i in range(n):
                    size = ref.page_size_bytes
                    assert torch.equal(t[dst[g0 + i], :size], t[gpu[g0 + i], :size])
            g0 += n
    finally:
        worker.shutdown()
        del views
        region.cleanup()
    assert not os.path.exists(tt.region_file(config.engine_id))
