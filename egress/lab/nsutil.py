"""Sockets, commands, DNS and HTTP probes inside a lab netns, from a process outside it.

A socket belongs to the netns it was created in, for life. So a short-lived thread
setns()es into the lab netns, creates the socket and exits; the calling thread never
changes namespace, and nothing has to switch back (a thread left in the wrong netns by a
failed switch-back is how such helpers go wrong). Python 3.11 has no os.setns: libc's,
via ctypes.
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import threading
from collections.abc import Sequence
from typing import Any

from egress.errors import LabError
from egress.lab.topology import NETNS_DIR

CLONE_NEWNET = 0x40000000


def socket_in_netns(
    netns: str, family: int = socket.AF_INET, kind: int = socket.SOCK_STREAM, proto: int = 0
) -> socket.socket:
    """A new socket living in ``netns`` (a name under /run/netns)."""
    result: list[socket.socket | BaseException] = []

    def enter_and_create() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(NETNS_DIR / netns, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({netns}): {os.strerror(err)}")
            finally:
                os.close(fd)
            result.append(socket.socket(family, kind, proto))
        except BaseException as exc:  # handed to the caller's thread below
            result.append(exc)

    thread = threading.Thread(target=enter_and_create, name=f"netns-{netns}")
    thread.start()
    thread.join()
    outcome = result[0]
    if isinstance(outcome, BaseException):
        raise LabError(f"cannot open a socket in netns {netns}: {outcome}") from outcome
    return outcome


def netns_exec_argv(netns: str, argv: Sequence[str]) -> list[str]:
    """``ip netns exec`` execs in place, so the child's PID is the program's PID."""
    return ["ip", "netns", "exec", netns, *argv]


def run_in_netns(
    netns: str, argv: Sequence[str], timeout: float = 30.0, check: bool = False, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Run a command inside ``netns`` and capture its text output."""
    return subprocess.run(
        netns_exec_argv(netns, argv),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
        **kwargs,
    )


def dns_exchange(
    netns: str, packet: bytes, server: str, *, tcp: bool = False, timeout: float = 2.0
) -> bytes:
    """Send raw DNS bytes to ``server`` port 53 from ``netns``; return the raw reply."""
    family = socket.AF_INET6 if ":" in server else socket.AF_INET
    kind = socket.SOCK_STREAM if tcp else socket.SOCK_DGRAM
    with socket_in_netns(netns, family, kind) as sock:
        sock.settimeout(timeout)
        sock.connect((server, 53))
        if not tcp:
            sock.send(packet)
            return sock.recv(65535)
        sock.sendall(len(packet).to_bytes(2, "big") + packet)
        size = int.from_bytes(_recv_exact(sock, 2), "big")
        return _recv_exact(sock, size)


def dns_probe(netns: str, server: str, timeout: float) -> None:
    """One query (REFUSED is fine): proves the server is listening and answering."""
    query = os.urandom(2) + bytes.fromhex("0100 0001 0000 0000 0000")
    query += b"\x05probe\x0aegress-lab\x07invalid\x00" + b"\x00\x01\x00\x01"
    reply = dns_exchange(netns, query, server, timeout=timeout)
    if reply[:2] != query[:2] or not reply[2] & 0x80:
        raise LabError(f"odd reply from {server}: {reply[:12].hex()}")


def http_get(
    netns: str, addr: str, port: int = 80, path: str = "/", timeout: float = 2.0
) -> tuple[int, str]:
    """HTTP/1.0 GET from ``netns``, read to EOF; (status, body)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket_in_netns(netns, family, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect((addr, port))
        sock.sendall(f"GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n".encode())
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].split()
    if len(status_line) < 2 or not status_line[1].isdigit():
        raise LabError(f"not an HTTP response from {addr}:{port}: {head[:60]!r}")
    return int(status_line[1]), body.decode(errors="replace")


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise LabError("connection closed mid-message")
        data += chunk
    return data
