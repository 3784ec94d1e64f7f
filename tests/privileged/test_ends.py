"""Issue 12, item 10: clean ends.

A sandbox whose `egressctl run` died is removed whole by `egressctl kill` (its observer
layer, the one left, does the teardown run would have done; kill waits for it), and never
one whose owner is alive. `egressctl sandbox exec` into a frozen sandbox is refused at
once, and a command whose sandbox freezes under it says so instead of hanging silently.
Real namespaces, cgroups and egress processes against a lab; every wait is on a condition.
"""

from __future__ import annotations

import fcntl
import http.server
import json
import os
import signal
import socketserver
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from egress.kernel import netns
from egress.kernel.cgroup import Cgroup
from egress.lab import Lab
from egress.store import claims
from egress.store.journal import Journal
from tests.privileged.test_freeze import Run, agent_run, policy
from tests.support import NOBODY, SYSTEM_PYTHON
from tests.support.egressd import Egressd, Lines, egressd
from tests.support.probes import wait_until
from tests.support.sandboxes import EGRESSCTL, cleanup, env, leftovers, policy_file, workdir

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

GONE_S = 30.0  # deadlines are generous: 2 busy vCPUs run other suites meanwhile


def left(sandbox_id: str, uplink: str) -> list[str]:
    """What of the sandbox is still on the machine. egress's parent cgroups are not
    counted: other suites on this machine make and remove sandboxes meanwhile."""
    return [x for x in leftovers(sandbox_id, uplink) if not x.endswith("/egress")]


def gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


def ended(run: Run) -> dict[str, Any]:
    with run.journal() as j:
        row = j.sandbox(run.id) or {}
        kinds = [e["kind"] for e in j.events(run.id)]
        actions = [d["action"] for d in j.decisions(run.id)]
    return {"state": row.get("state"), "ended_at": row.get("ended_at"), "kinds": kinds,
            "actions": actions}  # fmt: skip


def frozen_with_run_dead(run: Run, violation: bool) -> None:
    """SIGKILL `egressctl run` (the inline layer); the observer freezes the sandbox, on
    the loss itself or on a violation made afterwards."""
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait()
    if violation:
        run.go()
    run.wait_frozen(timeout=GONE_S)


@pytest.mark.parametrize("violation", [False, True], ids=["frozen-on-loss", "frozen-after"])
def test_kill_after_run_died_removes_everything(lab: Lab, violation: bool) -> None:
    text = policy(loss="log") if violation else policy()
    with agent_run(lab, text, "connect") as run:
        observer = run.observer_pid()
        frozen_with_run_dead(run, violation)
        workload = run.cgroup.pids()
        assert workload and not gone(observer)
        killed = run.ctl("kill", run.id)
        assert killed.returncode == 0, killed.stderr
        assert f"sandbox {run.id} removed by its observer layer" in killed.stdout, killed
        # kill returned after the teardown: nothing is left, nothing to wait for.
        assert left(run.id, lab.uplink_netns) == []
        assert wait_until(lambda: all(gone(p) for p in [*workload, observer]), GONE_S)
        journal = ended(run)
        assert journal["state"] == "exited" and journal["ended_at"]
        assert journal["actions"] == ["kill"] and "sandbox_ended" in journal["kinds"]
        for argv in (["gc", "--dry-run", run.id], ["gc", "--dry-run"]):
            listed = run.ctl(*argv)
            assert listed.returncode == 0 and run.id not in listed.stdout, listed
        assert "nothing to remove" in run.ctl("gc", "--dry-run", run.id).stdout


def test_kill_racing_gc_leaves_nothing_and_neither_fails(lab: Lab) -> None:
    with agent_run(lab, policy(), "connect") as run:
        frozen_with_run_dead(run, violation=False)
        argvs = [[*EGRESSCTL, "kill", run.id], [*EGRESSCTL, "gc", run.id]]
        procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env()) for a in argvs]  # fmt: skip
        (kill_out, kill_err), (gc_out, gc_err) = (p.communicate(timeout=120) for p in procs)
        said = kill_out + kill_err + gc_out + gc_err
        assert procs[1].returncode == 0, said
        # gc may have ended it before kill looked: that refusal is the only other answer.
        assert procs[0].returncode == 0 or "has ended; nothing to kill" in kill_err, said
        assert "could not remove" not in said and "Traceback" not in said, said
        assert wait_until(lambda: left(run.id, lab.uplink_netns) == [], GONE_S)
        assert wait_until(lambda: ended(run)["state"] == "exited", GONE_S)


