"""The ``/dev/shm`` name of vLLM's ``SharedOffloadRegion``, removed on every exit path (:class:`RegionName`). The region
is host memory: a file left in ``/dev/shm`` keeps its pages allocated until someone deletes it. vLLM's tiering maps the
region by name in the scheduler and in each worker with no barrier between them, so the process that created it keeps
the name until its own clean shutdown; one that dies, or an engine whose startup fails before shutdown is reached,
leaves the file behind. :class:`RegionName` closes those paths. No vLLM import: plain files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from typing import Any

__all__ = ["RegionName", "region_paths", "unlink_paths"]

logger = logging.getLogger(__name__)

# Run by a child interpreter (python -I -S: no site, no environment): waits until its stdin reaches end of file,
# which happens when the process that created the region exits (cleanly, on an error, or killed: the kernel closes
# the pipe's write end), then removes the region's files, unless the first name now belongs to another file.
_GUARD_SCRIPT = """
import os, sys
paths, dev, ino = sys.argv[1:-2], int(sys.argv[-2]), int(sys.argv[-1])
sys.stdin.buffer.read()
try:
    st = os.stat(paths[0])
    ours = (st.st_dev, st.st_ino) == (dev, ino)
except OSError:
    ours = True
for path in paths if ours else ():
    try:
        os.unlink(path)
    except OSError:
        pass
"""


def region_paths(region: Any) -> list[str]:
    """The ``/dev/shm`` files behind a region: one in vLLM 0.32; vLLM 0.33 may split a region into segments."""
    segments = getattr(region, "_segments", None)
    return [path for path, _, _ in segments] if segments else [region.mmap_path]


def unlink_paths(paths: list[str]) -> bool:
    """Removes the names; True if any still existed."""
    removed = False
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed = True
    return removed


class RegionName:
    """Removes a shared region's ``/dev/shm`` name on every exit path of the process that created it:

    - the scheduler removes the name as soon as it has mapped the region (vLLM builds the scheduler after every
      worker has registered its KV caches, so nobody opens it by name after that; see ``TritonTieringOffloadingSpec``);
    - the creating process starts a guard: a tiny child interpreter that removes the name when the creator's end of a
      pipe closes, which the kernel does however the creator exits, SIGKILL included;
    - :meth:`release` removes it at once (worker shutdown, or an error while starting).

    Removing a name never disturbs the processes that have mapped the region: mappings outlive the name.

    Args:
        region: the ``SharedOffloadRegion``, just constructed.
        take_over: make this object, not vLLM's ``cleanup()``, responsible for the name when this process created
            it (the worker side: a name already removed by the scheduler would otherwise be removed twice).
    """

    def __init__(self, region: Any, *, take_over: bool):
        self.paths = region_paths(region)
        self.created = bool(getattr(region, "_creator", False))
        self._guard: subprocess.Popen | None = None
        if take_over and self.created:
            region._creator = False  # vLLM's cleanup would unlink it too; the name is ours to remove now
        if self.created:
            self._guard = self._start_guard()

    def _start_guard(self) -> subprocess.Popen | None:
        try:
            st = os.stat(self.paths[0])
        except FileNotFoundError:  # already removed (by the scheduler in the same process)
            return None
        # A new session: a Ctrl-C or SIGTERM sent to the engine's process group must not end the guard before its
        # creator, or nobody would remove the name.
        return subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _GUARD_SCRIPT, *self.paths, str(st.st_dev), str(st.st_ino)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def unlink_now(self) -> bool:
        """Removes the name now (the guard then exits with nothing to do). True if it still existed."""
        return unlink_paths(self.paths)

    def release(self) -> None:
        """Removes the name if this process created it, and ends the guard."""
        if self.created:
            self.unlink_now()
        guard, self._guard = self._guard, None
        if guard is not None:
            with contextlib.suppress(OSError):
                guard.stdin.close()
            try:
                guard.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - it only stats and unlinks
                logger.warning("the /dev/shm guard process %d did not exit; leaving it", guard.pid)
