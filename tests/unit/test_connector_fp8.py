"""``host_format = "fp8_e4m3"`` through TritonOffloadingSpec, with vLLM's own connector code (0.32 and 0.33): the spec
built by vLLM's ``build_offloading_config`` (wrapped by the plugin), the worker role's ``register_kv_caches`` over
caches laid out by vLLM's ``create_kv_cache_views`` (``LBHNC``, fp16), its store and load jobs. Checked: the rows are
sized for the compressed bytes (and the native count is reported beside them), a stored and loaded block equals the
plain-PyTorch reference's quantize-dequantize of each head's K and V as vLLM's CPU attention reads them, 8-bit caches
move unchanged, and what cannot be read exactly is refused naming the key, before anything is allocated.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.base", reason="needs vLLM >= 0.32 (pip install 'triton-offload[vllm]')")
from vllm_configs import ctx, key  # noqa: E402

if not hasattr(pytest.importorskip("vllm.v1.kv_cache_interface"), "create_kv_cache_views"):
    pytest.skip("needs vLLM's KV cache layouts (create_kv_cache_views)", allow_module_level=True)
from vllm.distributed.kv_transfer.kv_connector.v1 import offloading_connector  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.kv_offload.base import GPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm_hybrid import BLOCK_TOKENS, Case, HybridKV, full, mamba, vllm_config  # noqa: E402

import triton_offload.connector as plugin  # noqa: E402
import triton_offload.connector.worker as worker_module  # noqa: E402
from triton_offload.connector import load_errors, typed_pages  # noqa: E402
from triton_offload.kernels.reference_fp8 import dequantize_head, quantize_head  # noqa: E402

pytestmark = pytest.mark.vllm
plugin.register()

F, HEADS, HEAD = 2, 2, 32  # fp16 pages of 2 heads x 16 tokens x (32 + 32): 4096 bytes
PAGE = 2 * HEADS * BLOCK_TOKENS * HEAD * 2
FP8 = {"host_format": "fp8_e4m3"}


@pytest.fixture(autouse=True)
def cpu_platform(monkeypatch):
    """vLLM's CPU platform, as the e2e runs (vLLM 0.33's GPU bundle here has no platform at all)."""
    monkeypatch.setattr(typed_pages, "cpu_platform", lambda: True)


def _spec(kv: HybridKV, extra=None, *, layout="LBHNC", budget=64 * F * 2 * PAGE, wrapped=True):
    extra = {"spec_name": plugin.SPEC_NAME, "cpu_bytes_to_use": budget, "block_size": F * BLOCK_TOKENS, **(extra or {})}
    cfg = vllm_config(extra)
    cfg.cache_config.kv_cache_layout = layout
    build = offloading_connector.build_offloading_config
    config = (build if wrapped else build.__wrapped__)(cfg, kv.config)
    return OffloadingSpecFactory.create_spec(config)


def _kv(spec=None, layers=2, seed=0) -> HybridKV:
    """Two fp16 layers of one group, filled with finite values (normal, scaled per layer)."""
    kv = HybridKV(Case(((spec or full(PAGE), layers),), "overlaid"), num_blocks=12, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    if kv.raw.numel() % 2 == 0 and (spec is None or spec.dtype == torch.float16):
        kv.raw.view(torch.float16).copy_(torch.randn(kv.raw.numel() // 2, generator=gen) * 3)
    return kv


def _store_then_load(kv: HybridKV, spec, src, dst):
    """Stores GPU blocks ``src`` (one host row of F) through vLLM's worker role, then loads the row into ``dst``."""
    role = OffloadingConnectorWorker(spec, vllm_config({}), kv.config)
    role.register_kv_caches(dict(kv.views))
    mgr, rc, keys = spec.get_manager(), ctx(), [key(0)]
    store = TransferJob("r", GPULoadStoreSpec(src, [len(src)], [0]), mgr.prepare_store(keys, rc).store_spec)
    role.prepare_store_kv(OffloadingConnectorMetadata(load_jobs={}, store_jobs={0: store}))
    role.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
    role.worker.wait({0})
    role.get_finished(set())
    mgr.complete_store(keys, rc)
    load = TransferJob("r", mgr.prepare_load(keys, rc), GPULoadStoreSpec(dst, [len(dst)], [0]))  # async: 0.32 too
    role.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={1: load}, store_jobs={}))
    role.worker.wait({1})
    role.get_finished(set())
    mgr.complete_load(keys, rc)
    return role


