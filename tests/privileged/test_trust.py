"""Issue 12, items 6 and 7, for real: the policy is the operator's, and egress's own files
are root's and the egress group's only.

- `egressctl run` refuses a policy the workload could change, exit 2, one line, and
  makes nothing; a policy it accepts is journaled with the sha256 of its bytes, and so
  is one egressd receives from `egressctl sandbox create` and `set-policy`.
- After a run, nobody (uid 65534, no groups) cannot read a claim, a record or the
  journal (EACCES); with the egress group added, it can.

The egress group is created for the module if the machine lacks it (`make setup` makes
it) and removed afterwards.
"""

from __future__ import annotations

import grp
import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from egress.lab import Lab
from egress.store.journal import Journal
from tests.support import NOBODY, SYSTEM_PYTHON
from tests.support.egressd import egressd
from tests.support.sandboxes import (
    EGRESSCTL,
    cleanup,
    env,
    policy_file,
    refused,
    workdir,
)

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: trusted}
spec:
  dns:
    upstreams: ["198.51.100.53"]
    allow: [allowed.lab.test]
"""
READ = (
    "import sys\n"
    "for p in sys.argv[1:]:\n"
    "    try: open(p, 'rb').read(1)\n"
    "    except PermissionError: sys.exit(13)\n"
)


@pytest.fixture(scope="module")
def egress_group() -> Iterator[int]:
    made = subprocess.run(["getent", "group", "egress"], capture_output=True).returncode != 0
    if made:
        subprocess.run(["groupadd", "--system", "egress"], check=True)
    try:
        yield grp.getgrnam("egress").gr_gid  # not egress_gid(): that is under test
    finally:
        if made:
            subprocess.run(["groupdel", "egress"], check=False)


@pytest.fixture
def base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A run dir and state dir of our own, under a directory nobody may pass through, so
    only egress's own modes decide what it may read."""
    path = Path(tempfile.mkdtemp(prefix="egress-trust-"))
    path.chmod(0o755)
    monkeypatch.setenv("EGRESS_RUN_DIR", str(path / "run"))
    monkeypatch.setenv("EGRESS_STATE_DIR", str(path / "state"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def egressctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EGRESSCTL, *args], capture_output=True, text=True, env=env(),
                          timeout=120)  # fmt: skip


def as_nobody(groups: list[int], *paths: Path) -> int:
    who = ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    argv = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), *who,
            SYSTEM_PYTHON, "-c", READ, *map(str, paths)]  # fmt: skip
    return subprocess.run(argv, timeout=30).returncode


def test_run_refuses_a_group_writable_policy_and_makes_nothing(lab: Lab, base: Path) -> None:
    with workdir() as d:
        bad = policy_file(d, POLICY)
        os.chown(bad, 0, 50 if _has_gid(50) else 100)  # staff or users
        bad.chmod(0o664)
        group = _group_name(bad.stat().st_gid)
        argv = [*EGRESSCTL, "run", "--policy", str(bad), "--uplink-netns", lab.uplink_netns,
                "--", "true"]  # fmt: skip
        code, err, left = refused(argv, env())
    assert code == 2, err
    assert err == f"{bad}: writable by group '{group}' (mode 0664); chmod g-w it\n"
    assert left == []
    journal = base / "state" / "journal.db"
    if journal.exists():  # nothing opened it; if something did, it holds no sandbox
        with Journal.open(base / "state") as j:
            assert j.sandboxes() == []


