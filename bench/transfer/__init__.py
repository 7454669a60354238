"""The transfer benchmark (``python -m bench.transfer``): every method on the same blocks, byte-checked, then timed."""
