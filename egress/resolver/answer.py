"""Filter an upstream answer before any of it reaches the sandbox.

Only the CNAME chain that starts at the question is kept, and every name in it must be
allowlisted (a CNAME is not a way out); records of types the rule does not allow are
removed; A/AAAA records pointing at rebinding targets are dropped; SVCB/HTTPS records lose
their ECH keys and address hints (``svcb``). The addresses that remain are what the
kernel's sets will allow.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, replace

from dnslib import QTYPE

from egress.model import DnsRule, IPAddress, Policy, Ports, ViolationClass
from egress.policy.matcher import Matcher
from egress.resolver import svcb
from egress.resolver.message import AAAA, CNAME, HTTPS, SOA, SVCB, A, Record, Response
from egress.resolver.rebinding import rebinding_reason
from egress.resolver.wire import NOERROR, NXDOMAIN, SERVFAIL
from egress.tunnel.labels import under_no_real_tld


@dataclass(frozen=True)
class Finding:
    """Something the filter removed or refused, to be reported as a violation."""

    cls: ViolationClass
    rule: str
    detail: str


@dataclass
class Filtered:
    rcode: int
    answers: list[Record] = field(default_factory=list)
    authority: list[Record] = field(default_factory=list)
    ips: list[tuple[IPAddress, int]] = field(default_factory=list)  # (address, ttl)
    findings: list[Finding] = field(default_factory=list)
    refused: bool = False  # the whole answer is withheld (denied CNAME target)

    def min_ttl(self) -> int:
        ttls = [rr.ttl for rr in self.answers + self.authority]
        return min(ttls) if ttls else 0

    def negative_ttl(self) -> int | None:
        """RFC 2308: a negative answer lives min(SOA TTL, SOA MINIMUM); no SOA, no caching."""
        for rr in self.authority:
            if rr.rtype == SOA:
                return min(rr.ttl, rr.soa_minimum())
        return None


def filter_answer(
    response: Response, qname: str, qtype: int, rule: DnsRule, matcher: Matcher, policy: Policy
) -> Filtered:
    rcode = response.rcode
    if rcode not in (NOERROR, NXDOMAIN):
        return Filtered(SERVFAIL if rcode != 5 else rcode)
    out = Filtered(rcode)
    chain = _follow_chain(response.answers, qname, rule, matcher, out)
    if out.refused:
        return out
    for rr in response.answers:
        if rr.name not in chain or rr.rtype == CNAME:
            continue  # outside the chain: not an answer to this question
        _keep_record(rr, qtype, rule, policy, out)
    out.authority = [rr for rr in response.authority if rr.rtype == SOA]
    return out


def _cname_out(current: str, target: str) -> Finding:
    """A CNAME leaving the allowlist: refused. Pointing under no real top-level domain,
    it can only be data (a DNS tunnel's downstream), so it is a tunnel, not a typo."""
    if under_no_real_tld(target):
        return Finding(ViolationClass.TUNNEL, "spec.tunnel",
                       f"CNAME {current} -> {target}: data in a CNAME target "
                       "(no real top-level domain answers there)")  # fmt: skip
    return Finding(ViolationClass.DENIED_NAME, f"no rule matches {target!r}",
                   f"CNAME {current} -> {target}: the target is not allowlisted")  # fmt: skip


def _follow_chain(
    records: list[Record], qname: str, rule: DnsRule, matcher: Matcher, out: Filtered
) -> set[str]:
    """Names on the CNAME chain from qname, within this answer only."""
    cnames = {rr.name: rr for rr in records if rr.rtype == CNAME}
    chain, current = [qname], qname
    while current in cnames and len(chain) <= 16:
        rr = cnames[current]
        target = rr.target
        if target in chain:
            break  # a loop: stop where it closes
        if not matcher.rule_for(target):
            out.refused = True
            out.findings.append(_cname_out(current, target))
            return set()
        if CNAME not in rule.types:
            out.refused = True
            out.findings.append(Finding(
                ViolationClass.DENIED_TYPE, rule.describe(),
                f"CNAME {current} -> {target}: {rule.describe()} does not allow CNAME",
            ))  # fmt: skip
            return set()
        out.answers.append(rr)
        chain.append(target)
        current = target
    return set(chain)


def learned_ports(rule: DnsRule | None, policy: Policy) -> Ports:
    """Where addresses learned through ``rule`` may be reached: its own ``ports``, else
    ``connect.ports``."""
    if rule is None or rule.ports.is_empty():
        return policy.connect.ports
    return rule.ports


def record_ip(rr: Record) -> IPAddress:
    if rr.rtype == A:
        return ipaddress.IPv4Address(rr.rdata)
    return ipaddress.IPv6Address(rr.rdata)


def _keep_record(rr: Record, qtype: int, rule: DnsRule, policy: Policy, out: Filtered) -> None:
    if rr.rtype != qtype and qtype != 255:
        return  # an extra the question did not ask for
    if rr.rtype not in rule.types:
        out.findings.append(Finding(
            ViolationClass.DENIED_TYPE, rule.describe(),
            f"removed {QTYPE.get(rr.rtype, rr.rtype)} record of {rr.name}",
        ))  # fmt: skip
        return
    if rr.rtype in (A, AAAA):
        ip = record_ip(rr)
        why = (
            rebinding_reason(ip, policy.dns.rebinding_exempt) if policy.dns.rebinding_deny else None
        )
        if why:
            out.findings.append(Finding(
                ViolationClass.REBINDING, "dns.rebinding: deny",
                f"dropped {rr.name} -> {ip}: {why}",
            ))  # fmt: skip
            return
        out.ips.append((ip, rr.ttl))
    elif rr.rtype in (SVCB, HTTPS):
        rdata = svcb.for_sandbox(rr.rdata, learned_ports(rule, policy))
        if rdata is None:
            return  # the client goes by the name's A/AAAA records (see ``svcb``)
        rr = replace(rr, rdata=rdata)
    out.answers.append(rr)
