"""``host_format = "fp8_e4m3"`` through TritonTieringOffloadingSpec (packed rows), with vLLM's own classes: the spec
built by vLLM's ``build_offloading_config`` (wrapped by the plugin), its ``SharedOffloadRegion``, the worker role's
``register_kv_caches`` over caches laid out by vLLM's ``create_kv_cache_views`` (``LBHNC``, fp16) and vLLM's
``FileMapper`` (the names the fs / obj tiers give rows). Checked: the CPU tier's rows (what every secondary tier
carries) are sized for the compressed bytes, so about twice the chunks fit; FP8 rows are named apart from native
ones whatever ``config_fingerprint`` says, while an 8-bit cache's rows (moved unchanged) share the native name; a
chunk stored and loaded equals the reference's quantize-dequantize of each head's K and V; with the integrity checks,
the trailer follows the FP8 pages and a flipped value or scale byte fails exactly its block; and what the rows cannot
hold is refused naming the keys.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid

import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="needs vLLM >= 0.32 with its tiering package")
from vllm_configs import finished, key, submit_load  # noqa: E402

if not hasattr(pytest.importorskip("vllm.v1.kv_cache_interface"), "create_kv_cache_views"):
    pytest.skip("needs vLLM's KV cache layouts (create_kv_cache_views)", allow_module_level=True)
from vllm.distributed.kv_transfer.kv_connector.v1 import offloading_connector  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.kv_offload.base import GPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.kv_offload.file_mapper import FileMapper  # noqa: E402
from vllm_hybrid import BLOCK_TOKENS, Case, HybridKV, full, vllm_config  # noqa: E402

import triton_offload.connector as plugin  # noqa: E402
from triton_offload import integrity  # noqa: E402
from triton_offload.connector import geometry, load_errors, typed_pages  # noqa: E402
from triton_offload.connector.tiering import (  # noqa: E402
    FP8_NAMESPACE,
    INTEGRITY_NAMESPACE,
    PACKED_NAMESPACE,
    IdentifiedChunks,
    trailer_bytes,
)
from triton_offload.kernels.reference_fp8 import dequantize_head, quantize_head  # noqa: E402

pytestmark = pytest.mark.vllm
plugin.register()

F, HEADS, HEAD = 2, 2, 32  # fp16 pages of 2 heads x 16 tokens x (32 + 32): 4096 bytes, 2 x (1024 + 16) in FP8
PAGE = 2 * HEADS * BLOCK_TOKENS * HEAD * 2
FP8_PAGE = 2 * (HEADS * BLOCK_TOKENS * HEAD + 16)  # two runs (the K|V halves): 2 heads' values, their scales
FP8 = {"host_layout": "packed", "host_format": "fp8_e4m3"}
BUDGET = 64 * F * 2 * PAGE  # 64 native chunks of two layers


@pytest.fixture(autouse=True)
def cpu_platform(monkeypatch):
    """vLLM's CPU platform, as the e2e runs (vLLM 0.33's GPU bundle here has no platform at all)."""
    monkeypatch.setattr(typed_pages, "cpu_platform", lambda: True)


def _kv(spec=None, seed=0) -> HybridKV:
    """Two fp16 layers of one group, filled with finite values."""
    kv = HybridKV(Case(((spec or full(PAGE), 2),), "overlaid"), num_blocks=12, seed=seed)
    if spec is None:
        gen = torch.Generator().manual_seed(seed)
        kv.raw.view(torch.float16).copy_(torch.randn(kv.raw.numel() // 2, generator=gen) * 3)
    return kv


def _spec(kv: HybridKV, extra=None, budget=BUDGET):
    extra = {"spec_name": plugin.TIERING_SPEC_NAME, "cpu_bytes_to_use": budget, "block_size": F * BLOCK_TOKENS,
             **(extra or {})}  # fmt: skip
    cfg = vllm_config(extra)
    cfg.cache_config.kv_cache_layout = "LBHNC"
    config = offloading_connector.build_offloading_config(cfg, kv.config)
    # A region name of its own per spec: vLLM names it after the engine id.
    config = dataclasses.replace(config, engine_id=f"fp8tier-{uuid.uuid4().hex[:10]}")
    geometry.remember(config, kv.config)
    return OffloadingSpecFactory.create_spec(config)


def _root(spec) -> str:
    return FileMapper.from_offloading_spec("/kv", spec).base_path


def test_rows_are_the_compressed_bytes_about_twice_the_chunks_and_the_log_says_so(caplog):
    """Same cpu_bytes_to_use: a native packed row is F x 2 pages (16 KiB), an FP8 one F x 2 x 2080 bytes rounded up to
    vLLM's 4 KiB row alignment (12 KiB: the alignment costs this small row; the slot itself is 0.51x); the
    configuration fingerprint names the format, and the startup log the tokens each format holds."""
    kv = _kv()
    native = _spec(kv, {"host_layout": "packed"})
    with caplog.at_level(logging.INFO, logger="triton_offload.connector.tiering"):
        fp8 = _spec(kv, FP8)
    assert native.cpu_page_size_per_worker == F * 2 * PAGE and native.num_chunks == 64
    assert fp8.format_plan.group_bytes == (2 * FP8_PAGE,)
    assert fp8.cpu_page_size_per_worker == F * 2 * FP8_PAGE == 8320
    assert fp8.kv_bytes_per_chunk == 12288 and fp8.num_chunks == BUDGET // 12288 == 85
    assert fp8.format_facts() == ("fp8_e4m3", 85 * F * BLOCK_TOKENS, 64)
    assert native.format_facts() == ("native", 64 * F * BLOCK_TOKENS, 64)
    assert '"format":"fp8_e4m3"' in dict(fp8.fingerprint.fields)["host_format"]
    with caplog.at_level(logging.INFO, logger="triton_offload.connector.tiering"):
        fp8.get_manager().shutdown()
    assert f"host format fp8_e4m3: {85 * F * BLOCK_TOKENS} tokens in the CPU tier (native: 64 chunks)" in caplog.text


def test_larger_rows_lose_less_to_the_alignment():
    """Rows of 32 GPU blocks: 1.94x the chunks of the native format for the same budget (the 4 KiB alignment of
    a model's rows, MiBs each, costs less still)."""
    kv = _kv()
    extra = {"block_size": 32 * BLOCK_TOKENS}
    budget = 64 * 32 * 2 * PAGE
    native, fp8 = _spec(kv, {**extra, "host_layout": "packed"}, budget), _spec(kv, {**extra, **FP8}, budget)
    assert fp8.cpu_page_size_per_worker == 32 * 2 * FP8_PAGE and fp8.kv_bytes_per_chunk == 135168
    assert (native.num_chunks, fp8.num_chunks) == (64, budget // 135168) == (64, 124)


def test_mla_rows_hold_the_compressed_latent():
    """vLLM's MLA spec (one latent of 32 + 8 fp16 elements per token, one head): the CPU tier's packed rows hold
    F x 2 layers x (640 + 16) bytes, a scale per block and layer, where native rows hold F x 2 x 1280."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    mla = MLAAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=1, head_size=40, dtype=torch.float16)
    kv = HybridKV(Case(((mla, 2),), "overlaid"), num_blocks=4, views=False)
    extra = {"block_size": 32 * BLOCK_TOKENS}
    native, fp8 = _spec(kv, {**extra, "host_layout": "packed"}), _spec(kv, {**extra, **FP8})
    assert fp8.format_plan.pages[0][0].layout == "mla" and fp8.format_plan.group_bytes == (2 * 656,)
    assert (native.cpu_page_size_per_worker, fp8.cpu_page_size_per_worker) == (32 * 2 * 1280, 32 * 2 * 656)
    assert fp8.num_chunks / native.num_chunks > 1.9


@pytest.mark.parametrize("fingerprint", ["auto", "off", "shared-label"])
def test_fp8_rows_are_never_named_as_native_ones(fingerprint):
    """Whatever config_fingerprint says (a label or "off" would otherwise name both formats alike), the fs / obj
    tiers' names (vLLM's FileMapper) and the p2p handshake's model name differ between native and FP8 rows."""
    kv = _kv()
    extra = {"config_fingerprint": fingerprint}
    native, fp8 = _spec(kv, {**extra, "host_layout": "packed"}), _spec(kv, {**extra, **FP8})
    assert fp8.config.model.name.endswith(PACKED_NAMESPACE + FP8_NAMESPACE)
    assert native.config.model.name.endswith(PACKED_NAMESPACE)
    assert _root(native) != _root(fp8)
    if fingerprint == "auto":  # the fingerprint's host_format field differs too
        assert native.fingerprint.digest != fp8.fingerprint.digest
    else:
        assert fp8.config.model.name == native.config.model.name + FP8_NAMESPACE


def test_an_8_bit_cache_keeps_the_native_rows_and_name():
    """kv_cache_dtype="fp8": the pages move unchanged, so the rows and their names are the native format's (an
    engine with host_format native shares them, rightly: the bytes are the same)."""
    spec8 = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.uint8)
    kv = _kv(spec8)
    native, fp8 = _spec(kv, {"host_layout": "packed"}), _spec(kv, FP8)
    assert fp8.format_plan.host_format == "native"
    assert (fp8.kv_bytes_per_chunk, fp8.num_chunks) == (native.kv_bytes_per_chunk, native.num_chunks)
    assert fp8.config.model.name == native.config.model.name and _root(fp8) == _root(native)


