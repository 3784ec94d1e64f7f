"""The resolver as a state machine: bytes and ``now`` in, actions out.

    query ─parse─▶ cache hit? ─▶ Reply (refreshing the sets if they would lapse first)
                 └▶ matcher: denied? ─▶ Report + NXDOMAIN/REFUSED (never forwarded)
                 └▶ allowed ─▶ Forward (our own ID, lowercased name, our EDNS)
    upstream reply ─▶ filter (chain, types, rebinding) ─▶ AllowThenReply (sets first)
    on_allowed(token, acked) ─▶ the replies (cached), or SERVFAIL (+ Revoke if too late)

The verdict on a query is ``judge.judge``'s, the same the observer layer gives. The set
update is planned here, once (``ExpiryBook``: no answer shortens what an earlier one
allowed), and the kernel's answer comes back as the ``on_allowed`` event.

No sockets and no clock of its own: the shells (the sandbox's asyncio server, egressd)
perform the actions and call back with upstream replies, failures and set acks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from egress.datapath.elements import (
    ExpiryBook,
    SetAdd,
    SetUpdate,
    clamp_ttl,
    element_parts,
    plan_update,
)
from egress.model import (
    Action as OnViolation,
)
from egress.model import (
    DeniedResponse,
    DnsRule,
    IPAddress,
    Layer,
    Mode,
    Policy,
    Ports,
    ViolationClass,
)
from egress.policy.matcher import Matcher
from egress.resolver import cache as cache_mod
from egress.resolver import message, message_dnslib, wire
from egress.resolver.actions import (
    Action,
    AllowThenReply,
    Client,
    Forward,
    Release,
    Reply,
    Report,
    Revoke,
)
from egress.resolver.answer import Filtered, Finding, filter_answer, learned_ports, record_ip
from egress.resolver.audit import ALLOWED, AuditLog
from egress.resolver.bindings import Bindings, answer_chain
from egress.resolver.cache import Cache, Entry
from egress.resolver.judge import QueryScorer, Verdict, dns_violation, judge, tunnel
from egress.resolver.rebinding import rebinding_reason

LAYER = Layer.INLINE


@dataclass
class Waiter:
    client: Client
    query: wire.Query
    max_size: int


@dataclass
class Pending:
    token: int
    qid: int
    qname: str
    qtype: int
    rule: DnsRule | None  # None: a denied name forwarded only because of audit mode
    matcher: Matcher  # the policy it was decided under (set_policy makes a new one)
    waiters: list[Waiter] = field(default_factory=list)
    upstream: int = 0
    tcp: bool = False
    withheld: bool = False  # scored after its send, it made a verdict: refuse the answer
    unscored: bool = False  # scored after its send, its scoring raised: SERVFAIL


REPLAY_MAX = 4096  # remembered queries (see replay)
REPLAY_MAX_QUERY = 512
REPLAY_MAX_REPLY = 1500


@dataclass(slots=True)
class Allowing:
    """An AllowThenReply the kernel has not answered yet (see ``on_allowed``)."""

    adds: tuple[SetAdd, ...]
    replies: tuple[Release, ...]
    fresh: SetUpdate  # what this answer alone allows: taken back if acked too late
    planned_at: float  # the wall clock ``now`` (cache times)
    booked_at: float  # the book's clock (kernel timeouts are relative: no wall-clock steps)
    entry: Entry
    key: bytes | None  # cache the entry under it once allowed (None: a refresh)
    timeout_s: int


ADDRESS_TYPES = (1, 28)  # A, AAAA
REFUSAL_TTL_S = 60  # how long a withheld answer is answered from cache, not asked again
ALLOWING_MAX = 65_536  # set updates awaiting their ack: the shell answers each at once


class ResolverCore:
    def __init__(
        self,
        policy: Policy,
        n_upstreams: int,
        randbits: Callable[[int], int],
        cache_size: int = 10_000,
        scorer: QueryScorer | None = None,
        monotonic: Callable[[], float] | None = None,
    ) -> None:
        """``monotonic``: the clock the ExpiryBook keeps kernel timeouts on (the shell
        passes time.monotonic, so a wall-clock step neither shortens an element an earlier
        answer allowed nor revokes one it still needs). None: the ``now`` passed in."""
        self.n_upstreams = n_upstreams
        self._monotonic = monotonic
        self.randbits = randbits
        # Cache hits skip the scorer: nothing leaves the host, and a repeat adds nothing.
        self.scorer = scorer
        # The scorer's work moved off the answer's path, in order (``settle``): a query
        # sent before its scoring (query, its rule), or an answer's rcode (None, name,
        # rcode).
        self.later: list[tuple[wire.Query | None, str, int, DnsRule | None]] = []
        self.deferring = True  # off for good once a deferred scoring raised
        self.cache = Cache(cache_size)
        self.pending: dict[int, Pending] = {}
        self.inflight: dict[bytes, int] = {}
        self._stats: dict[str, int] = dict.fromkeys(
            ("queries", "allowed", "denied", "cache_hits", "forwarded", "servfail", "malformed"),
            0,
        )
        # Replies to UDP queries seen before, keyed by the query's bytes after its ID: until
        # when the reply's TTLs hold, the reply after its ID, its cache entry and key.
        self._replay: dict[bytes, tuple[float, bytes, Entry, bytes]] = {}
        self._replays = 0
        self._next_token = 0
        self.expiry = ExpiryBook()  # when each element we added expires in the kernel
        # Which names put each address in the sets, while the kernel allows it for them:
        # what a flow's SNI or Host is checked against (``flows``).
        self.bindings = Bindings()
        self.allowing: dict[int, Allowing] = {}
        self.audit_log = AuditLog()  # mode: audit only; kept across swaps
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
        before (or None: call ``on_query``). The same bytes mean the same question, flags
        and EDNS, so the same reply but for the ID and the TTLs: no parsing, no policy,
        no objects. A replay lasts while the cache holds its entry: evicted, answered anew
        or expired, it is dropped; the policy changing drops them all. Once a second its
        TTLs are aged from the entry (which goes to the cache's fresh end, as a hit
        would). So a replay is what ``on_query`` would send, and a client that asks once
        a second (egressd's many sandboxes) is still replayed."""
        key = data[2:]
        hit = self._replay.get(key)
        if hit is None:
            return None
        until, tail, entry, cache_key = hit
        if until <= now or not self.cache.holds(cache_key, entry):
            if (
                entry.expires_at <= now
                or not _replayable(entry)
                or not self.cache.touch(cache_key, entry)
            ):
                del self._replay[key]  # on_query decides again (and may remember anew)
                return None
            tail = cache_mod.aged(entry, tail, now)
            self._replay[key] = (_replay_until(entry, now), tail, entry, cache_key)
        self._replays += 1
        return data[:2] + tail

    def _remember(
        self, data: bytes, reply: bytes, entry: Entry, cache_key: bytes, now: float
    ) -> None:
        if not _replayable(entry):
            return  # a later hit may have to refresh the sets first: keep it on on_query
        if len(data) > REPLAY_MAX_QUERY or len(entry.message) > REPLAY_MAX_REPLY:
            # Bounded memory: 4,096 x (512 + 1,500) bytes, and entries of at most 1,500
            # (a reply truncated for its client is short; the entry it stands for is not).
            return
        if len(self._replay) >= REPLAY_MAX:
            self._replay.clear()  # bounded; a client varying its bytes only slows itself
        self._replay[bytes(data[2:])] = (
            _replay_until(entry, now), bytes(reply[2:]), entry, cache_key
        )  # fmt: skip

    # -- queries -------------------------------------------------------------------------

    def settle(self, now: float) -> list[Action]:
        """The scorer's part of what was answered or sent since the last call, in order:
        the queries ``can_defer`` let go upstream before their scoring, and the rcodes of
        answers. The shell calls it once it has sent what the core asked (off the answer's
        path); ``on_query`` calls it first, so no query is judged before it, and so do
        ``on_upstream_reply`` and ``on_upstream_failure``, so none is answered. A query that
        makes a verdict here (``can_defer`` is a sound bound: none should) is reported,
        counted denied, and its answer refused; one whose scoring raises (a bug) gets
        SERVFAIL, nothing is deferred from then on, and the error is raised once the rest
        is settled, unless a violation was found."""
        later, self.later = self.later, []
        scorer = self.scorer
        out: list[Action] = []
        if scorer is None:
            return out
        failed: Exception | None = None
        for q, name, code, rule in later:
            try:
                if q is None:
                    scorer.observe_response(name, code)
                    continue
                finding = scorer.observe_query(name, code)
            except Exception as exc:  # a bug; scored first, it would not have gone up
                failed = failed or exc
                self.deferring = False  # a retry is scored first, as before deferral
                if q is not None:
                    self._withhold(q, unscored=True)  # fail closed, and settle the rest
                continue
            if finding is None:
                continue
            self._stats["allowed"] -= 1
            self._stats["denied"] += 1
            verdict = tunnel(q, finding, rule)
            out.append(Report(verdict.violation(q, layer=LAYER, policy=self.policy, at=now)))
            self._withhold(q)
        # The shell counts a raised bug; a violation found beside it matters more.
        if failed is not None and not out:
            raise failed
        return out

    def _withhold(self, q: wire.Query, unscored: bool = False) -> None:
        token = self.inflight.get(q.key)
        if token is not None:
            p = self.pending[token]
            p.withheld = True
            p.unscored = p.unscored or unscored

    def on_query(self, data: bytes, client: object, tcp: bool, now: float) -> list[Action]:
        if self.later:  # the query's own actions first: a Report must not hold up its send
            settled = self.settle(now)
            return self._on_query(data, client, tcp, now) + settled
        return self._on_query(data, client, tcp, now)

    def _on_query(self, data: bytes, client: object, tcp: bool, now: float) -> list[Action]:
        self._stats["queries"] += 1
        try:
            q = wire.parse_query(data)
        except wire.WireError as exc:
            return self._malformed(data, client, exc)
        max_size = 65535 if tcp else (q.edns_size or wire.MAX_UDP_NO_EDNS)
        entry = self.cache.get(q.key, now)
        if entry is not None:
            if self.audit:
                self._audit_hit(q, now)
            self._stats["cache_hits"] += 1
            self._stats["allowed"] += 1
            actions = self._from_cache(entry, q, client, now, max_size)
            if not tcp and not self.audit and type(actions[0]) is Reply:  # audit counts each
                self._remember(data, actions[0].data, entry, q.key, now)
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
        update = SetUpdate(entry.update.elements4, entry.update.elements6, timeout)
        release = (Release(client, data, self._servfail(q)),)
        return [self._allow(update, release, entry, None, now, q.qname, q.qtype)]

    def _decide(self, q: wire.Query, waiter: Waiter, now: float) -> list[Action]:
        scorer = self.scorer
        # Sent first and scored right after (settle), where no verdict can come of it.
        later = (
            scorer is not None
            and self.deferring
            and not self.audit
            and scorer.can_defer(q.qname, q.qtype)
        )
        verdict = judge(q, self.matcher, None if later else scorer)
        if self.audit:
            self.audit_log.name(q.qname, q.qtype, _verdict_text(verdict), now)
        if verdict.allowed:
            self._stats["allowed"] += 1
            if later:
                self.later.append((q, q.qname, q.qtype, verdict.rule))
            return self._forward(q, waiter, verdict.rule)
        self._stats["denied"] += 1
        report = Report(verdict.violation(q, layer=LAYER, policy=self.policy, at=now))
        if self.audit and q.qclass == wire.CLASS_IN:
            # Audit: record, then answer as a forwarder would (a tunnel under its zone's rule).
            return [report, *self._forward(q, waiter, verdict.rule)]
        why = self._why(verdict.cls or ViolationClass.DENIED_NAME, _WHY)
        reply = wire.error_reply(q, self._refusal(verdict), wire.ede_option(wire.EDE_BLOCKED, why))
        return [report, Reply(waiter.client, reply)]

    def _why(self, cls: ViolationClass, what: dict[ViolationClass, str]) -> str:
        """What an agent reads in a refusal (``dig`` prints it as EDE 15, Blocked): that
        egress refused it, why, under which policy, the violation class the journal and the
        report file it under, and whether the sandbox is now frozen; not the rule text."""
        frozen = self.policy.action(cls) is OnViolation.FREEZE
        note = "; the sandbox is frozen for review" if frozen else ""
        why = what.get(cls, "refused")
        return f"egress: {why} by policy {self.policy.name} ({cls.value}){note}"

    def _refusal(self, verdict: Verdict) -> int:
        if verdict.cls is ViolationClass.DENIED_NAME and (
            self.policy.dns.denied_response is DeniedResponse.NXDOMAIN
        ):
            return wire.NXDOMAIN
        return wire.REFUSED

    def _forward(self, q: wire.Query, waiter: Waiter, rule: DnsRule | None) -> list[Action]:
        token = self.inflight.get(q.key)
        if token is not None:  # the same question is already upstream: wait with it
            self.pending[token].waiters.append(waiter)
            return []
        self._next_token += 1
        token = self._next_token
        p = Pending(token, self.randbits(16), q.qname, q.qtype, rule, self.matcher, [waiter])
        self.pending[token] = p
        self.inflight[q.key] = token
        self._stats["forwarded"] += 1
        return [Forward(token, 0, wire.build_query(p.qid, p.qname, p.qtype), False)]

    # -- upstream ------------------------------------------------------------------------

    def on_upstream_reply(self, token: int, data: bytes, now: float) -> list[Action]:
        if self.later:  # its query may be among them: withheld before it is answered
            settled = self.settle(now)
            return settled + self._on_upstream_reply(token, data, now)
        return self._on_upstream_reply(token, data, now)

    def _on_upstream_reply(self, token: int, data: bytes, now: float) -> list[Action]:
        p = self.pending.get(token)
        if p is None:
            return []  # late or duplicate: already answered
        try:
            response = _parse_response(data)
        except wire.WireError:  # garbage (message_dnslib translates dnslib's errors)
            return self.on_upstream_failure(token, now)
        if not _matches(response, p):
            return []  # not the answer to our question: ignore it (spoofing, stale reply)
        if p.withheld:  # not asked again over TCP either
            self._finish(p)
            return self._refuse_tunnel(p)
        if response.truncated and not p.tcp:
            p.tcp = True
            p.qid = self.randbits(16)
            return [Forward(token, p.upstream, wire.build_query(p.qid, p.qname, p.qtype), True)]
        self._finish(p)
        if self.scorer is not None:  # accounted after the answer is sent (settle)
            self.later.append((None, p.qname, response.rcode, None))
        return self._answer(p, response, now)

    def on_upstream_failure(self, token: int, now: float) -> list[Action]:
        """The upstream timed out or failed: try the next one, else SERVFAIL."""
        if self.later:  # its query may be among them: withheld before it is asked again
            settled = self.settle(now)
            return settled + self._on_upstream_failure(token, now)
        return self._on_upstream_failure(token, now)

    def _on_upstream_failure(self, token: int, now: float) -> list[Action]:
        p = self.pending.get(token)
        if p is None:
            return []
        if p.withheld:  # not asked of the next upstream
            self._finish(p)
            return self._refuse_tunnel(p)
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
        rule = p.rule
        if p.matcher is not self.matcher and not self.audit:
            # egressd swapped the policy since the question went upstream (from audit mode
            # too, where a denied name goes up with no rule): decided again under the one
            # in force now, and an answer it no longer allows is not released.
            decision = self.matcher.decide(p.qname, p.qtype)
            if not decision.allowed:
                return [Reply(w.client, self._servfail(w.query)) for w in p.waiters]
            rule = decision.rule
        if rule is None:
            filtered = _unfiltered(response)
        else:
            filtered = filter_answer(response, p.qname, p.qtype, rule, self.matcher, self.policy)
        actions: list[Action] = [self._finding(f, p, now) for f in filtered.findings]
        if self.audit:
            self._audit_answer(p, response)
        if self.audit and rule is not None and filtered.findings:
            filtered = _unfiltered(response)  # audit: record, then answer as a forwarder would
        if filtered.refused:
            withheld = filtered.findings[-1].cls if filtered.findings else None  # the last
            return actions + self._refuse_all(p, now, withheld)
        entry = self._entry(p, rule, filtered, now)
        key = p.waiters[0].query.key
        replies = tuple(
            Release(w.client, cache_mod.render(entry, w.query, now, w.max_size),
                    self._servfail(w.query))
            for w in p.waiters
        )  # fmt: skip
        if entry.update is None or entry.update.is_empty():
            if entry.expires_at > now:
                self.cache.put(key, entry)
            return actions + [Reply(r.client, r.data) for r in replies]
        # Cached only once the kernel has the addresses: a SERVFAIL'd answer must not
        # come back from the cache as if its addresses were allowed.
        return [*actions, self._allow(entry.update, replies, entry, key, now, p.qname, p.qtype)]

    # -- the kernel's sets ---------------------------------------------------------------

    def _allow(
        self,
        update: SetUpdate,
        replies: tuple[Release, ...],
        entry: Entry,
        key: bytes | None,
        now: float,
        qname: str,
        qtype: int,
    ) -> AllowThenReply:
        self._next_token += 1
        token = self._next_token
        booked = self._book_time(now)
        adds = self.expiry.plan_adds(update, booked)
        fresh = self.expiry.fresh_update(update, booked)
        if len(self.allowing) >= ALLOWING_MAX:  # a shell that never answers: stay bounded
            self.allowing.pop(next(iter(self.allowing)))
        self.allowing[token] = Allowing(
            adds, replies, fresh, now, booked, entry, key, update.timeout_s
        )  # fmt: skip
        return AllowThenReply(token, update, adds, replies, qname, qtype, entry.ips)

    def on_allowed(self, token: int, acked: int, now: float, *, late: bool = False) -> list[Action]:
        """The kernel acked the first ``acked`` adds of AllowThenReply ``token`` (all of
        them: the answer is released; fewer: SERVFAIL). ``late``: the acks came after the
        deadline, so the client gets SERVFAIL and what this answer alone added goes."""
        a = self.allowing.pop(token, None)
        if a is None:
            return []
        for add in a.adds[:acked]:
            self.expiry.record(add.elements, add.timeout_s, a.booked_at)
        if acked < len(a.adds) or late:
            revoke: list[Action] = [Revoke(a.fresh)] if late and not a.fresh.is_empty() else []
            return [*revoke, *(Reply(r.client, r.fallback) for r in a.replies)]
        self.bindings.learn(
            a.entry.ips, a.entry.names, a.entry.ports, now, a.planned_at + a.timeout_s,
            checked=a.entry.checked,
        )  # fmt: skip
        if a.key is None:
            a.entry.allowed_until = a.planned_at + a.timeout_s
        elif a.entry.expires_at > a.planned_at:
            self.cache.put(a.key, a.entry)
        return [Reply(r.client, r.data) for r in a.replies]

    def seed_expiry(
        self, elements: list[tuple[str, int]], now: float, inherit: bool = True
    ) -> None:
        """(element, seconds left) the kernel already holds (an adopted sandbox): no
        answer shortens what a predecessor allowed. With ``inherit`` (no handover told
        which questions put them there), its TCP elements are inherited by ``bindings``:
        a client may still connect there from its cache, under a name this resolver
        never saw answered."""
        booked = self._book_time(now)
        for element, left in elements:
            self.expiry.record((element,), left, booked)
            parts = element_parts(element) if inherit else None
            if parts is not None and parts[1] == "tcp":
                self.bindings.inherit(parts[0], parts[2], now + left)

    def _book_time(self, now: float) -> float:
        return now if self._monotonic is None else self._monotonic()

    def _entry(self, p: Pending, rule: DnsRule | None, filtered: Filtered, now: float) -> Entry:
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
        ports = self._ports(rule)
        update = None
        if filtered.ips:
            update = plan_update([ip for ip, _ in filtered.ips], ports, timeout)
        ips = tuple(dict.fromkeys(ip for ip, _ in filtered.ips))
        # What these addresses answer for: the question and its CNAME chain, on the ports
        # the set elements allow.
        names = answer_chain(p.qname, filtered.answers)
        return cache_mod.make_entry(
            msg, offsets, ttl, now, update, timeout, ips, names=names, ports=ports,
            checked=rule is None or rule.check_names,
        )  # fmt: skip

    def _ports(self, rule: DnsRule | None) -> Ports:
        return learned_ports(rule, self.policy)

    def _refuse_all(
        self, p: Pending, now: float, withheld: ViolationClass | None = None
    ) -> list[Action]:
        """Refuse a withheld answer, and remember the refusal: asked again, the same
        question must not go upstream again (a tunnel client retries, and restarted with
        the same seed it repeats its names, each repeat carrying data out)."""
        rcode = wire.NXDOMAIN
        if self.policy.dns.denied_response is DeniedResponse.REFUSED:
            rcode = wire.REFUSED
        msg, offsets = message.build(p.qname, p.qtype, rcode, [], [])
        why = self._why(withheld or ViolationClass.DENIED_NAME, _WITHHELD)
        ede = wire.ede_option(wire.EDE_BLOCKED, why)
        entry = cache_mod.make_entry(msg, offsets, REFUSAL_TTL_S, now, None, 0, ede=ede)
        self.cache.put(p.waiters[0].query.key, entry)
        return [Reply(w.client, cache_mod.render(entry, w.query, now, w.max_size))
                for w in p.waiters]  # fmt: skip

    # -- helpers -------------------------------------------------------------------------

    def _refuse_tunnel(self, p: Pending) -> list[Action]:
        """What a query scored after its send, and found a tunnel, is answered: what it
        would have been answered, scored first (``_decide``); SERVFAIL where its scoring
        raised (scored first, it would have had no answer)."""
        if p.unscored:
            self._stats["servfail"] += len(p.waiters)
            return [Reply(w.client, self._servfail(w.query)) for w in p.waiters]
        why = wire.ede_option(wire.EDE_BLOCKED, self._why(ViolationClass.TUNNEL, _WHY))
        return [Reply(w.client, wire.error_reply(w.query, wire.REFUSED, why)) for w in p.waiters]

    def _servfail(self, q: wire.Query) -> bytes:
        return wire.error_reply(q, wire.SERVFAIL)

    def _audit_hit(self, q: wire.Query, now: float) -> None:
        # A cache hit repeats a question already judged; one cached before a swap to
        # audit mode is judged here (without the scorer: it sends nothing upstream).
        verdict = None if self.audit_log.knows(q.qname, q.qtype) else judge(q, self.matcher, None)
        text = ALLOWED if verdict is None else _verdict_text(verdict)
        self.audit_log.name(q.qname, q.qtype, text, now)

    def _audit_answer(self, p: Pending, response: message.Response) -> None:
        """What the learner needs of an answer: its CNAME chain (each name on it must be
        allowed, and CNAME with it) and whether it pointed inside (a rebinding answer is
        a risk, never learned; a name forwarded under no rule was not filtered)."""
        chain = answer_chain(p.qname, response.answers)
        self.audit_log.chain(p.qname, p.qtype, chain[1:])
        for rr in response.answers:
            if rr.rtype in ADDRESS_TYPES and rebinding_reason(record_ip(rr)) is not None:
                self.audit_log.risk(p.qname, p.qtype, ViolationClass.REBINDING.value)

    def audit_connect(
        self, address: IPAddress, proto: str, port: int, static: bool, blocked: bool, now: float
    ) -> None:
        """Audit mode: a new flow the kernel logged. Enforce would have blocked it if the
        kernel did (``blocked``), or if only answers to names the policy denies (which
        audit mode forwarded) put its address in the sets."""
        if not self.audit:
            return
        names = self.bindings.names(address, now)
        allowed = not blocked and (
            static or any(self.matcher.decide(n, 1).name_allowed for n in names)
        )
        verdict = ALLOWED if allowed else ViolationClass.BLOCKED_CONNECT.value
        self.audit_log.connect(str(address), proto, port, verdict, names, now)

    def audit_asked(self, address: IPAddress, port: int, name: str | None, now: float) -> None:
        """Audit mode: a TCP flow's first bytes named ``name`` (TLS SNI, HTTP Host)."""
        if self.audit and name:
            self.audit_log.asked(str(address), "tcp", port, name, now)

    def _finding(self, f: Finding, p: Pending, now: float) -> Report:
        if self.audit:
            self.audit_log.risk(p.qname, p.qtype, f.cls.value)
        return Report(
            dns_violation(f.cls, f.rule, f.detail, p.qname, p.qtype,
                          layer=LAYER, policy=self.policy, at=now)
        )  # fmt: skip