def quiet(run: Run) -> bool:
    """Both layers have journaled the one violation and its process: `run` writes
    nothing more (a denied DNS query is one packet; a SYN would be retried)."""
    with run.journal() as j:
        rows = j.violations(run.id)
    layers = {d["layer"] for r in rows for d in r.get("detected_by") or []}
    return len(rows) == 1 and layers == {"inline", "observer"} and bool(rows[0]["process"])


@contextmanager
def kept(lab: Lab) -> Iterator[str]:
    """A sandbox `egressctl run --keep` left (its command done, nothing of it running)."""
    with workdir() as d:
        report = d / "report.json"
        argv = [*EGRESSCTL, "run", "--keep", "--policy", str(policy_file(d, policy())),
                "--uplink-netns", lab.uplink_netns, "--report", str(report),
                "--", "true"]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, env=env(), timeout=120)
        assert done.returncode == 0, done.stderr
        sandbox_id = json.loads(report.read_text())["sandbox"]
    try:
        yield sandbox_id
    finally:
        cleanup(sandbox_id)


def waiting_for(inode: int) -> int:
    """How many processes wait for an flock on this inode (/proc/locks: ``->`` lines)."""
    lines = Path("/proc/locks").read_text().splitlines()
    return sum(1 for x in lines if "-> FLOCK" in x and f":{inode} " in x)


def test_removers_of_one_sandbox_take_turns(lab: Lab) -> None:
    """Two `egressctl gc` of one sandbox while a third remover (this test) holds it: both
    wait, then one removes it and the other finds nothing left; neither fails."""
    with kept(lab) as sid:
        path = claims.sandboxes_dir() / f"{sid}.json"
        fd = os.open(path, os.O_RDONLY)
        procs = []
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # as teardown_claim holds it while it works
            procs = [subprocess.Popen([*EGRESSCTL, "gc", sid], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env())
                     for _ in range(2)]  # fmt: skip
            assert wait_until(lambda: waiting_for(os.fstat(fd).st_ino) == 2, GONE_S)
            assert netns.netns_exists(f"egress-{sid}")  # neither touched anything meanwhile
        finally:
            os.close(fd)
            outs = [p.communicate(timeout=120) for p in procs]
        said = [o + e for o, e in outs]
        assert [p.returncode for p in procs] == [0, 0], said
        assert all(f"sandbox {sid} removed" in x and "could not" not in x for x in said), said
        assert left(sid, lab.uplink_netns) == []


def test_a_piece_that_resists_keeps_the_claim_so_gc_can_finish(lab: Lab) -> None:
    """A cgroup with a child cgroup can't be removed: gc says so and keeps the claim
    (a claim released anyway would leave the cgroup behind, known to nothing)."""
    with kept(lab) as sid:
        child = os.path.join(Cgroup.open(sid).v2_path, "resists")
        os.mkdir(child)
        try:
            first = subprocess.run([*EGRESSCTL, "gc", sid], capture_output=True, text=True,
                                   env=env(), timeout=120)  # fmt: skip
            assert first.returncode == 1 and f"cgroup {sid}" in first.stdout, first
            assert any(c.id == sid for c in claims.load_all())
        finally:
            os.rmdir(child)
        again = subprocess.run([*EGRESSCTL, "gc", sid], capture_output=True, text=True,
                               env=env(), timeout=120)  # fmt: skip
        assert again.returncode == 0 and f"sandbox {sid} removed" in again.stdout, again
        assert left(sid, lab.uplink_netns) == []


