"""Where a store job's GPU blocks sit in their request, with vLLM's own scheduler (``Scheduler`` with the
``OffloadingConnector`` and our spec, no engine; vLLM 0.33's, and 0.32's where installed): the review's open question
4.3.

A store spec lists, per KV-cache group, only the non-null GPU blocks it stores, and one ``block_indices[g]`` (the
first one's position). Our worker, like vLLM's own (``compute_sub_block_ptrs`` with a skip), places the group's
blocks *contiguously* from that position. A job whose group skips a block between two stored ones (a Mamba group
whose only non-null block is the last of each chunk, two chunks in one job, at f > 1) would put the second chunk's
block in the wrong sub-block, and a later load of that key would read stale bytes.

So every store job vLLM's scheduler emits is checked against the request's block table at the time: each block must
land where the worker puts it (a job may skip whole chunks: its keys name only the chunks it stores). With a Mamba
group (align mode, the only mode prefix caching allows) at f = 2 beside full attention, and sliding-window groups
(one with a window shorter than a chunk), in chunked and whole prefills, sparse, periodic and dense retention, and a
second request hitting the first's prefix. vLLM 0.33
stores a Mamba group only through its boundary hand-offs, one block per job, never through the chunk walk that skips
null blocks; a sliding-window group's job may skip whole chunks (periodic retention), which both workers place
right. vLLM 0.32's scheduler gives the same jobs here.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.base", reason="needs vLLM >= 0.32 (pip install 'triton-offload[vllm]')")
sched_mod = pytest.importorskip("vllm.v1.core.sched.scheduler")
if not hasattr(sched_mod.Scheduler, "_mamba_block_aligned_split"):
    pytest.skip("needs a vLLM scheduler with Mamba align-mode prefix caching", allow_module_level=True)

from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ObservabilityConfig, ParallelConfig, SchedulerConfig  # noqa: E402
from vllm.config.ec_manager_config import EncoderCacheManagerConfig  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm_hybrid import BLOCK_TOKENS, full, mamba, sliding  # noqa: E402

import triton_offload.connector as plugin  # noqa: E402

pytestmark = pytest.mark.vllm
plugin.register()
init_none_hash(sha256)
F = 2
NUM_BLOCKS = 256


def _scheduler(specs, *, batched: int, retention_interval):
    """vLLM 0.33's ``Scheduler`` over KV-cache groups of ``specs`` (2 layers each, overlaid), with our spec at
    f = 2; the engine's other configs reduced to the fields the scheduler reads."""
    page = max(s.page_size_bytes for s in specs)
    tensors, groups = [], []
    for gi, spec in enumerate(specs):
        names = [f"g{gi}l0", f"g{gi}l1"]
        tensors.append(KVCacheTensor(2 * NUM_BLOCKS * page, names, NUM_BLOCKS * page, page))
        groups.append(KVCacheGroupSpec(names, spec))
    kv = KVCacheConfig(NUM_BLOCKS, tensors, groups)
    cache = CacheConfig(block_size=BLOCK_TOKENS, enable_prefix_caching=True, mamba_cache_mode="align")
    cache.num_gpu_blocks = NUM_BLOCKS
    cache.prefix_cache_retention_interval = retention_interval
    extra = {"spec_name": plugin.SPEC_NAME, "cpu_bytes_to_use": 1 << 24, "block_size": F * BLOCK_TOKENS}
    model = SimpleNamespace(
        is_diffusion=False,
        supports_multimodal_inputs=False,
        uses_mrope=False,
        is_encoder_decoder=False,
        max_model_len=1024,
        use_mla=False,
        get_total_num_kv_heads=lambda: 2,
        model="tiny",
        dtype=torch.float16,
        runner_type="generate",
        is_hybrid=True,
        return_sampling_mask=False,
    )
    config = SimpleNamespace(
        model_config=model,
        cache_config=cache,
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=batched, max_num_seqs=4, max_model_len=1024, is_encoder_decoder=False
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", engine_id="sparse", kv_connector_extra_config=extra
        ),
        parallel_config=ParallelConfig(),
        observability_config=ObservabilityConfig(),
        ec_manager_config=EncoderCacheManagerConfig(),
        aux_output_config=SimpleNamespace(enabled=False),
        lora_config=None,
        kv_events_config=None,
        speculative_config=None,
        structured_outputs_config=None,
        ec_transfer_config=None,
        use_v2_model_runner=False,
        is_mm_encoder_only=False,
        max_concurrent_batches=1,
        num_speculative_tokens=0,
        num_lookahead_tokens=0,
        num_prefill_lookahead_tokens=0,
        num_hash_lookahead_tokens=0,
        max_in_flight_tokens=None,
    )
    outputs = SimpleNamespace(accept_tokens=lambda *a, **k: True, should_advance=lambda *a, **k: False)
    return sched_mod.Scheduler(config, kv, structured_output_manager=outputs, block_size=BLOCK_TOKENS)


def _serve(scheduler, prompts: dict[str, list[int]], max_steps: int = 200) -> list[tuple]:
    """Runs the requests to their end (one sampled token each once its prompt is computed, 3 in all); returns every
    store job with the block tables of its request when it was built: (job id, spec, tables)."""
    hasher = get_request_block_hasher(BLOCK_TOKENS, sha256)
    for rid, tokens in prompts.items():
        scheduler.add_request(Request(rid, tokens, SamplingParams(max_tokens=3), None, block_hasher=hasher))
    tables: dict[str, tuple[list[int], ...]] = {}
    jobs = []
    for _ in range(max_steps):
        out = scheduler.schedule()
        for rid in out.num_scheduled_tokens:
            tables[rid] = tuple(list(ids) for ids in scheduler.kv_cache_manager.get_block_ids(rid))
        for job_id, job in (out.kv_connector_metadata.store_jobs or {}).items():
            jobs.append((job_id, job.src_spec, tables[job.req_id]))
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = scheduler.requests[rid]
            sampled.append([7] if req.num_computed_tokens >= req.num_prompt_tokens else [])
        runner = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
        )
        scheduler.update_from_output(out, runner)
        if not scheduler.requests and not ids:
            break
    return jobs


