"""Issue 7 item 4: `egressd sidecar`, inside a netns and beside a cgroup made by hand.

Each test makes a netns as another runtime would (``ip netns add``, a veth to the lab's
uplink netns, a default route, resolv.conf naming 127.0.0.53) and mkdirs a cgroup; the
sidecar runs inside the netns (``nsenter --net``, as a container runtime enters one); the
workload runs there too (``ip netns exec``), in the cgroup, as nobody with no capabilities.
Each test removes its netns (the veth goes with it), /etc/netns entry, cgroups and
processes, also on failure.
"""

from __future__ import annotations

import difflib
import itertools
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from egress.datapath import constants as c
from egress.datapath.render import Sidecar, render_sandbox
from egress.kernel.cgroup import Cgroup, find_mounts
from egress.kernel.netns import in_netns
from egress.kernel.nft import NftHandle
from egress.lab import Lab
from egress.policy import load_policy
from egress.sandbox import uplink as uplink_mod
from egress.store.journal import Journal
from egress.store.paths import read_template
from tests.support import NOBODY, ROOT, SYSTEM_PYTHON
from tests.support.netns import scratch_netns, unique
from tests.support.sandboxes import policy_file, workdir
from tests.support.sched import policies, tasks_under

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

SIDECAR = [sys.executable, "-m", "egress.daemon.main", "sidecar"]
POLICIES = sorted(ROOT.joinpath("policies").glob("*.yaml"))
POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {{name: {name}}}
spec:
  dns:
    upstreams: ["198.51.100.53"]
    allow: [{names}]
  connect:
    ports: [80, 8081]
  violations: {{blocked_connect: freeze, foreign_dns: block, denied_name: block}}
"""
ALLOWED, ALLOWED_IP = "ip-198-19-1-2.any.lab.test", "198.19.1.2"  # the lab's AnyIP, port 8081
BLOCKED_IP = "198.51.100.12"  # a lab HTTP server no policy here allows
_veth = itertools.count(1)
# As root without CAP_NET_ADMIN/CAP_NET_RAW there is nothing to gain; nobody is the workload.
MARK_CODE = """
import errno, json, socket, struct
out = {}
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", %d))
try:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, %d)
    out["mark"] = "set"
except OSError as e:
    out["mark"] = errno.errorcode[e.errno]
q = struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0) + b"%s" + struct.pack("!HH", 1, 1)
s.settimeout(1)
try:
    s.sendto(q, ("%s", 53))
    s.recv(512)
    out["direct"] = "answered"
except OSError as e:
    out["direct"] = errno.errorcode.get(e.errno or 0, "TIMEOUT")
