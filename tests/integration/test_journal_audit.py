"""The journal's audit tables (store.audit_sql): batches add up, the cap holds across
AuditLogs (a restarted egressd starts a fresh one), and reads filter by sandbox and time."""

from __future__ import annotations

from pathlib import Path

import pytest

from egress.errors import JournalError
from egress.resolver.audit import AUDIT_CAP, AuditBatch, ConnectRow, NameRow
from egress.store.journal import Journal


@pytest.fixture
def journal(tmp_path: Path) -> Journal:
    j = Journal.open(tmp_path)
    j.record_sandbox("s1", "audit-all")
    j.record_sandbox("s2", "audit-all")
    return j


def test_batches_add_counts_widen_times_and_merge_lists(journal: Journal) -> None:
    journal.record_audit("s1", AuditBatch(
        names=(NameRow("a.test", 1, "allowed", 2, 10.0, 11.0, (), ("b.test",)),),
        connects=(ConnectRow("192.0.2.1", "tcp", 443, "allowed", 1, 10.5, 10.5, ("a.test",)),),
    ))  # fmt: skip
    blocked = ConnectRow("192.0.2.1", "tcp", 443, "blocked_connect", 2, 30.0, 31.0, ("x.test",))
    journal.record_audit("s1", AuditBatch(
        names=(NameRow("a.test", 1, "allowed", 3, 20.0, 25.0, ("rebinding",), ("c.test",)),),
        connects=(blocked,),
    ))  # fmt: skip
    got = journal.audit(["s1"])
    [name] = got["names"]
    assert (name["count"], name["first_seen"], name["last_seen"]) == (5, 10.0, 25.0)
    assert (name["risks"], name["chain"]) == (["rebinding"], ["b.test", "c.test"])
    [conn] = got["connects"]
    assert (conn["count"], conn["verdict"], conn["names"]) == (
        3,
        "blocked_connect",
        ["a.test", "x.test"],
    )
    assert got["overflow"] == {"names": 0, "connects": 0}
    journal.close()


def test_the_cap_holds_in_the_journal_and_what_it_left_out_is_counted(journal: Journal) -> None:
    rows = tuple(NameRow(f"n{i}.test", 1, "allowed", 1, 1.0, 1.0) for i in range(AUDIT_CAP))
    journal.record_audit("s1", AuditBatch(names=rows, over_cap_names=4))
    late = NameRow("late.test", 1, "allowed", 7, 2.0, 2.0)
    again = NameRow("n0.test", 1, "allowed", 1, 3.0, 3.0)
    journal.record_audit("s1", AuditBatch(names=(late, again)))
    got = journal.audit(["s1"])
    assert len(got["names"]) == AUDIT_CAP
    assert "late.test" not in {r["name"] for r in got["names"]}
    assert got["overflow"] == {"names": 4 + 7, "connects": 0}
    journal.close()


def test_reads_filter_by_sandbox_and_last_seen(journal: Journal) -> None:
    journal.record_audit("s1", AuditBatch(names=(NameRow("old.test", 1, "allowed", 1, 1.0, 5.0),)))
    journal.record_audit(
        "s2", AuditBatch(names=(NameRow("new.test", 1, "allowed", 1, 50.0, 60.0),))
    )
    assert journal.audited_sandboxes() == ["s1", "s2"]
    assert journal.audited_sandboxes(since=10.0) == ["s2"]
    assert [r["name"] for r in journal.audit(["s1", "s2"], since=10.0)["names"]] == ["new.test"]
    assert journal.audit(["s1"], since=10.0)["names"] == []
    journal.close()


def test_an_unknown_sandbox_is_refused(journal: Journal) -> None:
    with pytest.raises(JournalError, match="no sandbox 'nope'"):
        journal.record_audit(
            "nope", AuditBatch(names=(NameRow("a.test", 1, "allowed", 1, 1.0, 1.0),))
        )
    journal.close()
