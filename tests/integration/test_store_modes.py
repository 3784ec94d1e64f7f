"""egress's own files are root's and the egress group's only (store.paths): claims,
egressd's records and their directories, made so and, if an older egress left them
looser, narrowed when egress next opens them. The journal's are in test_journal.py.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from egress.daemon.main import _check_reach
from egress.errors import SandboxError
from egress.store import claims, rundir
from egress.store.paths import egress_gid, private_dir, write_private


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "run"
    monkeypatch.setenv("EGRESS_RUN_DIR", str(path))
    return path


def mode_and_group(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return stat.S_IMODE(st.st_mode), st.st_gid


def claim(sandbox_id: str) -> claims.Claim:
    return claims.Claim(id=sandbox_id, index=0, netns=f"egress-{sandbox_id}",
                        host_if=f"eg-{sandbox_id}", uplink_netns=None, owner_pid=1)  # fmt: skip


def test_claims_are_made_0750_and_0640_whatever_the_umask(run: Path) -> None:
    old = os.umask(0)
    try:
        with claims.locked():
            claims.save(claim("c1"))
    finally:
        os.umask(old)
    gid = egress_gid()
    assert mode_and_group(run) == mode_and_group(run / "sandboxes") == (0o750, gid)
    assert mode_and_group(run / "sandboxes" / "c1.json") == (0o640, gid)
    assert mode_and_group(run / "sandboxes" / ".lock") == (0o600, gid)
    assert [c.id for c in claims.load_all()] == ["c1"]


def test_an_older_egress_s_loose_run_dir_is_narrowed_and_a_strict_one_kept(run: Path) -> None:
    (run / "sandboxes").mkdir(parents=True)
    run.chmod(0o777)
    (run / "sandboxes").chmod(0o755)
    (run / "sandboxes" / ".lock").touch(0o666)
    with claims.locked():
        pass
    assert mode_and_group(run) == (0o750, egress_gid())
    assert mode_and_group(run / "sandboxes") == (0o750, egress_gid())
    assert mode_and_group(run / "sandboxes" / ".lock")[0] == 0o640
    (run / "sandboxes").chmod(0o700)  # an administrator's choice: stricter, so kept
    with claims.locked():
        pass
    assert mode_and_group(run / "sandboxes")[0] == 0o700


def test_records_are_0640_and_prepare_narrows_what_an_older_egressd_left(run: Path) -> None:
    records = run / "daemon"
    record = rundir.Record(id="r1", kind="created", netns="n", cgroup="c", policy="secret")
    rundir.save(records, record)
    assert mode_and_group(run) == mode_and_group(records) == (0o750, egress_gid())
    assert mode_and_group(records / "r1.json") == (0o640, egress_gid())
    records.chmod(0o755)
    (records / "r1.json").chmod(0o644)
    (records / "old.json").write_text("{}")
    (records / "old.json").chmod(0o666)
    rundir.prepare(records)
    assert mode_and_group(records)[0] == 0o750
    assert mode_and_group(records / "r1.json")[0] == 0o640
    assert mode_and_group(records / "old.json")[0] == 0o640
    assert rundir.load(records, "r1") == record


def test_a_run_dir_elsewhere_is_made_without_touching_its_parents(tmp_path: Path) -> None:
    parent = tmp_path / "mine"
    parent.mkdir(mode=0o755)
    parent.chmod(0o755)
    private_dir(parent / "egressd")
    assert mode_and_group(parent)[0] == 0o755
    assert mode_and_group(parent / "egressd") == (0o750, egress_gid())


def test_a_crash_s_leftover_tmp_file_does_not_lend_its_mode(tmp_path: Path) -> None:
    leftover = tmp_path / ".r.json.tmp"
    leftover.write_text("half")
    leftover.chmod(0o666)
    write_private(tmp_path / "r.json", b"{}")
    assert mode_and_group(tmp_path / "r.json") == (0o640, egress_gid())
    assert (tmp_path / "r.json").read_bytes() == b"{}"


def test_group_must_be_able_to_reach_a_socket_in_the_run_dir(run: Path) -> None:
    inside = str(run / "egressd.sock")
    _check_reach(inside, 0)
    _check_reach(inside, egress_gid())
    with pytest.raises(SandboxError, match=r"only root and group egress may enter \(0750\)"):
        _check_reach(inside, 4242)
    _check_reach(str(run.parent / "elsewhere" / "egressd.sock"), 4242)  # the operator's
