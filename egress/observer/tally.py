"""Drops the kernel counted that the observer's rate-limited log never carried.

The drop rule counts every packet (``counter name dropped``) and then logs it, rate
limited. A packet counted but never logged is evidence the log lost: a flood past the
limit. But a packet that was just counted has its log message still on the way, so a
reading is judged only a whole tick later: whatever that old reading counted and the log
has still not carried by now was not logged. Comparing two readings instead ("one
unlogged, and again one unlogged") mistakes a steady stream of drops, each with its
message in flight, for a lost one. Pure: fed readings and log arrivals, with ``now``.

The counter is read only when there can be something to find: the log's limit lets its
burst through first, so no drop goes unlogged unless the log carried (or the socket
overflowed with) others just before it. A sandbox that drops nothing costs no reading;
egressd's observer layer watches hundreds of them.
"""

from __future__ import annotations


class DropTally:
    def __init__(self, counted_before: int, tick_s: float, now: float) -> None:
        # Drops counted before this observer bound its group were judged by whoever was
        # watching then: they are not drops its log missed.
        self.logged = counted_before
        self.tick_s = tick_s
        self.pending: tuple[int, float] | None = None  # (a counter reading, when)
        self.last_read = now - tick_s
        self.active = True  # read once at start: whatever came before is judged there

    def on_logged(self) -> None:
        """The log carried one dropped packet."""
        self.logged += 1
        self.active = True

    def wake(self) -> None:
        """A drop may have been counted that the log will never carry: the socket
        overflowed (the kernel dropped copies, maybe of drops), or a checked flow's
        segment was copied (the ruleset drops one it cannot queue, counted, unlogged)."""
        self.active = True

    def due(self, now: float) -> bool:
        """Is a counter reading due: something to find, and a tick since the last one
        (however often the reader wakes)?"""
        return (self.active or self.pending is not None) and now - self.last_read >= self.tick_s

    def on_reading(self, packets: int, now: float) -> int:
        """A counter reading; returns how many drops the log missed (0: none so far)."""
        self.last_read = now
        self.active = False
        missed = 0
        if self.pending is not None:
            old, at = self.pending
            if now - at >= self.tick_s and old > self.logged:
                missed = old - self.logged
                self.logged = old  # reported once; later messages add to it as usual
            if now - at < self.tick_s:
                return 0  # keep the older reading until it is a tick old
        self.pending = (packets, now) if packets > self.logged else None
        return missed