def _cpu_heads(view: torch.Tensor, block: int):
    """One block's (head, K or V) slabs as vLLM's CPU attention reads a page: (H, N, 2D) viewed (H, 2N, D)."""
    page = view[block].reshape(HEADS, 2 * BLOCK_TOKENS, HEAD)
    return [page[h, kv * BLOCK_TOKENS : (kv + 1) * BLOCK_TOKENS] for h in range(HEADS) for kv in (0, 1)]


def test_rows_hold_about_twice_the_blocks_and_the_startup_says_both(caplog):
    """Same budget: 64 rows native, 126 in FP8 (a page of 4096 bytes takes 2 x (1024 + 16): 1.97x); the manager's info
    and the startup log give the format, the tokens and the native count."""
    kv = _kv()
    native, fp8 = _spec(kv), _spec(kv, FP8)
    assert (native.num_host_blocks, native.format_plan, native.native_host_blocks) == (64, None, 64)
    assert fp8.format_plan.group_bytes == (2 * 2 * (1024 + 16),)
    assert (fp8.num_host_blocks, fp8.native_host_blocks) == (126, 64)
    with caplog.at_level(logging.INFO, logger="triton_offload.connector.spec"):
        info = fp8.get_manager().config_info()[0]
    assert info["triton_offload_host_format"] == "fp8_e4m3" and info["triton_offload_native_host_blocks"] == 64
    assert info["triton_offload_host_tokens"] == 126 * F * BLOCK_TOKENS
    assert f"host format fp8_e4m3: {126 * F * BLOCK_TOKENS} tokens per region (native: 64 rows)" in caplog.text


def test_a_stored_and_loaded_block_is_each_heads_k_and_v_quantized(caplog):
    """Blocks 3 and 7 stored into one host row, loaded into 10 and 11: each (head, K/V) of the loaded blocks equals
    the reference's quantize-dequantize of the source's (one power-of-two scale each, as the CPU backend splits K
    and V); the row is 2 x the compressed page of each layer, and other blocks are untouched. vLLM's transfer stats
    count the compressed bytes, the worker's totals both."""
    kv = _kv()
    spec = _spec(kv, FP8)
    names = kv.names[0]
    before = {n: kv.views[n].clone() for n in names}
    with caplog.at_level(logging.INFO, logger="triton_offload.connector.worker"):
        role = _store_then_load(kv, spec, [3, 7], [10, 11])
    worker = role.worker
    assert worker.kv.host_format == "fp8_e4m3" and worker.kv.layout.label == "block_first"
    assert worker.host_cache.buffer.shape == (126, F * 2 * 2 * (1024 + 16))
    assert "host format fp8_e4m3" in caplog.text
    # vLLM's kv_offload_{load,store}_bytes (from the worker role's transfer stats): the bytes over the link; the GPU
    # bytes stay in the worker's totals beside them.
    wire, gpu = 2 * 2 * 2 * (1024 + 16), 2 * 2 * PAGE
    stats = role.build_connector_worker_meta().transfer_stats
    assert (stats.store.bytes, stats.load.bytes, stats.store.sizes) == (wire, wire, [wire])
    assert [worker.stats[k] for k in ("stored_bytes", "loaded_bytes", "stored_wire_bytes", "loaded_wire_bytes")] == [
        gpu, gpu, wire, wire
    ]  # fmt: skip
    for n in names:
        for src, dst in ((3, 10), (7, 11)):
            for want, got in zip(_cpu_heads(before[n], src), _cpu_heads(kv.views[n], dst)):
                codes, scale = quantize_head(want)
                assert torch.equal(got, dequantize_head(codes, scale, torch.float16)), n
                assert (got - want).abs().max() <= want.abs().max() / 16  # the format's bound, loosely
        untouched = [b for b in range(12) if b not in (10, 11)]
        assert torch.equal(kv.views[n][untouched], before[n][untouched])
    worker.shutdown()


