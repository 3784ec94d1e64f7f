"""Issue 5: freeze on violation through two independent layers, with a durable journal.

Each test runs `egressctl run` for real and acts on it from outside, as a person (or a
crash) would: `egressctl resume/kill`, SIGKILL of a layer's process by its pid.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from egress.kernel.cgroup import Cgroup
from egress.lab import Lab
from egress.store import claims
from egress.store.journal import Journal
from tests.support import SYSTEM_PYTHON
from tests.support.probes import wait_until
from tests.support.sandboxes import (
    EGRESSCTL,
    cleanup,
    env,
    leftovers,
    policy_file,
    run_in,
    workdir,
)

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

BASE = """
apiVersion: egress/v1
kind: Policy
metadata: {{name: freeze}}
spec:
  mode: {mode}
  dns:
    upstreams: ["198.51.100.53"]
    allow: [allowed.lab.test]
  connect:
    allow:
      - {{cidr: 203.0.113.10/32, ports: [80], proto: tcp}}
      - {{cidr: "2001:db8:80::10/128", ports: [80], proto: tcp}}
  violations: {{blocked_connect: {connect}, denied_name: {name}, layer_loss: {loss},
                spoofed_source: {spoof}}}
"""

# The workload: a thread bumps a counter file as fast as it can; the main thread waits for
# the test's "go" and then does what the test asks (a blocked connect, a raw DNS query...).
AGENT = r"""
import os, socket, struct, sys, threading, time
d = sys.argv[1]
def tick():
    n = 0
    while True:
        n += 1
        with open(os.path.join(d, "counter.tmp"), "w") as f:
            f.write(str(n))
        os.replace(os.path.join(d, "counter.tmp"), os.path.join(d, "counter"))
        time.sleep(0.001)
threading.Thread(target=tick, daemon=True).start()
print("started", flush=True)
while not os.path.exists(os.path.join(d, "go")):
    time.sleep(0.005)
what, _, count = sys.argv[2].partition(":")
if what == "connect":
    s = socket.socket(); s.settimeout(30)
    try: s.connect(("203.0.113.11", 80))
    except OSError as e: print("connect failed:", e, flush=True)
elif what == "connect-again":
    s = socket.socket(); s.settimeout(30)
    try: s.connect(("203.0.113.11", 80))
    except OSError as e: print("connect failed:", e, flush=True)
    # At once after a resume: another blocked destination, and a request if it gets there.
    s = socket.socket(); s.settimeout(30)
    try:
        s.connect(("203.0.113.12", 80))
        s.sendall(b"GET /after-resume HTTP/1.0\r\nHost: allowed.lab.test\r\n\r\n")
        print("reached:", s.recv(100), flush=True)
    except OSError as e: print("second connect failed:", e, flush=True)
elif what == "udp-burst":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for i in range(int(count)):
        try: s.sendto(b"x", ("203.0.113.11", 10000 + i % 1000))
        except OSError: pass
elif what == "dns":
    name = b"".join(bytes([len(p)]) + p for p in b"denied.lab.test".split(b".")) + b"\0"
    q = struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0) + name + struct.pack("!HH", 1, 1)
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(q, ("127.0.0.53", 53))
elif what == "dns-behind-repeats":
    def query(qname, qid):
        name = b"".join(bytes([len(p)]) + p for p in qname.split(b".")) + b"\0"
        return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + name + struct.pack("!HH", 1, 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.sendto(query(b"allowed.lab.test", 1), ("127.0.0.53", 53))
    # The kernel hands the observer that copy at its next tick (4-10 ms): the burst's
    # repeats come in a later datagram, as repeats of a query it judged allowed.
    time.sleep(0.2)
    for i in range(int(count)):
        s.sendto(query(b"allowed.lab.test", 2 + i), ("127.0.0.53", 53))
    s.sendto(query(b"denied.lab.test", 9), ("127.0.0.53", 53))
elif what == "spoof-reply":
    # IPV6_FREEBIND (no privilege needed) lets a socket bind the server's address; it
    # sends to a second socket over lo, whose reply to it, an established flow, would go
    # to the server with anything in it.
    server = ("2001:db8:80::10", int(count))
    probe = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); probe.connect(server)
    b = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); b.settimeout(5)
    b.bind((probe.getsockname()[0], 0))
    a = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    a.setsockopt(socket.IPPROTO_IPV6, 78, 1); a.bind(server)
    try:
        a.sendto(b"x", b.getsockname()[:2])
        _, peer = b.recvfrom(10)
        b.sendto(b"spoofed-reply", peer)
        print("sent", flush=True)
    except OSError as e: print("spoof failed:", e, flush=True)
