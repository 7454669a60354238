"""triton-offload's benchmarks (not installed; run from the repository root): ``python -m bench.transfer`` (one
transfer, every method, against the link's peak), ``python -m bench.serving`` (a serving engine's step loop), the
micro-benchmarks in :mod:`bench.micro`, all over the shared rooms :mod:`bench.common` (case, timing, checks, output)
and :mod:`bench.baselines` (the one registry of methods). bench/README.md says what each measures."""
