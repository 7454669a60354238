"""The serving benchmark (``python -m bench.serving``): a vLLM-like worker step loop per method. Its ``config`` is
stdlib only (the GPU runner reads it before the project is installed)."""
