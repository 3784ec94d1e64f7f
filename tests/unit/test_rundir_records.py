"""``rundir.Records``: an observer shard's look at egressd's records reads a record again
only when its file was replaced (a swap's new policy, a record removed and made again),
and sees each change at the next look."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from egress.store import rundir


def record(sandbox_id: str, policy: str = "spec: {}\n") -> rundir.Record:
    return rundir.Record(id=sandbox_id, kind="created", netns=f"egress-{sandbox_id}",
                         cgroup="", policy=policy)  # fmt: skip


def test_a_record_is_read_once_until_its_file_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[str] = []
    load = rundir.load
    monkeypatch.setattr(rundir, "load", lambda d, sid: reads.append(sid) or load(d, sid))
    for sid in ("a", "b"):
        rundir.save(tmp_path, record(sid))
    records = rundir.Records(tmp_path)
    assert [r.id for r in records.load_all()] == ["a", "b"] and reads == ["a", "b"]
    assert [r.id for r in records.load_all()] == ["a", "b"] and reads == ["a", "b"]
    # A swap: the same size and, within a timestamp tick, the same time; another file.
    before = os.stat(tmp_path / "a.json")
    swapped = record("a", "spec: []\n")
    rundir.save(tmp_path, swapped)
    os.utime(tmp_path / "a.json", ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(tmp_path / "a.json").st_size == before.st_size
    assert [r.policy_sha256 for r in records.load_all()] == [
        swapped.policy_sha256, record("b").policy_sha256]  # fmt: skip
    assert reads == ["a", "b", "a"]
    rundir.remove(tmp_path, "b")
    (tmp_path / "c.json").write_text("{torn")  # unreadable: skipped, as load_all does
    assert [r.id for r in records.load_all()] == ["a"]
    assert [r.id for r in rundir.load_all(tmp_path)] == ["a"]
    rundir.save(tmp_path, record("b"))  # made again
    assert [r.id for r in records.load_all()] == ["a", "b"]
    # ``fresh``: every one read anew, whatever its file says.
    reads.clear()
    assert [r.id for r in records.load_all(fresh=True)] == ["a", "b"]
    assert reads == ["a", "b", "c"]  # c, torn, is read at every look


def test_no_directory_is_no_records(tmp_path: Path) -> None:
    assert rundir.Records(tmp_path / "none").load_all() == []
