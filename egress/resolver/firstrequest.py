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
"""

from __future__ import annotations

import functools
import ipaddress
from collections import OrderedDict
from dataclasses import dataclass, field

from egress.datapath.firstbytes import MAX_HELLO, Outcome, judge
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


TCP_URG = 0x20


def segment_of(packet_id: int, p: Packet | None) -> Segment | None:
    """The segment a parsed packet carries, or None if it is not one this can judge (not
    TCP, a fragment, no ports): both layers read their copies through this."""
    if p is None or p.proto != "tcp" or p.fragment or p.seq is None:
        return None
    if p.sport is None or p.dport is None:
        return None
    key = (p.src, p.sport, p.dst, p.dport)
    urgent = bool((p.tcp_flags or 0) & TCP_URG)
    return Segment(packet_id, key, _address(p.dst), p.dport, p.seq, p.payload, urgent)


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

    def __len__(self) -> int:
        """Flows waiting for the rest of their first request."""
        return len(self._waiting)

    def forget(self, key: FlowKey) -> None:
        """A probed segment came back: it is a new connection's, so judge it afresh."""
        self._decided.pop(key, None)

    def decided(self, key: FlowKey) -> bool | None:
        """The verdict on flow ``key`` (passed or not), None while it has none."""
        found = self._decided.get(key)
        return None if found is None else found.allowed

    def feed(
        self, seg: Segment, bindings: Bindings, matcher: Matcher, now: float
    ) -> list[Decision]:
        """Hold ``seg``, or decide on it and what its flow holds."""
        decided = self._decided.get(seg.key)
        if decided is not None:
            if not decided.allowed:
                return [Decision((seg.packet_id,), False, seg.key)]
            if _continues(decided, seg, now):
                return [Decision((seg.packet_id,), True, seg.key, probe=True)]
            del self._decided[seg.key]  # another connection from the same port

        out = []
        flow = self._waiting.get(seg.key)
        if flow is None:
            if not seg.data:  # a bare ACK before any byte: it carries nothing
                return [Decision((seg.packet_id,), True, seg.key)]
            if bindings.unchecked(seg.dst, seg.dport, now):  # its rule: check_names false
                self._remember(seg.key, True, seg.seq, len(seg.data), now)
                where = endpoint(seg.dst, seg.dport)
                verdict = FlowVerdict(True, None, "", f"a flow to {where}: not checked "
                                      "(a rule with check_names: false resolved it)")  # fmt: skip
                return [Decision((seg.packet_id,), True, seg.key, verdict)]
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
        if first.outcome is Outcome.NEED_MORE:
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
        """Refuse the flows whose first request did not complete in ``timeout_s``."""
        late = [k for k, f in self._waiting.items() if now - f.started >= self.timeout_s]
        return [self._refuse(k, f"no complete first request in {self.timeout_s:g} s") for k in late]

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
        start = min(flow.segments, key=lambda s: _distance(flow.first_seq, s), default=0)
        length = self._size(flow)
        self._remember(key, verdict.allowed, start, length, flow.started if now is None else now)
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