elif what == "spoof-syn":
    # Connects to an allowed destination from other addresses of the sandbox's /64
    # (IPV6_FREEBIND), then one from its own: the replies to the first would make the
    # host look each address up, an entry each in its one neighbour table. The status
    # line's arrival says theirs came back first, on the same path.
    server = ("2001:db8:80::10", 80)
    probe = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); probe.connect(server)
    own = probe.getsockname()[0]
    spoofed = [own.rsplit("::", 1)[0] + "::dead:%x" % n for n in range(1, int(count) + 1)]
    held = []
    for src in spoofed:
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM); s.setblocking(False)
        s.setsockopt(socket.IPPROTO_IPV6, 78, 1); s.bind((src, 0))
        s.connect_ex(server); held.append(s)
    s = socket.create_connection(server, timeout=10)
    s.sendall(b"GET /own-source HTTP/1.0\r\nHost: allowed.lab.test\r\n\r\n")
    status = s.makefile("rb").readline().decode().strip()
    print("|".join([status, " ".join(spoofed)]), flush=True)
print("done", flush=True)
while True:
    time.sleep(1)
"""


def policy(mode: str = "enforce", connect: str = "freeze", name: str = "block",
           loss: str = "freeze", spoof: str = "freeze") -> str:  # fmt: skip
    return BASE.format(mode=mode, connect=connect, name=name, loss=loss, spoof=spoof)


class Run:
    """`egressctl run` of the agent in the background, with handles on both layers."""

    def __init__(self, lab: Lab, d: Path, text: str, what: str, *extra: str) -> None:
        self.dir = d
        board = d / "board"
        board.mkdir()
        board.chmod(0o777)
        self.board = board
        (d / "agent.py").write_text(AGENT)
        self.report = d / "report.json"
        argv = [*run_in(d), "--policy", str(policy_file(d, text)), "--uplink-netns",
                lab.uplink_netns, "--report", str(self.report), *extra, "--",
                SYSTEM_PYTHON, str(d / "agent.py"), str(board), what]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env())  # fmt: skip
        self._pending = b""  # read from stdout, not yet a whole line
        self.ended = False  # stdout closed: no line will come
        first = self.line(60)
        if first != "started":
            self.proc.kill()
            _, err = self.proc.communicate()
            raise AssertionError(f"the agent did not start: {first!r}; egressctl said: {err}")
        [claim] = [c for c in claims.load_all() if c.owner_pid == self.proc.pid]
        self.id = claim.id
        self.cgroup = Cgroup.open(self.id)

    def journal(self) -> Journal:
        return Journal.open(os.environ["EGRESS_STATE_DIR"])

    def observer_pid(self) -> int:
        with self.journal() as j:
            row = j.sandbox(self.id)
        assert row and row["observer_pid"]
        return int(row["observer_pid"])

    def go(self) -> None:
        (self.board / "go").touch()

    def line(self, timeout: float) -> str:
        """The agent's next line on stdout, or "" if none comes within ``timeout`` (or it
        ended). Read from the pipe itself: a buffered reader may hold a line that select
        no longer sees, and a frozen agent must fail a test, not hang it."""
        assert self.proc.stdout is not None
        end = time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return ""
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:  # what it printed last, unended, is still a line
                self.ended = True
                last, self._pending = self._pending, b""
                return last.decode(errors="replace").strip()
            self._pending += chunk
        got, _, self._pending = self._pending.partition(b"\n")
        return got.decode(errors="replace").strip()

    def counter(self) -> int:
        try:
            return int((self.board / "counter").read_text() or 0)
        except FileNotFoundError:
            return 0  # the agent's thread has not written it yet

    def wait_frozen(self, timeout: float = 10) -> dict[str, Any]:
        """Until the journal shows a confirmed freeze and the kernel agrees."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.journal() as j:
                freezes = j.freezes(self.id)
            if freezes and freezes[0].get("confirmed_at") and self.cgroup.is_frozen():
                return freezes[0]
            time.sleep(0.01)
        with self.journal() as j:
            events = [(e["kind"], e["record"].get("detail")) for e in j.events(self.id)]
        log = Path(os.environ["EGRESS_STATE_DIR"], f"observer-{self.id}.log")
        said = log.read_text() if log.exists() else "(no observer log)"
        raise AssertionError(f"sandbox {self.id} not frozen after {timeout} s: {events}; {said}")

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*EGRESSCTL, *args], capture_output=True, text=True, env=env())

    def finish(self, timeout: float = 30) -> tuple[int, dict[str, Any], str]:
        _, err = self.proc.communicate(timeout=timeout)
        data = json.loads(self.report.read_text()) if self.report.exists() else {}
        return self.proc.returncode, data, err

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        cleanup(self.id)