print(json.dumps(out))
"""


def policy(name: str, *names: str) -> str:
    return POLICY.format(name=name, names=", ".join(json.dumps(n) for n in names))


@dataclass
class Box:
    ns: str
    cgroup: Cgroup
    dir: Path  # readable by nobody: probe.py, policy files, the sidecar's stderr
    id: str


@pytest.fixture(scope="module")
def uplink(lab: Lab) -> Iterator[str]:
    """The lab's uplink, forwarding and masquerading eg-* veths (as for egress's own
    sandboxes): the hand-made netns reaches the lab DNS and HTTP servers through it."""
    uplink_mod.attach(lab.uplink_netns)
    try:
        yield lab.uplink_netns
    finally:  # as the last sandbox would: forwarding put back, the table removed
        uplink_mod.detach(lab.uplink_netns, "no-claim")


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=20)


@contextmanager
def hand_made(uplink: str) -> Iterator[Box]:
    name = unique("sc")
    host_if = f"eg-t{os.getpid() % 10000}{next(_veth)}"[:15]
    mounts = find_mounts()
    assert mounts.v2 is not None
    v2 = os.path.join(mounts.v2, name)
    freezer = os.path.join(mounts.freezer, name) if mounts.freezer else None
    etc = Path("/etc/netns") / name
    made: list[str] = []
    with workdir() as d:
        try:
            _run("ip", "netns", "add", name)
            made.append("netns")
            _run("ip", "-n", uplink, "link", "add", host_if, "type", "veth",
                 "peer", "name", "eth0", "netns", name)  # fmt: skip
            _run("ip", "-n", uplink, "addr", "add", "10.213.0.1/30", "dev", host_if)
            _run("ip", "-n", uplink, "link", "set", host_if, "up")
            uplink_mod.attach(uplink, host_if)  # forwarding on for this veth's host end
            for cmd in (
                ["addr", "add", "10.213.0.2/30", "dev", "eth0"],
                ["link", "set", "eth0", "up"],
                ["link", "set", "lo", "up"],
                ["route", "add", "default", "via", "10.213.0.1"],
            ):
                _run("ip", "-n", name, *cmd)
            etc.mkdir(parents=True)
            (etc / "resolv.conf").write_text("nameserver 127.0.0.53\n")
            for path in (v2, freezer):
                if path is not None:
                    os.mkdir(path)
                    made.append(path)
            yield Box(name, Cgroup.attach_existing(v2, freezer), d, name.replace(".", "-"))
        finally:
            _remove(name, v2, freezer, etc, made)


def _remove(name: str, v2: str, freezer: str | None, etc: Path, made: list[str]) -> None:
    if v2 in made:
        cgroup = Cgroup.attach_existing(v2, freezer if freezer in made else None)
        with suppress(Exception):
            cgroup.thaw()
        with suppress(Exception):
            if cgroup.pids():
                cgroup.kill()
        for path in (freezer, v2):
            if path in made:
                with suppress(OSError):
                    os.rmdir(path)
    shutil.rmtree(etc, ignore_errors=True)
    if "netns" in made:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
    assert not os.path.exists(f"/run/netns/{name}") and not os.path.exists(v2)


# -- the sidecar ---------------------------------------------------------------------------


def sidecar_argv(
    box: Box,
    policy_path: Path,
    state: Path,
    *extra: str,
    enter: str = "nsenter",
    wrapper: tuple[str, ...] = (),
) -> list[str]:
    """The sidecar in the box's netns, entered as a container runtime would (nsenter: the
    netns only; `ip netns exec` would also hide the cgroup filesystems, see below), run
    by ``wrapper`` (e.g. chrt) there."""
    into = [f"--net=/run/netns/{box.ns}"] if enter == "nsenter" else ["netns", "exec", box.ns]
    argv = [enter, *into, *wrapper, *SIDECAR, "--policy", str(policy_path), "--cgroup",
            box.cgroup.v2_path, "--id", box.id, "--state-dir", str(state)]  # fmt: skip
    if box.cgroup.freezer_path:
        argv += ["--freezer", box.cgroup.freezer_path]
    return argv + list(extra)


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    ready: str  # its "serving" line
    ready_ms: float  # from exec to that line

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


def _first_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    data, deadline = b"", time.monotonic() + timeout
    while b"\n" not in data and time.monotonic() < deadline:
        if sel.select(max(deadline - time.monotonic(), 0)):
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            data += chunk
    sel.close()
    return data.decode(errors="replace").split("\n", 1)[0]


@contextmanager
def sidecar(
    box: Box, policy_path: Path, state: Path, *extra: str, wrapper: tuple[str, ...] = ()
) -> Iterator[Running]:
    """A running sidecar (killed on the way out if the test did not stop it)."""
    start = time.monotonic()
    with open(box.dir / "sidecar.err", "ab") as err:
        proc = subprocess.Popen(sidecar_argv(box, policy_path, state, *extra, wrapper=wrapper),
                                stdout=subprocess.PIPE, stderr=err, cwd=ROOT)  # fmt: skip
    try:
        line = _first_line(proc, 30)
        ms = (time.monotonic() - start) * 1e3
        errors = (box.dir / "sidecar.err").read_text(errors="replace")
        assert line.startswith(f"egressd sidecar: serving {box.id} "), (line, errors)
        yield Running(proc, line, ms)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def refused(box: Box, policy_path: Path, state: Path, *extra: str, enter: str = "nsenter") -> str:
    """A sidecar start that must fail: its stderr."""
    done = subprocess.run(sidecar_argv(box, policy_path, state, *extra, enter=enter),
                          capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert done.returncode == 1 and "serving" not in done.stdout, (done.stdout, done.stderr)
    return done.stderr


# -- the workload ---------------------------------------------------------------------------


def workload_argv(box: Box, argv: list[str], caps: str = "-all") -> list[str]:
    """``argv`` as nobody without capabilities (``caps``: setpriv's inheritable and ambient
    set), in the box's netns and cgroup (the shell joins it before anything runs)."""
    procs = [box.cgroup.procs_file_v2, box.cgroup.procs_file_v1]
    join = "".join(f"echo $$ > {p}; " for p in procs if p)
    drop = ["--bounding-set=-all"] if caps == "-all" else [f"--ambient-caps={caps}"]
    priv = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
            f"--inh-caps={caps}", *drop]  # fmt: skip
    return ["sh", "-c", join + 'exec "$@"', "sh", "ip", "netns", "exec", box.ns, *priv, *argv]


