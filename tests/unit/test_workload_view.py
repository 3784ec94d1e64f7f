"""The parts of the workload's start that are plain functions: uid ranges, the
environment, binds, the view's passwd and the directories made on the way to a mount."""

from __future__ import annotations

from pathlib import Path

import pytest

from egress.errors import UsageError
from egress.sandbox import view, workload
from egress.sandbox.view import Bind, Identity
from egress.store import paths, uids

WHO = Identity("egress-abc123", 2000000007, 2000000007, "/home/egress-abc123", True)


def test_uid_range_default_parses_and_bad_ones_say_how_to_write_them() -> None:
    assert uids.parse_range("2000000000-2000065535") == range(2000000000, 2000065536)
    for bad in ("2000", "a-b", "10-5", "5-10", "2000000000-2147483647"):
        with pytest.raises(UsageError, match="uid range"):
            uids.parse_range(bad)


def test_a_range_overlapping_subordinate_ids_is_refused_with_the_line(tmp_path: Path) -> None:
    subuid = tmp_path / "subuid"
    subuid.write_text("alice:100000:65536\nbob:2000000100:10\n")
    with pytest.raises(UsageError, match=r"subuid:2 \(bob: 2000000100-2000000109\)"):
        uids.check_range(range(2000000000, 2000001000), [str(subuid)])
    uids.check_range(range(2000000000, 2000000100), [str(subuid)])  # just below bob's


def test_pick_skips_held_uids_and_reports_exhaustion(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uids, "live_uids", lambda ids, known: {ids.start + 1} - known)
    monkeypatch.setattr(uids, "check_range", lambda ids: None)
    ids = range(2000000000, 2000000003)
    assert uids.pick(ids, {2000000000}) == 2000000002
    with pytest.raises(UsageError, match="no free uid left in 2000000000-2000000002"):
        uids.pick(ids, {2000000000, 2000000002})


