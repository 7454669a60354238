"""A fix for Triton < 3.7's interpreter under NumPy >= 2.4, applied only on those versions.

Triton 3.6's interpreter holds every scalar as a 1-element array and turns it into a Python int with ``int(array)``,
which NumPy 2.4 rejects for arrays that are not 0-d: every loop with a run-time bound then fails with "only
0-dimensional arrays can be converted to Python scalars". Triton 3.7 squeezes the array first; on older versions we
install the same conversion on the interpreter's tensor patch. Compiled kernels are not affected.
"""

from __future__ import annotations

import triton

_FIXED_IN = (3, 7)


def _version(v: str) -> tuple[int, int]:
    major, minor = (v.split("+")[0].split(".") + ["0"])[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def patch_interpreter_scalar_index() -> bool:
    """Makes the interpreter's scalar-to-int conversion squeeze first; True if a patch was installed."""
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
