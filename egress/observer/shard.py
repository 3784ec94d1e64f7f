"""One shard of `egressd observer`: the observers of its share of egressd's sandboxes,
in one poll loop of one process.

Each sandbox still has an ``Observer`` of its own (its NFLOG group, its policy, its
Enforcer); what the sandboxes of a shard share is the process, the loop and one journal
connection. A process per sandbox, as before, cost 13.7 MB (PSS) and ten wake-ups a
second each: 2.7 GB and 1.3 CPUs at 200 sandboxes. The supervisor runs a shard per CPU
and restarts one that dies; a sandbox belongs to shard ``crc32(id) % shards``.

A shard follows egressd's run dir like the supervisor did: a record new or with another
policy (a live swap) starts that sandbox's observer (again), a record gone stops it, and
one that fails (the netns went away under it, a policy that no longer parses) is tried
again after a backoff. An exception in one observer's work ends that observer only: it
is logged and the observer started again, the others go on.

What the sandboxes of a shard do share is its time: each readable socket gets at most
``layer.DRAIN_MAX`` copies per turn, but a sandbox producing violations fast (in audit
mode, or with actions that do not freeze) costs a journal commit each, and the others in
its shard wait meanwhile, as they do in egressd's inline layer.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from egress.collect import Collector, Timers
from egress.errors import EgressError
from egress.observer.layer import TICK_S, Observer, ObserverConfig
from egress.policy import parse_policy
from egress.store import rundir
from egress.store.journal import Journal

SCAN_S = 0.25
RESCAN_S = 5.0
RESTART_BACKOFF_S = 1.0


def shard_of(sandbox_id: str, shards: int) -> int:
    return zlib.crc32(sandbox_id.encode()) % shards


@dataclass
class Watched:
    observer: Observer
    sha: str


class Shard:
    def __init__(self, run_dir: Path, state_dir: Path, index: int, shards: int) -> None:
        self.run_dir = run_dir
        self.state_dir = state_dir
        self.index = index
        self.shards = shards
        self.journal = Journal.open(state_dir)
        # Only this shard's records are read: the other shards' files are theirs.
        self.records = rundir.Records(run_dir, lambda sid: shard_of(sid, shards) == index)
        self.watched: dict[str, Watched] = {}
        self.owner: dict[int, str] = {}  # fd -> sandbox id
        self.retry: dict[str, float] = {}  # sandbox id -> when to try it again
        self.unnoted: set[str] = set()  # watched, its observer_pid not yet journaled
        # epoll, not poll: at 5 queries a second each, a shard of 500 sandboxes wakes a
        # few thousand times a second for a copy or two, and poll() walks every one of
        # its 1,000+ descriptors (and Python builds its list) at each wake-up.
        self.poll = select.epoll()
        self.stopping = False
        # What ``look`` knows between looks: the run dir's mtime at the last one, when
        # that was, whether to look once more, when the records were last all looked at
        # and the refused observer_pids last tried again.
        self._mtime: int | None = None
        self._looked = 0.0
        self._again = True
        self._scanned = self._noted_at = time.monotonic()
        # Garbage collected on egressd's schedule (egress/collect.py): no automatic full
        # collection, one once its sandboxes settle; what the supervisor froze before
        # the fork left alone.
        self.timers = Timers()
        self.collector = Collector(self.timers, freeze=False)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)  # SIGTERM wakes poll() at once
        self.poll.register(wake_r, select.EPOLLIN)
        ticked = 0.0
        self.collector.start()
        while not self.stopping:
            for fd, _ in self.poll.poll(self.timers.wait(TICK_S)):
                if fd == wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 64)
                    continue
                self._ready(fd)
            now = time.monotonic()
            if now - ticked >= TICK_S:
                ticked = now
                for sid, watched in list(self.watched.items()):
                    self._guard(sid, watched, watched.observer.tick)
            self.look(now)
            if not self.stopping:  # a full collection must not hold up the way out
                self.timers.run()
        for sid in list(self.watched):
            self._end(sid)
        self.collector.close()
        self.journal.close()
        self.poll.close()
        signal.set_wakeup_fd(-1)
        os.close(wake_r)
        os.close(wake_w)
        return 0

    def _ready(self, fd: int) -> None:
        sid = self.owner.get(fd)
        watched = self.watched.get(sid) if sid is not None else None
        if sid is None or watched is None:
            return
        if fd == watched.observer.inline_fd:
            self._forget_fd(fd)  # a pidfd reports its process's end once
        observer = watched.observer
        self._guard(sid, watched, lambda: observer.on_ready(fd))

    def look(self, now: float) -> None:
        """Every SCAN_S: the records are looked at again when the run dir changed (a
        record made, replaced on a swap or removed: each a rename or unlink in it), once
        more after that (a change in the same coarse timestamp tick as our look leaves
        the mtime as it was), when a sandbox is due a retry, when a record read anew
        differs from the copy kept, and every RESCAN_S (an observer that stopped with
        its record unchanged starts again). Each look reads anew the share of the
        records that the time since the last one is of RESCAN_S (Records.refresh), a
        slice at a time: all at once every RESCAN_S, that held this loop 35-106 ms at
        1,000 sandboxes under load, and this layer's freezes waited up to 110 ms."""
        if now - self._looked >= SCAN_S:
            seen = _mtime_ns(self.run_dir)
            changed = seen != self._mtime
            due = any(at <= now for at in self.retry.values())
            stale = self.records.refresh(min(1.0, (now - self._looked) / RESCAN_S))
            if changed or self._again or due or stale or now - self._scanned >= RESCAN_S:
                self.scan()
                self._scanned = now
            self._looked, self._again, self._mtime = now, changed, seen
        if now - self._noted_at >= RESCAN_S:
            self._noted_at = now
            self._note_again()

    def scan(self) -> None:
        """Start and end observers as the records say (this shard's own: ``records``
        reads no other)."""
        wanted = {r.id: r for r in self.records.load_all()}
        for sid in [s for s in self.watched if s not in wanted]:
            self._end(sid)
        for sid in [s for s in self.retry if s not in wanted]:
            del self.retry[sid]
        now = time.monotonic()
        started = False
        for sid, record in wanted.items():
            watched = self.watched.get(sid)
            if watched is not None and watched.sha != record.policy_sha256:
                self._end(sid)  # swapped: the new policy's observer takes over
                watched = None
            if watched is None and self.retry.get(sid, 0.0) <= now:
                self._start(record)
                started = started or sid in self.watched
        if started:
            self.collector.made()  # what the new observers hold, out of the walks

    def _note_again(self) -> None:
        """The observer_pids the journal refused, tried again (every RESCAN_S)."""
        for sid in list(self.unnoted):
            if sid in self.watched:
                self._note_pid(sid)
            else:
                self.unnoted.discard(sid)

    def _note_pid(self, sid: str) -> None:
        """Journal this process as the sandbox's observer (`egressctl ps` shows both
        layers' pids); where the journal refuses it (its lock held past the busy timeout
        while egressd creates hundreds), said once and tried again every RESCAN_S
        (each try may wait the busy timeout on this loop)."""
        try:
            self.journal.update_sandbox(sid, observer_pid=os.getpid())
        except EgressError as exc:
            if sid not in self.unnoted:
                print(f"egressd observer: {sid}: {exc}; tried again", file=sys.stderr,
                      flush=True)  # fmt: skip
            self.unnoted.add(sid)
            return
        self.unnoted.discard(sid)

    def _start(self, record: rundir.Record) -> None:
        self.retry.pop(record.id, None)
        run_dir, sha = self.run_dir, record.policy_sha256

        def current() -> bool:
            now = rundir.load(run_dir, record.id)
            return now is not None and now.policy_sha256 == sha

        try:
            policy, _ = parse_policy(record.policy, f"<sandbox {record.id}>")
            cfg = ObserverConfig(
                record.id, record.netns, policy, str(self.state_dir), None, record.cgroup,
                record.freezer, current, cgroup_found=record.cgroup_found,
            )  # fmt: skip
            observer = Observer(cfg, journal=self.journal)
        except EgressError as exc:
            self._failed(record.id, str(exc))
            return
        except Exception:
            self._failed(record.id, traceback.format_exc())
            return
        self.watched[record.id] = Watched(observer, sha)
        self._note_pid(record.id)
        for fd in observer.fds():
            self.owner[fd] = record.id
            try:
                self.poll.register(fd, select.EPOLLIN)
            except FileExistsError:  # a number an ended observer's file left registered
                self.poll.modify(fd, select.EPOLLIN)
        watching = f"{record.id} ({record.kind}, cgroup {record.cgroup})"
        print(f"egressd observer: watching {watching}", file=sys.stderr, flush=True)

    def _guard(self, sid: str, watched: Watched, work: Callable[[], None]) -> None:
        """One observer's work; what it raises ends that observer (retried later)."""
        try:
            work()
        except Exception:
            self._end(sid)
            self._failed(sid, traceback.format_exc())
            return
        if watched.observer.stopping:  # its sandbox is gone, or it was superseded
            self._end(sid)  # the next scan starts it again if its record says so

    def _failed(self, sid: str, why: str) -> None:
        print(f"egressd observer: {sid}: {why.strip()}", file=sys.stderr, flush=True)
        self.retry[sid] = time.monotonic() + RESTART_BACKOFF_S

    def _end(self, sid: str) -> None:
        watched = self.watched.pop(sid, None)
        if watched is None:
            return
        self.collector.changed()  # its cycles go at the full collection, once settled
        for fd in watched.observer.fds():  # a pidfd already forgotten is no matter
            self._forget_fd(fd)
        try:
            watched.observer.finish()
        except Exception:
            traceback.print_exc()

    def _forget_fd(self, fd: int) -> None:
        self.owner.pop(fd, None)
        with contextlib.suppress(OSError, ValueError):  # not registered, or closed
            self.poll.unregister(fd)


def _mtime_ns(path: Path) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1
