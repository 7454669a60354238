"""The per-block checksum of the integrity checks (docs/integrity.md): its definition in plain NumPy
(:func:`block_checksums`, whose docstring states it: the reference the fused kernel is tested against, byte for byte),
its constants (shared with the kernel), the per-host-row marker, the block identities derived from vLLM's keys, and the
``integrity`` setting. NumPy and the standard library only: the scheduler process imports it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# The setting lives with the other stdlib-only checks: the scheduler's configuration parser reads it without NumPy.
from triton_offload._checks import INTEGRITY_SETTINGS, OFF, REQUIRE, VERIFY, integrity_setting

__all__ = [
    "VERSION",
    "INTEGRITY_SETTINGS",
    "OFF",
    "VERIFY",
    "REQUIRE",
    "integrity_setting",
    "marker",
    "parse_marker",
    "key_identity",
    "identities_of_keys",
    "slot_identity",
    "lane_sums",
    "finalize",
    "block_checksums",
    "OK",
    "FAILED",
    "ABSENT",
]

VERSION = 1

# Per-block status a load reports (the kernel writes it, JobResult carries the failed ones).
OK, FAILED, ABSENT = 0, 1, 2

# The kernel's constants (kernels/copy_blocks.py reads them from here).
POS_A = 0x9E3779B1
POS_B_MUL = 0xCC9E2D51
POS_B_ADD = 0x1B873593
FMIX_A = (0x85EBCA6B, 0xC2B2AE35)  # MurmurHash3's fmix32: shifts 16, 13, 16
FMIX_B = (0x7FEB352D, 0x846CA68B)  # "lowbias32" (C. Wellons): shifts 16, 15, 16
SUB_MUL = 0x9E3779B97F4A7C15
LEN_MUL = 0xC2B2AE3D27D4EB4F
MIX64 = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # SplitMix64's finaliser: shifts 30, 27, 31

# A row marker: magic in the top 32 bits, then the version, f and the word size. Zero (a fresh table) is "absent".
_MAGIC = 0x544F434B  # "TOCK"
_U32 = np.uint64(0xFFFFFFFF)


def _salt(words: int) -> np.ndarray:
    """(j + 1) * SUB_MUL mod 2**64 for a key's words j < ``words``."""
    return np.array([((j + 1) * SUB_MUL) & ((1 << 64) - 1) for j in range(words)], dtype=np.uint64)


_WORD_SALT = _salt(64)


def marker(blocks_per_host_block: int, word_bytes: int) -> int:
    """The value a store writes at the head of a host row's checksums (as a signed int64): version 1, its f and the
    word size. A row whose head holds anything else has no checksum a load can check (absent)."""
    if not 1 <= blocks_per_host_block < 1 << 16:
        raise ValueError(f"blocks_per_host_block = {blocks_per_host_block} is out of range [1, 65536) for the marker")
    if word_bytes not in (1, 2, 4):
        raise ValueError(f"word_bytes = {word_bytes}, expected 1, 2 or 4")
    value = (_MAGIC << 32) | (VERSION << 24) | (blocks_per_host_block << 8) | word_bytes
    return value - (1 << 64) if value >= 1 << 63 else value


def parse_marker(value: int) -> dict | None:
    """The fields of a row marker, or None where ``value`` is not one (absent)."""
    value &= (1 << 64) - 1
    if value >> 32 != _MAGIC:
        return None
    return {"version": (value >> 24) & 0xFF, "blocks_per_host_block": (value >> 8) & 0xFFFF, "word": value & 0xFF}


