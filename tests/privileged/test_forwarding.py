"""Issue 12, item 9: no host-wide side effects. A sandbox's uplink forwards on the
interfaces sandbox traffic enters by, nothing namespace-wide, and puts back what it changed.

The uplink is this module's lab uplink, with one more network behind it that is not on
its default route (the "LAN": a netns of the test's own on ``lan0``). The lab's internet
side plays the attacker: it routes the LAN via the uplink, which must not forward that
just because egress turned forwarding on for the interface the attacker is on.

    LAN netns  eth0 192.0.2.2 ── lan0 192.0.2.1  NAME-up  inet0 198.18.0.1 ── NAME-inet
               2001:db8:1a2::2    2001:db8:1a2::1         ::ffff::1 (default route)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from egress.datapath import constants as c
from egress.kernel import netns
from egress.kernel.nft import NftHandle
from egress.lab import Lab
from egress.lab.topology import INET4, INET6, UPLINK4, UPLINK6, UPLINK_IF
from egress.sandbox import uplink as uplink_mod
from egress.store import claims
from tests.support import SYSTEM_PYTHON
from tests.support.netns import unique
from tests.support.sandboxes import EGRESSCTL, cleanup, env, policy_file, run_in, workdir
from tests.support.sandboxes import leftovers as all_leftovers

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.usefixtures("require_root"),
    # What these tests assert of IPv6 needs per-interface IPv6 forwarding (Linux 6.17+);
    # without it egress gives sandboxes no IPv6 (tests/unit/test_uplink_forwarding.py).
    pytest.mark.skipif(
        not os.path.exists("/proc/sys/net/ipv6/conf/lo/force_forwarding"),
        reason="this kernel has no net.ipv6.conf.*.force_forwarding (Linux 6.17+)",
    ),
]

LAN_UP4, LAN4, LAN_UP6, LAN6 = "192.0.2.1", "192.0.2.2", "2001:db8:1a2::1", "2001:db8:1a2::2"
LAN_IF, PORT, TABLE = "lan0", 7777, "fwdtest"
WEB4, WEB6 = "203.0.113.10", "2001:db8:80::10"
V4_KEY = f"net/ipv4/conf/{UPLINK_IF}/forwarding"
V6_KEY = f"net/ipv6/conf/{UPLINK_IF}/force_forwarding"
POLICY = f"""
apiVersion: egress/v1
kind: Policy
metadata: {{name: fwd}}
spec:
  dns: {{upstreams: ["198.51.100.53"], allow: []}}
  connect:
    allow:
      - {{cidr: {WEB4}/32, ports: [80], proto: tcp}}
      - {{cidr: "{WEB6}/128", ports: [80], proto: tcp}}
  violations: {{blocked_connect: block}}
