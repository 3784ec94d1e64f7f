"""The violation journal: API, durability across kill -9, and concurrent writers.

The crash and concurrency tests run real writer processes (``_HELPER`` below) against one
journal file. Kill points are chosen by how many committed ids the writer has printed,
not by timers, so every run asserts the same thing: whatever a writer reported as
committed is in the journal after a SIGKILL, and the file is intact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from egress.errors import JournalError, SandboxError
from egress.model import Action, Flow, Violation, ViolationClass
from egress.store import journal_schema
from egress.store.journal import Journal
from egress.store.paths import default_state_dir, egress_gid, state_dir

T0 = 1_700_000_000.0

# Writer processes. argv: mode state_dir sandbox layer count [go_file]
_HELPER = r"""
import os, sys, time
from egress.model import Action, Flow, Violation, ViolationClass
from egress.store.journal import Journal

mode, state, sandbox, layer, count = sys.argv[1:6]
go = sys.argv[6] if len(sys.argv) > 6 else None
with Journal.open(state) as j:
    if mode == "fresh":
        j.record_sandbox(sandbox, "p")
    print("ready", flush=True)
    while go and not os.path.exists(go):
        time.sleep(0.001)
    if mode == "lying":  # the control: commits the first 50, then reports but never commits
        j._conn.execute("BEGIN IMMEDIATE")
    for i in range(int(count)):
        if mode == "freeze":
            print(j.record_freeze_request(sandbox, layer, None, time.time()), flush=True)
            continue
        flow = Flow("tcp", "10.0.0.2", "203.0.113.7", 40000 + i % 20000, 443)
        pad = "x" * (i % 7 * 400)  # some commits span several pages
        v = Violation(cls=ViolationClass.BLOCKED_CONNECT, layer=layer, rule="no rule",
                      detail=f"{layer} #{i} {pad}", at=time.time(), action=Action.FREEZE,
                      flow=flow)
        if mode == "lying":
            vid = j._insert_violation(j._conn, sandbox, v)
            if i == 49:
                j._conn.execute("COMMIT")
                j._conn.execute("BEGIN IMMEDIATE")
        else:
            vid = j.record_violation(sandbox, v)
        sys.stdout.write(f"{vid} {i}\n")
        sys.stdout.flush()
"""


def _spawn(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _HELPER, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _violation(
    at: float = T0,
    layer: str = "inline",
    cls: ViolationClass = ViolationClass.BLOCKED_CONNECT,
    dport: int = 443,
) -> Violation:
    flow = Flow("tcp", "10.0.0.2", "203.0.113.7", 40000, dport)
    return Violation(
        cls=cls,
        layer=layer,
        rule="no rule",
        detail="connect refused",
        at=at,
        action=Action.FREEZE,
        flow=flow,
    )


def _dns_violation(
    at: float = T0, layer: str = "inline", qname: str = "Evil.Example."
) -> Violation:
    return Violation(
        cls=ViolationClass.DENIED_NAME,
        layer=layer,
        rule="no dns rule",
        detail="query",
        at=at,
        action=Action.BLOCK,
        uid=1000,
        qname=qname,
        qtype="TXT",
    )


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    j = Journal.open(tmp_path / "state")
    j.record_sandbox("sb1", "default", netns="egress-sb1", cgroup="/sys/fs/cgroup/x",
                     created_at=T0 - 10, owner_pid=os.getpid())  # fmt: skip
    yield j
    j.close()


def _raw_check(path: Path) -> tuple[str, str]:
    conn = sqlite3.connect(path)
    try:
        integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
        quick = conn.execute("PRAGMA quick_check").fetchone()[0]
    finally:
        conn.close()
    return integrity, quick


# -- opening ---------------------------------------------------------------------------


def test_open_creates_private_dir_and_files(tmp_path: Path) -> None:
    """Root's and the egress group's only: 0750 and 0640 whatever the umask, and the
    -wal and -shm files SQLite makes take the database's mode and group."""
    state = tmp_path / "a" / "state"
    old = os.umask(0o002)
    try:
        j = Journal.open(state)
    finally:
        os.umask(old)
    with j:
        j.record_sandbox("sb1", "p")
        st = state.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o750, egress_gid())
        for name in ("journal.db", "journal.db-wal", "journal.db-shm"):
            st = (state / name).stat()
            assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o640, egress_gid()), name
    assert j.path == state / "journal.db"


