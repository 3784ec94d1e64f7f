"""The resolver as a state machine: bytes and ``now`` in, actions out.

    query ─parse─▶ cache hit? ─▶ Reply (refreshing the sets if they would lapse first)
                 └▶ matcher: denied? ─▶ Report + NXDOMAIN/REFUSED (never forwarded)
                 └▶ allowed ─▶ Forward (our own ID, lowercased name, our EDNS)
    upstream reply ─▶ filter (chain, types, rebinding) ─▶ AllowThenReply (sets first)

No sockets and no clock of its own: the shells (the sandbox's asyncio server, egressd)
perform the actions and call back with upstream replies and failures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from egress.datapath.elements import SetUpdate, clamp_ttl, plan_update
from egress.model import DeniedResponse, DnsRule, Mode, Policy, Ports, Violation, ViolationClass
from egress.policy.matcher import Matcher
from egress.policy.rrtypes import type_name
from egress.resolver import cache as cache_mod
from egress.resolver import message, wire
from egress.resolver.actions import Action, AllowThenReply, Forward, Reply, Report
from egress.resolver.answer import Filtered, Finding, filter_answer, record_ip
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


REPLAY_MAX = 4096  # remembered queries (see replay)
REPLAY_MAX_QUERY = 512
REPLAY_MAX_REPLY = 1500


class TunnelFinding(Protocol):
    def describe(self) -> str: ...


class QueryScorer(Protocol):
    """What the core needs of a tunnel scorer (``egress.tunnel.TunnelScorer`` fits): it
    sees every allowed query before it is forwarded, and the upstream's rcode after."""

    def observe_query(self, name: str, qtype: int) -> TunnelFinding | None: ...

    def observe_response(self, name: str, rcode: int) -> None: ...


ADDRESS_TYPES = (1, 28)  # A, AAAA
REFUSAL_TTL_S = 60  # how long a withheld answer is answered from cache, not asked again


