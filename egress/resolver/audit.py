"""What an audit run saw, deduplicated and bounded: the learner's input.

In ``mode: audit`` the inline layer feeds an ``AuditLog`` every query it answers (name,
type, and the verdict enforce would have given) and every new flow the kernel logged
(address, protocol, port, the names whose answers put the address in the sandbox's
sets, and the verdict). Repeats only bump a count and the last-seen time, so a day of
a busy agent is a few hundred rows. Distinct entries are capped per kind (``cap``);
what comes after the cap is counted, not kept, and the learner reports the count.

``take`` hands the shell what changed since the last take (count deltas, first and
last seen), which it adds to the journal's audit tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

AUDIT_CAP = 2048  # distinct (name, type) and (address, proto, port) per sandbox, each
ALLOWED = "allowed"  # the verdict of an entry enforce would have let through
MAX_NAMES = 8  # names kept per connect (those of the answers that gave the address)


Key = TypeVar("Key", tuple[str, int], tuple[str, str, int])


@dataclass(slots=True)
class _Seen:
    verdict: str
    first: float
    last: float
    count: int = 0  # since the last take
    extra: tuple[str, ...] = ()  # a name's risks, or a connect's names
    chain: tuple[str, ...] = ()  # a name's: the CNAME targets its answers led to
    asked: tuple[str, ...] = ()  # a connect's: the names its flows asked for (SNI, Host)


@dataclass(frozen=True, slots=True)
class NameRow:
    name: str  # lowercase, no trailing dot
    qtype: int
    verdict: str  # ALLOWED, or the violation class enforce would have filed it under
    count: int
    first: float
    last: float
    risks: tuple[str, ...] = ()  # what its answers did: "rebinding", ...
    chain: tuple[str, ...] = ()  # the CNAME targets its answers led to, in order


@dataclass(frozen=True, slots=True)
class ConnectRow:
    address: str
    proto: str  # tcp | udp | ...
    port: int
    verdict: str  # ALLOWED or "blocked_connect"
    count: int
    first: float
    last: float
    names: tuple[str, ...] = ()  # whose answers gave this address (empty: none did)
    asked: tuple[str, ...] = ()  # what its flows asked for (TLS SNI, HTTP Host), if read


@dataclass(frozen=True, slots=True)
class AuditBatch:
    names: tuple[NameRow, ...] = ()
    connects: tuple[ConnectRow, ...] = ()
    over_cap_names: int = 0  # queries (or flows) not recorded because the cap was reached
    over_cap_connects: int = 0

    def is_empty(self) -> bool:
        return not (self.names or self.connects or self.over_cap_names or self.over_cap_connects)


@dataclass
class AuditLog:
    cap: int = AUDIT_CAP
    _names: dict[tuple[str, int], _Seen] = field(default_factory=dict)
    _connects: dict[tuple[str, str, int], _Seen] = field(default_factory=dict)
    _dirty_names: set[tuple[str, int]] = field(default_factory=set)
    _dirty_connects: set[tuple[str, str, int]] = field(default_factory=set)
    _over_names: int = 0
    _over_connects: int = 0

    def knows(self, name: str, qtype: int) -> bool:
        return (name, qtype) in self._names

    def name(self, name: str, qtype: int, verdict: str, now: float) -> None:
        """One query for ``name`` (as the resolver normalised it) and ``qtype``. The first
        verdict stands: a repeat from the cache is the same question."""
        key = (name, qtype)
        seen = _slot(self._names, key, self.cap, verdict, now)
        if seen is None:
            self._over_names += 1
            return
        seen.count += 1
        seen.last = max(seen.last, now)
        self._dirty_names.add(key)

    def risk(self, name: str, qtype: int, risk: str) -> None:
        """An answer to ``name`` did something the learner must not allow (``risk``)."""
        seen = self._names.get((name, qtype))
        if seen is not None and risk not in seen.extra:
            seen.extra = (*seen.extra, risk)
            self._dirty_names.add((name, qtype))

    def chain(self, name: str, qtype: int, targets: tuple[str, ...]) -> None:
        """An answer to ``name`` led through CNAMEs to ``targets``."""
        seen = self._names.get((name, qtype))
        if seen is not None and _adds(seen.chain, targets):
            seen.chain = _appended(seen.chain, targets)
            self._dirty_names.add((name, qtype))

    def connect(
        self, address: str, proto: str, port: int, verdict: str, names: tuple[str, ...], now: float
    ) -> None:
        """One new flow; ``names``: those bound to ``address`` when it started."""
        key = (address, proto, port)
        seen = _slot(self._connects, key, self.cap, verdict, now)
        if seen is None:
            self._over_connects += 1
            return
        seen.count += 1
        seen.last = max(seen.last, now)
        if verdict != ALLOWED:
            seen.verdict = verdict  # one blocked flow makes the destination a violation
        seen.extra = _appended(seen.extra, names)
        self._dirty_connects.add(key)

    def asked(self, address: str, proto: str, port: int, name: str, now: float) -> None:
        """A flow to this destination asked for ``name`` in its first bytes (the check of
        connect.check_names read it): the learner gives the port to that name alone."""
        key = (address, proto, port)
        # The flow's first packet may still be on its way from NFLOG: that one counts it.
        seen = _slot(self._connects, key, self.cap, ALLOWED, now)
        if seen is not None and _adds(seen.asked, (name,)):
            seen.asked = _appended(seen.asked, (name,))
            self._dirty_connects.add(key)

    def take(self) -> AuditBatch:
        """What changed since the last take (counts are deltas); resets the deltas."""
        names = tuple(
            NameRow(n, t, s.verdict, s.count, s.first, s.last, s.extra, s.chain)
            for (n, t), s in ((k, self._names[k]) for k in sorted(self._dirty_names))
        )
        connects = tuple(
            ConnectRow(a, p, port, s.verdict, s.count, s.first, s.last, s.extra, s.asked)
            for (a, p, port), s in ((k, self._connects[k]) for k in sorted(self._dirty_connects))
        )
        for seen in (*(self._names[k] for k in self._dirty_names),
                     *(self._connects[k] for k in self._dirty_connects)):  # fmt: skip
            seen.count = 0
        batch = AuditBatch(names, connects, self._over_names, self._over_connects)
        self._dirty_names.clear()
        self._dirty_connects.clear()
        self._over_names = self._over_connects = 0
        return batch


def _slot(table: dict[Key, _Seen], key: Key, cap: int, verdict: str, now: float) -> _Seen | None:
    """``table``'s entry for ``key``, made if there is room (None: the cap is reached)."""
    seen = table.get(key)
    if seen is None and len(table) < cap:
        seen = table[key] = _Seen(verdict, now, now)
    return seen


def _adds(old: tuple[str, ...], new: tuple[str, ...]) -> bool:
    return any(item not in old for item in new)


def _appended(old: tuple[str, ...], new: tuple[str, ...]) -> tuple[str, ...]:
    """``old`` and what of ``new`` it lacks, in order, at most MAX_NAMES."""
    return (*old, *(item for item in dict.fromkeys(new) if item not in old))[:MAX_NAMES]
