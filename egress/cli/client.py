"""egressctl's HTTP client for egressd's API, over its unix socket.

It lives in egress.cli rather than in egress.daemon: egressctl talks to egressd only
over its socket (an import-linter contract forbids egress.cli to import egress.daemon),
and a stdlib HTTP connection over AF_UNIX is all it takes. ``Client.call`` returns the
decoded JSON; anything else is a ``DaemonError``: egressd unreachable (no socket, no
permission), or its JSON refusal with the status.
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any

from egress.errors import DaemonError
from egress.store.paths import run_dir

TIMEOUT_S = 120.0


def default_socket() -> str:
    return str(run_dir() / "egressd.sock")


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("egressd", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class Client:
    """egressd's API over its unix socket; ``call`` returns the decoded JSON."""

    def __init__(self, path: str | None = None, timeout: float = TIMEOUT_S) -> None:
        self.path = path or default_socket()
        self.timeout = timeout

    def call(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        status, data = self.request(method, url, body)
        if status >= 400:
            message = data.get("error") if isinstance(data, dict) else str(data)
            raise DaemonError(f"egressd: {message}", status, data)
        return data

    def request(self, method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        conn = _UnixConnection(self.path, self.timeout)
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        try:
            conn.request(method, url, payload, headers)
            resp = conn.getresponse()
            raw = resp.read()
        except PermissionError:
            raise DaemonError(f"{self.path}: permission denied (not in egressd's group?)") from None
        except (FileNotFoundError, ConnectionRefusedError):
            raise DaemonError(f"{self.path}: egressd is not running (no socket)") from None
        except OSError as exc:
            raise DaemonError(f"{self.path}: {exc}") from None
        finally:
            conn.close()
        ctype = resp.getheader("Content-Type", "")
        return resp.status, json.loads(raw) if "json" in ctype else raw.decode()
