"""Cyclic garbage collection kept off the path of what a process serves: egressd's DNS
answers, and an observer shard's judging and freezing.

At 1,000 sandboxes egressd holds ~300,000 objects the collector tracks, nearly all of them
living as long as their sandbox. Python's automatic full (generation 2) collection walks
every one: 110-260 ms on this 2-vCPU machine, every few seconds under load, and no
sandbox's DNS is answered meanwhile (bench_egressd at 5,000 qps: cache hits p99 154-208
ms, one full collection each). So egressd collects on purpose instead:

- what lives is frozen (``gc.freeze``: moved to the permanent generation, which no
  automatic collection walks; O(1)) when a sandbox is made (created, attached, adopted)
  and every FREEZE_S: the automatic collections then walk only what was made since,
  queries' short-lived objects mostly (the cache entries of a second's misses stay
  alive for their TTL: unfrozen, 90,000 of them made a full collection 25-70 ms);
- a full collection with everything unfrozen, then frozen again, once the sandboxes
  have stayed unchanged for SETTLE_S after a change (a delete leaves its sandbox's
  cycles behind, frozen or not), and at the latest MAX_DELAY_S after the last one.
  That is the one pause: once churn settles, and every ten minutes.

Objects freed by their reference count go at once, frozen or not; garbage cycles made
meanwhile (pyroute2's messages, mostly) wait for the next full collection.

The automatic collections that remain are kept short, as long as the collector runs:
- no automatic full collection (the third threshold): it would walk everything made
  since the last freeze, or, in a shard, since the fork;
- the middle generation is collected after every two young collections (GEN1_EVERY),
  not every ten: each walks two young collections' survivors, not ten. Each object is
  still walked about as often. At 1,000 sandboxes under bench_egressd's load, egressd's
  middle-generation pauses went from 2.8-3.5 ms to at most 1.4-1.7 ms (most under 0.9),
  and in `egressctl run`'s miss run, 2 of them took over 0.5 ms (0.6, 1.8 ms) where ~10
  did (up to 2.0 ms), beside a 5.8 ms automatic full collection.
The incremental collector of Python 3.14.0-3.14.4 reads the thresholds otherwise (the
second sets how fast the old generation is scanned, the third is not kept): there they
are left as they were. It is told by that third threshold, not by the version.

`egressctl run` and `egressd sidecar`, one sandbox each, collect the same way: their one
full collection (start-up's ~30,000 objects and the cache) took 10-22 ms, every ten
minutes. What serves a query makes no garbage cycle (measured: none over 3,000 misses);
a TCP client's connection leaves a few objects in one, which wait for it.

Each observer shard of `egressd observer` collects on the same schedule (``freeze=False``).
At 1,000 sandboxes on 2 CPUs a shard holds ~500 sandboxes' observers, ~210,000 objects:
its automatic full collections took 52-221 ms each, during which none of its sandboxes
was judged or frozen (the observer decided a freeze at p99 up to 513 ms under
bench_egressd's load; section of issue 17's note). A shard is forked from the supervisor,
which froze its own objects first so that no collection in the shard touches, and so
copies, their pages; unfreezing would undo that. So a shard leaves the frozen alone:
its automatic full collections are switched off (the third threshold) and its full
collection is a plain ``gc.collect()``, which never walks the permanent generation. It
runs no asyncio loop: its timers are ``Timers``, which its poll loop runs.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import time
import traceback
from collections.abc import Callable
from typing import Protocol

FREEZE_S = 1.0
SETTLE_S = 60.0
MAX_DELAY_S = 600.0
_NEVER = 1 << 30  # a third threshold no count of second-generation passes reaches
GEN1_EVERY = 1  # young collections between two of the middle generation, less one


def _incremental() -> bool:
    """The collector keeps no third threshold: the incremental one (see the module doc)."""
    before = gc.get_threshold()
    gc.set_threshold(before[0], before[1], 12345)
    kept = gc.get_threshold()[2] == 12345
    gc.set_threshold(*before)
    return not kept


_INCREMENTAL = _incremental()


class Handle(Protocol):
    def when(self) -> float: ...

    def cancel(self) -> None: ...


class Clock(Protocol):
    """What Collector needs of a loop: asyncio's, or ``Timers``."""

    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], object]) -> Handle: ...

    def call_later(self, delay: float, callback: Callable[[], object]) -> Handle: ...


