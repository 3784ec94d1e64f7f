"""The policy is the operator's: a policy file the workload could change is refused.

Modelled on sshd's StrictModes (``secure_filename``): before a byte is read, the path is
followed component by component as the kernel resolves it (the path as given and every
symlink on the way, so both the given path and its realpath), and refused when

- the file is not a regular file, is owned by a workload uid, or is group- or
  other-writable (a workload gid as its group with group write is named as such);
- a directory it passes through is owned by a workload uid, or is writable by a
  workload gid (group write) or by everyone (other write): whoever can write a
  directory can rename or replace what it holds.

One exception: in a sticky directory not owned by the workload (``/tmp``), only an
entry's owner (or the directory's, or root) may rename or remove it, so such a directory
is accepted when the next component is owned by root or the invoking user (the real
uid) and not by the workload. pytest's tmp_path (/tmp/pytest-of-root/...) is one.

Then the file is opened once (``O_NOFOLLOW``, no controlling tty, non-blocking), its
fstat must be the file the walk checked (same device and inode) and pass the file's
checks again, and its bytes are read from that descriptor: what is parsed and hashed is
what was checked, even if the path is swapped meanwhile. POSIX ACLs show in the group
bits (they hold the ACL mask), so an ACL granting write is refused as group-writable.

A refusal is a PolicyError (egressctl exits 2) with one line: what is wrong, and the
command that fixes it.
"""

from __future__ import annotations

import grp
import hashlib
import os
import pwd
import stat
from collections.abc import Container
from dataclasses import dataclass

from egress.errors import Location, PolicyError, Problem
from egress.store.walk import walk

DEFAULT_MAX_BYTES = 1 << 20  # the policy loader refuses more; one byte over is enough


@dataclass(frozen=True)
class TrustedPolicy:
    """A policy file's bytes, read once after its checks; ``sha256`` is their hex digest."""

    path: str
    data: bytes
    sha256: str


def read_policy(
    path: str,
    *,
    workload_uids: Container[int],
    workload_gids: Container[int],
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> TrustedPolicy:
    """The bytes of the policy file ``path`` (at most ``max_bytes`` + 1, so a parser can
    tell it is too large), if no workload uid in ``workload_uids`` or gid in
    ``workload_gids`` could have changed it; else PolicyError naming what is wrong."""
    rules = _Rules(path, workload_uids, workload_gids)
    try:
        real, checked = walk(path, rules.directory)
        rules.file(checked)
        fd = _open(real)
    except OSError as exc:
        raise rules.refuse(f"cannot read: {exc.strerror or exc}") from None
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (checked.st_dev, checked.st_ino):
            raise rules.refuse("was replaced while it was being checked; run the command again")
        rules.file(now)
        data = _read(fd, max_bytes + 1)
    except OSError as exc:
        raise rules.refuse(f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    return TrustedPolicy(path, data, hashlib.sha256(data).hexdigest())


def _open(real: str) -> int:
    # No symlink at the end, no FIFO to block on, no terminal to adopt.
    return os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)


def _read(fd: int, limit: int) -> bytes:
    chunks, size = [], 0
    while size < limit:
        chunk = os.read(fd, min(limit - size, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


class _Rules:
    """The checks, and their messages, for one policy path and one workload."""

    def __init__(self, path: str, uids: Container[int], gids: Container[int]) -> None:
        self.path = path
        self.uids = uids
        self.gids = gids
        # Who may own an entry of a sticky directory: root and the invoking user.
        self.trusted = {u for u in (0, os.getuid()) if u not in uids}

    def refuse(self, message: str) -> PolicyError:
        return PolicyError([Problem(Location(self.path), message)])

    def file(self, st: os.stat_result) -> None:
        if not stat.S_ISREG(st.st_mode):
            raise self.refuse("not a regular file")
        if st.st_uid in self.uids:
            raise self.refuse(f"owned by the workload's user {_user(st.st_uid)}; chown root it")
        group = bool(st.st_mode & stat.S_IWGRP)  # by anyone in the group: not the operator
        if group or st.st_mode & stat.S_IWOTH:
            raise self.refuse(self._writable(st, group, "it"))

    def directory(
        self, here: str, st: os.stat_result, entry: str, entry_st: os.stat_result
    ) -> None:
        if st.st_uid in self.uids:
            raise self.refuse(
                f"directory {here} is owned by the workload's user {_user(st.st_uid)}; "
                f"chown root {here}"
            )
        group = bool(st.st_mode & stat.S_IWGRP) and st.st_gid in self.gids
        if not (group or st.st_mode & stat.S_IWOTH):
            return
        if not st.st_mode & stat.S_ISVTX:
            raise self.refuse(f"directory {here} is " + self._writable(st, group, here))
        if entry_st.st_uid in self.trusted:
            return  # sticky: the workload can neither rename nor replace it there
        raise self.refuse(
            f"{entry} is owned by {_whose(entry_st.st_uid, self.uids)}, in sticky "
            f"directory {here} the workload may write (mode {_mode(st)}); "
            f"chown root {entry}, or keep the policy elsewhere"
        )

    def _writable(self, st: os.stat_result, group: bool, fix: str) -> str:
        other = bool(st.st_mode & stat.S_IWOTH)
        who = []
        if group:
            mine = "the workload's group" if st.st_gid in self.gids else "group"
            who.append(f"{mine} {_group(st.st_gid)}")
        if other:
            who.append("everyone")
        bits = ("g" if group else "") + ("o" if other else "")
        return f"writable by {' and '.join(who)} (mode {_mode(st)}); chmod {bits}-w {fix}"


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def _user(uid: int) -> str:
    try:
        return f"'{pwd.getpwuid(uid).pw_name}' (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _whose(uid: int, workload: Container[int]) -> str:
    if uid in workload:
        return f"the workload's user {_user(uid)}"
    return f"{_user(uid)}, not root or you"


def _group(gid: int) -> str:
    try:
        return f"'{grp.getgrgid(gid).gr_name}'"
    except KeyError:
        return f"gid {gid}"
