"""Issue 15: `egressd sidecar` as a pod runs it, with no --cgroup (the workload's container
id is the runtime's), beside its observer and a workload in containers of their own.

The pod is built as Kubernetes builds one with shareProcessNamespace: a netns; a pause
process as PID 1 of a PID namespace (with its own /proc) that every container joins; a
cgroup per container under the pod's (pause, sidecar, observer, work). The sidecar and the
observer announce their cgroups in a directory they share (--peers, an emptyDir in the
example manifest); on a violation each finds the workload's cgroup from the processes in
the netns, leaving out PID 1 and the announced cgroups. What must hold: the workload's
cgroup is frozen, never the sidecar's, the observer's or the pause's; the journal names
the cgroup found, and `egressctl resume` thaws it; with two workload containers (no cgroup
holds them both without egress's own) nothing is frozen, it is journaled why, and the
sidecar keeps serving.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from egress.kernel.cgroup import Cgroup
from egress.lab import Lab
from egress.store.journal import Journal
from tests.privileged.test_sidecar import (  # noqa: F401  (uplink: a fixture)
    ALLOWED,
    ALLOWED_IP,
    BLOCKED_IP,
    Box,
    _first_line,
    fetch,
    hand_made,
    policy,
    uplink,
    wait_for,
)
from tests.support import NOBODY, ROOT, SYSTEM_PYTHON
from tests.support.sandboxes import PROBE, policy_file

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

CONTAINERS = ("pause", "sidecar", "observer", "work", "work2")
NOBODY_PRIV = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
               "--inh-caps=-all", "--bounding-set=-all"]  # fmt: skip


@dataclass
class Pod:
    box: Box
    cgroups: dict[str, Cgroup]
    pause: subprocess.Popen[bytes]
    pause_pid: int  # its host pid: what `nsenter -t` joins
    peers: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def enter(self, container: str, argv: list[str]) -> list[str]:
        """``argv`` in the pod's netns, PID namespace and /proc, in ``container``'s cgroup."""
        cg = self.cgroups[container]
        files = [cg.procs_file_v2, cg.procs_file_v1]
        join = "".join(f"echo $$ > {f}; " for f in files if f)
        return ["nsenter", "-t", str(self.pause_pid), "--net", "--pid", "--mount", "--",
                "sh", "-c", join + 'exec "$@"', "sh", *argv]  # fmt: skip

    def start(self, container: str, argv: list[str], err: Path) -> subprocess.Popen[bytes]:
        with open(err, "ab") as f:
            proc = subprocess.Popen(self.enter(container, argv), stdout=subprocess.PIPE,
                                    stderr=f, cwd=ROOT)  # fmt: skip
        self.procs.append(proc)
        return proc


def _child(path: str) -> None:
    os.mkdir(path)


def _rmdir(path: str) -> bool:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


@contextmanager
def pod(box: Box) -> Iterator[Pod]:
    top = box.cgroup
    cgroups: dict[str, Cgroup] = {}
    made: list[str] = []
    peers = Path(tempfile.mkdtemp(prefix="egress-pod-peers-"))
    shutil.copyfile(PROBE, box.dir / "probe.py")  # what the workload containers run
    (box.dir / "probe.py").chmod(0o644)
    pause = None
    try:
        for name in CONTAINERS:
            v2 = os.path.join(top.v2_path, name)
            freezer = os.path.join(top.freezer_path, name) if top.freezer_path else None
            for path in (v2, freezer):
                if path is not None:
                    _child(path)
                    made.append(path)
            cgroups[name] = Cgroup.attach_existing(v2, freezer)
        files = [cgroups["pause"].procs_file_v2, cgroups["pause"].procs_file_v1]
        join = "".join(f"echo $$ > {f}; " for f in files if f)
        pause = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{box.ns}", "unshare", "--pid", "--fork",
             "--mount-proc", "--kill-child", "sh", "-c",
             join + f"mount --bind /etc/netns/{box.ns}/resolv.conf /etc/resolv.conf; "
             "exec sleep 600"],
        )  # fmt: skip

        def paused() -> bool:  # its sh has run mount and exec'd sleep: one process
            pids = cgroups["pause"].pids()
            try:
                return len(pids) == 1 and Path(f"/proc/{pids[0]}/comm").read_text() == "sleep\n"
            except OSError:
                return False

        assert wait_for(paused, 10), "no pause process"
        [pause_pid] = cgroups["pause"].pids()
        p = Pod(box, cgroups, pause, pause_pid, peers)
        try:
            yield p
        finally:
            # SIGTERM to the egress processes themselves (as a runtime stops a container;
            # nsenter, outside the pod's PID namespace, would not pass it on)
            for name in ("sidecar", "observer"):
                for pid in cgroups[name].pids():
                    with suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
            for name in ("sidecar", "observer"):
                assert wait_for(lambda name=name: not cgroups[name].pids(), 30), name
            for proc in p.procs:
                with suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=20)
                if proc.stdout is not None:
                    proc.stdout.close()
            assert not (box.dir / "sidecar.ready").exists()  # not ready once it stopped
    finally:
        for cg in cgroups.values():
            with suppress(Exception):
                cg.thaw()
            with suppress(Exception):
                if cg.pids():
                    cg.kill()
        if pause is not None:
            pause.kill()
            pause.wait(timeout=20)
        for path in reversed(made):  # a cgroup whose last process is still exiting is busy
            assert wait_for(lambda path=path: _rmdir(path), 20), f"{path} stayed busy"
        shutil.rmtree(peers, ignore_errors=True)


def sidecar_in(p: Pod, policy_path: Path, state: Path) -> subprocess.Popen[bytes]:
    ready = p.box.dir / "sidecar.ready"  # what the example pod's startupProbe tests
    argv = [sys.executable, "-m", "egress.daemon.main", "sidecar", "--policy", str(policy_path),
            "--id", p.box.id, "--state-dir", str(state), "--peers", str(p.peers),
            "--ready-file", str(ready)]  # fmt: skip
    proc = p.start("sidecar", argv, p.box.dir / "sidecar.err")
    line = _first_line(proc, 30)
    err = (p.box.dir / "sidecar.err").read_text(errors="replace")
    assert line.startswith(f"egressd sidecar: serving {p.box.id} "), (line, err)
    assert ready.read_text() == f"{p.box.id}\n"
    return proc


def observer_in(p: Pod, policy_path: Path, state: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "egress.cli.main", "observe", "--sandbox", p.box.id,
            "--netns", "/proc/self/ns/net", "--policy", str(policy_path), "--state-dir",
            str(state), "--peers", str(p.peers)]  # fmt: skip
    proc = p.start("observer", argv, p.box.dir / "observer.err")
    line = _first_line(proc, 30)
    err = (p.box.dir / "observer.err").read_text(errors="replace")
    assert line == "ready", (line, err)
    return proc


def workload(p: Pod, container: str, steps: list[dict[str, Any]]) -> subprocess.Popen[str]:
    """The probe as nobody with no capabilities, in ``container``'s cgroup."""
    argv = p.enter(container, [*NOBODY_PRIV, SYSTEM_PYTHON, str(p.box.dir / "probe.py"),
                               json.dumps(steps)])  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> list[dict[str, Any]]:
    out, err = proc.communicate(timeout=timeout)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert rows, err
    return rows


