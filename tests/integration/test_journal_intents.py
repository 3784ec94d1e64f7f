"""Freeze intents (store/intents.py) against a real journal, files and processes: what a
layer that dies between its intent and its SQLite commit leaves is journaled all the
same by whoever opens the journal next, once, and never while the layer lives."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from egress.errors import JournalError
from egress.model import Action, Flow, Violation, ViolationClass
from egress.store import intents
from egress.store.journal import FROZEN_AGAIN, STILL_PENDING, Journal

V = Violation(
    cls=ViolationClass.BLOCKED_CONNECT, layer="observer", rule="default deny",
    detail="tcp to 203.0.113.9:443", at=1_700_000_000.5, action=Action.FREEZE,
    flow=Flow("tcp", "10.0.0.2", "203.0.113.9", 40000, 443), uid=1000,
)  # fmt: skip

# A layer in a process of its own: its intent written, then (as `commit` says) its
# SQLite commit or not, then gone at once, as kill -9 leaves it: no close, no cleanup.
LAYER = """
import os, sys, time
from egress.errors import JournalError
from egress.model import Action, Flow, Violation, ViolationClass
from egress.store.journal import FROZEN_AGAIN, STILL_PENDING, Journal
j = Journal.open(sys.argv[1])
j.open_intents()
v = Violation(cls=ViolationClass.BLOCKED_CONNECT, layer="observer", rule="default deny",
              detail="tcp to 203.0.113.9:443", at=float(sys.argv[3]), action=Action.FREEZE,
              flow=Flow("tcp", "10.0.0.2", "203.0.113.9", 40000, 443), uid=1000)
intent = j.write_intent("sb1", v, 2.0, float(sys.argv[3]) + 0.001)
assert intent is not None
if sys.argv[2] in ("commit", "commit-resume"):
    j.record_for_freeze("sb1", v, 2.0, float(sys.argv[3]) + 0.001, intent)
if sys.argv[2] == "commit-resume":
    j.record_decision("sb1", "resume", 0, float(sys.argv[3]) + 1, "a person")
