"""`egressd observer`: the observer layer for every sandbox egressd serves.

A separate process from egressd, so either layer can die and the other still freezes
(DESIGN.md invariant 4). It keeps one forked shard per CPU (``shard.Shard``), each
following egressd's run dir and running, in one poll loop, an ``Observer`` for each of
its share of the sandboxes: the same judge, its own NFLOG group per sandbox, its own
Enforcer. A shard that dies is started again after a backoff; its sandboxes go
unwatched by this layer meanwhile (egressd's inline layer still judges them).

Created and attached sandboxes alike: each observer freezes the cgroup at the paths the
record names (v2, and the v1 freezer twin if any), wherever the runtime that made it put
it. A shard logs "watching ID" once it has bound the sandbox's observer NFLOG group.
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

from egress.kernel import nft
from egress.observer.shard import RESTART_BACKOFF_S, Shard
from egress.tunnel import labels

WAIT_S = 0.25


@dataclass
class Child:
    pid: int
    exited: float | None = None


class Supervisor:
    def __init__(self, run_dir: Path, state_dir: Path, shards: int | None = None) -> None:
        self.run_dir = run_dir
        self.state_dir = state_dir
        self.shards = shards or len(os.sched_getaffinity(0)) or 1
        self.children: dict[int, Child] = {}  # shard index -> its process
        self.stopping = False

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        print(f"egressd observer: following {self.run_dir} ({self.shards} shards)",
              file=sys.stderr, flush=True)  # fmt: skip
        # The suffix list every shard's scorers split names with, loaded once here: each
        # shard loaded its own before (2.5 MB and ~50 ms at each start, restarts too).
        labels.load()
        # Start-up's objects out of the collector's walks: a forked shard's collections
        # would otherwise touch (and so copy) every page of them.
        gc.freeze()
        while not self.stopping:
            self._reap()
            for index in range(self.shards):
                if index not in self.children:
                    self._start(index)
            time.sleep(WAIT_S)
        for index in list(self.children):
            self._end(index)
        return 0

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def _start(self, index: int) -> None:
        pid = os.fork()
        if pid == 0:  # the child never returns from here
            os._exit(_shard(self.run_dir, self.state_dir, index, self.shards))
        self.children[index] = Child(pid)

    def _end(self, index: int) -> None:
        child = self.children.pop(index)
        if child.exited is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if os.waitpid(child.pid, os.WNOHANG)[0]:
                return
            time.sleep(0.01)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
        os.waitpid(child.pid, 0)

    def _reap(self) -> None:
        """Note shards that died; forget them after a backoff, so they are started again."""
        now = time.monotonic()
        for index, child in list(self.children.items()):
            if child.exited is None and os.waitpid(child.pid, os.WNOHANG)[0]:
                child.exited = now
                print(f"egressd observer: shard {index} (pid {child.pid}) died",
                      file=sys.stderr, flush=True)  # fmt: skip
            if child.exited is not None and now - child.exited >= RESTART_BACKOFF_S:
                del self.children[index]


def _shard(run_dir: Path, state_dir: Path, index: int, shards: int) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # An nft handle opened here goes through a worker process of its own
    # (kernel/nft_worker.py, started at the first), as egressd's do: an in-process
    # libnftables context keeps a cache of the ruleset after a read (1.6 MB each), which
    # made the layer's PSS 1,978 MB at 1,000 sandboxes; and a shard holds well over the
    # 1,024 descriptors past which libnftables' select() aborts a process on a batch
    # command. Its observers open none: they ask the kernel through nft_figures' sockets.
    worker = nft.use_worker()
    try:
        return Shard(run_dir, state_dir, index, shards).run()
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        worker.close()