def test_an_8_bit_cache_moves_unchanged_in_native_rows():
    """kv_cache_dtype="fp8": the pages are 8-bit already, so host_format fp8_e4m3 moves their bytes unchanged, in
    rows of the native size (the canonical spec)."""
    spec8 = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.uint8)
    kv = _kv(spec8)
    spec = _spec(kv, FP8, budget=64 * F * 2 * spec8.page_size_bytes)
    assert spec.format_plan.host_format == "native" and spec.num_host_blocks == 64
    before = {n: kv.views[n].clone() for n in kv.names[0]}
    role = _store_then_load(kv, spec, [3, 7], [10, 11])
    assert role.worker.kv.layout.label == "canonical"
    for n in kv.names[0]:
        assert torch.equal(kv.views[n][[10, 11]], before[n][[3, 7]])
    role.worker.shutdown()


def _refused(kv, extra, match, **kw):
    with pytest.raises(ValueError, match=match):
        _spec(kv, {**FP8, **extra}, **kw)


def test_what_cannot_be_read_exactly_is_refused_naming_the_key(monkeypatch):
    """Refused when the spec is built (before the worker allocates anything): no geometry from vLLM's config, a
    layout or platform whose K and V halves are not described, a Mamba group, an fp32 model, and the copy engines
    (they cannot quantize)."""
    monkeypatch.setattr(worker_module, "HostCache", None)  # a tripwire: nothing may be allocated
    kv = _kv()
    _refused(kv, {}, r"host_format = 'fp8_e4m3' needs each layer's dtype .* entry point did not run", wrapped=False)
    _refused(kv, {}, r"host_format = 'fp8_e4m3': kv_cache_layout 'LBNHC' on the CPU platform", layout="LBNHC")
    monkeypatch.setattr(typed_pages, "cpu_platform", lambda: False)
    _refused(kv, {}, r"kv_cache_layout 'LBHNC' on the GPU platform .* not described")
    monkeypatch.setattr(typed_pages, "cpu_platform", lambda: True)
    _refused(kv, {"transfer_path": "dma"}, r"host_format = 'fp8_e4m3' does not work with transfer_path = 'dma'")
    hybrid = HybridKV(Case(((full(), 2), (mamba(), 2)), "overlaid"), num_blocks=4, views=False)
    _refused(hybrid, {}, r"host_format = 'fp8_e4m3' quantizes attention K/V pages and MLA latents; a MambaSpec layer")
    fp32 = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    _refused(HybridKV(Case(((fp32, 2),), "overlaid"), 4, views=False), {}, r"bf16 or fp16 caches; this one is")


