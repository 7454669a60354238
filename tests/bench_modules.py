"""In-process access to bench/'s modules for the benchmark's unit tests.

bench/ is not a package: its modules import each other by plain name (``from case import ...``) with bench/ on
``sys.path``, as when it runs as a script. These names are generic, so they are put on the path only while the
tests import them, checked to come from bench/, and removed from ``sys.modules`` afterwards.
"""

from __future__ import annotations

import contextlib
import importlib
import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"


@contextlib.contextmanager
def bench_modules(*names: str):
    """Yields the named bench modules (a list, in order); unloads every bench module afterwards."""
    before = set(sys.modules)
    sys.path.insert(0, str(BENCH))
    try:
        modules = [importlib.import_module(name) for name in names]
        for m in modules:
            assert pathlib.Path(m.__file__).parent == BENCH, f"{m.__name__} resolved to {m.__file__}, not bench/"
        yield modules
    finally:
        sys.path.remove(str(BENCH))
        for name in set(sys.modules) - before:
            if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(BENCH)):
                del sys.modules[name]
