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


def counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids ``rundir.load`` reads from now on, in order."""
    reads: list[str] = []
    load = rundir.load
    monkeypatch.setattr(rundir, "load", lambda d, sid: reads.append(sid) or load(d, sid))
    return reads


def kept(directory: Path, ids: tuple[str, ...]) -> rundir.Records:
    """A reader that has read the records of ``ids`` once."""
    for sid in ids:
        rundir.save(directory, record(sid))
    records = rundir.Records(directory)
    records.load_all()
    return records


def test_a_record_is_read_once_until_its_file_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = counted(monkeypatch)
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


def test_refresh_reads_the_kept_records_anew_a_share_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever their files say, in turn: a swap whose file matches the one read before
    in inode, size and time (as a freed and reused inode could) is found within a turn."""
    records = kept(tmp_path, ("a", "b", "c", "d"))
    reads = counted(monkeypatch)
    assert records.refresh(0.5) is False and reads == ["a", "b"]
    assert records.refresh(0.1) is False and reads == ["a", "b", "c"]  # at least one
    # c's policy swapped, its file's inode, time and size as before: load_all can't tell.
    path = tmp_path / "c.json"
    before = os.stat(path)
    swapped = record("c", "spec: []\n")
    path.write_text(path.read_text().replace(record("c").policy_sha256, swapped.policy_sha256)
                    .replace('"spec: {}\\n"', '"spec: []\\n"'))  # fmt: skip
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    assert [r.policy_sha256 for r in records.load_all()][2] == record("c").policy_sha256
    assert records.refresh(0.5) is False and reads[3:] == ["d", "a"]  # wraps around
    assert records.refresh(0.5) is True and reads[5:] == ["b", "c"]
    assert [r.policy_sha256 for r in records.load_all()][2] == swapped.policy_sha256
    rundir.remove(tmp_path, "d")
    assert records.refresh(1.0) is True  # gone: the caller looks again


def test_a_reader_keeps_only_the_records_it_wants(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for sid in ("a", "b", "c"):
        rundir.save(tmp_path, record(sid))
    reads = counted(monkeypatch)
    records = rundir.Records(tmp_path, lambda sid: sid != "b")
    assert [r.id for r in records.load_all()] == ["a", "c"] and reads == ["a", "c"]
    assert records.refresh(1.0) is False and reads == ["a", "c", "a", "c"]


def test_no_directory_is_no_records(tmp_path: Path) -> None:
    assert rundir.Records(tmp_path / "none").load_all() == []


def test_refresh_goes_on_after_the_last_name_it_read_as_records_come_and_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its turn is a name, not a position: a record removed before it makes none skip
    theirs, and one made before it waits for the next round."""
    records = kept(tmp_path, ("b", "c", "d", "e"))
    reads = counted(monkeypatch)
    records.refresh(0.5)
    assert reads == ["b", "c"]
    rundir.remove(tmp_path, "b")
    records.load_all()
    records.refresh(0.25)
    assert reads == ["b", "c", "d"]  # by position (the third) it would be "e"
    rundir.save(tmp_path, record("a"))
    records.load_all()
    reads.clear()
    records.refresh(0.5)
    assert reads == ["e", "a"]  # a, made before the turn, has its turn at the wrap
