"""What learning would add to and remove from an existing policy, and why.

    + an entry the audit runs needed that the policy does not allow (a name, a type of
      it, a port connected, a static destination), with the evidence
    - a rule of the policy no audit query or connect used, with where it is written
    ! a risk the policy allows (a tunnel-shaped name, a rebinding answer, TXT, ...)

Judged with the policy's own matcher, the way the resolver would decide.
"""

from __future__ import annotations

import ipaddress

from egress.learn.draft import Draft, evidence
from egress.learn.observed import Observed
from egress.learn.risks import risky_type
from egress.model import Policy, Ports
from egress.policy.matcher import Matcher
from egress.policy.rrtypes import type_name
from egress.resolver.answer import learned_ports


def against(draft: Draft, seen: Observed, policy: Policy) -> list[str]:
    """The lines of the diff; empty when the policy already says what was learned."""
    matcher = Matcher(policy)
    used: set[int] = set()
    out: list[str] = []
    for name in sorted(draft.names()):
        n = seen.names.get(name)
        types = sorted(t for t in (n.types if n else {1: 0}) if not risky_type(t)) or [1]
        missing = []
        for qtype in types:
            d = matcher.decide(name, qtype)
            if d.rule is not None and d.allowed:
                used.add(d.rule.index)
                ports = learned_ports(d.rule, policy)
                for proto, port in sorted(n.ports if n else ()):
                    if not ports.allows(proto, port):
                        missing.append(f"port {proto}/{port} ({d.rule.describe()} allows"
                                       f" {_ports_text(ports)})")  # fmt: skip
            else:
                missing.append(f"{type_name(qtype)} ({d.reason})")
        if missing and n is not None:
            why = evidence(n.count, "queries", n)
            out.append(f"+ {name}: {'; '.join(dict.fromkeys(missing))}; seen: {why}")
        elif missing:
            out.append(f"+ {name}: {'; '.join(missing)}; a CNAME target of a learned name")
    for name, why, ev in draft.risks:
        n = seen.names.get(name)
        if n is not None and any(matcher.decide(name, t).allowed for t in n.types):
            out.append(f"! {name}: the policy allows it, but {why}; seen: {ev}")
    for rule in policy.dns.allow:
        if rule.index not in used:
            out.append(f"- {rule.describe()} ({rule.where}): no audit query needed it")
    out += _statics(draft, policy)
    return out


def _statics(draft: Draft, policy: Policy) -> list[str]:
    out = []
    used: set[int] = set()
    for s in draft.statics:
        address = ipaddress.ip_address(s.address)
        for port in s.ports:
            hit = next(
                (r for r in policy.connect.allow
                 if address in r.network and r.ports.allows(s.proto, port)),
                None,
            )  # fmt: skip
            if hit is None:
                out.append(f"+ connect.allow {s.address} {s.proto}/{port}: no DNS answer"
                           f" named it; seen: {s.evidence}")  # fmt: skip
            else:
                used.add(hit.index)
    for rule in policy.connect.allow:
        if rule.index not in used:
            out.append(f"- {rule.describe()} ({rule.where}): no audit connect needed it")
    return out


def _ports_text(ports: Ports) -> str:
    tcp = ", ".join(str(r) for r in ports.tcp)
    udp = ", ".join(str(r) for r in ports.udp)
    parts = [f"tcp {tcp}"] if tcp else []
    parts += [f"udp {udp}"] if udp else []
    return "; ".join(parts) or "no ports"