def _cpu_heads(view: torch.Tensor, block: int):
    """One block's (head, K or V) slabs as vLLM's CPU attention reads a page: (H, N, 2D) viewed (H, 2N, D)."""
    page = view[block].reshape(HEADS, 2 * BLOCK_TOKENS, HEAD)
    return [page[h, kv * BLOCK_TOKENS : (kv + 1) * BLOCK_TOKENS] for h in range(HEADS) for kv in (0, 1)]


def assert_blocks_quantized(kv: HybridKV, names, before: dict) -> None:
    """Blocks 10 and 11 of every layer hold the reference's quantize-dequantize of what blocks 3 and 7 held."""
    for n in names:
        for src, dst in ((3, 10), (7, 11)):
            for want, got in zip(_cpu_heads(before[n], src), _cpu_heads(kv.views[n], dst)):
                codes, scale = quantize_head(want)
                assert torch.equal(got, dequantize_head(codes, scale, torch.float16)), n


def test_a_chunk_stored_and_loaded_through_the_region_is_each_heads_k_and_v_quantized():
    """Blocks 3 and 7 stored into chunk 5 of the shared region (the worker vLLM's worker role registered), loaded
    into 10 and 11: each
    (head, K/V) equals the reference's quantize-dequantize; the row the scheduler's tiers read holds exactly the
    compressed bytes (the rest of the row is never written), and the transfer's size (vLLM's kv_offload byte
    counters) counts them."""
    kv = _kv()
    spec = _spec(kv, FP8)
    role = OffloadingConnectorWorker(spec, vllm_config({}), kv.config)
    role.register_kv_caches(dict(kv.views))
    worker = role.worker
    names = kv.names[0]
    before = {n: kv.views[n].clone() for n in names}
    try:
        assert worker.kv.host_format == "fp8_e4m3" and worker.host.shape == (spec.num_chunks, F * 2 * FP8_PAGE)
        row = spec.kv_bytes_per_chunk
        worker.region.base_tensor.view(torch.uint8).fill_(0x5A)
        assert worker.submit_store(0, GPULoadStoreSpec([3, 7], [2], [0]), CPULoadStoreSpec([5]))
        (stored,) = finished(worker)
        assert stored.transfer_size == 2 * 2 * FP8_PAGE, "the bytes over the link, not the GPU pages"
        whole = worker.region.base_tensor.view(torch.uint8)
        written = (whole.view(spec.num_chunks, row) != 0x5A).nonzero()
        assert set(written[:, 0].tolist()) == {5} and int(written[:, 1].max()) < F * 2 * FP8_PAGE
        submit_load(worker, 1, CPULoadStoreSpec([5]), GPULoadStoreSpec([10, 11], [2], [0]), expedited=False)
        assert [r.transfer_size for r in finished(worker)] == [2 * 2 * FP8_PAGE]
    finally:
        role.shutdown()
    assert_blocks_quantized(kv, names, before)


