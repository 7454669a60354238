"""vLLM 0.33's own OffloadingConnector worker role (``OffloadingConnectorWorker``) driving TritonOffloadingSpec, over
KV caches laid out exactly as vLLM 0.33's model runner lays them out: one flat allocation per cache tensor viewed by
vLLM's own ``create_kv_cache_views`` in a resolved ``KVCacheLayout`` (llama-like pages, and MLA latents).

``register_kv_caches`` derives the canonical tensors as vLLM does for an engine; stores and loads then arrive as
connector metadata, the way the scheduler ships them each step (a store is deferred to the next step's
``start_kv_transfers``; a sync load completes before the step's forward pass, an async one reports its request as
finished receiving). Every byte of the host blocks and of the KV allocation is checked, on CPU (the kernels under
the interpreter) and, with -m gpu, on CUDA.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.base", reason="needs vLLM >= 0.32 (pip install 'triton-offload[vllm]')")
from vllm_configs import ctx, key, offloading_config, worker_role_missing  # noqa: E402

if reason := worker_role_missing():
    pytest.skip(reason, allow_module_level=True)
from vllm.config import ParallelConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.kv_offload.base import GPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

import triton_offload.connector as plugin  # noqa: E402

pytestmark = pytest.mark.vllm

SENTINEL = 0x5A
LAYERS, BLOCKS, F, HOST_BLOCKS = 3, 24, 2, 8
# Per layer, what vLLM's attention backends publish: llama-like (2 KV heads of 64, K and V in one cell: 8 KiB
# pages) and DeepSeek-like MLA (one latent of 72 per token, no V: 2304-byte pages).
SPECS = {
    "llama": (FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16), 2),
    "mla": (MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=72, dtype=torch.bfloat16), 1),
}


class VllmKV:
    """One KV cache tensor shared by every layer, allocated and viewed as vLLM 0.33's model runner does it."""

    def __init__(self, kind: str, layout: KVCacheLayout, device: str, seed: int = 0):
        self.spec, heads = SPECS[kind]
        self.page = self.spec.page_size_bytes
        self.names = [f"l{i}" for i in range(LAYERS)]
        layer_stride, block_stride, *_ = compute_layout_strides(self.spec, BLOCKS, LAYERS, layout)
        self.tensor = KVCacheTensor(
            size=LAYERS * BLOCKS * self.page, layers=self.names, layer_stride=layer_stride, block_stride=block_stride
        )
        gen = torch.Generator().manual_seed(seed)
        self.raw = torch.randint(-128, 128, (self.tensor.size,), dtype=torch.int8, generator=gen).to(device)
        self.views = create_kv_cache_views(self.raw, self.spec, BLOCKS, layout, self.tensor)
        self.config = KVCacheConfig(BLOCKS, [self.tensor], [KVCacheGroupSpec(self.names, self.spec)])
        # What derive_canonical_mappings reads of the engine's config: one rank, and the model's KV heads.
        self.vllm_config = SimpleNamespace(
            parallel_config=ParallelConfig(), model_config=SimpleNamespace(get_total_num_kv_heads=lambda: heads)
        )

    def block_bytes(self, raw: torch.Tensor, blocks) -> torch.Tensor:
        """(len(blocks), LAYERS * page) uint8 on the CPU: each block's pages, layer after layer (the packed
        sub-block), read from the flat allocation with the strides vLLM placed them at (no view of vLLM's)."""
        flat = raw.view(torch.uint8).cpu()
        rows = []
        for b in blocks:
            pages = []
            for layer in range(LAYERS):
                start = layer * self.tensor.layer_stride + b * self.tensor.block_stride
                pages.append(flat[start : start + self.page])
            rows.append(torch.cat(pages))
        return torch.stack(rows)