def test_open_narrows_what_an_older_egress_left_looser_and_widens_nothing(
    tmp_path: Path,
) -> None:
    loose, tight = tmp_path / "loose", tmp_path / "tight"
    for state, dir_mode, file_mode in ((loose, 0o777, 0o666), (tight, 0o700, 0o600)):
        Journal.open(state).close()
        os.chmod(state, dir_mode)
        os.chmod(state / "journal.db", file_mode)
        Journal.open(state).close()
    assert stat.S_IMODE(loose.stat().st_mode) == 0o750
    assert stat.S_IMODE((loose / "journal.db").stat().st_mode) == 0o640
    assert stat.S_IMODE(tight.stat().st_mode) == 0o700
    assert stat.S_IMODE((tight / "journal.db").stat().st_mode) == 0o600


def test_pragmas_wal_full_foreign_keys(journal: Journal) -> None:
    conn = journal._conn  # the settings are per connection: ask the journal's own
    assert conn is not None
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 10_000


def test_schema_version_recorded_once(tmp_path: Path) -> None:
    Journal.open(tmp_path).close()
    Journal.open(tmp_path).close()
    conn = sqlite3.connect(tmp_path / "journal.db")
    rows = conn.execute("SELECT version FROM schema_version").fetchall()
    conn.close()
    assert rows == [(1,), (2,), (3,), (4,), (journal_schema.SCHEMA_VERSION,)]
    assert rows == [(1,), (2,), (3,), (4,), (5,)]


def test_a_version_1_journal_is_migrated_keeping_its_rows(tmp_path: Path) -> None:
    """A journal an earlier egress wrote (schema 1) gains the freezer column, rows intact."""
    conn = sqlite3.connect(tmp_path / "journal.db")
    conn.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at REAL)")
    for statement in journal_schema.MIGRATIONS[0]:
        conn.execute(statement)
    conn.execute("INSERT INTO schema_version VALUES (1, 0)")
    conn.execute("INSERT INTO sandboxes (id, policy, created_at, state) "
                 "VALUES ('old1', 'p', 1.0, 'running')")  # fmt: skip
    conn.commit()
    conn.close()
    with Journal.open(tmp_path) as journal:
        row = journal.sandbox("old1")
        assert row is not None and row["policy"] == "p" and row["freezer"] is None
        journal.record_sandbox("new1", "p", cgroup="/sys/fs/cgroup/x", freezer="/f/x")
        row = journal.sandbox("new1")
        assert row is not None and row["freezer"] == "/f/x"


def test_a_version_2_journal_gains_policy_sha256_and_uid_keeping_its_rows(
    tmp_path: Path,
) -> None:
    conn = sqlite3.connect(tmp_path / "journal.db")
    conn.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at REAL)")
    for statement in (*journal_schema.MIGRATIONS[0], *journal_schema.MIGRATIONS[1]):
        conn.execute(statement)
    conn.execute("INSERT INTO schema_version VALUES (1, 0), (2, 0)")
    conn.execute("INSERT INTO sandboxes (id, policy, created_at, state, freezer) "
                 "VALUES ('old2', 'p', 1.0, 'running', '/f/old2')")  # fmt: skip
    conn.commit()
    conn.close()
    with Journal.open(tmp_path) as journal:
        row = journal.sandbox("old2")
        assert row is not None and row["freezer"] == "/f/old2"
        assert row["policy_sha256"] is None and row["uid"] is None
        journal.record_sandbox("new2", "p", policy_sha256="ab" * 32, uid=65534)
        row = journal.sandbox("new2")
        assert row is not None and (row["policy_sha256"], row["uid"]) == ("ab" * 32, 65534)


