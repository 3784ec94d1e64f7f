"""The observer layer: a separate process that trusts nothing the inline layer says.

It reads the kernel's own evidence from the sandbox netns (its own NFLOG group, which gets
a copy of every DNS packet sent to the resolver and of every dropped packet, and the drop
rule's counter), parses the DNS queries itself, applies the same policy, and freezes
through its own Enforcer. From the copies of the resolver's answers and of the segments
held for the first-bytes check it judges those flows too (``flows.FlowWatch``). If the
inline layer's process dies, that is a ``layer_loss`` violation. It exits when the
sandbox's netns is gone or on SIGTERM.

Given a ``teardown`` (only `egressctl run`'s own observer is), it also ends what a dead
inline layer can no longer end: once that process is gone and nothing runs in the
cgroup any more (`egressctl kill`, or the command finished), it removes the sandbox as
`run` would have, journals it ended and exits. egressd's observers have none: egressd
handles its own sandboxes.

The cgroup it freezes is egress's own for the sandbox id, or, given as paths (what
egressd records), any cgroup: so it also watches sandboxes attached to another runtime's.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from egress.datapath import constants as c
from egress.datapath.evidence import drop_class, drop_violation
from egress.datapath.nflog_wire import Copies
from egress.errors import EgressError
from egress.freeze.enforcer import Enforcer
from egress.kernel.cgroup import Cgroup
from egress.kernel.netns import netns_exists, netns_id, netns_path
from egress.kernel.netns_cgroup import Peers
from egress.kernel.nflog import NflogEvent, NflogListener
from egress.kernel.nft_figures import Reader
from egress.model import Layer, Policy, SandboxState, Violation, ViolationClass
from egress.observer.flows import FlowWatch
from egress.observer.replays import QueryReplays
from egress.observer.sift import sift
from egress.observer.tally import DropTally
from egress.policy.matcher import Matcher
from egress.resolver import wire
from egress.resolver.judge import QueryScorer, judge, several_messages
from egress.store.journal import Journal
from egress.tunnel import scorer_for

TICK_S = 0.1
# The drop counter is read once a second: the log's burst carries the first drops of a
# flood at once (the violation and freeze come from those); the counter only adds how
# many the log then missed. A read is one GETOBJ on the observer's own nf_tables socket
# (kernel/nft_figures.py): 12 µs, where libnftables took 260 µs idle and 2-15 ms in a
# shard at 1,000 sandboxes, its loop judging none of its other sandboxes meanwhile.
COUNTER_S = 1.0
# Whether the sandbox's netns is still the one this observer opened is asked once a
# second, not at every tick: a shard ticks each of its ~500 observers ten times a second,
# and those stat()s were 2-12% of a shard's samples at 1,000 sandboxes (py-spy). It is
# what ends `egressctl observe`'s watch; egressctl run stops its observer, and a shard's
# scan of the run dir ends the observer of a sandbox deleted through egressd.
NETNS_S = 1.0
# The kernel hands copies over in batches of up to this many (or at its next tick, 4 ms
# at HZ=250 and 10 ms at HZ=100, when fewer come): a syscall and a wake-up per batch,
# not per packet. What waits is evidence for this layer only; the inline layer's group
# is never batched, and a drop's copy flushes the batch before it at once. 256, not 64:
# at egressctl run's cache hits (two copies a query, ~170,000 a second) the observer
# took 11% of a CPU instead of 16% (2 runs each, the sift not yet compiled), which
# dnsperf and the resolver share.
# Its 64 KiB buffer (NLBUFSIZ) holds ~300 such copies; more gained nothing measurable.
BATCH = 256
# Copies judged per wake-up of one sandbox's socket, replays included: in a shard, one
# sandbox's stream must leave the loop to the others' between its batches. Read a
# datagram at a time, a wake-up may take up to DRAIN_MAX + BATCH - 1.
DRAIN_MAX = 512
LAYER = Layer.OBSERVER


@dataclass
class ObserverConfig:
    sandbox_id: str
    netns: str
    policy: Policy
    state_dir: str
    watch_pid: int | None  # the inline layer's process
    # The sandbox's cgroup as paths (v2, and the v1 freezer twin if any): an attached
    # sandbox's cgroup lies wherever its runtime made it. None: egress's own, by the id.
    cgroup: str | None = None
    freezer: str | None = None
    # Is this policy still the one in force? egressd swaps a policy live and restarts the
    # observer a moment later; until then this one must not act on the old policy's
    # verdicts (a name the new one allows would be "denied", and maybe frozen for).
    current: Callable[[], bool] | None = None
    # Removes the sandbox (returns what resisted); called once the watched inline layer
    # is dead and the cgroup empty. Only where that layer owned the sandbox's end.
    teardown: Callable[[], list[str]] | None = None
    cgroup_found: bool = False  # ``cgroup`` was found from the netns's processes: again
    # A pod's observer beside a sidecar without --cgroup: egress's own cgroups there, left
    # out when the workload's is found from the netns's processes (netns_cgroup.Peers).
    peers: Peers | None = None

    def open_cgroup(self) -> Cgroup:
        if self.cgroup is None and self.peers is not None:
            cgroup = Cgroup.in_netns(netns_path(self.netns))
            cgroup.exclude = self.peers.exclusions
            cgroup.skip_init = True
            return cgroup
        if self.cgroup is None:
            return Cgroup.open(self.sandbox_id)
        return Cgroup.attached(netns_path(self.netns), self.cgroup, self.freezer,
                               self.cgroup_found)  # fmt: skip


class Observer:
    """One sandbox's observer. ``run`` is its own loop (`egressctl run`, `egressctl
    observe`); a shard of `egressd observer` drives many through ``fds``, ``on_ready``
    and ``tick`` in one loop instead, with one ``journal`` for them all (not closed here)."""

    def __init__(self, cfg: ObserverConfig, journal: Journal | None = None) -> None:
        self.cfg = cfg
        self.policy = cfg.policy
        self.matcher = Matcher(cfg.policy)
        self.scorer = scorer_for(cfg.policy.tunnel, time.monotonic)  # as the resolver's
        cgroup = cfg.open_cgroup()  # before the journal: a missing cgroup leaves nothing open
        self.owns_journal = journal is None
        self.journal = journal if journal is not None else Journal.open(cfg.state_dir)
        self.enforcer = Enforcer(cfg.sandbox_id, cfg.policy, LAYER, self.journal, cgroup)
        self.cgroup = cgroup
        # Whole packets: a ClientHello's segments and the answers are read, not only headers.
        self.listener = NflogListener.open(
            cfg.netns, c.OBSERVER_GROUP, copy_range=0xFFFF, batch=BATCH
        )
        nftables: Reader | None = None
        try:
            self.listener.sift = self._sift
            # Its own nf_tables socket for what it asks of the kernel: the allow sets at
            # start, the drop counter after (no libnftables: see COUNTER_S).
            self.nftables = nftables = Reader(cfg.netns, c.TABLE)
            self.flows = FlowWatch(cfg.policy, self.matcher, nftables)
            # Drops counted before this observer bound its group were judged by whoever
            # was watching then (an observer restarted on a policy swap, the inline
            # layer): not drops its log missed. Read after binding: none falls between.
            self.drops = DropTally(self._dropped() or 0, COUNTER_S, time.monotonic())
        except BaseException:
            # Unbound now, not when a collector gets to it: a group has one listener per
            # netns, and the next observer's bind would fail until then.
            self.listener.close()
            if nftables is not None:
                nftables.close()
            if self.owns_journal:
                self.journal.close()
            raise
        self.overruns = 0
        self.queries = QueryReplays()
        self.inline_fd = _pidfd(cfg.watch_pid)
        self.inline_dead = False
        self.stopping = False
        # The netns it opened in, and when that was last checked (just now).
        self._netns = netns_id(cfg.netns)
        self._netns_seen = time.monotonic()

    def start(self) -> None:
        """Serve until the sandbox is gone; an inline layer already dead is a loss now."""
        if self.cfg.watch_pid is not None and self.inline_fd is None:
            self._inline_lost()
        self.run()

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        # SIGTERM also writes a byte here, so poll() wakes at once instead of at its tick.
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        poll = select.poll()
        poll.register(wake_r, select.POLLIN)
        for fd in self.fds():
            poll.register(fd, select.POLLIN)
        self.tick()
        while not self.stopping:
            for fd, _ in poll.poll(TICK_S * 1000):
                if fd == wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 64)
                else:
                    if fd == self.inline_fd:
                        poll.unregister(fd)
                    self.on_ready(fd)
            self.tick()
        self.finish()

    def fds(self) -> list[int]:
        """What to wait on: the NFLOG socket, and the inline layer's pidfd if watched."""
        return [self.listener.fileno()] + ([self.inline_fd] if self.inline_fd is not None else [])

    def on_ready(self, fd: int) -> None:
        """``fd`` (one of ``fds``) is readable: copies to judge, or the inline layer died
        (its pidfd reports once; the caller stops waiting on it)."""
        if fd == self.inline_fd:
            self._inline_lost()
        else:
            self._drain()

    def tick(self) -> None:
        """What each pass does besides reading (at least every TICK_S): the sandbox gone
        ends the watch; the drop counter, the first-request timers, records SQLite
        refused (Enforcer.retry_pinned: a frozen sandbox makes no violation to retry
        them after), an abandoned sandbox."""
        now = time.monotonic()
        if now - self._netns_seen >= NETNS_S or self._netns is None:
            seen = netns_id(self.cfg.netns)
            if seen is None or seen != self._netns:  # gone, or a reused PID's path
                self.stopping = True
                return
            self._netns_seen = now
        self._check_counter()
        for v in self.flows.expire(time.time()):
            self._act(v)
        self.enforcer.retry_pinned()
        self._end_if_abandoned()

    def finish(self) -> None:
        """Judge what is still queued (when told to stop, it is still evidence); close,
        whatever judging it raised. Unbound first: the kernel flushes the copies it was
        still batching (up to a tick's: DNS, answers, queued segments) into the socket
        as the binding goes, and the drain reads them."""
        try:
            with contextlib.suppress(EgressError, OSError):
                self.listener.unbind()
                self._drain()
        finally:
            self.close()

    def close(self) -> None:
        self.enforcer.release_pinned()  # a shard's journal outlives this watch
        with contextlib.suppress(EgressError, OSError):
            self.listener.close()
            self.nftables.close()
            if self.owns_journal:
                self.journal.close()
        if self.inline_fd is not None:  # a shard restarts observers: one pidfd each
            with contextlib.suppress(OSError):
                os.close(self.inline_fd)
            self.inline_fd = None

    def _drain(self) -> None:
        queries = self.queries
        for event in self.listener.read_events(DRAIN_MAX):
            if event.prefix == c.DNS_LOG_PREFIX and queries.allowed(
                event.payload, time.monotonic()
            ):
                # A repeat of a query allowed within the last minute, behind a copy this
                # drain had to judge first (``_sift`` stops there): the same verdict, as
                # ``replays`` says, in this same order, without a parse. A busy observer
                # reads many copies at once, most of them behind one to judge: judging
                # each repeat again made it slower the further behind it was. As in
                # ``_sift`` and the resolver's replay, the scorer does not see it: its
                # windows would not move, only its zone's place among those kept, so a
                # zone of repeats alone is let go first; a zone remade still counts what
                # it sent before (tunnel/scorer.py, ``_allowance``).
                continue
            v = self.judge(event)
            if v is not None:
                queries.clear()  # a verdict (a tunnel's zone) may now cover repeats
                self._act(v)
            elif event.prefix == c.DNS_LOG_PREFIX and event.packet is not None:
                queries.remember(event.payload, event.packet.payload, time.monotonic())
            elif event.prefix in (c.FIRST_BYTES_LOG_PREFIX, c.READ_LOG_PREFIX):
                # The ruleset drops a checked flow's segment it could not queue (no queue
                # rule) counted but not logged: have the counter read after this one.
                self.drops.wake()
            for v in self.flows.on_event(event):
                self._act(v)

    def _sift(self, copies: Copies) -> int:
        """Deal here with the first of ``copies`` whose bytes say all there is, without
        making events of them (``sift.sift``): repeats of a query allowed within the last
        minute, and answers over UDP. How many it dealt with: it stops at the first that
        must be an event. The clocks are read once: a datagram's copies take tens of
        microseconds here, against a replay's minute and an answer's 50 ms."""
        return sift(copies, self.queries, self.flows.answers, time.monotonic(), time.time())

    def _act(self, v: Violation) -> None:
        """Act on one verdict; a failure is reported and the watch goes on."""
        if self.cfg.current is not None and not self.cfg.current():
            self.stopping = True  # superseded: the next observer judges by the new policy
            return
        try:
            self.enforcer.handle(v)
        except EgressError as exc:
            print(f"egress observer: could not act on {v.cls.value}: {exc}", file=sys.stderr)

    def judge(self, event: NflogEvent) -> Violation | None:
        """The observer's own verdict on one copied packet."""
        if drop_class(event.prefix) is not None:
            self.drops.on_logged()
        return verdict_on(event, self.policy, self.matcher, self.scorer)

    def _dropped(self) -> int | None:
        try:
            return self.nftables.counter_packets("dropped")
        except EgressError:
            return None

    def _check_counter(self) -> None:
        """Drops the rate-limited log did not carry still show in the counter."""
        now = time.monotonic()
        if self.listener.overruns != self.overruns:
            self.overruns = self.listener.overruns
            self.drops.wake()
        if not self.drops.due(now):
            return
        packets = self._dropped()
        if packets is None:
            return
        unlogged = self.drops.on_reading(packets, now)
        if unlogged > 0:
            v = Violation(
                cls=ViolationClass.BLOCKED_CONNECT,
                layer=LAYER,
                rule="default deny",
                detail=f"{unlogged} dropped packets beyond the log's rate limit",
                at=time.time(),
                action=self.policy.action(ViolationClass.BLOCKED_CONNECT),
            )
            self._act(v)

    def _inline_lost(self) -> None:
        if not netns_exists(self.cfg.netns):
            return  # the sandbox ended with its inline layer: not a loss
        cls = ViolationClass.LAYER_LOSS
        v = Violation(
            cls=cls,
            layer=LAYER,
            rule="spec.violations.layer_loss",
            detail=f"the inline layer (pid {self.cfg.watch_pid}) died; DNS is no longer answered",
            at=time.time(),
            action=self.policy.action(cls),
        )
        self._act(v)
        self.inline_dead = True
        # A freeze it made from its intent but never committed (store/intents.py).
        self.journal.fold_intents_or_say("egress observer")
        if self.cfg.teardown is not None:
            # The journal's owner is who ends the sandbox: `egressctl kill` waits for it.
            with contextlib.suppress(EgressError):
                self.journal.update_sandbox(self.cfg.sandbox_id, owner_pid=os.getpid())

    def _end_if_abandoned(self) -> None:
        """The inline layer is dead and nothing runs in the sandbox: remove it."""
        if not self.inline_dead or self.cfg.teardown is None:
            return
        with contextlib.suppress(EgressError):  # a cgroup gone already is empty
            if not self.cgroup.empty():
                return
        try:
            problems = self.cfg.teardown()
        except EgressError as exc:
            problems = [str(exc)]
        self.stopping = True  # done, either way: what resisted is `egressctl gc`'s now
        if problems:
            print(f"egress observer: could not remove the sandbox: {'; '.join(problems)}",
                  file=sys.stderr)  # fmt: skip
            return
        with contextlib.suppress(EgressError):
            self.journal.set_sandbox_state(self.cfg.sandbox_id, SandboxState.EXITED)
        print(f"egress observer: sandbox {self.cfg.sandbox_id} removed", file=sys.stderr)


def verdict_on(
    event: NflogEvent, policy: Policy, matcher: Matcher, scorer: QueryScorer | None
) -> Violation | None:
    """What one packet the kernel copied to the observer says (pure: testable unrooted).

    A logged drop is its class's violation; a DNS query gets ``resolver.judge``'s verdict,
    the same the inline layer's core acts on; anything else says nothing."""
    cls = drop_class(event.prefix)
    if cls is not None:
        return drop_violation(policy, cls, event.flow, event.uid, event.timestamp, LAYER)
    if event.prefix != c.DNS_LOG_PREFIX or event.packet is None or event.packet.proto != "udp":
        return None  # a query over TCP may span segments: the resolver's own check holds
    payload = event.packet.payload
    try:
        q = wire.parse_query(payload)
    except wire.WireError:
        return None  # the resolver answers FORMERR; nothing leaves
    # Several queries in one copy (UDP GSO): the resolver judges each, this copy can't.
    plain = wire.one_plain_query(payload, q)
    verdict = judge(q, matcher, scorer) if plain else several_messages(q)
    if verdict.allowed:
        return None
    # A tunnel is the name's doing, not one flow's: keyed by the question alone.
    flow = None if verdict.cls is ViolationClass.TUNNEL else event.flow
    return verdict.violation(
        q, layer=LAYER, policy=policy, at=event.timestamp, flow=flow, uid=event.uid
    )


def _pidfd(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None  # already gone: the first poll can't report it, so say so at start
