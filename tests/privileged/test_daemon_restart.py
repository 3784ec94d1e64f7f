"""Issue 7: restarting egressd under load (`egressd --replace`) loses no query.

The old egressd hands its sockets to the new one and exits; dnsperf, asking at 1,000
queries a second from inside a sandbox the whole time, must see every query answered.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from egress.daemon import handoff
from egress.errors import DaemonError
from egress.kernel.cgroup import Cgroup
from egress.lab import Lab
from tests.privileged.daemons import ROOT, Daemon, dig, egressd
from tests.privileged.dnsperf import figures

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: restart}
spec:
  dns:
    upstreams: ["198.51.100.53"]
    allow: ["*.lag.lab.test", allowed.lab.test]
    rate_limit: {qps: 5000, burst: 5000}
  violations: {blocked_connect: freeze}
"""
RATE = 1000
SECONDS = 6
# Half the load asks names the upstream answers 0.2 s late, each name once: at any moment
# ~100 queries wait for their answer, so a handover that dropped what the old egressd
# had sent upstream would lose some.
LAGGING_ZONES = """
zones:
  - zone: lab.test
    ttl: 300
    soa: {mname: ns.lab.test, rname: hostmaster.lab.test, serial: 1, minimum: 60}
    records:
      "@": {NS: ns.lab.test}
      ns: {A: 198.51.100.53}
      allowed: {A: 203.0.113.10}
      "*.lag": {A: 203.0.113.11, delay: 0.2}
"""


def replace(daemon: Daemon) -> subprocess.Popen[str]:
    """Start `egressd --replace` on the daemon's socket and run dir; returns the old
    process once the new one serves (the old one is then draining)."""
    old = daemon.proc
    assert old is not None
    argv = [sys.executable, "-m", "egress.daemon.main", "--replace", "--socket", daemon.socket,
            "--run-dir", str(daemon.run_dir), "--state-dir", str(daemon.state)]  # fmt: skip
    with open(daemon.dir / "stderr", "a") as err:
        new = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
    assert new.stdout is not None
    # From here the fixture stops whichever of the two serves; the old one exits itself.
    daemon.proc = new
    took = new.stdout.readline()
    serving = new.stdout.readline()
    if "took over from egressd" not in took or " sandboxes on " not in serving:
        old.send_signal(signal.SIGTERM)
        old.wait(timeout=30)
        raise AssertionError(took + serving + daemon.stderr())
    return old


def reload(daemon: Daemon) -> subprocess.Popen[str]:
    """SIGHUP (systemd's reload): the same process re-executes, keeping every socket."""
    proc = daemon.proc
    assert proc is not None and proc.stdout is not None
    started = time.monotonic()
    proc.send_signal(signal.SIGHUP)
    again = proc.stdout.readline()
    serving = proc.stdout.readline()
    # Queries wait in the sockets meanwhile (answered late, not lost): dnsperf -t 10.
    print(f"SIGHUP to serving again: {(time.monotonic() - started) * 1000:.0f} ms")
    assert f"re-executed {proc.pid}" in again and "serving 1 sandboxes" in serving, (
        again + serving + daemon.stderr()
    )
    assert proc.poll() is None
    return proc


@pytest.fixture
def daemon(lab: Lab, state_dir: Path) -> Iterator[Daemon]:
    with egressd(state_dir) as d:
        yield d


@pytest.mark.parametrize("how", ["replace", "sighup"])
def test_restart_under_1000_qps_answers_every_query(
    make_lab: Callable[..., Lab], state_dir: Path, tmp_path: Path, how: str
) -> None:
    """`egressd --replace` (a new process takes the sockets over) and SIGHUP (this one
    re-executes with them), each three times while dnsperf asks 1,000 queries/s."""
    zones = tmp_path / "zones.yaml"
    zones.write_text(LAGGING_ZONES)
    lab = make_lab(zones=zones)
    with egressd(state_dir) as daemon:
        _restart_under_load(lab, daemon, how)


def _restart_under_load(lab: Lab, daemon: Daemon, how: str) -> None:
    made = daemon.create(POLICY, lab.uplink_netns)
    ns = made["netns"]
    lagging = [f"q{i}.lag.lab.test A\n" for i in range(RATE * SECONDS)]
    with tempfile.NamedTemporaryFile("w", suffix=".queries", delete=False) as f:
        f.write("".join(f"{q}allowed.lab.test A\n" for q in lagging))
    argv = ["ip", "netns", "exec", ns, "dnsperf", "-s", "127.0.0.53", "-d", f.name,
            "-Q", str(RATE), "-q", "1000", "-l", str(SECONDS), "-t", "10"]  # fmt: skip
    perf = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    olds = []
    try:
        deadline = time.monotonic() + SECONDS - 1.5
        while time.monotonic() < deadline and len(olds) < 3:
            time.sleep(0.5)  # let dnsperf run between handovers: that is the load
            olds.append(replace(daemon) if how == "replace" else reload(daemon))
            if how == "replace":
                assert olds[-1].wait(timeout=10) == 0, daemon.stderr()
        assert perf.poll() is None, "dnsperf ended before the last handover"
        text, _ = perf.communicate(timeout=SECONDS + 30)
    finally:
        os.unlink(f.name)
        for old in olds:
            if old.poll() is None and old is not daemon.proc:
                old.kill()  # it should have exited by itself; the test has failed
                old.wait(timeout=10)
        if perf.poll() is None:
            perf.kill()
            perf.wait(timeout=10)
    got = figures(text)
    print(f"dnsperf: {got}; handovers: {len(olds)}")
    assert len(olds) >= 2, daemon.stderr()
    assert got["lost"] == 0 and got["completed"] == got["sent"] >= RATE * (SECONDS - 1), text
    assert got["rcodes"] == {"NOERROR": str(got["completed"])}, text
    rows = daemon.client.call("GET", "/v1/sandboxes")
    assert [r["id"] for r in rows] == [made["id"]]
    assert dig(ns, "allowed.lab.test") == "203.0.113.10"
    assert ("draining" if how == "replace" else "re-executing") in daemon.stderr()
    assert "serving on" not in daemon.stderr()  # no handover was taken for a failure