def _worker_role(kv: VllmKV):
    plugin.register()  # what vLLM's plugin loading does in every engine process
    extra = {"spec_name": plugin.SPEC_NAME, "cpu_bytes_to_use": HOST_BLOCKS * LAYERS * kv.page * F}
    config = offloading_config(extra, groups=(tuple(range(LAYERS)),), worker_bytes=LAYERS * kv.page, f=F)
    spec = OffloadingSpecFactory.create_spec(config)
    role = OffloadingConnectorWorker(spec, kv.vllm_config, kv.config)
    role.register_kv_caches(dict(zip(kv.names, kv.views)))
    return spec.get_manager(), role


def _step_done(role, jobs: set[int]):
    """Waits for ``jobs``, then what the worker role reports at the end of a step: (finished sending, finished
    receiving) and the completed job ids with the bytes it recorded per direction."""
    role.worker.wait(jobs)
    done = role.get_finished(set())
    meta = role.build_connector_worker_meta()
    return done, meta.completed_jobs, meta.transfer_stats


@pytest.mark.parametrize(
    ("kind", "layout"),
    [("llama", KVCacheLayout.LBHNC), ("mla", KVCacheLayout.LBHNC), ("llama", KVCacheLayout.BLHNC)],
    ids=["llama-LBHNC", "mla-LBHNC", "llama-BLHNC-packed"],
)
def test_connector_metadata_moves_vllm_laid_out_blocks(kind, layout, device):
    """A store of 6 blocks into 3 host blocks (f=2), deferred to the next step as vLLM's worker role does it; a sync
    load of 5 of them (the device holds the first) and an async load of blocks 1-2 into other blocks. Block-outermost
    layouts (BLHNC) reach the spec as one packed region per block, layer-compact ones (LBHNC) as one tensor per
    layer: the host bytes are the same."""
    kv = VllmKV(kind, layout, device)
    mgr, role = _worker_role(kv)
    worker = role.worker
    host = worker.host_cache.buffer
    assert host.shape == (HOST_BLOCKS, F * LAYERS * kv.page)
    host.fill_(SENTINEL)
    before = kv.raw.clone()
    rc = ctx()
    keys = [key(c) for c in range(3)]
    out = mgr.prepare_store(keys, rc)
    src = [3, 7, 1, 9, 4, 12]
    store = {0: TransferJob("r", GPULoadStoreSpec(src, [6], [0]), out.store_spec)}
    role.prepare_store_kv(OffloadingConnectorMetadata(load_jobs={}, store_jobs=store))  # step end: deferred
    assert worker.stats["store_jobs"] == 0
    role.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))  # the next step submits it
    done, completed, stats = _step_done(role, {0})
    assert done == (set(), set()) and completed == {0: 1} and stats.store.bytes == 6 * LAYERS * kv.page
    mgr.complete_store(keys, rc)

    rows = out.store_spec.block_ids.tolist()
    want = torch.full_like(host, SENTINEL)
    want[rows] = kv.block_bytes(before, src).reshape(3, -1)
    assert torch.equal(host, want), "the host blocks hold other bytes than the stored blocks, or more"

    dst = [13, 14, 15, 0, 2]
    load = mgr.prepare_load(keys, rc)
    sync = TransferJob("r", load, GPULoadStoreSpec(dst, [5], [1]), sync=True)
    role.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={1: sync}, store_jobs={}))  # waited for in the step
    done, completed, stats = _step_done(role, {1})
    assert done == (set(), set()), "a sync load's request already runs: it is not reported as received"
    assert completed == {1: 1} and stats.load.bytes == 5 * LAYERS * kv.page
    mgr.complete_load(keys, rc)

    two = [key(0), key(1)]
    load = mgr.prepare_load(two, rc)
    later = TransferJob("r2", load, GPULoadStoreSpec([20, 21], [2], [1]), sync=False)
    role.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={2: later}, store_jobs={}))
    done, completed, _ = _step_done(role, {2})
    assert done == (set(), {"r2"}) and completed == {2: 1}
    mgr.complete_load(two, rc)

    loaded = [(d, s) for d, s in zip(dst, src[1:])] + [(20, src[1]), (21, src[2])]  # blocks 1-2 of the prefix
    assert torch.equal(kv.block_bytes(kv.raw, [d for d, _ in loaded]), kv.block_bytes(before, [s for _, s in loaded]))
    others = sorted(set(range(BLOCKS)) - {d for d, _ in loaded})
    assert torch.equal(kv.block_bytes(kv.raw, others), kv.block_bytes(before, others)), "a load wrote other blocks"
    assert torch.equal(host[rows], want[rows]), "a load changed the host blocks"
    role.shutdown()


