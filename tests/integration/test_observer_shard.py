"""One shard of `egressd observer` (observer.shard): one sandbox's failing observer ends
alone and is tried again later; the others in the same loop go on. Observers are stand-ins
here (no netns needed); the shard, its journal and its poll loop's bookkeeping are real."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from egress.observer.layer import TICK_S
from egress.observer.shard import RESCAN_S, SCAN_S, Shard, Watched, shard_of
from egress.store import rundir


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
    started: list[str] = []
    run = tmp_path / "run"
    run.mkdir()
    ids = [f"s{i:04x}" for i in range(40)]
    for sid in ids:  # every shard's records, in one run dir
        rundir.save(run, rundir.Record(id=sid, kind="created", netns=f"egress-{sid}",
                                       cgroup="", policy="x"))  # fmt: skip
    sh = Shard(run, tmp_path / "state", 1, 3)
    monkeypatch.setattr(sh, "_start", lambda r: (started.append(r.id), sh._failed(r.id, "no")))
    try:
        sh.scan()
        mine = [sid for sid in ids if shard_of(sid, 3) == 1]
        assert started == mine and 0 < len(mine) < 40
        sh.scan()  # within the backoff: not tried again
        assert started == mine
        for sid in sh.retry:
            sh.retry[sid] = 0.0
        sh.scan()
        assert started == mine * 2
    finally:
        sh.journal.close()


def shard_over(run: Path, ids: list[str], monkeypatch: Any) -> tuple[Shard, list[tuple[str, str]]]:
    """A shard of one over records of ``ids`` in ``run``, whose observers are stand-ins:
    the (id, policy hash) of each start, in order."""
    run.mkdir()
    for sid in ids:
        rundir.save(run, rundir.Record(id=sid, kind="created", netns=f"egress-{sid}",
                                       cgroup="", policy="spec: {}\n"))  # fmt: skip
    sh = Shard(run, run.parent / "state", 0, 1)
    started: list[tuple[str, str]] = []

    def start(record: rundir.Record) -> None:
        started.append((record.id, record.policy_sha256))
        sh.watched[record.id] = Watched(StandIn(), record.policy_sha256)

    monkeypatch.setattr(sh, "_start", start)
    return sh, started


def test_a_swap_no_look_at_the_run_dir_can_see_restarts_its_observer_within_a_rescan(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A record replaced in place by one whose file keeps its inode, size and time (and
    the run dir its mtime): no look sees a change, but the share of records each look
    reads anew finds it within RESCAN_S, and its observer starts again under the new
    policy."""
    run = tmp_path / "run"
    sh, started = shard_over(run, [f"s{i:04x}" for i in range(40)], monkeypatch)
    try:
        now = 1000.0
        sh.look(now)
        assert len(started) == 40
        path = run / "s0007.json"
        old = rundir.load(run, "s0007")
        assert old is not None
        new = rundir.Record(**{**old.__dict__, "policy": "spec: []\n"})
        st, dir_st = os.stat(path), os.stat(run)
        path.write_text(path.read_text().replace(old.policy_sha256, new.policy_sha256)
                        .replace('"spec: {}\\n"', '"spec: []\\n"'))  # fmt: skip
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert (os.stat(path).st_ino, os.stat(path).st_size) == (st.st_ino, st.st_size)
        assert os.stat(run).st_mtime_ns == dir_st.st_mtime_ns
        started.clear()
        looks = 0
        while not started and looks < RESCAN_S / SCAN_S:
            looks += 1
            sh.look(now + looks * SCAN_S)
        assert started == [("s0007", new.policy_sha256)], looks
    finally:
        for sid in list(sh.watched):
            sh._end(sid)
        sh.journal.close()


