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

import time
from typing import Any

from egress.lab.querylog import JsonLines, read_json_lines


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


AccessLog = JsonLines  # each line is flushed before the response goes out
read_access_log = read_json_lines