def test_policy_sha256_and_uid_are_journaled_and_in_the_timeline(journal: Journal) -> None:
    digest = hashlib.sha256(b"name: p\n").hexdigest()
    journal.record_sandbox("sb2", "p", policy_sha256=digest, uid=1234, created_at=T0)
    started = [e for e in journal.events("sb2") if e["kind"] == "sandbox_started"]
    assert started[0]["record"]["policy_sha256"] == digest
    assert started[0]["record"]["uid"] == 1234
    other = hashlib.sha256(b"name: q\n").hexdigest()
    journal.set_sandbox_state("sb2", "running", policy="q", policy_sha256=other)
    row = journal.sandbox("sb2")
    assert row is not None and (row["policy"], row["policy_sha256"]) == ("q", other)
    untold = journal.sandbox("sb1")  # recorded without them: NULL
    assert untold is not None and untold["policy_sha256"] is None and untold["uid"] is None


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    Journal.open(tmp_path).close()
    conn = sqlite3.connect(tmp_path / "journal.db")
    conn.execute("INSERT INTO schema_version VALUES (99, 0)")
    conn.commit()
    conn.close()
    with pytest.raises(JournalError, match="version 99 is newer"):
        Journal.open(tmp_path)


def test_garbage_file_is_a_journal_error_naming_the_path(tmp_path: Path) -> None:
    (tmp_path / "journal.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(JournalError, match=str(tmp_path / "journal.db")) as info:
        Journal.open(tmp_path)
    assert isinstance(info.value.__cause__, sqlite3.Error)


def test_unwritable_state_dir(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(JournalError, match="cannot create"):
        Journal.open(tmp_path / "file" / "state")


def test_closed_journal_raises(tmp_path: Path) -> None:
    j = Journal.open(tmp_path)
    j.close()
    j.close()
    with pytest.raises(JournalError, match="closed"):
        j.sandboxes()


def test_state_dir_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EGRESS_STATE_DIR", raising=False)
    assert default_state_dir() == Path("/var/lib/egress")
    monkeypatch.setenv("EGRESS_STATE_DIR", "/srv/egress")
    assert default_state_dir() == state_dir() == state_dir(None) == Path("/srv/egress")
    assert state_dir("/opt/x") == Path("/opt/x")


# -- sandboxes -------------------------------------------------------------------------


def test_sandbox_record_and_state(journal: Journal) -> None:
    sb = journal.sandbox("sb1")
    assert sb is not None
    assert sb["state"] == "running" and sb["netns"] == "egress-sb1" and sb["ended_at"] is None
    journal.set_sandbox_state("sb1", "running", inline_pid=11, observer_pid=12)
    journal.set_sandbox_state("sb1", "exited")
    sb = journal.sandbox("sb1")
    assert sb is not None
    assert (sb["state"], sb["inline_pid"], sb["observer_pid"]) == ("exited", 11, 12)
    assert sb["ended_at"] is not None
    assert journal.sandbox("nope") is None
    journal.record_sandbox("sb2", "p", created_at=T0)
    assert [s["id"] for s in journal.sandboxes()] == ["sb2", "sb1"]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda j: j.record_sandbox("sb1", "p"), "already journaled"),
        (lambda j: j.set_sandbox_state("sb1", "paused"), "state must be one of"),
        (lambda j: j.set_sandbox_state("sb1", "frozen", color=1), "not a sandbox field: color"),
        (lambda j: j.set_sandbox_state("zz", "frozen"), "no sandbox 'zz'"),
        (lambda j: j.record_violation("zz", _violation()), "no sandbox 'zz'"),
        (lambda j: j.record_detection(999, "observer", T0), "no violation 999"),
        (lambda j: j.attach_process(999, {"pid": 1}), "no violation 999"),
        (lambda j: j.record_freeze_request("zz", "inline", None, T0), "no sandbox 'zz'"),
        (lambda j: j.confirm_freeze(999, T0, 1.0), "no freeze 999"),
        (lambda j: j.record_decision("sb1", "thaw", 0, T0), "resume or kill"),
        (lambda j: j.record_decision("zz", "kill", 0, T0), "no sandbox 'zz'"),
    ],
)
def test_bad_requests_are_journal_errors_and_change_nothing(
    journal: Journal, call: object, message: str
) -> None:
    before = journal.events(limit=1000)
    with pytest.raises(JournalError, match=message):
        call(journal)  # type: ignore[operator]
    assert journal.events(limit=1000) == before


