"""Lowers one copy-kernel variant for a GPU architecture without a GPU: Triton's own compiler to PTX and, with the
ptxas inside its wheel, to cubin; :func:`tool` finds the wheel's cuobjdump and nvdisasm. The signature is the one a
real launch binds: the scalars int64 and unspecialised, the KV anchor and host buffer 16-byte aligned, the integrity
arguments None (compiled out) without the checks."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from triton_offload.kernels import copy_blocks
from triton_offload.kernels.shapes import LaunchConfig

__all__ = ["ARCHES", "compile_variant", "signature", "tool"]

# Hopper (H100, H200) and Blackwell (B200).
ARCHES = (90, 100)
CHECK_POINTERS = ("ck_ptr", "ident_ptr", "sums_ptr", "res_ptr", "tab_ptr")
CHECK_SCALARS = ("tab_row", "mark")


def without_checks(sig: dict, constexprs: dict) -> None:
    """Adds to ``sig`` and ``constexprs`` what a launch without the checks passes for their arguments
    (copy_blocks.NO_INTEGRITY, the FP8 kernel's too), as Triton's dispatch types it: a None pointer is specialised
    away (a constexpr), a typed scalar keeps its annotation whatever its value."""
    for name, value in zip(CHECK_POINTERS + CHECK_SCALARS, copy_blocks.NO_INTEGRITY, strict=True):
        if value is None:
            constexprs[name], sig[name] = None, "constexpr"
        else:
            sig[name] = "i64"


def drop_unused_check_scalars(ptx: str, kernel: str, first: int) -> str:
    """``ptx`` of a variant without the checks, as the kernel of the same arguments without them would read: the
    typed check scalars (parameters ``first``, ``first + 1`` of ``kernel``) removed and Triton's scratch pointers
    after them renumbered. Raises AssertionError if the code reads either scalar (it must not: NO_INTEGRITY's 0)."""
    n = len(CHECK_SCALARS)
    for i in range(n):
        decl = f"\t.param .u64 {kernel}_param_{first + i},\n"
        assert ptx.count(f"{kernel}_param_{first + i}") == 1 and decl in ptx, f"{kernel} reads check scalar {i}"
        ptx = ptx.replace(decl, "")
    for i in range(2):  # the global and profile scratch pointers
        ptx = re.sub(rf"\b{kernel}_param_{first + n + i}\b", f"{kernel}_param_{first + i}", ptx)
    return ptx


def signature(cfg: LaunchConfig, store: bool, grouped: bool, integrity: bool, copy: bool, plain_kernel: bool = False):
    """(signature, constexprs, attrs) of a launch with these constexprs. ``plain_kernel``: a kernel of the same
    arguments without the integrity ones at all (tests/unit/golden_copy_kernel.py)."""
    ptr = {1: "*i8", 2: "*i16", 4: "*i32"}[cfg.elem]
    sig = {"anchor_ptr": ptr, "host_ptr": ptr, "table_ptr": "*i64", "ids_ptr": "*i64"}
    sig |= {name: "i64" for name in copy_blocks._NOT_SPECIALIZED if name not in CHECK_SCALARS}
    constexprs: dict = {}
    if integrity:
        sig |= {name: "*i64" for name in CHECK_POINTERS} | {name: "i64" for name in CHECK_SCALARS}
    elif not plain_kernel:
        without_checks(sig, constexprs)
    shape = {"STORE": store, "MULTI_GROUP": grouped, "ROWS": cfg.rows, "CHUNK": cfg.chunk, "VEC": cfg.vec}
    flags = {} if plain_kernel else {"INTEGRITY": integrity, "COPY": copy}
    constexprs |= shape | flags
    sig |= {name: "constexpr" for name in (*shape, *flags)}
    # torch allocations are at least 64-byte aligned: Triton specialises the KV anchor and the host buffer as 16-byte
    # divisible (not the table and id pointers: copy_blocks._ALIGNMENT_NOT_SPECIALIZED).
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(2)}
    return sig, constexprs, attrs


def compile_variant(
    cfg: LaunchConfig,
    store: bool,
    grouped: bool,
    integrity: bool = False,
    copy: bool = True,
    arch: int = 90,
    kernel: Callable | None = None,
):
    """The compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``) for ``arch`` (90: sm_90, 100:
    sm_100). ``kernel``: another version of the kernel function (a test's mutation, or the golden kernel of the same
    arguments without the checks)."""
    # A fresh JITFunction: the session may have TRITON_INTERPRET=1, which turns triton.jit into the interpreter.
    fn = JITFunction(kernel or copy_blocks._copy_blocks_kernel, **copy_blocks._JIT_OPTIONS)
    plain = kernel is not None and "INTEGRITY" not in fn.arg_names
    sig, constexprs, attrs = signature(cfg, store, grouped, integrity, copy, plain_kernel=plain)
    source = ASTSource(fn, sig, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": cfg.num_warps})


def tool(name: str) -> str:
    """The path of a CUDA binary utility (``cuobjdump``, ``nvdisasm``): the one inside Triton's wheel, else PATH's."""
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if os.path.isfile(bundled):
        return bundled
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} is neither in Triton's wheel ({bundled}) nor on PATH")
    return found
