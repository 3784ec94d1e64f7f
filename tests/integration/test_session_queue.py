"""The inline layer's queue in egressd (Session with commits_off_loop): a freeze-worthy
verdict is frozen on the event loop that answers every sandbox's DNS (Enforcer.begin,
which waits for no lock) and committed by the writer thread, ahead of block/log records
still waiting; the commits never run on the loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from egress.freeze.enforcer import Begun, FreezeEvent
from egress.inline import session as session_mod
from egress.inline.session import Session
from egress.model import Action, Violation, ViolationClass
from egress.store.intents import Intent

SLOW_S = 0.05  # each record's "fsync"


@dataclass
class FakeEnforcer:
    handled: list[tuple[str, str]] = field(default_factory=list)  # (class, thread)
    begun: list[tuple[str, str]] = field(default_factory=list)  # (class, thread)
    begins: bool = True  # False: begin does nothing (no intent slot free, say)
    sightings: set[str] = field(default_factory=set)  # classes whose flow froze it already
    # The writer thread waits here before each record: cleared, it is held up (as by
    # SQLite's lock held elsewhere) until the test sets it.
    writer_may: threading.Event = field(default_factory=threading.Event)
    on_freeze: Any = None

    def __post_init__(self) -> None:
        self.writer_may.set()

    def wants_freeze(self, v: Violation) -> bool:
        return v.action is Action.FREEZE

    def begin(self, v: Violation, confirmer: object = None) -> Begun | None:
        if not (self.begins and self.wants_freeze(v)) or self.seen_before(v):
            return None
        self.begun.append((v.cls.value, threading.current_thread().name))
        intent = Intent("intents:1", 0, "sbx1", {})
        return Begun(v, "key", intent, v.at, time.time())

    def seen_before(self, v: Violation) -> bool:
        return v.cls.value in self.sightings

    def finish(self, v: Violation, begun: Begun | None) -> None:
        assert begun is None or begun.violation is v
        if threading.current_thread().name == "journal":
            assert self.writer_may.wait(10)
        time.sleep(SLOW_S)
        self.handled.append((v.cls.value, threading.current_thread().name))
        if self.wants_freeze(v):
            self.on_freeze(FreezeEvent(v, 1, 1.0, {}))

    def release_pinned(self) -> None:
        pass  # no intent file here: nothing pinned


class FakeListener:
    overruns = 0

    def read_events(self) -> list[object]:
        return []

    def close(self) -> None:
        pass


class ClosedCount(FakeListener):
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


@dataclass
class FakeSandbox:
    id: str = "sbx1"


def violation(cls: ViolationClass, action: Action) -> Violation:
    return Violation(
        cls=cls, layer="inline", rule="rule", detail="detail", at=time.time(), action=action
    )


def test_a_freeze_begins_on_the_loop_and_its_commit_goes_ahead_of_queued_records() -> None:
    async def main() -> None:
        enforcer = FakeEnforcer()
        session = Session(
            sb=FakeSandbox(), enforcer=enforcer, decision_timeout=None, review_hint="",  # type: ignore[arg-type]
            listener=FakeListener(), commits_off_loop=True,  # type: ignore[arg-type]
        )  # fmt: skip
        loop_thread = threading.current_thread().name
        started = time.monotonic()
        for _ in range(4):
            session.on_violation(violation(ViolationClass.DENIED_NAME, Action.BLOCK))
        session.on_violation(violation(ViolationClass.BLOCKED_CONNECT, Action.FREEZE))
        assert time.monotonic() - started < SLOW_S  # the loop never waited on a record
        deadline = time.monotonic() + 5
        while not session.state.freezes:  # reported back on the loop
            assert time.monotonic() < deadline, enforcer.handled
            await asyncio.sleep(0.01)
        session.stopping = True
        session.close()
        order = [cls for cls, _ in enforcer.handled]
        # The writer was busy with the first record at most; the freeze came next.
        assert order.index("blocked_connect") <= 1, order
        assert len(order) == 5 and {t for _, t in enforcer.handled} == {"journal"} != {loop_thread}
        # Frozen from the loop, before the records queued ahead of it were committed.
        assert enforcer.begun == [("blocked_connect", loop_thread)]

    asyncio.run(main())


def test_aclose_returns_once_everything_queued_is_journaled_and_the_loop_runs_meanwhile() -> None:
    """egressd's close: the loop answers other sandboxes while the writer commits the
    backlog (no executor thread is held for it), and it returns only once the last record
    is in; cancelled, it still releases the listener and the writer still finishes."""

    async def main() -> None:
        for cancel in (False, True):
            enforcer = FakeEnforcer()
            listener = ClosedCount()
            session = Session(
                sb=FakeSandbox(), enforcer=enforcer, decision_timeout=None, review_hint="",  # type: ignore[arg-type]
                listener=listener, commits_off_loop=True,  # type: ignore[arg-type]
            )  # fmt: skip
            for _ in range(5):
                session.on_violation(violation(ViolationClass.DENIED_NAME, Action.BLOCK))
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.005)

            ticker = asyncio.ensure_future(tick())
            closing = asyncio.ensure_future(session.aclose())
            # The loop's one executor thread stays free for a create, a delete, a kill.
            await asyncio.sleep(0)
            assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), SLOW_S) == "free"
            if cancel:
                await asyncio.sleep(SLOW_S)
                closing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await closing
                assert listener.closed == 1
                session._writer.join(timeout=5 * SLOW_S * 5)
                assert not session._writer.is_alive() and len(enforcer.handled) == 5
            else:
                await closing
                assert len(enforcer.handled) == 5 and listener.closed == 1
                assert ticks >= 10, ticks  # ~25 ticks in 5 x 50 ms: the loop was not held
            ticker.cancel()

    async def one_worker() -> None:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
        await main()

    asyncio.run(one_worker())


def test_a_freeze_the_writer_makes_after_a_cancelled_aclose_starts_no_review() -> None:
    """aclose cancelled while the writer is still finishing a freeze: the session has let
    go (its listener closed), so the freeze is kept as evidence but starts no review of
    its own, which would outlive the session and could kill a sandbox nobody serves
    here."""

    async def main() -> None:
        enforcer = FakeEnforcer()
        listener = ClosedCount()
        session = Session(
            sb=FakeSandbox(), enforcer=enforcer, decision_timeout=1.0, review_hint="",  # type: ignore[arg-type]
            listener=listener, commits_off_loop=True,  # type: ignore[arg-type]
        )  # fmt: skip
        session.on_violation(violation(ViolationClass.BLOCKED_CONNECT, Action.FREEZE))
        closing = asyncio.ensure_future(session.aclose())
        await asyncio.sleep(0)
        closing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await closing
        assert listener.closed == 1 and not enforcer.handled  # let go before the freeze
        await asyncio.to_thread(session._writer.join, 5 * SLOW_S)
        assert not session._writer.is_alive() and len(enforcer.handled) == 1
        deadline = time.monotonic() + 5
        while not session.state.freezes:  # the writer's report, run on the loop
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert session._monitor is None

    asyncio.run(main())


def test_past_the_backlog_a_freeze_begun_is_queued_and_a_record_is_counted_unjournaled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The writer far behind (JOURNAL_BACKLOG made 3 here): a block record more is not
    queued but counted, and so is a repeat of a flow frozen already (a sighting); a
    freeze begun on the loop is queued all the same (its record must not wait for
    SQLite on the loop), and committed in its turn; a freeze-worthy verdict that began
    nothing is finished on the loop, late rather than never."""
    monkeypatch.setattr(session_mod, "JOURNAL_BACKLOG", 3)

    async def main() -> None:
        enforcer = FakeEnforcer()
        enforcer.writer_may.clear()  # the writer held up at its first record
        session = Session(
            sb=FakeSandbox(), enforcer=enforcer, decision_timeout=None, review_hint="",  # type: ignore[arg-type]
            listener=FakeListener(), commits_off_loop=True,  # type: ignore[arg-type]
        )  # fmt: skip
        loop_thread = threading.current_thread().name
        for _ in range(8):  # the writer takes one at most meanwhile: 3 left queued
            session.on_violation(violation(ViolationClass.DENIED_NAME, Action.BLOCK))
        assert session.state.unjournaled >= 4
        session.on_violation(violation(ViolationClass.BLOCKED_CONNECT, Action.FREEZE))
        assert enforcer.begun == [("blocked_connect", loop_thread)]
        assert ("blocked_connect", loop_thread) not in enforcer.handled  # queued, not here
        enforcer.sightings.add("blocked_connect")
        unjournaled = session.state.unjournaled
        session.on_violation(violation(ViolationClass.BLOCKED_CONNECT, Action.FREEZE))
        assert session.state.unjournaled == unjournaled + 1  # a sighting: counted
        enforcer.begins = False  # no intent slot free, say: nothing begun
        session.on_violation(violation(ViolationClass.TUNNEL, Action.FREEZE))
        assert ("tunnel", loop_thread) in enforcer.handled  # finished here: no room
        enforcer.writer_may.set()
        session.stopping = True
        await session.aclose()
        threads = {cls: t for cls, t in enforcer.handled}
        assert threads["blocked_connect"] == "journal" and threads["tunnel"] == loop_thread
        assert len(enforcer.handled) == 9 - session.state.unjournaled + 2

    asyncio.run(main())


