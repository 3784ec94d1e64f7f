"""Start the observer layer as its own process, forked from `egressctl run`.

Forking (rather than exec'ing a new interpreter) starts it in milliseconds with the
policy already parsed. It is forked first thing, before `run` opens the journal: an
SQLite connection must never cross a fork (the library's lock bookkeeping would be shared
with a copy that holds none of the locks). The child waits on a pipe for the sandbox to
exist, opens its own journal, NFLOG socket and counter socket, says "ready", and from then on
lives in its own session with its own log, so Ctrl-C and a dying inline layer don't take
it along. If `run` dies, the sandbox's end is the observer's: once nothing runs in it
any more (after `egressctl kill`), it removes it as `run` would have (``_remover``).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from egress.errors import SandboxError
from egress.model import Policy
from egress.observer.layer import Observer, ObserverConfig
from egress.sandbox.lifecycle import teardown_claim
from egress.store import claims

READY_S = 10.0


class ObserverProcess:
    def __init__(self, pid: int, command_w: int, ready_r: int) -> None:
        self.pid = pid
        self._command_w = command_w
        self._ready_r = ready_r
        self._reaped = False

    @classmethod
    def fork(cls, policy: Policy, state_dir: Path) -> ObserverProcess:
        command_r, command_w = os.pipe()
        ready_r, ready_w = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child never returns from here
            os.close(command_w)
            os.close(ready_r)
            _child(policy, state_dir, parent, command_r, ready_w)
        os.close(command_r)
        os.close(ready_w)
        return cls(pid, command_w, ready_r)

    def begin(self, sandbox_id: str, netns: str) -> None:
        """Tell it which sandbox to watch; return once its NFLOG group is bound."""
        os.write(self._command_w, f"{sandbox_id} {netns}\n".encode())
        os.close(self._command_w)
        self._command_w = -1
        got, _, _ = select.select([self._ready_r], [], [], READY_S)
        line = os.read(self._ready_r, 256).decode(errors="replace").strip() if got else ""
        if line != "ready":
            self.stop(timeout=0)
            raise SandboxError(f"the observer layer did not start ({line or 'no answer'})")

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, wait; SIGKILL after ``timeout``. Also ends a child never begun."""
        for fd in (self._command_w, self._ready_r):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._command_w = self._ready_r = -1
        if self._reaped:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.waitpid(self.pid, os.WNOHANG)[0]:
                self._reaped = True
                return
            time.sleep(0.002)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        self._reaped = True


def _child(policy: Policy, state_dir: Path, parent: int, command_r: int, ready_w: int) -> NoReturn:
    code = 1
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)  # the workload's stdin is not the observer's
        command = _read_all(command_r)
        if not command:
            os._exit(0)  # `run` failed before the sandbox existed: nothing to watch
        sandbox_id, netns = command.split()
        _log_to(state_dir / f"observer-{sandbox_id}.log")
        cfg = ObserverConfig(sandbox_id, netns, policy, str(state_dir), parent,
                             teardown=_remover(sandbox_id))  # fmt: skip
        observer = Observer(cfg)
        os.write(ready_w, b"ready\n")
        os.close(ready_w)
        observer.start()
        code = 0
    except BaseException as exc:  # the child must end here, whatever happened
        with contextlib.suppress(OSError):
            os.write(ready_w, f"{type(exc).__name__}: {exc}\n".encode())
        print(f"egress observer: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    finally:
        os._exit(code)


def _remover(sandbox_id: str) -> Callable[[], list[str]]:
    """The teardown `run` does at its end, from the sandbox's address claim."""

    def remove() -> list[str]:
        for claim in claims.load_all():
            if claim.id == sandbox_id:
                return teardown_claim(claim)
        return []  # removed already (`egressctl gc`)

    return remove


def _read_all(fd: int) -> str:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode().strip()


def _log_to(path: Path) -> None:
    """It outlives the terminal it was started from: it writes to its own log."""
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