def test_vllm_hands_the_spec_one_tensor_per_layer_or_one_packed_region():
    """What register_kv_caches gives the spec for each layout (the structure the byte test relies on)."""
    shapes = {}
    for layout in (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC):
        kv = VllmKV("llama", layout, "cpu")
        _, role = _worker_role(kv)
        shapes[layout.name] = [tuple(t.shape) for t in role.worker.kv.kv_caches]
        role.shutdown()
    assert shapes == {"LBHNC": [(BLOCKS, 8192)] * LAYERS, "BLHNC": [(BLOCKS, LAYERS * 8192)]}


def test_a_sync_load_completes_while_an_earlier_async_load_is_held_back():
    """vLLM 0.33's worker role submits a synchronous load with ``expedited=True`` and waits for it before the step's
    forward pass: it must not wait behind an asynchronous load submitted earlier. On a simulated device whose load
    lane is held back (tests/unit/sim_cuda.py), the sync load completes and is waited for; the async one completes once
    released, and only then is its request reported as received."""
    from sim_cuda import SimEngine, lane_stream

    from triton_offload.connector.worker import TritonOffloadingWorker
    from triton_offload.engine import LOAD

    kv = VllmKV("llama", KVCacheLayout.LBHNC, "cpu")
    with pytest.MonkeyPatch.context() as m:  # the worker's engines on the stream simulator, through its engine hook
        m.setattr(TritonOffloadingWorker, "engine_class", SimEngine)
        mgr, role = _worker_role(kv)
    rc = ctx()
    keys = [key(c) for c in range(2)]
    out = mgr.prepare_store(keys, rc)
    src = [3, 7, 1, 9]
    role.prepare_store_kv(
        OffloadingConnectorMetadata(load_jobs={}, store_jobs={0: TransferJob("r", GPULoadStoreSpec(src, [4], [0]),
                                                                             out.store_spec)})
    )  # fmt: skip
    role.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
    _step_done(role, {0})
    mgr.complete_store(keys, rc)
    before = kv.raw.clone()

    engine = role.worker.engine
    sim = engine.sim
    sim.held.add(lane_stream(engine, LOAD).name)  # the asynchronous load is slow
    slow = TransferJob("r2", mgr.prepare_load(keys[:1], rc), GPULoadStoreSpec([20, 21], [2], [0]), sync=False)
    role.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={1: slow}, store_jobs={}))
    fast = TransferJob("r", mgr.prepare_load(keys[1:], rc), GPULoadStoreSpec([13, 14], [2], [0]), sync=True)
    # Submits job 2 expedited and waits for it: the simulator fails this if the wait blocks behind job 1.
    role.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={2: fast}, store_jobs={}))
    assert torch.equal(kv.block_bytes(kv.raw, [13, 14]), kv.block_bytes(before, src[2:]))
    assert torch.equal(kv.block_bytes(kv.raw, [20, 21]), kv.block_bytes(before, [20, 21])), "job 1 is held back"
    assert role.get_finished(set()) == (set(), set())
    assert role.build_connector_worker_meta().completed_jobs == {2: 1}
    sim.held.clear()
    role.worker.wait({1})
    assert role.get_finished(set()) == (set(), {"r2"})
    assert torch.equal(kv.block_bytes(kv.raw, [20, 21]), kv.block_bytes(before, src[:2]))
    role.shutdown()
