"""No privilege back: the seccomp filter and the Landlock domain the workload runs under.

seccomp (libseccomp's Python binding, Debian's python3-seccomp), applied by bubblewrap to
the workload just before it execs:
- no user namespaces: ``unshare``/``clone`` with CLONE_NEWUSER fail with EPERM and
  ``clone3`` with ENOSYS (its flags sit in a struct seccomp can't read; libc falls back
  to ``clone``), as container runtimes' default profiles do. A user namespace would hand
  the workload every capability over a namespace of its own, and with it the kernel's
  least-tested surface;
- no set-user-ID or set-group-ID bits: files the workload writes in the working directory
  are stored as the invoking user's (kernel/idmap.py), so a set-uid bit there would be a
  set-uid program of that user (of root, under plain ``sudo`` as root). chmod-family
  calls and O_CREAT/O_TMPFILE/mknod with S_ISUID or S_ISGID fail with EPERM;
- no ways around the filter or into the host's kernel state that a sandbox never needs:
  io_uring (its operations are not seen by seccomp), openat2 (a struct again: ENOSYS, libc
  falls back to openat), the kernel keyring (not namespaced), bpf, perf_event_open,
  userfaultfd.

Landlock (Linux 6.12+, ABI 6): a domain scoped for signals and abstract Unix sockets, set
on the process that becomes bubblewrap, so everything inside inherits it. It is the
second wall behind the PID namespace: even a process that reached a host pid could not
signal it. Where the kernel lacks it, the PID namespace alone holds.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import struct
import tempfile

from egress.errors import SandboxError

_CLONE_NEWUSER = 0x10000000
_S_ISUID = 0o4000
_S_ISGID = 0o2000
_O_CREAT = 0o100
_O_TMPFILE = 0o20000000  # __O_TMPFILE, without the O_DIRECTORY bit it is paired with

# Syscalls refused outright, with the errno that makes libc and runtimes fall back or
# give up cleanly.
_DENIED = {
    "clone3": errno.ENOSYS,
    "openat2": errno.ENOSYS,
    "io_uring_setup": errno.EPERM,
    "io_uring_enter": errno.EPERM,
    "io_uring_register": errno.EPERM,
    "add_key": errno.EPERM,
    "request_key": errno.EPERM,
    "keyctl": errno.EPERM,
    "bpf": errno.EPERM,
    "perf_event_open": errno.EPERM,
    "userfaultfd": errno.EPERM,
}
# (syscall, index of its mode argument, index of its flags argument or None)
_MODE_SETTERS = (
    ("chmod", 1, None), ("fchmod", 1, None), ("fchmodat", 2, None),
    ("mknod", 1, None), ("mknodat", 2, None), ("creat", 1, None),
    ("open", 2, 1), ("openat", 3, 2),
)  # fmt: skip
_FCHMODAT2 = 452  # Linux 6.6; libseccomp 2.5.4 does not know its name


@functools.cache
def seccomp_program() -> bytes:
    """The compiled BPF program (for ``bwrap --seccomp FD``), built once per process."""
    try:
        import seccomp  # type: ignore[import-not-found]  # Debian's python3-seccomp
    except ImportError:
        raise SandboxError(
            "python3-seccomp is not installed (apt install python3-seccomp; `make setup`)"
        ) from None
    f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    eperm = seccomp.ERRNO(errno.EPERM)
    for name in ("unshare", "clone"):
        f.add_rule(eperm, name, seccomp.Arg(0, seccomp.MASKED_EQ, _CLONE_NEWUSER, _CLONE_NEWUSER))
    for name, err in _DENIED.items():
        f.add_rule(seccomp.ERRNO(err), name)
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), _FCHMODAT2)
    for name, mode_arg, flags_arg in _MODE_SETTERS:
        for bit in (_S_ISUID, _S_ISGID):
            mode = seccomp.Arg(mode_arg, seccomp.MASKED_EQ, bit, bit)
            if flags_arg is None:
                f.add_rule(eperm, name, mode)
                continue
            for create in (_O_CREAT, _O_TMPFILE):
                flags = seccomp.Arg(flags_arg, seccomp.MASKED_EQ, create, create)
                f.add_rule(eperm, name, flags, mode)
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def seccomp_fd() -> int:
    """A fresh readable fd holding the program; bubblewrap reads it once, caller closes."""
    fd = os.memfd_create("egress-seccomp", os.MFD_CLOEXEC)
    os.write(fd, seccomp_program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


# -- Landlock ------------------------------------------------------------------------------

_SYS_LANDLOCK_CREATE_RULESET = 444
_SYS_LANDLOCK_RESTRICT_SELF = 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_SCOPE_ABSTRACT_UNIX_SOCKET = 0x1
_SCOPE_SIGNAL = 0x2
_SCOPED_ABI = 6

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


@functools.cache
def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is absent or disabled."""
    version = int(
        _libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, None, 0, _LANDLOCK_CREATE_RULESET_VERSION)
    )
    return max(version, 0)


class _Scoper:
    """Prepared before fork, called between fork and exec: only raw syscalls there."""

    def __init__(self) -> None:
        attr = struct.pack("QQQ", 0, 0, _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL)
        self._attr = ctypes.create_string_buffer(attr, len(attr))
        self._size = len(attr)

    def __call__(self) -> None:
        fd = _libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, self._attr, self._size, 0)
        if fd < 0 or _libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, fd, 0) != 0:
            os.write(2, b"egress: cannot enter the Landlock domain\n")
            os._exit(126)
        os.close(fd)


def landlock_scoper() -> _Scoper | None:
    """A callable that scopes the calling process, or None where the kernel can't."""
    return _Scoper() if landlock_abi() >= _SCOPED_ABI else None