"""
WEB = [{"op": "tcp", "host": WEB4, "port": 80}, {"op": "tcp", "host": WEB6, "port": 80}]
# Counters where packets land: the LAN counts datagrams by source, the lab's internet
# counts the SYNs that reach its web server, by source (the uplink's own address: masqueraded).
LAN_RULES = f"""
table inet {TABLE} {{
    counter from_inet4 {{}}
    counter from_inet6 {{}}
    counter from_uplink4 {{}}
    counter from_uplink6 {{}}
    chain input {{
        type filter hook input priority filter; policy accept;
        ip saddr {INET4} udp dport {PORT} counter name from_inet4
        ip6 saddr {INET6} udp dport {PORT} counter name from_inet6
        ip saddr {LAN_UP4} udp dport {PORT} counter name from_uplink4
        ip6 saddr {LAN_UP6} udp dport {PORT} counter name from_uplink6
    }}
}}
"""
INET_RULES = f"""
table inet {TABLE} {{
    counter web4 {{}}
    counter web6 {{}}
    chain input {{
        type filter hook input priority filter; policy accept;
        ip saddr {UPLINK4} ip daddr {WEB4} tcp dport 80 tcp flags syn / syn,ack counter name web4
        ip6 saddr {UPLINK6} ip6 daddr {WEB6} tcp dport 80 tcp flags syn / syn,ack counter name web6
    }}
}}
"""


@dataclass(frozen=True)
class World:
    lab: Lab
    lan: str

    @property
    def up(self) -> str:
        return self.lab.uplink_netns

    def count(self, name: str, ns: str | None = None) -> int:
        with NftHandle.open(ns or self.lan) as nft:
            return nft.counter("inet", TABLE, name).packets

    def attack(self) -> tuple[int, int]:
        """UDP from the internet side to the LAN, through the uplink: how many of the
        datagrams, IPv4 and IPv6, reached the LAN."""
        before = self.count("from_inet4"), self.count("from_inet6")
        self._send(self.lab.inet_netns)
        return self.count("from_inet4") - before[0], self.count("from_inet6") - before[1]

    def control(self) -> tuple[int, int]:
        """The same datagrams from the uplink itself (not forwarded): the counters work."""
        before = self.count("from_uplink4"), self.count("from_uplink6")
        self._send(self.up)
        return self.count("from_uplink4") - before[0], self.count("from_uplink6") - before[1]

    def _send(self, ns: str) -> None:
        for family, host in ((socket.AF_INET, LAN4), (socket.AF_INET6, LAN6)):
            with self.lab.socket(family, socket.SOCK_DGRAM, netns=ns) as s:
                for _ in range(3):
                    with suppress(OSError):  # an ICMP error from the last one: ECONNREFUSED
                        s.sendto(b"route me", (host, PORT))
        time.sleep(0.3)


def nft(ns: str, text: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=text, text=True,
                   check=True, capture_output=True, timeout=20)  # fmt: skip


@pytest.fixture(scope="module")
def world(lab: Lab) -> Iterator[World]:
    lan = unique("lan")
    netns.create_netns(lan)
    try:
        netns.create_veth_pair(LAN_IF, "eth0", lan, lab.uplink_netns)
        for ns, dev, a4, a6 in ((lab.uplink_netns, LAN_IF, LAN_UP4, LAN_UP6),
                                (lan, "eth0", LAN4, LAN6)):  # fmt: skip
            netns.add_address(dev, f"{a4}/24", ns)
            netns.add_address(dev, f"{a6}/64", ns)
            netns.set_up(dev, ns)
        netns.loopback_up(lan)
        nft(lan, LAN_RULES)
        nft(lab.inet_netns, INET_RULES)
        # The attacker routes the LAN via the uplink (in the lab's own netns: nothing of
        # this is on the host).
        lab.run(["ip", "route", "add", "192.0.2.0/24", "via", UPLINK4], netns=lab.inet_netns)
        lab.run(["ip", "route", "add", "2001:db8:1a2::/64", "via", UPLINK6], netns=lab.inet_netns)
        assert netns.get_sysctl(lab.uplink_netns, "net.ipv4.ip_forward") == "0"
        yield World(lab, lan)
    finally:
        netns.remove_netns(lan)  # lan0 goes with its peer
        netns.delete_link(LAN_IF, lab.uplink_netns)


def forwarding(ns: str) -> dict[str, str | None]:
    """Every forwarding sysctl of the namespace and of its interfaces but egress's veths."""
    with netns.in_netns(ns):
        names = sorted(os.listdir("/proc/sys/net/ipv4/conf"))
    keys = ["net/ipv4/ip_forward"]
    for name in names:
        if not name.startswith("eg-"):
            keys += [f"net/ipv4/conf/{name}/forwarding", f"net/ipv6/conf/{name}/forwarding",
                     f"net/ipv6/conf/{name}/force_forwarding"]  # fmt: skip
    return {key: netns.find_sysctl(ns, key) for key in keys}


def opened(before: dict[str, str | None]) -> dict[str, str | None]:
    """``before`` as egress leaves it while a sandbox runs: both families on, on the
    default-route device only."""
    return before | {V4_KEY: "1", V6_KEY: "1"}


def table_exists(ns: str) -> bool:
    with NftHandle.open(ns) as handle:
        return handle.table_exists("inet", c.UPLINK_TABLE)


def saved(ns: str) -> dict[str, Any] | None:
    path = uplink_mod.saved_path(ns)
    return json.loads(path.read_text()) if path.exists() else None


# ---- a sandbox that runs until told to stop -------------------------------------------