def probe(box: Box, steps: list[dict[str, Any]], timeout: float = 60) -> list[dict[str, Any]]:
    argv = workload_argv(box, [SYSTEM_PYTHON, str(box.dir / "probe.py"), json.dumps(steps)])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        # A frozen probe holds its pipes open and ignores signals: killed through its
        # cgroup, or communicate() would wait for it forever.
        frozen = box.cgroup.is_frozen()
        box.cgroup.kill()
        proc.kill()
        proc.communicate(timeout=30)
        raise AssertionError(f"the probe did not finish in {timeout} s (frozen: {frozen})") from exc
    out = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert len(out) == len(steps), stderr
    return out


def direct_query(
    box: Box, server: str, name: str, caps: str = "-all", port: int = 0
) -> dict[str, str]:
    """The workload (nobody) tries SO_MARK, then asks ``server`` directly, from source
    ``port`` (0: any)."""
    wire = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    code = MARK_CODE % (port, c.SIDECAR_MARK, "".join(f"\\x{b:02x}" for b in wire), server)
    argv = workload_argv(box, [SYSTEM_PYTHON, "-c", code], caps)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def sidecar_like_query(box: Box, server: str, name: str) -> int:
    """A query as the sidecar sends it (root, marked) from inside the netns; returns its
    source port, whose conntrack entry is now established."""
    wire = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    query = struct.pack("!HHHHHH", 9, 0x0100, 1, 0, 0, 0) + wire + struct.pack("!HH", 1, 1)
    with in_netns(box.ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, c.SIDECAR_MARK)
        s.settimeout(2)
        s.sendto(query, (server, 53))
        s.recv(512)
        return int(s.getsockname()[1])


def fetch(name: str = ALLOWED, port: int = 8081) -> dict[str, Any]:
    return {"op": "fetch", "name": name, "port": port, "timeout": 2}


def dns(name: str, server: str = c.RESOLVER4) -> dict[str, Any]:
    return {"op": "dns", "name": name, "server": server}


# -- what the kernel holds ----------------------------------------------------------------


def table(ns: str) -> bool:
    with NftHandle.open(ns) as nft:
        return nft.table_exists("inet", c.TABLE)


def set_ips(ns: str) -> set[str]:
    with NftHandle.open(ns) as nft:
        return {e["key"].split(" . ")[0] for e in nft.list_set("inet", c.TABLE, "allow4")}


def ruleset(ns: str) -> str:
    argv = ["ip", "netns", "exec", ns, "nft", "-s", "-t", "list", "ruleset"]  # no counts, elements
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def snapshot(ns: str) -> list[str]:
    ip = ["ip", "-n", ns]
    out = [ruleset(ns)]
    for argv in ([*ip, "link"], [*ip, "addr"], [*ip, "route"]):
        out.append(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)
    return out