def reached(lab: Lab, ip: str) -> list[dict[str, Any]]:
    """The requests the lab's web server answered on ``ip`` (the probe's tcp op sends one
    once its connect is through)."""
    return [r for r in lab.requests() if r["local"].rsplit(":", 1)[0] == ip]


def record(state: Path, sandbox_id: str) -> dict[str, Any]:
    with Journal.open(state) as journal:
        row = journal.sandbox(sandbox_id)
        assert row is not None
        return {"row": row, "violations": journal.violations(sandbox_id)}


def test_a_pod_sidecar_freezes_the_workloads_cgroup_never_its_own(
    uplink: str,  # noqa: F811  (the fixture)
    lab: Lab,
    state_dir: Path,
) -> None:
    with hand_made(uplink) as box, pod(box) as p:
        path = policy_file(box.dir, policy("pod", "*.any.lab.test"))
        # The agent takes the name the sidecar's lock once had (any process in the netns
        # may bind an abstract socket): the sidecar's lock is a file it cannot reach now.
        squat = (
            "import socket, time; s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)"
            "; s.bind(b'\\0egressd-sidecar'); print('{}', flush=True); time.sleep(60)"
        )
        squatter = subprocess.Popen(p.enter("work", [*NOBODY_PRIV, SYSTEM_PYTHON, "-c", squat]),
                                    stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert squatter.stdout is not None and squatter.stdout.readline() == "{}\n"
        sidecar_in(p, path, state_dir)
        observer_in(p, path, state_dir)
        [allowed] = finish(workload(p, "work", [fetch()]))
        assert allowed["ok"] and allowed["address"] == ALLOWED_IP, allowed
        assert lab.saw(ALLOWED)
        assert reached(lab, ALLOWED_IP)  # the access log sees what gets through
        # A blocked connect: both layers find the workload's cgroup, and freeze it alone.
        lab.clear_requests()
        blocked = workload(p, "work", [{"op": "tcp", "host": BLOCKED_IP, "port": 80, "timeout": 1}])
        try:
            work = p.cgroups["work"]
            assert wait_for(work.is_frozen, 20), (box.dir / "sidecar.err").read_text()
            time.sleep(0.3)  # the other layer's freeze, had it picked another cgroup
            for name in ("pause", "sidecar", "observer", "work2"):
                assert not p.cgroups[name].is_frozen(), name
            seen = record(state_dir, box.id)
            assert seen["row"]["cgroup"] == work.v2_path
            assert seen["row"]["freezer"] == work.freezer_path
            connect = [v for v in seen["violations"] if v["class"] == "blocked_connect"]
            assert connect and connect[0]["evidence"]["flow"]["dst"] == BLOCKED_IP
            resumed = subprocess.run(
                [sys.executable, "-m", "egress.cli.main", "resume", "--state-dir",
                 str(state_dir), box.id], capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            assert resumed.returncode == 0, resumed.stderr
            assert not work.is_frozen()
            finish(blocked)  # resumed, its held connect fails at once
            assert reached(lab, BLOCKED_IP) == []
        finally:
            with suppress(Exception):
                p.cgroups["work"].thaw()
            p.cgroups["work"].kill()
            for proc in (blocked, squatter):
                if proc.returncode is None:  # not yet finished (and read) above
                    proc.kill()
                    proc.communicate(timeout=30)


def test_two_workload_containers_are_not_frozen_and_the_journal_says_why(
    uplink: str,  # noqa: F811  (the fixture)
    lab: Lab,
    state_dir: Path,
) -> None:
    """No cgroup holds both workload containers without egress's own: nothing is frozen
    (a pod's cgroup would freeze the sidecar mid-freeze), and the journal says so."""
    with hand_made(uplink) as box, pod(box) as p:
        path = policy_file(box.dir, policy("pod2", "*.any.lab.test"))
        sidecar_in(p, path, state_dir)
        other = workload(p, "work2", [{"op": "wait_file", "path": "/nonexistent", "timeout": 60}])
        lab.clear_requests()
        blocked = workload(p, "work", [{"op": "tcp", "host": BLOCKED_IP, "port": 80, "timeout": 1}])
        try:
            finish(blocked)

            def journaled() -> bool:
                rows = record(state_dir, box.id)["violations"]
                return any(v["class"] == "blocked_connect" for v in rows)

            assert wait_for(journaled, 20)
            assert not any(cg.is_frozen() for cg in p.cgroups.values())
            err = (box.dir / "sidecar.err").read_text(errors="replace")
            seen = record(state_dir, box.id)
            [v] = [v for v in seen["violations"] if v["class"] == "blocked_connect"]
            assert "also holds egress's own" in json.dumps(v) + err, (v, err)
            assert reached(lab, BLOCKED_IP) == []  # not frozen, but blocked all the same
            [still] = finish(workload(p, "work", [fetch()]))  # the sidecar still serves
            assert still["ok"], still
        finally:  # the probe runs in the pod's PID namespace: ended through its cgroup
            p.cgroups["work2"].kill()
            other.kill()
            other.communicate(timeout=30)


def test_a_workload_forking_in_a_loop_is_still_frozen(
    uplink: str,  # noqa: F811  (the fixture)
    lab: Lab,
    state_dir: Path,
) -> None:
    """A process forked after the netns was listed, and gone before it was looked at
    again, must not make the workload's cgroup look shared (then nothing is frozen):
    shells forking /bin/true as fast as they can while the workload connects."""
    with hand_made(uplink) as box, pod(box) as p:
        path = policy_file(box.dir, policy("pod3", "*.any.lab.test"))
        sidecar_in(p, path, state_dir)
        # 300 idle processes make each look through /proc slower, so a forked one can
        # come and go between two looks; four shells fork as fast as they can.
        idle = [*NOBODY_PRIV, "sh", "-c", "for i in $(seq 300); do sleep 600 & done; wait"]
        loop = [*NOBODY_PRIV, "sh", "-c", "while :; do /bin/true; done"]
        churn = [subprocess.Popen(p.enter("work", idle))]
        assert wait_for(lambda: len(p.cgroups["work"].pids()) > 300, 20)
        churn += [subprocess.Popen(p.enter("work", loop)) for _ in range(4)]
        lab.clear_requests()
        blocked = workload(p, "work", [{"op": "tcp", "host": BLOCKED_IP, "port": 80, "timeout": 1}])
        try:
            assert wait_for(p.cgroups["work"].is_frozen, 20), [
                v["detail"] for v in record(state_dir, box.id)["violations"]
            ]
            assert reached(lab, BLOCKED_IP) == []
        finally:
            with suppress(Exception):
                p.cgroups["work"].thaw()
            p.cgroups["work"].kill()
            for proc in [*churn, blocked]:
                proc.kill()
                proc.communicate(timeout=30)
