"""How often the integrity checksum's two 32-bit lanes miss a change spread over several groups (docs/integrity.md,
"What it detects"), for the definition in force and candidate ones, measured rather than argued: per pattern (sign
bits, low bits, random words, in two or four groups of random content at random positions) it draws ``--blocks``
changed blocks and counts those whose lane sums both stay the same (the checksum then stays the same: the finaliser
is a bijection of the lanes), and each lane's misses alone. Only the changed groups' terms are computed: the others
add the same to both sums. NumPy only; ``python -m bench.micro.integrity_lanes [--blocks N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

from triton_offload import integrity

_U32 = np.uint64(0xFFFFFFFF)
_P, _A, _B = np.uint64(integrity.POS_MUL), np.uint64(integrity.LANE_A), np.uint64(integrity.LANE_B)
GROUPS_PER_BLOCK = 4096  # a 64 KiB block of 16-byte groups: the positions drawn


def _xs16(x):
    return x ^ (x >> np.uint64(16))


def _fold(words: np.ndarray) -> np.ndarray:
    """sum_v GROUP_MUL[v] * w_v mod 2**64 over the last axis (uint64 words below 2**32)."""
    mul = np.array(integrity.GROUP_MUL[: words.shape[-1]], dtype=np.uint64)
    with np.errstate(over="ignore"):
        return (words * mul).sum(axis=-1, dtype=np.uint64)


def terms_v2(words, j):
    """Version 2: t = j * P + fold (64 bits); a = xs16(lo) * A, b = xs16(lo ^ hi) * B."""
    with np.errstate(over="ignore"):
        t = _fold(words) + j * _P
        lo, hi = t & _U32, t >> np.uint64(32)
        return (_xs16(lo) * _A) & _U32, (_xs16(lo ^ hi) * _B) & _U32


def terms_lo_xs16(words, j):
    """Candidate: the index enters the low half only, lo = fold + j * P mod 2**32, hi = fold >> 32; one xor-shift per
    group, z = xs16(lo); a = z * A, b = (z ^ hi) * B."""
    with np.errstate(over="ignore"):
        t = _fold(words)
        lo, hi = (t + j * _P) & _U32, t >> np.uint64(32)
        z = _xs16(lo)
        return (z * _A) & _U32, ((z ^ hi) * _B) & _U32


def terms_lo_2xs16(words, j):
    """Candidate: as :func:`terms_lo_xs16` but b = xs16(lo ^ hi) * B (a second xor-shift, as version 2)."""
    with np.errstate(over="ignore"):
        t = _fold(words)
        lo, hi = (t + j * _P) & _U32, t >> np.uint64(32)
        return (_xs16(lo) * _A) & _U32, (_xs16(lo ^ hi) * _B) & _U32


def terms_hi_top(words, j):
    """Candidate: as :func:`terms_lo_xs16`, but the shared step takes the high half's top bits into the low half's,
    z = lo ^ (hi >> 16) (the same cost as xs16(lo)); a = z * A, b = (z ^ hi) * B."""
    with np.errstate(over="ignore"):
        t = _fold(words)
        lo, hi = (t + j * _P) & _U32, t >> np.uint64(32)
        z = lo ^ (hi >> np.uint64(16))
        return (z * _A) & _U32, ((z ^ hi) * _B) & _U32


def terms_v3(words, j):
    """Version 3, the one in force: the reference's own terms (:func:`triton_offload.integrity.lane_terms`), as
    :func:`terms_lo_xs16` but the shared shift a funnel shift taking the high half's low bits into the low half's top
    ones (the same cost): z = lo ^ ((hi:lo) >> 16 mod 2**32); a = z * A, b = (z ^ hi) * B."""
    return integrity.lane_terms(words, j)


# Version 2, version 3 (in force) and the candidates measured against them (docs/integrity.md).
DEFINITIONS = {
    "v2": terms_v2,
    "v3": terms_v3,
    "lo+xs16": terms_lo_xs16,
    "lo+2xs16": terms_lo_2xs16,
    "hi-top": terms_hi_top,
}


def _flip(bit: int, same_word: bool):
    """A change flipping ``bit`` of one word per group (the same word of each group, or a random one each)."""

    def change(words, rng):
        n, k, g = words.shape
        v = rng.integers(0, g, size=(n, 1)) if same_word else rng.integers(0, g, size=(n, k))
        out = words.copy()
        np.put_along_axis(out, np.broadcast_to(v, (n, k))[..., None],
                          np.take_along_axis(words, np.broadcast_to(v, (n, k))[..., None], 2) ^ np.uint64(1 << bit),
                          2)  # fmt: skip
        return out

    return change


def _two_sign_bits_each(words, rng):
    """Bit 31 of two different words in each group (four sign bits in two groups)."""
    n, k, g = words.shape
    out = words.copy()
    first = rng.integers(0, g, size=(n, k))
    second = (first + rng.integers(1, g, size=(n, k))) % g
    for v in (first, second):
        cur = np.take_along_axis(out, v[..., None], 2)
        np.put_along_axis(out, v[..., None], cur ^ np.uint64(1 << 31), 2)
    return out


def _all_sign_bits(words, rng):
    """Bit 31 of every word of the group (four sign bits in one group: certain, a change of one group)."""
    return words ^ np.uint64(1 << 31)


def _random_word(words, rng):
    """One word per group replaced by a random one (a word of garbage in each)."""
    n, k, g = words.shape
    v = rng.integers(0, g, size=(n, k, 1))
    out = words.copy()
    np.put_along_axis(out, v, rng.integers(0, 1 << 32, size=(n, k, 1), dtype=np.uint64), 2)
    return out


# (name, groups changed, words per group, word bits, change)
PATTERNS = (
    ("sign bit, same word, 2 groups", 2, 4, 32, _flip(31, True)),
    ("sign bit, any word, 2 groups", 2, 4, 32, _flip(31, False)),
    ("bf16 sign bit (15), same word, 2 groups", 2, 4, 32, _flip(15, True)),
    ("bit 0, same word, 2 groups", 2, 4, 32, _flip(0, True)),
    ("bit 16, same word, 2 groups", 2, 4, 32, _flip(16, True)),
    ("sign bit, same word, 4 groups", 4, 4, 32, _flip(31, True)),
    ("sign bit, any word, 4 groups", 4, 4, 32, _flip(31, False)),
    ("4 sign bits of 1 group", 1, 4, 32, _all_sign_bits),
    ("2 sign bits in each of 2 groups", 2, 4, 32, _two_sign_bits_each),
    ("a random word in each of 2 groups", 2, 4, 32, _random_word),
    ("G=1 W=4: sign bit, 2 groups", 2, 1, 32, _flip(31, True)),
    ("G=1 W=1 (FP8): sign bit (7), 2 groups", 2, 1, 8, _flip(7, True)),
    ("G=1 W=1 (FP8): sign bit (7), 4 groups", 4, 1, 8, _flip(7, True)),
)


def misses(terms, n: int, groups: int, g: int, bits: int, change, seed: int) -> dict:
    """Blocks (of ``n``) whose change both lanes miss, and each lane's misses alone."""
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 1 << bits, size=(n, groups, g), dtype=np.uint64)
    j = _distinct_positions(rng, n, groups)
    changed = change(words, rng)
    a0, b0 = terms(words, j)
    a1, b1 = terms(changed, j)
    with np.errstate(over="ignore"):
        da = ((a1 - a0) & _U32).sum(axis=1, dtype=np.uint64) & _U32
        db = ((b1 - b0) & _U32).sum(axis=1, dtype=np.uint64) & _U32
    return {"both": int(((da == 0) & (db == 0)).sum()), "lane_a": int((da == 0).sum()), "lane_b": int((db == 0).sum())}


