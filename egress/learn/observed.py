"""Journal audit rows, folded over sandboxes: one entry per name and per destination."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

ALLOWED = "allowed"


@dataclass
class NameSeen:
    name: str
    types: dict[int, int] = field(default_factory=dict)  # qtype -> queries
    verdicts: set[str] = field(default_factory=set)
    risks: set[str] = field(default_factory=set)  # from answers: "rebinding", ...
    chain: list[str] = field(default_factory=list)  # CNAME targets its answers led to
    sandboxes: set[str] = field(default_factory=set)
    first: float = float("inf")
    last: float = 0.0
    ports: set[tuple[str, int]] = field(default_factory=set)  # (proto, port) connected

    @property
    def count(self) -> int:
        return sum(self.types.values())


@dataclass
class ConnectSeen:
    address: str
    proto: str
    port: int
    count: int = 0
    verdict: str = ALLOWED
    names: list[str] = field(default_factory=list)  # whose answers gave the address
    asked: list[str] = field(default_factory=list)  # what its flows asked for (SNI, Host)
    sandboxes: set[str] = field(default_factory=set)
    first: float = float("inf")
    last: float = 0.0


@dataclass
class Observed:
    names: dict[str, NameSeen] = field(default_factory=dict)
    connects: dict[tuple[str, str, int], ConnectSeen] = field(default_factory=dict)
    sandboxes: set[str] = field(default_factory=set)
    overflow_names: int = 0
    overflow_connects: int = 0

    @property
    def first(self) -> float:
        times = [n.first for n in self.names.values()] + [c.first for c in self.connects.values()]
        return min(times, default=0.0)

    @property
    def last(self) -> float:
        times = [n.last for n in self.names.values()] + [c.last for c in self.connects.values()]
        return max(times, default=0.0)


def collect(
    names: Iterable[Mapping[str, Any]],
    connects: Iterable[Mapping[str, Any]],
    overflow: Mapping[str, int] | None = None,
) -> Observed:
    """Fold ``audit_names`` and ``audit_connects`` rows. A connect's port goes to the
    names its flows asked for (TLS SNI, HTTP Host: the check read them), else to every
    name whose answer gave its address (one address may serve many names)."""
    out = Observed()
    for row in names:
        seen = out.names.setdefault(row["name"], NameSeen(row["name"]))
        qtype = int(row["qtype"])
        seen.types[qtype] = seen.types.get(qtype, 0) + int(row["count"])
        seen.verdicts.add(row["verdict"])
        seen.risks.update(row.get("risks") or ())
        seen.chain.extend(t for t in row.get("chain") or () if t not in seen.chain)
        _span(seen, row)
        out.sandboxes.add(row["sandbox_id"])
    for row in connects:
        key = (row["address"], row["proto"], int(row["port"]))
        c = out.connects.setdefault(key, ConnectSeen(*key))
        c.count += int(row["count"])
        if row["verdict"] != ALLOWED:
            c.verdict = row["verdict"]
        c.names.extend(n for n in row.get("names") or () if n not in c.names)
        c.asked.extend(n for n in row.get("asked") or () if n not in c.asked)
        _span(c, row)
        out.sandboxes.add(row["sandbox_id"])
        asked = [n for n in row.get("asked") or () if n in (row.get("names") or ())]
        for name in asked or row.get("names") or ():
            if name in out.names:
                out.names[name].ports.add((row["proto"], int(row["port"])))
    if overflow:
        out.overflow_names = int(overflow.get("names", 0))
        out.overflow_connects = int(overflow.get("connects", 0))
    return out


def _span(seen: NameSeen | ConnectSeen, row: Mapping[str, Any]) -> None:
    seen.sandboxes.add(row["sandbox_id"])
    seen.first = min(seen.first, float(row["first_seen"]))
    seen.last = max(seen.last, float(row["last_seen"]))
