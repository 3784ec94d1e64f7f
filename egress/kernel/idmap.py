"""Idmapped bind mounts: a host directory as the workload sees it, owned by the workload.

The workload runs under a uid of its own, yet the working directory it writes in belongs
to the person who started it. An idmapped mount (Linux 5.12+, ext4/xfs/btrfs/tmpfs…)
shows files of the invoking user's uid as the workload's uid, and stores what the
workload writes under the invoking user's uid, with no chown pass afterwards and nothing
to undo on disk: files the workload leaves behind are simply the user's.

The idmapping is a user namespace made only to describe it: a short-lived child process
unshares one, root writes its uid_map and gid_map ("HOST_ID WORKLOAD_ID 1": ids on disk
are read as ids inside that namespace, then mapped down), and its /proc/PID/ns/user fd is
what ``mount_setattr(MOUNT_ATTR_IDMAP)`` takes. The tree is cloned with ``open_tree``
(this one mount only: submounts are not carried into the view) and attached with
``move_mount`` at a path under the sandbox's workload directory (<workloads dir>/ID/mnt/),
from where bubblewrap binds it.
"""

from __future__ import annotations

import ctypes
import os
import struct
from dataclasses import dataclass

from egress.errors import SandboxError

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

# Syscall numbers of the new mount API are the same on every architecture (asm-generic).
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_MOUNT_SETATTR = 442
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_OPEN_TREE_CLONE = 1
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_CLONE_NEWUSER = 0x10000000
_MNT_DETACH = 2

MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
_MOUNT_ATTR_IDMAP = 0x00100000


@dataclass(frozen=True)
class IdMap:
    """Files of ``host_uid``/``host_gid`` appear as ``inner_uid``/``inner_gid``."""

    host_uid: int
    host_gid: int
    inner_uid: int
    inner_gid: int


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise SandboxError(f"{what}: {os.strerror(err)}")
    return result


def mapping_userns(idmap: IdMap) -> int:
    """An fd of a user namespace that maps host ids to the workload's; caller closes it."""
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(ready_r)
            os.close(done_w)
            ok = _libc.unshare(_CLONE_NEWUSER) == 0
            os.write(ready_w, b"1" if ok else b"0")
            os.read(done_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(done_r)
    try:
        if os.read(ready_r, 1) != b"1":
            raise SandboxError("idmapped mount: cannot create a user namespace for the idmap")
        for name, line in (
            ("uid_map", f"{idmap.host_uid} {idmap.inner_uid} 1\n"),
            ("gid_map", f"{idmap.host_gid} {idmap.inner_gid} 1\n"),
        ):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(line)
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise SandboxError(f"idmapped mount: {exc}") from None
    finally:
        os.close(ready_r)
        os.close(done_w)  # the child exits; the fd keeps its namespace alive
        os.waitpid(pid, 0)


def mount_idmapped(source: str, target: str, idmap: IdMap, attrs: int) -> None:
    """Attach ``source`` at ``target`` (an existing empty directory), idmapped.

    ``attrs``: MOUNT_ATTR_* flags to set besides the idmap (read-only, nosuid, nodev).
    """
    userns = mapping_userns(idmap)
    try:
        tree = _check(
            _libc.syscall(
                _SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(source), _OPEN_TREE_CLONE | os.O_CLOEXEC
            ),
            f"{source}: open_tree",
        )
        try:
            attr = struct.pack("QQQQ", _MOUNT_ATTR_IDMAP | attrs, 0, 0, userns)
            _check(
                _libc.syscall(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH, attr, len(attr)),
                f"{source}: cannot idmap this filesystem (needs Linux 5.12+ and a filesystem "
                "that supports idmapped mounts, e.g. ext4, xfs, btrfs)",
            )
            _check(
                _libc.syscall(
                    _SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, os.fsencode(target),
                    _MOVE_MOUNT_F_EMPTY_PATH,
                ),
                f"{target}: move_mount",
            )  # fmt: skip
        finally:
            os.close(tree)
    finally:
        os.close(userns)


def unmount(target: str) -> None:
    """Detach the mount at ``target``; nothing to do when none is there."""
    if _libc.umount2(os.fsencode(target), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not a mount point; ENOENT: gone
            raise SandboxError(f"{target}: umount: {os.strerror(err)}")
