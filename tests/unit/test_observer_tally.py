"""The observer's check of the drop counter against its rate-limited log (pure)."""

from __future__ import annotations

from egress.observer.tally import DropTally

TICK = 0.1


def test_a_steady_stream_of_logged_drops_is_never_taken_for_a_lost_one() -> None:
    """Each reading catches one drop whose message is still on the way, a different one
    each time: nothing was lost (this froze a resumed sandbox once its workload kept
    sending blocked packets)."""
    tally = DropTally(0, TICK, now=0.0)
    for i in range(50):
        # drop i+1 counted by the kernel, its message not yet read...
        assert tally.on_reading(i + 1, i * TICK) == 0
        tally.on_logged()  # ...and read before the next tick


def test_drops_the_log_never_carried_are_reported_once_a_tick_later() -> None:
    tally = DropTally(0, TICK, now=0.0)
    for _ in range(100):
        tally.on_logged()
    assert tally.on_reading(350, 0.0) == 0  # 250 counted beyond the log: maybe in flight
    assert tally.on_reading(350, 0.05) == 0  # not a tick old yet
    assert tally.on_reading(350, 0.1) == 250
    assert tally.on_reading(350, 0.2) == 0  # reported once
    tally.on_logged()  # a later drop, logged
    assert tally.on_reading(351, 0.3) == 0
    assert tally.on_reading(351, 0.4) == 0


def test_a_loss_behind_later_logged_drops_is_still_seen() -> None:
    tally = DropTally(0, TICK, now=0.0)
    assert tally.on_reading(5, 0.0) == 0  # 5 counted, none logged yet
    for _ in range(3):  # 3 of them arrive; 2 were beyond the limit
        tally.on_logged()
    assert tally.on_reading(8, 0.1) == 2  # 3 more counted meanwhile: judged next tick
    for _ in range(3):
        tally.on_logged()
    assert tally.on_reading(8, 0.2) == 0


def test_drops_counted_before_the_observer_started_are_not_its_loss() -> None:
    tally = DropTally(3, TICK, now=0.0)
    assert tally.on_reading(3, 0.0) == 0
    assert tally.on_reading(3, 0.1) == 0


def test_readings_are_due_once_a_tick_however_often_it_wakes() -> None:
    tally = DropTally(0, TICK, now=0.0)
    assert tally.due(0.0)
    tally.on_reading(0, 0.0)
    tally.on_logged()
    assert not tally.due(0.05)
    assert tally.due(0.1)


def test_the_counter_is_read_only_when_the_log_says_there_may_be_something_to_find() -> None:
    """No drop goes unlogged before the log's burst went through: a quiet sandbox costs
    no reading; logged drops or a socket overflow make one due."""
    tally = DropTally(0, TICK, now=0.0)
    assert tally.due(0.0)  # once at start
    assert tally.on_reading(0, 0.0) == 0
    assert not tally.due(5.0)
    tally.on_logged()
    assert not tally.due(0.05) and tally.due(5.0)
    assert tally.on_reading(400, 5.0) == 0  # 399 beyond the log, in flight or not
    assert not tally.due(5.05) and tally.due(5.2)  # the pending one is judged a tick later
    assert tally.on_reading(400, 5.2) == 399
    assert not tally.due(9.0)
    tally.wake()
    assert tally.due(9.0)
