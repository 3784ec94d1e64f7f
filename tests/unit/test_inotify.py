"""store.inotify's DirWatch: the names a directory's changes touched, and the loss of
them (the directory gone) said as such, for good."""

from __future__ import annotations

import os
from pathlib import Path

from egress.store.inotify import DirWatch


def test_names_made_replaced_written_and_removed_are_reported_once(tmp_path: Path) -> None:
    (tmp_path / "kept").write_text("x")
    watch = DirWatch(str(tmp_path))
    try:
        assert watch.changes() == set()
        (tmp_path / ".a.tmp").write_text("1")
        os.replace(tmp_path / ".a.tmp", tmp_path / "a")  # as a save replaces a claim
        (tmp_path / "kept").write_text("y")
        (tmp_path / "gone").write_text("z")
        (tmp_path / "gone").unlink()
        assert watch.changes() == {".a.tmp", "a", "kept", "gone"}
        assert watch.changes() == set()
    finally:
        watch.close()


def test_the_directory_gone_means_read_it_whole_from_then_on(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    watch = DirWatch(str(d))
    try:
        d.rmdir()
        assert watch.changes() is None
        d.mkdir()
        (d / "b").write_text("1")
        assert watch.changes() is None  # the watch was of the old one
    finally:
        watch.close()
