"""The ``fs`` tier's ``root_dir``: checked when the configuration is, and private before vLLM's tier writes to it.

KV bytes reveal the prompts they were computed from, and a block file of the right size is loaded without question.
vLLM's ``fs`` tier creates a missing ``root_dir`` and the directories below it with the process umask (0755 under
the usual 022) and writes its block files 0644, so any local user could read other tenants' conversations. Here a
missing ``root_dir`` (and every directory created on the way to it) is created 0700 first: nothing below it is
reachable by anyone but its owner, whatever modes vLLM uses inside. An existing ``root_dir`` is left as it is, with a
warning when its group or others have access. No vLLM import: plain paths.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import Any

__all__ = ["check_root_dir", "make_private_root_dir", "warn_if_shared"]

logger = logging.getLogger(__name__)

PRIVATE_MODE = 0o700


def _split_existing(path: str) -> tuple[str, list[str]]:
    """(the longest part of ``path`` that exists, the parts below it that do not, innermost first), on the absolute
    path with ``..`` taken lexically."""
    existing, missing = os.path.abspath(path), []
    while not os.path.lexists(existing):
        missing.append(existing)
        existing = os.path.dirname(existing)
    return existing, missing


def check_root_dir(value: Any, where: str) -> str:
    """``value`` as a path that is, or can become, a directory: every part of it that exists is a directory.

    Side-effect free (also run where the configuration is only read). A path the filesystem refuses to create (one
    under ``/proc``, a read-only mount) passes here and is refused by :func:`make_private_root_dir`.

    Raises:
        ValueError: not a non-empty path, or a path that is a file or passes through one; the message names
            ``where``, the value and the offending part.
    """
    try:
        path = os.fspath(value)
    except TypeError:
        path = None
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where} = {value!r} must be a directory path (a non-empty string)")
    existing, missing = _split_existing(path)
    if not os.path.isdir(existing):
        part = f"passes through {existing!r}, which is" if missing else "is"
        raise ValueError(f"{where} = {value!r} {part} not a directory: the fs tier needs a directory for its files")
    return path


def make_private_root_dir(path: str, where: str) -> None:
    """Creates the missing directories of ``path``, outermost first, each with mode 0700 (set explicitly: ``mkdir``'s
    mode is masked by the umask), and logs those it created. Another process of the same instance may create them at
    the same time.

    Raises:
        ValueError: a directory could not be created (``path`` under ``/proc``, on a read-only filesystem, ...) or
            ``path`` is not a directory; the message names ``where``, the value and the system's reason.
    """
    _, missing = _split_existing(path)
    created = []
    for part in reversed(missing):
        try:
            os.mkdir(part, PRIVATE_MODE)
        except FileExistsError:
            continue  # created meanwhile, by another process of this instance or by someone else: checked below
        except OSError as e:
            raise ValueError(f"{where} = {path!r} cannot be created: mkdir {part!r} failed: {e.strerror}") from e
        os.chmod(part, PRIVATE_MODE)
        created.append(part)
    if not os.path.isdir(os.path.abspath(path)):
        raise ValueError(f"{where} = {path!r} is not a directory: the fs tier needs a directory for its files")
    if created:
        logger.info("created %s = %r with mode 0700 (%s)", where, path, ", ".join(created))


def warn_if_shared(path: str, where: str) -> None:
    """Logs a warning when the existing directory ``path`` grants its group or others any access."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if not mode & 0o077:
        return
    who = " and ".join(name for name, bits in (("its group", 0o070), ("other users", 0o007)) if mode & bits)
    logger.warning(
        "%s = %r has mode %04o: %s may reach the KV files below it. Whoever can read them can read the prompts they "
        "came from; whoever can write them can change other users' outputs (a block file of the right size is "
        "loaded without error). Make it 0700, owned by the one service user every instance sharing it runs as "
        "(docs/tiering.md, 'Security and trust model')",
        where,
        path,
        mode,
        who,
    )