@contextmanager
def agent_run(lab: Lab, text: str, what: str, *extra: str) -> Iterator[Run]:
    with workdir() as d:
        run = Run(lab, d, text, what, *extra)
        try:
            yield run
        finally:
            run.cleanup()


def still(run: Run) -> None:
    """The counter does not move while frozen (read, wait 300 ms, read)."""
    before = run.counter()
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        assert run.counter() == before
        time.sleep(0.02)


def moves(run: Run) -> None:
    before = run.counter()
    deadline = time.monotonic() + 5
    while run.counter() == before:
        assert time.monotonic() < deadline, "the counter did not advance"
        time.sleep(0.01)


def test_blocked_connect_freezes_and_resume_goes_on(lab: Lab) -> None:
    with agent_run(lab, policy(), "connect") as run:
        moves(run)
        run.go()
        freeze = run.wait_frozen()
        still(run)
        with run.journal() as j:
            [v] = [v for v in j.violations(run.id) if v["class"] == "blocked_connect"]
        assert v["evidence"]["flow"]["dst"] == "203.0.113.11"
        assert v["process"]["method"] == "socket"
        assert "agent.py" in v["process"]["cmdline"]
        assert freeze["latency_ms"] < 1000
        resumed = run.ctl("resume", run.id)
        assert resumed.returncode == 0, resumed.stderr
        moves(run)
        assert not run.cgroup.is_frozen()
        # The held connect fails at once (its next SYN is reset), not at its 30 s timeout.
        said = run.line(5.0)
        assert said.startswith("connect failed:") and "refused" in said, said
        run.ctl("kill", run.id)
        _, report, err = run.finish()
        assert f"egressctl resume {run.id}" in err and "FROZEN" in err
        assert report["frozen"] is True and report["outcome"] == "killed"
        with run.journal() as j:
            actions = [d["action"] for d in j.decisions(run.id)]
        assert actions == ["kill", "resume"]  # newest first, both journaled with a uid
    assert leftovers(run.id, lab.uplink_netns) == []


def test_a_violation_right_after_a_resume_freezes_again_and_reaches_nothing(lab: Lab) -> None:
    """The agent's answer to a resume: another blocked connect at once, while the layer
    that saw the first violation second may still be settling its freeze of it (a late
    freeze of a resumed freeze is thawed again, Journal.thaw_if_resumed). The new
    violation's freeze must stand, and the lab's web server must never see the request."""
    lab.clear_requests()
    with agent_run(lab, policy(), "connect-again") as run:
        run.go()
        first = run.wait_frozen()
        assert run.ctl("resume", run.id).returncode == 0
        end = time.monotonic() + 10
        while True:
            with run.journal() as j:
                freezes = j.freezes(run.id)
            if len(freezes) == 2 and freezes[0].get("confirmed_at") and run.cgroup.is_frozen():
                break
            assert time.monotonic() < end, f"not frozen again: {freezes}"
            time.sleep(0.01)
        second = freezes[0]
        assert second["id"] != first["id"] and second["decision_id"] is None
        still(run)  # and it stays so: no layer's thaw of the first freeze undid it
        with run.journal() as j:
            dsts = [v["evidence"]["flow"]["dst"] for v in j.violations(run.id)
                    if v["class"] == "blocked_connect"]  # fmt: skip
        assert sorted(set(dsts)) == ["203.0.113.11", "203.0.113.12"]
        run.ctl("kill", run.id)
        _, report, _ = run.finish()
        assert report["outcome"] == "killed"
    assert not [r for r in lab.requests() if "after-resume" in str(r.get("path"))]
    assert leftovers(run.id, lab.uplink_netns) == []


