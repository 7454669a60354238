"""Who may read what under a directory, from the mode bits alone (no ACLs): the check the privacy tests make."""

from __future__ import annotations

import os
import stat


def exposed_below(top) -> list[str]:
    """Every file and directory below ``top`` that a user other than its owner can read (``"0644 /path"`` each),
    taking ``top`` as open to everyone: every directory on the way must grant that user's class (group or others)
    search (x), the entry read (r)."""
    exposed = []
    enter = {str(top): 0o011}  # per directory, the x bits (group 0o010, others 0o001) of the classes that can enter it
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            mode = stat.S_IMODE(os.lstat(path).st_mode)
            if (enter[dirpath] << 2) & mode:  # a class in dirpath has r on the entry (x shifted onto r)
                exposed.append(f"{mode:04o} {path}")
            if name in dirnames:
                enter[path] = enter[dirpath] & mode
    return exposed
