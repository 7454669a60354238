"""Compiler evidence for the copy kernel without a GPU: every variant the launcher can pick, lowered by Triton to PTX
and (with the ptxas, cuobjdump and nvdisasm inside Triton's wheel) to cubin and SASS for sm_90 and sm_100, measured
from the code (registers, spills, occupancy, access widths, the steady loop's instructions per 16 bytes, barriers,
fences and atomics with their semantics), a bandwidth model from those numbers, and the budgets CI holds every kernel
change to (docs/compiler.md).

    python -m bench.static [--arch 90 100] [--json PATH]      # one Triton: this interpreter's
    ./dev static                                              # Triton 3.6, 3.8 and the newest, merged and committed
"""