def test_pick_honours_another_run_dirs_ledger_entries_and_skips_only_the_known(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EGRESS_WORKLOADS_DIR", str(tmp_path / "workloads"))
    (tmp_path / "workloads").mkdir()
    monkeypatch.setattr(uids, "live_uids", lambda ids, known: set())
    monkeypatch.setattr(uids, "check_range", lambda ids: None)
    ours, theirs = tmp_path / "run" / "ours.json", tmp_path / "other-run" / "theirs.json"
    for claim in (ours, theirs):
        claim.parent.mkdir()
        claim.write_text("{}")
    ids = range(2000000000, 2000000010)
    uids.record("ours", 2000000000, ours)
    uids.record("theirs", 2000000001, theirs)
    # Ours is known (its uid comes in ``taken``); theirs, of another run dir, is not.
    assert uids.pick(ids, {2000000000}, known={"ours"}) == 2000000002
    assert uids.pick(ids, set(), known={"ours"}) == 2000000000  # skipped: the caller's say
    theirs.unlink()  # their claim went without a teardown: their files still hold it
    assert uids.pick(ids, {2000000000}, known={"ours"}) == 2000000002
    (tmp_path / "workloads" / "theirs" / "uid").unlink()  # their files removed (gc)
    (tmp_path / "workloads" / "theirs").rmdir()
    assert uids.pick(ids, {2000000000}, known={"ours"}) == 2000000001


def test_an_entry_is_orphaned_only_when_its_claim_and_netns_are_both_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only "no such file" counts as gone, for the claim and the netns alike; the ledger
    keeps the claim's path absolute. An orphan's uid stays held until its files go."""
    monkeypatch.setenv("EGRESS_WORKLOADS_DIR", str(tmp_path / "workloads"))
    (tmp_path / "workloads").mkdir()
    netns = tmp_path / "netns"
    netns.mkdir()
    monkeypatch.setattr(paths, "NETNS_DIR", str(netns))  # where claims pin them too
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.chdir(tmp_path)
    for uid, sid in enumerate(("live", "gone", "pinned"), start=2000000001):
        (run / f"{sid}.json").write_text("{}")
        uids.record(sid, uid, Path("run") / f"{sid}.json")  # relative
    # ENOTDIR, not ENOENT: a claim path that can't be looked at is not a claim gone.
    uids.record("unreadable", 2000000010, run / "live.json" / "unreadable.json")
    by_id = {e.sandbox_id: e for e in uids.ledger()}
    assert by_id["live"].claim_file == str(run / "live.json")  # kept absolute
    assert not any(e.orphaned() for e in by_id.values())
    for sid in ("gone", "pinned"):
        (run / f"{sid}.json").unlink()
    (netns / "egress-pinned").write_text("")  # its netns still pinned: it lives
    orphaned = {e.sandbox_id for e in uids.ledger() if e.orphaned()}
    assert orphaned == {"gone"}
    assert uids.ledger_held() == {2000000001, 2000000002, 2000000003, 2000000010}


def test_env_is_the_allowlist_plus_what_env_names() -> None:
    caller = {"PATH": "/usr/bin", "LANG": "C.UTF-8", "LC_ALL": "C", "TERM": "xterm",
              "AWS_SECRET_ACCESS_KEY": "x", "SSH_AUTH_SOCK": "/tmp/ssh", "HOME": "/root",
              "TOKEN": "from-caller"}  # fmt: skip
    extra = workload.resolve_env(["TOKEN", "GIVEN=a=b"], caller)
    env = workload.build_env(WHO, extra, caller)
    assert env == {"PATH": "/usr/bin", "LANG": "C.UTF-8", "LC_ALL": "C", "TERM": "xterm",
                   "HOME": WHO.home, "USER": WHO.name, "LOGNAME": WHO.name,
                   "TOKEN": "from-caller", "GIVEN": "a=b"}  # fmt: skip
    assert workload.build_env(WHO, {}, {})["PATH"] == workload.DEFAULT_PATH


@pytest.mark.parametrize("item", ["1X=1", "A-B=1", "=x", "A B"])
def test_env_with_an_invalid_name_is_refused(item: str) -> None:
    with pytest.raises(UsageError, match="not a variable name"):
        workload.resolve_env([item], {})


def test_env_naming_an_unset_variable_is_refused() -> None:
    with pytest.raises(UsageError, match="not set in egressctl's environment"):
        workload.resolve_env(["MISSING"], {})


def test_env_file_lines_and_errors_name_the_line(tmp_path: Path) -> None:
    good = tmp_path / "good.env"
    good.write_text("# comment\n\nA=1\n  B\nC=x=y\n")
    assert workload.parse_env_file(str(good)) == ["A=1", "B", "C=x=y"]
    bad = tmp_path / "bad.env"
    bad.write_text("A=1\n2B=3\n")
    with pytest.raises(UsageError, match=r"bad.env:2: '2B' is not a variable name"):
        workload.parse_env_file(str(bad))
    with pytest.raises(UsageError, match=r"no-such\.env"):
        workload.parse_env_file(str(tmp_path / "no-such.env"))


def test_bind_specs(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    assert Bind.parse(str(tmp_path / "data"), writable=False) == Bind(
        str(tmp_path / "data"), str(tmp_path / "data"), False
    )
    assert Bind.parse(f"{tmp_path}/data:/mnt/d/", writable=True).dest == "/mnt/d"
    with pytest.raises(UsageError, match="no such file or directory"):
        Bind.parse(str(tmp_path / "nope"), writable=True)
    with pytest.raises(UsageError, match="DEST must be an absolute path"):
        Bind.parse(f"{tmp_path}/data:relative", writable=True)
    for reserved in ("/", "/proc", "/etc/resolv.conf"):
        with pytest.raises(UsageError, match="part of the view"):
            Bind.parse(f"{tmp_path}/data:{reserved}", writable=False)


def test_named_user_is_never_root_and_must_exist() -> None:
    with pytest.raises(UsageError, match="never runs as root"):
        workload.named_user("root")
    with pytest.raises(UsageError, match="no such user"):
        workload.named_user("no-such-user-egress")
    nobody = workload.named_user("nobody")
    assert not nobody.allocated and nobody.home == "/home/nobody"


def test_passwd_and_group_name_the_workload_inside() -> None:
    host = ["root:x:0:0:root:/root:/bin/bash", "alice:x:1000:1000::/home/alice:/bin/bash"]
    text = view.sandbox_passwd(WHO, host)
    assert text.splitlines() == [*host, f"{WHO.name}:x:{WHO.uid}:{WHO.gid}:egress sandbox:"
                                 f"{WHO.home}:/bin/sh"]  # fmt: skip
    alice = Identity("alice", 1000, 1000, "/home/alice-sbx", False)
    assert view.sandbox_passwd(alice, host).splitlines()[1].split(":")[5] == "/home/alice-sbx"
    groups = view.sandbox_group(WHO, ["root:x:0:", f"clash:x:{WHO.gid}:"])
    assert groups.splitlines() == ["root:x:0:", f"{WHO.name}:x:{WHO.gid}:"]


def test_every_directory_above_a_mount_point_is_made_reachable() -> None:
    made: set[str] = set()
    assert view.parents_args("/srv/a/b/data", made) == [
        "--perms", "0755", "--dir", "/srv",
        "--perms", "0755", "--dir", "/srv/a",
        "--perms", "0755", "--dir", "/srv/a/b",
    ]  # fmt: skip
    assert view.parents_args("/srv/a/other", made) == []  # made already
    # The view's own directories are left as they are (/tmp stays 1777).
    assert view.parents_args("/tmp/pytest-of-root/x", set()) == [
        "--perms", "0755", "--dir", "/tmp/pytest-of-root"
    ]  # fmt: skip
    assert view.parents_args("/usr/share/x", set()) == []


def test_the_command_line_confines_before_it_runs_cmd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workload, "tool", lambda name: f"/usr/bin/{name}")
    v = view.View(["--ro-bind", "/usr", "/usr"], "/w", WHO.home)
    argv = workload.command_line("egress-abc123", WHO, ["make", "-j2"], v, "abc123", 7, 8)
    assert argv[:3] == ["/usr/bin/nsenter", "--net=/run/netns/egress-abc123", "--"]
    bwrap = argv[3 : argv.index("--", 4)]
    for flag in ("--unshare-pid", "--unshare-ipc", "--as-pid-1", "--new-session"):
        assert flag in bwrap
    assert bwrap[bwrap.index("--seccomp") + 1] == "7" and bwrap[bwrap.index("--info-fd") + 1] == "8"
    tail = argv[argv.index(workload.SETPRIV) :]
    assert tail[1:3] == [f"--reuid={WHO.uid}", f"--regid={WHO.gid}"]
    assert "--clear-groups" in tail and "--no-new-privs" in tail and "--bounding-set=-all" in tail
    assert tail[-5:] == [workload.TINI, "-g", "--", "make", "-j2"]


def test_the_sandboxs_own_name_is_in_its_hosts_file() -> None:
    text = view.sandbox_hosts("egress-abc123", ["127.0.0.1\tlocalhost"])
    assert text == "127.0.0.1\tlocalhost\n127.0.1.1\tegress-abc123\n::1\tegress-abc123\n"