# -- violations ------------------------------------------------------------------------


def test_violation_round_trip(journal: Journal) -> None:
    vid = journal.record_violation("sb1", _violation())
    did = journal.record_violation("sb1", _dns_violation(at=T0 + 1))
    rows = journal.violations()
    assert [r["id"] for r in rows] == [did, vid]  # newest first
    v = rows[1]
    assert v["class"] == "blocked_connect" and v["action"] == "freeze" and v["layer"] == "inline"
    assert v["evidence"] == {
        "flow": {"proto": "tcp", "src": "10.0.0.2", "sport": 40000,
                 "dst": "203.0.113.7", "dport": 443},
    }  # fmt: skip
    assert v["key"] == "tcp 10.0.0.2:40000 -> 203.0.113.7:443"
    assert v["process"] is None
    assert v["detected_by"] == [{"layer": "inline", "at": T0}]
    d = rows[0]
    assert d["evidence"] == {"qname": "Evil.Example.", "qtype": "TXT", "uid": 1000}
    assert d["key"] == "evil.example/TXT"
    assert journal.violation(vid) == v


def test_violations_filter_and_limit(journal: Journal) -> None:
    journal.record_sandbox("sb2", "p")
    for i in range(5):
        journal.record_violation("sb1" if i % 2 else "sb2", _violation(at=T0 + i))
    assert [r["at"] for r in journal.violations("sb1")] == [T0 + 3, T0 + 1]
    assert [r["at"] for r in journal.violations(limit=2)] == [T0 + 4, T0 + 3]
    assert journal.violations("nope") == []


def test_attach_process_fills_in_later_and_first_keys_win(journal: Journal) -> None:
    vid = journal.record_violation("sb1", _violation())
    journal.attach_process(vid, {"pid": 42, "cmdline": ["curl", "x"], "parents": [1, 7]})
    journal.attach_process(vid, {"pid": 43, "cwd": "/work"})
    v = journal.violation(vid)
    assert v is not None
    assert v["process"] == {"pid": 42, "cmdline": ["curl", "x"], "parents": [1, 7], "cwd": "/work"}


def test_cross_layer_dedup(journal: Journal) -> None:
    vid = journal.record_violation("sb1", _violation(at=T0))
    key = journal_schema.violation_key(_violation())
    cls = ViolationClass.BLOCKED_CONNECT
    assert journal.find_recent_violation("sb1", cls, key, 2.0, now=T0 + 1) == vid
    assert journal.find_recent_violation("sb1", "blocked_connect", key, 2.0, now=T0 + 1) == vid
    assert journal.find_recent_violation("sb1", cls, key, 2.0, now=T0 + 3) is None
    assert journal.find_recent_violation("sb1", ViolationClass.TUNNEL, key, 2.0, now=T0) is None
    assert journal.find_recent_violation("sb1", cls, "other", 2.0, now=T0) is None
    journal.record_detection(vid, "observer", T0 + 0.004)
    journal.record_detection(vid, "observer", T0 + 0.5)  # a layer's first sighting counts
    v = journal.violation(vid)
    assert v is not None
    assert v["detected_by"] == [
        {"layer": "inline", "at": T0},
        {"layer": "observer", "at": T0 + 0.004},
    ]


def test_record_or_detect_is_one_step(journal: Journal) -> None:
    first = journal.record_or_detect("sb1", _dns_violation(at=T0 + 0.01, layer="observer"), 2.0)
    again = journal.record_or_detect("sb1", _dns_violation(at=T0, qname="evil.example"), 2.0)
    later = journal.record_or_detect("sb1", _dns_violation(at=T0 + 5), 2.0)
    assert first[1] is True and again == (first[0], False) and later[1] is True
    v = journal.violation(first[0])
    assert v is not None
    assert [d["layer"] for d in v["detected_by"]] == ["inline", "observer"]  # ordered by time


