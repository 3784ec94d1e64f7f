"""The lab web server's access log: one JSON line per HTTP request answered.

The query log (querylog.py) shows which names reached the lab's DNS server; this log shows
which requests reached its web server, so a test can prove that a real tool (pip, npm,
git) fetched what it was expected to fetch and nothing else. Each line is flushed before
the response goes out.

A line: ``{"ts": 1764520000.123, "remote": "198.18.0.1", "local": "203.0.113.11:80",
"tls": false, "sni": null, "host": "pypi.lab.test", "method": "GET",
"path": "/simple/egress-lab-hello/", "status": 200, "bytes": 312, "agent": "pip/23.0.1 ..."}``.
``host`` is the Host header as sent (port stripped, lower case); ``sni`` is the TLS server
name the client sent, null over plain HTTP or when it sent none; ``path`` keeps the query.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Any


def entry(
    *,
    remote: str,
    local: str,
    tls: bool,
    sni: str | None,
    host: str,
    method: str,
    path: str,
    status: int,
    size: int,
    agent: str,
) -> dict[str, Any]:
    """The log record of one request."""
    return {
        "ts": round(time.time(), 6),
        "remote": remote,
        "local": local,
        "tls": tls,
        "sni": sni,
        "host": host,
        "method": method,
        "path": path,
        "status": status,
        "bytes": size,
        "agent": agent,
    }


class AccessLog:
    """Appends entries to a file, one flushed line each."""

    def __init__(self, path: str | Path) -> None:
        # Append mode: the lab may truncate the file underneath us and writes still land.
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_access_log(path: str | Path) -> list[dict[str, Any]]:
    """Every entry so far, oldest first. A partly written last line is skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    out = []
    for line in text.split("\n"):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the last line, mid-write (or an empty tail)
    return out