def _distinct_positions(rng, n: int, k: int) -> np.ndarray:
    """(n, k) distinct group positions in [0, GROUPS_PER_BLOCK) per row (redrawn where two collide)."""
    j = rng.integers(0, GROUPS_PER_BLOCK, size=(n, k))
    while True:
        s = np.sort(j, axis=1)
        bad = (np.diff(s, axis=1) == 0).any(axis=1)
        if not bad.any():
            return j.astype(np.uint64)
        j[bad] = rng.integers(0, GROUPS_PER_BLOCK, size=(int(bad.sum()), k))


def run(blocks: int, names=tuple(DEFINITIONS), only: str = "", chunk: int = 250_000) -> list[dict]:
    rows = []
    for name in names:
        for p, (what, groups, g, bits, change) in enumerate(PATTERNS):
            if only not in what:
                continue
            total = {"both": 0, "lane_a": 0, "lane_b": 0}
            for c in range(0, blocks, chunk):
                got = misses(DEFINITIONS[name], min(chunk, blocks - c), groups, g, bits, change, seed=1000 * p + c)
                total = {k: total[k] + got[k] for k in total}
            rows.append({"definition": name, "pattern": what, "blocks": blocks, **total})
            print(f"{name:<4} {what:<42} missed {total['both']:>7}   lane a alone {total['lane_a']:>7}   "
                  f"lane b alone {total['lane_b']:>7}", flush=True)  # fmt: skip
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.micro.integrity_lanes", description=__doc__)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--definitions", nargs="+", default=list(DEFINITIONS), choices=list(DEFINITIONS))
    ap.add_argument("--only", default="", help="only the patterns whose name holds this")
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args(argv)
    rows = run(args.blocks, args.definitions, args.only)
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "integrity-lanes", "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