os._exit(0)
"""


def dead_layer(state: Path, then: str, at: float) -> None:
    """``then``: "no" (killed before its commit), "commit", or "commit-resume" (and a
    person resumed the freeze before it died)."""
    args = [sys.executable, "-c", LAYER, str(state), then, str(at)]
    subprocess.run(args, check=True, timeout=60)


def intent_files(state: Path) -> list[Path]:
    return sorted((state / intents.DIR).glob("*" + intents.SUFFIX))


@pytest.fixture
def state(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    with Journal.open(state) as j:
        j.record_sandbox("sb1", "p")
    return state


def test_a_layer_killed_after_its_intent_leaves_its_violation_and_freeze_journaled(
    state: Path,
) -> None:
    at = time.time()
    dead_layer(state, "no", at=at)
    [left] = intent_files(state)
    with Journal.open(state) as j:  # folds it
        [v] = j.violations("sb1")
        assert (v["class"], v["layer"], v["key"], v["at"]) == (
            "blocked_connect", "observer", str(V.flow), at,
        )  # fmt: skip
        assert v["evidence"]["uid"] == 1000
        [f] = j.freezes("sb1")
        assert f["first_violation"] == v["id"] and f["decision_id"] is None
        assert f["requested_at"] == at + 0.001 and f["confirmed_at"] is None
        assert [a["layer"] for a in f["requested_by"]] == ["observer"]
        assert j.sandbox("sb1")["state"] == "frozen"  # type: ignore[index]
    assert not left.exists() and intent_files(state) == []
    with Journal.open(state) as j:  # nothing left to fold twice
        assert len(j.violations("sb1")) == 1 and len(j.freezes("sb1")) == 1


def test_an_intent_already_committed_is_not_folded_again(state: Path) -> None:
    """Committed, then resumed, then the layer died with its file left: folded again, the
    record would open a new freeze for a person (as a fold of a decided violation does,
    below); its token says it is in SQLite already."""
    dead_layer(state, "commit-resume", at=time.time())
    [left] = intent_files(state)
    with Journal.open(state) as j:
        [f] = j.freezes("sb1")
        assert f["decision_id"] is not None
        assert j.sandbox("sb1")["state"] == "running"  # type: ignore[index]
        assert len(j.violations("sb1")) == 1
    assert not left.exists()


def test_a_fold_after_the_violation_was_decided_opens_a_freeze_for_a_person(
    state: Path,
) -> None:
    """The inline layer froze for it and a person resumed; the observer's freeze, from an
    intent written before, landed after that, and it died before its commit. Nobody is
    left to thaw it: the fold opens a freeze for a person to decide, not a join of the
    decided one."""
    at = time.time()
    with Journal.open(state) as j:
        inline = dataclasses.replace(V, layer="inline", at=at)
        _, _, first = j.record_for_freeze("sb1", inline, 2.0, at)
        j.record_decision("sb1", "resume", 0, at + 0.5, "a person")
    dead_layer(state, "no", at=at + 0.0002)
    with Journal.open(state) as j:
        [v] = j.violations("sb1")
        assert {d["layer"] for d in v["detected_by"]} == {"inline", "observer"}
        new, old = j.freezes("sb1")
        assert old["id"] == first and old["decision_id"] is not None
        assert new["decision_id"] is None and new["first_violation"] == v["id"]
        assert [a["layer"] for a in new["requested_by"]] == ["observer"]
        assert j.sandbox("sb1")["state"] == "frozen"  # type: ignore[index]


def test_a_record_sqlite_refused_is_committed_when_tried_again_and_at_close(
    state: Path,
) -> None:
    layer = Journal.open(state, busy_timeout_s=0.05)
    lock = sqlite3.connect(state / "journal.db", isolation_level=None, timeout=0)
    try:
        layer.open_intents()
        refused = []
        for n in range(2):
            v = dataclasses.replace(V, at=V.at + n * 60)
            intent = layer.write_intent("sb1", v, 2.0, v.at)
            assert intent is not None
            lock.execute("BEGIN IMMEDIATE")  # SQLite refuses: busy past the timeout
            with pytest.raises(JournalError, match="locked"):
                layer.record_for_freeze("sb1", v, 2.0, v.at, intent)
            lock.execute("ROLLBACK")
            refused.append(v.at)
            if n == 0:
                assert layer.violations("sb1") == []  # only the file has it, pinned there
                layer.commit_pinned()  # what a layer calls after its next freeze
                assert [v["at"] for v in layer.violations("sb1")] == [V.at]
        assert len(layer.violations("sb1")) == 1  # the second is pinned still
    finally:
        lock.close()
        layer.close()  # commits it
    assert intent_files(state) == []  # both committed: the file went at close
    with Journal.open(state) as j:
        assert sorted(v["at"] for v in j.violations("sb1")) == refused
        assert len(j.freezes("sb1")) == 1  # one open freeze: both joined it


def test_a_sandboxs_retry_commits_its_own_pinned_records_and_no_others(state: Path) -> None:
    """egressd's sandboxes share one journal and intent file: a retry for sb1 (its
    Enforcer's, which freezes sb1 again after each commit) must leave sb2's record
    pinned for sb2's own retry, whose freeze_again is sb2's cgroup."""
    with Journal.open(state) as j:
        j.record_sandbox("sb2", "p")
    layer = Journal.open(state, busy_timeout_s=0.05)
    lock = sqlite3.connect(state / "journal.db", isolation_level=None, timeout=0)
    called: list[str] = []
    try:
        layer.open_intents()
        lock.execute("BEGIN IMMEDIATE")  # SQLite refuses: busy past the timeout
        for sid in ("sb1", "sb2"):
            intent = layer.write_intent(sid, V, 2.0, V.at)
            assert intent is not None
            with pytest.raises(JournalError, match="locked"):
                layer.record_for_freeze(sid, V, 2.0, V.at, intent)
        assert layer.has_pinned("sb1") and layer.has_pinned("sb2")
        assert layer.commit_pinned(False, "sb1", lambda: called.append("busy")) == []
        assert layer.has_pinned("sb1")  # refused again, without a wait: pinned still
        lock.execute("ROLLBACK")
        [done] = layer.commit_pinned(False, "sb1", lambda: called.append("sb1"))
        assert done.freeze_id is not None
        assert called == ["sb1"] and not layer.has_pinned("sb1") and layer.has_pinned("sb2")
        assert [f["sandbox_id"] for f in layer.freezes()] == ["sb1"]
        assert len(layer.commit_pinned(False, "sb2", lambda: called.append("sb2"))) == 1
        assert called == ["sb1", "sb2"] and not layer.has_pinned("sb2")
        assert {f["sandbox_id"] for f in layer.freezes()} == {"sb1", "sb2"}
    finally:
        lock.close()
        layer.close()


def pinned(layer: Journal, lock: sqlite3.Connection, sandbox_id: str, v: Violation) -> None:
    """``v``'s record written to ``layer``'s intent file, its commit refused: pinned."""
    intent = layer.write_intent(sandbox_id, v, 2.0, v.at)
    assert intent is not None
    lock.execute("BEGIN IMMEDIATE")  # SQLite refuses: busy past the timeout
    try:
        with pytest.raises(JournalError, match="locked"):
            layer.record_for_freeze(sandbox_id, v, 2.0, v.at, intent)
    finally:
        lock.execute("ROLLBACK")
    assert layer.has_pinned(sandbox_id)


def test_a_retried_record_of_a_violation_whose_freeze_was_resumed_joins_that_freeze(
    state: Path,
) -> None:
    """The inline layer's commit went through, the observer's (the same violation) was
    refused; a person then resumed the freeze they saw. The retry commits the
    observer's record as its own commit would have: it joins the decided freeze, opens
    none, and asks no freeze again (its Enforcer thaws, if nothing else is open)."""
    layer = Journal.open(state, busy_timeout_s=0.05)
    lock = sqlite3.connect(state / "journal.db", isolation_level=None, timeout=0)
    called: list[str] = []
    try:
        layer.open_intents()
        inline = dataclasses.replace(V, layer="inline")
        vid, _, fid = layer.record_for_freeze("sb1", inline, 2.0, V.at)
        pinned(layer, lock, "sb1", V)
        layer.record_decision("sb1", "resume", 0, V.at + 5, "a person")
        [done] = layer.commit_pinned(False, "sb1", lambda: called.append("again"))
        assert done.violation_id == vid and done.freeze_id is None and called == []
        [freeze] = layer.freezes("sb1")
        assert freeze["id"] == fid and freeze["decision_id"] is not None
        assert {a["layer"] for a in freeze["requested_by"]} == {"inline", "observer"}
        assert layer.sandbox("sb1")["state"] != "frozen"  # type: ignore[index]
        assert layer.decided_freeze(vid) == fid
    finally:
        lock.close()
        layer.close()


def test_a_retry_that_fails_in_its_freeze_again_keeps_the_record_pinned(state: Path) -> None:
    """Whatever the freeze-again raises rolls its commit back, and the record, and those
    after it, stay pinned for the next try: none is dropped, no slot is lost."""
    layer = Journal.open(state, busy_timeout_s=0.05)
    lock = sqlite3.connect(state / "journal.db", isolation_level=None, timeout=0)

    def fails() -> None:
        raise RuntimeError("the cgroup went")

    try:
        layer.open_intents()
        pinned(layer, lock, "sb1", V)
        pinned(layer, lock, "sb1", dataclasses.replace(V, at=V.at + 60))
        with pytest.raises(RuntimeError, match="the cgroup went"):
            layer.commit_pinned(False, "sb1", fails)
        assert layer.has_pinned("sb1") and layer.violations("sb1") == []
        assert len(layer.commit_pinned(False, "sb1")) == 2
        assert not layer.has_pinned("sb1") and len(layer.violations("sb1")) == 2
    finally:
        lock.close()
        layer.close()
    assert intent_files(state) == []  # every slot freed: the file went at close


def test_a_slot_is_freed_once_however_often_its_record_is_said_committed(
    tmp_path: Path,
) -> None:
    """Two threads committing one pinned record (egressd's writers share the file): a
    slot freed twice would be handed to two records, the second overwriting the first."""
    log = intents.IntentLog.create(tmp_path)
    try:
        first = log.write("sb1", {"n": 1})
        assert first is not None
        log.done(first, folded=False)
        [taken] = log.take_pinned()
        assert log.take_pinned() == []  # handed to one caller only
        log.done(taken, folded=True)
        a = log.write("sb1", {"n": 2})
        assert a is not None and a.slot == taken.slot  # free again, and taken
        log.done(taken, folded=True)  # late, for the record that slot held before
        b = log.write("sb1", {"n": 3})
        assert b is not None and a.slot != b.slot
    finally:
        log.close()


def test_a_live_layers_intents_are_not_folded_until_it_has_gone(state: Path) -> None:
    layer = Journal.open(state)
    try:
        layer.open_intents()
        intent = layer.write_intent("sb1", V, 2.0, V.at)
        assert intent is not None
        with Journal.open(state) as other:  # its open folds nothing of the live file
            assert other.fold_intents() == 0
            assert other.violations("sb1") == []
            assert len(intent_files(state)) == 1
    finally:
        layer.close()  # a record not folded: the file stays, unlocked
    assert len(intent_files(state)) == 1
    with Journal.open(state) as j:
        assert len(j.violations("sb1")) == 1
    assert intent_files(state) == []


def test_a_closed_layers_file_and_tokens_go_when_all_is_folded(state: Path) -> None:
    j = Journal.open(state)
    j.open_intents()
    for n in range(3):
        v = dataclasses.replace(V, at=V.at + n * 10)
        intent = j.write_intent("sb1", v, 2.0, v.at)
        assert intent is not None
        assert j.record_for_freeze("sb1", v, 2.0, v.at, intent).freeze_id is not None
        j.record_decision("sb1", "resume", 0, v.at + 1)
    assert len(intent_files(state)) == 1
    j.close()
    assert intent_files(state) == []
    with Journal.open(state) as again:
        assert len(again.violations("sb1")) == 3
    conn = sqlite3.connect(state / "journal.db")
    try:
        assert conn.execute("SELECT token FROM folded_intents").fetchall() == []
    finally:
        conn.close()


def test_a_slot_is_written_again_only_once_its_record_is_committed(tmp_path: Path) -> None:
    log = intents.IntentLog.create(tmp_path)
    try:
        held = [log.write("sb1", {"n": n}) for n in range(intents.SLOTS)]
        assert all(h is not None for h in held)
        assert len({h.slot for h in held if h is not None}) == intents.SLOTS
        assert log.write("sb1", {"n": "one too many"}) is None  # the caller commits first
        first = held[0]
        assert first is not None
        log.done(first, folded=False)  # SQLite refused it: the slot stays taken
        assert log.write("sb1", {"n": "still none"}) is None
        second = held[1]
        assert second is not None
        log.done(second, folded=True)
        again = log.write("sb1", {"n": "again"})
        assert again is not None and again.slot == second.slot
        data = log.path.read_bytes()
        assert [r["n"] for _, r in intents.records(data)][-1] == "again"
        assert {"n": 0} in [{"n": r["n"]} for _, r in intents.records(data)]  # slot 0 kept
    finally:
        assert not log.close()  # slot 0 still pinned: the file stays


def kept_aside(state: Path) -> list[dict[str, Any]]:
    paths = sorted((state / intents.DIR / intents.KEPT).glob("*.jsonl"))
    return [json.loads(line) for p in paths for line in p.read_text().splitlines()]


def test_an_intent_the_journal_cannot_take_is_kept_aside_and_said(
    state: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """One record for a sandbox this journal does not know, one that is not a freeze
    intent this version reads (a newer violation class, after a rollback): neither is
    journaled, both are kept whole for a person, once however often the fold runs."""
    layer = Journal.open(state)
    layer.open_intents()
    assert layer.write_intent("nosuch", V, 2.0, V.at) is not None
    future = {**V.to_json(), "class": "from_a_newer_egress"}
    other = intents.IntentLog.create(state)
    assert other.write("sb1", {"violation": future, "within_s": 2.0, "asked_at": V.at})
    layer.close()
    assert not other.close()  # its record not in SQLite: the file stays
    with Journal.open(state) as j:
        assert j.violations() == []
    err = capfd.readouterr().err
    assert err.count("1 freeze intent(s) not journaled") == 2
    assert "no sandbox 'nosuch'" in err and "not a freeze intent this version reads" in err
    assert intent_files(state) == []
    entries = kept_aside(state)
    by_sandbox = {e["record"]["sandbox_id"]: e for e in entries}
    assert set(by_sandbox) == {"nosuch", "sb1"} and len(entries) == 2
    assert Violation.from_json(by_sandbox["nosuch"]["record"]["violation"]) == V
    assert by_sandbox["sb1"]["record"]["violation"] == future


def test_an_intent_that_cannot_be_kept_aside_stays_in_its_file_and_the_fold_says_why(
    state: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Where the kept file cannot be written (here ``kept`` is a file, not a folder), the
    record stays in its intent file for the next open, and the error names keeping
    aside, not the removal that never ran."""
    layer = Journal.open(state)
    layer.open_intents()
    assert layer.write_intent("nosuch", V, 2.0, V.at) is not None
    layer.close()
    (state / intents.DIR / intents.KEPT).write_text("in the way")
    with Journal.open(state):
        pass
    err = capfd.readouterr().err
    assert "cannot keep aside freeze intents this journal cannot take" in err, err
    assert "cannot remove" not in err
    assert len(intent_files(state)) == 1  # the record is still there
    (state / intents.DIR / intents.KEPT).unlink()
    with Journal.open(state):
        pass
    assert intent_files(state) == [] and len(kept_aside(state)) == 1


def test_kept_records_are_appended_once_each_and_nothing_there_is_rewritten(
    state: Path,
) -> None:
    """The kept file only grows: a record kept again (a fold done again after a crash)
    is there once, another is added, and a line torn by a crash, not UTF-8 or not ours
    stays as it was, while the journal still opens."""
    stem = "123-" + "ab" * 16
    first = {"token": intents.token(stem, 1), "why": "w", "record": {"sandbox_id": "x"}}
    second = {"token": intents.token(stem, 2), "why": "w", "record": {"sandbox_id": "y"}}
    path = intents.keep_aside(state, stem, [first])
    with open(path, "ab") as f:
        f.write(b'{"token": {"not": "a string"}}\n')
        f.write(b'\xff\xfe not json {"token": "' + stem.encode() + b':2"')  # torn, no newline
    threads = [threading.Thread(target=intents.keep_aside, args=(state, stem, [e]))
               for e in (first, second) * 4]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = path.read_bytes().splitlines()
    assert lines[1] == b'{"token": {"not": "a string"}}'  # kept as they were
    assert lines[2].startswith(b"\xff\xfe not json")
    assert [json.loads(line) for line in lines[:1] + lines[3:]] == [first, second]
    with Journal.open(state) as j:
        assert j.violations() == []


def test_a_file_left_half_made_is_removed_once_its_maker_is_gone(state: Path) -> None:
    """Where the filesystem has no O_TMPFILE, an intent file is made under a dot-name
    first; a crash then leaves it. It holds no record: a fold removes it, but not a
    live maker's."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    directory = state / intents.DIR
    directory.mkdir(exist_ok=True)
    dead = directory / f".{gone.stdout.strip()}-{'0' * 32}{intents.SUFFIX}"
    live = directory / f".{os.getpid()}-{'1' * 32}{intents.SUFFIX}"
    for path in (dead, live):
        path.write_bytes(bytes(intents.SLOT))
    with Journal.open(state):
        pass
    assert not dead.exists() and live.exists()
    log = intents.IntentLog.create(state)  # made without a name: no dot-file meanwhile
    try:
        assert sorted(p.name for p in directory.iterdir() if p.is_file()) == sorted(
            [live.name, log.path.name]
        )
    finally:
        log.close()


def test_an_intent_file_has_no_name_until_it_is_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Made with O_TMPFILE: when it is linked to its name, nothing else is in the
    directory (no dot-name a crash could leave), and it holds every slot, zeroed."""
    real_link = os.link
    seen: list[list[str]] = []

    def looked(*args: Any, **kwargs: Any) -> None:
        seen.append(os.listdir(tmp_path / intents.DIR))
        real_link(*args, **kwargs)

    monkeypatch.setattr(intents.os, "link", looked)
    log = intents.IntentLog.create(tmp_path)
    monkeypatch.undo()
    try:
        assert seen == [[]]
        assert log.path.read_bytes() == bytes(intents.SLOT * intents.SLOTS)
    finally:
        assert log.close()


def test_without_o_tmpfile_the_file_is_made_under_a_dot_name_and_named_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem without O_TMPFILE (EOPNOTSUPP): the file is made under a dot-name,
    locked, filled, then linked to its name; the dot-name goes."""
    real_open = os.open

    def no_tmpfile(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(intents.os, "open", no_tmpfile)
    log = intents.IntentLog.create(tmp_path)
    monkeypatch.undo()
    try:
        assert [p.name for p in (tmp_path / intents.DIR).iterdir()] == [log.path.name]
        assert log.path.stat().st_size == intents.SLOT * intents.SLOTS
        intent = log.write("sb1", {"n": 1})
        assert intent is not None
        assert [r for _, r in intents.records(log.path.read_bytes())] == [
            {"sandbox_id": "sb1", "n": 1}
        ]
    finally:
        assert not log.close()


def resumed_freeze(j: Journal) -> int:
    """V's freeze of sb1, which a person resumed: a late sighting of V would thaw it."""
    _, _, resumed = j.record_for_freeze("sb1", V, 2.0, V.at)
    assert resumed is not None
    j.record_decision("sb1", "resume", 0, V.at + 1, "a person")
    return resumed


def test_a_resumed_freeze_is_not_thawed_while_a_freeze_of_its_sandbox_is_in_an_intent(
    state: Path,
) -> None:
    """A late sighting of a violation a person resumed thaws the sandbox where no freeze
    of it is open (thaw_if_resumed). A freeze durable in an intent file and not yet in
    SQLite is open all the same: a live layer's, between its freeze and its commit (or
    refused by SQLite), or a dead layer's, not yet folded. Once SQLite holds it, it is
    decided there like any other."""
    j = Journal.open(state)
    other = Journal.open(state)
    try:
        resumed = resumed_freeze(j)
        thaws: list[str] = []
        other.open_intents()
        newer = dataclasses.replace(V, at=V.at + 60, flow=dataclasses.replace(V.flow, dport=22),
                                    detail="tcp to 203.0.113.9:22")  # fmt: skip
        intent = other.write_intent("sb1", newer, 2.0, newer.at)
        assert intent is not None
        assert not j.thaw_if_resumed(resumed, "inline", lambda: thaws.append("live"))
        other.record_for_freeze("sb1", newer, 2.0, newer.at, intent)
        assert not j.thaw_if_resumed(resumed, "inline", lambda: thaws.append("open"))
        j.record_decision("sb1", "resume", 0, newer.at + 1, "a person")
        assert j.thaw_if_resumed(resumed, "inline", lambda: thaws.append("decided"))
        assert thaws == ["decided"]
        dead_layer(state, "no", at=V.at + 120)  # a flow of its own, killed before its commit
        assert not j.thaw_if_resumed(resumed, "inline", lambda: thaws.append("dead"))
        assert thaws == ["decided"]
    finally:
        other.close()
        j.close()


def test_a_torn_slot_is_skipped_and_the_others_folded(state: Path) -> None:
    layer = Journal.open(state)
    layer.open_intents()
    for n in range(2):
        v = dataclasses.replace(V, at=V.at + n * 10)
        assert layer.write_intent("sb1", v, 2.0, v.at) is not None
    layer.close()
    [path] = intent_files(state)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF  # slot 0's record, as a write torn by a power loss leaves it
    path.write_bytes(bytes(data))
    with Journal.open(state) as j:
        [v] = j.violations("sb1")
        assert v["at"] == V.at + 10


def test_a_resumed_freeze_is_not_thawed_where_the_intents_cannot_be_read(
    state: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Whether an intent of the sandbox is pending can't be told: it stays frozen."""
    with Journal.open(state) as j:
        resumed = resumed_freeze(j)
        (state / intents.DIR).write_bytes(b"not a directory")
        thaws: list[int] = []
        assert not j.thaw_if_resumed(resumed, "inline", lambda: thaws.append(1))
        assert thaws == []
    assert "sandbox sb1 stays frozen for a person to decide" in capfd.readouterr().err


def test_a_refused_record_whose_sandbox_is_gone_from_the_journal_is_kept(
    state: Path,
) -> None:
    """Pinned by a refused commit, then tried again by a journal that does not know its
    sandbox: kept aside, and its slot freed (the file goes at close)."""
    layer = Journal.open(state, busy_timeout_s=0.05)
    lock = sqlite3.connect(state / "journal.db", isolation_level=None, timeout=0)
    try:
        layer.open_intents()
        intent = layer.write_intent("gone", V, 2.0, V.at)
        assert intent is not None
        lock.execute("BEGIN IMMEDIATE")
        with pytest.raises(JournalError, match="locked"):
            layer.record_for_freeze("gone", V, 2.0, V.at, intent)
        lock.execute("ROLLBACK")
        layer.commit_pinned()
        [kept] = kept_aside(state)
        assert kept["token"] == intent.token and "no sandbox 'gone'" in kept["why"]
        assert Violation.from_json(kept["record"]["violation"]) == V
    finally:
        lock.close()
        layer.close()
    assert intent_files(state) == []


def test_a_thaw_looks_again_for_an_intent_written_since_its_first_look(state: Path) -> None:
    """An intent written after the look, whose freeze may have landed before the thaw
    that undid it: the thawer freezes again."""
    j = Journal.open(state)
    other = Journal.open(state)
    try:
        resumed = resumed_freeze(j)
        other.open_intents()
        newer = dataclasses.replace(V, at=V.at + 60, detail="newer")
        done: list[str] = []

        def thaw() -> None:  # meanwhile, the other layer's intent, then its freeze
            assert other.write_intent("sb1", newer, 2.0, newer.at) is not None
            done.append("thaw")

        assert j.thaw_if_resumed(resumed, "inline", thaw, lambda: done.append("again"))
        assert done == ["thaw", "again"]
        assert j.thaw_if_resumed(resumed, "inline", thaw, lambda: done.append("no")) is False
    finally:
        other.close()
        j.close()


def test_a_persons_resume_closes_the_open_freeze_thaws_once_and_marks_it_running(
    state: Path,
) -> None:
    with Journal.open(state) as j:
        _, _, fid = j.record_for_freeze("sb1", V, 2.0, V.at)
        j.set_sandbox_state("sb1", "frozen")
        done: list[str] = []
        why = j.resume("sb1", 1000, V.at + 2, lambda: done.append("thaw"),
                       lambda: done.append("again"), "a person")  # fmt: skip
        assert why is None and done == ["thaw"]
        assert j.sandbox("sb1")["state"] == "running"  # type: ignore[index]
        [decision] = j.decisions("sb1")
        assert decision["uid"] == 1000 and decision["note"] == "a person"
        [freeze] = j.freezes("sb1")
        assert freeze["id"] == fid and freeze["decision_id"] == decision["id"]


def test_a_resume_left_frozen_for_the_other_layers_record_of_it_runs_once_that_thaws(
    state: Path,
) -> None:
    """The resume found the other layer's record of the same violation pending and left
    the sandbox frozen; that layer's commit joins the decided freeze and thaws it
    (thaw_if_resumed), and the journal says running again (what ps and gc read)."""
    j = Journal.open(state)
    other = Journal.open(state)
    try:
        _, _, fid = j.record_for_freeze("sb1", dataclasses.replace(V, layer="inline"), 2.0, V.at)
        j.set_sandbox_state("sb1", "frozen")
        other.open_intents()
        intent = other.write_intent("sb1", V, 2.0, V.at)
        assert intent is not None
        why = j.resume("sb1", 0, V.at + 2, lambda: None, lambda: None)
        assert why == STILL_PENDING
        assert j.sandbox("sb1")["state"] == "frozen"  # type: ignore[index]
        _, _, joined = other.record_for_freeze("sb1", V, 2.0, V.at, intent)
        assert joined is None and fid is not None  # it joined the decided freeze
        thaws: list[str] = []
        assert other.thaw_if_resumed(fid, "observer", lambda: thaws.append("thaw"))
        assert thaws == ["thaw"]
        assert j.sandbox("sb1")["state"] == "running"  # type: ignore[index]
    finally:
        other.close()
        j.close()


def test_a_persons_resume_does_not_thaw_while_a_freeze_of_it_is_in_an_intent(
    state: Path,
) -> None:
    """A layer froze for a newer violation and has not committed it (its record in its
    intent file): the resume closes what the journal holds, and leaves the cgroup frozen
    for that freeze, which then opens for a person."""
    j = Journal.open(state)
    other = Journal.open(state)
    try:
        resumed_freeze(j)
        other.open_intents()
        newer = dataclasses.replace(V, at=V.at + 60, flow=dataclasses.replace(V.flow, dport=22),
                                    detail="tcp to 203.0.113.9:22")  # fmt: skip
        intent = other.write_intent("sb1", newer, 2.0, newer.at)
        assert intent is not None
        done: list[str] = []
        why = j.resume("sb1", 0, newer.at + 1, lambda: done.append("thaw"),
                       lambda: done.append("again"))  # fmt: skip
        assert why == STILL_PENDING and done == []
        assert all(f["decision_id"] is not None for f in j.freezes("sb1"))  # what it saw
        other.record_for_freeze("sb1", newer, 2.0, newer.at, intent)
        opened = [f for f in j.freezes("sb1") if f["decision_id"] is None]
        assert [f["first_violation"] for f in opened] == [j.violations("sb1")[0]["id"]]
    finally:
        other.close()
        j.close()


@pytest.mark.parametrize("through", ["sqlite", "intent"])
def test_a_freeze_journaled_between_a_resume_and_its_thaw_is_frozen_again(
    state: Path, through: str
) -> None:
    """A layer's freeze request committed after the person's decision, whose freeze
    landed before the person's thaw (the thaw would undo it, leaving the workload running
    with a freeze open): looked for after the thaw, under the write lock, and frozen
    again. ``through``: the layer's commit-first path, or an intent written then (still
    pending at the look)."""
    j = Journal.open(state)
    other = Journal.open(state)
    try:
        resumed_freeze(j)
        newer = dataclasses.replace(V, at=V.at + 60, detail="newer")
        other.open_intents()
        done: list[str] = []

        def thaw() -> None:  # meanwhile, the other layer journals a freeze of its own
            if through == "sqlite":
                other.record_for_freeze("sb1", newer, 2.0, newer.at)
            else:
                assert other.write_intent("sb1", newer, 2.0, newer.at) is not None
            done.append("thaw")

        j.set_sandbox_state("sb1", "frozen")
        why = j.resume("sb1", 0, V.at + 30, thaw, lambda: done.append("again"))
        assert why == FROZEN_AGAIN and done == ["thaw", "again"]
        assert j.sandbox("sb1")["state"] == "frozen"  # type: ignore[index]
    finally:
        other.close()
        j.close()


def test_a_resume_whose_look_after_the_thaw_fails_freezes_again(state: Path) -> None:
    """Whether a freeze came in between can't be told (the write lock held past the busy
    timeout): frozen again (fail closed), and the person is told."""
    j = Journal.open(state, busy_timeout_s=0.05)
    lock = sqlite3.connect(state / "journal.db", isolation_level=None, timeout=0)
    try:
        resumed_freeze(j)
        done: list[str] = []

        def thaw() -> None:
            lock.execute("BEGIN IMMEDIATE")
            done.append("thaw")

        with pytest.raises(JournalError, match="locked"):
            j.resume("sb1", 0, V.at + 30, thaw, lambda: done.append("again"))
        assert done == ["thaw", "again"]
    finally:
        lock.close()
        j.close()
