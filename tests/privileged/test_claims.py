"""Address claims (store.claims) read from what an earlier create read, with real netns:
a known claim is trusted only while its netns exists, and is read again otherwise."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from egress.datapath.addressing import Pools
from egress.errors import SandboxError
from egress.kernel import netns
from egress.lab import Lab
from egress.policy import parse_policy
from egress.sandbox import lifecycle
from egress.store import claims
from egress.store.paths import netns_name
from tests.support.netns import unique

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

POOLS = Pools.parse("10.99.0.0/27,fd00:99::/60")  # 8 blocks
POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: ids}
spec: {dns: {allow: [allowed.lab.test]}}
"""


@pytest.fixture(params=["listed", "tracked"])
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: Any) -> Iterator[Path]:
    """A run dir of its own, its claims looked at as ``egressctl run`` does (the
    directory listed at each claim) or as egressd does (``track``: its inotify events)."""
    monkeypatch.setenv("EGRESS_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(claims, "_tracked", request.param == "tracked")
    claims._known.forget()
    yield tmp_path / "run"
    claims._known.forget()


def dead_pid() -> int:
    """The pid of a process that has ended and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_known_claim_whose_netns_went_away_with_its_owner_is_released(run: Path) -> None:
    name = unique("cl")
    netns.create_netns(name)
    try:
        orphan = claims.claim("orphan", POOLS, None)
        orphan.netns, orphan.owner_pid = name, dead_pid()  # its netns alone keeps it live
        claims.save(orphan)
        second = claims.claim("second", POOLS, None)  # reads the orphan: live, remembered
        assert second.index == 1 and (run / "sandboxes" / "orphan.json").exists()
    finally:
        netns.remove_netns(name)
    # The file is as it was; only the netns is gone. Trusting what was read before would
    # keep block 0 taken for ever.
    third = claims.claim("third", POOLS, None)
    assert third.index == 0
    assert not (run / "sandboxes" / "orphan.json").exists()


def test_a_rewritten_claim_is_read_again(run: Path) -> None:
    name = unique("cl")
    netns.create_netns(name)
    try:
        first = claims.claim("first", POOLS, None)
        first.netns = name
        claims.save(first)
        assert claims.claim("second", POOLS, None).index == 1  # first remembered, live
        claims.release("second")
        # Another process takes the same file name for another block (the file is
        # replaced, as every save does): its block is the one held now.
        moved = claims.Claim(**{**first.__dict__, "index": 5, "net4": str(POOLS.network(5).net4),
                                "net6": str(POOLS.network(5).net6)})  # fmt: skip
        claims.save(moved)
        assert claims.claim("third", POOLS, None).index == 0
        assert claims.claim("fourth", POOLS, None).index == 1
    finally:
        netns.remove_netns(name)


OTHER = """
import sys
from egress.datapath.addressing import Pools
from egress.store import claims
print(claims.claim(sys.argv[1], Pools.parse("10.99.0.0/27,fd00:99::/60"), None).index, flush=True)
sys.stdin.readline()
claims.release(sys.argv[1])
"""


def test_what_another_process_claims_and_releases_is_seen_at_the_next_claim(run: Path) -> None:
    """Another process's claim, made and given up between two of ours, is what the
    next claim goes around, and then takes (egressd learns it from inotify's events).
    Its netns exists throughout: its claim is live, and only its release says it went."""
    assert claims.claim("a", POOLS, None).index == 0
    assert (claims._known.watch is not None) == claims._tracked
    sid = unique("o").replace("-", "")[-12:]
    try:
        with subprocess.Popen([sys.executable, "-c", OTHER, sid], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) as other:  # fmt: skip
            try:
                assert other.stdout is not None and other.stdin is not None
                assert other.stdout.readline().strip() == "1"
                netns.create_netns(netns_name(sid))  # as its create would
                assert claims.claim("b", POOLS, None).index == 2
                other.stdin.write("\n")
                other.stdin.flush()
                assert other.wait(timeout=60) == 0
            finally:
                if other.poll() is None:
                    other.kill()
        assert claims.claim("c", POOLS, None).index == 1
    finally:
        netns.remove_netns(netns_name(sid))
    assert {c.id: c.index for c in claims.load_all()} == {"a": 0, "b": 2, "c": 1}


def test_a_claim_that_could_not_be_read_is_read_at_the_next_claim(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim file that fails to open (not for its absence) fails the claim, which must
    not hand out what it may hold; the next claim reads it (the events drained by the
    failed one are not lost)."""
    assert claims.claim("a", POOLS, None).index == 0
    held = POOLS.network(1)
    claims.save(claims.Claim(id="f", index=1, netns="egress-f", host_if="eg-f",
                             uplink_netns=None, owner_pid=os.getppid(),
                             net4=str(held.net4), net6=str(held.net6)))  # fmt: skip
    real_open, failed = open, []

    def open_once_failing(path: Any, *args: Any) -> Any:
        if Path(path).name == "f.json" and not failed:
            failed.append(path)
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_open(path, *args)

    monkeypatch.setattr(claims, "open", open_once_failing, raising=False)
    with pytest.raises(SandboxError, match=r"f\.json: Too many open files"):
        claims.claim("b", POOLS, None)
    assert claims.claim("c", POOLS, None).index == 2
    assert failed


def test_a_file_that_is_no_claim_holds_nothing_and_is_read_again(run: Path) -> None:
    assert claims.claim("a", POOLS, None).index == 0
    (run / "sandboxes" / "x.json").write_text("[not a claim")
    assert claims.claim("b", POOLS, None).index == 1
    held = POOLS.network(2)
    (run / "sandboxes" / "x.json").write_text(json.dumps(dict(
        id="x", index=2, netns="egress-x", host_if="eg-x", uplink_netns=None,
        owner_pid=os.getppid(), net4=str(held.net4), net6=str(held.net6))))  # fmt: skip
    assert claims.claim("c", POOLS, None).index == 3


def test_a_run_dir_made_again_is_read_anew(run: Path) -> None:
    assert claims.claim("a", POOLS, None).index == 0
    assert claims.claim("b", POOLS, None).index == 1
    (run / "sandboxes" / "a.json").unlink()
    (run / "sandboxes" / "b.json").rename(run / "b.json")
    (run / "sandboxes" / ".lock").unlink()
    (run / "sandboxes").rmdir()
    (run / "sandboxes").mkdir()
    (run / "b.json").rename(run / "sandboxes" / "b.json")  # b's alone, in a new directory
    assert claims.claim("c", POOLS, None).index == 0
    assert claims.claim("d", POOLS, None).index == 2


def test_a_uid_is_held_while_a_claim_and_its_files_hold_it(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workloads = tmp_path / "workloads"
    monkeypatch.setenv("EGRESS_WORKLOADS_DIR", str(workloads))
    ids = range(2000200000, 2000200010)
    a, b = claims.claim("a", POOLS, None, ids), claims.claim("b", POOLS, None, ids)
    assert (a.uid, b.uid) == (ids[0], ids[1])
    claims.save(a)  # rewritten, as a create does: it holds its uid still, and once
    claims.release("b")
    assert claims.claim("c", POOLS, None, ids).uid == ids[2]  # b's files hold its uid
    shutil.rmtree(workloads / "b")
    assert claims.claim("d", POOLS, None, ids).uid == ids[1]
    claims.release("a")
    shutil.rmtree(workloads / "a")
    assert claims.claim("e", POOLS, None, ids).uid == ids[0]


def test_a_taken_id_is_refused_and_the_claim_holding_it_kept(run: Path) -> None:
    held = claims.claim("same", POOLS, None)
    with pytest.raises(claims.IdTaken, match="same"):
        claims.claim("same", POOLS, None)
    assert [c.index for c in claims.load_all() if c.id == "same"] == [held.index]


def test_create_draws_another_id_for_one_used_before(
    run: Path, lab: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The journal refuses an id it ever recorded, and ids are 24 random bits: over a
    # thousand sandboxes in one state dir a repeat is likely enough to have failed CI.
    drawn = iter(["used01", "live01", "fresh1"])
    monkeypatch.setattr(lifecycle, "new_id", lambda: next(drawn))
    live = claims.claim("live01", POOLS, lab.uplink_netns)
    policy = parse_policy(POLICY, "p.yaml")[0]
    sb = lifecycle.create(policy, POOLS, lab.uplink_netns, None, {"used01"}.__contains__)
    try:
        assert sb.id == "fresh1"
        assert {c.id: c.index for c in claims.load_all()}["live01"] == live.index
    finally:
        try:
            claims.release("live01")  # first: the last sandbox out takes the uplink's table
        finally:
            sb.destroy()


def test_an_id_another_run_dir_uses_on_this_host_is_refused(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Netns names and workload directories are the host's, not a run dir's: another run
    # dir's live sandbox with this id holds them, and a failed create's undo would remove
    # that sandbox's files.
    monkeypatch.setenv("EGRESS_WORKLOADS_DIR", str(tmp_path / "workloads"))
    sid = unique("id").replace("-", "")[-12:]
    netns.create_netns(f"egress-{sid}")
    try:
        with pytest.raises(claims.IdTaken, match="in use on this host"):
            claims.claim(sid, POOLS, None)
    finally:
        netns.remove_netns(f"egress-{sid}")
    (tmp_path / "workloads" / sid).mkdir(parents=True)
    with pytest.raises(claims.IdTaken, match="in use on this host"):
        claims.claim(sid, POOLS, None)
    assert claims.load_all() == []  # nothing claimed by the refusals