def test_run_journals_the_sha256_of_the_policy_bytes(lab: Lab, base: Path) -> None:
    with workdir() as d:
        path = policy_file(d, POLICY + "# a comment changes the bytes, not the policy\n")
        report = d / "r.json"
        done = egressctl("run", "--policy", str(path), "--uplink-netns", lab.uplink_netns,
                         "--report", str(report), "--", "true")  # fmt: skip
        assert done.returncode == 0, done.stderr
        data = json.loads(report.read_text())
        sandbox_id, uid = data["sandbox"], data["uid"]
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with Journal.open(base / "state") as j:
        row = j.sandbox(sandbox_id)
    assert row is not None and row["policy_sha256"] == digest and row["uid"] == uid
    text = egressctl("journal", "--sandbox", sandbox_id)
    assert f"sandbox started (policy trusted, sha256 {digest}, uid {uid})" in text.stdout, text
    events = json.loads(egressctl("journal", "--sandbox", sandbox_id, "--json").stdout)
    started = [e for e in events if e["kind"] == "sandbox_started"]
    assert started[0]["record"]["policy_sha256"] == digest


def test_egressd_journals_the_sha256_from_create_and_set_policy(lab: Lab, base: Path) -> None:
    state = base / "state"
    with egressd(state) as daemon, workdir() as d:
        first = policy_file(d, POLICY, "first.yaml")
        second = policy_file(d, POLICY.replace("[allowed.lab.test]", "[mail.lab.test]"),
                             "second.yaml")  # fmt: skip
        sock = ["--daemon", daemon.socket]
        done = egressctl("sandbox", "create", "--policy", str(first), "--uplink-netns",
                         lab.uplink_netns, "--json", *sock)  # fmt: skip
        assert done.returncode == 0, done.stderr
        sandbox_id = json.loads(done.stdout)["id"]
        daemon.made.append(sandbox_id)
        with Journal.open(state) as j:
            row = j.sandbox(sandbox_id)
        assert row is not None
        assert row["policy_sha256"] == hashlib.sha256(first.read_bytes()).hexdigest()
        second.chmod(0o666)
        done = egressctl("sandbox", "set-policy", sandbox_id, "--policy", str(second), *sock)
        assert done.returncode == 2 and "writable by" in done.stderr, done.stderr
        with Journal.open(state) as j:
            assert (j.sandbox(sandbox_id) or {}).get("policy_sha256") == row["policy_sha256"]
        second.chmod(0o644)
        done = egressctl("sandbox", "set-policy", sandbox_id, "--policy", str(second), *sock)
        assert done.returncode == 0, done.stderr
        with Journal.open(state) as j:
            row = j.sandbox(sandbox_id)
        assert row is not None
        assert row["policy_sha256"] == hashlib.sha256(second.read_bytes()).hexdigest()


def test_claims_records_and_the_journal_are_root_and_egress_group_only(
    lab: Lab, base: Path, egress_group: int
) -> None:
    with workdir() as d:
        report = d / "r.json"
        done = egressctl("run", "--keep", "--policy", str(policy_file(d, POLICY)),
                         "--uplink-netns", lab.uplink_netns, "--report", str(report),
                         "--", "true")  # fmt: skip
        assert done.returncode == 0, done.stderr
        kept = json.loads(report.read_text())["sandbox"]
    try:
        with egressd(base / "state") as daemon:
            Path(daemon.dir).chmod(0o755)  # the helper's temp dir: passable, like base
            box = daemon.create(POLICY, lab.uplink_netns)
            claim = base / "run" / "sandboxes" / f"{kept}.json"
            record = daemon.run_dir / f"{box['id']}.json"
            journal = base / "state" / "journal.db"
            for path in (claim, record, journal):
                st = path.stat()
                assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o640, egress_group), path
            for path in (claim.parent, base / "run", daemon.run_dir, journal.parent):
                st = path.stat()
                assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o750, egress_group), path
            for path in (claim, record, journal):
                assert as_nobody([], path) == 13, path  # EACCES
                assert as_nobody([egress_group], path) == 0, path
    finally:
        cleanup(kept)


def _has_gid(gid: int) -> bool:
    return subprocess.run(["getent", "group", str(gid)], capture_output=True).returncode == 0


def _group_name(gid: int) -> str:
    out = subprocess.run(["getent", "group", str(gid)], capture_output=True, text=True).stdout
    return out.split(":")[0]