def test_both_layers_alive_make_one_freeze_two_detections(lab: Lab) -> None:
    with agent_run(lab, policy(), "connect", "--decision-timeout", "1") as run:
        run.go()
        run.wait_frozen()
        rc, report, _ = run.finish()
        assert rc == 137 and report["outcome"] == "killed"
        with run.journal() as j:
            freezes = j.freezes(run.id)
            [v] = [v for v in j.violations(run.id) if v["class"] == "blocked_connect"]
        assert len(freezes) == 1
        assert {d["layer"] for d in v["detected_by"]} == {"inline", "observer"}
        assert {a["layer"] for a in freezes[0]["requested_by"]} <= {"inline", "observer"}


def test_inline_layer_killed_observer_still_freezes(lab: Lab) -> None:
    with agent_run(lab, policy(loss="log"), "connect") as run:
        os.kill(run.proc.pid, signal.SIGKILL)  # egressctl run is the inline layer
        run.proc.wait()
        run.go()
        run.wait_frozen()
        still(run)
        with run.journal() as j:
            [v] = [v for v in j.violations(run.id) if v["class"] == "blocked_connect"]
            freezes = j.freezes(run.id)
        assert [d["layer"] for d in v["detected_by"]] == ["observer"]
        assert freezes[0]["layer"] == "observer"


def test_losing_the_inline_layer_freezes_by_default(lab: Lab) -> None:
    with agent_run(lab, policy(), "connect") as run:
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait()
        run.wait_frozen()
        with run.journal() as j:
            classes = [v["class"] for v in j.violations(run.id)]
        assert classes == ["layer_loss"]


def test_observer_killed_inline_still_freezes(lab: Lab) -> None:
    with agent_run(lab, policy(loss="log"), "connect", "--decision-timeout", "1") as run:
        os.kill(run.observer_pid(), signal.SIGKILL)
        run.go()
        run.wait_frozen()
        rc, report, _ = run.finish()
        assert rc == 137
        assert report["frozen"] and report["outcome"] == "killed"
        by_class = {v["class"]: v for v in report["violations"]}
        assert by_class["layer_loss"]["layer"] == "inline"
        assert by_class["blocked_connect"]["layer"] == "inline"
        assert [d["layer"] for d in by_class["blocked_connect"]["detected_by"]] == ["inline"]


def test_denied_query_with_the_resolver_gone_is_seen_by_the_observer(lab: Lab) -> None:
    text = policy(name="freeze", loss="log")
    with agent_run(lab, text, "dns") as run:
        os.kill(run.proc.pid, signal.SIGKILL)  # the resolver dies with the inline layer
        run.proc.wait()
        run.go()
        run.wait_frozen()
        with run.journal() as j:
            [v] = [v for v in j.violations(run.id) if v["class"] == "denied_name"]
        assert v["layer"] == "observer" and v["evidence"]["qname"] == "denied.lab.test"


def test_a_denied_query_behind_repeats_of_an_allowed_one_is_seen_by_the_observer(
    lab: Lab,
) -> None:
    """The observer deals with repeats of a query it judged allowed without making events
    of them (``observer.sift``), a datagram of copies at a time. A denied query behind 100
    of them (in their datagram, or the next if the kernel's tick split the burst), with
    the resolver gone: the observer alone still judges it and freezes, and nothing
    reached the lab's DNS."""
    lab.clear_queries()
    with agent_run(lab, policy(name="freeze", loss="log"), "dns-behind-repeats:100") as run:
        os.kill(run.proc.pid, signal.SIGKILL)  # the resolver dies with the inline layer
        run.proc.wait()
        run.go()
        run.wait_frozen()
        with run.journal() as j:
            found = [v for v in j.violations(run.id) if v["class"] == "denied_name"]
        assert [(v["layer"], v["evidence"]["qname"]) for v in found] == [
            ("observer", "denied.lab.test")
        ]
    assert lab.queries() == []