def blocked_connect(netns: str, cg: Cgroup) -> subprocess.Popen[bytes]:
    """A connect no policy here allows, from inside the sandbox (the process joins the
    cgroup before it execs, so the connect is the sandbox's own)."""
    script = "import socket; s=socket.socket(); s.settimeout(5); s.connect_ex(('192.0.2.7', 80))"
    return subprocess.Popen(
        ["ip", "netns", "exec", netns, sys.executable, "-c", script],
        preexec_fn=lambda: cg.add_pid(os.getpid()),
    )


def wait_until(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_frozen_sandbox_stays_frozen_across_a_handover(lab: Lab, daemon: Daemon) -> None:
    made = daemon.create(POLICY, lab.uplink_netns)
    cg = Cgroup.attach_existing(made["cgroup"], made.get("freezer"))
    proc = blocked_connect(made["netns"], cg)
    try:
        assert wait_until(cg.is_frozen), daemon.stderr()
        old = replace(daemon)
        try:
            assert old.wait(timeout=10) == 0
        finally:
            if old.poll() is None:
                old.kill()
                old.wait(timeout=10)
        shown = daemon.client.call("GET", f"/v1/sandboxes/{made['id']}")
        assert shown["state"] == "frozen" and cg.is_frozen()
        daemon.client.call("POST", f"/v1/sandboxes/{made['id']}/kill", {})
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            cg.kill()
            proc.wait(timeout=10)


def test_a_successor_that_leaves_before_serving_changes_nothing(lab: Lab, daemon: Daemon) -> None:
    """While its sockets are in flight egressd refuses changes (503) but answers DNS; a
    successor that goes away before it serves leaves egressd serving as before."""
    made = daemon.create(POLICY, lab.uplink_netns)
    taken = handoff.take_over(daemon.run_dir)
    assert taken is not None and set(taken.sandboxes) == {made["id"]}
    try:
        with pytest.raises(DaemonError) as refused:
            daemon.client.call("DELETE", f"/v1/sandboxes/{made['id']}")
        assert refused.value.status == 503, refused.value
        assert dig(made["netns"], "allowed.lab.test") == "203.0.113.10"
    finally:
        taken.close()  # leaves without "serving"
    assert wait_until(lambda: "serving on" in daemon.stderr())
    assert "the successor left before serving; serving on" in daemon.stderr()
    daemon.client.call("DELETE", f"/v1/sandboxes/{made['id']}")
    assert daemon.client.call("GET", "/v1/sandboxes") == []


def test_a_successor_that_fails_after_adopting_leaves_the_inline_layer_bound(
    lab: Lab, daemon: Daemon, tmp_path: Path
) -> None:
    """The successor adopts every sandbox with the handed sockets, then fails (its API
    socket can't be made) and stops: the NFLOG sockets it shared must stay bound, or the
    old egressd, serving on, would never see a blocked connect again."""
    made = daemon.create(POLICY, lab.uplink_netns)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = [sys.executable, "-m", "egress.daemon.main", "--replace",
            "--socket", str(blocker / "egressd.sock"), "--run-dir", str(daemon.run_dir),
            "--state-dir", str(daemon.state)]  # fmt: skip
    failed = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert failed.returncode == 1 and "--socket" in failed.stderr, failed.stderr
    assert wait_until(lambda: "serving on" in daemon.stderr()), daemon.stderr()
    cg = Cgroup.attach_existing(made["cgroup"], made.get("freezer"))
    proc = blocked_connect(made["netns"], cg)
    try:
        assert wait_until(cg.is_frozen), daemon.stderr()  # no observer runs: inline did it
    finally:
        cg.kill()
        proc.wait(timeout=10)


def test_the_api_socket_file_goes_with_the_last_egressd(lab: Lab, daemon: Daemon) -> None:
    """The old egressd leaves the socket file to its successor; the last one removes it."""
    old = replace(daemon)
    assert old.wait(timeout=10) == 0
    assert os.path.exists(daemon.socket)
    daemon.stop()
    assert not os.path.exists(daemon.socket)
