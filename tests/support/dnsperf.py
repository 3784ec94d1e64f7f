"""dnsperf's summary, parsed: what the load tests assert on."""

from __future__ import annotations

import re
from typing import Any


def figures(text: str) -> dict[str, Any]:
    """Queries sent, completed and lost, and the response codes with their counts."""
    out: dict[str, Any] = {}
    for key, pattern in (("sent", r"Queries sent:\s+(\d+)"),
                         ("completed", r"Queries completed:\s+(\d+)"),
                         ("lost", r"Queries lost:\s+(\d+)")):  # fmt: skip
        m = re.search(pattern, text)
        assert m is not None, text
        out[key] = int(m.group(1))
    m = re.search(r"Response codes:\s+(.*)", text)
    out["rcodes"] = dict(re.findall(r"(\w+) (\d+) \(", m.group(1))) if m else {}
    return out
