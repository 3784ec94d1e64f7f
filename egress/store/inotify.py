"""inotify(7): which names in one directory changed since the last look.

egressd keeps the claims directory's holdings in memory (store/claims.py) and learns
what other processes changed from here, instead of reading 1,000 claim files' worth of
directory at every create. The kernel queues an event in the changing process's
syscall, before it returns: whatever another process changed before it released a lock
we then take is in the queue when we read it under that lock.
"""

from __future__ import annotations

import ctypes
import os
import struct

_libc = ctypes.CDLL(None, use_errno=True)

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
# A name's content or presence: made, replaced (rename onto it), written, removed.
_NAMES = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE
_NAMES |= IN_DELETE
# The directory itself is gone, or the kernel dropped events: nothing can be trusted.
_LOST = IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT | IN_Q_OVERFLOW | IN_IGNORED
_HEADER = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (+ name)


class DirWatch:
    """The names in ``path`` that changed: ``changes()`` since the last call."""

    def __init__(self, path: str) -> None:
        fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        mask = _NAMES | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR
        if _libc.inotify_add_watch(fd, os.fsencode(path), mask) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"inotify_add_watch {path}: {os.strerror(err)}")
        self._fd = fd
        self._lost = False

    def changes(self) -> set[str] | None:
        """Names changed since the last call (or since the watch began); None if the
        kernel lost events or the directory went, then and from now on: read it whole,
        and watch it anew."""
        names: set[str] = set()
        while not self._lost:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                break
            at = 0
            while at < len(data):
                _wd, mask, _cookie, size = _HEADER.unpack_from(data, at)
                at += _HEADER.size
                if mask & _LOST:
                    self._lost = True
                elif size:
                    names.add(os.fsdecode(data[at : at + size].rstrip(b"\0")))
                at += size
        return None if self._lost else names

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
