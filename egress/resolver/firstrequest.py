"""A flow's first request, put together from the segments the kernel holds, then judged.

The kernel hands the first payload segments of a checked TCP flow to the inline layer
and holds each until it has a verdict (``kernel.nfqueue``). A ClientHello or an HTTP
header block may take several segments, so nothing is released until the bytes so far
say what the flow asks for (``datapath.firstbytes``) and ``flows.judge_flow`` has said
whether that name is one this address was resolved for. Then every held segment of the
flow gets the same verdict: all pass, or none reaches the server.

Sans-I/O, like the core: ``feed`` a segment and ``expire`` on a timer, and perform the
``Decision``s they return, in order. Segments that overlap with different bytes refuse
the flow: a receiver's TCP stack picks one copy, and the check must read what it reads.
Bounded, and failing closed at each bound: a flow whose first request is not complete
within ``max_segments`` segments (``HELD_FACTOR`` times as many packets held),
``max_bytes`` bytes or ``timeout_s`` seconds is refused (``incomplete``); beyond
``max_flows`` flows waiting at once, the one waiting longest is refused.

A decided flow's verdict is remembered, so that a segment of it still queued when the
verdict came (a retransmission, a request body sent right after its headers) gets the
same answer instead of being judged as a new flow's first bytes. But the four-tuple
does not say "the same connection", and neither do sequence numbers: a client may
connect again from the same port at once (the server closed first), and Linux's
initial sequence number for the same four-tuple only grows with the clock (RFC 6528),
so the new connection's bytes start just past the old ones. Only conntrack knows: the
old connection's entry is marked checked, a new one's is not. So a segment that could
continue a pass (within ``CONTINUE_BYTES`` of the judged bytes, within ``PASSED_S``) is
a ``probe``: the shell re-runs it through the queue's chain (NF_REPEAT), whose rule
queues only flows still unchecked in conntrack. A segment of the passed connection
goes on; one of a new connection comes back, and ``forget`` makes it judged as what it
is. A refusal is kept as it is: its retransmissions (after a resume) are refused again.

A flow whose first request is plain HTTP is read on (``Decision.read``): the shell has
conntrack queue its every later segment with data, marked as a read flow's
(``Segment.read``), and each is fed in order to the flow's ``RequestStream``
(``datapath.httpstream``), which frames bodies and hands back each request head to judge
as the first was. A segment is held while the bytes it carries are not all judged (an
unfinished head), past a gap until the bytes before it come, and within the same bounds
as a first request. A retransmission must agree with the bytes that framed requests
(the last ``KEEP_BYTES`` of them per flow); a body's bytes frame nothing. A segment of a read
flow queued before conntrack knew it as one (its first request's verdict came after)
is a probe too: re-run, it comes back marked as what its flow is by then.
"""

from __future__ import annotations

import functools
import ipaddress
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from egress.datapath.firstbytes import MAX_HELLO, Outcome, judge
from egress.datapath.httpstream import RequestStream
from egress.datapath.packet import Packet
from egress.model import IPAddress
from egress.policy.matcher import Matcher
from egress.resolver.bindings import Bindings
from egress.resolver.flows import FlowVerdict, endpoint, judge_flow

FlowKey = tuple[str, int, str, int]  # src, sport, dst, dport

MAX_SEGMENTS = 8  # a ClientHello with a post-quantum key share spans 2-3 full segments
MAX_BYTES = MAX_HELLO + 5 * 8  # a ClientHello at firstbytes' bound, in records
TIMEOUT_S = 5.0
MAX_FLOWS = 1024
# Packets held over all flows: half the kernel's queue (kernel.nfqueue's maxlen), so the
# queue never fills. A full queue drops silently, and a flow whose first segment was
# dropped there would be judged on a later one.
MAX_HELD = 2048
HELD_FACTOR = 4  # packets held per flow, retransmissions and bare ACKs too: 4 x segments
DECIDED = 4096  # flows whose verdict a retransmission may still ask for
CONTINUE_BYTES = 256 * 1024  # a decided flow's later segments: this far past its bytes
PASSED_S = 2.0  # how long a pass is remembered
MAX_READING = 1024  # plain-HTTP flows read request by request at once; the oldest goes
# A read flow's framing bytes kept to compare retransmissions with: a whole head at its
# bound and more (a retransmission of a long head's first segment must still agree).
KEEP_BYTES = 20 * 1024
KEEP_SPANS = 256  # where older framing bytes were, kept without them: a body's may pass
KEEP_TOTAL = 2 * 1024 * 1024  # ... over all its read flows


