"""How late egressd's event loop runs what is due: the stalls every sandbox's DNS waits on.

One loop serves every sandbox, so anything that holds it (a long callback, a blocking
call, the GIL held by a worker thread, the CPU taken by others) delays every answer. A
callback due every TICK_S notes how late it ran; ``/metrics`` shows the histogram
(``egress_loop_lag_seconds``) and the worst lag seen. A stall of d seconds is seen with
probability about d / TICK_S, as late as up to d: the histogram's tail is where to look.
Cost: 100 callbacks a second.
"""

from __future__ import annotations

import asyncio

from egress.inline.upstream import Latencies

TICK_S = 0.01
BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class LoopLag:
    def __init__(self, loop: asyncio.AbstractEventLoop, tick_s: float = TICK_S) -> None:
        self.loop = loop
        self.tick_s = tick_s
        self.latencies = Latencies(BUCKETS_S)
        self.worst = 0.0  # seconds, since the start
        self._due = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._due = self.loop.time() + self.tick_s
        self._timer = self.loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        now = self.loop.time()
        late = max(0.0, now - self._due)
        self.latencies.observe(late)
        self.worst = max(self.worst, late)
        self._due = now + self.tick_s
        self._timer = self.loop.call_at(self._due, self._tick)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