def identities_of_keys(keys: Sequence[bytes]) -> np.ndarray:
    """A 64-bit identity (int64) per key, such as vLLM's ``OffloadKey`` (block hash plus group index): the XOR of
    ``mix64(w_j + (j + 1) * SUB_MUL)`` over the key's little-endian 8-byte words ``w_j`` (the last zero-padded) and
    of ``mix64(len(key))``. Every byte counts, in its place, keys from any hash function give well-spread identities,
    identical in every process and on every machine. Vectorised over the keys (the scheduler computes them per call:
    about 15 us whatever the count)."""
    keys = list(keys)
    lengths = set(map(len, keys))
    if len(lengths) > 1:  # keys of several lengths: each length on its own
        out = np.empty(len(keys), dtype=np.int64)
        for length in lengths:
            where = [i for i, k in enumerate(keys) if len(k) == length]
            out[where] = identities_of_keys([keys[i] for i in where])
        return out
    length = lengths.pop() if keys else 0
    width = max(8, -(-length // 8) * 8)
    raw = np.zeros((len(keys), width), dtype=np.uint8)
    if keys and length:
        raw[:, :length] = np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), length)
    with np.errstate(over="ignore"):
        salt = _WORD_SALT if width <= 8 * _WORD_SALT.size else _salt(width // 8)
        words = raw.view("<u8") + salt[: width // 8]
        z = np.bitwise_xor.reduce(_mix64(words), axis=1) ^ _mix64(np.uint64(length))
    return z.view(np.int64)


def key_identity(key: bytes) -> int:
    """:func:`identities_of_keys` of one key, as an int."""
    return int(identities_of_keys([key])[0])


def slot_identity(identities: np.ndarray, slot: int) -> np.ndarray:
    """Identities of one worker's slot of a chunk row (vLLM's tiering: one slot per rank): each chunk's identity
    mixed with the slot index, so a slot's bytes and checksums copied into another rank's slot fail too."""
    if slot == 0:
        return identities
    with np.errstate(over="ignore"):
        return (identities.view(np.uint64) ^ _mix64(np.uint64(slot) * np.uint64(SUB_MUL))).view(np.int64)


# ---------------------------------------------------------------------------------------------------------------
# The reference (NumPy): what the kernel computes, written for clarity
# ---------------------------------------------------------------------------------------------------------------


def _fmix32(x: np.ndarray, mul: tuple[int, int], shifts: tuple[int, int, int]) -> np.ndarray:
    x = x ^ (x >> np.uint32(shifts[0]))
    x = x * np.uint32(mul[0])
    x = x ^ (x >> np.uint32(shifts[1]))
    x = x * np.uint32(mul[1])
    return x ^ (x >> np.uint32(shifts[2]))


def _mix64(z):
    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(MIX64[0])
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(MIX64[1])
    return z ^ (z >> np.uint64(31))


def _words(blocks: np.ndarray, word_bytes: int) -> np.ndarray:
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
    if blocks.ndim != 2 or blocks.shape[1] % word_bytes:
        raise ValueError(f"blocks must be (n, bytes) with bytes a multiple of {word_bytes}, got {blocks.shape}")
    dtype = {1: "<u1", 2: "<u2", 4: "<u4"}[word_bytes]
    return blocks.view(dtype).astype(np.uint32)


def lane_sums(blocks: np.ndarray, word_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The two 32-bit lane sums of each block's word stream: ``blocks`` is (n, bytes) uint8, each row one block's
    moved bytes in stream order. Returns (lane_a, lane_b), uint32 arrays of n."""
    with np.errstate(over="ignore"):
        w = _words(blocks, word_bytes)
        i = np.arange(w.shape[1], dtype=np.uint32)[None, :]
        a = _fmix32(w ^ (i * np.uint32(POS_A)), FMIX_A, (16, 13, 16))
        b = _fmix32(w ^ (i * np.uint32(POS_B_MUL) + np.uint32(POS_B_ADD)), FMIX_B, (16, 15, 16))
        return a.sum(axis=1, dtype=np.uint32), b.sum(axis=1, dtype=np.uint32)


def finalize(lane_a, lane_b, identities, subs, num_words) -> np.ndarray:
    """Checksums (int64) from lane sums, identities (int64), sub-block indices and words per block (arrays or
    scalars, broadcast)."""
    with np.errstate(over="ignore"):
        ident = np.asarray(identities, dtype=np.int64).view(np.uint64)
        sub = np.asarray(subs, dtype=np.uint64)
        n = np.asarray(num_words, dtype=np.uint64)
        h = _mix64(ident ^ _mix64((sub * np.uint64(SUB_MUL)) ^ (n * np.uint64(LEN_MUL))))
        lanes = (np.asarray(lane_b, dtype=np.uint64) << np.uint64(32)) | (np.asarray(lane_a, dtype=np.uint64) & _U32)
        return np.asarray(_mix64(h ^ lanes), dtype=np.uint64).view(np.int64)


def block_checksums(blocks: np.ndarray, word_bytes: int, identities, subs) -> np.ndarray:
    """The checksum of each block: ``blocks`` (n, bytes) uint8 in stream order, its identity and sub-block index
    (arrays of n, or scalars).

    Definition (version 1). A GPU block's *word stream* is the bytes the transfer moves for it (its KV-cache group's
    segments in order, K before V, exactly what the packed host format lays side by side), read as ``W``-byte
    little-endian unsigned words, ``W`` the kernel's element size (1, 2 or 4; the row marker records it). Word ``i``
    (position ``i`` in the stream, ``N`` words in all) contributes to two 32-bit lanes::

        a_i = fmix_a(w_i ^ (i * 0x9E3779B1))        b_i = fmix_b(w_i ^ (i * 0xCC9E2D51 + 0x1B873593))

    (all mod 2**32), two different bijective mixers, so changing any single word always changes both terms. The lanes
    are plain sums mod 2**32: associative and commutative, so partial sums of any tiles and programs combine to the same
    value (integer atomics), under Triton's interpreter and on a GPU alike. The block's checksum mixes the lanes with
    its identity (a 64-bit value naming the block: the key's hash), its sub-block index in the host block and ``N``::

        h = mix64(identity ^ mix64(sub * 0x9E3779B97F4A7C15 ^ N * 0xC2B2AE3D27D4EB4F))
        checksum = mix64(h ^ (lane_b << 32 | lane_a))

    ``mix64`` is SplitMix64's finaliser (a bijection). Not cryptographic: see docs/integrity.md for what it detects.
    """
    a, b = lane_sums(blocks, word_bytes)
    return finalize(a, b, identities, subs, blocks.shape[1] // word_bytes)
