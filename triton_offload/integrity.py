"""The per-block checksum of the integrity checks (docs/integrity.md): its definition in plain NumPy
(:func:`block_checksums`, whose docstring states it: the reference the fused kernel is tested against, byte for byte),
its constants (shared with the kernel), the per-host-row marker, the block identities derived from vLLM's keys, and the
``integrity`` setting. NumPy and the standard library only: the scheduler process imports it.
"""

from __future__ import annotations

import hashlib
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
    "digests_of_keys",
    "keep_digests",
    "CarriesIdentities",
    "slot_identity",
    "lane_sums",
    "lane_terms",
    "finalize",
    "block_checksums",
    "OK",
    "FAILED",
    "ABSENT",
]

VERSION = 3  # 3: the index joins the low half, one funnel shift per group (version 2 rows are absent)

# Per-block status a load reports (the kernel writes it, JobResult carries the failed ones).
OK, FAILED, ABSENT = 0, 1, 2

# The kernel's constants (kernels/copy_blocks.py writes them as literals; tests/unit/test_integrity.py checks both).
GROUP_MUL = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)  # one odd multiplier per word of a group
POS_MUL = 0x165667B1  # the group's index in the block's stream
LANE_A = 0x7FEB352D
LANE_B = 0x846CA68B
SUB_MUL = 0x9E3779B97F4A7C15
LEN_MUL = 0xC2B2AE3D27D4EB4F
MIX64 = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # SplitMix64's finaliser: shifts 30, 27, 31

# A row marker: magic in the top 32 bits, then the version, f and the word size. Zero (a fresh table) is "absent".
_MAGIC = 0x544F434B  # "TOCK"
_U32 = np.uint64(0xFFFFFFFF)


def marker(blocks_per_host_block: int, word_bytes: int, group_words: int = 1) -> int:
    """The value a store writes at the head of a host row's checksums (as a signed int64): the version, its f, the
    word size and the words per group (:func:`block_checksums`). A row whose head holds anything else has no checksum
    a load can check (absent)."""
    if not 1 <= blocks_per_host_block < 1 << 16:
        raise ValueError(f"blocks_per_host_block = {blocks_per_host_block} is out of range [1, 65536) for the marker")
    if word_bytes not in (1, 2, 4):
        raise ValueError(f"word_bytes = {word_bytes}, expected 1, 2 or 4")
    if group_words not in (1, 2, 4):
        raise ValueError(f"group_words = {group_words}, expected 1, 2 or 4")
    value = (_MAGIC << 32) | (VERSION << 24) | (blocks_per_host_block << 8) | (group_words << 4) | word_bytes
    return value - (1 << 64) if value >= 1 << 63 else value


def parse_marker(value: int) -> dict | None:
    """The fields of a row marker, or None where ``value`` is not one (absent)."""
    value &= (1 << 64) - 1
    if value >> 32 != _MAGIC:
        return None
    return {
        "version": (value >> 24) & 0xFF,
        "blocks_per_host_block": (value >> 8) & 0xFFFF,
        "group": (value >> 4) & 0xF,
        "word": value & 0xF,
    }


def identities_of_keys(keys: Sequence[bytes], person: bytes = b"") -> np.ndarray:
    """A 64-bit identity (int64) per key, such as vLLM's ``OffloadKey`` (block hash plus group index): the key's
    BLAKE2b digest of 8 bytes, little-endian, personalised with ``person`` (at most 16 bytes: the configuration
    fingerprint's, so that a block stored under another configuration fails its check; empty: none). Every byte counts,
    in its place, keys from any hash function give well-spread identities, identical in every process and on every
    machine. The array views :func:`digests_of_keys`."""
    return _frombuffer(digests_of_keys(keys, person), _INT64)


def digests_of_keys(keys: Sequence[bytes], person: bytes = b"") -> bytes:
    """The keys' identities (:func:`identities_of_keys`) as their digests, joined: 8 bytes per key. Each key hashes
    from a copy of one BLAKE2b state set up per ``person`` (its parameter block: no keyword parsing per key), a lone
    key without a list; docs/integrity.md gives the measured cost."""
    copy = (_HASHERS.get(person) or _hasher(person)).copy
    if len(keys) == 1:  # a decoding step's store: no comprehension, no join
        h = copy()
        h.update(keys[0])
        return h.digest()
    # (h := copy()).update(k) returns None: ``or`` goes on to the digest of the copy that took the key.
    return b"".join([(h := copy()).update(k) or h.digest() for k in keys])


def keep_digests(keys: Sequence[bytes], slots: Sequence[int], table: memoryview, person: bytes = b"") -> bytes:
    """:func:`digests_of_keys`, each digest also written at its slot of ``table`` (a writable byte view, 8 bytes per
    slot: a store keeps its keys' identities for the loads to read). Up to 8 keys in one loop (no NumPy), more with
    one NumPy ``put``: the faster of the two at each size, as measured."""
    if len(keys) > 8:
        digests = digests_of_keys(keys, person)
        _frombuffer(table, _INT64).put(slots, _frombuffer(digests, _INT64))
        return digests
    copy = (_HASHERS.get(person) or _hasher(person)).copy
    if len(keys) == 1:  # a decoding step's store: no list, no join
        h = copy()
        h.update(keys[0])
        table[slots[0] * 8 : slots[0] * 8 + 8] = digest = h.digest()
        return digest
    parts = []
    for key, slot in zip(keys, slots):
        h = copy()
        h.update(key)
        table[slot * 8 : slot * 8 + 8] = digest = h.digest()
        parts.append(digest)
    return b"".join(parts)


_INT64 = np.dtype("<i8")
_frombuffer = np.frombuffer
_HASHERS: dict[bytes, object] = {}  # person -> an empty BLAKE2b state with it, which digests_of_keys copies