def wait_for(check: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return bool(check())


def journaled(state: Path, sandbox_id: str) -> list[dict[str, Any]]:
    with Journal.open(state) as journal:
        return journal.violations(sandbox_id)


# -- tests ------------------------------------------------------------------------------------


def test_sidecar_resolves_blocks_and_freezes_from_inside_the_netns(
    uplink: str, lab: Lab, state_dir: Path
) -> None:
    with (
        hand_made(uplink) as box,
        sidecar(box, policy_file(box.dir, policy("sc", "*.any.lab.test")), state_dir) as running,
    ):
        print(f"sidecar start-to-ready {running.ready_ms:.0f} ms: {running.ready}")
        lab.clear_queries()
        allowed, denied, cached = probe(box, [fetch(), dns("denied.lab.test"), dns(ALLOWED)])
        # Resolved through 127.0.0.53 (the sidecar asked upstream from this very netns),
        # and connectable at once: the address was in allow4 before the answer came.
        assert allowed["ok"] and allowed["address"] == ALLOWED_IP, allowed
        assert lab.saw(ALLOWED) and cached["ok"] and cached["ancount"] == 1
        ms = {step["op"]: round(step["elapsed"] * 1e3, 1) for step in (allowed, cached)}
        print(f"resolve+connect / cached query, as the probe saw them: {ms}")
        assert denied["ok"] and denied["rcode"] in (3, 5) and denied["ancount"] == 0, denied
        assert not lab.saw("denied.lab.test")  # a denied query never leaves
        # The workload can't use the sidecar's exception: unmarked, its query to the
        # upstream is dropped; it may not set the mark; with CAP_NET_RAW it could set it,
        # but its packets are still not the sidecar's uid.
        plain = direct_query(box, lab.dns4, "direct1.lab.test")
        assert plain == {"mark": "EPERM", "direct": "EPERM"}, plain
        raw = direct_query(box, lab.dns4, "direct2.lab.test", caps="+net_raw")
        assert raw["mark"] == "set" and raw["direct"] == "EPERM", raw
        assert not lab.saw("direct1.lab.test") and not lab.saw("direct2.lab.test")
        # Nor by riding a flow the sidecar opened: a marked query of the sidecar's uid
        # leaves an established conntrack entry; the workload binds the same port.
        port = sidecar_like_query(box, lab.dns4, "ct-seed.lab.test")
        reuse = direct_query(box, lab.dns4, "direct3.lab.test", port=port)
        assert reuse["direct"] == "EPERM", reuse
        assert lab.saw("ct-seed.lab.test") and not lab.saw("direct3.lab.test")
        # A blocked connect freezes the cgroup, journaled by the sidecar's inline layer.
        step = [{"op": "tcp", "host": BLOCKED_IP, "port": 80, "timeout": 1}]
        argv = workload_argv(box, [SYSTEM_PYTHON, str(box.dir / "probe.py"), json.dumps(step)])
        worker = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert wait_for(box.cgroup.is_frozen), "the blocked connect did not freeze"
            rows = journaled(state_dir, box.id)
            connect = [v for v in rows if v["class"] == "blocked_connect"]
            assert connect and connect[0]["layer"] == "inline"
            assert connect[0]["evidence"]["flow"]["dst"] == BLOCKED_IP
            # The person's side, with no egressd: egressctl finds the cgroup (and the v1
            # freezer) the sidecar was given from the journal and thaws both.
            resumed = subprocess.run(
                [sys.executable, "-m", "egress.cli.main", "resume", "--state-dir",
                 str(state_dir), box.id], capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            assert resumed.returncode == 0, resumed.stderr
            assert not box.cgroup.is_frozen() and box.cgroup.v1_state() in (None, "THAWED")
        finally:
            with suppress(Exception):
                box.cgroup.thaw()
            worker.kill()
            worker.wait(timeout=10)
        assert wait_for(lambda: {"foreign_dns", "denied_name"}
                        <= {v["class"] for v in journaled(state_dir, box.id)})  # fmt: skip
        assert running.stop() == 0


def test_sigterm_leaves_the_rules_and_a_restart_replaces_them(
    uplink: str, lab: Lab, state_dir: Path
) -> None:
    with hand_made(uplink) as box:
        # Names checked on the lab's port too: the restarted sidecar never saw the answer
        # its predecessor gave, which the workload still holds.
        text = policy("sc1", "*.any.lab.test").replace(
            "ports: [80, 8081]", "ports: [80, 8081]\n    check_names: [80, 8081]"
        )
        first = policy_file(box.dir, text)
        with sidecar(box, first, state_dir) as running:
            assert "rules loaded" in running.ready
            assert probe(box, [fetch()])[0]["ok"]
            rules = ruleset(box.ns)
            assert running.stop() == 0
        # Fail closed: the table stays with what it learned; no DNS, no new flows.
        assert table(box.ns) and set_ips(box.ns) == {ALLOWED_IP}
        no_dns, no_flow = probe(box, [dns(ALLOWED), {"op": "tcp", "host": BLOCKED_IP,
                                                      "port": 80, "timeout": 1}])  # fmt: skip
        assert not no_dns["ok"] and not no_flow["ok"], (no_dns, no_flow)
        with Journal.open(state_dir) as journal:
            assert journal.sandbox(box.id)["state"] == "running"  # type: ignore[index]
        # A restart with the same policy: the same rules (replaced, not added twice), and
        # the addresses learned before are still allowed.
        with sidecar(box, first, state_dir) as running:
            assert "learned addresses kept" in running.ready, running.ready
            assert ruleset(box.ns) == rules
            assert set_ips(box.ns) == {ALLOWED_IP}
            cached = {"op": "tcp", "host": ALLOWED_IP, "port": 8081, "name": ALLOWED}
            assert probe(box, [cached])[0]["ok"]  # no DNS: the address from before
            assert probe(box, [fetch()])[0]["ok"]
            assert not box.cgroup.is_frozen()
            assert running.stop() == 0
        # Another policy: its rules, and the old policy's addresses are gone at once.
        second = policy_file(box.dir, policy("sc2", "allowed.lab.test"), "second.yaml")
        with sidecar(box, second, state_dir) as running:
            assert "learned addresses dropped" in running.ready, running.ready
            assert set_ips(box.ns) == set()
            got, gone = probe(box, [dns("allowed.lab.test"), dns(ALLOWED)])
            assert got["ok"] and got["ancount"] == 1 and gone["ok"] and gone["ancount"] == 0
            assert set_ips(box.ns) == {"203.0.113.10"}
            assert running.stop() == 0
        with Journal.open(state_dir) as journal:
            rows = [r for r in journal.sandboxes() if r["cgroup"] == box.cgroup.v2_path]
        assert [r["id"] for r in rows] == [box.id]  # one record, continued by each restart
        assert table(box.ns)


def settled(ns: str) -> bool:
    """No IPv6 address still in duplicate address detection: its "tentative" flag goes
    by itself a moment after the link is up, and would tell two snapshots apart."""
    argv = ["ip", "-n", ns, "addr"]
    return "tentative" not in subprocess.run(argv, capture_output=True, text=True).stdout


def test_remove_on_exit_leaves_the_netns_as_it_was(uplink: str, state_dir: Path) -> None:
    with hand_made(uplink) as box:
        assert wait_for(lambda: settled(box.ns), 20)
        before = snapshot(box.ns)
        path = policy_file(box.dir, policy("sc3", "*.any.lab.test"))
        with sidecar(box, path, state_dir, "--remove-on-exit") as running:
            assert probe(box, [fetch()])[0]["ok"] and table(box.ns)
            assert running.stop() == 0
        assert snapshot(box.ns) == before
        with Journal.open(state_dir) as journal:
            assert journal.sandbox(box.id)["state"] == "exited"  # type: ignore[index]


def test_a_sidecar_started_real_time_runs_under_sched_other(uplink: str, state_dir: Path) -> None:
    """Real-time, a busy sidecar keeps what its freezes wait on off the CPU (see
    egress/kernel/sched.py): it leaves it before it starts anything, and says so."""
    with hand_made(uplink) as box:
        path = policy_file(box.dir, policy("rt", "*.any.lab.test"))
        with sidecar(box, path, state_dir, wrapper=("chrt", "--fifo", "10")) as running:
            threads, _ = tasks_under(running.proc.pid)
            assert threads and policies(threads) == {os.SCHED_OTHER}
            assert running.stop() == 0
        said = (box.dir / "sidecar.err").read_text()
        assert "egressd sidecar: started SCHED_FIFO, now SCHED_OTHER" in said


def test_bad_starts_are_refused_and_change_nothing(uplink: str, state_dir: Path) -> None:
    with hand_made(uplink) as box:
        path = policy_file(box.dir, policy("sc4", "*.any.lab.test"))
        empty = ruleset(box.ns)
        bogus = str(box.dir / "no-cgroup")
        assert "is not a cgroup v2 directory" in refused(box, path, state_dir, "--cgroup", bogus)
        bad = policy_file(box.dir, "apiVersion: egress/v1\nkind: Policy\nspec: [\n", "bad.yaml")
        assert "bad.yaml:" in refused(box, bad, state_dir)
        # `ip netns exec` mounts a fresh /sys: no cgroup filesystem to freeze with.
        assert "nsenter --net=" in refused(box, path, state_dir, enter="ip")
        # Inside the cgroup it would freeze: refused (it would freeze itself).
        inside = ["sh", "-c", f"echo $$ > {box.cgroup.procs_file_v2}; exec \"$@\"", "sh",
                  *sidecar_argv(box, path, state_dir)]  # fmt: skip
        done = subprocess.run(inside, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert done.returncode == 1 and "the cgroup it would freeze" in done.stderr, done.stderr
        assert ruleset(box.ns) == empty
        with sidecar(box, path, state_dir) as running:
            rules = ruleset(box.ns)
            other = policy_file(box.dir, policy("other", "allowed.lab.test"), "other.yaml")
            assert "another egressd sidecar" in refused(box, other, state_dir, "--id", "x1")
            assert ruleset(box.ns) == rules and probe(box, [fetch()])[0]["ok"]
            assert running.stop() == 0
        # Its id belongs to this cgroup: another cgroup may not take it over.
        elsewhere = box.cgroup.v2_path + "-other"
        os.mkdir(elsewhere)
        try:
            err = refused(box, path, state_dir, "--cgroup", elsewhere)
            assert f"sandbox id {box.id!r} is already in use" in err, err
        finally:
            os.rmdir(elsewhere)
        assert ruleset(box.ns) == rules


@pytest.mark.parametrize("path", POLICIES, ids=lambda p: p.name)
def test_sidecar_ruleset_passes_nft_check_and_only_adds(path: Path) -> None:
    template, pol = read_template("sandbox.nft"), load_policy(str(path))
    plain = render_sandbox(template, pol)
    ups = (("198.51.100.53", 53), ("2001:db8:53::53", 5353))
    text = render_sandbox(template, pol, Sidecar(ups, 0))
    assert "sidecar" not in plain.lower()
    added = [d[2:] for d in difflib.ndiff(plain.splitlines(), text.splitlines()) if d[:2] == "+ "]
    removed = [d for d in difflib.ndiff(plain.splitlines(), text.splitlines()) if d[:2] == "- "]
    assert not removed
    rules = [line.strip() for line in added if line.strip() and not line.strip().startswith("#")]
    assert rules[1:] == [
        "meta mark $SIDECAR_MARK meta skuid 0 ip daddr 198.51.100.53 meta l4proto { tcp, udp } "
        "th dport 53 accept",
        "ip daddr 198.51.100.53 udp dport 53 counter name dropped goto foreign_dns",
        "meta mark $SIDECAR_MARK meta skuid 0 ip6 daddr 2001:db8:53::53 meta l4proto { tcp, udp } "
        "th dport 5353 accept",
        "ip6 daddr 2001:db8:53::53 udp dport 5353 counter name dropped goto foreign_dns",
    ]
    assert rules[0].startswith("define SIDECAR_MARK")
    # Before conntrack's shortcut: an established flow must not skip them.
    lines = [line.strip() for line in text.splitlines()]
    assert lines.index(rules[-1]) < lines.index("ct state established,related accept")
    with scratch_netns("scr") as ns:
        check = subprocess.run(["ip", "netns", "exec", ns, "nft", "-c", "-f", "-"],
                               input=text, capture_output=True, text=True)  # fmt: skip
    assert check.returncode == 0, check.stderr