def _replayable(entry: Entry) -> bool:
    """The kernel allows the entry's addresses as long as its TTLs say: no hit of it will
    have to refresh the sets first (``_from_cache``), so it may be replayed to its end."""
    return entry.update is None or entry.allowed_until >= entry.expires_at


def _replay_until(entry: Entry, now: float) -> float:
    """Until when a reply rendered at ``now`` holds: its TTLs tick down at the next whole
    second of the entry's age, and it ends with the entry."""
    return min(entry.stored_at + int(now - entry.stored_at) + 1, entry.expires_at)


def _verdict_text(verdict: Verdict) -> str:
    return ALLOWED if verdict.cls is None else verdict.cls.value


_WHY = {  # a query refused before it went upstream
    ViolationClass.DENIED_NAME: "name not allowed",
    ViolationClass.DENIED_TYPE: "record type not allowed",
    ViolationClass.TUNNEL: "DNS tunnel suspected",
}
_WITHHELD = {  # an answer refused after the upstream gave it
    ViolationClass.DENIED_NAME: "answer leads to a name not allowed",
    ViolationClass.DENIED_TYPE: "answer is a CNAME, a record type not allowed",
    ViolationClass.TUNNEL: "answer carries a DNS tunnel's data",
}


def _parse_response(data: bytes) -> message.Response:
    try:
        return message.parse(data)
    except message.Unsupported:
        return message_dnslib.from_dnslib(data)


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
