"""The seccomp program the workload runs under, loaded into a child and tried for real.

Each call runs in a forked child that sets no_new_privs and loads the program exactly
as bubblewrap would (``bwrap --seccomp FD`` takes these bytes), then reports the errno
each syscall gave. No root needed for the filter itself; the user-namespace probe needs
unprivileged user namespaces (or root) to succeed without the filter, which the control
child checks first.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import struct
import tempfile

import pytest

from egress.kernel import confine

seccomp = pytest.importorskip("seccomp", reason="python3-seccomp (Debian) is not installed")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
CLONE_NEWUSER = 0x10000000
SYS = {"clone3": 435, "io_uring_setup": 425, "openat2": 437, "fchmodat2": 452}


def _load(program: bytes) -> None:
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("HL", len(program) // 8, ctypes.addressof(buf))
    prog = ctypes.create_string_buffer(fprog, len(fprog))
    if _libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        os._exit(90)
    if _libc.prctl(22, 2, ctypes.c_void_p(ctypes.addressof(prog)), 0, 0) != 0:  # SET_SECCOMP
        os._exit(91)


def _errno(result: int) -> int:
    return 0 if result >= 0 else ctypes.get_errno()


def _probe(directory: str) -> dict[str, int]:
    out: dict[str, int] = {}
    plain = os.path.join(directory, "plain")
    with open(plain, "w"):
        pass
    for name, mode in (("chmod_755", 0o755), ("chmod_suid", 0o4755), ("chmod_sgid", 0o2755)):
        out[name] = _errno(_libc.chmod(plain.encode(), mode))
    flags = os.O_CREAT | os.O_WRONLY
    for name, mode in (("create_644", 0o644), ("create_suid", 0o4755)):
        path = os.path.join(directory, name).encode()
        fd = _libc.open(path, flags, mode)
        out[name] = _errno(fd)
        if fd >= 0:
            os.close(fd)
    out["open_plain_rdonly"] = _errno(_libc.open(plain.encode(), os.O_RDONLY, 0o4755))
    out["unshare_user"] = _errno(_libc.unshare(CLONE_NEWUSER))
    out["clone3"] = _errno(_libc.syscall(SYS["clone3"], None, 0))
    out["io_uring_setup"] = _errno(_libc.syscall(SYS["io_uring_setup"], 1, None))
    out["openat2"] = _errno(_libc.syscall(SYS["openat2"], -100, b"/", None, 0))
    out["fchmodat2"] = _errno(_libc.syscall(SYS["fchmodat2"], -100, plain.encode(), 0o755, 0))
    return out


def _in_child(program: bytes | None) -> dict[str, int]:
    r, w = os.pipe()
    with tempfile.TemporaryDirectory() as directory:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                os.close(r)
                if program is not None:
                    _load(program)
                os.write(w, json.dumps(_probe(directory)).encode())
            finally:
                os._exit(0)
        os.close(w)
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        os.close(r)
        os.waitpid(pid, 0)
    result: dict[str, int] = json.loads(data)
    return result


def test_the_filter_refuses_user_namespaces_setuid_bits_and_bypasses() -> None:
    control = _in_child(None)
    assert control["chmod_suid"] == 0 and control["create_suid"] == 0
    got = _in_child(confine.seccomp_program())
    assert got["chmod_755"] == 0 and got["create_644"] == 0  # ordinary work goes on
    assert got["open_plain_rdonly"] == 0  # a mode without O_CREAT means nothing
    assert got["chmod_suid"] == got["chmod_sgid"] == errno.EPERM
    assert got["create_suid"] == errno.EPERM
    if control["unshare_user"] == 0:
        assert got["unshare_user"] == errno.EPERM
    assert got["clone3"] == errno.ENOSYS  # libc falls back to clone, whose flags are seen
    assert got["openat2"] == errno.ENOSYS and got["fchmodat2"] == errno.ENOSYS
    assert got["io_uring_setup"] == errno.EPERM


def test_the_program_is_built_once_and_handed_over_in_a_memfd() -> None:
    assert confine.seccomp_program() is confine.seccomp_program()
    fd = confine.seccomp_fd()
    try:
        assert os.read(fd, 1 << 20) == confine.seccomp_program()
    finally:
        os.close(fd)