@dataclass(frozen=True, slots=True)
class Segment:
    """One held TCP segment of a checked flow, as the kernel queued it."""

    packet_id: int
    key: FlowKey
    dst: IPAddress
    dport: int
    seq: int  # its first byte's sequence number
    data: bytes  # its payload; empty for a bare ACK
    # URG set: a server without SO_OOBINLINE takes the urgent byte out of the stream, so
    # it would read other bytes than the check did. A first request never needs it.
    urgent: bool = False
    # Conntrack had the flow as read request by request when the segment was queued (its
    # first request passed as plain HTTP): a later segment of that connection, not a new
    # connection's first (see ``FirstRequests``).
    read: bool = False


TCP_URG = 0x20


def segment_of(packet_id: int, p: Packet | None, read: bool = False) -> Segment | None:
    """The segment a parsed packet carries, or None if it is not one this can judge (not
    TCP, a fragment, no ports): both layers read their copies through this. ``read``:
    the ruleset says its flow is read request by request (``Segment.read``)."""
    if p is None or p.proto != "tcp" or p.fragment or p.seq is None:
        return None
    if p.sport is None or p.dport is None:
        return None
    key = (p.src, p.sport, p.dst, p.dport)
    urgent = bool((p.tcp_flags or 0) & TCP_URG)
    return Segment(packet_id, key, _address(p.dst), p.dport, p.seq, p.payload, urgent, read)


@functools.lru_cache(maxsize=4096)
def _address(text: str) -> IPAddress:
    """A destination's address (a sandbox reaches few: parsed once each, not per segment)."""
    return ipaddress.ip_address(text)


@dataclass(frozen=True, slots=True)
class Decision:
    """Release (``accept``) or drop the held segments ``packet_ids``. ``verdict``: the
    flow's, when this decision is the one that judged it (None for a bare ACK, or a
    segment of a flow judged before)."""

    packet_ids: tuple[int, ...]
    accept: bool
    key: FlowKey
    verdict: FlowVerdict | None = None
    probe: bool = False  # re-run it through the queue's rule: conntrack says which flow
    # Released, and the flow is read on: its later segments are queued too (plain HTTP,
    # request by request). An accept without it ends the queueing of a passed flow.
    read: bool = False
    later: bool = False  # ``verdict`` is on a read flow's bytes after its first request
    # Dropped without a verdict or a reset, for the client's TCP to send again: a read
    # flow's segment past a gap the queue made, beyond what is held for it.
    quiet: bool = False


@dataclass(frozen=True, slots=True)
class _Decided:
    allowed: bool
    start: int  # sequence number of the first judged byte
    length: int  # bytes judged
    at: float


@dataclass
class _Waiting:
    started: float
    dst: IPAddress
    dport: int
    first_seq: int = 0  # of the first segment held: sequence numbers are ordered from it
    segments: dict[int, Segment] = field(default_factory=dict)  # by seq
    held: list[int] = field(default_factory=list)  # packet ids, bare ACKs included

    def start(self) -> int:
        """The sequence number of the earliest byte held (0 with none)."""
        return min(self.segments, key=lambda s: _distance(self.first_seq, s), default=0)


