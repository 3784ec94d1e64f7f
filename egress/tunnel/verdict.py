"""The scorer's output: a verdict on one zone, with the figures that crossed each limit."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Crossing:
    """One limit that a zone's window crossed."""

    rule: str  # the TunnelSpec field that set the limit, e.g. "info_bytes"
    value: float
    limit: float
    text: str  # for a person: "unique subdomain text 1,830 B in 30 s > 1,536 B"

    def to_json(self) -> dict[str, object]:
        return {"rule": self.rule, "value": self.value, "limit": self.limit, "text": self.text}


@dataclass(frozen=True, slots=True)
class TunnelVerdict:
    """Tunnelling under ``zone``: neither the query ``name`` nor later ones are forwarded."""

    zone: str  # registered domain
    name: str  # the query that tipped the balance (not forwarded)
    qtype: int
    at: float  # the scorer's clock at the verdict (monotonic in the resolver and observer)
    score: float  # largest value/limit over the crossed rules (>= 1.0)
    reasons: tuple[Crossing, ...]
    queries_before: int  # queries under the zone forwarded before the verdict
    bytes_before: int  # subdomain text those queries carried upstream (repeats scored included)
    unique_before: int  # distinct subdomains among them
    types: tuple[tuple[str, int], ...]  # record-type mix of the zone's queries

    def describe(self) -> str:
        why = "; ".join(c.text for c in self.reasons)
        return (
            f"DNS tunnel suspected under {self.zone}: {why} "
            f"({self.queries_before} queries, {self.bytes_before:,} B of subdomain text "
            f"forwarded before the verdict)"
        )

    def to_json(self) -> dict[str, object]:
        return {
            "zone": self.zone,
            "name": self.name,
            "qtype": self.qtype,
            "at": self.at,
            "score": round(self.score, 3),
            "reasons": [c.to_json() for c in self.reasons],
            "queries_before": self.queries_before,
            "bytes_before": self.bytes_before,
            "unique_before": self.unique_before,
            "types": dict(self.types),
        }
