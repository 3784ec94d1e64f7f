"""The demo's scripted "agent": what a coding agent might try, as plain socket calls.

Runs inside the sandbox as an unprivileged user with Debian's python3 and the standard
library only. Prints one JSON line per step for `egressctl demo` to narrate.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Callable
from typing import Any


def step(name: str, fn: Callable[[], dict[str, Any]]) -> None:
    start = time.monotonic()
    out: dict[str, Any] = {"step": name}
    try:
        out.update(fn())
        out["ok"] = True
    except OSError as exc:
        out["ok"] = False
        out["error"] = exc.strerror or str(exc) or type(exc).__name__
    out["ms"] = round((time.monotonic() - start) * 1000, 1)
    print(json.dumps(out), flush=True)


def resolve(name: str) -> list[str]:
    infos = socket.getaddrinfo(name, 80, socket.AF_INET, socket.SOCK_STREAM)
    return sorted({str(i[4][0]) for i in infos})


def http_get(address: str, name: str) -> str:
    with socket.create_connection((address, 80), timeout=3) as s:
        s.sendall(b"GET / HTTP/1.0\r\nHost: " + name.encode() + b"\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return data.split(b"\r\n\r\n", 1)[-1].decode(errors="replace").strip()


def fetch(name: str) -> dict[str, Any]:
    addresses = resolve(name)
    return {"addresses": addresses, "body": http_get(addresses[0], name)}


def main() -> None:
    allowed, denied, rebind, direct = sys.argv[1:5]
    step("fetch-allowed", lambda: fetch(allowed))
    # The allowed name's address, asked for another name: what a CDN would answer.
    step("other-name", lambda: {"body": http_get(resolve(allowed)[0], denied)})
    step("resolve-denied", lambda: {"addresses": resolve(denied)})
    step("resolve-rebinding", lambda: {"addresses": resolve(rebind)})
    step("connect-direct", lambda: {"body": http_get(direct, direct)})


if __name__ == "__main__":
    main()