@dataclass
class LookedAt:
    """A cgroup whose every look (is_frozen) is counted."""

    frozen: bool = True
    looks: int = 0

    def is_frozen(self) -> bool:
        self.looks += 1
        return self.frozen


@dataclass
class FrozenSandbox:
    id: str = "sbx1"
    cgroup: LookedAt = field(default_factory=LookedAt)


def reviewing(sb: FrozenSandbox, poll_max_s: float, timeout: float | None = None) -> Session:
    return Session(
        sb=sb, enforcer=FakeEnforcer(), decision_timeout=timeout, review_hint="",  # type: ignore[arg-type]
        listener=FakeListener(), commits_off_loop=True, review_poll_max_s=poll_max_s,  # type: ignore[arg-type]
    )  # fmt: skip


def frozen(cls: ViolationClass, freeze_id: int | None) -> FreezeEvent:
    return FreezeEvent(violation(cls, Action.FREEZE), 1, 1.0, {}, freeze_id)


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Each sleep the session's reviews ask for, in order (and slept)."""
    asked: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        asked.append(seconds)
        await real_sleep(seconds)

    fake = SimpleNamespace(**{**vars(asyncio), "sleep": sleep})
    monkeypatch.setattr(session_mod, "asyncio", fake)
    return asked


def test_a_review_in_egressd_looks_for_the_thaw_less_often_as_it_waits(sleeps: list[float]) -> None:
    """Each look at a frozen sandbox's cgroup costs egressd's loop, which answers every
    sandbox: a look every 50 ms (as `egressctl run` does) for each of 1,000 sandboxes
    awaiting review would fill it. The waits double up to review_poll_max_s (0.4 s
    here), and the review still ends once the sandbox is thawed."""

    async def main() -> None:
        sb = FrozenSandbox()
        session = reviewing(sb, 0.4)
        session._frozen(frozen(ViolationClass.BLOCKED_CONNECT, 1))
        monitor = session._monitor
        assert monitor is not None
        while len(sleeps) < 6:
            await asyncio.sleep(0.05)
        assert sleeps[:6] == [0.05, 0.1, 0.2, 0.4, 0.4, 0.4], sleeps
        sb.cgroup.frozen = False
        await asyncio.wait_for(monitor, 10)  # its next look ends it
        assert sb.cgroup.looks == len(sleeps) + 1
        session.stopping = True
        await session.aclose()

    asyncio.run(main())


