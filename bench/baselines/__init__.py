"""The one registry of the methods both benchmarks compare, by exact name (:data:`METHODS`): a name is one way of
moving KV blocks everywhere, in the transfer benchmark's form (``prepare(case, env, num_ctas) -> Prepared``: one
transfer, issued on the current stream) and in the serving benchmark's (``engine(target, num_ctas)``: TransferEngine's
worker API), where it has one. Each is the library itself or an adapter over its seams, never a copy of its logic:
``triton`` and ``auto`` are the public calls and ``TransferEngine``, ``triton_fp8`` that engine over the FP8 host
format (serving loop only; bench/micro/fp8.py measures the transfers), ``triton_integrity`` the kernel with the
integrity checks (run on request: ``--integrity``); ``memcpy_batch`` is the library's copy-engine
issuer uncoalesced; ``vllm033`` and ``vllm_native`` are issuers tracked by the library's job tracker
(:mod:`bench.baselines.tracked`), over the library's descriptors for ``vllm033``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bench.baselines import copies, ours, torch_copy, vllm033, vllm_native

__all__ = ["Method", "METHODS", "SERVING_METHODS"]


@dataclass(frozen=True)
class Method:
    """One way of moving KV blocks.

    Attributes:
        describe: what it is, for the serving benchmark's methods table and rows.
        prepare: the transfer benchmark's form, ``(case, env, num_ctas) -> Prepared``; None where only the serving
            loop runs it.
        engine: the serving benchmark's form, ``(target, num_ctas) -> engine`` with TransferEngine's worker API (an
            engine of None: no offload traffic); None where the serving loop does not run it.
        sweeps_ctas: runs at the kernel's default num_ctas and at each other num_ctas asked for.
        host_format: what its host rows hold: the serving loop gives a method of ``"fp8_e4m3"`` a target of its own
            (:mod:`bench.serving.fp8`).
    """

    describe: str
    prepare: Callable | None = None
    engine: Callable | None = None
    sweeps_ctas: bool = False
    host_format: str = "native"


METHODS: dict[str, Method] = {
    "none": Method("no offload traffic: the model's steps alone", engine=lambda target, _: None),
    "triton": Method(
        "TransferEngine(path='kernel'): one Triton launch per transfer on its store / load stream",
        ours.prepare_triton,
        lambda target, num_ctas: ours.triton_engine(target, num_ctas, path="kernel"),
        sweeps_ctas=True,
    ),
    "triton_size_aware": Method(
        "the same kernel with launch_shape='size-aware': programs chosen from the caches' page runs (16 below 4 KiB, "
        "8 below 8 KiB, else the default 4; never above num_ctas); the probe of whether it should be the default",
        ours.prepare_triton_size_aware,
        ours.triton_size_aware_engine,
    ),
    "triton_integrity": Method(
        "TransferEngine(path='kernel') with 'verify' Checksums: triton with the integrity checks fused into its "
        "launches (a checksum per block, written by stores, checked by loads; docs/integrity.md)",
        ours.prepare_triton_integrity,
        ours.triton_integrity_engine,
    ),
    "triton_fp8": Method(
        "TransferEngine(path='kernel') over a spec with host_format='fp8_e4m3': the same kernel launches storing FP8 "
        "values and per-head scales (about half the bytes) into a host cache of FP8 rows, restoring bf16 on load; "
        "checked against the reference quantization (bench/serving/fp8.py)",
        engine=lambda target, num_ctas: ours.triton_engine(target, num_ctas, path="kernel"),
        host_format="fp8_e4m3",
    ),
    "auto": Method(
        "TransferEngine(path='auto'), the default on CUDA: per transfer the faster of our kernel and one "
        "cuMemcpyBatchAsync of coalesced descriptors, from the calibration the engine makes at creation",
        ours.prepare_auto,
        ours.auto_engine,
    ),
    "memcpy_per_block": Method(
        "the original design: one cudaMemcpyAsync per block per run, from a C++ loop", copies.prepare_per_block
    ),
    "memcpy_batch": Method(
        "cuMemcpyBatchAsync both ways (PREFER_OVERLAP_WITH_COMPUTE), one descriptor per block and run: the library's "
        "copy-engine path uncoalesced; descriptors built per call from the block ids",
        copies.prepare_batch,
        copies.batch_engine,
    ),
    "torch_staged": Method("index_select / index_copy_ per run + one copy_", torch_copy.prepare_staged),
    "vllm033": Method(
        "vLLM 0.33's policy: stores one cuMemcpyBatchAsync (source order STREAM); loads of pages < 28 KiB its SM "
        "copy (12 programs), others one cuMemcpyBatchAsync (source order ANY); descriptors built per call from the "
        "block ids",
        vllm033.prepare,
        vllm033.engine,
    ),
    "vllm_native": Method(
        "vLLM 0.33's own CPUOffloadingWorker (bench/baselines/vllm_native.py), its swap_blocks_batch op the same "
        "cuMemcpyBatchAsync through ctypes; n/a where vLLM 0.33's code is not importable (./dev gpu-bundle)",
        vllm_native.prepare,
        vllm_native.engine,
    ),
    "peak": Method(
        "one contiguous pinned copy_ of the same bytes: the link's practical ceiling", torch_copy.prepare_peak
    ),
}
# The names the serving loop runs.
SERVING_METHODS = tuple(name for name, m in METHODS.items() if m.engine is not None)
