"""Layer 1's check of a new flow's first bytes: NFQUEUE in, a verdict per held segment.

The sandbox's ruleset marks a checked flow's first segments with data, iptables-nft's
NFQUEUE rule hands them here (``kernel.queue_rule``) and the kernel holds each until it
has a verdict. ``resolver.firstrequest`` puts the flow's first request together and
judges it against the resolver core's own bindings (the names whose answers put the
address into this sandbox's sets); this shell performs what it decides:

- passed: each held segment is released with CHECKED_MARK, which sets the flow's
  conntrack mark to CT_CHECKED, so every later packet of it stays in the kernel. A flow
  whose first request is plain HTTP is released with READ_MARK instead (CT_READING):
  every later segment of it with data is queued too, and each request it carries is
  judged as the first was, its body framed as the server frames it
  (``datapath.httpstream``); the segments between requests go at once;
- refused: a ``name_mismatch`` goes to the Session (journal, then freeze by default).
  A flow that freezes the sandbox has its segments dropped: the process stays inside
  its write or read with its socket open, where attribution finds it. Otherwise, and for
  every later segment of a refused flow (after a resume), REFUSED_MARK answers the
  segment with a TCP reset: the client fails at once, and no byte reaches the server;
- audit mode, or ``name_mismatch: log``: journaled, then released as if it passed;
- a segment with no data ahead of the flow's first request: released unmarked (the
  chain's usual rules take it; it carries nothing to read);
- a segment that may continue a passed flow (``Decision.probe``): re-run through the
  queue's rules (NF_REPEAT), which ask conntrack again. A checked flow's goes by; a read
  flow's comes back marked READ_QUEUE_MARK and is read as its flow's next bytes; one
  that comes back unmarked is a new connection's from the same port: judged afresh.
- a segment marked READ_QUEUE_MARK of a flow this layer reads no stream for (it
  restarted, or let the flow go at a bound): reset, with no verdict;
- a read flow's segment past a gap (the queue lost the one before it): held a while
  for the gap to fill, then dropped without a verdict or a reset (``Decision.quiet``),
  for the client's TCP to send again.

If this process dies, the queue has no listener and the kernel drops what it would
queue: new checked flows fail closed until a layer serves the queue again.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from ipaddress import ip_address

from egress.datapath import constants as c
from egress.errors import EgressError
from egress.inline.server import ResolverServer
from egress.kernel.nfqueue import NfqueueListener, QueuedPacket
from egress.model import Action, Flow, Mode, Violation, ViolationClass
from egress.resolver.firstrequest import MAX_HELD, Decision, FirstRequests, FlowKey, segment_of
from egress.resolver.flows import flow_violation

EXPIRE_EVERY_S = 0.5  # how often a flow still waiting for its first request is timed
QUEUE_MAXLEN = 2 * MAX_HELD  # the kernel's queue: never full while FirstRequests bounds it
LOSS_S = 2.0  # after the socket overflowed (segments dropped), new flows are refused this long
MAX_PROBED = 1024  # segments re-run to ask conntrack whose they are, remembered


class FlowCheck:
    def __init__(
        self,
        netns: str | None,
        resolver: ResolverServer,
        on_violation: Callable[[Violation], None],
        listener: NfqueueListener | None = None,
        frozen: Callable[[], bool] = lambda: False,
    ) -> None:
        self.resolver = resolver  # its core's bindings, matcher and policy, read per packet
        self.on_violation = on_violation
        # A listener handed over by a previous egressd is already bound to the queue.
        self.listener = listener or NfqueueListener.open(
            netns, c.FIRST_BYTES_QUEUE, maxlen=QUEUE_MAXLEN
        )
        self.frozen = frozen  # is the sandbox frozen now (a refused flow's retransmission)
        self.requests = FirstRequests()
        self._held: dict[int, QueuedPacket] = {}  # packet id -> packet, until its verdict
        self._probed: OrderedDict[tuple[FlowKey, int], None] = OrderedDict()  # (flow, seq)
        self._timer: asyncio.TimerHandle | None = None
        self.packets = 0  # segments the kernel handed over (the ruleset's queue)
        self._overruns = 0
        self.passed = 0  # flows released after their first request was judged
        self.refused = 0
        self.errors = 0  # verdicts the kernel could not take (the socket is gone, ...)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.listener.fileno(), self.on_readable)

    def on_readable(self) -> None:
        try:
            packets = self.listener.read_packets()
        except EgressError as exc:
            self._error(f"reading the queue: {exc}")
            return
        now = time.time()
        core = self.resolver.core
        self.packets += len(packets)
        if self.listener.overruns != self._overruns:  # the kernel dropped some: which flows?
            self._overruns = self.listener.overruns
            self.requests.refuse_new_until = now + LOSS_S
        try:
            for pkt in packets:
                read = pkt.mark == c.READ_QUEUE_MARK  # conntrack: a read flow's (queue_rules)
                seg = segment_of(pkt.packet_id, pkt.packet, read)
                if seg is None:  # not TCP as this reads it: nothing judged, so dropped
                    self._verdict(pkt.packet_id, accept=False)
                    continue
                self._held[pkt.packet_id] = pkt
                back = self._probed.pop((seg.key, seg.seq), 0) is None
                if back and not read:  # queued again as unchecked: a new connection's
                    for decision in self.requests.forget(seg.key):
                        self._perform(decision, now)
                for decision in self.requests.feed(seg, core.bindings, core.matcher, now):
                    self._perform(decision, now)
        finally:  # what waits is timed, also after a failure
            self._time_waiting()

    def _time_waiting(self) -> None:
        """Time the flows still waiting for the rest of their first request, and only
        while there are some: egressd serves a thousand sandboxes on one loop, and a
        timer each, twice a second, cost it 2,000 callbacks a second doing nothing."""
        if self._timer is None and len(self.requests):
            self._timer = asyncio.get_running_loop().call_later(EXPIRE_EVERY_S, self._expire)

    def _expire(self) -> None:
        self._timer = None
        try:
            now = time.time()
            for decision in self.requests.expire(now):
                self._perform(decision, now)
        finally:  # a failure must not leave waiting flows untimed
            self._time_waiting()

    def _perform(self, d: Decision, now: float) -> None:
        packets = [self._held.pop(i) for i in d.packet_ids if i in self._held]
        if d.probe:
            for pkt in packets:
                self._probe(d.key, pkt)
            return
        if d.quiet:  # past a gap the queue made: dropped, for the client to send again
            for pkt in packets:
                self._verdict(pkt.packet_id, accept=False)
            return
        policy = self.resolver.core.policy
        if d.verdict is not None and policy.mode is Mode.AUDIT:
            self.resolver.core.audit_asked(ip_address(d.key[2]), d.key[3], d.verdict.name, now)
        action = policy.action(ViolationClass.NAME_MISMATCH)
        release = d.accept or policy.mode is Mode.AUDIT or action is Action.LOG
        mark: int | None = c.READ_MARK if d.read else c.CHECKED_MARK
        if d.verdict is None and self.requests.decided(d.key) is None:
            mark = 0  # no data ahead of the first request: nothing decided yet
        elif d.verdict is not None and not d.verdict.allowed:
            self.refused += 1
            first = packets[0] if packets else None
            src, sport, dst, dport = d.key
            v = flow_violation(
                d.verdict, policy, self.resolver.core.matcher, Flow("tcp", src, dst, sport, dport),
                first.uid if first else None, now, "inline",
            )  # fmt: skip
            self.on_violation(v)
            if not release and action is Action.FREEZE:
                mark = None  # dropped: the process is frozen inside its write or read
        elif d.verdict is not None and not d.later:
            self.passed += 1
        elif not d.accept and action is Action.FREEZE and not release and self.frozen():
            mark = None  # a retransmission while frozen: dropped, the socket stays as it was
        if not release and mark is not None:
            mark = c.REFUSED_MARK
        for pkt in packets:
            self._verdict(pkt.packet_id, accept=mark is not None, mark=mark)

    def _probe(self, key: FlowKey, pkt: QueuedPacket) -> None:
        seq = pkt.packet.seq if pkt.packet is not None else None
        if seq is None:
            self._verdict(pkt.packet_id, accept=False)
            return
        self._probed[(key, seq)] = None
        while len(self._probed) > MAX_PROBED:
            self._probed.popitem(last=False)
        try:
            self.listener.verdict(pkt.packet_id, True, repeat=True)
        except EgressError as exc:
            self._error(str(exc))

    def _verdict(self, packet_id: int, accept: bool, mark: int | None = None) -> None:
        try:
            self.listener.verdict(packet_id, accept, mark=mark if accept else None)
        except EgressError as exc:
            self._error(str(exc))

    def _error(self, what: str) -> None:
        self.errors += 1
        print(f"egress inline: first-bytes queue: {what}", file=sys.stderr)

    def stop_reading(self) -> None:
        """A successor reads the queue now (egressd's handoff): take nothing more from it.
        What it holds is dropped when it closes (the clients send it again, to the
        successor); no timer refuses it meanwhile."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        with contextlib.suppress(ValueError, OSError, RuntimeError):
            asyncio.get_running_loop().remove_reader(self.listener.fileno())

    def close(self, handed_over: bool = False) -> None:
        """Stop; held segments are dropped by the kernel as the socket closes (fail
        closed). With ``handed_over`` a successor serves the queue: keep it bound."""
        self.stop_reading()
        if handed_over:
            # The successor shares the queue: the segments held here would wait there for
            # a verdict nobody gives. Dropped, their clients send them again, and the
            # successor judges the flow from its first segment.
            for packet_id in list(self._held):
                self._verdict(packet_id, accept=False)
            self._held.clear()
            self.listener.release()
        else:
            self.listener.close()
