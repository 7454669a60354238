"""The model's side of a serving step (:class:`StepModel`): a transformer's per-layer matrix products in bf16 on the
current (compute) stream, and each layer's write of the step's new K and V into the step's GPU blocks, the way vLLM's
``reshape_and_cache`` writes them through a slot mapping. What is modelled: the four matrix products of every layer at
the model's real per-GPU shapes (QKV, O, gate/up, down) for the step's tokens, and the KV write, whose values are the
QKV product's K and V columns: a store of those blocks reads what the compute wrote, so it must be ordered after it.
With a decode context (the decode-heavy shape), each layer also reads as many bytes as its decode requests' attention
reads from the KV cache (decode x context tokens of K and V): a bandwidth-bound reduction over a buffer larger than the
L2 cache, so the step has a decode step's memory traffic. What is not: attention itself (its FLOPs, its reads of the
paged blocks themselves, the prefill chunk's attention; the O product takes Q's columns as its input instead), norms,
activations, embedding and sampling. The step input is fresh random activations each step, so no two steps write the
same KV.
"""

from __future__ import annotations

import numpy as np
import torch

import triton_offload as to
from bench.common.workloads import Workload
from bench.serving.config import KV_READ_MIN_BYTES
from triton_offload.layouts import resolve_layout

__all__ = ["StepModel"]


class StepModel:
    """One GPU's share of a model, run one step at a time over ``tokens`` tokens.

    Args:
        workload: its ``model`` gives the shapes; its KV heads and head size must be the model's.
        spec: the KV caches the steps write (a K/V layout: kv_first or block_first), bf16.
        tokens: tokens per step (prefill chunk + decodes).
        seed: weights' seed; :meth:`reset` seeds the step inputs.
        kv_read_tokens: tokens of K and V each layer reads (decode requests x their context; 0: none).
    """

    def __init__(self, workload: Workload, spec: to.KVCacheSpec, tokens: int, seed: int = 0, kv_read_tokens: int = 0):
        m = workload.model
        if m is None:
            raise ValueError(f"workload {workload.name!r} has no model dimensions: the serving loop cannot run it")
        if (m.kv_heads, m.head_dim) != (workload.heads, workload.head_dim):
            raise ValueError(
                f"{workload.name}: the model has {m.kv_heads} KV heads x {m.head_dim}, its KV cache "
                f"{workload.heads} x {workload.head_dim}: they must match"
            )
        dims = resolve_layout(spec.layout).dims
        if dims.kv_dim is None:
            raise ValueError(f"the serving loop writes K and V separately: needs kv_first or block_first, got "
                             f"{spec.layout.label}")  # fmt: skip
        self.model, self.spec, self.tokens = m, spec, tokens
        device = spec.device
        self.cuda = device.type == "cuda"
        gen = torch.Generator(device=device).manual_seed(seed)
        # Distinct weights per layer, scaled by 1/sqrt(fan-in) so activations stay O(1) through the layers.
        self.weights = [
            {
                name: torch.empty((k, n), dtype=torch.bfloat16, device=device).normal_(0.0, k**-0.5, generator=gen)
                for name, (k, n) in m.matmuls().items()
            }
            for _ in range(spec.num_layers)
        ]
        self.x = torch.empty((tokens, m.hidden), dtype=torch.bfloat16, device=device)
        self.qkv = torch.empty((tokens, m.q_width + 2 * m.kv_width), dtype=torch.bfloat16, device=device)
        self.h = torch.empty((tokens, m.hidden), dtype=torch.bfloat16, device=device)
        self.up = torch.empty((tokens, m.up_width), dtype=torch.bfloat16, device=device)
        self.input_gen = torch.Generator(device=device)
        # One token's K (or V) of one layer is one row of kv_width elements; the slot mapping names rows.
        self.kv_rows = [t.view(-1, m.kv_width) for t in spec.kv_caches]
        t = spec.kv_caches[0]
        row = m.kv_width
        # Token slots follow the block and K/V dims in both K/V layouts: (2, nb, bs, ...) and (nb, 2, bs, ...).
        token_dim = max(dims.block_dim, dims.kv_dim) + 1
        self._strides = tuple(t.stride(d) // row for d in (dims.block_dim, dims.kv_dim, token_dim))
        # The slot mapping (K rows, then V rows) goes up once per step, from pinned memory so the copy is async; the
        # loop synchronises every step, so the staging buffer is free again when the next step fills it.
        self.rows_host = torch.empty(2 * tokens, dtype=torch.int64, pin_memory=self.cuda)
        self.rows_dev = torch.empty(2 * tokens, dtype=torch.int64, device=device)
        # The attention read: per layer, K and V of kv_read_tokens tokens (bf16), from a buffer at least twice that
        # (and, on a GPU, KV_READ_MIN_BYTES) so that consecutive layers read different bytes, none from L2.
        self.kv_read_elems = 2 * kv_read_tokens * m.kv_width
        self.kv_read_bytes = 2 * self.kv_read_elems * spec.num_layers  # per step
        if self.kv_read_elems:
            floor = KV_READ_MIN_BYTES // 2 if self.cuda else 0
            size = max(2 * self.kv_read_elems, floor)
            self.kv_buffer = torch.zeros(size, dtype=torch.bfloat16, device=device)
            span = size - self.kv_read_elems + 1
            self._kv_offsets = [(layer * self.kv_read_elems) % span for layer in range(spec.num_layers)]

    def reset(self, seed: int) -> None:
        """Seeds the step inputs: every method's run computes (and stores) the same KV."""
        self.input_gen.manual_seed(seed)

    def slot_rows(self, blocks: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """(2 * tokens,) int64: the K rows then the V rows that each token's KV goes to, in every layer's
        ``(-1, kv_width)`` view. ``blocks``, ``slots``: (tokens,) GPU block and position in the block of each token."""
        block, kv, token = self._strides
        k_rows = blocks.astype(np.int64) * block + slots.astype(np.int64) * token
        return np.concatenate([k_rows, k_rows + kv])

    def step(self, rows: np.ndarray) -> None:
        """Queues one step on the current stream: fresh inputs, then every layer's products and KV write.

        Args:
            rows: :meth:`slot_rows` of this step's tokens.
        """
        m, n = self.model, self.tokens
        self.rows_host.numpy()[:] = rows
        self.rows_dev.copy_(self.rows_host, non_blocking=True)
        k_rows, v_rows = self.rows_dev[:n], self.rows_dev[n:]
        q, kv = m.q_width, m.kv_width
        self.x.normal_(generator=self.input_gen)
        for layer, (w, cache) in enumerate(zip(self.weights, self.kv_rows)):
            wqkv, wo, wup, wdown = w.values()
            torch.matmul(self.x, wqkv, out=self.qkv)
            cache.index_copy_(0, k_rows, self.qkv[:, q : q + kv])
            cache.index_copy_(0, v_rows, self.qkv[:, q + kv :])
            if self.kv_read_elems:  # the decode requests' attention reads their KV (the result is not used)
                off = self._kv_offsets[layer]
                torch.sum(self.kv_buffer[off : off + self.kv_read_elems], dtype=torch.float32)
            torch.matmul(self.qkv[:, :q], wo, out=self.h)
            torch.matmul(self.h, wup, out=self.up)
            torch.matmul(self.up[:, : m.intermediate], wdown, out=self.x)
