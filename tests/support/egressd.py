"""A real egressd on a temporary socket: the one start-up every test and benchmark uses.

``egressd(state)`` starts one (its socket, run dir and stderr file in a temp dir; its
journal in ``state``, or in the temp dir) and, on the way out, deletes every sandbox it
still serves through the API, stops it, tears down by their claims the sandboxes that an
egressd stopped on purpose left behind, and removes the temp dir, whether the test
passed or not. Every process is stopped by its own PID.

``Egressd.launch(*options)`` starts another egressd on the same socket and run dir
(``--replace``, or one that must fail); ``Egressd.observer()`` its observer layer.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from egress.cli.client import Client
from egress.errors import DaemonError
from egress.sandbox.lifecycle import teardown_claim
from egress.store import claims
from tests.support import ROOT

EGRESSD = [sys.executable, "-m", "egress.daemon.main"]
# From exec to "serving": python's start-up and imports, the API socket, and adopting what
# the run dir holds. Well under 2 s on an idle machine; a busy one takes several times that.
START_S = 60.0
STOP_S = 60.0


class Lines:
    """A child's output pipe read line by line with a deadline (a bare readline would
    block forever on a child that hangs)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""

    def next(self, timeout: float) -> str:
        """The next line, or what was read of it when the pipe closed or time ran out."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                break
            chunk = os.read(self.fd, 4096)
            if not chunk:
                break
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode(errors="replace")


def read_until(proc: subprocess.Popen[bytes], needle: str, timeout: float = START_S) -> str:
    """Read ``proc``'s stderr until ``needle`` shows; AssertionError at the deadline or if
    it exits first. Returns what was read."""
    assert proc.stderr is not None
    fd, seen, deadline = proc.stderr.fileno(), b"", time.monotonic() + timeout
    while needle.encode() not in seen:
        ready = select.select([fd], [], [], max(deadline - time.monotonic(), 0))[0]
        chunk = os.read(fd, 4096) if ready else b""
        assert chunk, f"no {needle!r} within {timeout} s; stderr: {seen.decode()}"
        seen += chunk
    return seen.decode(errors="replace")


class Egressd:
    """One egressd of our own, started and stopped by its PID. ``own_session``: a Ctrl-C
    at the terminal reaches only the caller, which can still clean up through the API."""

    def __init__(self, directory: Path, state: Path | None = None, own_session: bool = False):
        self.dir = directory
        self.socket = str(directory / "egressd.sock")
        self.run_dir = directory / "run"
        self.state = state if state is not None else directory / "state"
        self.stderr_path = directory / "stderr"
        self.own_session = own_session
        self.made: list[str] = []
        self.pids: set[int] = set()  # every egressd started here: their claims are ours
        self.proc: subprocess.Popen[bytes] | None = None
        self.lines: Lines | None = None
        self.retired: list[subprocess.Popen[bytes]] = []  # replaced, exiting by themselves
        self.wrapper: list[str] = []  # runs egressd (e.g. chrt); it must exec, keeping the PID

    def argv(self, *options: str) -> list[str]:
        return [*self.wrapper, *EGRESSD, *options, "--socket", self.socket,
                "--run-dir", str(self.run_dir), "--state-dir", str(self.state)]  # fmt: skip

    def launch(self, *options: str) -> subprocess.Popen[bytes]:
        """Another egressd on this socket and run dir (e.g. ``--replace``), not yet waited
        for. stderr goes to the file: a pipe nobody reads fills up (a review block per
        freeze) and would block the daemon mid-write."""
        with open(self.stderr_path, "ab") as err:
            proc = subprocess.Popen(self.argv(*options), stdout=subprocess.PIPE, stderr=err,
                                    cwd=ROOT, start_new_session=self.own_session)  # fmt: skip
        self.pids.add(proc.pid)
        return proc

    def adopt(self, proc: subprocess.Popen[bytes]) -> None:
        """From now on ``proc`` is the egressd this one stops and reads."""
        assert proc.stdout is not None
        if self.proc is not None and self.proc is not proc:
            self.retired.append(self.proc)  # its pipe stays open: it may still write
        self.proc, self.lines = proc, Lines(proc.stdout.fileno())

    def line(self, timeout: float = START_S) -> str:
        """The next line egressd writes on stdout ("" if it ends or says nothing in time)."""
        assert self.lines is not None
        return self.lines.next(timeout)

    def start(self, *options: str) -> None:
        """Start it and wait until it says it is serving; stopped again if it does not."""
        self.adopt(self.launch(*options))
        line = self.line()
        if "serving" not in line:
            self.stop()
            raise AssertionError(f"egressd did not start: {line!r}\n{self.stderr()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> str:
        """Stop it (if it runs; killed if ``sig`` does not end it in time); returns what
        it wrote to stderr so far."""
        if self.proc is not None:
            _end(self.proc, sig)
        for old in self.retired:
            _end(old, signal.SIGKILL)  # a replaced egressd exits by itself; else, killed
        self.retired.clear()
        return self.stderr()

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def client(self) -> Client:
        return Client(self.socket)

    def create(self, text: str, uplink: str) -> dict[str, Any]:
        data = self.client.call("POST", "/v1/sandboxes", {"policy": text, "uplink_netns": uplink})
        self.made.append(data["id"])
        return dict(data)

    def delete(self, sandbox_id: str) -> None:
        self.client.call("DELETE", f"/v1/sandboxes/{sandbox_id}")

    def observer(
        self, to_file: bool = False, *options: str, own_session: bool = False
    ) -> subprocess.Popen[bytes]:
        """Its observer layer (`egressd observer` on the same run dir and journal), stderr
        piped (read it with ``read_until``) or, ``to_file``, appended to ``observer.log``
        here (a line per sandbox watched: hundreds fill a pipe nobody reads); leading a
        session of its own, as a service does, if ``own_session`` or this egressd does.
        The caller stops it."""
        argv = [*self.wrapper, *EGRESSD, "observer", "--run-dir", str(self.run_dir),
                "--state-dir", str(self.state), *options]  # fmt: skip
        session = own_session or self.own_session
        if not to_file:
            return subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE,
                                    start_new_session=session)  # fmt: skip
        with open(self.dir / "observer.log", "ab") as err:
            return subprocess.Popen(argv, cwd=ROOT, stderr=err,
                                    start_new_session=session)  # fmt: skip

    def delete_all(self) -> list[str]:
        """Delete every sandbox it serves; what could not be deleted (why)."""
        problems = []
        with suppress(DaemonError):
            for row in self.client.call("GET", "/v1/sandboxes"):
                try:
                    self.delete(row["id"])
                except DaemonError as exc:
                    problems.append(f"{row['id']}: {exc}")
        return problems

    def cleanup(self) -> list[str]:
        """Delete what is still served, stop, tear down what a stopped egressd left: the
        sandboxes made here and any other claim one of our egressd processes held (a
        create still under way when a benchmark was interrupted)."""
        if self.proc is not None and self.proc.poll() is None:
            self.delete_all()
        self.stop()
        left = []
        for claim in claims.load_all():
            # An owner pid still alive after ours stopped is someone else's by now.
            ours = claim.owner_pid in self.pids and not claims.alive(claim.owner_pid)
            if claim.id in self.made or ours:
                left += teardown_claim(claim)
        return left


def _end(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Signal ``proc`` (by its PID, if it still runs), wait for it, close its pipe."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_S)
    if proc.stdout is not None:
        proc.stdout.close()


@contextmanager
def egressd(
    state: Path | None = None,
    *options: str,
    own_session: bool = False,
    wrapper: tuple[str, ...] = (),
) -> Iterator[Egressd]:
    """A started egressd (``options`` on its command line, ``wrapper`` before it, e.g.
    ``chrt``), cleaned up on the way out."""
    daemon = Egressd(Path(tempfile.mkdtemp(prefix="egressd-test-")), state, own_session)
    daemon.wrapper = list(wrapper)
    try:
        daemon.start(*options)
        yield daemon
    finally:
        try:
            daemon.cleanup()
        finally:
            shutil.rmtree(daemon.dir, ignore_errors=True)
