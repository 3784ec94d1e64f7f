"""`egressd observer`: the observer layer for every sandbox egressd serves.

A separate process from egressd, so either layer can die and the other still freezes
(DESIGN.md invariant 4). It follows egressd's run dir and keeps one forked child per
sandbox, each running the same ``Observer`` poll loop `egressctl run` forks: its own NFLOG
group, its own journal connection and Enforcer. A policy swap (the record's policy hash
changes) restarts that sandbox's child with the new policy; a deleted sandbox's child is
stopped; a child that dies is started again.

Created and attached sandboxes alike: each child freezes the cgroup at the paths the
record names (v2, and the v1 freezer twin if any), wherever the runtime that made it put
it. A child logs "watching ID" once its NFLOG group is bound.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from egress.errors import EgressError
from egress.observer.layer import Observer, ObserverConfig
from egress.policy import parse_policy
from egress.store import rundir

SCAN_S = 0.25
RESCAN_S = 5.0
RESTART_BACKOFF_S = 1.0


@dataclass
class Child:
    pid: int
    sha: str
    exited: float | None = None


class Supervisor:
    def __init__(self, run_dir: Path, state_dir: Path) -> None:
        self.run_dir = run_dir
        self.state_dir = state_dir
        self.children: dict[str, Child] = {}
        self.stopping = False

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        print(f"egressd observer: following {self.run_dir}", file=sys.stderr, flush=True)
        # Start-up's objects out of the collector's walks: a forked child's collections
        # would otherwise touch (and so copy) every page of them.
        gc.freeze()
        mtime, scanned, again = None, 0.0, True
        while not self.stopping:
            # The records are read again only when the run dir changed (a record made,
            # replaced on a swap, or removed: each a rename or unlink in it), once more
            # after that (a change within the same coarse timestamp tick as our look
            # leaves the mtime as it was), when a child is to be restarted, or after a
            # while: with hundreds of sandboxes, reading every record four times a
            # second was most of this process's work.
            restart = self._reap()
            now, seen = time.monotonic(), _mtime_ns(self.run_dir)
            changed = seen != mtime
            if changed or again or restart or now - scanned >= RESCAN_S:
                self.scan()
                scanned = now
            again, mtime = changed, seen
            time.sleep(SCAN_S)
        for sid in list(self.children):
            self._end(sid)
        return 0

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def scan(self) -> None:
        wanted = {r.id: r for r in rundir.load_all(self.run_dir)}
        for sid in [s for s in self.children if s not in wanted]:
            self._end(sid)
        for sid, record in wanted.items():
            child = self.children.get(sid)
            if child is not None and child.sha != record.policy_sha256:
                self._end(sid)
                child = None
            if child is None:
                self._start(record)

    def _start(self, record: rundir.Record) -> None:
        pid = os.fork()
        if pid == 0:  # the child never returns from here
            os._exit(_watch(record, self.state_dir, self.run_dir))
        self.children[record.id] = Child(pid, record.policy_sha256)

    def _end(self, sid: str) -> None:
        child = self.children.pop(sid)
        if child.exited is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if os.waitpid(child.pid, os.WNOHANG)[0]:
                return
            time.sleep(0.01)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
        os.waitpid(child.pid, 0)

    def _reap(self) -> bool:
        """Note children that died; forget them after a backoff, so the scan restarts
        them. True when one was forgotten (a scan is due)."""
        now, forgot = time.monotonic(), False
        for sid, child in list(self.children.items()):
            if child.exited is None and os.waitpid(child.pid, os.WNOHANG)[0]:
                child.exited = now
            if child.exited is not None and now - child.exited >= RESTART_BACKOFF_S:
                del self.children[sid]
                forgot = True
        return forgot


def _mtime_ns(path: Path) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1


def _watch(record: rundir.Record, state_dir: Path, run_dir: Path) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def current() -> bool:
        now = rundir.load(run_dir, record.id)
        return now is not None and now.policy_sha256 == record.policy_sha256

    try:
        policy, _ = parse_policy(record.policy, f"<sandbox {record.id}>")
        cfg = ObserverConfig(
            record.id, record.netns, policy, str(state_dir), None, record.cgroup,
            record.freezer, current, cgroup_found=record.cgroup_found,
        )  # fmt: skip
        observer = Observer(cfg)
        with contextlib.suppress(EgressError):  # `egressctl ps` shows both layers' pids
            observer.journal.update_sandbox(record.id, observer_pid=os.getpid())
        watching = f"{record.id} ({record.kind}, cgroup {record.cgroup})"
        print(f"egressd observer: watching {watching}", file=sys.stderr, flush=True)
        observer.start()
    except EgressError as exc:
        print(f"egressd observer: {record.id}: {exc}", file=sys.stderr, flush=True)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0