@pytest.mark.parametrize("action", ["log", "block"])
def test_log_and_block_do_not_freeze(lab: Lab, action: str) -> None:
    with agent_run(lab, policy(connect=action), "connect") as run:
        run.go()
        _wait_for(run, "done")
        moves(run)
        with run.journal() as j:
            assert j.freezes(run.id) == []
            assert [v["class"] for v in j.violations(run.id)] == ["blocked_connect"]


def test_audit_mode_never_freezes_but_journals(lab: Lab) -> None:
    with agent_run(lab, policy(mode="audit"), "connect") as run:
        run.go()
        _wait_for(run, "done")
        moves(run)
        with run.journal() as j:
            assert j.freezes(run.id) == []
            [v] = j.violations(run.id)
        assert v["class"] == "blocked_connect" and v["action"] == "freeze"


def test_kill_9_of_every_egress_process_in_a_burst_keeps_the_journal(lab: Lab) -> None:
    with agent_run(lab, policy(connect="log"), "udp-burst:20000") as run:
        observer = run.observer_pid()
        run.go()
        with run.journal() as j:  # wait until violations are being committed
            end = time.monotonic() + 10
            while len(j.violations(run.id, limit=10)) < 5 and time.monotonic() < end:
                time.sleep(0.01)
        os.kill(run.proc.pid, signal.SIGKILL)
        os.kill(observer, signal.SIGKILL)
        run.proc.wait()
        with run.journal() as j:
            assert j.check() == "ok"
            rows = j.violations(run.id, limit=100_000)
        assert len(rows) >= 5
        assert all(r["class"] == "blocked_connect" and r["evidence"]["flow"] for r in rows)


@contextmanager
def journal_locked(run: Run, state: Path) -> Iterator[sqlite3.Connection]:
    """The journal's write lock held here, then the workload's go: it is frozen all the
    same (from the layers' intent files). The lock goes on the way out."""
    lock = sqlite3.connect(state / "journal.db", isolation_level=None, timeout=0)
    try:
        lock.execute("BEGIN IMMEDIATE")
        run.go()
        end = time.monotonic() + 10
        while not run.cgroup.is_frozen():
            assert time.monotonic() < end, "not frozen with the journal locked"
            time.sleep(0.005)
        yield lock
    finally:
        lock.execute("ROLLBACK")
        lock.close()


def test_layers_killed_between_intent_and_commit_leave_the_violation_journaled(
    lab: Lab,
) -> None:
    """A freeze waits for the violation to be durable, not for SQLite: with the journal's
    write lock held here, the workload's blocked connect freezes the sandbox all the same
    (the record is in the layers' intent files). Both layers are then killed (-9) while
    they wait for the lock, the moment a crash between the freeze and the commit leaves.
    The next open of the journal holds the violation and its freeze, once."""
    state = Path(os.environ["EGRESS_STATE_DIR"])
    with agent_run(lab, policy(), "connect") as run:
        observer = run.observer_pid()
        with journal_locked(run, state) as lock:
            still(run)
            committed = lock.execute(  # nothing: only the intents hold it (Journal.open
                "SELECT count(*) FROM violations WHERE sandbox_id = ?",  # would wait)
                (run.id,),
            ).fetchone()
            assert committed == (0,)
            os.kill(observer, signal.SIGKILL)
            os.kill(run.proc.pid, signal.SIGKILL)
            run.proc.wait()
            gone(observer)
        with run.journal() as j:  # folds what the dead layers left
            [v] = [v for v in j.violations(run.id) if v["class"] == "blocked_connect"]
            freezes = j.freezes(run.id)
        assert v["evidence"]["flow"]["dst"] and v["evidence"]["flow"]["dport"]
        assert len(freezes) == 1 and freezes[0]["first_violation"] == v["id"]
        assert freezes[0]["decision_id"] is None  # for a person to decide
        assert list((state / "intents").glob("*.log")) == []
        with run.journal() as j:
            assert len(j.freezes(run.id)) == 1
            assert len([x for x in j.violations(run.id) if x["class"] == "blocked_connect"]) == 1