def _hasher(person: bytes):
    if len(person) > 16:
        raise ValueError(f"person is {len(person)} bytes; BLAKE2b takes at most 16")
    hasher = hashlib.blake2b(digest_size=8, person=person)
    if len(_HASHERS) < 64:  # a process sees one or two fingerprints; the bound only guards against a caller's loop
        _HASHERS[bytes(person)] = hasher
    return hasher


class CarriesIdentities:
    """For a transfer spec that carries its host blocks' identities to the workers: they are kept as their digests
    (``identity_bytes``, :func:`digests_of_keys`: a bytes object pickles in a fraction of a microsecond, a NumPy
    array in several) and read as an int64 array (``identities``, a view; None without them). Setting
    ``identities`` takes the digests as they are, or any integers (one 64-bit value each)."""

    identity_bytes: bytes | None = None

    @property
    def identities(self) -> np.ndarray | None:
        digests = self.identity_bytes
        return None if digests is None else _frombuffer(digests, _INT64)

    @identities.setter
    def identities(self, value) -> None:
        if value is None or type(value) is bytes:
            self.identity_bytes = value
        else:
            value = np.asarray(value)
            if value.size and value.dtype.kind not in "iu":
                raise TypeError(f"identities must hold integers, got {value.dtype}")
            self.identity_bytes = value.astype(np.uint64 if value.dtype.kind == "u" else _INT64).tobytes()


def key_identity(key: bytes, person: bytes = b"") -> int:
    """:func:`identities_of_keys` of one key, as an int."""
    return int(identities_of_keys([key], person)[0])


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


def lane_sums(blocks: np.ndarray, word_bytes: int, group_words: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The two 32-bit lane sums of each block's word stream: ``blocks`` is (n, bytes) uint8, each row one block's
    moved bytes in stream order. Returns (lane_a, lane_b), uint32 arrays of n."""
    w = _words(blocks, word_bytes)
    if w.shape[1] % group_words:
        raise ValueError(f"a block of {w.shape[1]} words does not split into groups of {group_words}")
    groups = w.reshape(len(w), -1, group_words).astype(np.uint64)
    a, b = lane_terms(groups, np.arange(groups.shape[1], dtype=np.uint64))
    return a.astype(np.uint32).sum(axis=1, dtype=np.uint32), b.astype(np.uint32).sum(axis=1, dtype=np.uint32)


def lane_terms(groups: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two lane terms of word groups: ``groups`` uint64 words below 2**32, the last axis a group's words, at
    group positions ``index`` (uint64, broadcast against the groups' other axes). Returns (a, b), uint64 values below
    2**32, one per group: what :func:`lane_sums` adds up (and the detection experiment, bench/micro/integrity_lanes.py,
    compares before and after a change)."""
    with np.errstate(over="ignore"):
        t = (groups * np.array(GROUP_MUL[: groups.shape[-1]], dtype=np.uint64)).sum(axis=-1, dtype=np.uint64)
        lo = ((t & _U32) + index * np.uint64(POS_MUL)) & _U32
        hi = t >> np.uint64(32)
        z = lo ^ ((lo >> np.uint64(16)) | ((hi << np.uint64(16)) & _U32))
        return (z * np.uint64(LANE_A)) & _U32, ((z ^ hi) * np.uint64(LANE_B)) & _U32


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


def block_checksums(blocks: np.ndarray, word_bytes: int, identities, subs, group_words: int = 1) -> np.ndarray:
    """The checksum of each block: ``blocks`` (n, bytes) uint8 in stream order, its identity and sub-block index
    (arrays of n, or scalars).

    Definition (version 3). A GPU block's *word stream* is the bytes the transfer moves for it (its KV-cache group's
    segments in order, K before V, exactly what the packed host format lays side by side), read as ``W``-byte
    little-endian unsigned words, ``W`` the kernel's element size (1, 2 or 4), in groups of ``G`` consecutive words,
    ``G`` the words one access of the kernel moves (1, 2 or 4: a group is at most 16 bytes; the row marker records
    ``W`` and ``G``). Group ``j`` (words ``w_0 .. w_{G-1}``) folds into 64 bits, then into one term per 32-bit lane::

        t_j = sum_v GROUP_MUL[v] * w_v    (mod 2**64; each product is exact)
        lo = (t_j + j * POS_MUL) mod 2**32;   hi = t_j >> 32
        z = lo ^ ((hi:lo) >> 16 mod 2**32)    (a funnel shift: lo >> 16 | hi << 16)
        a_j = z * LANE_A    b_j = (z ^ hi) * LANE_B    (mod 2**32)

    The terms of one group are a bijection of ``(lo, hi)``, and so of ``t_j`` (given ``j``), so any change of one
    group whose sum ``sum_v GROUP_MUL[v] * delta_v`` is not 0 mod 2**64 (one word, or 1-3 flipped bits of a group:
    tested exhaustively) changes a lane. The lanes are plain sums mod 2**32: associative and commutative, so partial
    sums of any tiles and programs combine to the same value (integer atomics), under Triton's interpreter and on a
    GPU alike. The block's checksum mixes the lanes with its identity (a 64-bit value naming the block: the key's
    hash), its sub-block index in the host block and its number of words ``N``::

        h = mix64(identity ^ mix64(sub * 0x9E3779B97F4A7C15 ^ N * 0xC2B2AE3D27D4EB4F))
        checksum = mix64(h ^ (lane_b << 32 | lane_a))

    ``mix64`` is SplitMix64's finaliser (a bijection). Not cryptographic: see docs/integrity.md for what it detects.
    """
    a, b = lane_sums(blocks, word_bytes, group_words)
    return finalize(a, b, identities, subs, blocks.shape[1] // word_bytes)
