"""Triton kernels of triton-offload and their plain-PyTorch reference (installed as ``triton_offload.kernels``)."""
