"""The ``fs`` tier's ``root_dir``: checked when the configuration is (:func:`check_root_dir`), and private before vLLM's
tier writes to it (:func:`make_private_root_dir`, :func:`warn_if_shared`). KV bytes reveal the prompts they were
computed from, and a block file of the right size is loaded without question. vLLM's ``fs`` tier creates a missing
``root_dir`` and the directories below it with the process umask (0755 under the usual 022) and writes its block files
0644, so any local user could read other tenants' conversations. Here a missing ``root_dir`` (and every directory
created on the way to it) is created 0700 first: nothing below it is reachable by anyone but its owner, whatever modes
vLLM uses inside. An existing ``root_dir`` is left as it is, with a warning when its group or others have access; one
this process cannot write is refused, naming the permission, before anything is built. No vLLM import: plain paths.
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
    """``value`` as a path that is, or can become, a directory this process can write: every part of it that exists
    is a directory, and the deepest existing one (``root_dir`` itself, or where it would be created) is writable.

    Side-effect free (also run where the configuration is only read, before the model loads). A path the filesystem
    refuses to create for other reasons (one under ``/proc``) passes here and is refused by
    :func:`make_private_root_dir`.

    Raises:
        ValueError: not a non-empty path, a path that is a file or passes through one, or one whose deepest existing
            directory this process cannot write (naming the path, this process's user, the directory's owner and
            mode); the message names ``where`` and the value.
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
    if not _writable(existing):
        job = "create it below" if missing else "write its block files below"
        raise ValueError(
            f"{where} = {value!r}: {existing!r} is not writable and searchable by this process ({_whom()}; it is "
            f"{_owner_and_mode(existing)}), so the fs tier cannot {job} it. Give the user vLLM runs as write and "
            "search permission on it (the one service user every instance sharing it runs as: docs/tiering.md, "
            "'Security and trust model'), or choose a directory it owns"
        )
    return path


def _writable(path: str) -> bool:
    """Whether this process may create entries in the directory ``path`` (write and search permission), as the kernel
    decides for its effective ids; also False on a read-only filesystem."""
    effective = os.access in os.supports_effective_ids
    return os.access(path, os.W_OK | os.X_OK, effective_ids=effective)


def _whom() -> str:
    uid = os.geteuid()
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _owner_and_mode(path: str) -> str:
    st = os.stat(path)
    try:
        import pwd

        owner = f"{st.st_uid} ({pwd.getpwuid(st.st_uid).pw_name})"
    except (ImportError, KeyError):
        owner = str(st.st_uid)
    readonly = ", on a read-only filesystem" if os.statvfs(path).f_flag & os.ST_RDONLY else ""
    return f"owned by uid {owner}, mode {stat.S_IMODE(st.st_mode):04o}{readonly}"


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
