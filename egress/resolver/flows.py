"""The verdict on a new TCP flow's first bytes: does it ask for a name that allowed it?

``datapath.firstbytes`` reads the name a flow's first client bytes ask for (TLS SNI,
HTTP/1.x Host) or the reason there is none; ``bindings`` knows which names put the flow's
address into this sandbox's sets. A flow passes only if its name is one the policy
allows and one this sandbox resolved to that address, still within the answer's
timeout. Anything else is a ``name_mismatch``, with a reason code:

- what ``firstbytes`` refused: ``no_sni``, ``ip_literal``, ``ech``, ``malformed``,
  ``too_long``, ``host_conflict``, ``no_host``, ``http2_prior_knowledge``,
  ``unknown_protocol``;
- ``name_not_allowed``: no rule allows the name;
- ``incomplete``, ``overlap`` (``firstrequest``): no complete first request within the
  bounds, or segments that overlap with different bytes;
- ``not_resolved_here``: allowed, but no answer in this sandbox put this address in its
  sets for that name on this port (the address came from another name, whose rule
  allows other ports; or from another sandbox; or the answer's timeout has passed).

Pure, like ``judge``: the same function for each layer that checks a flow.
"""

from __future__ import annotations

from dataclasses import dataclass

from egress.datapath.firstbytes import FirstBytes, Outcome
from egress.model import Flow, IPAddress, Mode, Policy, Violation, ViolationClass
from egress.policy.matcher import Matcher
from egress.resolver.answer import learned_ports
from egress.resolver.bindings import Bindings

SHOWN = 8  # names of the address a mismatch's detail lists (a CDN's may be hundreds)


@dataclass(frozen=True, slots=True)
class FlowVerdict:
    allowed: bool
    name: str | None  # the name the flow asks for, when it names one
    reason: str  # "" when allowed, else a code (module docstring)
    detail: str  # for a person: the flow, the name, what was wrong


def judge_flow(
    first: FirstBytes,
    dst: IPAddress,
    dport: int,
    bindings: Bindings,
    matcher: Matcher,
    now: float,
) -> FlowVerdict:
    """The verdict on a flow to ``dst``:``dport`` whose first bytes gave ``first`` (a
    NAME or a REFUSE: the caller waits while it is NEED_MORE)."""
    if first.outcome is Outcome.NEED_MORE:
        raise ValueError("judge_flow needs a complete first request, not NEED_MORE")
    where = f"{first.protocol or 'a flow'} to {endpoint(dst, dport)}"
    if first.outcome is Outcome.REFUSE or first.name is None:
        return FlowVerdict(False, None, first.reason or "malformed", f"{where}: {first.detail}")
    name = first.name
    rule = matcher.rule_for(name)
    if rule is None:
        return FlowVerdict(False, name, "name_not_allowed",
                           f"{where} asks for {name}: no rule allows it")  # fmt: skip
    if not bindings.bound(dst, name, dport, now) and not (
        bindings.inherited(dst, dport, now)
        and learned_ports(rule, matcher.policy).allows("tcp", dport)
    ):
        others = bindings.names(dst, now)
        shown = ", ".join(others[:SHOWN]) + (
            f" and {len(others) - SHOWN} more" if len(others) > SHOWN else ""
        )
        resolved = f"resolved for {shown}" if others else "resolved for no name now"
        return FlowVerdict(False, name, "not_resolved_here",
                           f"{where} asks for {name}: this sandbox never resolved it to "
                           f"{dst} for port {dport}, or no longer does (the address is "
                           f"{resolved})")  # fmt: skip
    return FlowVerdict(True, name, "", f"{where} asks for {name}")


def flow_violation(
    verdict: FlowVerdict,
    policy: Policy,
    matcher: Matcher,
    flow: Flow,
    uid: int | None,
    at: float,
    layer: str,
) -> Violation:
    """The ``name_mismatch`` a refused flow is, as ``layer`` saw it: both layers spell it
    this one way (the journal pairs their records)."""
    if verdict.allowed:
        raise ValueError("an allowed flow is no violation")
    if verdict.reason == "name_not_allowed":
        rule = "spec.dns.allow: no rule allows the name the flow asks for"
    elif verdict.reason == "not_resolved_here" and verdict.name is not None:
        found = matcher.rule_for(verdict.name)
        rule = f"{found.describe() if found else 'spec.dns.allow'}: only where it resolved"
    else:
        rule = "spec.connect.check_names: a flow names its host (TLS SNI, HTTP Host)"
    verb = "allowed (audit)" if policy.mode is Mode.AUDIT else "refused"
    who = f" (uid {uid})" if uid is not None else ""
    cls = ViolationClass.NAME_MISMATCH
    return Violation(
        cls=cls, layer=layer, rule=rule, detail=f"{verdict.detail} [{verdict.reason}]: "
        f"{verb}{who}", at=at, action=policy.action(cls), flow=flow, uid=uid,
        qname=verdict.name,
    )  # fmt: skip


def endpoint(ip: IPAddress, port: int) -> str:
    """``ip:port``, the IPv6 address in brackets."""
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