# -- freezes and decisions -------------------------------------------------------------


def test_a_violation_is_dated_by_its_first_sighting_whichever_layer_commits_first(
    journal: Journal,
) -> None:
    """The inline layer saw it first and froze from its intent; the observer, later to
    see it, committed first, and the freeze was confirmed before the inline layer's
    commit. The violation is dated by the first sighting, and the freeze latency counts
    from it (it read -1.5 ms in `make demo`, confirmed "before" the observer's sighting)."""
    first, later = _violation(T0, "inline"), _violation(T0 + 0.003, "observer")
    vid, _, fid = journal.record_for_freeze("sb1", later, 2.0, later.at)
    assert fid is not None
    journal.confirm_freeze(fid, T0 + 0.002, 0.5, "observer")
    journal.record_for_freeze("sb1", first, 2.0, first.at)
    [v] = journal.violations("sb1")
    assert v["id"] == vid and v["at"] == T0
    assert [d["at"] for d in v["detected_by"]] == [T0, T0 + 0.003]
    [f] = journal.freezes("sb1")
    assert f["latency_ms"] == pytest.approx(2.0, abs=1e-3)
    journal.confirm_freeze(fid, T0 + 0.001, 0.4, "inline")  # earlier still: counted from T0
    assert journal.freezes("sb1")[0]["latency_ms"] == pytest.approx(1.0, abs=1e-3)


def test_freeze_is_idempotent_across_layers(journal: Journal) -> None:
    vid = journal.record_violation("sb1", _violation())
    fid = journal.record_freeze_request("sb1", "observer", vid, T0 + 0.002)
    assert journal.record_freeze_request("sb1", "inline", vid, T0 + 0.003) == fid
    assert journal.record_freeze_request("sb1", "observer", vid, T0 + 0.009) == fid
    journal.confirm_freeze(fid, T0 + 0.020, 17.0, "inline")  # the later one, journaled first
    journal.confirm_freeze(fid, T0 + 0.010, 8.0, "observer")
    journal.confirm_freeze(fid, T0 + 0.030, 27.0, "inline")
    [f] = journal.freezes("sb1")
    assert (f["layer"], f["first_violation"], f["requested_at"]) == ("observer", vid, T0 + 0.002)
    # The latency runs from the first violation (at T0), whichever layer confirmed.
    assert (f["confirmed_at"], f["decision_id"]) == (T0 + 0.010, None)
    assert f["latency_ms"] == pytest.approx(10.0, abs=1e-3)
    assert f["requested_by"] == [
        {"layer": "observer", "at": T0 + 0.002, "violation_id": vid, "confirmed_at": T0 + 0.010},
        {"layer": "inline", "at": T0 + 0.003, "violation_id": vid, "confirmed_at": T0 + 0.020},
    ]
    journal.record_sandbox("sb2", "default")
    no_violation = journal.record_freeze_request("sb2", "inline", None, T0 + 5)
    journal.confirm_freeze(no_violation, T0 + 5.004, 4.0)  # none to count from: as given
    assert journal.freezes("sb2")[0]["latency_ms"] == 4.0
    sb = journal.sandbox("sb1")
    assert sb is not None and sb["state"] == "frozen"