def _checked_spec(kv: HybridKV, setting: str):
    token = load_errors._REPORTING.set(True)  # what TritonOffloadingConnector does around vLLM's construction
    try:
        return _spec(kv, {**FP8, "integrity": setting})
    finally:
        load_errors._REPORTING.reset(token)


def test_with_the_integrity_checks_the_trailer_follows_the_compressed_pages():
    """Each worker slot is the FP8 pages (8320 bytes, already 16-byte aligned) plus the trailer of the row marker and
    F checksums; the row still fits vLLM's 12 KiB alignment, so the CPU tier keeps its 85 chunks; the tiers name the
    rows apart from unchecked FP8 ones."""
    kv = _kv()
    off, on = _spec(kv, FP8), _checked_spec(kv, "verify")
    assert (off.trailer_bytes, on.trailer_bytes) == (0, trailer_bytes(F)) == (0, 32)
    assert on.cpu_page_size_per_worker == F * 2 * FP8_PAGE + 32 == 8352
    assert (on.kv_bytes_per_chunk, on.num_chunks) == (off.kv_bytes_per_chunk, off.num_chunks) == (12288, 85)
    assert on.config.model.name.endswith(PACKED_NAMESPACE + FP8_NAMESPACE + INTEGRITY_NAMESPACE)
    assert _root(on) != _root(off)


