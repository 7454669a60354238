"""What both benchmarks share: the case, the machine, the workloads, the byte checks, timing and output. The stdlib-only
modules (``grid``, ``results``) are read by the GPU runner (tools/gpu/) before the project is installed."""
