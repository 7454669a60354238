"""Builders of random KV caches, host buffers and transfers shared by the kernel tests."""

from __future__ import annotations

import math

import numpy as np
import torch

import triton_offload as to

SENTINEL = 0xA5


def random_bytes(shape, dtype: torch.dtype, device="cpu", gen: torch.Generator | None = None) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are uniformly random (NaN patterns included: compare bytes, not values)."""
    esize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * esize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(device)


def make_layer(layout: str, num_blocks: int, page: dict, dtype: torch.dtype, device="cpu", gen=None) -> torch.Tensor:
    """One layer tensor. ``page`` holds block_size/heads/head_dim (kv layouts), block_size/latent (mla) or
    page_bytes/pad (canonical, an int8 view whose stride(0) exceeds the page by ``pad`` bytes)."""
    if layout == "kv_first":
        return random_bytes((2, num_blocks, page["block_size"], page["heads"], page["head_dim"]), dtype, device, gen)
    if layout == "block_first":
        return random_bytes((num_blocks, 2, page["block_size"], page["heads"], page["head_dim"]), dtype, device, gen)
    if layout == "mla":
        return random_bytes((num_blocks, page["block_size"], page["latent"]), dtype, device, gen)
    if layout == "canonical":
        stride = page["page_bytes"] + page.get("pad", 0)
        base = random_bytes((num_blocks, stride), torch.int8, device, gen)
        return base[:, : page["page_bytes"]]
    raise AssertionError(layout)


def make_caches(layout, num_layers, num_blocks, page, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [make_layer(layout, num_blocks, page, dtype, device, gen) for _ in range(num_layers)]


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of the tensor's storage (padding included), as a uint8 CPU copy."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).cpu().clone()


def snapshot(tensors) -> list[torch.Tensor]:
    return [storage_bytes(t) for t in tensors]


def sentinel_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor with t's shape, dtype and strides whose every storage byte is SENTINEL."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    out.untyped_storage().fill_(SENTINEL)
    return out


def host_buffer(spec: to.KVCacheSpec, rows: int, f: int, device="cpu", pin=False) -> torch.Tensor:
    buf = torch.full((rows, spec.host_block_bytes(f)), SENTINEL, dtype=torch.uint8)
    return buf.pin_memory() if pin else buf.to(device)


def random_transfer(rng: np.random.Generator, num_blocks: int, num_host: int, n: int, f: int, skip: int):
    """Distinct, unsorted GPU ids and the matching number of distinct host ids."""
    g = rng.permutation(num_blocks)[:n]
    m = math.ceil((skip + n) / f)
    h = rng.permutation(num_host)[:m]
    return g, h


def copy_blocks_into(dst: torch.Tensor, src: torch.Tensor, layout: str, g) -> None:
    """dst's blocks g := src's, by plain indexing (the expected state after a scatter)."""
    g = torch.as_tensor(np.asarray(g), dtype=torch.int64, device=src.device)
    if layout == "kv_first":
        dst[:, g] = src[:, g]
    else:
        dst[g] = src[g]


def assert_loaded_exactly(loaded, sources, layout: str, g, what: str = "a load") -> None:
    """Each tensor of ``loaded`` (sentinel-filled before the load) holds ``sources``' blocks ``g`` and the sentinel in
    every other storage byte, padding included."""
    for out, src in zip(loaded, sources, strict=True):
        want = sentinel_like(src)
        copy_blocks_into(want, src, layout, g)
        assert torch.equal(storage_bytes(out), storage_bytes(want)), (
            f"{what} wrote other bytes than the addressed blocks"
        )
