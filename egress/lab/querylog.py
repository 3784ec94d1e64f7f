"""The lab DNS server's query log: one JSON line per packet received, before any parsing.

Invariant 2 (a denied query never leaves the host) is tested by reading this log: the lab's
DNS server plays "the internet", so a name absent here never arrived upstream. That is
why every packet is logged first, including garbage, and why each line is flushed at once.

A line: ``{"ts": 1764520000.123, "proto": "udp", "src": "198.18.0.1", "sport": 40000,
"qname": "Allowed.lab.test", "qtype": "A", "bytes": 34}``. ``qname`` keeps the received
bytes exactly (case, odd characters) decoded as latin-1, labels joined by "." with no
trailing dot; it is null when the packet holds no readable question. ``qtype`` is the
mnemonic ("AAAA", "TYPE65399" for unknown ones), null with qname.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Any

from dnslib import QTYPE

from egress.lab.dnsmsg import RawQuestion


def qtype_name(qtype: int) -> str:
    """The mnemonic, or RFC 3597's TYPEnnn for types dnslib does not know."""
    name = QTYPE.forward.get(qtype)
    return name if isinstance(name, str) else f"TYPE{qtype}"


def entry(
    packet: bytes, proto: str, src: tuple[Any, ...], question: RawQuestion | None
) -> dict[str, Any]:
    """The log record of one received packet."""
    return {
        "ts": round(time.time(), 6),
        "proto": proto,
        "src": str(src[0]) if src else None,
        "sport": int(src[1]) if len(src) > 1 else None,
        "qname": question.name if question else None,
        "qtype": qtype_name(question.qtype) if question else None,
        "bytes": len(packet),
    }


class JsonLines:
    """Appends entries to a file, one flushed line each (the query log, the access log)."""

    def __init__(self, path: str | Path) -> None:
        # Append mode: the lab may truncate the file underneath us and writes still land.
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        # ASCII-only JSON: a name's raw bytes may include \x85 or \u2028, which some line
        # splitters (str.splitlines among them) would take for line ends.
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_json_lines(path: str | Path) -> list[dict[str, Any]]:
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


QueryLog = JsonLines  # each line is flushed before the query is handled
read_query_log = read_json_lines