def test_a_freeze_sqlite_refused_is_journaled_on_the_layers_tick_and_stands(lab: Lab) -> None:
    """The journal's write lock held here past both layers' busy timeout (10 s): SQLite
    refuses their commits of the workload's blocked connect, and the freeze stands from
    their intent files. The frozen workload makes no further violation; once the lock is
    free, the layers' own ticks commit the records (this test's Journal.open folds no
    live layer's file). The journal then shows the freeze open for a person, the
    workload still stopped, and a resume lets it go on; nothing reached the lab."""
    state = Path(os.environ["EGRESS_STATE_DIR"])
    lab.clear_requests()
    with agent_run(lab, policy(), "connect") as run:
        observer = run.observer_pid()
        observer_log = state / f"observer-{run.id}.log"
        with journal_locked(run, state):
            # Both layers refused: each says so (the inline layer on egressctl's stderr).
            assert run.proc.stderr is not None
            said, end = "", time.monotonic() + 60
            while "egress inline: journal:" not in said or "egress observer: journal:" not in (
                observer_log.read_text() if observer_log.exists() else ""
            ):
                assert time.monotonic() < end, f"no refusal said: {said!r}"
                if select.select([run.proc.stderr], [], [], 0.05)[0]:
                    said += os.read(run.proc.stderr.fileno(), 65536).decode(errors="replace")
            assert "locked" in said
            still(run)
        end = time.monotonic() + 30  # the inline layer's tick is 5 s; the observer's 0.1
        while True:
            with run.journal() as j:
                freezes = j.freezes(run.id)
                asks = {a["layer"]: a for f in freezes for a in f["requested_by"]}
            # Each retry journals what its layer knew when SQLite refused the record: the
            # kernel's confirmation, and the process (attach_process), just after it.
            if set(asks) == {"inline", "observer"} and all("confirmed_at" in a for a in
                                                            asks.values()):  # fmt: skip
                break
            assert time.monotonic() < end, f"not journaled: {freezes}"
            time.sleep(0.02)
        assert all(f["decision_id"] is None for f in freezes)  # open, for a person
        with run.journal() as j:
            [v] = [v for v in j.violations(run.id) if v["class"] == "blocked_connect"]
            assert j.sandbox(run.id)["state"] == "frozen"  # type: ignore[index]
        assert v["evidence"]["flow"]["dst"] == "203.0.113.11"
        [freeze] = freezes
        assert 0 < freeze["latency_ms"] < 2000 and freeze["confirmed_at"] is not None
        # By uid: SQLite took its 10 s busy timeout to refuse, and meanwhile the SYN's
        # retransmit was reset (held4), so the socket was gone when the layer looked.
        assert v["process"]["method"] == "uid" and "agent.py" in v["process"]["cmdline"]
        still(run)
        assert run.proc.poll() is None and os.kill(observer, 0) is None  # both layers live
        assert run.ctl("resume", run.id).returncode == 0
        moves(run)
        run.ctl("kill", run.id)
        _, report, _ = run.finish()
        assert report["outcome"] == "killed"
    assert lab.requests() == []
    assert leftovers(run.id, lab.uplink_netns) == []


def gone(pid: int, timeout: float = 10) -> None:
    """Until ``pid`` is no more (reaped by whoever its parent is now)."""
    end = time.monotonic() + timeout
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < end, f"process {pid} still there"
        time.sleep(0.01)


