"""triton-offload: KV-cache offloading for LLM serving on Triton kernels.

One launch moves any number of non-contiguous GPU KV blocks, all layers at once, into a packed pinned host buffer
(:func:`gather_blocks`) or back (:func:`scatter_blocks`).
"""

from triton_offload.layouts import KVCacheSpec, Layout, prepare_kv
from triton_offload.transfer import check_transfer, gather_blocks, host_block_bytes, scatter_blocks

__version__ = "0.1.0"

__all__ = [
    "Layout",
    "KVCacheSpec",
    "prepare_kv",
    "gather_blocks",
    "scatter_blocks",
    "host_block_bytes",
    "check_transfer",
]