@dataclass
class Running:
    proc: subprocess.Popen[str]
    go: Path
    id: str
    stderr: Path

    def line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        text = self.proc.stdout.readline()
        assert text, f"egressctl run ended early: {self.stderr.read_text()}"
        return dict(json.loads(text))

    def finish(self) -> list[dict[str, Any]]:
        """Let the workload go on past its wait, and collect the rest."""
        assert self.proc.stdout is not None
        self.go.touch()
        waited, *rest = [json.loads(line) for line in self.proc.stdout]
        assert waited["ok"] and self.proc.wait(timeout=60) == 0, self.stderr.read_text()
        return rest

    def observer(self) -> int:
        """The observer's pid, once the run has journaled it."""
        from egress.store.journal import Journal

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            with Journal.open(os.environ["EGRESS_STATE_DIR"]) as journal:
                row = journal.sandbox(self.id)
            if row is not None and row["observer_pid"]:
                return int(row["observer_pid"])
            time.sleep(0.02)
        raise AssertionError(f"sandbox {self.id}: no observer journaled")


@contextmanager
def sandbox(
    world: World, first: list[dict[str, Any]], then: list[dict[str, Any]]
) -> Iterator[Running]:
    """`egressctl run` of a probe that does ``first``, waits, then does ``then``. Whatever
    happens, its process ends (by PID) and its sandbox is removed."""
    with workdir() as d:
        go, err_path = d / "go", d / "stderr"
        steps = [*first, {"op": "wait_file", "path": str(go), "timeout": 90}, *then]
        argv = [*run_in(d), "--policy", str(policy_file(d, POLICY)),
                "--uplink-netns", world.up, "--", SYSTEM_PYTHON, str(d / "probe.py"),
                json.dumps(steps)]  # fmt: skip
        with open(err_path, "w") as err:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env())
        run = Running(proc, go, "", err_path)
        observer = None
        try:
            run.id = _claim_of(proc)
            observer = run.observer()
            yield run
        finally:
            ids = {run.id} | {c.id for c in claims.load_all() if c.owner_pid == proc.pid}
            killed = proc.poll() is None
            if killed:
                proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
            if killed and observer is not None and _is_ours(observer):
                os.kill(observer, signal.SIGKILL)
            for sandbox_id in ids - {""}:
                cleanup(sandbox_id)  # a claim left (killed, crashed): egressctl gc's steps


def _claim_of(proc: subprocess.Popen[str]) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        for claim in claims.load_all():
            if claim.owner_pid == proc.pid and claim.cgroup:  # made, not just claimed
                return claim.id
        time.sleep(0.02)
    raise AssertionError(f"no sandbox of egressctl run {proc.pid} (rc {proc.poll()})")


def _is_ours(pid: int) -> bool:
    try:
        return "egress" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


def leftovers(sandbox_id: str, uplink: str) -> list[str]:
    """What of this sandbox is left. Not egress's parent cgroups: other test sessions on
    this machine may hold sandboxes in them (with claims this code may not parse)."""
    return [x for x in all_leftovers(sandbox_id, uplink) if not x.endswith("/egress")]


def web_ok(steps: list[dict[str, Any]]) -> None:
    ok4, ok6 = steps
    assert ok4["ok"] and ok4["body"].startswith(f"lab {WEB4}:80"), ok4
    assert ok6["ok"] and ok6["body"].startswith(f"lab [{WEB6}]:80"), ok6


# ---- the tests ----------------------------------------------------------------------


def test_a_run_changes_no_forwarding_setting_and_traffic_flows(world: World) -> None:
    """(a) Globals and every pre-existing interface as they were, before and after; while
    the sandbox runs only the default-route device has changed, and IPv4 and IPv6 reach
    the lab's web server masqueraded as the uplink."""
    before = forwarding(world.up)
    web = world.count("web4", world.lab.inet_netns), world.count("web6", world.lab.inet_netns)
    with sandbox(world, WEB, WEB) as run:
        web_ok([run.line(), run.line()])
        assert forwarding(world.up) == opened(before)
        host_end = f"eg-{run.id}"
        assert netns.get_sysctl(world.up, f"net/ipv4/conf/{host_end}/forwarding") == "1"
        assert netns.get_sysctl(world.up, f"net/ipv6/conf/{host_end}/force_forwarding") == "1"
        record = saved(world.up)
        assert record is not None and record["before"] == {V4_KEY: "0", V6_KEY: "0"}
        web_ok(run.finish())
    assert forwarding(world.up) == before
    assert saved(world.up) is None and not table_exists(world.up)
    assert leftovers(run.id, world.up) == []
    reached = (world.count("web4", world.lab.inet_netns) - web[0],
               world.count("web6", world.lab.inet_netns) - web[1])  # fmt: skip
    assert reached[0] >= 2 and reached[1] >= 2, reached  # one SYN per connect (or a retry)