def test_a_freeze_that_lands_after_its_resume_is_thawed_unless_another_is_open(
    journal: Journal,
) -> None:
    """The other layer froze first, a person resumed, then this layer's freeze landed."""
    vid = journal.record_violation("sb1", _violation())
    fid = journal.record_freeze_request("sb1", "inline", vid, T0 + 0.001)
    thawed: list[int] = []
    assert not journal.thaw_if_resumed(fid, "inline", lambda: thawed.append(fid))  # undecided
    journal.record_decision("sb1", "resume", 0, T0 + 1)
    journal.confirm_freeze(fid, T0 + 1.5, 1500.0, "inline")  # the late layer's confirmation
    sb = journal.sandbox("sb1")
    assert sb is not None and sb["state"] == "running"  # not marked frozen again
    assert journal.thaw_if_resumed(fid, "inline", lambda: thawed.append(fid))
    assert thawed == [fid]
    [ask] = journal.freezes("sb1")[0]["requested_by"]
    assert ask["confirmed_at"] == T0 + 1.5 and ask["thawed_at"] > T0  # journaled, then thawed

    def refused() -> None:
        raise SandboxError("cannot write '0'")

    with pytest.raises(SandboxError):  # a thaw that fails: the note goes with it
        journal.thaw_if_resumed(fid, "observer", refused)
    assert [a["layer"] for a in journal.freezes("sb1")[0]["requested_by"]] == ["inline"]
    # A new violation's freeze request is open: its freeze must stand.
    fid2 = journal.record_freeze_request("sb1", "observer", None, T0 + 2)
    assert not journal.thaw_if_resumed(fid, "inline", lambda: thawed.append(-1))
    # A kill is not undone.
    journal.record_decision("sb1", "kill", 0, T0 + 3)
    assert not journal.thaw_if_resumed(fid2, "observer", lambda: thawed.append(-2))
    assert thawed == [fid]


def test_decision_closes_the_open_freeze(journal: Journal) -> None:
    first = journal.record_freeze_request("sb1", "inline", None, T0)
    did = journal.record_decision("sb1", "resume", 1000, T0 + 60, "false positive")
    second = journal.record_freeze_request("sb1", "inline", None, T0 + 70)
    assert second != first
    kid = journal.record_decision("sb1", "kill", 0, T0 + 80)
    assert [(d["id"], d["action"], d["uid"], d["note"]) for d in journal.decisions()] == [
        (kid, "kill", 0, ""),
        (did, "resume", 1000, "false positive"),
    ]
    assert [(f["id"], f["decision_id"]) for f in journal.freezes()] == [(second, kid), (first, did)]


def test_events_timeline(journal: Journal) -> None:
    journal.record_sandbox("other", "p", created_at=T0 + 0.5)
    vid = journal.record_violation("sb1", _violation(at=T0))
    fid = journal.record_freeze_request("sb1", "inline", vid, T0 + 0.001)
    journal.confirm_freeze(fid, T0 + 0.004, 3.0)
    journal.record_decision("sb1", "kill", 1000, T0 + 30)
    journal.set_sandbox_state("sb1", "exited", ended_at=T0 + 31)
    events = journal.events("sb1")
    assert [(e["kind"], e["at"]) for e in events] == [
        ("sandbox_ended", T0 + 31),
        ("decision", T0 + 30),
        ("frozen", T0 + 0.004),
        ("freeze_requested", T0 + 0.001),
        ("violation", T0),
        ("sandbox_started", T0 - 10),
    ]
    assert {e["sandbox_id"] for e in events} == {"sb1"}
    assert events[2]["record"]["latency_ms"] == pytest.approx(4.0, abs=1e-3)  # from the violation
    assert events[4]["record"]["evidence"]["flow"]["dport"] == 443
    assert len(journal.events()) == 7 and journal.events(limit=2) == events[:2]
    json.dumps(journal.events())  # plain data all the way down


# -- durability and concurrency (real processes) ---------------------------------------

# How many committed ids the writer must have printed before it is killed, one run each.
# Runs accumulate in one file, so later runs reopen (and recover) a crashed journal, and
# the larger ones cross WAL auto-checkpoints (about every 200 commits here).
KILL_AFTER = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 7, 233, 1, 377, 4, 150, 610, 17, 300]


def _kill_after(state: Path, mode: str, layer: str, n: int) -> dict[int, int]:
    """Start a writer, SIGKILL it once it has printed ``n`` ids; return {id: loop index}."""
    writer = _spawn(mode, state, "sb1", layer, 1_000_000)
    assert writer.stdout is not None and writer.stderr is not None
    try:
        assert writer.stdout.readline() == "ready\n"
        lines = [writer.stdout.readline().split() for _ in range(n)]
    finally:
        writer.send_signal(signal.SIGKILL)
        assert writer.wait(timeout=30) == -signal.SIGKILL
        writer.stdout.close()
        writer.stderr.close()
    return {int(vid): int(i) for vid, i in lines}


