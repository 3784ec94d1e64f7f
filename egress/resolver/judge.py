"""The one verdict on a DNS query, for both layers.

    wire.Query ─▶ class IN? ─▶ a hostname? ─▶ matcher.decide ─▶ tunnel scorer ─▶ Verdict
                   (no: denied_type)  (no, under an allowed rule: tunnel; else denied_name)

The inline layer's resolver core acts on it (forward, or refuse and report), and the
observer, in its own process with its own matcher and scorer, judges the copy of the same
query the kernel logged: the two layers cannot disagree on what a rule means, and what
makes them independent is separate processes, sockets and journal writers, not two copies
of the rules. Pure: no clock of its own (``now`` comes in), no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from egress.model import DnsRule, Flow, Policy, Violation, ViolationClass
from egress.policy.matcher import Matcher
from egress.policy.rrtypes import type_name
from egress.resolver import wire

NOT_A_HOSTNAME = "a name is letters, digits, '-' and '_'"
ONLY_CLASS_IN = "only class IN is answered"
TUNNEL_RULE = "spec.tunnel"


class TunnelFinding(Protocol):
    def describe(self) -> str: ...


class QueryScorer(Protocol):
    """What the judge needs of a tunnel scorer (``egress.tunnel.TunnelScorer`` fits): it
    sees every allowed query before it is forwarded (or, where ``can_defer`` says no
    verdict can come of it, right after), and the upstream's rcode after."""

    def can_defer(self, name: str, qtype: int) -> bool: ...

    def observe_query(self, name: str, qtype: int) -> TunnelFinding | None: ...

    def observe_response(self, name: str, rcode: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Verdict:
    """``cls`` None: allowed by ``rule``. Else the violation's class, the rule text that
    decided (``reason``) and what a person reads (``detail``); ``rule`` is then the rule
    whose zone the query went through, if any (audit mode forwards under it)."""

    cls: ViolationClass | None
    rule: DnsRule | None
    reason: str = ""
    detail: str = ""

    @property
    def allowed(self) -> bool:
        return self.cls is None

    def violation(
        self,
        q: wire.Query,
        *,
        layer: str,
        policy: Policy,
        at: float,
        flow: Flow | None = None,
        uid: int | None = None,
    ) -> Violation:
        """The violation this verdict is, as ``layer`` saw it (with its evidence)."""
        assert self.cls is not None, "an allowed query is no violation"
        return dns_violation(self.cls, self.reason, self.detail, q.qname, q.qtype,
                             layer=layer, policy=policy, at=at, flow=flow, uid=uid)  # fmt: skip


def dns_violation(
    cls: ViolationClass,
    rule: str,
    detail: str,
    qname: str,
    qtype: int,
    *,
    layer: str,
    policy: Policy,
    at: float,
    flow: Flow | None = None,
    uid: int | None = None,
) -> Violation:
    """A violation about the question ``qname``/``qtype``, spelled the one way both layers
    must: the journal pairs their records by the question (the root as ".", an unknown
    type as the policy writes it, TYPE65399), so a second spelling would be two events."""
    return Violation(
        cls=cls, layer=layer, rule=rule, detail=detail, at=at, action=policy.action(cls),
        flow=flow, uid=uid, qname=qname or ".", qtype=type_name(qtype),
    )  # fmt: skip


def judge(q: wire.Query, matcher: Matcher, scorer: QueryScorer | None) -> Verdict:
    """Allowed (by which rule), denied (why) or a tunnel (what gave it away).

    A denied query never reaches the scorer: it is not forwarded, so it carries nothing
    out. Binary labels are judged by the shape of the name (``wire.hostname_shape``): no
    rule names such a host, so under an allowed zone they are a tunnel's data."""
    if q.qclass != wire.CLASS_IN:
        return _denied(q, ViolationClass.DENIED_TYPE, ONLY_CLASS_IN, f"class {q.qclass}")
    if not wire.is_hostname(q.qname):
        shaped = matcher.decide(wire.hostname_shape(q.qname), q.qtype)
        if shaped.name_allowed and shaped.rule is not None:
            return tunnel(q, wire.BinaryName(q.qname, shaped.rule.describe()), shaped.rule)
        return _denied(q, ViolationClass.DENIED_NAME, NOT_A_HOSTNAME, "not a hostname")
    decision = matcher.decide(q.qname, q.qtype)
    if decision.allowed:
        finding = scorer.observe_query(q.qname, q.qtype) if scorer is not None else None
        if finding is not None:
            return tunnel(q, finding, decision.rule)
        return Verdict(None, decision.rule)
    cls = ViolationClass.DENIED_TYPE if decision.name_allowed else ViolationClass.DENIED_NAME
    return _denied(q, cls, decision.reason, "")


def several_messages(q: wire.Query) -> Verdict:
    """A copied UDP packet that is more than one plain query (``wire.one_plain_query``):
    what the resolver reads as several queries, a packet filter's copy holds as one."""
    detail = (f"query {q.qname or '.'} {type_name(q.qtype)}: more than one DNS message "
              "in one UDP packet (UDP GSO): the resolver reads each, a copy the first")  # fmt: skip
    return Verdict(ViolationClass.TUNNEL, None, TUNNEL_RULE, detail)


def tunnel(q: wire.Query, finding: TunnelFinding, rule: DnsRule | None) -> Verdict:
    detail = f"query {q.qname} {type_name(q.qtype)}: {finding.describe()}"
    return Verdict(ViolationClass.TUNNEL, rule, TUNNEL_RULE, detail)


def _denied(q: wire.Query, cls: ViolationClass, reason: str, extra: str) -> Verdict:
    detail = f"query {q.qname or '.'} {type_name(q.qtype)}" + (f" ({extra})" if extra else "")
    return Verdict(cls, None, reason, detail)