@dataclass
class _Reading:
    """A plain-HTTP flow whose first request passed, read request by request."""

    dst: IPAddress
    dport: int
    stream: RequestStream
    base: int  # the sequence number of the stream's first byte
    held: list[int] = field(default_factory=list)  # in order, held until all judged
    held_since: float = 0.0
    ahead: dict[int, Segment] = field(default_factory=dict)  # past a gap, by seq
    ahead_since: float = 0.0
    framing: list[tuple[int, bytearray]] = field(default_factory=list)  # (stream offset, bytes)
    kept: int = 0  # bytes in ``framing``
    dropped: list[tuple[int, int]] = field(default_factory=list)  # framing no longer kept
    forgotten: int = 0  # before this stream offset not even where framing was is known
    verdict: FlowVerdict | None = None  # the last head passed, not yet released
    passed_at: float = 0.0  # when its first request passed
    # A segment went with READ_MARK: conntrack knows the flow as read, and a verdict
    # released from now on is on a later request (the first release carries the first's).
    marked: bool = False

    def next_seq(self) -> int:
        return (self.base + self.stream.offset) % (1 << 32)

    def packets(self) -> tuple[int, ...]:
        return (*self.held, *(s.packet_id for s in self.ahead.values()))

    def keep(self, at: int, data: bytes) -> None:
        """Keep framing bytes ``data`` at stream offset ``at``: the last ``KEEP_BYTES``."""
        last = self.framing[-1] if self.framing else None
        if last is not None and last[0] + len(last[1]) == at:
            last[1].extend(data)
        else:
            self.framing.append((at, bytearray(data)))
        self.kept += len(data)
        while self.kept > KEEP_BYTES:
            first_at, first = self.framing[0]
            cut = min(len(first), self.kept - KEEP_BYTES)
            del first[:cut]
            self.kept -= cut
            if self.dropped and self.dropped[-1][1] == first_at:
                self.dropped[-1] = (self.dropped[-1][0], first_at + cut)
            else:
                self.dropped.append((first_at, first_at + cut))
            if len(self.dropped) > KEEP_SPANS:
                self.forgotten = self.dropped.pop(0)[1]
            if first:
                self.framing[0] = (first_at + cut, first)
            else:
                self.framing.pop(0)

    def agrees(self, at: int, data: bytes) -> bool | None:
        """A retransmission of stream bytes ``at``.. says what was read there: the same
        bytes wherever they framed requests (a body's bytes frame nothing). None: it
        overlaps framing bytes no longer kept, so that cannot be told."""
        end = at + len(data)
        if at < self.forgotten or any(lo < end and at < hi for lo, hi in self.dropped):
            return None
        for kept_at, kept in self.framing:
            lo, hi = max(at, kept_at), min(end, kept_at + len(kept))
            if lo < hi and data[lo - at : hi - at] != kept[lo - kept_at : hi - kept_at]:
                return False
        return True