def test_a_review_backing_off_never_sleeps_past_its_decision_timeout(sleeps: list[float]) -> None:
    """However far the looks have backed off, the decision timeout's kill is not put off
    by the wait before the next one: no sleep asked reaches past the deadline."""
    killed: list[str] = []

    async def main() -> None:
        sb = FrozenSandbox()
        sb.cgroup.kill = lambda: killed.append("cgroup")  # type: ignore[attr-defined]
        session = reviewing(sb, 30.0, timeout=0.3)
        session.enforcer.journal = SimpleNamespace(record_decision=lambda *a: None)  # type: ignore[attr-defined]
        session._frozen(frozen(ViolationClass.BLOCKED_CONNECT, 1))
        assert session._monitor is not None
        await asyncio.wait_for(session._monitor, 10)
        assert killed == ["cgroup"] and session.state.timed_out
        assert sum(sleeps) <= 0.3 + 1e-6, sleeps  # backing off alone: 0.05 + 0.1 + 0.2
        session.stopping = True
        await session.aclose()

    asyncio.run(main())


def test_a_freeze_opened_after_the_one_under_review_gets_a_review_of_its_own(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Resumed (through egressd's API or `egressctl resume`) and frozen again between
    two of the review's looks, up to a second apart in egressd: the new freeze, a new
    journal freeze id, gets its own review (its block printed, its decision timeout
    from now), not taken for the one resumed. Another request of the freeze under
    review, a freeze not journaled, or an older one, starts none."""

    async def main() -> None:
        sb = FrozenSandbox()
        session = reviewing(sb, 3600.0, timeout=3600.0)  # it would not look again in time
        session._frozen(frozen(ViolationClass.BLOCKED_CONNECT, 7))
        first = session._monitor
        assert first is not None and capsys.readouterr().err.count("is FROZEN") == 1
        session._frozen(frozen(ViolationClass.DENIED_NAME, 7))  # the same freeze
        session._frozen(frozen(ViolationClass.DENIED_NAME, None))  # its record refused
        assert session._monitor is first and "is FROZEN" not in capsys.readouterr().err
        session._frozen(frozen(ViolationClass.TUNNEL, 8))
        second = session._monitor
        assert second is not first and second is not None
        await asyncio.sleep(0)
        assert first.cancelled()
        block = capsys.readouterr().err
        assert block.count("is FROZEN") == 1 and "tunnel: " in block, block
        session._frozen(frozen(ViolationClass.BLOCKED_CONNECT, 7))  # late, and older
        assert session._monitor is second and "is FROZEN" not in capsys.readouterr().err
        session.stopping = True
        await session.aclose()

    asyncio.run(main())


def test_a_review_from_the_journal_is_of_the_open_freeze_or_none(tmp_path: Path) -> None:
    """`egressctl run`'s watch of the cgroup (a freeze by the observer alone) starts a
    review from the journal: of the newest freeze still open. A killed sandbox's cgroup
    stays frozen with its freeze decided: no review of that one again; and a freeze
    opened since is the one reviewed, whatever its request's time says."""
    from egress.store.journal import Journal

    async def main() -> None:
        with Journal.open(tmp_path) as journal:
            journal.record_sandbox("sbx1", "p")
            enforcer = FakeEnforcer()
            enforcer.journal = journal  # type: ignore[attr-defined]
            sb = FrozenSandbox()
            sb.policy = SimpleNamespace(action=lambda cls: Action.FREEZE)  # type: ignore[attr-defined]
            session = Session(
                sb=sb, enforcer=enforcer, decision_timeout=None, review_hint="",  # type: ignore[arg-type]
                listener=FakeListener(), commits_off_loop=True,  # type: ignore[arg-type]
            )  # fmt: skip
            try:
                now = time.time()
                first = journal.record_violation(
                    "sbx1", violation(ViolationClass.TUNNEL, Action.FREEZE)
                )
                journal.record_freeze_request("sbx1", "inline", first, now)
                journal.record_decision("sbx1", "kill", 0, now + 1, "a person")
                assert session._open_freeze() is None  # decided: nothing to review
                v = violation(ViolationClass.BLOCKED_CONNECT, Action.FREEZE)
                second = journal.record_violation("sbx1", v)
                fid = journal.record_freeze_request("sbx1", "observer", second, now - 60)
                event = session._open_freeze()
                assert event is not None and event.freeze_id == fid, event
                assert event.violation_id == second and event.violation.cls is v.cls
            finally:
                session.stopping = True
                await session.aclose()

    asyncio.run(main())


def test_a_freeze_whose_record_sqlite_refused_gets_its_review_once_committed() -> None:
    """A freeze after a resume whose record SQLite refused has no freeze id yet: nothing
    tells it from the one under review. Once the layer's retry commits it (its id filled
    in, Enforcer.on_journaled), it gets its own review; the review's own freeze, its id
    filled in later, does not."""

    async def main() -> None:
        session = reviewing(FrozenSandbox(), 3600.0)
        reviewed = frozen(ViolationClass.BLOCKED_CONNECT, None)  # refused, too
        session._frozen(reviewed)
        first = session._monitor
        refused = frozen(ViolationClass.TUNNEL, None)
        session._frozen(refused)
        assert session._monitor is first
        told = session.enforcer.on_journaled  # type: ignore[attr-defined]
        reviewed.freeze_id = 7
        told(reviewed)
        assert session._monitor is first
        refused.freeze_id = 8
        told(refused)
        assert session._reviewed is refused and session._monitor is not first
        session.stopping = True
        await session.aclose()

    asyncio.run(main())
