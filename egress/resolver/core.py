"""The resolver as a state machine: bytes and ``now`` in, actions out.

    query ─parse─▶ cache hit? ─▶ Reply (refreshing the sets if they would lapse first)
                 └▶ matcher: denied? ─▶ Report + NXDOMAIN/REFUSED (never forwarded)
                 └▶ allowed ─▶ Forward (our own ID, lowercased name, our EDNS)
    upstream reply ─▶ filter (chain, types, rebinding) ─▶ AllowThenReply (sets first)

No sockets and no clock of its own: the shells (the sandbox's asyncio server, egressd)
perform the actions and call back with upstream replies and failures.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, field

from dnslib import QTYPE, DNSHeader, DNSQuestion, DNSRecord

from egress.datapath.elements import SetUpdate, clamp_ttl, plan_update
from egress.model import DeniedResponse, DnsRule, Mode, Policy, Ports, Violation, ViolationClass
from egress.policy.matcher import Matcher
from egress.resolver import cache as cache_mod
from egress.resolver import wire
from egress.resolver.actions import Action, AllowThenReply, Forward, Reply, Report
from egress.resolver.answer import AAAA, A, Filtered, Finding, filter_answer
from egress.resolver.cache import Cache, Entry


@dataclass
class Waiter:
    client: object
    query: wire.Query
    max_size: int


@dataclass
class Pending:
    token: int
    qid: int
    qname: str
    qtype: int
    rule: DnsRule | None  # None: a denied name forwarded only because of audit mode
    waiters: list[Waiter] = field(default_factory=list)
    upstream: int = 0
    tcp: bool = False


class ResolverCore:
    def __init__(
        self,
        policy: Policy,
        n_upstreams: int,
        randbits: Callable[[int], int],
        cache_size: int = 10_000,
    ) -> None:
        self.n_upstreams = n_upstreams
        self.randbits = randbits
        self.cache = Cache(cache_size)
        self.pending: dict[int, Pending] = {}
        self.inflight: dict[bytes, int] = {}
        self.stats: dict[str, int] = dict.fromkeys(
            ("queries", "allowed", "denied", "cache_hits", "forwarded", "servfail", "malformed"),
            0,
        )
        self._next_token = 0
        self.set_policy(policy)

    def set_policy(self, policy: Policy) -> None:
        """Swap the policy; cached answers were decided under the old one, so they go."""
        self.policy = policy
        self.matcher = Matcher(policy)
        self.audit = policy.mode is Mode.AUDIT
        self.cache.clear()

    # -- queries -------------------------------------------------------------------------

    def on_query(self, data: bytes, client: object, tcp: bool, now: float) -> list[Action]:
        self.stats["queries"] += 1
        try:
            q = wire.parse_query(data)
        except wire.WireError as exc:
            return self._malformed(data, client, exc)
        max_size = 65535 if tcp else (q.edns_size or wire.MAX_UDP_NO_EDNS)
        entry = self.cache.get(q.key, now)
        if entry is not None:
            self.stats["cache_hits"] += 1
            self.stats["allowed"] += 1
            return self._from_cache(entry, q, client, now, max_size)
        return self._decide(q, Waiter(client, q, max_size), now)

    def _malformed(self, data: bytes, client: object, exc: wire.WireError) -> list[Action]:
        self.stats["malformed"] += 1
        if exc.rcode is None:
            return []
        reply = wire.header_error(data, exc.rcode)
        return [Reply(client, reply)] if reply else []

    def _from_cache(
        self, entry: Entry, q: wire.Query, client: object, now: float, max_size: int
    ) -> list[Action]:
        data = cache_mod.render(entry, q, now, max_size)
        remaining = entry.remaining(now)
        if entry.update is None or entry.allowed_until >= now + remaining:
            return [Reply(client, data)]
        # The kernel would forget these addresses before the client stops using the answer.
        timeout = clamp_ttl(remaining, self.policy)
        entry.allowed_until = now + timeout
        update = plan_update_refresh(entry, timeout)
        return [AllowThenReply(update, ((client, data, self._servfail(q)),))]

    def _decide(self, q: wire.Query, waiter: Waiter, now: float) -> list[Action]:
        if q.qclass != wire.CLASS_IN:
            return self._deny(q, waiter, now, ViolationClass.DENIED_TYPE,
                              "only class IN is answered", f"class {q.qclass}")  # fmt: skip
        decision = self.matcher.decide(q.qname, q.qtype)
        if decision.allowed:
            self.stats["allowed"] += 1
            return self._forward(q, waiter, decision.rule)
        cls = ViolationClass.DENIED_TYPE if decision.name_allowed else ViolationClass.DENIED_NAME
        return self._deny(q, waiter, now, cls, decision.reason, "")

    def _deny(
        self, q: wire.Query, waiter: Waiter, now: float, cls: ViolationClass, why: str, extra: str
    ) -> list[Action]:
        self.stats["denied"] += 1
        detail = f"query {q.qname or '.'} {_type_name(q.qtype)}" + (f" ({extra})" if extra else "")
        report = Report(self._violation(cls, why, detail, now, q.qname, q.qtype))
        if self.audit and q.qclass == wire.CLASS_IN:
            return [report, *self._forward(q, waiter, None)]
        if cls is ViolationClass.DENIED_NAME and (
            self.policy.dns.denied_response is DeniedResponse.NXDOMAIN
        ):
            return [report, Reply(waiter.client, wire.error_reply(q, wire.NXDOMAIN))]
        return [report, Reply(waiter.client, wire.error_reply(q, wire.REFUSED))]

    def _forward(self, q: wire.Query, waiter: Waiter, rule: DnsRule | None) -> list[Action]:
        token = self.inflight.get(q.key)
        if token is not None:  # the same question is already upstream: wait with it
            self.pending[token].waiters.append(waiter)
            return []
        self._next_token += 1
        token = self._next_token
        p = Pending(token, self.randbits(16), q.qname, q.qtype, rule, [waiter])
        self.pending[token] = p
        self.inflight[q.key] = token
        self.stats["forwarded"] += 1
        return [Forward(token, 0, wire.build_query(p.qid, p.qname, p.qtype), False)]

    # -- upstream ------------------------------------------------------------------------

    def on_upstream_reply(self, token: int, data: bytes, now: float) -> list[Action]:
        p = self.pending.get(token)
        if p is None:
            return []  # late or duplicate: already answered
        try:
            response = DNSRecord.parse(data)
        except Exception:  # dnslib raises many types on garbage; all mean "unusable"
            return self.on_upstream_failure(token, now)
        if not _matches(response, p):
            return []  # not the answer to our question: ignore it (spoofing, stale reply)
        if response.header.tc and not p.tcp:
            p.tcp = True
            p.qid = self.randbits(16)
            return [Forward(token, p.upstream, wire.build_query(p.qid, p.qname, p.qtype), True)]
        self._finish(p)
        return self._answer(p, response, now)

    def on_upstream_failure(self, token: int, now: float) -> list[Action]:
        """The upstream timed out or failed: try the next one, else SERVFAIL."""
        p = self.pending.get(token)
        if p is None:
            return []
        if p.upstream + 1 < self.n_upstreams:
            p.upstream += 1
            p.tcp = False
            p.qid = self.randbits(16)
            return [Forward(token, p.upstream, wire.build_query(p.qid, p.qname, p.qtype), False)]
        self._finish(p)
        self.stats["servfail"] += len(p.waiters)
        return [Reply(w.client, self._servfail(w.query)) for w in p.waiters]

    def _finish(self, p: Pending) -> None:
        del self.pending[p.token]
        key = p.waiters[0].query.key
        if self.inflight.get(key) == p.token:
            del self.inflight[key]

    def _answer(self, p: Pending, response: DNSRecord, now: float) -> list[Action]:
        if p.rule is None:
            filtered = _unfiltered(response)
        else:
            filtered = filter_answer(response, p.qname, p.qtype, p.rule, self.matcher, self.policy)
        actions: list[Action] = [self._finding(f, p, now) for f in filtered.findings]
        if self.audit and p.rule is not None and filtered.findings:
            filtered = _unfiltered(response)  # audit: record, then answer as a forwarder would
        if filtered.refused:
            return actions + self._refuse_all(p)
        entry = self._entry(p, filtered, now)
        if entry.expires_at > now:
            self.cache.put(p.waiters[0].query.key, entry)
        replies = [
            (w.client, cache_mod.render(entry, w.query, now, w.max_size), self._servfail(w.query))
            for w in p.waiters
        ]
        if entry.update is None or entry.update.is_empty():
            return actions + [Reply(c, d) for c, d, _ in replies]
        return [*actions, AllowThenReply(entry.update, tuple(replies))]

    def _entry(self, p: Pending, filtered: Filtered, now: float) -> Entry:
        cap = self.policy.dns.ttl_max
        for rr in filtered.answers:
            rr.ttl = min(rr.ttl, cap)  # a client must not keep an IP longer than the kernel
        header = DNSHeader(id=0, qr=1, rd=1, ra=1, rcode=filtered.rcode)
        msg = DNSRecord(header, q=DNSQuestion(p.qname, p.qtype), rr=filtered.answers,
                        auth=filtered.authority)  # fmt: skip
        message = msg.pack()
        ttl = filtered.min_ttl() if filtered.answers else filtered.negative_ttl() or 0
        ip_ttl = min((t for _, t in filtered.ips), default=0)
        timeout = clamp_ttl(min(ip_ttl, cap), self.policy)
        update = None
        if filtered.ips:
            update = plan_update([ip for ip, _ in filtered.ips], self._ports(p.rule), timeout)
        return cache_mod.make_entry(message, ttl, now, update, timeout)

    def _ports(self, rule: DnsRule | None) -> Ports:
        if rule is None or rule.ports.is_empty():
            return self.policy.connect.ports
        return rule.ports

    def _refuse_all(self, p: Pending) -> list[Action]:
        rcode = wire.NXDOMAIN
        if self.policy.dns.denied_response is DeniedResponse.REFUSED:
            rcode = wire.REFUSED
        return [Reply(w.client, wire.error_reply(w.query, rcode)) for w in p.waiters]

    # -- helpers -------------------------------------------------------------------------

    def _servfail(self, q: wire.Query) -> bytes:
        return wire.error_reply(q, wire.SERVFAIL)

    def _finding(self, f: Finding, p: Pending, now: float) -> Report:
        return Report(self._violation(f.cls, f.rule, f.detail, now, p.qname, p.qtype))

    def _violation(
        self, cls: ViolationClass, rule: str, detail: str, now: float, qname: str, qtype: int
    ) -> Violation:
        return Violation(
            cls, "inline", rule, detail, now, self.policy.action(cls),
            qname=qname or ".", qtype=_type_name(qtype),
        )  # fmt: skip


def plan_update_refresh(entry: Entry, timeout: int) -> SetUpdate:
    assert entry.update is not None
    return SetUpdate(entry.update.elements4, entry.update.elements6, timeout)


def _matches(response: DNSRecord, p: Pending) -> bool:
    if response.header.id != p.qid or not response.header.qr or len(response.questions) != 1:
        return False
    q = response.questions[0]
    return bool(q.qtype == p.qtype and str(q.qname).rstrip(".").lower() == p.qname)


def _unfiltered(response: DNSRecord) -> Filtered:
    out = Filtered(response.header.rcode, list(response.rr), list(response.auth))
    for rr in response.rr:
        if rr.rtype in (A, AAAA):
            out.ips.append((ipaddress.ip_address(str(rr.rdata)), rr.ttl))
    return out


def _type_name(qtype: int) -> str:
    name = QTYPE.get(qtype, None)
    return str(name) if name is not None else f"TYPE{qtype}"