class ResolverCore:
    def __init__(
        self,
        policy: Policy,
        n_upstreams: int,
        randbits: Callable[[int], int],
        cache_size: int = 10_000,
        scorer: QueryScorer | None = None,
    ) -> None:
        self.n_upstreams = n_upstreams
        self.randbits = randbits
        # Cache hits skip the scorer: nothing leaves the host, and a repeat adds nothing.
        self.scorer = scorer
        self.cache = Cache(cache_size)
        self.pending: dict[int, Pending] = {}
        self.inflight: dict[bytes, int] = {}
        self._stats: dict[str, int] = dict.fromkeys(
            ("queries", "allowed", "denied", "cache_hits", "forwarded", "servfail", "malformed"),
            0,
        )
        # Replies to UDP queries seen before, keyed by the query's bytes after its ID.
        self._replay: dict[bytes, tuple[float, bytes]] = {}
        self._replays = 0
        self._next_token = 0
        self.set_policy(policy)

    @property
    def stats(self) -> dict[str, int]:
        out = dict(self._stats)
        for key in ("queries", "allowed", "cache_hits"):
            out[key] += self._replays
        return out

    def set_policy(self, policy: Policy) -> None:
        """Swap the policy; cached answers were decided under the old one, so they go."""
        self.policy = policy
        self.matcher = Matcher(policy)
        self.audit = policy.mode is Mode.AUDIT
        self.cache.clear()
        self._replay.clear()

    # -- the hot path --------------------------------------------------------------------

    def replay(self, data: bytes, now: float) -> bytes | None:
        """The reply to a UDP query whose bytes after the ID were answered from the cache
        within the last second (or None: call ``on_query``). The same bytes mean the same
        question, flags and EDNS, so the same reply but for the ID: no parsing, no
        policy, no objects. Entries live until their TTLs would tick down, their cache
        entry expires or the policy changes, so a replay is what ``on_query`` would send."""
        hit = self._replay.get(data[2:])
        if hit is None or hit[0] <= now:
            return None
        self._replays += 1
        return data[:2] + hit[1]

    def _remember(self, data: bytes, reply: bytes, entry: Entry, now: float) -> None:
        if entry.update is not None and entry.allowed_until < entry.expires_at:
            return  # a later hit may have to refresh the sets first: keep it on on_query
        if len(data) > REPLAY_MAX_QUERY or len(reply) > REPLAY_MAX_REPLY:
            return  # bounded memory: 4,096 x (512 + 1,500) bytes at most
        until = min(entry.stored_at + int(now - entry.stored_at) + 1, entry.expires_at)
        if len(self._replay) >= REPLAY_MAX:
            self._replay.clear()  # bounded; a client varying its bytes only slows itself
        self._replay[bytes(data[2:])] = (until, bytes(reply[2:]))

    # -- queries -------------------------------------------------------------------------

    def on_query(self, data: bytes, client: object, tcp: bool, now: float) -> list[Action]:
        self._stats["queries"] += 1
        try:
            q = wire.parse_query(data)
        except wire.WireError as exc:
            return self._malformed(data, client, exc)
        max_size = 65535 if tcp else (q.edns_size or wire.MAX_UDP_NO_EDNS)
        entry = self.cache.get(q.key, now)
        if entry is not None:
            self._stats["cache_hits"] += 1
            self._stats["allowed"] += 1
            actions = self._from_cache(entry, q, client, now, max_size)
            if not tcp and type(actions[0]) is Reply:
                self._remember(data, actions[0].data, entry, now)
            return actions
        return self._decide(q, Waiter(client, q, max_size), now)

    def _malformed(self, data: bytes, client: object, exc: wire.WireError) -> list[Action]:
        self._stats["malformed"] += 1
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
        update = plan_update_refresh(entry, timeout)

        def refreshed() -> None:
            entry.allowed_until = now + timeout

        return [AllowThenReply(update, ((client, data, self._servfail(q)),), refreshed)]

    def _decide(self, q: wire.Query, waiter: Waiter, now: float) -> list[Action]:
        if q.qclass != wire.CLASS_IN:
            return self._deny(q, waiter, now, ViolationClass.DENIED_TYPE,
                              "only class IN is answered", f"class {q.qclass}")  # fmt: skip
        if not wire.is_hostname(q.qname):  # binary labels: no rule names them, tunnels do
            shaped = self.matcher.decide(wire.hostname_shape(q.qname), q.qtype)
            if shaped.name_allowed and shaped.rule is not None:
                found = wire.BinaryName(q.qname, shaped.rule.describe())
                return self._tunnel(q, waiter, now, found, shaped.rule)
            why = "a name is letters, digits, '-' and '_'"
            return self._deny(q, waiter, now, ViolationClass.DENIED_NAME, why, "not a hostname")
        decision = self.matcher.decide(q.qname, q.qtype)
        if decision.allowed:
            finding = self.scorer.observe_query(q.qname, q.qtype) if self.scorer else None
            if finding is not None:
                return self._tunnel(q, waiter, now, finding, decision.rule)
            self._stats["allowed"] += 1
            return self._forward(q, waiter, decision.rule)
        cls = ViolationClass.DENIED_TYPE if decision.name_allowed else ViolationClass.DENIED_NAME
        return self._deny(q, waiter, now, cls, decision.reason, "")

    def _deny(
        self, q: wire.Query, waiter: Waiter, now: float, cls: ViolationClass, why: str, extra: str
    ) -> list[Action]:
        self._stats["denied"] += 1
        detail = f"query {q.qname or '.'} {_type_name(q.qtype)}" + (f" ({extra})" if extra else "")
        report = Report(self._violation(cls, why, detail, now, q.qname, q.qtype))
        if self.audit and q.qclass == wire.CLASS_IN:
            return [report, *self._forward(q, waiter, None)]
        if cls is ViolationClass.DENIED_NAME and (
            self.policy.dns.denied_response is DeniedResponse.NXDOMAIN
        ):
            return [report, Reply(waiter.client, wire.error_reply(q, wire.NXDOMAIN))]
        return [report, Reply(waiter.client, wire.error_reply(q, wire.REFUSED))]

    def _tunnel(
        self,
        q: wire.Query,
        waiter: Waiter,
        now: float,
        finding: TunnelFinding,
        rule: DnsRule | None,
    ) -> list[Action]:
        """Not forwarded (the name is the data); audit mode reports and forwards."""
        self._stats["denied"] += 1
        detail = f"query {q.qname} {_type_name(q.qtype)}: {finding.describe()}"
        cls = ViolationClass.TUNNEL
        report = Report(self._violation(cls, "spec.tunnel", detail, now, q.qname, q.qtype))
        if self.audit:
            return [report, *self._forward(q, waiter, rule)]
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
        self._stats["forwarded"] += 1
        return [Forward(token, 0, wire.build_query(p.qid, p.qname, p.qtype), False)]

    # -- upstream ------------------------------------------------------------------------

    def on_upstream_reply(self, token: int, data: bytes, now: float) -> list[Action]:
        p = self.pending.get(token)
        if p is None:
            return []  # late or duplicate: already answered
        try:
            response = _parse_response(data)
        except Exception:  # garbage (WireError, or any of dnslib's many errors): unusable
            return self.on_upstream_failure(token, now)
        if not _matches(response, p):
            return []  # not the answer to our question: ignore it (spoofing, stale reply)
        if response.truncated and not p.tcp:
            p.tcp = True
            p.qid = self.randbits(16)
            return [Forward(token, p.upstream, wire.build_query(p.qid, p.qname, p.qtype), True)]
        self._finish(p)
        if self.scorer is not None:
            self.scorer.observe_response(p.qname, response.rcode)
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
        self._stats["servfail"] += len(p.waiters)
        return [Reply(w.client, self._servfail(w.query)) for w in p.waiters]

    def _finish(self, p: Pending) -> None:
        del self.pending[p.token]
        key = p.waiters[0].query.key
        if self.inflight.get(key) == p.token:
            del self.inflight[key]

    def _answer(self, p: Pending, response: message.Response, now: float) -> list[Action]:
        if p.rule is None:
            filtered = _unfiltered(response)
        else:
            filtered = filter_answer(response, p.qname, p.qtype, p.rule, self.matcher, self.policy)
        actions: list[Action] = [self._finding(f, p, now) for f in filtered.findings]
        if self.audit and p.rule is not None and filtered.findings:
            filtered = _unfiltered(response)  # audit: record, then answer as a forwarder would
        if filtered.refused:
            return actions + self._refuse_all(p, now)
        entry = self._entry(p, filtered, now)
        key = p.waiters[0].query.key

        def remember() -> None:
            if entry.expires_at > now:
                self.cache.put(key, entry)

        replies = [
            (w.client, cache_mod.render(entry, w.query, now, w.max_size), self._servfail(w.query))
            for w in p.waiters
        ]
        if entry.update is None or entry.update.is_empty():
            remember()
            return actions + [Reply(c, d) for c, d, _ in replies]
        # Cached only once the kernel has the addresses: a SERVFAIL'd answer must not
        # come back from the cache as if its addresses were allowed.
        return [*actions, AllowThenReply(entry.update, tuple(replies), remember)]

    def _entry(self, p: Pending, filtered: Filtered, now: float) -> Entry:
        cap = self.policy.dns.ttl_max
        ip_ttl = min((t for _, t in filtered.ips), default=0)
        for rr in filtered.answers:
            rr.ttl = min(rr.ttl, cap)  # a client must not keep an IP longer than the kernel
            if rr.rtype in ADDRESS_TYPES:
                # One kernel timeout covers the whole answer: no address may be shown to
                # the client as valid for longer than the kernel will allow it.
                rr.ttl = min(rr.ttl, max(ip_ttl, self.policy.dns.ttl_min))
        msg, offsets = message.build(
            p.qname, p.qtype, filtered.rcode, filtered.answers, filtered.authority
        )
        ttl = filtered.min_ttl() if filtered.answers else filtered.negative_ttl() or 0
        timeout = clamp_ttl(min(ip_ttl, cap), self.policy)
        update = None
        if filtered.ips:
            update = plan_update([ip for ip, _ in filtered.ips], self._ports(p.rule), timeout)
        return cache_mod.make_entry(msg, offsets, ttl, now, update, timeout)

    def _ports(self, rule: DnsRule | None) -> Ports:
        if rule is None or rule.ports.is_empty():
            return self.policy.connect.ports
        return rule.ports

    def _refuse_all(self, p: Pending, now: float) -> list[Action]:
        """Refuse a withheld answer, and remember the refusal: asked again, the same
        question must not go upstream again (a tunnel client retries, and restarted with
        the same seed it repeats its names, each repeat carrying data out)."""
        rcode = wire.NXDOMAIN
        if self.policy.dns.denied_response is DeniedResponse.REFUSED:
            rcode = wire.REFUSED
        msg, offsets = message.build(p.qname, p.qtype, rcode, [], [])
        entry = cache_mod.make_entry(msg, offsets, REFUSAL_TTL_S, now, None, 0)
        self.cache.put(p.waiters[0].query.key, entry)
        return [Reply(w.client, cache_mod.render(entry, w.query, now, w.max_size))
                for w in p.waiters]  # fmt: skip

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


def _parse_response(data: bytes) -> message.Response:
    try:
        return message.parse(data)
    except message.Unsupported:
        return message.from_dnslib(data)


def _matches(response: message.Response, p: Pending) -> bool:
    if response.id != p.qid or not response.flags & wire.QR or len(response.questions) != 1:
        return False
    name, qtype, _ = response.questions[0]
    return qtype == p.qtype and name == p.qname


def _unfiltered(response: message.Response) -> Filtered:
    out = Filtered(response.rcode, list(response.answers), list(response.authority))
    for rr in response.answers:
        if rr.rtype in (message.A, message.AAAA):
            out.ips.append((record_ip(rr), rr.ttl))
    return out


def _type_name(qtype: int) -> str:
    # The policy's spelling, the same one the observer uses: the layers' journal keys
    # must match for unknown types too (TYPE65399, not "65399").
    return type_name(qtype)
