"""The tiering spec's test model and vLLM's own view of its shared region, for the tests that check our worker's bytes
against vLLM's (unit/test_tiering.py on CPU, gpu/test_gpu_tiering.py on CUDA).

Importing it registers our specs with vLLM's ``OffloadingSpecFactory`` (what vLLM's plugin loader does in each of its
processes), so that a config from :func:`make_config` builds our spec. Needs vLLM >= 0.32 with its tiering package:
the test modules skip before they import it.
"""

from __future__ import annotations

import uuid

import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm_configs import offloading_config

import triton_offload.connector as plugin

plugin.register()

SENTINEL = 0x5A


def make_config(extra, *, num_groups=1, worker_bytes, f, world_size=1, rank=0, replicated=False, engine_id=None):
    """An OffloadingConfig as vLLM's connector builds it for the tiering spec."""
    return offloading_config(
        {"spec_name": plugin.TIERING_SPEC_NAME, **extra},
        groups=tuple((g,) for g in range(num_groups)),
        worker_bytes=worker_bytes,
        f=f,
        world_size=world_size,
        rank=rank,
        engine_id=engine_id or f"tiertest-{uuid.uuid4().hex[:12]}",
        replicated=replicated,
    )


def region_file(engine_id: str) -> str:
    """vLLM's name for an engine's shared region."""
    return f"/dev/shm/vllm_offload_{engine_id}.mmap"


# The model: 4 canonical tensors. Tensor 0 and 1 (group 0) have 512-byte padded pages of which the layers use 384;
# tensor 2 (group 1) a 256-byte page; tensor 3 is referenced by no group but still takes its place in each slot.
# Group 1 also reads tensor 0 (HMA groups overlaying one allocation), with a shorter page.
PAGES = [512, 512, 256, 128]


def kv_caches(num_blocks=12, seed=0) -> CanonicalKVCaches:
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        CanonicalKVCacheTensor(torch.randint(-128, 128, (num_blocks, p), dtype=torch.int8, generator=gen), p)
        for p in PAGES
    ]
    refs = [
        [CanonicalKVCacheRef(0, 384), CanonicalKVCacheRef(1, 384)],
        [CanonicalKVCacheRef(2, 256), CanonicalKVCacheRef(0, 320)],
    ]
    return CanonicalKVCaches(tensors, refs)


def vllm_views(config, spec, rank: int) -> tuple[SharedOffloadRegion, list[torch.Tensor]]:
    """A second mapping of the same region, with vLLM's own per-tensor worker views, in tensor order."""
    region = SharedOffloadRegion(
        engine_id=config.engine_id,
        num_chunks=spec.num_chunks,
        rank=rank,
        kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
        cpu_page_size=spec.cpu_page_size_per_worker,
    )
    f = config.cache.blocks_per_chunk
    return region, [region.create_next_worker_view(p * f) for p in PAGES]


def positions(group_sizes, block_indices, chunk_ids, f):
    """vLLM's placement of a job's GPU blocks, written out independently of the code under test: for block i of
    group g, (g, its index in the job's GPU ids, chunk, sub-block), at position p = block_indices[g] % f + i of the
    group's chunks, chunk chunk_ids[p // f], sub-block p % f."""
    g0 = c0 = 0
    for g, (n, first) in enumerate(zip(group_sizes, block_indices)):
        skip = first % f
        for i in range(n):
            p = skip + i
            yield g, g0 + i, chunk_ids[c0 + p // f], p % f
        g0, c0 = g0 + n, c0 + (-(-(skip + n) // f) if n else 0)


def expected_store(before: torch.Tensor, views, kv, gpu_ids, group_sizes, block_indices, chunk_ids, f):
    """The whole region after vLLM's worker ran the store: ``before`` with each ref's un-padded page of each block
    written at its :func:`positions` entry, through vLLM's view of its tensor."""
    out = before.clone()
    dsts = [torch.as_strided(out, v.shape, v.stride(), v.storage_offset()) for v in views]  # vLLM's views, over out
    for g, j, row, sub in positions(group_sizes, block_indices, chunk_ids, f):
        for ref in kv.group_data_refs[g]:
            page = kv.tensors[ref.tensor_idx].page_size_bytes
            dsts[ref.tensor_idx][row, sub * page : sub * page + ref.page_size_bytes] = kv.tensors[
                ref.tensor_idx
            ].tensor[gpu_ids[j], : ref.page_size_bytes]
    return out