class Timer:
    def __init__(self, at: float, callback: Callable[[], object]) -> None:
        self.at, self.callback, self.cancelled = at, callback, False

    def when(self) -> float:
        return self.at

    def cancel(self) -> None:
        self.cancelled = True


class Timers:
    """Timers for a loop that is no asyncio loop: it asks ``wait`` how long it may
    sleep and calls ``run`` after each wake-up (monotonic time)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        self._order = itertools.count()

    def time(self) -> float:
        return time.monotonic()

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        timer = Timer(when, callback)
        heapq.heappush(self._heap, (when, next(self._order), timer))
        return timer

    def call_later(self, delay: float, callback: Callable[[], object]) -> Timer:
        return self.call_at(self.time() + delay, callback)

    def wait(self, longest: float) -> float:
        """Seconds until the next timer is due, at most ``longest``."""
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)
        if not self._heap:
            return longest
        return max(0.0, min(longest, self._heap[0][0] - self.time()))

    def run(self) -> None:
        """Call what is due, in order (a timer a callback sets for now waits for the next
        call). One that raises is said on stderr; the others still run, as asyncio does."""
        now = self.time()
        due = []
        while self._heap and self._heap[0][0] <= now:
            due.append(heapq.heappop(self._heap)[2])
        for timer in due:
            if timer.cancelled:
                continue
            try:
                timer.callback()
            except Exception:
                traceback.print_exc()


class Collector:
    def __init__(
        self,
        loop: Clock,
        settle_s: float = SETTLE_S,
        max_delay_s: float = MAX_DELAY_S,
        freeze: bool = True,
    ) -> None:
        self.loop = loop
        self.freeze = freeze  # False: a forked shard's way (see the module doc)
        self._thresholds: tuple[int, int, int] | None = None  # as they were before start
        self.settle_s = settle_s
        self.max_delay_s = max_delay_s
        self._timer: Handle | None = None  # the next full collection
        self._freezer: Handle | None = None
        self.collections = 0
        self.last_ms = 0.0  # how long the last full collection held the loop
        self._last = loop.time()  # the last full collection (or the start)

    def start(self) -> None:
        """From now on: short automatic collections only (the module doc), and with
        ``freeze``, what lives frozen every FREEZE_S; a full collection is due
        MAX_DELAY_S on, or sooner where sandboxes made before (adopted ones) had it
        due sooner."""
        if self._thresholds is None:
            self._thresholds = gc.get_threshold()
            if not _INCREMENTAL:
                gc.set_threshold(self._thresholds[0], GEN1_EVERY, _NEVER)
        if self.freeze:
            self._freeze_tick()
        due = self.loop.time() + self.max_delay_s
        self._schedule(due if self._timer is None else min(self._timer.when(), due))

    def _freeze_tick(self) -> None:
        gc.freeze()
        self._freezer = self.loop.call_later(FREEZE_S, self._freeze_tick)

    def made(self) -> None:
        """A sandbox was made: its objects out of the automatic collections' walks."""
        if self.freeze:
            gc.freeze()
        self.changed()

    def changed(self) -> None:
        """The sandboxes changed: a full collection is due once they settle."""
        self._schedule(min(self.loop.time() + self.settle_s, self._last + self.max_delay_s))

    def _schedule(self, due: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_at(due, self.collect)

    def collect(self) -> None:
        """One full collection of everything, then all that lives frozen again (without
        ``freeze``: of everything but what was frozen before the fork)."""
        start = time.perf_counter()
        if self.freeze:
            gc.unfreeze()
        gc.collect()
        if self.freeze:
            gc.freeze()
        self.last_ms = (time.perf_counter() - start) * 1000
        self.collections += 1
        self._last = self.loop.time()
        self._schedule(self._last + self.max_delay_s)

    def close(self) -> None:
        for timer in (self._timer, self._freezer):
            if timer is not None:
                timer.cancel()
        self._timer = self._freezer = None
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)
            self._thresholds = None