def test_an_observer_that_stopped_with_its_record_unchanged_starts_again_within_a_rescan(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """An observer can stop with nothing in the run dir changed and no retry set (its
    netns looked gone once): a scan every RESCAN_S starts it again."""
    sh, started = shard_over(tmp_path / "run", ["s0", "s1", "s2"], monkeypatch)
    try:
        now = 1000.0
        sh.look(now)
        sh.look(now + SCAN_S)  # the look once more after a change
        assert [sid for sid, _ in started] == ["s0", "s1", "s2"]
        sh._end("s1")  # as _guard ends an observer that says it is stopping
        looks = 1
        while len(started) == 3 and looks * SCAN_S <= RESCAN_S:
            looks += 1
            sh.look(now + looks * SCAN_S)
        assert [sid for sid, _ in started[3:]] == ["s1"] and looks * SCAN_S >= RESCAN_S, looks
    finally:
        for sid in list(sh.watched):
            sh._end(sid)
        sh.journal.close()


class Collections:
    """What a shard tells its Collector."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def made(self) -> None:
        self.calls.append("made")

    def changed(self) -> None:
        self.calls.append("changed")


def test_a_shard_freezes_its_new_observers_objects_and_collects_once_they_settle(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Its observers' objects out of the automatic collections' walks as they start (those
    walks held a shard 52-221 ms at 1,000 sandboxes), and an ended one's due for the full
    collection once the shard's sandboxes settle (egress/collect.py)."""
    sh, started = shard_over(tmp_path / "run", ["s0", "s1"], monkeypatch)
    told = Collections()
    monkeypatch.setattr(sh, "collector", told)
    try:
        sh.look(1000.0)
        assert len(started) == 2 and told.calls == ["made"]  # once for the scan's starts
        sh.look(1000.0 + SCAN_S)  # the look once more: nothing new
        assert told.calls == ["made"]
        sh._end("s1")
        assert told.calls == ["made", "changed"]
    finally:
        for sid in list(sh.watched):
            sh._end(sid)
        sh.journal.close()


class Polls:
    """A shard's epoll, stood in for: no descriptor is ever ready; it ends the loop after
    ``turns`` waits and keeps how long each was."""

    def __init__(self, sh: Shard, turns: int) -> None:
        self.sh, self.turns, self.waits = sh, turns, []

    def register(self, *_: object) -> None:
        pass

    def unregister(self, *_: object) -> None:
        pass

    def close(self) -> None:
        pass

    def poll(self, timeout: float) -> list[tuple[int, int]]:
        self.waits.append(timeout)
        self.sh.stopping = len(self.waits) >= self.turns
        return []


def test_a_shards_loop_runs_its_collectors_timers_and_waits_no_longer_than_they_allow(
    tmp_path: Path,
) -> None:
    """The collector started with the loop (no automatic full collection while it runs,
    the thresholds back at its end), a due timer run, and the poll's wait cut short
    for it."""
    sh = Shard(tmp_path / "run", tmp_path / "state", 0, 1)
    sh.poll.close()
    polls = sh.poll = Polls(sh, 3)  # type: ignore[assignment]
    ran: list[str] = []
    sh.timers.call_at(sh.timers.time() - 1, lambda: ran.append("due"))
    thresholds = gc.get_threshold()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    seen: list[tuple[int, int, int]] = []
    sh.timers.call_at(sh.timers.time() - 1, lambda: seen.append(gc.get_threshold()))
    try:
        assert sh.run() == 0
        after = gc.get_threshold()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        gc.set_threshold(*thresholds)
    assert ran == ["due"] and seen[0][2] > thresholds[2] and after == thresholds
    assert polls.waits[0] == 0.0 and all(0 < w <= TICK_S for w in polls.waits[1:])


# A supervisor whose one shard, forked, says how many suffix lists its process had
# loaded before it did anything, then asks the supervisor to stop.
FORKED = """
import os, signal, sys
from pathlib import Path
from egress.observer import supervisor
from egress.tunnel import labels
def shard(run_dir, state_dir, index, shards):
    try:
        Path(sys.argv[1]).write_text(str(labels._psl.cache_info().currsize))
    finally:  # whatever happened, the supervisor stops: no shard started again
        os.kill(os.getppid(), signal.SIGTERM)
    return 0
supervisor._shard = shard
assert labels._psl.cache_info().currsize == 0
sys.exit(supervisor.Supervisor(Path(sys.argv[2]), Path(sys.argv[3]), 1).run())
"""


def test_a_shard_is_forked_with_the_suffix_list_its_scorers_need_loaded(tmp_path: Path) -> None:
    """Loaded once in the supervisor, its pages are shared by every shard, and no shard's
    start (or restart) loads its own."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    out = tmp_path / "loaded"
    done = subprocess.run([sys.executable, "-c", FORKED, str(out), str(tmp_path / "run"),
                           str(tmp_path / "state")], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert out.read_text() == "1"
