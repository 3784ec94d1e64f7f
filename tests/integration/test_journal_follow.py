"""``egressctl journal --follow``: what is there, then each new event once, as it lands."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from egress.model import Action, Flow, Violation, ViolationClass
from egress.store.journal import Journal
from tests.support.sandboxes import EGRESSCTL, env

WAIT_S = 20.0  # for a line the follower should print; a busy 2-vCPU machine is slow


def violation(detail: str, at: float) -> Violation:
    return Violation(cls=ViolationClass.BLOCKED_CONNECT, layer="inline", rule="no rule",
                     detail=detail, at=at, action=Action.FREEZE,
                     flow=Flow("tcp", "10.0.0.2", "203.0.113.7", 40000, 443))  # fmt: skip


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    with Journal.open(tmp_path) as j:
        j.record_sandbox("s1", "p", created_at=time.time() - 5)
        j.record_violation("s1", violation("old", time.time() - 4))
        yield j


class Follower:
    def __init__(self, state: Path, *extra: str) -> None:
        argv = [*EGRESSCTL, "journal", "--follow", "--state-dir", str(state), *extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env())
        assert self.proc.stdout is not None
        self.fd = self.proc.stdout.fileno()
        self.buf = b""

    def line(self, wait: float = WAIT_S) -> str | None:
        """The next line it prints, or None if none comes within ``wait`` seconds."""
        deadline = time.monotonic() + wait
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            data = os.read(self.fd, 1 << 16)
            if not data:
                return None
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        self.proc.kill()  # ours, by PID
        self.proc.wait(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def test_follow_prints_the_backlog_then_each_new_event_once_as_json_lines(
    journal: Journal, tmp_path: Path
) -> None:
    f = Follower(tmp_path, "--json")
    try:
        first, second = json.loads(f.line() or "{}"), json.loads(f.line() or "{}")
        assert [first["kind"], second["kind"]] == ["sandbox_started", "violation"]
        assert second["record"]["detail"] == "old" and second["sandbox_id"] == "s1"
        journal.record_violation("s1", violation("new", time.time()))
        new = json.loads(f.line() or "{}")
        assert new["kind"] == "violation" and new["record"]["detail"] == "new"
        # one written by another process a little late, stamped before the newest: still
        # printed, once
        journal.record_violation("s1", violation("late", time.time() - 2))
        late = json.loads(f.line() or "{}")
        assert late["record"]["detail"] == "late"
        assert f.line(wait=1.0) is None  # nothing printed twice
    finally:
        f.close()


def test_follow_as_text_and_for_one_sandbox(journal: Journal, tmp_path: Path) -> None:
    journal.record_sandbox("s2", "p")
    f = Follower(tmp_path, "--sandbox", "s2")
    try:
        assert "sandbox started" in (f.line() or "")
        journal.record_violation("s1", violation("elsewhere", time.time()))
        journal.record_violation("s2", violation("here", time.time()))
        line = f.line() or ""
        assert "s2" in line and "violation blocked_connect" in line and "here" in line
    finally:
        f.close()


def test_follow_an_unknown_sandbox_is_an_error(journal: Journal, tmp_path: Path) -> None:
    argv = [*EGRESSCTL, "journal", "--follow", "--state-dir", str(tmp_path), "--sandbox", "x"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env())
    assert done.returncode != 0 and "no sandbox 'x'" in done.stderr