def _reopen_and_read(state: Path) -> dict[int, dict[str, object]]:
    """Open the crashed journal (recovery runs here) and check it is intact."""
    assert _raw_check(state / "journal.db") == ("ok", "ok")
    with Journal.open(state) as j:
        assert j.check() == "ok"
        return {r["id"]: r for r in j.violations(limit=10_000_000)}


def test_committed_violations_survive_kill_9(tmp_path: Path) -> None:
    with Journal.open(tmp_path) as j:
        j.record_sandbox("sb1", "p")
    reported: dict[int, int] = {}  # violation id -> writer's loop index
    for run, n in enumerate(KILL_AFTER):
        reported |= _kill_after(tmp_path, "write", f"run{run}", n)
        rows = _reopen_and_read(tmp_path)
        missing = sorted(set(reported) - set(rows))
        assert not missing, f"run {run} (killed after {n}): committed ids lost: {missing[:10]}"
        ids = sorted(rows)
        assert ids == list(range(1, len(ids) + 1))  # no torn or half-numbered rows
        for vid, i in reported.items():
            assert str(rows[vid]["detail"]).startswith(f"{rows[vid]['layer']} #{i} ")
    assert len(reported) == sum(KILL_AFTER)


def test_crash_harness_catches_early_reports(tmp_path: Path) -> None:
    """Control: a writer that prints ids before committing them fails the check above."""
    with Journal.open(tmp_path) as j:
        j.record_sandbox("sb1", "p")
    reported = _kill_after(tmp_path, "lying", "liar", 75)
    rows = _reopen_and_read(tmp_path)
    assert set(rows) == set(range(1, 51))  # the first 50 were committed, the rest vanish
    assert set(reported) - set(rows) == set(range(51, 76))


def _run_together(procs: list[subprocess.Popen[str]], go: Path) -> list[tuple[str, str]]:
    try:
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline() != "ready\n":
                go.touch()  # let the others finish; this one's stderr says why
                _, err = p.communicate(timeout=120)
                pytest.fail(f"a helper exited before it was ready (rc {p.returncode}): {err}")
        go.touch()
    finally:
        outs = [p.communicate(timeout=120) for p in procs]  # reaps and closes every pipe
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert err == ""
    return outs


def test_two_writers_at_once_lose_nothing(tmp_path: Path) -> None:
    with Journal.open(tmp_path) as j:
        j.record_sandbox("sb1", "p")
    n = 300
    go = tmp_path / "go"
    outs = _run_together(
        [_spawn("write", tmp_path, "sb1", layer, n, go) for layer in ("inline", "observer")], go
    )
    written = {layer: [int(line.split()[0]) for line in out.splitlines()]
               for layer, (out, _) in zip(("inline", "observer"), outs, strict=True)}  # fmt: skip
    with Journal.open(tmp_path) as j:
        rows = j.violations(limit=10 * n)
    assert len(rows) == 2 * n
    for layer, ids in written.items():
        assert len(ids) == n
        assert {r["id"] for r in rows if r["layer"] == layer} == set(ids)
    by_id = sorted(rows, key=lambda r: r["id"])
    switches = sum(a["layer"] != b["layer"] for a, b in itertools.pairwise(by_id))
    assert switches > 1, "the writers did not overlap"


def test_many_processes_open_a_fresh_journal_at_once(tmp_path: Path) -> None:
    state, go = tmp_path / "new" / "state", tmp_path / "go"
    procs = [_spawn("fresh", state, f"sb{k}", "inline", 20, go) for k in range(4)]
    _run_together(procs, go)
    with Journal.open(state) as j:
        assert len(j.sandboxes()) == 4
        assert len(j.violations(limit=1000)) == 80
        assert j.check() == "ok"


