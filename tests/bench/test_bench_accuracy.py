"""The accuracy harness's arithmetic and prompts without an engine (bench/accuracy; the engines run in
tests/e2e/test_accuracy_harness.py): the top-k KL estimate, agreement and first divergence on made-up outputs, the
configurations the command accepts, and the prompt set (lengths, distinct beginnings) with a word tokenizer."""

from __future__ import annotations

import math

import pytest

from bench.accuracy import compare
from bench.accuracy.__main__ import configuration
from bench.accuracy.texts import PASSAGES, prompt_set, text_ids

TOP = [[5, -0.1], [7, -2.5], [9, -4.0]]


def row(tokens, tops=None, cached=0):
    return {"tokens": tokens, "top": tops or [TOP] * len(tokens), "cached": cached}


def test_the_kl_estimate_is_zero_for_equal_top_ks_and_grows_with_the_change():
    assert compare.top_k_kl(TOP, TOP) == 0.0
    assert compare.top_k_kl(TOP, [[7, -0.1], [5, -2.5], [9, -4.0]]) > 1.0  # the two best swapped
    small = compare.top_k_kl(TOP, [[5, -0.1001], [7, -2.5], [9, -4.0]])
    assert 0 < small < 1e-4
    # A token missing from the other top-k counts at its smallest logprob there.
    missing = compare.top_k_kl(TOP, [[5, -0.1], [7, -2.5], [11, -4.5]])
    p = [math.exp(lp) for _, lp in TOP]
    q = [math.exp(-0.1), math.exp(-2.5), math.exp(-4.5)]
    want = sum(a / sum(p) * math.log((a / sum(p)) / (b / sum(q))) for a, b in zip(p, q))
    assert missing == pytest.approx(want)


def test_agreement_and_the_first_divergence():
    ref = [row([1, 2, 3, 4]), row([1, 2, 3, 4], cached=0)]
    got = [row([1, 2, 3, 4], cached=96), row([1, 2, 9, 9], [TOP, TOP, [[9, -0.2], [3, -1.0]], TOP], cached=64)]
    s = compare.compare(ref, got)
    assert (s["prompts"], s["tokens"], s["token_agreement"], s["prompts_identical"]) == (2, 8, 6 / 8, 0.5)
    assert (s["diverged_prompts"], s["first_divergence_min"], s["first_divergence_median"]) == (1, 2, 2)
    assert s["cached_tokens"] == [0, 160]
    # Steps compared: all 4 of the first prompt, the second's up to its divergence (3): KL only at the divergence.
    assert s["kl_max"] > 0 and s["kl_mean"] == pytest.approx(s["kl_max"] / 7)
    assert s["per_prompt"] == [{"agree": 4, "first_divergence": None}, {"agree": 2, "first_divergence": 2}]
    same = compare.compare(ref, ref)
    assert (same["token_agreement"], same["kl_max"], same["first_divergence_min"]) == (1.0, 0.0, None)


def test_configurations(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}'
    )
    assert configuration("off", str(tmp_path)) == ("off", None, {})
    name, extra, engine = configuration("offload", str(tmp_path))
    assert name == "offload" and extra["spec_name"] == "TritonOffloadingSpec" and extra["block_size"] == 32
    assert extra["cpu_bytes_to_use"] == 2 * 16 * 16 * 1440 * 1024 and engine == {}  # two batches, 16 prompts of 16
    name, extra, _ = configuration('p={"spec_name": "PerturbingSpec", "integrity": "off"}', str(tmp_path))
    assert (name, extra["spec_name"], extra["integrity"], extra["block_size"]) == ("p", "PerturbingSpec", "off", 32)
    # vLLM's own FP8 KV cache, no offloading: engine arguments only.
    assert configuration('v={"offload": false, "engine": {"kv_cache_dtype": "fp8"}}', str(tmp_path)) == (
        "v",
        None,
        {"kv_cache_dtype": "fp8"},
    )
    name, extra, engine = configuration('f={"host_format": "fp8_e4m3", "engine": {"seed": 1}}', str(tmp_path))
    assert (extra["host_format"], extra["block_size"], engine) == ("fp8_e4m3", 32, {"seed": 1})
    with pytest.raises(SystemExit, match="NAME=JSON"):
        configuration("offlaod", str(tmp_path))
    with pytest.raises(SystemExit, match='"offload": false takes no extra config'):
        configuration('v={"offload": false, "integrity": "off"}', str(tmp_path))
    with pytest.raises(SystemExit, match='"engine" takes an object'):
        configuration('v={"engine": "fp8"}', str(tmp_path))


class Words:
    """A tokenizer with one id per word (what prompt_set needs of a tokenizer)."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]}


def test_the_prompt_set_has_distinct_beginnings_and_a_few_hundred_tokens_each():
    prompts = prompt_set(Words(), 248)
    assert len({tuple(p[:32]) for p in prompts}) == 248
    assert min(map(len, prompts)) == 256 and max(map(len, prompts)) == 448
    with pytest.raises(AssertionError, match="at most 248"):
        prompt_set(Words(), 249)
    words = Words()
    ids = text_ids(words, 1, 200, prefix=[7, 7])
    assert len(ids) == 200 and ids[:2] == [7, 7] and ids[2:5] == words(" ".join(PASSAGES[1].split()[:3]))["input_ids"]
