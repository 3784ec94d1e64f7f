"""Observations to a draft policy: rules with their evidence, static destinations, risks.

The least the audit runs needed: exact names as seen (patterns only by
``siblings.group``), per rule the record types asked (CNAME where an answer went
through one) and the ports connected to. A destination no answer named becomes a
``connect.allow`` entry, flagged for review. Risks (``risks.classify``) are kept aside:
the writer prints them commented out.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from egress.learn.observed import ConnectSeen, NameSeen, Observed
from egress.learn.risks import RISKY_TYPES_NOTE, Classifier, Risk, classify, risky_type
from egress.learn.siblings import DEFAULT_MIN_SIBLINGS, Group, group
from egress.model import Policy
from egress.policy.matcher import Matcher
from egress.policy.rrtypes import type_name
from egress.resolver.answer import learned_ports
from egress.resolver.rebinding import rebinding_reason

CNAME = 5


@dataclass(frozen=True)
class Rule:
    pattern: str
    types: tuple[str, ...]
    tcp: tuple[int, ...]
    udp: tuple[int, ...]
    evidence: str
    members: tuple[str, ...]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Static:
    address: str
    proto: str
    ports: tuple[int, ...]
    evidence: str


@dataclass(frozen=True)
class Draft:
    rules: tuple[Rule, ...]
    statics: tuple[Static, ...]
    risks: tuple[tuple[str, str, str], ...]  # (name or destination, why, evidence)
    sandboxes: tuple[str, ...]
    first: float
    last: float
    overflow_names: int = 0
    overflow_connects: int = 0
    in_base: tuple[str, ...] = ()  # names seen that the base policy already allows

    def names(self) -> set[str]:
        return {m for r in self.rules for m in r.members}


@dataclass
class _Merged:
    types: set[int] = field(default_factory=set)
    ports: set[tuple[str, int]] = field(default_factory=set)
    count: int = 0
    sandboxes: set[str] = field(default_factory=set)
    first: float = float("inf")
    last: float = 0.0
    notes: list[str] = field(default_factory=list)


def make_draft(
    seen: Observed, base: Policy | None = None, min_siblings: int = DEFAULT_MIN_SIBLINGS
) -> Draft:
    spec = base.tunnel if base is not None else None
    asked = sorted(seen.names.values(), key=lambda n: n.name)
    keep, risks, judge = classify(asked, spec, min_siblings)
    kept = {n.name: n for n in keep}
    targets = _chain_targets(kept, risks, judge)
    in_base: list[str] = []
    if base is not None:
        matcher = Matcher(base)
        for table in (kept, targets):
            for name in list(table):
                if _base_allows(matcher, base, table[name]):
                    in_base.append(name)
                    del table[name]
    risky = [r.name for r in risks]
    groups = _safe(group(list(kept), min_siblings), risky, judge.zones)
    rules = [_rule(g.pattern, [kept[m] for m in g.members]) for g in groups]
    rules += [_rule(t.name, [t]) for t in targets.values()]  # exact: never a pattern's sibling
    learned = {m for r in rules for m in r.members} | set(in_base)
    statics, connect_risks = _statics(seen.connects.values(), learned)
    risk_rows = [(r.name, r.why, evidence(r.seen.count, "queries", r.seen)) for r in risks]
    return Draft(
        rules=tuple(rules), statics=statics, risks=(*risk_rows, *connect_risks),
        sandboxes=tuple(sorted(seen.sandboxes)), first=seen.first, last=seen.last,
        overflow_names=seen.overflow_names, overflow_connects=seen.overflow_connects,
        in_base=tuple(sorted(in_base)),
    )  # fmt: skip


def _chain_targets(
    kept: dict[str, NameSeen], risks: list[Risk], judge: Classifier
) -> dict[str, NameSeen]:
    """The CNAME targets kept names' answers led to: enforce refuses a chain leaving the
    rules, so each must be allowed too, and each is judged like an asked name (the
    upstream chose it). A name whose chain goes through a risk is a risk itself."""
    risky = {r.name for r in risks}
    targets: dict[str, NameSeen] = {}
    for seen in list(kept.values()):
        bad = []
        for target in seen.chain:
            if target in kept or target in targets:
                continue
            if target not in risky:
                types = {q: 0 for q in seen.types if not risky_type(q)}
                t = NameSeen(target, types=types, sandboxes=set(seen.sandboxes),
                             first=seen.first, last=seen.last)  # fmt: skip
                t.verdicts.add(f"CNAME target of {seen.name}")
                why = judge.why(t)
                if why is None:
                    targets[target] = t
                    continue
                risks.append(Risk(target, f"a CNAME target of {seen.name}: {why}", t))
                risky.add(target)
            bad.append(target)
        if bad:
            del kept[seen.name]
            risks.append(Risk(seen.name, f"its answers lead through {', '.join(bad)},"
                              " set aside", seen))  # fmt: skip
    still = {target for seen in kept.values() for target in seen.chain}
    for name in [t for t in targets if t not in still]:
        del targets[name]  # its asker became a risk after it was taken
    return targets


def _safe(groups: list[Group], risky: list[str], zones: dict[str, str]) -> list[Group]:
    """No pattern may match a name set aside as a risk, or reach into or over a zone the
    tunnel scorer flags: such a group is written as its exact names."""
    out: list[Group] = []
    for g in groups:
        if g.pattern.startswith("*") and (
            any(_covers(g.pattern, name) for name in risky) or _overlaps(g.pattern, zones)
        ):
            out.extend(Group(m, (m,)) for m in g.members)
        else:
            out.append(g)
    return out


def _covers(pattern: str, name: str) -> bool:
    star, _, suffix = pattern.partition(".")
    if not name.endswith("." + suffix):
        return False
    extra = name[: -len(suffix) - 1].count(".") + 1
    return extra >= 1 if star == "**" else extra == 1


def _overlaps(pattern: str, zones: dict[str, str]) -> bool:
    suffix = pattern.partition(".")[2]
    return any(suffix == z or suffix.endswith("." + z) or z.endswith("." + suffix) for z in zones)


def _base_allows(matcher: Matcher, base: Policy, seen: NameSeen) -> bool:
    """The base policy allows every type asked and every port connected for this name."""
    types = [t for t in seen.types if not risky_type(t)] or [1]
    decisions = [matcher.decide(seen.name, t) for t in types]
    if not all(d.allowed for d in decisions):
        return False
    ports = learned_ports(decisions[0].rule, base)
    return all(ports.allows(proto, port) for proto, port in seen.ports)


def _rule(pattern: str, members: list[NameSeen]) -> Rule:
    m = _Merged()
    for seen in members:
        for qtype, count in seen.types.items():
            if risky_type(qtype):
                m.notes.append(f"{seen.name} {type_name(qtype)} asked {count}x: not allowed"
                               f" ({RISKY_TYPES_NOTE})")  # fmt: skip
            else:
                m.types.add(qtype)
        if seen.chain:
            m.types.add(CNAME)
        m.ports |= seen.ports
        m.count += seen.count
        m.sandboxes |= seen.sandboxes
        m.first, m.last = min(m.first, seen.first), max(m.last, seen.last)
        m.notes.extend(
            f"{seen.name}: {v}" if v.startswith("kept") else v
            for v in sorted(seen.verdicts) if v.startswith(("CNAME target", "kept"))
        )  # fmt: skip
    if not m.types:
        m.types.add(1)
    what = evidence(m.count, "queries", m) if m.count else "not asked itself"
    if len(members) > 1:
        what = f"{len(members)} names seen ({', '.join(s.name for s in members)}); {what}"
    return Rule(
        pattern=pattern, types=tuple(sorted((type_name(t) for t in m.types), key=_type_order)),
        tcp=tuple(sorted(p for proto, p in m.ports if proto == "tcp")),
        udp=tuple(sorted(p for proto, p in m.ports if proto == "udp")),
        evidence=what, members=tuple(s.name for s in members), notes=tuple(m.notes),
    )  # fmt: skip


_TYPE_ORDER = {"A": 0, "AAAA": 1, "CNAME": 2, "HTTPS": 3, "SVCB": 4}


def _type_order(name: str) -> tuple[int, str]:
    return (_TYPE_ORDER.get(name, 9), name)


def _statics(
    connects: Iterable[ConnectSeen], learned: set[str]
) -> tuple[tuple[Static, ...], list[tuple[str, str, str]]]:
    """Destinations no learned name explains: static entries (no answer named them), or
    risks (only a risky name's answer did, the address is inside the machine or its
    network, or the protocol is neither TCP nor UDP)."""
    by_dest: dict[tuple[str, str], list[ConnectSeen]] = {}
    risks: list[tuple[str, str, str]] = []
    for c in sorted(connects, key=lambda c: (c.address, c.proto, c.port)):
        where = f"{c.address} {c.proto}/{c.port}"
        stray = [n for n in c.asked if n not in c.names]
        if stray:
            why = (f"its flows asked for {', '.join(stray)}, which no answer for this address"
                   " named: enforce refuses them (name_mismatch)")  # fmt: skip
            risks.append((where, why, evidence(c.count, "connects", c)))
        if any(n in learned for n in c.names):
            continue
        refused = _static_risk(c)
        if refused is not None:
            risks.append((where, refused, evidence(c.count, "connects", c)))
            continue
        by_dest.setdefault((c.address, c.proto), []).append(c)
    statics = []
    for (address, proto), group_ in by_dest.items():
        m = _Merged()
        for c in group_:
            m.count += c.count
            m.sandboxes |= c.sandboxes
            m.first, m.last = min(m.first, c.first), max(m.last, c.last)
        ports = tuple(sorted(c.port for c in group_))
        statics.append(Static(address, proto, ports, evidence(m.count, "connects", m)))
    return tuple(statics), risks


def _static_risk(c: ConnectSeen) -> str | None:
    if c.names:
        return f"its address came only from answers to {', '.join(c.names)}, set aside above"
    if c.proto not in ("tcp", "udp"):
        return f"protocol {c.proto}: egress allows TCP and UDP destinations"
    try:
        inside = rebinding_reason(ipaddress.ip_address(c.address))
    except ValueError:
        return "not an IP address"
    if inside is not None:
        return f"no DNS answer named it, and it is {inside}: never a static destination"
    return None


def evidence(count: int, what: str, seen: NameSeen | ConnectSeen | _Merged) -> str:
    """``3 queries in 2 sandboxes, <span>``; ``what`` is a plural ending in s or ies."""
    n = len(seen.sandboxes)
    if count == 1:
        what = what[:-3] + "y" if what.endswith("ies") else what[:-1]
    return f"{count} {what} in {n} sandbox{'es' if n != 1 else ''}, {span(seen.first, seen.last)}"


def span(first: float, last: float) -> str:
    """``2026-12-02 03:10:05 .. 03:12:40 UTC`` (the date once if it is the same)."""
    a, b = stamp(first), stamp(last)
    if a[:10] == b[:10]:
        b = b[11:]
    return f"{a} .. {b} UTC"


def stamp(at: float) -> str:
    if at in (float("inf"), 0.0):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at))