def test_opening_a_fresh_journal_waits_for_another_writers_first_transaction(
    tmp_path: Path,
) -> None:
    # Another process in its first write transaction on the not yet WAL database holds
    # RESERVED: SQLite refuses the switch to WAL at once (no busy handler), so open must
    # poll, or a process that opens a fresh journal beside another one fails.
    tmp_path.chmod(0o750)
    other = sqlite3.connect(tmp_path / "journal.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    result: list[object] = []

    def open_it() -> None:
        try:
            with Journal.open(tmp_path, busy_timeout_s=60) as j:
                j.record_sandbox("sb1", "p")
            result.append("ok")
        except Exception as exc:  # reported below
            result.append(exc)

    opener = threading.Thread(target=open_it)
    opener.start()
    opener.join(timeout=0.3)
    try:
        assert opener.is_alive(), f"open did not wait for the lock: {result}"
    finally:
        other.execute("COMMIT")
        other.close()
        opener.join()
    assert result == ["ok"]
    with Journal.open(tmp_path) as j:
        assert [s["id"] for s in j.sandboxes()] == ["sb1"]


def test_layers_racing_to_freeze_share_one_freeze(tmp_path: Path) -> None:
    with Journal.open(tmp_path) as j:
        j.record_sandbox("sb1", "p")
    for rnd in range(5):
        go = tmp_path / f"go{rnd}"
        outs = _run_together(
            [_spawn("freeze", tmp_path, "sb1", layer, 3, go) for layer in ("inline", "observer")],
            go,
        )
        ids = {int(x) for out, _ in outs for x in out.split()}
        with Journal.open(tmp_path) as j:
            [open_freeze] = [f for f in j.freezes() if f["decision_id"] is None]
            assert ids == {open_freeze["id"]}
            assert sorted(a["layer"] for a in open_freeze["requested_by"]) == [
                "inline",
                "observer",
            ]
            j.record_decision("sb1", "resume", 0, time.time())
    with Journal.open(tmp_path) as j:
        assert len(j.freezes()) == 5


def test_decided_says_whether_a_person_already_ruled_on_a_violation(tmp_path: Path) -> None:
    with Journal.open(tmp_path) as j:
        j.record_sandbox("sb1", "p")
        vid = j.record_violation("sb1", _violation())
        assert not j.decided(vid)
        fid = j.record_freeze_request("sb1", "inline", vid, time.time())
        j.confirm_freeze(fid, time.time(), 0.5)
        assert not j.decided(vid)  # frozen, nobody has decided yet
        j.record_decision("sb1", "resume", 0, time.time())
        assert j.decided(vid)
        other = j.record_violation("sb1", _violation())
        assert not j.decided(other)


def test_record_for_freeze_is_one_commit_and_honours_decisions(tmp_path: Path) -> None:
    with Journal.open(tmp_path) as j:
        j.record_sandbox("sb1", "p")
        v = _violation()
        vid, first, fid = j.record_for_freeze("sb1", v, 2.0, time.time())
        assert first and fid is not None
        assert j.freezes("sb1")[0]["first_violation"] == vid
        # The other layer, same violation, before any decision: it joins the same freeze.
        other = dataclasses.replace(v, layer="observer")
        assert j.record_for_freeze("sb1", other, 2.0, time.time()) == (vid, False, fid)
        j.record_decision("sb1", "resume", 0, time.time())
        # After the decision, a late sighting of it must not ask for a freeze again.
        late = dataclasses.replace(v, layer="observer", at=v.at + 0.5)
        assert j.record_for_freeze("sb1", late, 2.0, time.time()) == (vid, False, None)
        assert len(j.freezes("sb1")) == 1


def test_a_name_mismatch_is_keyed_by_its_flow_not_by_the_name_it_asks_for() -> None:
    import dataclasses

    v = dataclasses.replace(_violation(cls=ViolationClass.NAME_MISMATCH), qname="other.test")
    w = dataclasses.replace(v, flow=Flow("tcp", "10.0.0.2", "203.0.113.7", 40001, 443))
    assert journal_schema.violation_key(v) == str(v.flow) != journal_schema.violation_key(w)
    dns = dataclasses.replace(v, cls=ViolationClass.DENIED_NAME, qtype="A")
    assert journal_schema.violation_key(dns) == "other.test/A"
