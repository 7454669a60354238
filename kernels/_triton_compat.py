"""What the kernels need from Triton beyond its public launch API, kept in one place because it depends on Triton's
internals: a fix for the interpreter of Triton < 3.7 under NumPy >= 2.4 (:func:`patch_interpreter_scalar_index`), and
the direct launch of a compiled variant (:class:`DirectRunner`).
"""

from __future__ import annotations

import triton
from triton import knobs as _knobs

_FIXED_IN = (3, 7)


def _version(v: str) -> tuple[int, int]:
    major, minor = (v.split("+")[0].split(".") + ["0"])[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def patch_interpreter_scalar_index() -> bool:
    """Makes the interpreter's scalar-to-int conversion squeeze first; True if a patch was installed.

    Triton 3.6's interpreter holds every scalar as a 1-element array and turns it into a Python int with
    ``int(array)``, which NumPy 2.4 rejects for arrays that are not 0-d: every loop with a run-time bound then fails
    with "only 0-dimensional arrays can be converted to Python scalars". Triton 3.7 squeezes the array first; on older
    versions the same conversion is installed on the interpreter's tensor patch. Compiled kernels are not affected.
    """
    if _version(triton.__version__) >= _FIXED_IN:
        return False
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_squeezes_index", False):
        return False

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        # Set after the original so the scope restores both, in reverse order, when the launch ends.
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._squeezes_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


# ---------------------------------------------------------------------------------------------------------------
# Launching a compiled variant directly (Triton 3.6 to 3.9 share this protocol; see triton/runtime/jit.py, JITFunction
# .run: after binding the arguments and finding the variant, it calls exactly what DirectRunner calls).
# ---------------------------------------------------------------------------------------------------------------


def compile_variant(jit_fn, args: tuple, constexprs: dict, num_warps: int):
    """The compiled variant ``jit_fn[grid](*args, **constexprs, num_warps=...)`` would launch, compiled now if
    Triton's cache does not hold it yet; nothing is launched. Needs a CUDA device."""
    kernel = jit_fn.warmup(*args, grid=(1,), num_warps=num_warps, **constexprs)
    if hasattr(kernel, "result"):  # Triton's asynchronous compile mode hands back a future
        kernel = kernel.result()
    return kernel


class DirectRunner:
    """Launches one compiled variant with the arguments as given: what Triton's dispatch does after it has bound and
    specialised the arguments and looked the variant up, minus that work and minus the launch hooks (the caller uses
    it only while none is installed, see :func:`launch_hooks_idle`).

    The caller must pass arguments for which Triton would have picked this very variant: with every scalar typed and
    unspecialised and the pointers' alignment fixed, that is any call of the launcher it was compiled for.
    """

    def __init__(self, compiled):
        self.compiled = compiled
        self._run = compiled.run  # first access loads the module and builds the launcher
        self._function = compiled.function
        self._metadata = compiled.packed_metadata

    def __call__(self, programs: int, stream: int, args: tuple) -> None:
        # (grid x, y, z, stream, function, packed metadata, launch metadata, enter hook, exit hook, *arguments)
        self._run(programs, 1, 1, stream, self._function, self._metadata, None, None, None, *args)


def launch_hooks_idle() -> bool:
    """True when no launch hook is installed (Triton >= 3.4 keeps empty hook chains; older ones None). Called on
    every direct launch: a few attribute reads."""
    runtime = _knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


# The combine function of ``tl.sum``. The kernels reduce with ``tl.reduce(x, axis, SUM_COMBINE)`` rather than
# ``tl.sum``: ``tl.sum`` is a @jit standard-library function, which the interpreter cannot call unless
# TRITON_INTERPRET=1 was set before Triton was imported (the vLLM CPU platform runs the kernels through the interpreter
# without it), while ``tl.reduce`` is a builtin the interpreter patches, and it recognises the standard library's own
# combine function as a sum (its NumPy fast path; Triton 3.6 to 3.9). Compiled, it is exactly what ``tl.sum`` emits.
# Under TRITON_INTERPRET=1 the standard library's function is itself an interpreted one, which a compiled kernel cannot
# reference: compiled kernels get a JITFunction of the same code (SUM_COMBINE), interpreted ones the standard
# library's object (INTERPRETED_SUM_COMBINE, see interpreted_globals).
def _jit_sum_combine():
    from triton.runtime.jit import JITFunction

    fn = triton.language.standard._sum_combine
    return fn if isinstance(fn, JITFunction) else JITFunction(fn.fn)


SUM_COMBINE = _jit_sum_combine()
INTERPRETED_SUM_COMBINE = triton.language.standard._sum_combine


def interpreted_copy(fn, **overrides):
    """A copy of the kernel function ``fn`` whose globals take ``overrides`` (what the interpreter should see in
    place of the compiled kernel's globals)."""
    import types

    copy = types.FunctionType(
        fn.__code__, {**fn.__globals__, **overrides}, fn.__name__, fn.__defaults__, fn.__closure__
    )
    copy.__qualname__, copy.__module__, copy.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    copy.__annotations__ = dict(fn.__annotations__)
    return copy