def _placements(jobs):
    """Per store job and group: where each of its GPU blocks belongs, and where the worker puts it, as (index of
    its key among the group's keys in the job, sub-block) pairs. It belongs to the chunk of its position in the
    request's table (keys are listed chunk by chunk, one per chunk the job stores), at the sub-block of its position
    in that chunk; the worker puts block i at position ``block_indices[g] % f + i`` of the group's host blocks."""
    for job_id, spec, tables in jobs:
        ids, start = list(spec.block_ids), 0
        for g, (n, first) in enumerate(zip(spec.group_sizes, spec.block_indices)):
            blocks = ids[start : start + n]
            start += n
            if not n:
                continue
            at = [tables[g].index(b) for b in blocks]
            chunks = list(dict.fromkeys(p // F for p in at))
            belongs = [(chunks.index(p // F), p % F) for p in at]
            placed = [((first % F + i) // F, (first % F + i) % F) for i in range(n)]
            yield job_id, g, at, belongs, placed


SCENARIOS = {
    "mamba-f2-chunked": ((full(), mamba()), 64, 0, {"a": list(range(3, 203))}),
    "mamba-f2-whole-prompt": ((full(), mamba()), 512, 0, {"a": list(range(3, 203))}),
    "mamba-f2-dense-retention": ((full(), mamba()), 64, None, {"a": list(range(3, 203))}),
    "mamba-f2-shared-prefix": (
        (full(), mamba()),
        96,
        0,
        {"a": list(range(3, 203)), "b": list(range(3, 163)) + [9] * 40},
    ),
    "sw-f2": ((full(), sliding()), 64, 0, {"a": list(range(3, 203))}),
    # A window of one block in chunks of two: only the last block of a chunk is reachable.
    "sw-f2-short-window": ((full(), sliding(window=BLOCK_TOKENS)), 64, 0, {"a": list(range(3, 203))}),
    "sw-f2-short-window-interval": ((full(), sliding(window=BLOCK_TOKENS)), 512, 64, {"a": list(range(3, 203))}),
    "sw-f2-short-window-dense": ((full(), sliding(window=BLOCK_TOKENS)), 512, None, {"a": list(range(3, 203))}),
    "sw-f2-dense-retention": ((full(), sliding()), 512, None, {"a": list(range(3, 203)), "b": list(range(3, 123))}),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_stored_block_lands_where_it_belongs(name):
    specs, batched, retention, prompts = SCENARIOS[name]
    jobs = _serve(_scheduler(specs, batched=batched, retention_interval=retention), prompts)
    placements = list(_placements(jobs))
    assert any(g == 1 for _, g, *_ in placements), "the sparse group stored nothing: the scenario tests nothing"
    wrong = [(job, g, at, belongs, placed) for job, g, at, belongs, placed in placements if belongs != placed]
    assert not wrong, f"blocks the worker would misplace (job, group, positions, (key, sub) wanted, placed): {wrong}"


def test_the_check_sees_the_reviews_case():
    """The check itself, on the job the review describes (a Mamba group whose only stored block is the last of each
    of two chunks, f = 2): the second block belongs to sub-block 1 of the second key, the worker puts it at 0."""
    spec = SimpleNamespace(block_ids=[21, 23], group_sizes=[2], block_indices=[1])
    tables = ([0, 21, 0, 23],)
    ((_, _, at, belongs, placed),) = _placements([(0, spec, tables)])
    assert at == [1, 3] and belongs == [(0, 1), (1, 1)] and placed == [(0, 1), (1, 0)]


def test_a_mamba_group_at_f2_stores_one_boundary_block_per_job():
    """The Mamba group's keys come from vLLM's boundary hand-offs: one block per job, the last of its chunk (skip
    f - 1), never two chunks of it in one job."""
    specs, batched, retention, prompts = SCENARIOS["mamba-f2-chunked"]
    jobs = _serve(_scheduler(specs, batched=batched, retention_interval=retention), prompts)
    mamba_jobs = [spec for _, spec, _ in jobs if spec.group_sizes[1]]
    assert mamba_jobs
    for spec in mamba_jobs:
        assert list(spec.group_sizes) == [0, 1] and spec.block_indices[1] % F == F - 1


def test_a_job_may_skip_whole_chunks_and_is_placed_right():
    """Periodic retention with a window shorter than a chunk: one job stores chunks 1, 3 and 5 of the sliding-window
    group (both blocks each) and skips 0, 2 and 4. Its keys name only the stored chunks, so consecutive placement from
    block_indices puts every block right, in our worker and in vLLM's (which also takes sub-blocks [skip, skip + n)
    of the host blocks the job names)."""
    specs, batched, retention, prompts = SCENARIOS["sw-f2-short-window-interval"]
    jobs = _serve(_scheduler(specs, batched=batched, retention_interval=retention), prompts)
    skipping = [
        (at, placed)
        for _, g, at, belongs, placed in _placements(jobs)
        if g == 1 and at != list(range(at[0], at[0] + len(at)))
    ]
    assert skipping == [([2, 3, 6, 7, 10, 11], [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)])]
