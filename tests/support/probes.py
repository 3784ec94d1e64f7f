"""Looking at a sandbox from outside: its resolver, its allow sets, and waiting on a
condition (frozen, journaled, a line in a log) rather than sleeping and hoping."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable

from egress.kernel.nft import NftHandle

POLL_S = 0.02


def dig(netns: str, name: str, server: str = "127.0.0.53") -> str:
    """``dig +short`` from inside ``netns`` (one try of 2 s): the answer lines."""
    argv = ["ip", "netns", "exec", netns, "dig", "+short", "+tries=1", "+time=2", f"@{server}"]
    done = subprocess.run([*argv, name], capture_output=True, text=True, timeout=20)
    return "\n".join(x for x in done.stdout.splitlines() if not x.startswith(";;")).strip()


def set_ips(netns: str) -> set[str]:
    """The addresses in the sandbox's ``allow4`` set (elements are ip . proto . port)."""
    with NftHandle.open(netns) as nft:
        return {e["key"].split(" . ")[0] for e in nft.list_set("inet", "egress", "allow4")}


def wait_until(condition: Callable[[], object], seconds: float = 10.0) -> bool:
    """Whether ``condition()`` came true within ``seconds`` (checked once more at the end)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(POLL_S)
    return bool(condition())


def drain(sock: socket.socket) -> int:
    """How many datagrams were waiting on non-blocking ``sock``, all read."""
    n = 0
    while True:
        try:
            sock.recv(65535)
        except BlockingIOError:
            return n
        n += 1
