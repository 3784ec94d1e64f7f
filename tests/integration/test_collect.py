"""The garbage collection policy of egressd and the observer shards (egress/collect.py)
against the interpreter's real collector, on a loop whose clock the test moves: what it
freezes the automatic collections leave alone; the full collection comes once the
sandboxes settle, at the latest MAX_DELAY_S after the last one, and takes every cycle,
frozen or not."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from egress import collect
from egress.collect import Collector, Timer


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


class Clock:
    """The part of an event loop Collector uses, with time moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.timers: list[Timer] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        self.timers.append(Timer(when, callback))
        return self.timers[-1]

    def call_later(self, delay: float, callback: Callable[[], object]) -> Timer:
        return self.call_at(self.now + delay, callback)

    def advance(self, seconds: float) -> None:
        """Move time on, running what falls due on the way, in order."""
        end = self.now + seconds
        while due := sorted((t for t in self.timers if not t.cancelled and t.when() <= end),
                            key=lambda t: t.when()):  # fmt: skip
            timer = due[0]
            self.timers.remove(timer)
            self.now = max(self.now, timer.when())
            timer.callback()
        self.now = end

    def collection_due(self) -> float:
        [timer] = [t for t in self.timers if not t.cancelled and t.callback.__name__ == "collect"]
        return timer.when()


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    gc.disable()  # no automatic collection between a cycle's making and its freezing
    thresholds = gc.get_threshold()  # a collector started and never closed changed them
    yield
    gc.set_threshold(*thresholds)
    gc.enable()
    gc.unfreeze()  # the rest of the suite's garbage is collected as usual
    gc.collect()


def short_thresholds(before: tuple[int, int, int]) -> tuple[int, int, int]:
    """What a started collector sets (an incremental one's are left as they were)."""
    return before if collect._INCREMENTAL else (before[0], collect.GEN1_EVERY, collect._NEVER)


def collector(clock: Clock, settle_s: float = 60, max_delay_s: float = 600) -> Collector:
    return Collector(clock, settle_s, max_delay_s)


def frozen_cycle(c: Collector) -> weakref.ref[Any]:
    ref = weakref.ref(Node())
    c.made()  # a sandbox made: what lives, this cycle too, frozen
    gc.collect()  # what the automatic collections do, at most
    assert ref() is not None
    return ref


def test_a_frozen_cycle_outlives_collections_until_the_full_one_once_settled() -> None:
    clock = Clock()
    c = collector(clock)
    ref = frozen_cycle(c)
    assert gc.get_freeze_count() > 0 and clock.collection_due() == 1060
    for _ in range(3):  # changes keep coming: the full collection keeps waiting
        clock.advance(59)
        assert c.collections == 0 and ref() is not None
        c.changed()
    clock.advance(59.9)
    assert c.collections == 0 and ref() is not None
    clock.advance(0.1)  # settled for 60 s
    assert c.collections == 1 and ref() is None
    assert gc.get_freeze_count() > 0  # what lives after it is frozen again
    assert clock.collection_due() == clock.now + 600  # and the next one is due at the latest


def test_churn_that_never_settles_is_collected_max_delay_after_the_last() -> None:
    clock = Clock()
    c = collector(clock)
    c.start()
    ref = frozen_cycle(c)
    while c.collections == 0:
        assert clock.now < 1000 + 600, "no full collection within max_delay"
        clock.advance(30)
        c.changed()  # a change every 30 s: never settled for 60
    assert 1600 <= clock.now < 1630 and ref() is None  # due at 1600, seen on the next step
    ref = frozen_cycle(c)
    while c.collections == 1:
        assert clock.now < 1600 + 600, "no second full collection within max_delay"
        clock.advance(30)
        c.changed()
    assert 2200 <= clock.now < 2230 and ref() is None


def test_start_keeps_what_adopted_sandboxes_made_due() -> None:
    clock = Clock()
    c = collector(clock)
    c.made()  # an adopted sandbox, before egressd serves
    clock.advance(1)
    c.start()
    assert clock.collection_due() == 1060
    quiet_clock = Clock()
    collector(quiet_clock).start()  # nothing made before: due max_delay on
    assert quiet_clock.collection_due() == 1600


def test_what_lives_is_frozen_every_second_once_started() -> None:
    clock = Clock()
    c = collector(clock)
    c.start()
    for _ in range(3):
        ref = weakref.ref(Node())
        assert ref() is not None
        clock.advance(collect.FREEZE_S)  # a tick: the cycle made since is frozen
        gc.collect()
        assert ref() is not None
    c.close()
    assert not [t for t in clock.timers if not t.cancelled]  # nothing left to fire


