"""What the learner never allows: each such name or type becomes a commented-out risk.

- a name the resolver scored as a DNS tunnel, or one shaped like tunnel data (its score
  under the tunnel spec reaches ``name_score``);
- the names of a zone the tunnel scorer flags when the names are replayed to it in the
  order they were first seen (a tunnel's names one by one may look plain: iodine's do;
  together they carry too much). In audit mode a name no rule allows never reached the
  resolver's scorer, so this replay is the only look it gets. Of such a zone only short
  names (at most two labels of at most 15 characters before the zone) whose parent has
  fewer than ``min_siblings`` children stay allowed, with a note: git.example.com
  beside a tunnel under t.example.com;
- a name whose answers pointed inside the machine or its network (rebinding);
- a name that is no valid policy name (a label no host has, an address);
- a data-only record type (NULL, ANY, private use: rrtypes.DATA_ONLY_TYPES) and TXT,
  the tunnels' favourite carriers: the name stays, the type goes, with a note.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from egress.learn.observed import NameSeen
from egress.model import TunnelSpec, ViolationClass
from egress.policy.names import parse_pattern
from egress.policy.rrtypes import is_data_only, type_name
from egress.tunnel.scorer import TunnelScorer

TXT = 16
_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?", re.IGNORECASE)
RISKY_TYPES_NOTE = "data-only record type, a DNS tunnel's carrier"


def risky_type(qtype: int) -> bool:
    return qtype == TXT or is_data_only(qtype)


@dataclass(frozen=True)
class Risk:
    name: str
    why: str
    seen: NameSeen


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def name_risk(seen: NameSeen, scorer: TunnelScorer, spec: TunnelSpec) -> str | None:
    """Why ``seen`` must not be allowed, or None."""
    if ViolationClass.TUNNEL.value in seen.verdicts:
        return "the resolver scored it as a DNS tunnel"
    if ViolationClass.REBINDING.value in seen.risks:
        return "its answers pointed inside the machine or its network (rebinding)"
    try:
        parse_pattern(seen.name)
    except ValueError as exc:
        return f"not a name a policy can allow: {exc}"
    if not seen.name or not all(_LABEL.fullmatch(label) for label in seen.name.split(".")):
        return "not a host name (letters, digits, '-' and '_' in labels of 1-63)"
    qtype = min(seen.types, default=1)
    score = scorer.explain(seen.name, qtype).score
    if score >= spec.name_score:
        return f"tunnel-shaped: score {score:.2f} >= name_score {spec.name_score:g}"
    if seen.types and all(risky_type(t) for t in seen.types):
        kinds = ", ".join(type_name(t) for t in sorted(seen.types))
        return f"asked only for {kinds} ({RISKY_TYPES_NOTE})"
    return None


PLAIN_LABELS = 2
PLAIN_LABEL_CHARS = 15


@dataclass
class Classifier:
    """What ``classify`` decided, and the means to judge one more name the same way (a
    CNAME target the answers brought)."""

    spec: TunnelSpec
    min_siblings: int
    zones: dict[str, str] = field(default_factory=dict)  # flagged zone -> why
    crowded: set[str] = field(default_factory=set)
    scorer: TunnelScorer = field(init=False)

    def __post_init__(self) -> None:
        self.scorer = TunnelScorer(self.spec, _Clock())

    def why(self, seen: NameSeen) -> str | None:
        why = name_risk(seen, self.scorer, self.spec)
        if why is not None:
            return why
        zone = self.scorer.applied(seen.name).zone
        if zone in self.zones:
            flagged = f"{zone}, which the tunnel scorer flags: {self.zones[zone]}"
            if not _plain(seen.name, zone, self.crowded):
                return f"under {flagged}"
            seen.verdicts.add(f"kept, though under {flagged}: review")
        return None


def classify(
    names: list[NameSeen], spec: TunnelSpec | None = None, min_siblings: int = 4
) -> tuple[list[NameSeen], list[Risk], Classifier]:
    """(names the learner may allow, risks, the classifier), each in the order given."""
    spec = spec or TunnelSpec()
    judge = Classifier(spec, min_siblings, tunnel_zones(names, spec),
                       _crowded_parents([n.name for n in names], min_siblings))  # fmt: skip
    keep: list[NameSeen] = []
    risks: list[Risk] = []
    for seen in names:
        why = judge.why(seen)
        if why is None:
            keep.append(seen)
        else:
            risks.append(Risk(seen.name, why, seen))
    return keep, risks, judge


def tunnel_zones(names: list[NameSeen], spec: TunnelSpec) -> dict[str, str]:
    """Zones whose names, replayed in first-seen order, draw a tunnel verdict: why."""
    clock = _Clock()
    scorer = TunnelScorer(spec, clock)
    out: dict[str, str] = {}
    for seen in sorted(names, key=lambda n: (n.first, n.name)):
        clock.now = seen.first
        for qtype in sorted(seen.types) or [1]:
            verdict = scorer.observe_query(seen.name, qtype)
            if verdict is not None and verdict.zone not in out:
                out[verdict.zone] = "; ".join(c.text for c in verdict.reasons)
    return out


def _crowded_parents(names: list[str], min_siblings: int) -> set[str]:
    children: dict[str, int] = {}
    for name in names:
        parent = name.partition(".")[2]
        children[parent] = children.get(parent, 0) + 1
    return {parent for parent, n in children.items() if n >= min_siblings}


def _plain(name: str, zone: str, crowded: set[str]) -> bool:
    sub = name[: -len(zone) - 1] if name != zone else ""
    labels = sub.split(".") if sub else []
    if len(labels) > PLAIN_LABELS or any(len(label) > PLAIN_LABEL_CHARS for label in labels):
        return False
    return name.partition(".")[2] not in crowded