def test_the_first_to_end_does_not_restore_the_last_does(world: World) -> None:
    """(b) Two sandboxes on one uplink: the first to end leaves forwarding and the table
    to the other, whose traffic still flows; the last one puts everything back."""
    before = forwarding(world.up)
    with sandbox(world, WEB[:1], []) as first, sandbox(world, WEB[:1], WEB) as second:
        first.line()
        second.line()
        assert forwarding(world.up) == opened(before)
        assert first.finish() == []
        assert forwarding(world.up) == opened(before)
        assert saved(world.up) is not None and table_exists(world.up)
        web_ok(second.finish())
        assert forwarding(world.up) == before
        assert saved(world.up) is None and not table_exists(world.up)


def test_the_uplink_does_not_become_a_router(world: World) -> None:
    """(c) With the uplink's ip_forward=0, forwarding on at its default-route device (for
    the sandboxes' replies) must not forward anything else that enters there: the
    internet side reaches the LAN behind the uplink neither before nor during a run."""
    assert netns.get_sysctl(world.up, "net.ipv4.ip_forward") == "0"
    assert world.attack() == (0, 0)
    with sandbox(world, WEB, []) as run:
        web_ok([run.line(), run.line()])
        # egress's change is in place: the device would forward, but for the guard
        assert netns.get_sysctl(world.up, V4_KEY) == "1"
        assert netns.get_sysctl(world.up, V6_KEY) == "1"
        assert world.attack() == (0, 0)
        assert world.control() == (3, 3)  # the LAN counts what reaches it
        run.finish()
    assert world.attack() == (0, 0)


def test_a_host_that_forwards_already_keeps_forwarding(world: World) -> None:
    """Where the uplink routes by its own choice (a router, docker), egress changes
    nothing there and adds no guard: the LAN stays reachable through it while sandboxes
    run, and the settings are the host's afterwards."""
    original = forwarding(world.up)
    try:
        netns.set_sysctl(world.up, "net.ipv4.conf.all.forwarding", 1)
        netns.set_sysctl(world.up, "net.ipv6.conf.all.forwarding", 1)
        before = forwarding(world.up)
        assert world.attack() == (3, 3)
        with sandbox(world, WEB, []) as run:
            web_ok([run.line(), run.line()])
            assert forwarding(world.up) == before
            record = saved(world.up)
            assert record is not None and record["before"] == {}
            assert world.attack() == (3, 3)
            run.finish()
        assert forwarding(world.up) == before
    finally:
        for family in ("ipv4", "ipv6"):
            for where in ("all", "default"):
                netns.set_sysctl(world.up, f"net/{family}/conf/{where}/forwarding", 0)
    assert forwarding(world.up) == original


def test_gc_restores_what_a_killed_run_changed(world: World) -> None:
    """(d) egressctl run and its observer SIGKILLed mid-run: the saved values are on disk,
    and `egressctl gc ID` puts them back (its last-out)."""
    before = forwarding(world.up)
    with sandbox(world, WEB, []) as run:
        web_ok([run.line(), run.line()])
        observer = run.observer()
        os.kill(run.proc.pid, signal.SIGKILL)
        os.kill(observer, signal.SIGKILL)
        run.proc.wait()
        assert forwarding(world.up) == opened(before)  # nobody put it back
        record = saved(world.up)
        assert record is not None and record["before"] == {V4_KEY: "0", V6_KEY: "0"}
        gc = subprocess.run([*EGRESSCTL, "gc", run.id], capture_output=True, text=True,
                            env=env(), timeout=60)  # fmt: skip
        assert gc.returncode == 0 and f"sandbox {run.id} removed" in gc.stdout, gc
        assert forwarding(world.up) == before
        assert saved(world.up) is None and not table_exists(world.up)
        assert leftovers(run.id, world.up) == []