def _wait_for(run: Run, line: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    seen = []
    while time.monotonic() < end and not run.ended:
        got = run.line(end - time.monotonic())
        if got == line:
            return
        seen.append(got)
    raise AssertionError(f"the agent never printed {line!r} within {timeout} s: {seen}")


def test_a_freeze_by_the_observer_alone_still_gets_the_review_and_the_timeout(lab: Lab) -> None:
    """The inline layer saw nothing; the sandbox froze anyway (here: a freeze made from
    outside, as the observer makes it). `run` shows the review block and, after
    --decision-timeout, kills it."""
    from egress.model import Action, Violation, ViolationClass

    with agent_run(lab, policy(), "connect", "--decision-timeout", "1") as run:
        v = Violation(
            cls=ViolationClass.BLOCKED_CONNECT,
            layer="observer",
            rule="default deny",
            detail="seen by the observer only",
            at=time.time(),
            action=Action.FREEZE,
        )
        with run.journal() as j:
            j.record_for_freeze(run.id, v, 2.0, time.time())
        run.cgroup.freeze()
        rc, report, err = run.finish()
        assert rc == 137
        assert "is FROZEN" in err and "seen by the observer only" in err
        assert report["outcome"] == "killed"


def test_a_reply_to_a_socket_bound_to_a_servers_address_never_reaches_it_and_freezes(
    lab: Lab,
) -> None:
    """The workload binds the lab server's IPv6 address (IPV6_FREEBIND) and sends from it
    to its own second socket over lo; that socket replies. Before the source check the
    reply, an established flow, left the sandbox: the server got it. Now the first
    datagram is dropped, both layers see it, the sandbox freezes, and the server gets
    nothing."""
    with lab.socket(socket.AF_INET6, socket.SOCK_DGRAM, netns=lab.inet_netns) as server:
        server.bind(("2001:db8:80::10", 4444))
        server.setblocking(False)
        with agent_run(lab, policy(), "spoof-reply:4444", "--decision-timeout", "1") as run:
            run.go()
            run.wait_frozen()
            rc, _, err = run.finish()
            assert rc == 137 and "spoofed_source" in err
            with run.journal() as j:
                found = [v for v in j.violations(run.id) if v["class"] == "spoofed_source"]
                classes = {v["class"] for v in j.violations(run.id)}
            assert classes == {"spoofed_source"}
            flow = found[0]["evidence"]["flow"]
            assert (flow["src"], flow["sport"], flow["proto"]) == ("2001:db8:80::10", 4444, "udp")
            assert {d["layer"] for d in found[0]["detected_by"]} == {"inline", "observer"}
            assert "agent.py" in found[0]["process"]["cmdline"]
        with pytest.raises(BlockingIOError):
            print("the server got", server.recvfrom(100))


def test_connects_from_addresses_of_its_64_it_does_not_hold_never_leave_the_sandbox(
    lab: Lab,
) -> None:
    """20 connects to an allowed destination, each from another address of the sandbox's
    /64 (IPV6_FREEBIND), then one from its own. Before the source check the 20 SYNs were
    answered, and the uplink held an entry for each address in the host's one neighbour
    table. Now none leaves (``block``: journaled, no freeze) and the uplink learns none;
    the sandbox's own connect still gets through. (None of the 20 could connect either
    way: nothing answers neighbour discovery for their addresses.)"""
    lab.clear_requests()
    with agent_run(lab, policy(spoof="block"), "spoof-syn:20") as run:
        run.go()
        said = run.line(30)
        status, spoofed = (part.split() for part in said.split("|"))
        assert status == ["HTTP/1.0", "200", "OK"] and len(spoofed) == 20
        # Asked while the sandbox lives: its veth's entries go with it.
        neigh = lab.run(["ip", "-6", "neigh", "show"]).stdout
        own = spoofed[0].rsplit("::", 1)[0] + "::2"
        assert f"{own} dev eg-" in neigh  # the sandbox's own, pinned: the listing works
        assert [a for a in spoofed if f"{a} " in neigh] == []

        def journaled() -> set[str]:  # by the layers' writer threads, a moment later
            with run.journal() as j:
                return {v["evidence"]["flow"]["src"] for v in j.violations(run.id)}

        assert wait_until(lambda: journaled() == set(spoofed), 10), journaled()
        with run.journal() as j:
            assert {v["class"] for v in j.violations(run.id)} == {"spoofed_source"}
            assert j.freezes(run.id) == []
    assert [r["path"] for r in lab.requests()] == ["/own-source"]