def test_kill_with_its_run_alive_leaves_the_teardown_to_run(lab: Lab) -> None:
    with agent_run(lab, policy(name="freeze"), "dns") as run:
        run.go()
        run.wait_frozen(timeout=GONE_S)
        assert wait_until(lambda: quiet(run), GONE_S)
        # Alive, so the owner of its end, but not acting: stopped when it holds no lock.
        os.kill(run.proc.pid, signal.SIGSTOP)
        try:
            killed = run.ctl("kill", run.id)
            assert killed.returncode == 0, killed.stderr
            assert "removed" not in killed.stdout and "gc" not in killed.stderr, killed
            assert run.cgroup.empty()  # kill returns once the workload is gone
            # Ten of the observer's ticks: neither the client nor the observer removes
            # anything of a sandbox whose owner lives.
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                assert netns.netns_exists(f"egress-{run.id}") and os.path.isdir(run.cgroup.v2_path)
                assert any(c.id == run.id for c in claims.load_all())
                time.sleep(0.05)
        finally:
            os.kill(run.proc.pid, signal.SIGCONT)
        rc, report, err = run.finish(timeout=120)
        assert rc == 137 and report["outcome"] == "killed", err
        assert "teardown" in report["timings_ms"]  # run's own
        log = Path(os.environ["EGRESS_STATE_DIR"], f"observer-{run.id}.log").read_text()
        assert "removed" not in log, log
    assert left(run.id, lab.uplink_netns) == []


# -- sandbox exec into egressd's sandboxes ------------------------------------------------

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: ends}
spec:
  dns:
    upstreams: ["198.51.100.53"]
    allow: [allowed.lab.test]
  violations: {blocked_connect: freeze}
