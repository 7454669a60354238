"""The GPU run (``./dev gpu``): stages, runner, summary, the vLLM bundle. Stdlib only at import: it starts before the
project is installed."""
