"""egressd's garbage collection policy (daemon/collect.py) on a real event loop and the
interpreter's real collector: what it freezes the automatic collections leave alone, and
the full collection it schedules (once the sandboxes settle, at the latest MAX_DELAY_S
after the last) takes every cycle, frozen or not."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Iterator

import pytest

from egress.daemon.collect import Collector


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # the rest of the suite's garbage is collected as usual
    gc.collect()


def cycle() -> weakref.ref[Node]:
    return weakref.ref(Node())


async def until(cond: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not within 5 s"
        await asyncio.sleep(0.005)


def test_a_frozen_cycle_outlives_collections_until_the_full_one() -> None:
    async def main() -> None:
        collector = Collector(asyncio.get_running_loop(), settle_s=30, max_delay_s=60)
        try:
            ref = cycle()
            collector.made()  # a sandbox made: what lives, this cycle too, frozen
            assert gc.get_freeze_count() > 0
            gc.collect()  # what automatic collections do, at most
            assert ref() is not None
            collector.collect()
            assert ref() is None and collector.collections == 1
            assert gc.get_freeze_count() > 0  # what lives after it is frozen again
        finally:
            collector.close()

    asyncio.run(main())


def test_the_full_collection_waits_for_the_sandboxes_to_settle() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        collector = Collector(loop, settle_s=0.2, max_delay_s=60)
        try:
            ref = cycle()
            collector.made()
            started = loop.time()
            for _ in range(3):  # changes keep coming: the collection keeps waiting
                await asyncio.sleep(0.1)
                assert collector.collections == 0 and ref() is not None
                collector.changed()
            await until(lambda: collector.collections == 1)
            assert loop.time() - started >= 0.49  # 0.3 of changes, then settled for 0.2
            assert ref() is None
        finally:
            collector.close()

    asyncio.run(main())


def test_churn_that_never_settles_is_collected_after_max_delay() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        collector = Collector(loop, settle_s=0.2, max_delay_s=0.5)
        try:
            collector.start()  # frozen now and every second; full collection due at 0.5
            started = loop.time()
            ref = cycle()
            collector.made()  # frozen: only the full collection frees it
            while collector.collections == 0:
                assert loop.time() - started < 5, "no full collection within 5 s"
                collector.changed()  # a change every 0.05 s: never settled for 0.2
                await asyncio.sleep(0.05)
            assert 0.49 <= loop.time() - started < 3.0  # due at 0.5; late on a busy machine
            assert ref() is None
        finally:
            collector.close()

    asyncio.run(main())
