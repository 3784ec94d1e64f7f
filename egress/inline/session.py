"""The live part of `egressctl run`: evidence in, verdicts acted on, signals forwarded.

NFLOG (inline group) ─┐
resolver verdicts ────┴▶ Enforcer(inline) ─▶ journal, freeze, attribution
observer process dies ─▶ layer_loss
frozen ─▶ the review block on stderr ─▶ wait for resume/kill (or --decision-timeout)
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from egress.datapath import constants as c
from egress.datapath.evidence import drop_class, drop_violation
from egress.errors import EgressError
from egress.freeze.enforcer import Begun, Enforcer, FreezeEvent
from egress.inline.confirm import CONFIRMER
from egress.inline.flowcheck import FlowCheck
from egress.inline.review import review_block
from egress.kernel.nflog import NflogListener
from egress.model import Flow, Layer, ReviewAction, Violation, ViolationClass
from egress.resolver.audit import AuditBatch
from egress.resolver.core import ResolverCore
from egress.sandbox.lifecycle import Sandbox

FROZEN_POLL_S = 0.05
# The longest egressd waits between two looks at a frozen sandbox's cgroup for the thaw
# that ends its review: a look every FROZEN_POLL_S, 20 a second for each sandbox awaiting
# review, cost its loop 271 ms a second at 500 of them (bench_egressd --frozen-idle), so
# 1,000 would have taken more than half of the loop other sandboxes' answers run on. A
# freeze made after a thaw the review has not looked at yet is told apart by its journal
# freeze id (Session._frozen).
REVIEW_POLL_MAX_S = 1.0
JOURNAL_BACKLOG = 10_000  # block/log verdicts waiting for their fsync
MAX_KEPT = 10_000  # violations kept in memory for the report (the journal keeps more)
# What the resolver saw in mode: audit goes to the journal this often, and the freeze
# records SQLite refused are tried again.
TICK_S = 5.0
RETRY_PINNED = "retry pinned"  # on the journal queue: Enforcer.retry_pinned
# What the journal writer takes: a verdict (or a freeze begun on the loop, to finish),
# mode: audit's rows, RETRY_PINNED, or None: the end.
_Queued = Violation | Begun | AuditBatch | str | None


@dataclass
class SessionState:
    violations: list[Violation] = field(default_factory=list)  # the first MAX_KEPT
    seen: int = 0  # every violation, kept or not
    unjournaled: int = 0  # dropped because the journal fell this far behind
    freezes: list[FreezeEvent] = field(default_factory=list)
    timed_out: bool = False  # the decision timeout killed it
    overruns: int = 0


class Session:
    def __init__(
        self,
        *,
        sb: Sandbox,
        enforcer: Enforcer,
        decision_timeout: float | None,
        review_hint: str,
        listener: NflogListener | None = None,
        commits_off_loop: bool = False,
        review_poll_max_s: float = FROZEN_POLL_S,
    ) -> None:
        self.sb = sb
        self.enforcer = enforcer
        self.decision_timeout = decision_timeout
        self.review_hint = review_hint
        self.state = SessionState()
        # A listener handed over by a previous egressd is already bound to the group.
        self.listener = listener or NflogListener.open(sb.reach, c.INLINE_GROUP)
        self._monitor: asyncio.Task[None] | None = None
        self._reviewed: FreezeEvent | None = None  # what the running review is about
        # A review looks for the thaw every FROZEN_POLL_S at first, then less often: at
        # most this long between two looks (_await_decision).
        self.review_poll_max_s = max(review_poll_max_s, FROZEN_POLL_S)
        self._released = False  # _release ran: no review starts here any more
        # Bounded for verdicts (JOURNAL_BACKLOG, on_violation): a workload flooding denied
        # queries must not grow egressctl without end; not for a freeze begun on the loop
        # (one per intent slot at most), whose record must not wait there. Ordered by
        # urgency: a freeze to make (with commits_off_loop) goes before every record
        # still waiting for its fsync, a repeat of a flow frozen already among them.
        self._journal_queue: queue.PriorityQueue[tuple[int, int, _Queued]] = queue.PriorityQueue()
        self._queued = itertools.count()
        # egressd serves every sandbox on one event loop: only the part of a freeze
        # that waits for no lock runs on it (Enforcer.begin: the intent's write, the
        # freeze's ask and a look for its confirmation: ~0.5 ms, the write's fsync most
        # of it; a longer wait for the confirmation on a confirmer thread), the rest
        # (SQLite's commits, which queue behind the other layer's and egressd's, and the
        # attribution's /proc walk: 1-3 ms, more on a slow disk) on the writer thread, so
        # other sandboxes' answers never wait for those. Not all of it there: a freeze
        # queued behind a record the writer was committing waited for SQLite's write
        # lock too (up to its busy timeout), and one handed over under load waited for
        # the GIL (up to the loop's 5 ms switch interval). `egressctl run` serves one
        # sandbox and acts at once.
        self.commits_off_loop = commits_off_loop
        self._loop = asyncio.get_running_loop() if commits_off_loop else None
        self._writer_ended: Callable[[], None] | None = None  # aclose's, told as it ends
        self._writer_done = threading.Event()
        self._writer = threading.Thread(target=self._journal_writer, name="journal", daemon=True)
        self._writer.start()
        self.stopping = False
        self.flows: FlowCheck | None = None  # the first-bytes queue's reader (wiring.make)
        self.core: ResolverCore | None = None  # its AuditLog, in mode: audit (wiring.make)
        self._audit_timer: asyncio.TimerHandle | None = None
        self._retry_queued = False  # RETRY_PINNED waits in the journal queue
        enforcer.on_freeze = self._frozen_from_any_thread
        enforcer.on_journaled = self._journaled_from_any_thread

    # -- evidence ------------------------------------------------------------------------

    def on_nflog(self) -> None:
        for event in self.listener.read_events():
            if event.prefix.startswith(c.CONNECT_PREFIX):
                self._audit_connect(event.flow, event.prefix, event.timestamp)
                continue
            cls = drop_class(event.prefix)
            if cls is not None:
                pol = self.sb.policy
                if cls is ViolationClass.BLOCKED_CONNECT:
                    self._audit_connect(event.flow, event.prefix, event.timestamp)
                self.on_violation(
                    drop_violation(pol, cls, event.flow, event.uid, event.timestamp, Layer.INLINE)
                )

    # -- mode: audit ---------------------------------------------------------------------

    def _audit_connect(self, flow: Flow | None, prefix: str, at: float) -> None:
        if self.core is None or flow is None or flow.dport is None:
            return
        if flow.proto not in ("tcp", "udp"):
            return  # ICMP's "ports" are its type and code: no destination to learn
        try:
            address = ipaddress.ip_address(flow.dst)
        except ValueError:
            return
        static = prefix == c.CONNECT_STATIC_PREFIX
        blocked = prefix.startswith(c.DROP_LOG_PREFIX + ViolationClass.BLOCKED_CONNECT.value)
        self.core.audit_connect(address, flow.proto, flow.dport, static, blocked, at)

    def start_tick(self, core: ResolverCore) -> None:
        """Flush ``core``'s AuditLog to the journal every TICK_S (it records only in mode:
        audit; a swap may turn that on later), and once more at close; and on the same
        tick, commit the freeze records SQLite refused (Enforcer.retry_pinned: a frozen
        sandbox makes no violation to retry them after)."""
        self.core = core
        self._audit_timer = asyncio.get_running_loop().call_later(TICK_S, self._tick)

    def _tick(self) -> None:
        self.flush_audit()
        # On the writer thread, never here: the journal's lock may be held by that thread
        # for SQLite's busy timeout, which is when records get refused. One at a time.
        if not self._retry_queued and self.enforcer.journal.has_pinned(self.sb.id):
            self._retry_queued = True  # before: the writer may take it at once
            self._journal_queue.put_nowait((0, next(self._queued), RETRY_PINNED))
        if not self.stopping:
            self._audit_timer = asyncio.get_running_loop().call_later(TICK_S, self._tick)

    def flush_audit(self) -> None:
        """Hand what the audit log saw since the last flush to the journal writer."""
        if self.core is None:
            return
        batch = self.core.audit_log.take()
        if batch.is_empty():
            return
        # Never dropped: one batch a tick, deduplicated and capped (resolver.audit).
        self._journal_queue.put_nowait((1, next(self._queued), batch))

    def on_violation(self, v: Violation) -> None:
        """Freeze-worthy verdicts are acted on here and now (journal, then freeze; with
        ``commits_off_loop``, the intent and the freeze's ask only, Enforcer.begin); the
        rest are journaled by a writer thread, so a burst of denied queries never holds
        up the DNS answers behind it on an fsync."""
        self.state.seen += 1
        if len(self.state.violations) < MAX_KEPT:
            self.state.violations.append(v)
        urgent = self.enforcer.wants_freeze(v)
        if urgent and not self.commits_off_loop:
            self._act(v)
            return
        item: Violation | Begun = self._begin(v) if urgent else v
        if isinstance(item, Begun):  # its record waits for no room: one per intent slot
            self._journal_queue.put_nowait((0, next(self._queued), item))
            return
        # A freeze still to make (begin made none: no intent slot free, no cgroup bound
        # yet) goes first; a repeat of a flow frozen already is a sighting, a record.
        first = urgent and not self.enforcer.seen_before(v)
        if self._journal_queue.qsize() < JOURNAL_BACKLOG:
            self._journal_queue.put_nowait((0 if first else 1, next(self._queued), item))
        elif first:  # never dropped: finished here, late rather than never
            self._finish(item)
        else:
            self.state.unjournaled += 1  # counted in the report; the kernel still blocked it

    def _begin(self, v: Violation) -> Violation | Begun:
        """Enforcer.begin, or ``v`` where it began nothing (its finish does it all)."""
        try:
            return self.enforcer.begin(v, CONFIRMER) or v
        except Exception as exc:  # its finish tries all of it again, and reports what fails
            print(f"egress inline: could not begin to act on {v.cls.value}: {exc}",
                  file=sys.stderr)  # fmt: skip
            return v

    def _act(self, v: Violation) -> None:
        try:
            self.enforcer.handle(v)
        except EgressError as exc:  # a failed freeze is reported, never swallowed
            print(f"egress inline: could not act on {v.cls.value}: {exc}", file=sys.stderr)

    def _finish(self, item: Violation | Begun) -> None:
        """What ``_act`` does, after Enforcer.begin (tried on the loop for a freeze-worthy
        ``item``; a verdict of no freeze begins nothing). Whatever it raises is reported,
        and the writer goes on: the records queued behind it hold intent slots."""
        v, begun = (item.violation, item) if isinstance(item, Begun) else (item, None)
        try:
            self.enforcer.finish(v, begun)
        except EgressError as exc:  # a failed freeze is reported, never swallowed
            print(f"egress inline: could not act on {v.cls.value}: {exc}", file=sys.stderr)
        except Exception as exc:
            print(f"egress inline: could not act on {v.cls.value}: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)  # fmt: skip

    def _journal_writer(self) -> None:
        try:
            while (item := self._journal_queue.get()[2]) is not None:
                if isinstance(item, AuditBatch):
                    self._record_audit(item)
                elif isinstance(item, str):  # RETRY_PINNED
                    self._retry_queued = False
                    self.enforcer.retry_pinned()
                else:
                    self._finish(item)
            self.enforcer.release_pinned()  # the session ends; egress may go on
        finally:
            self._writer_done.set()  # first: aclose looks at it after installing its call
            ended = self._writer_ended
            if ended is not None:
                ended()

    def _record_audit(self, batch: AuditBatch) -> None:
        try:
            self.enforcer.journal.record_audit(self.sb.id, batch)
        except EgressError as exc:  # audit evidence lost is reported, never swallowed
            print(f"egress inline: could not journal what audit mode saw: {exc}",
                  file=sys.stderr)  # fmt: skip

    def observer_died(self) -> None:
        if self.stopping:
            return
        cls = ViolationClass.LAYER_LOSS
        self.on_violation(
            Violation(
                cls=cls,
                layer=Layer.INLINE,
                rule="spec.violations.layer_loss",
                detail="the observer layer died",
                at=time.time(),
                action=self.sb.policy.action(cls),
            )
        )
        # A freeze the dead observer made from its intent but never committed: into the
        # journal for the review (store/intents.py); after the loss is acted on.
        self.enforcer.journal.fold_intents_or_say("egress inline")

    def close(self, handed_over: bool = False) -> None:
        """Stop; with ``handed_over`` a successor reads the NFLOG group from now on, so
        leave the rest of its queue to it and keep the group bound."""
        self._last_evidence(handed_over)
        self._writer.join()  # everything seen is in the journal before the report is made
        self._release(handed_over)

    async def aclose(self, handed_over: bool = False) -> None:
        """``close`` for egressd: the loop serves the other sandboxes while the writer
        thread commits what is left (a commit each, fsync'd: at 1,000 sandboxes being
        deleted, the join stalled every answer for up to 10 ms each time)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def settle() -> None:
            if not done.done():
                done.set_result(None)

        def ended() -> None:  # on the writer thread, as it ends
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(settle)

        # Told by the thread itself, not waited for on one of the loop's executor threads:
        # those are few and shared (creates, deletes, a person's kill), and a workload
        # can make this backlog 10,000 commits long.
        self._writer_ended = ended
        self._last_evidence(handed_over)
        try:
            if not self._writer_done.is_set():
                await asyncio.shield(done)  # cancelled or not, the writer goes on to the end
        finally:
            self._release(handed_over)

    def _last_evidence(self, handed_over: bool) -> None:
        if not handed_over:
            with contextlib.suppress(EgressError):
                self.on_nflog()  # evidence that arrived while the command was exiting
        if self._audit_timer is not None:
            self._audit_timer.cancel()
        self.flush_audit()
        # Last in line (after every record), blocks until there is room: nothing is lost.
        self._journal_queue.put((2, next(self._queued), None))

    def _release(self, handed_over: bool) -> None:
        self._released = True
        self.state.overruns = self.listener.overruns
        if handed_over:
            self.listener.release()
        else:
            self.listener.close()
        if self._monitor is not None:
            self._monitor.cancel()

    # -- freezes -------------------------------------------------------------------------

    async def watch_frozen(self) -> None:
        """A freeze made by the observer alone must also show the review block and start
        the decision timeout: watch the cgroup, not only the inline layer's freezes."""
        while not self.stopping:
            if self.sb.cgroup.is_frozen() and (self._monitor is None or self._monitor.done()):
                event = self._open_freeze()
                if event is not None:
                    self._frozen(event)
            await asyncio.sleep(FROZEN_POLL_S)

    def _open_freeze(self) -> FreezeEvent | None:
        journal = self.enforcer.journal
        try:
            # The one still open, not the newest: that may be one decided already (a
            # kill leaves the cgroup frozen; a freeze made from a layer's intent is not
            # committed yet), and reviewed it would show the wrong violation, or review
            # a sandbox killed.
            freeze = journal.open_freeze(self.sb.id)
            vid = freeze["first_violation"] if freeze is not None else None
            row = journal.violation(vid) if vid is not None else None
        except EgressError:
            return None
        if freeze is None or row is None:
            return None
        ev = row.get("evidence") or {}
        cls = ViolationClass(row["class"])
        v = Violation(
            cls=cls, layer=row["layer"], rule=row["rule"], detail=row["detail"], at=row["at"],
            action=self.sb.policy.action(cls), uid=ev.get("uid"), qname=ev.get("qname"),
            qtype=ev.get("qtype"),
        )  # fmt: skip
        latency = freeze.get("latency_ms") or 0.0
        return FreezeEvent(v, vid, float(latency), row.get("process") or {}, freeze["id"])

    def _frozen_from_any_thread(self, event: FreezeEvent) -> None:
        self._on_loop(self._frozen, event)

    def _journaled_from_any_thread(self, event: FreezeEvent) -> None:
        self._on_loop(self._journaled, event)

    def _on_loop(self, told: Callable[[FreezeEvent], None], event: FreezeEvent) -> None:
        if self._loop is not None and threading.current_thread() is self._writer:
            self._loop.call_soon_threadsafe(told, event)
        else:
            told(event)

    def _frozen(self, event: FreezeEvent) -> None:
        self.state.freezes.append(event)
        if self._released:
            # A cancelled aclose let go while its writer froze the sandbox: the freeze is
            # journaled, and whoever serves the sandbox next (a successor egressd, or the
            # delete that ends it) finds the cgroup frozen. A review started here would
            # outlive the session, and could kill at its timeout a sandbox it no longer serves.
            return
        if self._monitor is None or self._monitor.done():
            self._review(event)
        else:
            self._journaled(event)

    def _journaled(self, event: FreezeEvent) -> None:
        """``event``'s freeze id known (at once, or once the retry committed the record
        SQLite had refused): a freeze after the one under review gets its own."""
        if self._released or self._monitor is None or self._monitor.done():
            return
        if self._after_reviewed(event):
            # A person decided the freeze under review and it was frozen again (between
            # two of the review's looks, up to review_poll_max_s apart, or by a resume
            # that found another freeze pending): a freeze of its own, with its own
            # block and decision timeout, not one taken for the freeze decided.
            decided = self._monitor
            self._review(event)
            decided.cancel()  # after: a review stands whatever printing the block raised

    def _after_reviewed(self, event: FreezeEvent) -> bool:
        """``event`` joined a freeze opened after the one under review was decided (the
        journal's freeze ids grow; every layer's request joins the open one). Unknown
        where either was not journaled (SQLite refused its record): not yet, then; the
        retry that commits it fills the id in and tells the session (_journaled)."""
        reviewed = self._reviewed
        if reviewed is None or reviewed.freeze_id is None or event.freeze_id is None:
            return False
        return event.freeze_id > reviewed.freeze_id

    def _review(self, event: FreezeEvent) -> None:
        print(
            review_block(self.sb.id, event, self.review_hint, self.decision_timeout),
            file=sys.stderr,
            flush=True,
        )
        self._reviewed = event
        self._monitor = asyncio.get_running_loop().create_task(self._await_decision())

    def kill(self, note: str) -> None:
        """Kill every process of the sandbox, journaled like a person's kill; a journal
        that cannot take the record does not keep the sandbox alive."""
        try:
            self.enforcer.journal.record_decision(
                self.sb.id, ReviewAction.KILL, os.getuid(), time.time(), note
            )
        except EgressError as exc:
            print(f"egress: could not journal the kill ({note}): {exc}", file=sys.stderr)
        self.sb.cgroup.kill()

    async def _await_decision(self) -> None:
        """Hold until a person thaws or kills it, or the decision timeout kills it."""
        deadline = (
            None if self.decision_timeout is None else time.monotonic() + self.decision_timeout
        )
        wait = FROZEN_POLL_S
        while self.sb.cgroup.is_frozen():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                self.state.timed_out = True
                self.kill(f"--decision-timeout {self.decision_timeout:g} s passed")
                return
            # Backing off (egressd: review_poll_max_s), but never past the deadline.
            await asyncio.sleep(wait if deadline is None else min(wait, deadline - now))
            wait = min(2 * wait, self.review_poll_max_s)
