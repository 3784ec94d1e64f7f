"""Issue 7: restarting egressd under load (`egressd --replace`) loses no query.

The old egressd hands its sockets to the new one and exits; dnsperf, asking at 1,000
queries a second from inside a sandbox the whole time, must see every query answered.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from egress.daemon import handoff
from egress.errors import DaemonError
from egress.kernel.cgroup import Cgroup
from egress.kernel.nft import NftHandle
from egress.lab import Lab
from egress.store.journal import Journal
from tests.support import NOBODY, ROOT, SYSTEM_PYTHON
from tests.support.dnsperf import dnsperf, figures
from tests.support.egressd import Egressd, egressd
from tests.support.netns import strip_source_check
from tests.support.probes import dig, drain, wait_until

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


def replace(daemon: Egressd) -> subprocess.Popen[bytes]:
    """Start `egressd --replace` on the daemon's socket and run dir; returns the old
    process once the new one serves (the old one is then draining)."""
    old = daemon.proc
    assert old is not None
    # From here the fixture stops whichever of the two serves; the old one exits itself.
    daemon.adopt(daemon.launch("--replace"))
    took = daemon.line()
    serving = daemon.line()
    if "took over from egressd" not in took or " sandboxes on " not in serving:
        old.send_signal(signal.SIGTERM)
        old.wait(timeout=30)
        raise AssertionError(took + serving + daemon.stderr())
    return old


def reload(daemon: Egressd) -> subprocess.Popen[bytes]:
    """SIGHUP (systemd's reload): the same process re-executes, keeping every socket."""
    proc = daemon.proc
    assert proc is not None
    started = time.monotonic()
    proc.send_signal(signal.SIGHUP)
    again = daemon.line()
    serving = daemon.line()
    # Queries wait in the sockets meanwhile (answered late, not lost): dnsperf -t 10.
    print(f"SIGHUP to serving again: {(time.monotonic() - started) * 1000:.0f} ms")
    assert f"re-executed {proc.pid}" in again and "serving 1 sandboxes" in serving, (
        again + serving + daemon.stderr()
    )
    assert proc.poll() is None
    return proc


@pytest.fixture
def daemon(lab: Lab, state_dir: Path) -> Iterator[Egressd]:
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


def _restart_under_load(lab: Lab, daemon: Egressd, how: str) -> None:
    made = daemon.create(POLICY, lab.uplink_netns)
    ns = made["netns"]
    queries = (q for i in itertools.count() for q in (f"q{i}.lag.lab.test A", "allowed.lab.test A"))
    # Fed for as long as the three handovers take (a busy machine takes longer), and at
    # least SECONDS of queries. -b: the answers to what queued during a handover come in
    # one burst, more than the default receive buffer (208 KiB, ~250 replies) holds while
    # dnsperf waits for a CPU: dropped there, they would count as lost.
    options = ["-Q", str(RATE), "-q", "1000", "-t", "10", "-b", "4096"]
    olds = []
    try:
        with dnsperf(ns, queries, *options) as perf:
            while len(olds) < 3:
                time.sleep(0.5)  # let dnsperf run between handovers: that is the load
                olds.append(replace(daemon) if how == "replace" else reload(daemon))
                if how == "replace":
                    assert olds[-1].wait(timeout=10) == 0, daemon.stderr()
            assert perf.running(), "dnsperf ended before the last handover"
            text = perf.finish(at_least=RATE * SECONDS)
    finally:
        for old in olds:
            if old.poll() is None and old is not daemon.proc:
                old.kill()  # it should have exited by itself; the test has failed
                old.wait(timeout=10)
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


def test_a_frozen_sandbox_stays_frozen_across_a_handover(lab: Lab, daemon: Egressd) -> None:
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
        # The adopter tells a later `sandbox exec` the same cgroups to join, the cpu
        # twin too (where the v1 cpu controller is mounted; else None in both).
        assert [shown[k] for k in ("cgroup", "freezer", "cpu")] == [
            made[k] for k in ("cgroup", "freezer", "cpu")
        ]
        daemon.client.call("POST", f"/v1/sandboxes/{made['id']}/kill", {})
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            cg.kill()
            proc.wait(timeout=10)


def test_a_sandbox_made_before_cpu_twins_gets_one_when_adopted(lab: Lab, daemon: Egressd) -> None:
    """An egressd from before the cpu twins left its sandboxes' workloads in the root cpu
    group, where each session the workload starts weighs as much as the layers that must
    freeze it: the adopter makes the twin and moves every process in, those in sessions
    of their own too (forks during the move: test_cgroup's adoption test)."""
    made = daemon.create(POLICY, lab.uplink_netns)
    if made["cpu"] is None:
        pytest.skip("no v1 cpu controller mounted: no cpu twins on this host")
    # As such an egressd left it: its processes in v2 and the freezer only, no twin.
    os.rmdir(made["cpu"])
    cg = Cgroup.attach_existing(made["cgroup"], made.get("freezer"))
    script = "sleep 300 & setsid sleep 300 & wait"  # three processes, two sessions
    proc = subprocess.Popen(
        ["ip", "netns", "exec", made["netns"], "sh", "-c", script],
        preexec_fn=lambda: cg.add_pid(os.getpid()),
    )
    try:
        assert wait_until(lambda: len(cg.pids()) == 3), cg.pids()
        old = replace(daemon)
        assert old.wait(timeout=10) == 0
        shown = daemon.client.call("GET", f"/v1/sandboxes/{made['id']}")
        assert shown["cpu"] == made["cpu"], daemon.stderr()
        moved = {int(p) for p in Path(made["cpu"], "cgroup.procs").read_text().split()}
        assert len(cg.pids()) == 3 and set(cg.pids()) <= moved, daemon.stderr()
        for pid in cg.pids():
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
            assert any(ln.split(":")[2] == f"/egress/{made['id']}" for ln in lines
                       if "cpu" in ln.split(":")[1].split(",")), lines  # fmt: skip
    finally:
        if proc.poll() is None:
            cg.kill()
            proc.wait(timeout=10)


def permanent_neighbours(netns: str, dev: str) -> set[tuple[str, str]]:
    """(address, MAC) of each permanent neighbour entry on ``dev`` in ``netns``."""
    out = subprocess.run(["ip", "-j", "-n", netns, "neigh", "show", "dev", dev, "nud", "permanent"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return {(n["dst"], n["lladdr"]) for n in json.loads(out or "[]")}


def link_mac(netns: str, dev: str) -> str:
    out = subprocess.run(["ip", "-j", "-n", netns, "link", "show", dev],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return str(json.loads(out)[0]["address"])


def test_a_sandbox_made_before_pinned_neighbours_gets_them_when_adopted(
    lab: Lab, daemon: Egressd
) -> None:
    """An egress from before permanent neighbour entries left each end of a sandbox's veth
    to learn the other's addresses by ARP and neighbour discovery: two entries a sandbox
    in the kernel's one table for every netns, whose default bound is 1,024 (past ~500
    such sandboxes the rest reached nothing: test_daemon_scale's 1,000). The adopter
    pins them, in place of what was learned, and the workload still reaches what its
    policy allows through them. A sandbox made now has both ends' MACs set by egress."""
    made = daemon.create(CHECKED, lab.uplink_netns)
    ns, host_if, uplink = made["netns"], f"eg-{made['id']}", lab.uplink_netns
    inside = {(a, link_mac(uplink, host_if)) for a in sandbox_gateways(ns)}
    outside = {(a, link_mac(ns, "eth0")) for a in sandbox_addresses(ns)}
    assert len(inside) == len(outside) == 2  # v4 and v6 each
    assert permanent_neighbours(ns, "eth0") == inside
    assert permanent_neighbours(uplink, host_if) == outside
    for where, dev in ((ns, "eth0"), (uplink, host_if)):  # set by egress: udev leaves them
        path = f"/sys/class/net/{dev}/addr_assign_type"
        kind = subprocess.run(["ip", "netns", "exec", where, "cat", path],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert kind.strip() == "3", (dev, kind)  # NET_ADDR_SET
    # As such an egress left it: learned entries, not pinned (here with a MAC gone stale,
    # which the adopter must put right, not keep).
    for where, dev, pinned in ((ns, "eth0", inside), (uplink, host_if, outside)):
        for address, _ in pinned:
            stale = ["lladdr", "02:00:00:00:00:01", "dev", dev, "nud", "stale"]
            subprocess.run(["ip", "-n", where, "neigh", "replace", address, *stale], check=True)
    assert permanent_neighbours(ns, "eth0") == permanent_neighbours(uplink, host_if) == set()
    old = replace(daemon)
    assert old.wait(timeout=10) == 0
    assert permanent_neighbours(ns, "eth0") == inside, daemon.stderr()
    assert permanent_neighbours(uplink, host_if) == outside, daemon.stderr()
    # The workload's own request, as nobody inside the sandbox: through the pins, and
    # what reached the lab's web server.
    lab.clear_requests()
    argv = [sys.executable, "-m", "egress.cli.main", "sandbox", "exec", "--daemon",
            daemon.socket, "--user", str(NOBODY), made["id"], "--", SYSTEM_PYTHON, "-c",
            FETCH, "allowed.lab.test", "/pinned"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "lab 203.0.113.10:80\n"), done.stderr
    assert [r["path"] for r in lab.requests()] == ["/pinned"]


def test_a_sandbox_made_before_the_source_check_gets_it_when_adopted(
    lab: Lab, daemon: Egressd
) -> None:
    """Under the rules an egress from before the source check loaded, the workload binds
    the lab server's address (IPV6_FREEBIND), sends from it to its own socket over lo,
    and that socket's replies, an established flow, reach the server. The adopter
    renews the rules in one transaction that keeps what the sandbox learned, and
    forgets the conntrack entry of that flow: its next reply is a new flow to an
    address the policy does not allow, which freezes the sandbox, and the server gets
    nothing more."""
    made = daemon.create(CHECKED, lab.uplink_netns)
    ns = made["netns"]
    cg = Cgroup.attach_existing(made["cgroup"], made.get("freezer"))
    exec_argv = [sys.executable, "-m", "egress.cli.main", "sandbox", "exec", "--daemon",
                 daemon.socket, "--user", str(NOBODY), made["id"], "--",
                 SYSTEM_PYTHON, "-c"]  # fmt: skip
    done = subprocess.run([*exec_argv, FETCH, "allowed.lab.test", "/learned"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    learned = allowed_keys(ns)
    assert learned
    strip_source_check(ns)  # as such an egress left it
    with lab.socket(socket.AF_INET6, socket.SOCK_DGRAM, netns=lab.inet_netns) as server:
        server.bind(("2001:db8:80::10", 4445))
        server.setblocking(False)
        proc = subprocess.Popen([*exec_argv, SPOOFED_FLOW], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert wait_until(lambda: drain(server) > 0, 10)  # the hole, as it was
            old = replace(daemon)
            assert old.wait(timeout=10) == 0
            renewed = f"sandbox {made['id']}: rules renewed (an older egress loaded them)"
            assert renewed in daemon.stderr()
            assert allowed_keys(ns) == learned
            drain(server)  # what left before the renewal
            assert wait_until(cg.is_frozen), daemon.stderr()
            daemon.client.call("POST", f"/v1/sandboxes/{made['id']}/kill", {})
            proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
        assert drain(server) == 0
    with Journal.open(daemon.state) as j:
        classes = {v["class"] for v in j.violations(made["id"])}
    assert classes == {"blocked_connect"}


# test_freeze's agent's "spoof-reply", kept up: a reply every 20 ms while it passes.
SPOOFED_FLOW = """
import socket, time
server = ("2001:db8:80::10", 4445)
probe = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); probe.connect(server)
b = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); b.settimeout(5)
b.bind((probe.getsockname()[0], 0))
a = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
a.setsockopt(socket.IPPROTO_IPV6, 78, 1); a.bind(server)
a.sendto(b"x", b.getsockname()[:2])
_, peer = b.recvfrom(10)
while True:
    try: b.sendto(b"spoofed-reply", peer)
    except OSError: pass
    time.sleep(0.02)
"""


def allowed_keys(netns: str) -> set[str]:
    with NftHandle.open(netns) as nft:
        return {str(e["key"]) for name in ("allow4", "allow6")
                for e in nft.list_set("inet", "egress", name)}  # fmt: skip


FETCH = """
import socket, sys
host, path = sys.argv[1], sys.argv[2]
s = socket.create_connection((host, 80), timeout=5)
s.sendall(f"GET {path} HTTP/1.0\\r\\nHost: {host}\\r\\n\\r\\n".encode())
print(s.makefile("rb").read().decode().splitlines()[-1])
"""


def sandbox_addresses(netns: str) -> list[str]:
    """The global addresses of a sandbox's eth0 (v4 and v6)."""
    out = subprocess.run(["ip", "-j", "-n", netns, "addr", "show", "dev", "eth0"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return [a["local"] for a in json.loads(out)[0]["addr_info"] if a.get("scope") == "global"]


def sandbox_gateways(netns: str) -> list[str]:
    """The gateways of a sandbox's default routes (v4 and v6)."""
    gateways = []
    for family in ("-4", "-6"):
        out = subprocess.run(["ip", "-j", family, "-n", netns, "route", "show", "default"],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        gateways += [r["gateway"] for r in json.loads(out)]
    return gateways


def test_a_successor_that_leaves_before_serving_changes_nothing(lab: Lab, daemon: Egressd) -> None:
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
    lab: Lab, daemon: Egressd, tmp_path: Path
) -> None:
    """The successor adopts every sandbox with the handed sockets, then fails (its API
    socket can't be made) and stops: the NFLOG sockets it shared must stay bound, or the
    old egressd, serving on, would never see a blocked connect again."""
    made = daemon.create(POLICY, lab.uplink_netns)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    # Its own --socket, where no socket can be made (later on the line: it wins).
    argv = [*daemon.argv("--replace"), "--socket", str(blocker / "egressd.sock")]
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


def test_the_api_socket_file_goes_with_the_last_egressd(lab: Lab, daemon: Egressd) -> None:
    """The old egressd leaves the socket file to its successor; the last one removes it."""
    old = replace(daemon)
    assert old.wait(timeout=10) == 0
    assert os.path.exists(daemon.socket)
    daemon.stop()
    assert not os.path.exists(daemon.socket)


CHECKED = """
apiVersion: egress/v1
kind: Policy
metadata: {name: checked}
spec:
  dns:
    upstreams: ["198.51.100.53"]
    allow: [allowed.lab.test]
  violations: {blocked_connect: freeze, name_mismatch: block}
"""


def curl(netns: str, *args: str) -> tuple[int, str]:
    argv = ["ip", "netns", "exec", netns, "curl", "-sS", "--max-time", "5", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    return done.returncode, done.stdout


@pytest.mark.parametrize("how", ["replace", "sighup"])
def test_the_first_bytes_queue_is_served_across_a_handover(
    lab: Lab, daemon: Egressd, state_dir: Path, how: str
) -> None:
    """The new egressd reads the NFQUEUE socket the old one handed over: a checked flow
    still passes (without a listener it would hang, the queue failing closed), and one
    that asks the address for another name is still refused."""
    made = daemon.create(CHECKED, lab.uplink_netns)
    ns, url = made["netns"], "http://allowed.lab.test/"
    assert curl(ns, url) == (0, "lab 203.0.113.10:80\n"), daemon.stderr()
    old = replace(daemon) if how == "replace" else reload(daemon)
    try:
        if how == "replace":
            assert old.wait(timeout=10) == 0, daemon.stderr()
        for _ in range(3):
            assert curl(ns, url) == (0, "lab 203.0.113.10:80\n"), daemon.stderr()
        assert curl(ns, "-H", "Host: https.lab.test", url)[0] == 56  # reset at once
    finally:
        if old.poll() is None and old is not daemon.proc:
            old.kill()
            old.wait(timeout=10)
    with Journal.open(str(state_dir)) as journal:
        rows = journal.violations(made["id"])
    assert [v["class"] for v in rows] == ["name_mismatch"], rows


def test_a_cached_address_still_connects_after_egressd_is_killed(
    lab: Lab, daemon: Egressd, state_dir: Path
) -> None:
    """egressd dies (no handover) and the next one adopts the sandbox: it never saw the
    answer that put 203.0.113.10 in the sets, and the workload has it cached. A flow there
    under an allowed name passes until the kernel's element expires; another name is
    still refused. Without the inherited addresses the cached flow would be refused as
    never resolved here."""
    made = daemon.create(CHECKED, lab.uplink_netns)
    ns, url = made["netns"], "http://allowed.lab.test/"
    assert curl(ns, url) == (0, "lab 203.0.113.10:80\n"), daemon.stderr()
    daemon.stop(signal.SIGKILL)
    daemon.start()  # adopts it from the run dir, with nothing handed over
    cached = ("--resolve", "allowed.lab.test:80:203.0.113.10")  # no DNS: the client's cache
    lab.clear_requests()
    for _ in range(2):
        assert curl(ns, *cached, url) == (0, "lab 203.0.113.10:80\n"), daemon.stderr()
    assert curl(ns, *cached, "-H", "Host: https.lab.test", url)[0] == 56  # reset at once
    # What reached the lab's server: the two allowed requests, not the other name's.
    assert [r["host"] for r in lab.requests()] == ["allowed.lab.test"] * 2
    with Journal.open(str(state_dir)) as journal:
        rows = journal.violations(made["id"])
    assert [(v["class"], "[name_not_allowed]" in v["detail"]) for v in rows] == [
        ("name_mismatch", True)
    ], rows