def test_the_gpu_layout_halves_are_token_halves_of_each_heads_k_and_v():
    """LBNHC (GPU backends: per token and head, K then V): the typed view's slab s of half j is head s // 2's K
    (s even) or V of tokens [j N/2, (j+1) N/2), read from a page built in that order."""
    spec = full(PAGE)
    geo = typed_pages.page_geometry(spec, "LBNHC", cpu=False)
    cells = torch.randn(3, BLOCK_TOKENS, HEADS, 2, HEAD, dtype=torch.float16)  # [B, N, H, K|V, D]
    pages = cells.view(torch.int8).reshape(3, -1)
    view = geo.view(pages, "test")
    assert view.shape == (3, 2, BLOCK_TOKENS // 2, 2 * HEADS, HEAD) and geo.page_bytes == PAGE
    half = BLOCK_TOKENS // 2
    for j in range(2):
        for s in range(2 * HEADS):
            assert torch.equal(view[:, j, :, s], cells[:, j * half : (j + 1) * half, s // 2, s % 2])
    with pytest.raises(ValueError, match=r"'LBNHC' on the GPU platform \(block_size 15\)"):
        typed_pages.page_geometry(FullAttentionSpec(block_size=15, num_kv_heads=2, head_size=8, dtype=torch.float16),
                                  "LBNHC", cpu=False)  # fmt: skip


def _mla(head=40, **kw):
    """vLLM's MLA spec: one latent per token (kv_lora_rank 32 + qk_rope_head_dim 8 here), one head, fp16."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=1, head_size=head, dtype=torch.float16, **kw)


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_an_mla_latent_is_one_run_with_one_scale_per_block_and_layer(layout, monkeypatch):
    """MLA pages (16 tokens x 40 latent elements, fp16: 1280 bytes) in either layout (one head: the same bytes) and
    on either platform: rows of 2 x (640 + 16) bytes per block, the library's mla layout; a stored and loaded block
    is the reference's quantize-dequantize of the whole (tokens, latent) page, rope part included."""
    monkeypatch.setattr(typed_pages, "cpu_platform", lambda: layout == "LBHNC")
    kv = HybridKV(Case(((_mla(), 2),), "overlaid"), num_blocks=12, seed=3)
    gen = torch.Generator().manual_seed(3)
    kv.raw.view(torch.float16).copy_(torch.randn(kv.raw.numel() // 2, generator=gen) * 3)
    spec = _spec(kv, FP8, layout=layout, budget=64 * F * 2 * 1280)
    assert spec.format_plan.group_bytes == (2 * (640 + 16),)
    assert spec.num_host_blocks == 64 * 1280 // 656
    before = {n: kv.views[n].clone() for n in kv.names[0]}
    role = _store_then_load(kv, spec, [3, 7], [10, 11])
    assert role.worker.kv.layout.label == "mla" and role.worker.kv.host_format == "fp8_e4m3"
    for n in kv.names[0]:
        for src, dst in ((3, 10), (7, 11)):
            want = before[n][src].reshape(BLOCK_TOKENS, 40)
            codes, scale = quantize_head(want)
            got = kv.views[n][dst].reshape(BLOCK_TOKENS, 40)
            assert torch.equal(got, dequantize_head(codes, scale, torch.float16)), n
    role.worker.shutdown()


def test_mla_pages_that_are_not_one_plain_latent_are_refused():
    """An 8-bit MLA cache moves unchanged; DeepSeek-V4's MLA pages (model_version), MLA layers beside K/V ones and
    hidden-state caches are not described, so refused naming the key."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    one_byte = MLAAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=1, head_size=40, dtype=torch.uint8)
    assert typed_pages.page_geometry(one_byte, "LBHNC", cpu=True) is None
    with pytest.raises(ValueError, match=r"MLAAttentionSpec page is not one plain latent per token"):
        typed_pages.page_geometry(_mla(model_version="deepseek_v4"), "LBHNC", cpu=True)
    mixed = HybridKV(Case(((full(PAGE), 2), (_mla(), 2)), "disjoint"), num_blocks=4, views=False)
    _refused(mixed, {}, r"host_format = 'fp8_e4m3': MLA latents beside K/V pages in one model: not described")
    hidden = pytest.importorskip("vllm.v1.kv_cache_interface").__dict__.get("HiddenStateCacheSpec")
    if hidden is not None:
        spec = hidden(block_size=BLOCK_TOKENS, num_kv_heads=1, head_size=40, dtype=torch.float16)
        with pytest.raises(ValueError, match=r"a HiddenStateCacheSpec layer is not described"):
            typed_pages.page_geometry(spec, "LBHNC", cpu=True)


def test_with_the_integrity_checks_a_corrupted_fp8_block_is_a_load_error():
    """integrity = "verify" with the FP8 format (checked as "require" by this spec): a stored row carries its
    checksums over the stored bytes, an intact load passes, and a bit flipped in one block's FP8 values, then in the
    other's scale, fails exactly that block (reported to the connector by GPU block), the other loaded as before."""
    kv = _kv(seed=3)
    token = load_errors._REPORTING.set(True)  # what TritonOffloadingConnector does around vLLM's construction
    try:
        spec = _spec(kv, {**FP8, "integrity": "verify"})
    finally:
        load_errors._REPORTING.reset(token)
    role = _store_then_load(kv, spec, [3, 7], [10, 11])
    worker = role.worker
    try:
        assert worker.host_cache.checksums is not None and worker.take_load_errors() == ([], 0)
        (row,) = [r for r in range(worker.host_cache.buffer.shape[0]) if worker.host_cache.checksums.table[r, 0]]
        sub = worker.host_cache.buffer.shape[1] // F  # the second block's sub-block starts here
        for at, gpu in ((5, 10), (sub + 1024 + 4, 11)):  # a value of block 3's first run; block 7's second scale
            worker.host_cache.buffer[row, at] ^= 0x10
            mgr, rc, keys = spec.get_manager(), ctx(), [key(0)]
            load = TransferJob("r", mgr.prepare_load(keys, rc), GPULoadStoreSpec([10, 11], [2], [0]))
            role.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={2 + gpu: load}, store_jobs={}))
            role.worker.wait({2 + gpu})
            role.get_finished(set())
            mgr.complete_load(keys, rc)
            (error,), _ = worker.take_load_errors()
            assert error.gpu_block_ids == (gpu,), at
            worker.host_cache.buffer[row, at] ^= 0x10
    finally:
        worker.shutdown()
