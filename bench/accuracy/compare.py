"""The accuracy harness's comparison of one configuration's outputs with the reference's, prompt by prompt: token
agreement, the first divergence, and a KL estimate over the top-k logprobs at the steps where both still share a
context (up to and including the first divergence; after it the contexts differ and nothing is compared)."""

from __future__ import annotations

import math
import statistics


def top_k_kl(ref: list, got: list) -> float:
    """KL(ref || got) over the reference's top-k tokens (``[token, logprob]`` pairs), both renormalised over them; a
    token missing from ``got``'s top-k is given ``got``'s smallest logprob there (an upper bound on its probability).
    0 where both top-ks agree exactly."""
    got_lp = dict((token, lp) for token, lp in got)
    floor = min(got_lp.values())
    p = [math.exp(lp) for _, lp in ref]
    q = [math.exp(got_lp.get(token, floor)) for token, _ in ref]
    sp, sq = sum(p), sum(q)
    return max(0.0, sum(pi / sp * math.log((pi / sp) / (qi / sq)) for pi, qi in zip(p, q) if pi > 0))


def prompt(ref: dict, got: dict) -> dict:
    """One prompt: how many tokens agree position by position, the first position that differs (None: none), and
    the KL estimate of each step compared."""
    n = len(ref["tokens"])
    same = [a == b for a, b in zip(ref["tokens"], got["tokens"])]
    first = next((i for i, s in enumerate(same) if not s), None)
    upto = n if first is None else first + 1
    kls = [top_k_kl(ref["top"][i], got["top"][i]) for i in range(upto)]
    return {"tokens": n, "agree": sum(same), "first_divergence": first, "kl": kls}


def compare(ref: list[dict], got: list[dict]) -> dict:
    """The summary over all prompts: token agreement (fraction of positions equal), the share of prompts whose tokens
    are all equal, the first divergences, the KL estimate (mean and largest step), and the cached prompt tokens of
    each side (the offloading side's host hits)."""
    assert len(ref) == len(got), (len(ref), len(got))
    per = [prompt(a, b) for a, b in zip(ref, got)]
    firsts = [p["first_divergence"] for p in per if p["first_divergence"] is not None]
    kls = [kl for p in per for kl in p["kl"]]
    return {
        "prompts": len(per),
        "tokens": sum(p["tokens"] for p in per),
        "token_agreement": sum(p["agree"] for p in per) / max(1, sum(p["tokens"] for p in per)),
        "prompts_identical": sum(p["agree"] == p["tokens"] for p in per) / max(1, len(per)),
        "diverged_prompts": len(firsts),
        "first_divergence_min": min(firsts, default=None),
        "first_divergence_median": statistics.median(firsts) if firsts else None,
        "kl_mean": statistics.fmean(kls) if kls else 0.0,
        "kl_max": max(kls, default=0.0),
        "cached_tokens": [sum(r["cached"] for r in ref), sum(r["cached"] for r in got)],
        "per_prompt": [{"agree": p["agree"], "first_divergence": p["first_divergence"]} for p in per],
    }