class FirstRequests:
    def __init__(
        self,
        max_segments: int = MAX_SEGMENTS,
        max_bytes: int = MAX_BYTES,
        timeout_s: float = TIMEOUT_S,
        max_flows: int = MAX_FLOWS,
        max_held: int = MAX_HELD,
    ) -> None:
        self.max_segments = max_segments
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.max_flows = max_flows
        self.max_held = max_held
        self._held = 0  # packets held over all waiting flows
        # Until then a new flow is refused: the queue overflowed, and a flow whose first
        # segment was lost there would be judged on a later one (set by the shell).
        self.refuse_new_until = 0.0
        self._waiting: OrderedDict[FlowKey, _Waiting] = OrderedDict()
        self._decided: OrderedDict[FlowKey, _Decided] = OrderedDict()
        self._reading: OrderedDict[FlowKey, _Reading] = OrderedDict()
        self._kept = 0  # framing bytes kept over all read flows
        self._holding: set[FlowKey] = set()  # read flows holding packets

    def __len__(self) -> int:
        """Flows waiting for the rest of a request: their first, or a read flow's next."""
        return len(self._waiting) + len(self._holding)

    def forget(self, key: FlowKey) -> list[Decision]:
        """A probed segment came back: it is a new connection's, so judge it afresh. What
        the old connection's read stream still held is dropped (it is gone)."""
        self._decided.pop(key, None)
        r = self._reading.pop(key, None)
        if r is None:
            return []
        self._let_go(key, r)
        return [Decision(r.packets(), False, key)] if r.packets() else []

    def decided(self, key: FlowKey) -> bool | None:
        """The verdict on flow ``key`` (passed or not), None while it has none."""
        if key in self._reading:
            return True
        found = self._decided.get(key)
        return None if found is None else found.allowed

    def reads(self, key: FlowKey) -> bool:
        """Flow ``key`` passed as plain HTTP and is read request by request."""
        return key in self._reading

    def follows(self, seg: Segment) -> bool:
        """``seg`` starts within its read flow's stream so far, or right after it."""
        r = self._reading.get(seg.key)
        return r is not None and _distance(r.next_seq(), seg.seq) <= 0

    def feed(
        self, seg: Segment, bindings: Bindings, matcher: Matcher, now: float
    ) -> list[Decision]:
        """Hold ``seg``, or decide on it and what its flow holds."""
        reading = self._reading.get(seg.key)
        out: list[Decision] = []
        if reading is not None:
            if seg.read:
                self._reading.move_to_end(seg.key)
                return self._on_read(seg, reading, bindings, matcher, now) + self._bound(seg.key)
            # Nothing of the flow was released yet (its first segments end inside an
            # element), so conntrack cannot know it as read: what follows its bytes is its
            # next bytes. (A new connection on these ports needs the old socket gone, its
            # first write still held here, and a new first byte at exactly these
            # sequence numbers.)
            if (
                not reading.marked
                and _distance(reading.base, seg.seq) >= 0
                and _distance(reading.next_seq(), seg.seq) <= 0
            ):
                seg = replace(seg, read=True)
                self._reading.move_to_end(seg.key)
                return self._on_read(seg, reading, bindings, matcher, now) + self._bound(seg.key)
            # Queued before the first request's verdict had conntrack read the flow on, or
            # a new connection's from the same port: conntrack knows (a probe). Far from
            # the stream, or long after that verdict, it is a new connection's at once.
            if (
                now - reading.passed_at <= PASSED_S
                and 0 <= _distance(reading.base, seg.seq) < reading.stream.offset + CONTINUE_BYTES
            ):
                return [Decision((seg.packet_id,), True, seg.key, probe=True)]
            out += self.forget(seg.key)
        if seg.read:
            # Conntrack reads the flow on and this has no stream for it: a refused flow's
            # retransmission, or a stream this layer lost (it restarted, or let the flow
            # go at a bound), where requests begin is unknown. A reset, and no verdict:
            # the workload did nothing wrong.
            return [Decision((seg.packet_id,), False, seg.key)]
        decided = self._decided.get(seg.key)
        if decided is not None:
            if not decided.allowed:
                return [*out, Decision((seg.packet_id,), False, seg.key)]
            if _continues(decided, seg, now):
                return [*out, Decision((seg.packet_id,), True, seg.key, probe=True)]
            del self._decided[seg.key]  # another connection from the same port

        flow = self._waiting.get(seg.key)
        if flow is None:
            if not seg.data:  # a bare ACK before any byte: it carries nothing
                return [*out, Decision((seg.packet_id,), True, seg.key)]
            if bindings.unchecked(seg.dst, seg.dport, now):  # its rule: check_names false
                self._remember(seg.key, True, seg.seq, len(seg.data), now)
                where = endpoint(seg.dst, seg.dport)
                verdict = FlowVerdict(True, None, "", f"a flow to {where}: not checked "
                                      "(a rule with check_names: false resolved it)")  # fmt: skip
                return [*out, Decision((seg.packet_id,), True, seg.key, verdict)]
            if len(self._waiting) >= self.max_flows:
                out.append(self._refuse(next(iter(self._waiting)), "too many flows waiting"))
            if now < self.refuse_new_until:
                flow = self._waiting[seg.key] = _Waiting(now, seg.dst, seg.dport, seg.seq)
                flow.held.append(seg.packet_id)
                self._held += 1
                out.append(self._refuse(seg.key, "the queue lost segments just now, maybe "
                                        "this flow's first"))  # fmt: skip
                return out
            flow = self._waiting[seg.key] = _Waiting(now, seg.dst, seg.dport, seg.seq)
        flow.held.append(seg.packet_id)
        self._held += 1
        if seg.urgent and seg.data:
            out.append(self._refuse(seg.key, "urgent data (URG) in the first request",
                                    "malformed"))  # fmt: skip
            return out
        if self._held > self.max_held:  # the kernel's queue must never fill up: see above
            oldest = next(iter(self._waiting))
            out.append(self._refuse(oldest, f"{self._held - 1} segments held already"))
            if oldest == seg.key:
                return out
        known = flow.segments.get(seg.seq) if seg.data else None
        if known is not None and not _agree(known.data, seg.data):
            out.append(self._refuse(seg.key, "a retransmission with other bytes", "overlap"))
            return out
        if seg.data and (known is None or len(seg.data) > len(known.data)):
            flow.segments[seg.seq] = seg  # a longer retransmission: the kernel merged some
        data = self._contiguous(flow)
        if data is None:
            out.append(self._refuse(seg.key, "segments overlap with other bytes", "overlap"))
            return out
        first = judge(data)
        # Plain HTTP with held bytes past a gap: they are read in order too, so it waits.
        gap = first.outcome is Outcome.NAME and first.protocol == "http" and self._gap(flow, data)
        if first.outcome is Outcome.NAME and first.protocol == "http" and not gap:
            return out + self._start_reading(seg.key, flow, data, bindings, matcher, now)
        if first.outcome is Outcome.NEED_MORE or gap:
            if (
                len(flow.segments) >= self.max_segments
                or len(flow.held) >= HELD_FACTOR * self.max_segments  # bare ACKs, repeats
                or self._size(flow) >= self.max_bytes
            ):
                out.append(self._refuse(seg.key, f"no complete first request in "
                                                 f"{len(flow.segments)} segments"))  # fmt: skip
            return out
        out.append(self._decide(seg.key, judge_flow(first, flow.dst, flow.dport, bindings,
                                                    matcher, now), now))  # fmt: skip
        return out

    def expire(self, now: float) -> list[Decision]:
        """Refuse the flows whose first request, or a read flow's next bytes held, did not
        complete in ``timeout_s``."""
        late = [k for k, f in self._waiting.items() if now - f.started >= self.timeout_s]
        out = [self._refuse(k, f"no complete first request in {self.timeout_s:g} s") for k in late]
        for key in list(self._holding):
            r = self._reading[key]
            since = min(r.ahead_since, r.held_since) if r.held else r.ahead_since
            if r.ahead and now - since >= self.timeout_s:
                # A gap that never filled: what waits on either side of it is dropped, for
                # its client to send again (a lost segment is the queue's doing, not the
                # workload's). What the stream read of it comes again, and must agree.
                ids = r.packets()
                r.ahead.clear()
                r.held = []
                self._held -= len(ids)
                self._holding.discard(key)
                out.append(Decision(ids, False, key, quiet=True))
            elif r.held and now - r.held_since >= self.timeout_s:
                why = f"no complete request in {self.timeout_s:g} s"
                out.append(self._refuse_read(key, r, why))
        return out

    # --- plain HTTP, request by request ----------------------------------------------------

    def _start_reading(
        self,
        key: FlowKey,
        flow: _Waiting,
        data: bytes,
        bindings: Bindings,
        matcher: Matcher,
        now: float,
    ) -> list[Decision]:
        """A first request in plain HTTP: the flow is read on, from its first byte."""
        del self._waiting[key]
        r = _Reading(
            flow.dst, flow.dport, RequestStream(), flow.start(), list(flow.held), flow.started
        )
        r.passed_at = now
        self._decided.pop(key, None)
        self._reading[key] = r
        self._holding.add(key)  # what it holds stays counted in self._held
        refusal = self._read(key, r, data, bindings, matcher, now)
        return ([refusal] if refusal is not None else self._release(key, r)) + self._bound(key)

    def _on_read(
        self, seg: Segment, r: _Reading, bindings: Bindings, matcher: Matcher, now: float
    ) -> list[Decision]:
        key, pid = seg.key, seg.packet_id
        if self._held >= self.max_held:  # the queue must never fill: its client sends it again
            return [Decision((pid,), False, key, quiet=True)]
        if seg.urgent and seg.data:  # in order or past a gap
            return [self._refuse_with(key, r, pid, "urgent data (URG) in a request", "malformed")]
        rel = _distance(r.next_seq(), seg.seq)
        if rel > 0:  # past a gap: kept until the bytes before it come, or dropped
            return self._hold_ahead(key, r, seg, now)
        r.held.append(pid)
        self._held += 1
        if len(r.held) == 1:
            r.held_since = now
            self._holding.add(key)
        refusal = self._take(key, r, seg, bindings, matcher, now)
        while refusal is None and r.ahead:
            ready = sorted((q for q in r.ahead if _distance(r.next_seq(), q) <= 0),
                           key=lambda q: _distance(r.next_seq(), q))  # fmt: skip
            if not ready:
                break
            for q in ready:
                taken = r.ahead.pop(q)
                r.held.append(taken.packet_id)
                refusal = self._take(key, r, taken, bindings, matcher, now)
                if refusal is not None:
                    break
        if refusal is not None:
            return [refusal]
        if len(r.held) >= HELD_FACTOR * self.max_segments:
            return [self._refuse_read(key, r, f"no complete request in {len(r.held)} segments")]
        return self._release(key, r)

    def _hold_ahead(self, key: FlowKey, r: _Reading, seg: Segment, now: float) -> list[Decision]:
        """A segment past a gap. Its copies must agree (the receiver keeps one); beyond
        ``max_segments`` of them it is dropped, for its client to send again: a gap is
        a lost segment (the queue overflowed), not the workload's doing."""
        known = r.ahead.get(seg.seq)
        if known is not None:
            if not _agree(known.data, seg.data):
                why = "a retransmission with other bytes"
                return [self._refuse_with(key, r, seg.packet_id, why, "overlap")]
            if len(seg.data) <= len(known.data):
                return [Decision((seg.packet_id,), False, key, quiet=True)]  # held already
            r.ahead[seg.seq] = seg  # a longer copy: the shorter one's packet goes
            return [Decision((known.packet_id,), False, key, quiet=True)]
        if len(r.ahead) >= self.max_segments:
            return [Decision((seg.packet_id,), False, key, quiet=True)]
        r.ahead[seg.seq] = seg
        self._held += 1
        if len(r.ahead) == 1:
            r.ahead_since = now
        self._holding.add(key)
        return []

    def _take(
        self,
        key: FlowKey,
        r: _Reading,
        seg: Segment,
        bindings: Bindings,
        matcher: Matcher,
        now: float,
    ) -> Decision | None:
        """Read what ``seg`` (in order, or a retransmission) adds to the stream."""
        rel = _distance(r.next_seq(), seg.seq)
        overlap = min(-rel, len(seg.data))
        agrees = r.agrees(r.stream.offset + rel, seg.data[:overlap]) if overlap else True
        if agrees is False:
            return self._refuse_read(key, r, "a retransmission with other bytes where "
                                     "requests are framed", "overlap")  # fmt: skip
        if agrees is None:  # a copy of bytes long gone by: unread, so reset (no verdict)
            return self._refuse_read(key, r, "", verdict=None, quietly=True)
        new = seg.data[overlap:]
        return self._read(key, r, new, bindings, matcher, now) if new else None

    def _read(
        self,
        key: FlowKey,
        r: _Reading,
        data: bytes,
        bindings: Bindings,
        matcher: Matcher,
        now: float,
    ) -> Decision | None:
        """Feed ``data``, the stream's next bytes; judge each head they complete."""
        before, kept = r.stream.offset, r.kept
        step = r.stream.feed(data)
        for at, n in step.framing:
            r.keep(at, data[at - before : at - before + n])
        self._kept += r.kept - kept
        for head in step.heads:
            verdict = judge_flow(head, r.dst, r.dport, bindings, matcher, now)
            if not verdict.allowed:
                return self._refuse_read(key, r, verdict=verdict)
            r.verdict = verdict
        return None

    def _release(self, key: FlowKey, r: _Reading) -> list[Decision]:
        """Release what is held in order once every byte of it is judged."""
        if r.stream.pending:
            return []
        ids = tuple(r.held)
        later = r.marked and r.verdict is not None
        d = Decision(ids, True, key, r.verdict, read=True, later=later)
        r.marked = r.marked or bool(ids)
        r.held_since = 0.0
        self._held -= len(ids)
        r.held, r.verdict = [], None
        if not r.ahead:
            self._holding.discard(key)
        return [d] if ids else []

    def _refuse_with(
        self, key: FlowKey, r: _Reading, packet_id: int, why: str, reason: str
    ) -> Decision:
        """Refuse the flow with ``packet_id``, just come, among what it holds."""
        r.held.append(packet_id)
        self._held += 1
        return self._refuse_read(key, r, why, reason)

    def _refuse_read(
        self,
        key: FlowKey,
        r: _Reading,
        why: str = "",
        reason: str = "incomplete",
        verdict: FlowVerdict | None = None,
        quietly: bool = False,
    ) -> Decision:
        """Refuse the flow: its held segments are dropped or reset, and so is every later
        one. ``quietly``: with no verdict (reset, and no violation)."""
        if verdict is None and not quietly:
            where = endpoint(r.dst, r.dport)
            verdict = FlowVerdict(False, None, reason, f"a flow to {where}: {why}")
        del self._reading[key]
        self._let_go(key, r)
        self._remember(key, False, r.base, r.stream.offset, r.held_since)
        return Decision(r.packets(), False, key, verdict, later=True)

    def _let_go(self, key: FlowKey, r: _Reading) -> None:
        self._held -= len(r.held) + len(r.ahead)
        self._kept -= r.kept
        self._holding.discard(key)

    def _bound(self, key: FlowKey) -> list[Decision]:
        """At most ``MAX_READING`` read flows, keeping ``KEEP_TOTAL`` framing bytes: the
        ones read least recently go (a later segment of one is reset: ``feed``)."""
        out = []
        while len(self._reading) > 1 and (
            len(self._reading) > MAX_READING or self._kept > KEEP_TOTAL
        ):
            old = next(iter(self._reading))
            if old == key:
                self._reading.move_to_end(key)
                old = next(iter(self._reading))
            r = self._reading.pop(old)
            self._let_go(old, r)
            if r.packets():
                out.append(Decision(r.packets(), False, old))
        return out

    def _gap(self, flow: _Waiting, data: bytes) -> bool:
        """Held bytes lie past the first gap (``data`` ends at it)."""
        start = flow.start()
        return any(_distance(start, q) + len(s.data) > len(data) for q, s in flow.segments.items())

    def _contiguous(self, flow: _Waiting) -> bytes | None:
        """The bytes from the first segment held on, up to the first gap; None when two
        segments overlap with different bytes. Which copy a receiver keeps is its TCP
        stack's choice, so a flow that sends two is refused, never judged on one.
        Sequence numbers wrap at 2^32: ordered by their signed distance from the first
        segment held (a retransmission of an earlier one comes before it)."""
        seqs = sorted(flow.segments, key=lambda s: _distance(flow.first_seq, s))
        out, start = bytearray(), seqs[0]
        for seq in seqs:
            data = flow.segments[seq].data
            at = len(out)
            off = (seq - start) % (1 << 32)
            if off > at:
                break  # a gap: what comes after waits for the segment in between
            overlap = min(at - off, len(data))
            if data[:overlap] != out[off : off + overlap]:
                return None
            out += data[overlap:]
        return bytes(out)

    def _size(self, flow: _Waiting) -> int:
        return sum(len(s.data) for s in flow.segments.values())

    def _refuse(self, key: FlowKey, why: str, reason: str = "incomplete") -> Decision:
        flow = self._waiting[key]
        detail = f"a flow to {endpoint(flow.dst, flow.dport)}: {why}"
        return self._decide(key, FlowVerdict(False, None, reason, detail))

    def _decide(self, key: FlowKey, verdict: FlowVerdict, now: float | None = None) -> Decision:
        flow = self._waiting.pop(key)
        self._held -= len(flow.held)
        length = self._size(flow)
        self._remember(key, verdict.allowed, flow.start(), length,
                       flow.started if now is None else now)  # fmt: skip
        return Decision(tuple(flow.held), verdict.allowed, key, verdict)

    def _remember(self, key: FlowKey, allowed: bool, start: int, length: int, at: float) -> None:
        self._decided[key] = _Decided(allowed, start, length, at)
        while len(self._decided) > DECIDED:
            self._decided.popitem(last=False)


def _distance(base: int, seq: int) -> int:
    """How far ``seq`` is past ``base``, negative before it (mod 2^32, signed)."""
    d = (seq - base) % (1 << 32)
    return d - (1 << 32) if d >= 1 << 31 else d


def _continues(d: _Decided, seg: Segment, now: float) -> bool:
    """``seg`` may belong to the passed flow: within its bytes or just past them (sequence
    numbers wrap at 2^32), soon after it. Anything else is judged as a new flow at once."""
    return now - d.at <= PASSED_S and (seg.seq - d.start) % (1 << 32) < d.length + CONTINUE_BYTES


def _agree(a: bytes, b: bytes) -> bool:
    """The two copies of the same bytes are the same, as far as both go."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]
