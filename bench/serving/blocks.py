"""Which blocks each step of the serving loop writes, stores and loads, and what each must hold at the end
(:class:`Blocks`, one step's :class:`StepBlocks`). Everything here is host-side bookkeeping in NumPy, identical for
every method, and it records for the byte check which GPU block each host block was last stored from and which prefix
each load region last received.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bench.serving.config import LOAD_REGIONS, PREFIXES, LoopShape, RingSizes

__all__ = ["StepBlocks", "Blocks"]


@dataclass
class StepBlocks:
    """One step's blocks.

    Attributes:
        token_blocks, token_slots: (tokens,) GPU block and slot each token's KV goes to, prefill tokens first.
        store_gpu, store_host: (m,) the blocks the step completed and the host blocks they are stored to.
        must_finish: store jobs that still read blocks this step reallocates: they must be done before the compute.
    """

    token_blocks: np.ndarray
    token_slots: np.ndarray
    store_gpu: np.ndarray
    store_host: np.ndarray
    must_finish: set[int]


class Blocks:
    """The block plan of one method's run (every method gets a fresh one, so all move the same blocks).

    GPU blocks ``[0, gpu_ring)`` are the ring the steps write, allocated round-robin in a random order (so a store's
    blocks are scattered, as in a real cache); ``[gpu_ring, gpu_blocks)`` are the regions loads write, one prefix
    each. Host blocks ``[0, host_ring)`` are the store ring, taken round-robin in a random order; the rest hold the
    cached prefixes, never stored to. A step's tokens are a prefill chunk (whole fresh blocks, all completed in the
    step) and one token for each decode request (each fills its block one slot per step, staggered, and the step that
    fills a block's last slot completes it). Completed blocks are the step's store.

    Args:
        shape: the loop's shape.
        sizes: the ring sizes (:func:`serving_config.ring_sizes`).
        block_size: tokens per block.
        seed: the order the rings are walked in, and the prefixes' and load regions' blocks.
    """

    def __init__(self, shape: LoopShape, sizes: RingSizes, block_size: int, seed: int):
        rng = np.random.default_rng(seed)
        self.shape, self.sizes, self.bs = shape, sizes, block_size
        self.ring = rng.permutation(sizes.gpu_ring).astype(np.int64)
        self.host_ring = rng.permutation(sizes.host_ring).astype(np.int64)
        n = sizes.prefix_blocks
        loads = sizes.gpu_ring + rng.permutation(LOAD_REGIONS * n).astype(np.int64)
        self.load_gpu = loads.reshape(LOAD_REGIONS, n)
        prefixes = sizes.host_ring + rng.permutation(PREFIXES * n).astype(np.int64)
        self.prefix_host = prefixes.reshape(PREFIXES, n)
        self.allocated = 0  # allocations so far; ring position = allocation % gpu_ring
        self.life = np.full(sizes.gpu_ring, -1, dtype=np.int64)  # allocation number of each ring position's block
        self.reader = np.full(sizes.gpu_ring, -1, dtype=np.int64)  # store job reading each ring position, or -1
        self.decode_pos = np.full(shape.decode, -1, dtype=np.int64)  # each decode request's ring position
        self.decode_fill = np.arange(shape.decode, dtype=np.int64) % block_size  # staggered: completions spread
        self.stored = 0
        self.host_source = np.full((sizes.host_ring, 2), -1, dtype=np.int64)  # per ring slot: (ring pos, life)
        self.loads = 0
        self.region_prefix = np.full(LOAD_REGIONS, -1, dtype=np.int64)

    def _allocate(self, k: int, must_finish: set[int]) -> np.ndarray:
        pos = (self.allocated + np.arange(k, dtype=np.int64)) % self.sizes.gpu_ring
        must_finish.update(int(j) for j in self.reader[pos] if j >= 0)
        self.reader[pos] = -1
        self.life[pos] = self.allocated + np.arange(k, dtype=np.int64)
        self.allocated += k
        return pos

    def next_step(self, store_job: int) -> StepBlocks:
        """The next step's blocks; the store that ``store_job`` will be is recorded as reading them."""
        bs, must_finish = self.bs, set()
        prefill = self._allocate(self.shape.prefill // bs, must_finish)
        need = self.decode_pos < 0
        self.decode_pos[need] = self._allocate(int(need.sum()), must_finish)
        dec_pos, dec_slots = self.decode_pos.copy(), self.decode_fill.copy()
        self.decode_fill += 1
        done = self.decode_fill == bs
        completed = self.decode_pos[done]
        self.decode_pos[done], self.decode_fill[done] = -1, 0
        token_pos = np.concatenate([np.repeat(prefill, bs), dec_pos])
        token_slots = np.concatenate([np.tile(np.arange(bs, dtype=np.int64), prefill.size), dec_slots])
        store_pos = np.concatenate([prefill, completed])
        slot = (self.stored + np.arange(store_pos.size, dtype=np.int64)) % self.sizes.host_ring
        self.stored += store_pos.size
        self.host_source[slot] = np.stack([store_pos, self.life[store_pos]], axis=1)
        self.reader[store_pos] = store_job
        return StepBlocks(self.ring[token_pos], token_slots, self.ring[store_pos], self.host_ring[slot], must_finish)

    def next_load(self, record: bool = True) -> tuple[np.ndarray, np.ndarray, int, int]:
        """(GPU ids, host ids, region, prefix) of the next arrival's prefix load: prefix ``j % PREFIXES`` into region
        ``j % LOAD_REGIONS``. ``record=False`` (a run without offload, which checks the region without loading it):
        the region is not recorded as holding the prefix."""
        region, prefix = self.loads % LOAD_REGIONS, self.loads % PREFIXES
        self.loads += 1
        if record:
            self.region_prefix[region] = prefix
        return self.load_gpu[region], self.prefix_host[prefix], region, prefix

    def next_load_region(self) -> int:
        """The region the next arrival's load writes."""
        return self.loads % LOAD_REGIONS

    def next_host_ids(self) -> np.ndarray:
        """Every host block the next step's store may write (its store takes at most ``max_per_step`` ring slots
        from here)."""
        slot = (self.stored + np.arange(self.sizes.max_per_step, dtype=np.int64)) % self.sizes.host_ring
        return self.host_ring[slot]

    def expected_stores(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(host ids, GPU ids) of every store-ring block stored in this run, each with the GPU block it was last
        stored from (unchanged since: the ring sizes guarantee it), and the host ids never stored to."""
        slot_stored = self.host_source[:, 0] >= 0
        pos, life = self.host_source[slot_stored].T
        # An internal invariant (ring_sizes), not a byte-check result: a reallocated source cannot be compared.
        assert np.array_equal(self.life[pos], life), "a stored block's GPU source was reallocated: ring too small"
        return self.host_ring[slot_stored], self.ring[pos], self.host_ring[~slot_stored]

    def expected_loads(self) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
        """[(GPU ids, host ids)] of each load region's last load, and the GPU ids of regions never loaded."""
        loaded = [(self.load_gpu[r], self.prefix_host[p]) for r, p in enumerate(self.region_prefix) if p >= 0]
        never = self.load_gpu[self.region_prefix < 0].reshape(-1)
        return loaded, never
