"""Which names put an address into a sandbox's sets, and until when.

An address learned from DNS is a whole host: behind a CDN it serves thousands of names,
so allowing the address allows them all. What a connection to it asks for (its TLS SNI
or HTTP Host, ``datapath.firstbytes``) is checked against this table (``flows``): the
name must be one whose answer put this address into this sandbox's sets, the question
or a name on its CNAME chain, and that answer's kernel timeout must not have passed.

The resolver core records an answer here when the kernel has acked its set elements,
with the same timeout, so a name is bound exactly while its addresses are allowed for
it. Each sandbox has its own table: another sandbox's answers bind nothing here.

Bounded: ``max_addresses`` addresses, ``max_pairs`` (address, name) bindings in all, and
``max_names`` names on one address. A CDN serves hundreds of names from one address, and a
sandbox may resolve dozens of them within their TTLs: each must stay bound while its
answer lasts, or reconnecting to the first one resolved is a mismatch and a freeze (with
8 names an address, 40 names of the lab's wildcard froze the sandbox at the first).
A full table first drops what has expired, then the eighth of its addresses learned
longest ago; a full address replaces its name that expires first. Forgetting only ever
turns a later flow into a mismatch (fail closed), never into a pass. Full, the table
holds 2.1 MB when its addresses share their names (one answer binds its names to all of
its addresses) and 13.6 MB at the very worst: 32,768 distinct 253-character names,
far more than the tunnel scorer lets a sandbox ask.

Each binding keeps the ports of the rule the answer came through: the kernel's elements
allow the address on those, and a flow to another port (allowed through another name's
rule) must not pass as this name.

An egressd that adopts a sandbox without a handover (after a crash, or a plain stop and
start: a systemd restart, a DaemonSet rollout), and a restarted sidecar, find addresses
in the kernel's sets whose answers they never saw, and that a client may still hold in
its cache. ``inherit`` records them, per TCP port, until their elements expire: a flow
there passes if its name is one the policy allows on that port (``flows.judge_flow``),
though perhaps not the one the address was resolved for. Weaker, and only until the
predecessor's elements expire; the alternative would freeze every workload that reuses
a cached address after a restart. ``--replace`` and SIGHUP hand the questions over, and
inherit nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

from egress.model import IPAddress, Policy, Ports
from egress.policy.matcher import Matcher
from egress.resolver import message, message_dnslib
from egress.resolver.answer import learned_ports, record_ip
from egress.resolver.wire import WireError

MAX_ADDRESSES = 4096
MAX_PAIRS = 32768  # (address, name) bindings in all: what bounds the table's memory
MAX_NAMES = 512  # per address: a CDN address a sandbox reaches under many names


class Bindings:
    def __init__(
        self,
        max_addresses: int = MAX_ADDRESSES,
        max_names: int = MAX_NAMES,
        max_pairs: int = MAX_PAIRS,
    ) -> None:
        if max_addresses < 1 or max_names < 1 or max_pairs < max_names:
            raise ValueError(
                "a bindings table holds at least one address and one name, and an address"
                " full of names"
            )
        self.max_addresses = max_addresses
        self.max_names = max_names
        self.max_pairs = max_pairs
        self._pairs = 0  # names bound, over all addresses
        # Counts every binding dropped to make room or replaced by one on other ports (or
        # checked otherwise): one who knows the count from when it bound something knows
        # it all still stands, as bound, if the count is the same.
        self.changes = 0
        # address -> {name: (until, ports, checked)}; dict order is learning order
        # (refreshed on re-learn). ``ports``: those of the rule the answer came through,
        # which are what the kernel's set elements for the address allow; ``checked``:
        # that rule's check_names.
        self._table: dict[IPAddress, dict[str, tuple[float, Ports, bool]]] = {}
        # address -> {TCP port: until}: what a predecessor's answers allowed (``inherit``).
        # Bounded by the kernel's sets, which only this resolver's answers fill.
        self._inherited: dict[IPAddress, dict[int, float]] = {}

    def __len__(self) -> int:
        return len(self._table)

    def learn(
        self,
        ips: Iterable[IPAddress],
        names: Iterable[str],
        ports: Ports,
        now: float,
        until: float,
        checked: bool = True,
    ) -> None:
        """Bind each of ``names`` to each of ``ips``, on ``ports``, from ``now`` until
        ``until``; an earlier binding of the same pair on the same ports is kept if it
        lasts longer (on other ports, the new answer's replace it). ``checked``: False
        when the answer's rule has check_names off."""
        wanted = [_key(name) for name in names]
        if wanted:
            self._bind(ips, wanted, now, (until, ports, checked))

    def _bind(
        self,
        ips: Iterable[IPAddress],
        keys: Sequence[str],
        now: float,
        entry: tuple[float, Ports, bool],
    ) -> None:
        """``learn`` for names already keyed (``_key``), ``entry`` (until, ports, checked)
        made once: the observer applies an answer's binding again at its copies."""
        table = self._table
        until, ports, checked = entry
        for ip in ips:
            bound = table.pop(ip, None)
            if bound is None:
                if len(table) >= self.max_addresses:
                    self._make_room(now)
                bound = {}
            table[ip] = bound  # to the end: the most recently learned
            for name in keys:
                old = bound.get(name)
                if old is None:
                    if len(bound) >= self.max_names:
                        del bound[_first_to_expire(bound)]
                        self.changes += 1
                    else:
                        if self._pairs >= self.max_pairs:
                            self._make_room(now, keep=ip)
                        self._pairs += 1
                elif old[1] != ports or old[2] != checked:
                    self.changes += 1  # what the old one allowed is gone, not extended
                elif old[0] >= until:
                    continue
                bound[name] = entry

    def names(self, ip: IPAddress, now: float) -> tuple[str, ...]:
        """The names bound to ``ip`` at ``now``, in the order they were learned."""
        bound = self._table.get(ip)
        return tuple(n for n, (until, *_) in bound.items() if until > now) if bound else ()

    def bound(self, ip: IPAddress, name: str, port: int, now: float) -> bool:
        """``name`` is bound to ``ip`` at ``now``, for TCP ``port``, by an answer seen
        here (an inherited address is ``inherited``'s: its caller checks the name's
        rule allows the port)."""
        found = self._table.get(ip, {}).get(_key(name))
        if found is None or found[0] <= now:
            return False
        return found[1].allows("tcp", port)

    def inherit(self, ip: IPAddress, port: int, until: float) -> None:
        """A predecessor's answer allowed ``ip`` on TCP ``port`` until ``until``, for names
        this table does not know (module docstring)."""
        ports = self._inherited.setdefault(ip, {})
        ports[port] = max(ports.get(port, 0.0), until)

    def forget_inherited(self) -> None:
        """A policy swap removes from the sets what no question of this resolver
        justifies, inherited addresses included: so they go here too."""
        self._inherited.clear()

    def inherited(self, ip: IPAddress, port: int, now: float) -> bool:
        """``inherit`` allowed ``ip`` on TCP ``port`` and that has not expired."""
        found = self._inherited.get(ip)
        if found is None:
            return False
        if found.get(port, 0.0) > now:
            return True
        if not any(until > now for until in found.values()):
            del self._inherited[ip]
        return False

    def unchecked(self, ip: IPAddress, port: int, now: float) -> bool:
        """A rule with check_names off put ``ip`` in the sets for TCP ``port``: a flow
        there is reached unread."""
        return any(
            until > now and not checked and ports.allows("tcp", port)
            for until, ports, checked in self._table.get(ip, {}).values()
        )

    def _make_room(self, now: float, keep: IPAddress | None = None) -> None:
        """Drop the addresses whose every name expired; if that is not enough, the eighth
        learned longest ago (so the scan runs once per eighth of the table's addresses or
        bindings made anew, not for each). Never ``keep``, the address being learned (the
        most recent: the eighth is taken from the oldest, and it has at least one more)."""
        table = self._table
        self.changes += 1
        for ip in [ip for ip, bound in table.items() if ip != keep and _ended(bound, now)]:
            self._pairs -= len(table.pop(ip))
        if len(table) >= self.max_addresses or self._pairs >= self.max_pairs:
            for ip in list(islice(table, max(1, len(table) // 8))):
                if ip != keep:
                    self._pairs -= len(table.pop(ip))


def answer_chain(qname: str, answers: list[message.Record]) -> tuple[str, ...]:
    """``qname`` and the names its CNAMEs lead to, in order: what an answer's addresses
    answer for (the filter kept only these; an unfiltered answer, in audit mode, may
    hold others)."""
    targets = {rr.name: rr.target for rr in answers if rr.rtype == message.CNAME}
    chain = [qname]
    while chain[-1] in targets and targets[chain[-1]] not in chain and len(chain) <= 16:
        chain.append(targets[chain[-1]])
    return tuple(chain)


@dataclass(frozen=True, slots=True)
class AnswerBinding:
    """What one released answer binds: its question and CNAME chain to its addresses, on
    its rule's ports, for ``ttl`` seconds (the shortest address TTL, clamped as the
    kernel's timeout is). The same answer bytes always parse to the same one, so the
    observer keeps it by those bytes and applies it again at a copy's own time
    (``observer.answers.REAPPLY_S``)."""

    addresses: tuple[IPAddress, ...]
    names: tuple[str, ...]  # keyed as the table keys them: lowercase, no final dot
    ports: Ports
    ttl: int
    checked: bool

    def apply(self, bindings: Bindings, now: float, grace: float) -> None:
        entry = (now + self.ttl + grace, self.ports, self.checked)
        bindings._bind(self.addresses, self.names, now, entry)


def answer_binding(data: bytes, policy: Policy, matcher: Matcher) -> AnswerBinding | None:
    """What an answer the resolver released binds (None: nothing; it does not parse, or
    names no address of a rule)."""
    try:
        try:
            response = message.parse(data)
        except message.Unsupported:
            response = message_dnslib.from_dnslib(data)
    except WireError:
        return None
    if len(response.questions) != 1:
        return None
    qname = response.questions[0][0]
    ips = [(record_ip(rr), rr.ttl) for rr in response.answers if rr.rtype in ADDRESS_TYPES]
    rule = matcher.rule_for(qname)
    if not ips or rule is None:
        return None
    ttl = max(policy.dns.ttl_min, min(min(t for _, t in ips), policy.dns.ttl_max))
    addresses = tuple(dict.fromkeys(ip for ip, _ in ips))
    names = tuple(_key(name) for name in answer_chain(qname, response.answers))
    return AnswerBinding(addresses, names, learned_ports(rule, policy), ttl, rule.check_names)


ADDRESS_TYPES = (message.A, message.AAAA)


def _key(name: str) -> str:
    return name.lower().rstrip(".")


def _ended(bound: dict[str, tuple[float, Ports, bool]], now: float) -> bool:
    """Every binding of an address has expired (or it has none)."""
    return all(until <= now for until, _, _ in bound.values())


def _first_to_expire(bound: dict[str, tuple[float, Ports, bool]]) -> str:
    """The name of (non-empty) ``bound`` whose binding ends first (the first learned of a
    tie, even of bindings that never end)."""
    first = next(iter(bound))
    soonest = bound[first][0]
    for name, (until, _, _) in bound.items():
        if until < soonest:
            first, soonest = name, until
    return first
