"""One shard of `egressd observer` (observer.shard): one sandbox's failing observer ends
alone and is tried again later; the others in the same loop go on. Observers are stand-ins
here (no netns needed); the shard, its journal and its poll loop's bookkeeping are real."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from egress.observer.shard import Shard, Watched, shard_of


class StandIn:
    def __init__(self, fail: bool = False) -> None:
        self.r, self.w = os.pipe()
        self.inline_fd: int | None = None
        self.stopping = False
        self.fail = fail
        self.ready: list[int] = []
        self.finished = False

    def fds(self) -> list[int]:
        return [self.r]

    def on_ready(self, fd: int) -> None:
        if self.fail:
            raise RuntimeError("a bug in this sandbox's observer")
        self.ready.append(fd)

    def tick(self) -> None:
        pass

    def finish(self) -> None:
        self.finished = True
        os.close(self.r)
        os.close(self.w)


def watch(sh: Shard, sid: str, observer: Any) -> None:
    sh.watched[sid] = Watched(observer, "sha")
    for fd in observer.fds():
        sh.owner[fd] = sid
        sh.poll.register(fd)


def test_an_observer_that_raises_ends_alone_and_is_retried(tmp_path: Path) -> None:
    sh = Shard(tmp_path / "run", tmp_path / "state", 0, 1)
    try:
        good, bad = StandIn(), StandIn(fail=True)
        watch(sh, "good", good)
        watch(sh, "bad", bad)
        sh._ready(bad.r)
        sh._ready(good.r)
        assert list(sh.watched) == ["good"] and good.ready == [good.r]
        assert bad.finished and bad.r not in sh.owner
        assert sh.retry["bad"] > 0  # started again by a scan after the backoff
        good.stopping = True  # its sandbox went away
        sh._ready(good.r)
        assert sh.watched == {} and good.finished and "good" not in sh.retry
    finally:
        sh.journal.close()


def test_a_scan_starts_only_this_shards_sandboxes_and_backs_off_after_a_failure(
    tmp_path: Path, monkeypatch: Any
) -> None:
    from egress.store import rundir

    started: list[str] = []
    records = [rundir.Record(id=f"s{i:04x}", kind="created", netns=f"egress-s{i}", cgroup="",
                             policy="x") for i in range(40)]  # fmt: skip
    sh = Shard(tmp_path / "run", tmp_path / "state", 1, 3)
    monkeypatch.setattr(sh.records, "load_all", lambda fresh=False: records)
    monkeypatch.setattr(sh, "_start", lambda r: (started.append(r.id), sh._failed(r.id, "no")))
    try:
        sh.scan()
        mine = [r.id for r in records if shard_of(r.id, 3) == 1]
        assert started == mine and 0 < len(mine) < 40
        sh.scan()  # within the backoff: not tried again
        assert started == mine
        for sid in sh.retry:
            sh.retry[sid] = 0.0
        sh.scan()
        assert started == mine * 2
    finally:
        sh.journal.close()