"""
# Says it started, waits for a line on stdin, makes a blocked connect (the freeze), and
# once resumed says so and exits 7.
COMMAND = (
    "import socket, sys\nprint('started', flush=True)\nsys.stdin.readline()\n"
    "s = socket.socket(); s.settimeout(5)\n"
    "try: s.connect(('192.0.2.7', 80))\nexcept OSError: pass\n"
    "print('after', flush=True)\nsys.exit(7)"
)


@pytest.fixture(scope="module")
def daemon(lab: Lab, state_dir: Path) -> Iterator[Egressd]:
    with egressd(state_dir) as d:
        yield d


@pytest.fixture
def box(daemon: Egressd, lab: Lab) -> Iterator[dict[str, Any]]:
    made = daemon.create(POLICY, lab.uplink_netns)
    try:
        yield made
    finally:
        cgroup = Cgroup.attach_existing(made["cgroup"], made.get("freezer"))
        with suppress(Exception):
            cgroup.kill()  # the processes a test started in it, by the cgroup they are in
        daemon.delete(made["id"])


def exec_argv(socket: str, sandbox_id: str, *argv: str) -> list[str]:
    return [*EGRESSCTL, "sandbox", "exec", "--daemon", socket, "--user", str(NOBODY),
            sandbox_id, "--", *argv]  # fmt: skip


@contextmanager
def frozen_by_violation(box: dict[str, Any]) -> Iterator[Cgroup]:
    """A process in the sandbox makes a blocked connect; egressd freezes the sandbox."""
    cgroup = Cgroup.attach_existing(box["cgroup"], box.get("freezer"))
    code = (
        "import socket, time\ns = socket.socket(); s.settimeout(2)\n"
        "try: s.connect(('192.0.2.7', 80))\nexcept OSError: pass\ntime.sleep(300)"
    )
    argv = ["ip", "netns", "exec", box["netns"], SYSTEM_PYTHON, "-c", code]
    proc = subprocess.Popen(argv, preexec_fn=lambda: cgroup.add_pid(os.getpid()))
    try:
        assert wait_until(cgroup.is_frozen, GONE_S)
        yield cgroup
    finally:
        with suppress(Exception):
            cgroup.kill()
        proc.kill()
        proc.wait(timeout=30)


def refused_at_once(socket: str, box: dict[str, Any], cgroup: Cgroup) -> None:
    before = sorted(cgroup.pids())
    start = time.monotonic()
    done = subprocess.run(exec_argv(socket, box["id"], "/bin/true"), capture_output=True,
                          text=True, timeout=60, env=env())  # fmt: skip
    took = time.monotonic() - start
    print(f"exec into a frozen sandbox refused in {took:.2f} s")
    sid = box["id"]
    assert done.returncode == 1, done
    assert f"sandbox {sid} is frozen; resume or kill it" in done.stderr, done.stderr
    assert f"egressctl resume {sid}" in done.stderr and f"egressctl kill {sid}" in done.stderr
    assert sorted(cgroup.pids()) == before  # nothing joined it (a hang: the 60 s timeout)


def test_exec_into_a_frozen_sandbox_is_refused_at_once(
    daemon: Egressd, box: dict[str, Any]
) -> None:
    with frozen_by_violation(box) as cgroup:
        refused_at_once(daemon.socket, box, cgroup)


@contextmanager
def stale_egressd(real: Egressd, sandbox_id: str) -> Iterator[str]:
    """A socket answering GET /v1/sandboxes/ID with egressd's answer of a moment ago
    (state "running"): what exec sees when the sandbox freezes right after it asked."""
    answer = real.client.call("GET", f"/v1/sandboxes/{sandbox_id}")
    body = json.dumps({**answer, "state": "running"}).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path == f"/v1/sandboxes/{sandbox_id}"
            self.send_response(200 if ok else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body if ok else b'{"error": "no such sandbox"}')

        def log_message(self, *args: object) -> None:
            pass

    class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True

        def get_request(self) -> tuple[Any, Any]:
            conn, _ = super().get_request()
            return conn, ("stale", 0)  # BaseHTTPRequestHandler wants a (host, port)

    directory = tempfile.mkdtemp(prefix="egress-stale-")
    path = os.path.join(directory, "egressd.sock")
    server = Server(path, Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)
        with suppress(OSError):
            os.unlink(path)
        os.rmdir(directory)


def test_exec_reads_the_kernels_frozen_state_not_only_egressds_answer(
    daemon: Egressd, box: dict[str, Any]
) -> None:
    with frozen_by_violation(box) as cgroup, stale_egressd(daemon, box["id"]) as socket:
        refused_at_once(socket, box, cgroup)


@pytest.mark.parametrize("decision", ["resume", "kill"])
def test_exec_whose_sandbox_freezes_says_so_and_waits_for_the_decision(
    daemon: Egressd, box: dict[str, Any], decision: str
) -> None:
    cgroup = Cgroup.attach_existing(box["cgroup"], box.get("freezer"))
    argv = exec_argv(daemon.socket, box["id"], SYSTEM_PYTHON, "-c", COMMAND)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env())  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out, err = Lines(proc.stdout.fileno()), Lines(proc.stderr.fileno())
    try:
        assert out.next(GONE_S) == "started"
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        told, deadline = "", time.monotonic() + GONE_S
        while "froze" not in told and time.monotonic() < deadline:
            told = err.next(deadline - time.monotonic())  # the first line that says so
        assert f"sandbox {box['id']} froze" in told, (told, daemon.stderr()[-2000:])
        assert f"egressctl resume {box['id']}" in told and f"egressctl kill {box['id']}" in told
        assert cgroup.is_frozen() and proc.poll() is None  # still waiting, not hung up on
        daemon.client.call("POST", f"/v1/sandboxes/{box['id']}/{decision}", {})
        rc = proc.wait(timeout=GONE_S)
        rest_out, rest_err = out.next(5), err.next(5)
        if decision == "resume":
            assert (rc, rest_out) == (7, "after")
        else:
            assert rc == 128 + signal.SIGKILL
        assert "froze" not in rest_err  # said once
    finally:
        if proc.poll() is None:
            cgroup.kill()
            proc.wait(timeout=30)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            pipe.close()


def test_kill_of_an_egressd_sandbox_leaves_it_to_egressd(
    daemon: Egressd, box: dict[str, Any]
) -> None:
    with frozen_by_violation(box):
        killed = subprocess.run([*EGRESSCTL, "kill", box["id"]], capture_output=True,
                                text=True, timeout=60, env=env())  # fmt: skip
        assert killed.returncode == 0, killed.stderr
        assert "removed" not in killed.stdout and "gc" not in killed.stderr, killed
    served = daemon.client.call("GET", f"/v1/sandboxes/{box['id']}")
    assert served["id"] == box["id"] and netns.netns_exists(box["netns"])
    assert os.path.isdir(box["cgroup"]) and any(c.id == box["id"] for c in claims.load_all())
    with Journal.open(daemon.state) as journal:
        assert (journal.sandbox(box["id"]) or {}).get("state") != "exited"