@pytest.mark.parametrize("setting", ["verify", "require"])
def test_with_the_integrity_checks_a_corrupted_fp8_row_fails_exactly_its_block(setting):
    """Blocks 3 and 7 stored into chunk 5 with their key's identity: the trailer holds the row marker and checksums
    over the stored FP8 bytes, an intact load passes (the blocks quantized as without the checks), and a bit flipped
    in the region (what every tier carries) in block 3's FP8 values, then in block 7's scales, fails exactly that
    block under either setting, reported as the CPU tier's; restored, the row loads clean again."""
    kv = _kv(seed=3)
    spec = _checked_spec(kv, setting)
    role = OffloadingConnectorWorker(spec, vllm_config({}), kv.config)
    role.register_kv_caches(dict(kv.views))
    worker = role.worker
    chunk = IdentifiedChunks([5], integrity.identities_of_keys([key(0)]))
    names = kv.names[0]
    before = {n: kv.views[n].clone() for n in names}
    try:
        assert worker.checksums is not None and worker.host.shape == (spec.num_chunks, F * 2 * FP8_PAGE)
        assert worker.submit_store(0, GPULoadStoreSpec([3, 7], [2], [0]), chunk)
        assert all(r.success for r in finished(worker))
        assert worker.checksums.table[5, 0] != 0 and worker.checksums.table[5, 1:].ne(0).all()
        sub = worker.host.shape[1] // F  # block 7's sub-block starts here
        for job, at, gpu in ((1, None, None), (2, 5, 10), (3, sub + 1024 + 4, 11), (4, None, None)):
            if at is not None:
                worker.host[5, at] ^= 0x10
            submit_load(worker, job, chunk, GPULoadStoreSpec([10, 11], [2], [0]), expedited=False)
            assert finished(worker)[0].success
            errors, unchecked = worker.take_load_errors()
            assert unchecked == 0
            if at is None:
                assert errors == [], job
            else:
                assert [(e.gpu_block_ids, e.host_block_ids, e.tier) for e in errors] == [((gpu,), (5,), "CPU tier")]
                worker.host[5, at] ^= 0x10
    finally:
        role.shutdown()
    assert_blocks_quantized(kv, names, before)


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"host_layout": "worker_slots"}, r"host_format = 'fp8_e4m3' needs host_layout = 'packed'"),
        ({"transfer_path": "dma"}, r"does not work with transfer_path = 'dma' \(the copy engines cannot quantize\)"),
    ],
    ids=["worker-slots", "dma"],
)
def test_what_the_rows_cannot_hold_is_refused_naming_the_keys(extra, message):
    from triton_offload.connector.tiering_config import TritonTieringConfig

    with pytest.raises(ValueError, match=message):
        TritonTieringConfig.from_extra_config({"cpu_bytes_to_use": BUDGET, **FP8, **extra})


def test_a_layout_the_format_cannot_read_is_refused_before_the_region():
    """The spec reads the pages as TritonOffloadingSpec does (connector/typed_pages.py): a layout whose K and V halves
    are not described stops it, naming the key, before vLLM sizes anything."""
    kv = _kv()
    extra = {"spec_name": plugin.TIERING_SPEC_NAME, "cpu_bytes_to_use": BUDGET, "block_size": F * BLOCK_TOKENS, **FP8}
    cfg = vllm_config(extra)
    cfg.cache_config.kv_cache_layout = "LBNHC"
    config = offloading_connector.build_offloading_config(cfg, kv.config)
    with pytest.raises(ValueError, match=r"host_format = 'fp8_e4m3': kv_cache_layout 'LBNHC' on the CPU platform"):
        OffloadingSpecFactory.create_spec(config)
