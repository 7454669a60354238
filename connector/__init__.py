"""The vLLM plugin (installed as ``triton_offload.connector``)."""
