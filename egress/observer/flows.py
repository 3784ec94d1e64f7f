"""The observer's own check of a flow's first bytes, from its own copies.

The sandbox's ruleset copies to the observer's NFLOG group every answer the resolver
releases (``egress dns answer``) and every segment it hands to the inline layer's queue
(``egress first_bytes``). From the answers the observer keeps bindings of its own
(``resolver.bindings.answer_binding``: the names each address was resolved for, until
when), and it judges the segments with the same ``resolver.firstrequest`` and
``resolver.flows`` the inline layer runs. A refused flow is its ``name_mismatch`` too:
so if the inline layer let a mismatch through, or is gone, the observer still freezes.

It trusts nothing the inline layer says. What it cannot know it does not judge: an
address already in the sets when it started (egressd restarts an observer on a policy
swap) was resolved for names whose answers it never saw (maybe through a rule with
check_names off), so a flow there is judged only for a name no rule allows, the rest
being left to the inline layer until the kernel's element expires; and a
segment on the ports of a flow that just passed is judged only if it is a whole first
request naming a host (conntrack, which tells the inline layer whether it is the same
connection, does not tell the observer). A plain-HTTP flow is read request by request
here too, from the copies marked as its (``egress http_read``) and the ones copied before
its first request passed; a read flow whose start this observer did not see is left to
the inline layer.
"""

from __future__ import annotations

import ipaddress
import itertools
import struct
import time
from dataclasses import replace

from egress.datapath import constants as c
from egress.datapath.firstbytes import Outcome, judge
from egress.kernel.nflog import NflogEvent
from egress.kernel.nft_figures import Reader
from egress.model import Flow, IPAddress, Layer, Policy, Violation
from egress.observer.answers import GRACE_S, Answers
from egress.policy.matcher import Matcher
from egress.resolver.bindings import Bindings
from egress.resolver.firstrequest import Decision, FirstRequests, segment_of
from egress.resolver.flows import flow_violation


class FlowWatch:
    def __init__(self, policy: Policy, matcher: Matcher, sets: Reader | None) -> None:
        self.policy = policy
        self.matcher = matcher
        self.bindings = Bindings()
        self.requests = FirstRequests()
        self._ids = itertools.count(1)  # NFLOG copies have no packet id: one per segment
        self._uids: dict[tuple[str, int, str, int], int | None] = {}
        self.unknown: dict[IPAddress, float] = _in_sets(sets) if sets is not None else {}
        self.answers = Answers(policy, matcher, self.bindings)

    def on_event(self, event: NflogEvent) -> list[Violation]:
        if event.prefix == c.ANSWER_LOG_PREFIX:
            self._on_answer(event)
            return []
        if event.prefix == c.FIRST_BYTES_LOG_PREFIX:
            return self._on_segment(event)
        if event.prefix == c.READ_LOG_PREFIX:
            return self._on_segment(event, read=True)
        return []

    def expire(self, now: float) -> list[Violation]:
        if not len(self.requests):
            return []
        return self._violations(self.requests.expire(now), now)

    def _on_answer(self, event: NflogEvent) -> None:
        p = event.packet
        if p is None:
            return
        data = p.payload
        if p.proto == "tcp":  # one message per segment: the resolver writes each whole
            if len(data) < 2 or struct.unpack_from("!H", data)[0] != len(data) - 2:
                return
            data = data[2:]
        elif p.proto != "udp":
            return
        self.answers.learn(data, event.timestamp)

    def learn(self, data: bytes, now: float) -> None:
        """Bind what the answer ``data`` (a DNS message) names, as of ``now``."""
        self.answers.learn(data, now)

    def _on_segment(self, event: NflogEvent, read: bool = False) -> list[Violation]:
        seg = segment_of(next(self._ids), event.packet, read)
        if seg is None:
            return []
        key = seg.key
        self._uids.setdefault(key, event.uid)
        now = event.timestamp
        if read and not self.requests.reads(key):
            return []  # a stream whose start this observer did not see: the inline layer's
        decisions = self.requests.feed(seg, self.bindings, self.matcher, now)
        probed = any(d.probe for d in decisions)
        if probed and self.requests.follows(seg):
            # Copied before the flow's first request passed (conntrack read it on only
            # after), in order: the read connection's next bytes, as far as this layer
            # can tell. Past a gap, it is judged below as a reconnect's would be.
            seg = replace(seg, read=True)
            decisions = self.requests.feed(seg, self.bindings, self.matcher, now)
        elif probed:
            # Late bytes of a flow that passed, or a new connection from the same port:
            # the inline layer asks conntrack, this layer cannot. A segment that is a whole
            # first request naming a host is judged as one (what a reconnect must send to
            # reach another name); anything else is left as the passed flow's.
            if judge(seg.data).outcome is not Outcome.NAME:
                return []
            self.requests.forget(key)
            decisions = self.requests.feed(seg, self.bindings, self.matcher, now)
        return self._violations(decisions, now)

    def _violations(self, decisions: list[Decision], now: float) -> list[Violation]:
        out = []
        for d in decisions:
            uid = self._uids.pop(d.key, None)
            if d.verdict is None or d.verdict.allowed:
                continue
            if d.later and d.verdict.reason == "incomplete":
                continue  # a read flow's bytes it lacks: a copy lost here (NFLOG overran),
                # most likely; the inline layer, which holds the segments, bounds them
            dst = ipaddress.ip_address(d.key[2])
            if d.verdict.reason != "name_not_allowed" and self.unknown.get(dst, 0.0) > now:
                continue  # resolved before this observer started (maybe through a rule with
                # check_names off): the inline layer, which saw the answer, judges
            src, sport, _, dport = d.key
            flow = Flow("tcp", src, d.key[2], sport, dport)
            out.append(flow_violation(d.verdict, self.policy, self.matcher, flow, uid, now,
                                      Layer.OBSERVER))  # fmt: skip
        if len(self._uids) > 4 * self.requests.max_flows:
            self._uids.clear()  # flows that never completed a decision here
        return out


def _in_sets(sets: Reader) -> dict[IPAddress, float]:
    """The addresses in the allow sets now, each until its last element expires."""
    now, out = time.time(), dict[IPAddress, float]()
    for set_name, size in ((c.ALLOW4, 4), (c.ALLOW6, 16)):
        for key, left in sets.elements(set_name):
            if len(key) < size:
                continue
            address = ipaddress.ip_address(key[:size])  # the first field: the address
            out[address] = max(out.get(address, 0.0), now + left + GRACE_S)
    return out
