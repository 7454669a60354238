"""Every job's bytes, checked while the serving loop runs (:class:`JobChecks`): each load's GPU blocks right after its
wait (or, with async loads, right after ``get_finished`` reported it) and each store's host blocks when it completes,
against checksums known before. The checksum of a packed block is one int64 sum per K or V page of every layer
(:func:`row_sums`: the block's bytes as int32 words, summed per page): one wrong byte changes its page's sum, a page
left unwritten holds the sentinel, a block or page moved to the wrong place changes two sums. Words swapped within one
page are not seen; the byte-exact check at the end of a run (``serving_loop.byte_check``) compares its final state byte
for byte.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from bench.common.verify import SENTINEL
from triton_offload.layouts import resolve_layout

__all__ = ["row_sums", "pages_per_block", "JobChecks", "CHECK_CHUNK"]

# Blocks summed per chunk on the device (bounds the memory a check takes).
CHECK_CHUNK = 128


def pages_per_block(bytes_per_block: int, num_layers: int) -> int:
    """K and V pages of one packed block (2 per layer), each summed on its own."""
    pages = 2 * num_layers
    if bytes_per_block % (4 * pages):
        raise ValueError(f"a block of {bytes_per_block} bytes does not split into {pages} pages of int32 words")
    return pages


def row_sums(rows: torch.Tensor, pages: int) -> torch.Tensor:
    """(n, pages) int64: the sum of each page's int32 words, for (n, bytes) uint8 rows of packed blocks. No overflow:
    a page of up to 2**20 words sums to less than 2**51. In chunks of CHECK_CHUNK rows (the sum widens its input to
    int64 first)."""
    out = [
        part.contiguous().view(torch.int32).view(part.shape[0], pages, -1).sum(dim=2, dtype=torch.int64)
        for part in torch.split(rows, CHECK_CHUNK)
    ]
    return torch.cat(out) if out else torch.empty((0, pages), dtype=torch.int64, device=rows.device)


def _describe(what: str, job: int, got: torch.Tensor, want: torch.Tensor, ids: np.ndarray, kind: str) -> str:
    bad = (got != want).any(dim=1).nonzero().flatten()
    i = int(bad[0])
    page = int((got[i] != want[i]).nonzero()[0])
    return (f"{what} job {job}: {bad.numel()} of {got.shape[0]} blocks differ from their checksums; first: {kind} "
            f"block {int(ids[i])}, layer {page // 2} {'KV'[page % 2]} page")  # fmt: skip


@dataclass
class _Store:
    gpu_ids: np.ndarray
    host_ids: np.ndarray
    expected: torch.Tensor | None = None  # (n, pages) on the host, once the step that wrote the blocks has ended
    done: bool = False  # the engine reported it finished
    future: concurrent.futures.Future | None = None


@dataclass
class JobChecks:
    """The checks of one run.

    * A load's expected sums are its cached prefix's, computed once when the prefixes are made. Its GPU blocks are
      summed on the device, by the worker, right after the wait returned (the loop stops its clock meanwhile) or after
      the step whose poll reported it: an engine whose wait returned before its copy was done shows unwritten pages.
    * A store's expected sums are its GPU blocks', computed on the device at the end of the step whose compute wrote
      them, after the step's clock stopped. Its host blocks are summed on the host when the store is reported
      finished: on a GPU machine in a worker thread, so that neither the link (a copy up would be as large as the
      store) nor the worker's step pays for it; without CUDA at once. A host block is not stored to again before its
      check is done (:meth:`JobChecks.before_store_into`).

    The same check work is done in a run without offload (``none``), against the sentinel its blocks must keep, so
    the work falls on every method alike.

    Args:
        spec: the KV caches.
        host_rows: ``(host ids) -> (n, bytes_per_block)`` uint8 rows, where the method's host blocks live (the host
            cache; vLLM's own region for ``vllm_native``).
        prefix_sums: (cached prefix host blocks, pages) sums of the cached prefixes' host blocks, in host-id order
            from ``prefix_base``, on the device.
        prefix_base: the host id of the first cached prefix block.
        threaded: sum host blocks in a worker thread (on a GPU machine).
        offloaded: the run moves blocks; without offload every checked block must keep the sentinel.
        store_rows: ``(GPU ids) -> (n, host row bytes)`` on the device: the host rows a store must write, where they
            are not the blocks' own bytes (the FP8 host format's reference quantization); a store's expected sums are
            theirs.
    """

    spec: object
    host_rows: Callable[[np.ndarray], torch.Tensor]
    prefix_sums: torch.Tensor
    prefix_base: int
    threaded: bool
    offloaded: bool
    store_rows: Callable[[np.ndarray], torch.Tensor] | None = None
    jobs_checked: int = 0
    problem: str | None = None
    _stores: dict[int, _Store] = field(default_factory=dict)
    _pool: concurrent.futures.ThreadPoolExecutor | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        self.pages = pages_per_block(self.spec.bytes_per_block, self.spec.num_layers)
        self.device = self.spec.device
        kv_dim = resolve_layout(self.spec.layout).dims.kv_dim
        if kv_dim is None:
            raise ValueError(f"the per-job checks need a K/V layout, got {self.spec.layout.label}")
        # Each layer's K and V halves, blocks first (both K/V layouts): the packed block's pages, in order.
        self._pages = [t.select(kv_dim, h) for t in self.spec.kv_caches for h in (0, 1)]
        self._sentinel = row_sums(torch.full((1, self.spec.bytes_per_block), SENTINEL, dtype=torch.uint8), self.pages)
        if self.threaded:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="serving-check")

    def _fail(self, problem: str) -> None:
        with self._lock:
            if self.problem is None:
                self.problem = problem

    def gpu_sums(self, gpu_ids: np.ndarray) -> torch.Tensor:
        """(n, pages) sums of GPU blocks' packed bytes, computed on the device (returned there): per layer, the K and
        the V page of each block (a K/V layout's two halves, blocks first), gathered and summed, in packed order."""
        chunks = []
        for i in range(0, gpu_ids.size, CHECK_CHUNK):
            g = torch.from_numpy(gpu_ids[i : i + CHECK_CHUNK]).to(self.device)
            cols = [p[g].reshape(g.numel(), -1).view(torch.int32).sum(dim=1, dtype=torch.int64) for p in self._pages]
            chunks.append(torch.stack(cols, dim=1))
        return torch.cat(chunks) if chunks else torch.empty((0, self.pages), dtype=torch.int64, device=self.device)

    # Loads ---------------------------------------------------------------------------------------------------------

    def check_load(self, job: int, gpu_ids: np.ndarray, host_ids: np.ndarray | None) -> None:
        """A load's GPU blocks against the cached prefix blocks it loaded (``host_ids``; None: nothing was loaded, so
        they must hold the sentinel). Computed on the device and compared at once (the caller has stopped its
        clock)."""
        got = self.gpu_sums(gpu_ids)
        if host_ids is None:
            want = self._sentinel.to(self.device).expand_as(got)
        else:
            want = self.prefix_sums[torch.from_numpy(host_ids - self.prefix_base).to(self.device)]
        if not torch.equal(got, want):
            what = "load" if host_ids is not None else "a load region that no load addressed, at"
            self._fail(_describe(what, job, got.cpu(), want.cpu(), gpu_ids, "GPU"))
        elif host_ids is not None:
            with self._lock:
                self.jobs_checked += 1

    # Stores --------------------------------------------------------------------------------------------------------

    def expect_store(self, job: int, gpu_ids: np.ndarray, host_ids: np.ndarray) -> None:
        """Records store ``job``'s expected sums: its GPU blocks as the step that wrote them left them (called after
        that step's clock stopped, before any later step can overwrite them); without offload, the sentinel its host
        blocks must keep."""
        st = self._stores.setdefault(job, _Store(gpu_ids, host_ids))
        st.gpu_ids, st.host_ids = gpu_ids, host_ids  # also when the store was reported before its step ended
        # What the store must hold (computed even without offload: equal work).
        want = self.gpu_sums(gpu_ids) if self.store_rows is None else row_sums(self.store_rows(gpu_ids), self.pages)
        sums = want.cpu()
        st.expected = sums if self.offloaded else self._sentinel.expand_as(sums)
        if not self.offloaded:
            st.done = True  # no store: its host blocks are checked now, as a store's would be once it completed
        self._maybe_check(job)

    def store_done(self, job: int) -> None:
        """The engine reported store ``job`` finished: its host blocks are checked (now, or in the thread)."""
        self._stores.setdefault(job, _Store(np.empty(0, np.int64), np.empty(0, np.int64))).done = True
        self._maybe_check(job)

    def _maybe_check(self, job: int) -> None:
        st = self._stores[job]
        if st.expected is None or not st.done or st.future is not None:
            return
        if self._pool is None:
            self._check_store(job, st)
            del self._stores[job]
        else:
            st.future = self._pool.submit(self._check_store, job, st)

    def _check_store(self, job: int, st: _Store) -> None:
        got = row_sums(self.host_rows(st.host_ids), self.pages)
        if not torch.equal(got, st.expected):
            what = "store" if self.offloaded else "a store-ring range that no store addressed, at step"
            self._fail(_describe(what, job, got, st.expected, st.host_ids, "host"))
        elif self.offloaded:
            with self._lock:
                self.jobs_checked += 1

    def unreported_into(self, host_ids: np.ndarray) -> list[int]:
        """Store jobs into any of ``host_ids`` not yet reported finished: the caller waits for them (and books their
        results) before a store overwrites those host blocks."""
        wanted = set(host_ids.tolist())
        return [j for j, st in self._stores.items() if not st.done and wanted.intersection(st.host_ids.tolist())]

    def before_store_into(self, host_ids: np.ndarray) -> bool:
        """Waits for the checks of earlier stores into any of ``host_ids`` (the next store overwrites them); True
        when one was still running. Every such store must have been reported (:meth:`unreported_into`) and its step
        ended: anything else is a bug in the caller's order (AssertionError)."""
        waited = False
        wanted = set(host_ids.tolist())
        for job, st in list(self._stores.items()):
            if not wanted.intersection(st.host_ids.tolist()):
                continue
            assert st.future is not None, f"store job {job}'s host blocks are reused before it was checked"
            if not st.future.done():
                waited = True
            st.future.result()
            del self._stores[job]
        return waited

    def finish(self) -> None:
        """Waits for every check in flight; every store must have been checked by then."""
        for job, st in list(self._stores.items()):
            if st.future is not None:
                st.future.result()
            elif self.problem is None:
                missing = "its result" if st.expected is not None else "its expected sums"
                self._fail(f"store job {job} was never checked: {missing} never came")
            del self._stores[job]
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
