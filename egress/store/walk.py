"""Follow a path the way the kernel resolves it, one entry at a time.

Both checks of paths an operator gives walk them so: ``store.trust`` (may the workload
have changed this policy file?) looks at every directory passed through, and
``sandbox.view`` (did a workload plant a symlink on the way?) at every link taken. A
relative path starts at the current directory; each symlink's target is walked in turn
(from / when absolute); ``..`` steps back to the parent of where the walk is.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable

MAX_LINKS = 40  # as the kernel's ELOOP limit

# visit(directory, its lstat, entry, its lstat), for every entry the walk takes
Visit = Callable[[str, os.stat_result, str, os.stat_result], None]


def walk(path: str, visit: Visit) -> tuple[str, os.stat_result]:
    """The real path of ``path`` and its lstat; OSError (ENOENT, ENOTDIR, ELOOP, ...) as
    the kernel would give it, after visiting what was passed on the way there."""
    start = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    todo = _parts(start)
    here, here_st = "/", os.lstat("/")
    links = 0
    while todo:
        name = todo.pop(0)
        if name == "..":
            here = os.path.dirname(here)
            here_st = os.lstat(here)
            continue
        entry = os.path.join(here, name)
        st = os.lstat(entry)
        visit(here, here_st, entry, st)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
            target = os.readlink(entry)
            if target.startswith("/"):
                here, here_st = "/", os.lstat("/")
            todo = _parts(target) + todo
            continue
        if todo and not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        here, here_st = entry, st
    return here, here_st


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]
