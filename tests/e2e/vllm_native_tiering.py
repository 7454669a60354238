"""Test-only stand-in for vLLM's own tiering worker, which needs CUDA: vLLM's ``TieringOffloadingSpec`` with a worker
that copies through vLLM's own region views (``SharedOffloadRegion.create_next_worker_view``, one per canonical
tensor, in order) with plain tensor indexing, placing bytes as ``CPUOffloadingWorker`` does for the direct layout:
sub-block j of chunk c of tensor t at ``view_t[c, j * page_t :]``, of which each ref's un-padded page is copied.

Used by tests/e2e/vllm_tiering_driver.py (``--spec native``) to write fs-tier files in vLLM's native layout that a
``TritonTieringOffloadingSpec`` instance then reads. Select it with ``spec_name: NativeLayoutTestSpec,
spec_module_path: vllm_native_tiering`` (this directory on PYTHONPATH).
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class NativeLayoutWorker(OffloadingWorker):
    """Synchronous copies between the KV caches and this worker's views of the region, one page at a time."""

    def __init__(self, kv_caches: CanonicalKVCaches, region: SharedOffloadRegion, blocks_per_chunk: int):
        self.region = region
        self.f = blocks_per_chunk
        self.pages = [t.page_size_bytes for t in kv_caches.tensors]
        self.gpu = [t.tensor for t in kv_caches.tensors]
        # The views vLLM's worker takes, in the order it takes them.
        self.cpu = [region.create_next_worker_view(t.page_size_bytes * blocks_per_chunk) for t in kv_caches.tensors]
        self.refs = kv_caches.group_data_refs
        self.done: list[TransferResult] = []

    def _copy(self, job_id: int, gpu: GPULoadStoreSpec, host: LoadStoreSpec, store: bool) -> bool:
        f, chunks = self.f, host.block_ids
        g0 = c0 = nbytes = 0
        for g, (n, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices)):
            n, skip = int(n), int(first) % f
            for ref in self.refs[g]:
                t, page, size = ref.tensor_idx, self.pages[ref.tensor_idx], ref.page_size_bytes
                for i in range(n):
                    p = skip + i
                    host_bytes = self.cpu[t][int(chunks[c0 + p // f]), (p % f) * page : (p % f) * page + size]
                    gpu_bytes = self.gpu[t][int(gpu.block_ids[g0 + i]), :size]
                    (host_bytes if store else gpu_bytes).copy_(gpu_bytes if store else host_bytes)
                    nbytes += size
            g0, c0 = g0 + n, c0 + (-(-(skip + n) // f) if n else 0)
        self.done.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes, transfer_time=0.0))
        return True

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id, src_spec, dst_spec, expedited: bool = False) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        out, self.done = self.done, []
        return out

    def wait(self, job_ids) -> None:
        pass  # every copy is done when submitted

    def shutdown(self) -> None:
        self.cpu = self.gpu = []
        self.region.cleanup()


class NativeLayoutTestSpec(TieringOffloadingSpec):
    """vLLM's tiering spec, unchanged but for the worker (vLLM's own asserts CUDA)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=0 if self.replicated_layout else self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            self._worker = NativeLayoutWorker(kv_caches, region, self.blocks_per_chunk)
        return self._worker