def test_timers_run_what_is_due_in_order_and_say_how_long_a_loop_may_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An observer shard's poll loop drives Collector through Timers."""
    timers = collect.Timers()
    now = [1000.0]
    monkeypatch.setattr(timers, "time", lambda: now[0])
    ran: list[str] = []
    timers.call_at(1002.0, lambda: ran.append("b"))
    timers.call_later(1.0, lambda: ran.append("a"))
    gone = timers.call_at(1000.5, lambda: ran.append("cancelled"))
    gone.cancel()
    assert timers.wait(10.0) == 1.0  # the cancelled one is no reason to wake
    assert timers.wait(0.1) == 0.1
    timers.call_at(1001.2, lambda: ran.append("cancelled too")).cancel()
    now[0] = 1001.5
    timers.run()
    assert ran == ["a"] and timers.wait(10.0) == 0.5
    now[0] = 1003.0
    assert timers.wait(10.0) == 0.0  # overdue: no wait (a negative one blocks epoll)
    timers.run()
    assert ran == ["a", "b"] and timers.wait(10.0) == 10.0


def test_timers_run_all_that_is_due_in_order_whatever_one_of_them_does(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Due together, in their order; one that raises is said and the rest still run; one
    a callback sets for now waits for the next run."""
    timers = collect.Timers()
    monkeypatch.setattr(timers, "time", lambda: 1000.0)
    ran: list[str] = []

    def fails() -> None:
        ran.append("fails")
        raise RuntimeError("a bug in a callback")

    timers.call_at(999.0, lambda: ran.append("first"))
    timers.call_at(999.5, fails)
    timers.call_at(999.8, lambda: timers.call_at(1000.0, lambda: ran.append("set now")))
    timers.call_at(999.9, lambda: ran.append("last"))
    timers.run()
    assert ran == ["first", "fails", "last"] and "a bug in a callback" in capsys.readouterr().err
    timers.run()
    assert ran == ["first", "fails", "last", "set now"]


def test_without_freezing_the_frozen_stay_frozen_and_no_automatic_full_collection_runs() -> None:
    """A forked shard's way: what was frozen before (the supervisor's, before the fork)
    is never walked, even by the full collection; the automatic full collections are
    off until close, which puts the thresholds back."""
    clock = Clock()
    c = Collector(clock, 60, 600, freeze=False)
    before = gc.get_threshold()
    inherited = Node()
    gone = weakref.ref(inherited)
    del inherited
    gc.freeze()  # the supervisor's, before the fork
    frozen = gc.get_freeze_count()
    try:
        c.start()
        assert gc.get_threshold() == short_thresholds(before)
        made = Node()
        made_ref = weakref.ref(made)
        del made
        c.made()
        assert gc.get_freeze_count() == frozen  # nothing more frozen
        clock.advance(60)  # settled: the full collection
        assert c.collections == 1 and made_ref() is None
        assert gone() is not None and gc.get_freeze_count() == frozen
    finally:
        c.close()
    assert gc.get_threshold() == before


@pytest.mark.skipif(collect._INCREMENTAL, reason="an incremental collector keeps its own")
def test_once_started_the_automatic_collections_stay_short_until_close() -> None:
    """No automatic full collection, and the middle generation collected at every other
    young one, so each walks two young generations' survivors, not ten (the module doc);
    close puts the thresholds back."""
    clock = Clock()
    c = collector(clock)
    before = gc.get_threshold()
    generations: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            generations.append(info["generation"])

    c.start()
    gc.callbacks.append(seen)
    gc.enable()  # the fixture's gc.disable() kept the automatic ones out of other tests
    try:
        assert gc.get_threshold() == short_thresholds(before)
        kept = [[i] for i in range(50 * before[0])]  # survivors: they go up the generations
        assert len(generations) >= 40
        assert 2 not in generations
        assert generations.count(1) >= len(generations) // 3
        del kept
    finally:
        gc.disable()
        gc.callbacks.remove(seen)
        c.close()
    assert gc.get_threshold() == before


def test_an_incremental_collector_keeps_its_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.14.0-3.14.4's collector reads the second threshold as how fast to scan the
    old generation (one would scan it ten times as fast) and keeps no third: left as they
    were there. This interpreter's collector is not one (it keeps a third threshold)."""
    assert collect._INCREMENTAL is False
    monkeypatch.setattr(collect, "_INCREMENTAL", True)
    clock = Clock()
    c = collector(clock)
    before = gc.get_threshold()
    c.start()
    try:
        assert gc.get_threshold() == before
    finally:
        c.close()
    assert gc.get_threshold() == before
