"""Issue 7: a real egressd on a temporary socket, driven through its API.

Every sandbox a test makes through the API is deleted through it in ``finally``; anything
an egressd that was stopped on purpose left behind is torn down by its claim, and the
hand-made netns and cgroup of the attach test are removed by the test itself.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from egress.kernel.cgroup import Cgroup, find_mounts
from egress.kernel.netns_cgroup import cgroup_paths
from egress.kernel.nft import NftHandle
from egress.kernel.sched import AUTOGROUP, autogroups_on, session_nice
from egress.lab import Lab
from egress.model import Limits
from egress.store.journal import Journal
from tests.support import NOBODY, SYSTEM_PYTHON
from tests.support.bombs import FORK_BOMB, forked
from tests.support.egressd import START_S, Egressd, egressd, read_until
from tests.support.netns import strip_source_check, unique
from tests.support.probes import dig, set_ips, wait_until
from tests.support.sched import policies, tasks_under

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {{name: {name}}}
spec:
  dns:
    upstreams: ["198.51.100.53"]
    allow: [{names}]
  violations: {{blocked_connect: freeze, foreign_dns: freeze}}
"""
# name -> the address the lab's zone gives it (distinct, so sets can be told apart)
NAMES = {
    "allowed.lab.test": "203.0.113.10",
    "mail.lab.test": "203.0.113.11",
    "a1.cdn.lab.test": "203.0.113.13",
    "a2.cdn.lab.test": "203.0.113.14",
}


def policy(name: str, *names: str) -> str:
    return POLICY.format(name=name, names=", ".join(names))


@pytest.fixture(scope="module")
def daemon(lab: Lab, state_dir: Path) -> Iterator[Egressd]:
    with egressd(state_dir) as d:
        yield d


@contextmanager
def sleeper(netns: str, cgroup: Cgroup) -> Iterator[int]:
    """A process inside the sandbox (its netns and cgroup), killed afterwards."""
    proc = subprocess.Popen(["ip", "netns", "exec", netns, "sleep", "300"])
    try:
        cgroup.add_pid(proc.pid)
        yield proc.pid
    finally:
        with suppress(Exception):
            cgroup.thaw()
        proc.kill()
        proc.wait(timeout=10)


def connect(netns: str, ip: str) -> None:
    code = (
        "import socket; s=socket.socket(); s.settimeout(1)\n"
        f"try: s.connect(('{ip}', 80))\nexcept OSError: pass"
    )
    subprocess.run(["ip", "netns", "exec", netns, SYSTEM_PYTHON, "-c", code], timeout=20)


def wait_frozen(cgroup: Cgroup, timeout: float = 20.0) -> bool:
    return wait_until(cgroup.is_frozen, timeout)


def test_sandboxes_resolve_only_their_own_names_and_freeze_alone(
    daemon: Egressd, lab: Lab, state_dir: Path
) -> None:
    boxes = []
    try:
        start = time.monotonic()
        for i, name in enumerate(NAMES):
            boxes.append(daemon.create(policy(f"own{i}", name), lab.uplink_netns))
        print(f"created {len(boxes)} in {time.monotonic() - start:.3f} s")
        for box in boxes:  # where each create's time went: its steps, within its total
            steps = {k: v for k, v in box["create_ms"].items() if k != "total"}
            assert list(steps)[:3] == ["claim", "netns", "veth"] and "serve" in steps
            assert 0 < sum(steps.values()) <= box["create_ms"]["total"]
        for box, own in zip(boxes, NAMES, strict=True):
            for name, ip in NAMES.items():
                got = dig(box["netns"], name)
                assert (got == ip) == (name == own), (box["id"], name, got)
        cgroups = [Cgroup.attach_existing(b["cgroup"], b["freezer"]) for b in boxes]
        with sleeper(boxes[0]["netns"], cgroups[0]), sleeper(boxes[1]["netns"], cgroups[1]):
            connect(boxes[0]["netns"], "198.51.100.12")  # not in its policy
            assert wait_frozen(cgroups[0])
            time.sleep(0.2)
            assert not any(c.is_frozen() for c in cgroups[1:])
            shown = daemon.client.call("GET", f"/v1/sandboxes/{boxes[0]['id']}")
            assert shown["state"] == "frozen"
            done = daemon.client.call("POST", f"/v1/sandboxes/{boxes[0]['id']}/resume", {})
            assert done["uid"] == 0 and not cgroups[0].is_frozen()
        with Journal.open(state_dir) as journal:
            decision = journal.decisions(boxes[0]["id"], limit=1)[0]
            journaled = journal.sandbox(boxes[0]["id"])
        assert decision["action"] == "resume" and decision["uid"] == 0
        assert journaled is not None and journaled["state"] == "running"  # what ps shows
        metrics = daemon.client.request("GET", "/metrics")[1]
        assert (
            f'egress_violations_total{{sandbox="{boxes[0]["id"]}",class="blocked_connect"}}'
            in metrics
        )
        assert "egress_freeze_latency_ms_count 1" in metrics
        # The one pause egressd takes on purpose is counted and timed (egress/collect.py).
        assert re.search(r"^egress_gc_full_collections_total \d+$", metrics, re.M)
        assert re.search(r"^egress_gc_full_collection_last_seconds [\d.e-]+$", metrics, re.M)
        # How late its loop ran what was due (daemon/lag.py): ticking since it started.
        ticks = re.search(r"^egress_loop_lag_seconds_count (\d+)$", metrics, re.M)
        assert ticks is not None and int(ticks.group(1)) > 0, metrics
    finally:
        for box in boxes:
            daemon.client.call("DELETE", f"/v1/sandboxes/{box['id']}")
    for box in boxes:
        assert not os.path.exists(f"/run/netns/{box['netns']}")


def test_a_freeze_right_after_a_resume_gets_a_review_of_its_own(
    daemon: Egressd, lab: Lab, state_dir: Path
) -> None:
    """egressd looks at a frozen sandbox's cgroup less often the longer it waits (up to
    once a second: REVIEW_POLL_MAX_S), so that many awaiting review cost its loop
    little. A violation right after a resume, through its API or with `egressctl
    resume` (which never reaches egressd), is a freeze with its own review block on
    egressd's stderr, not one taken for the freeze just resumed, which the review may
    not have seen thawed yet. Each violation is the workload's: an HTTP request as
    nobody inside the sandbox (`egressctl sandbox exec`) to an address its policy does
    not allow, which reaches no lab server."""
    box = daemon.create(policy("again", "allowed.lab.test"), lab.uplink_netns)
    cgroup = Cgroup.attach_existing(box["cgroup"], box["freezer"])
    block = f"egress: sandbox {box['id']} is FROZEN"
    workloads: list[subprocess.Popen[bytes]] = []

    def request(ip: str) -> None:  # left running: frozen, or ended by the delete
        argv = [sys.executable, "-m", "egress.cli.main", "sandbox", "exec", "--daemon",
                daemon.socket, "--user", str(NOBODY), box["id"], "--", SYSTEM_PYTHON, "-c",
                GET, ip, f"/again-{ip}"]  # fmt: skip
        workloads.append(
            subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )

    def resume_by_cli() -> None:
        done = subprocess.run(
            [sys.executable, "-m", "egress.cli.main", "resume", box["id"],
             "--state-dir", str(state_dir)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr

    def resume_by_api() -> None:
        daemon.client.call("POST", f"/v1/sandboxes/{box['id']}/resume", {})

    try:
        request("198.51.100.12")
        assert wait_frozen(cgroup)
        assert wait_until(lambda: daemon.stderr().count(block) == 1)
        for n, (resume, ip) in enumerate(
            ((resume_by_api, "198.51.100.11"), (resume_by_cli, "198.51.100.10")), 2
        ):
            time.sleep(2)  # the review's looks backed off to a second apart
            resume()
            request(ip)  # again, at once
            assert wait_frozen(cgroup)
            assert wait_until(lambda n=n: daemon.stderr().count(block) == n), daemon.stderr()
            shown = daemon.stderr().split(block)[n]
            assert f"{ip}:80" in shown, shown
        assert not [r for r in lab.requests() if "/again-" in str(r.get("path"))]
    finally:
        daemon.client.call("DELETE", f"/v1/sandboxes/{box['id']}")
        for w in workloads:
            with suppress(subprocess.TimeoutExpired):
                w.wait(timeout=30)
            if w.poll() is None:
                w.kill()
                w.wait(timeout=10)


GET = """
import socket, sys
s = socket.socket()
s.settimeout(5)
try:
    s.connect((sys.argv[1], 80))
    s.sendall(f"GET {sys.argv[2]} HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n".encode())
except OSError:
    pass
"""


def test_a_freeze_sqlite_refused_is_journaled_on_egressds_tick_and_stands(
    daemon: Egressd, lab: Lab, state_dir: Path
) -> None:
    """egressd commits a freeze's records on its journal writer thread: there the
    layer's tick hands the retry of a record SQLite refused (its write lock held here
    past the 10 s busy timeout) to that thread. Once the lock is free the freeze shows in
    the journal, open, with no further violation to prompt it, and the sandbox stays
    frozen until resumed."""
    box = daemon.create(policy("pinned", "allowed.lab.test"), lab.uplink_netns)
    cgroup = Cgroup.attach_existing(box["cgroup"], box["freezer"])
    said_before = len(daemon.stderr())
    try:
        with sleeper(box["netns"], cgroup):
            lock = sqlite3.connect(state_dir / "journal.db", isolation_level=None, timeout=0)
            try:
                lock.execute("BEGIN IMMEDIATE")
                connect(box["netns"], "198.51.100.12")  # not in its policy
                assert wait_frozen(cgroup)
                refused = f"egress inline: journal: {state_dir / 'journal.db'}"
                assert wait_until(lambda: refused in daemon.stderr()[said_before:], 60), (
                    daemon.stderr()[said_before:]
                )
            finally:
                lock.execute("ROLLBACK")
                lock.close()

            def journaled() -> list[dict[str, Any]]:
                with Journal.open(state_dir) as journal:
                    return journal.freezes(box["id"])

            assert wait_until(journaled, 30)  # the tick is every 5 s
            [freeze] = journaled()
            assert freeze["decision_id"] is None and freeze["layer"] == "inline"
            assert cgroup.is_frozen()
            shown = daemon.client.call("GET", f"/v1/sandboxes/{box['id']}")
            assert shown["state"] == "frozen"
            daemon.client.call("POST", f"/v1/sandboxes/{box['id']}/resume", {})
            assert not cgroup.is_frozen()
    finally:
        daemon.client.call("DELETE", f"/v1/sandboxes/{box['id']}")


BEHIND = """
import socket, urllib.request
try:
    socket.gethostbyname("denied.lab.test")  # not in its policy: a record, no freeze
except OSError:
    pass
try:
    urllib.request.urlopen("http://203.0.113.11/behind-the-writer", timeout=2)
except OSError:
    pass
print("done")
"""


def test_egressd_freezes_on_its_loop_while_its_writer_waits_for_sqlite(
    daemon: Egressd, lab: Lab, state_dir: Path
) -> None:
    """The freeze is not queued behind the journal's writer thread: with SQLite's write
    lock held here, the workload's denied name is a record that keeps that thread
    waiting (10 s busy timeout); its blocked request right after freezes the sandbox
    from egressd's loop (intent, then cgroup) before that record is refused. Nothing
    reached the lab's web server; once the lock is free, both records are journaled."""
    box = daemon.create(policy("behind", "allowed.lab.test"), lab.uplink_netns)
    cgroup = Cgroup.attach_existing(box["cgroup"], box["freezer"])
    said_before = len(daemon.stderr())
    refused = f"egress inline: journal: {state_dir / 'journal.db'}"
    argv = [sys.executable, "-m", "egress.cli.main", "sandbox", "exec", "--daemon",
            daemon.socket, "--user", str(NOBODY), box["id"], "--", SYSTEM_PYTHON, "-c",
            BEHIND]  # fmt: skip
    lock = sqlite3.connect(state_dir / "journal.db", isolation_level=None, timeout=0)
    workload: subprocess.Popen[str] | None = None
    try:
        lock.execute("BEGIN IMMEDIATE")
        workload = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        assert wait_frozen(cgroup)
        # Not behind the denied name's record: the writer still waits for the lock.
        assert refused not in daemon.stderr()[said_before:], daemon.stderr()[said_before:]
        lock.execute("ROLLBACK")

        def journaled() -> list[dict[str, Any]]:
            with Journal.open(state_dir) as journal:
                return journal.freezes(box["id"])

        assert wait_until(journaled, 30)
        with Journal.open(state_dir) as journal:
            classes = {v["class"] for v in journal.violations(box["id"])}
        assert classes == {"denied_name", "blocked_connect"}, classes
        assert not [r for r in lab.requests() if "behind-the-writer" in str(r.get("path"))]
        assert cgroup.is_frozen()
        daemon.client.call("POST", f"/v1/sandboxes/{box['id']}/resume", {})
        out, _ = workload.communicate(timeout=30)
        assert workload.returncode == 0 and out.split() == ["done"], (workload.returncode, out)
        assert refused not in daemon.stderr()[said_before:]
    finally:
        with suppress(sqlite3.Error):
            lock.execute("ROLLBACK")
        lock.close()
        daemon.client.call("DELETE", f"/v1/sandboxes/{box['id']}")
        if workload is not None and workload.poll() is None:
            workload.kill()
            workload.wait(timeout=10)


BURST = """
import socket, struct, sys
n = int(sys.argv[1])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(1)
name = b"".join(bytes([len(p)]) + p.encode() for p in "allowed.lab.test".split(".")) + b"\\0"
for i in range(n):
    s.sendto(struct.pack("!6H", i, 256, 1, 0, 0, 0) + name + struct.pack("!HH", 1, 1),
             ("127.0.0.53", 53))
got = 0
try:
    while got < n:
        s.recv(4096)
        got += 1
except OSError:
    pass
print(got)
"""


def burst(netns: str, n: int) -> int:
    """``n`` queries sent at once from inside the sandbox; how many were answered."""
    argv = ["ip", "netns", "exec", netns, SYSTEM_PYTHON, "-c", BURST, str(n)]
    return int(subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout)


def test_metrics_count_rate_limited_queries_and_time_upstream_round_trips(
    daemon: Egressd, lab: Lab
) -> None:
    limited = policy("limited", "allowed.lab.test").replace(
        "    allow:", "    rate_limit: {qps: 1, burst: 2}\n    allow:"
    )
    box = daemon.create(limited, lab.uplink_netns)
    sid = box["id"]
    try:
        assert dig(box["netns"], "allowed.lab.test") == NAMES["allowed.lab.test"]  # upstream
        answered = burst(box["netns"], 10)
        assert answered <= 2  # what the bucket had left, and up to one second's refill
        metrics = daemon.client.request("GET", "/metrics")[1]
        assert f'egress_dns_rate_limited_total{{sandbox="{sid}"}} {10 - answered}' in metrics
        count = f'egress_upstream_latency_seconds_count{{sandbox="{sid}"}} 1'
        assert count in metrics
        assert f'egress_upstream_latency_seconds_bucket{{sandbox="{sid}",le="2.5"}} 1' in metrics
        assert f'egress_upstream_latency_seconds_bucket{{sandbox="{sid}",le="+Inf"}} 1' in metrics
        # A live swap to a policy with the default limit (500/s) lifts it at once.
        path = f"/v1/sandboxes/{sid}/policy"
        daemon.client.call("PUT", path, {"policy": policy("unlimited", "allowed.lab.test")})
        assert burst(box["netns"], 10) == 10
        metrics = daemon.client.request("GET", "/metrics")[1]
        assert f'egress_dns_rate_limited_total{{sandbox="{sid}"}} {10 - answered}' in metrics
    finally:
        daemon.client.call("DELETE", f"/v1/sandboxes/{sid}")


def test_metrics_show_the_kernels_set_sizes_and_drop_count(daemon: Egressd, lab: Lab) -> None:
    """egress_set_elements and egress_dropped_packets_total are the kernel's own figures
    (read by raw netlink, kernel/nft_figures.py): the same as nft lists at that moment."""
    blocking = policy("figures", "allowed.lab.test", "mail.lab.test").replace(
        "blocked_connect: freeze", "blocked_connect: block"
    )
    box = daemon.create(blocking, lab.uplink_netns)
    sid = box["id"]
    try:
        for name in ("allowed.lab.test", "mail.lab.test"):
            assert dig(box["netns"], name) == NAMES[name]
        send = "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        send += "for p in (9, 10, 11):\n    try: s.sendto(b'x', ('203.0.113.99', p))\n"
        send += "    except OSError: pass\n"
        subprocess.run(["ip", "netns", "exec", box["netns"], SYSTEM_PYTHON, "-c", send],
                       check=True, timeout=20)  # fmt: skip
        metrics = daemon.client.request("GET", "/metrics")[1]
        with NftHandle.open(box["netns"]) as nft:
            allow4 = len(nft.list_set("inet", "egress", "allow4"))
            allow6 = len(nft.list_set("inet", "egress", "allow6"))
            dropped = nft.counter("inet", "egress", "dropped").packets
        assert allow4 == 4 and allow6 == 0  # two names, tcp/80 and tcp/443 each
        assert dropped >= 3
        assert f'egress_set_elements{{sandbox="{sid}",set="allow4"}} {allow4}' in metrics
        assert f'egress_set_elements{{sandbox="{sid}",set="allow6"}} {allow6}' in metrics
        assert f'egress_dropped_packets_total{{sandbox="{sid}"}} {dropped}' in metrics
    finally:
        daemon.client.call("DELETE", f"/v1/sandboxes/{sid}")


def figures_workers(pid: int) -> list[int]:
    """The processes under ``pid`` that are its figures worker (kernel/figures_worker.py).
    A child still in its exec has an empty cmdline for a moment (Popen returns once the
    exec is past its point of no return, before the new program's arguments are in
    place): it is read again until it names its program (a zombie's stays empty)."""
    found = []
    for child in tasks_under(pid)[1]:
        deadline = time.monotonic() + 5
        with suppress(OSError):  # ended meanwhile
            while not (cmdline := Path(f"/proc/{child}/cmdline").read_bytes()):
                if dead(child):
                    break
                assert time.monotonic() < deadline, f"pid {child}: no cmdline after 5 s"
                time.sleep(0.001)
            if b"egress.kernel.figures_worker" in cmdline:
                found.append(child)
    return found


def dead(pid: int) -> bool:
    """``pid`` has ended (a zombie its parent has not reaped yet, or gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


def test_metrics_kernel_figures_come_from_a_worker_started_again_when_it_dies(
    lab: Lab, tmp_path: Path
) -> None:
    """The kernel is read by egressd's figures worker, not in egressd's own process (there
    it held the loop: bench_egressd --scrape). Killed, the next scrape starts another and
    gets the kernel's own figures; egressd's end ends it."""
    with egressd(tmp_path / "state") as d:
        first = figures_workers(d.pid)
        # started with egressd, before any scrape (a failed start says why on stderr)
        assert len(first) == 1, (first, d.stderr()[-2000:])
        box = d.create(policy("worker", "allowed.lab.test"), lab.uplink_netns)
        sid = box["id"]
        try:
            assert dig(box["netns"], "allowed.lab.test") == NAMES["allowed.lab.test"]
            os.kill(first[0], signal.SIGKILL)  # our egressd's child, by its PID
            assert wait_until(lambda: dead(first[0]))
            # Started again at a scrape, once RESTART_AFTER_S (5 s) after the last start
            # has passed; each scrape meanwhile still answers, without the kernel's part.
            seen: list[str] = []

            def read_again() -> bool:
                status, text = d.client.request("GET", "/metrics")
                assert status == 200 and "egress_dns_queries_total{" in text
                seen.append(text)
                return "\negress_kernel_figures 1\n" in text  # the sample, not its HELP

            assert wait_until(read_again, seconds=20), seen[-1][:2000]
            assert all("\negress_kernel_figures 0\n" in t for t in seen[:-1])
            metrics = seen[-1]
            with NftHandle.open(box["netns"]) as nft:
                allow4 = len(nft.list_set("inet", "egress", "allow4"))
            assert allow4 == 2  # one name, tcp/80 and tcp/443
            assert f'egress_set_elements{{sandbox="{sid}",set="allow4"}} 2' in metrics
            again = figures_workers(d.pid)
            assert len(again) == 1 and again != first
        finally:
            d.client.call("DELETE", f"/v1/sandboxes/{sid}")
        d.stop()
        assert not Path(f"/proc/{again[0]}").exists()


def test_policy_swap_removes_names_and_their_addresses_at_once(daemon: Egressd, lab: Lab) -> None:
    box = daemon.create(policy("swap", "allowed.lab.test", "mail.lab.test"), lab.uplink_netns)
    try:
        assert dig(box["netns"], "allowed.lab.test") == NAMES["allowed.lab.test"]
        assert dig(box["netns"], "mail.lab.test") == NAMES["mail.lab.test"]
        assert set_ips(box["netns"]) == {"203.0.113.10", "203.0.113.11"}
        swapped = daemon.client.call(
            "PUT", f"/v1/sandboxes/{box['id']}/policy",
            {"policy": policy("swap2", "allowed.lab.test")},
        )  # fmt: skip
        assert swapped["removed_elements"] == 2  # mail's tcp/80 and tcp/443
        assert set_ips(box["netns"]) == {"203.0.113.10"}  # kept, not re-learned
        assert dig(box["netns"], "mail.lab.test") == ""
        assert dig(box["netns"], "allowed.lab.test") == NAMES["allowed.lab.test"]
        shown = daemon.client.call("GET", f"/v1/sandboxes/{box['id']}")
        assert shown["policy"] == "swap2"
        with Journal.open(daemon.state) as journal:  # what `egressctl ps` shows
            assert (journal.sandbox(box["id"]) or {})["policy"] == "swap2"
        bad = daemon.client.request("PUT", f"/v1/sandboxes/{box['id']}/policy", {"policy": "x: ["})
        assert bad[0] == 422 and bad[1]["problems"]
        assert set_ips(box["netns"]) == {"203.0.113.10"}  # a refused swap changed nothing
    finally:
        daemon.client.call("DELETE", f"/v1/sandboxes/{box['id']}")


def test_an_audit_answer_in_flight_across_a_swap_to_enforce_is_not_released(
    daemon: Egressd, lab: Lab
) -> None:
    """Audit mode forwards a denied name; the policy goes to enforce while the upstream
    (lag.lab.test answers after 1.5 s, inside egressd's 2 s upstream timeout) still
    holds the question. The answer arriving then
    must be SERVFAIL, its address must not enter the sandbox's set, and asked again the
    name must not go upstream (nor come back from a cache)."""
    audit = policy("audit", "mail.lab.test").replace("  dns:", "  mode: audit\n  dns:")
    box = daemon.create(audit, lab.uplink_netns)
    argv = ["ip", "netns", "exec", box["netns"], "dig", "+tries=1", "+time=10",
            "@127.0.0.53", "lag.lab.test"]  # fmt: skip
    try:
        lab.clear_queries()
        with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as asker:
            assert wait_until(lambda: lab.saw("lag.lab.test"), 10), "never forwarded"
            daemon.client.call(
                "PUT", f"/v1/sandboxes/{box['id']}/policy",
                {"policy": policy("enforce", "mail.lab.test")},
            )  # fmt: skip
            out, _ = asker.communicate(timeout=30)
        assert "status: SERVFAIL" in out, out
        assert "203.0.113.12" not in set_ips(box["netns"])
        lab.clear_queries()
        assert dig(box["netns"], "lag.lab.test") == ""
        assert not lab.saw("lag.lab.test")  # denied now: never sent upstream
        assert "203.0.113.12" not in set_ips(box["netns"])
    finally:
        daemon.client.call("DELETE", f"/v1/sandboxes/{box['id']}")


def test_an_audit_sandbox_of_egressd_is_learned_from(
    daemon: Egressd, lab: Lab, state_dir: Path
) -> None:
    """egressd serves mode: audit with the same wiring as `egressctl run`: what its
    sandbox asked and connected to reaches the journal (flushed as the sandbox goes), and
    `egressctl learn` turns it into a policy that allows exactly that."""
    audit = policy("audit-d", "mail.lab.test").replace("  dns:", "  mode: audit\n  dns:")
    box = daemon.create(audit, lab.uplink_netns)
    try:
        assert dig(box["netns"], "a1.cdn.lab.test") == "203.0.113.13"  # denied: audit lets it
        connect(box["netns"], "203.0.113.13")
        assert dig(box["netns"], "mail.lab.test") == "203.0.113.11"  # allowed, never connected
    finally:
        daemon.client.call("DELETE", f"/v1/sandboxes/{box['id']}")
    with Journal.open(state_dir) as journal:
        record = journal.audit([box["id"]])
    asked = {(r["name"], r["qtype"], r["verdict"]) for r in record["names"]}
    assert {("a1.cdn.lab.test", 1, "denied_name"), ("mail.lab.test", 1, "allowed")} <= asked
    [flow] = [c for c in record["connects"] if c["port"] == 80]
    assert (flow["address"], flow["verdict"], flow["names"]) == (
        "203.0.113.13", "blocked_connect", ["a1.cdn.lab.test"],
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "egress.cli.main", "learn", "--sandbox", box["id"],
         "--state-dir", str(state_dir)], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "- name: a1.cdn.lab.test\n        types: [A]\n        ports: [80]" in done.stdout
    assert "- name: mail.lab.test\n        types: [A]\n        # never connected to" in done.stdout


def _snapshot(netns: str) -> list[str]:
    out = []
    ip = ["ip", "-n", netns]
    nft = ["ip", "netns", "exec", netns, "nft", "list", "ruleset"]
    for argv in ([*ip, "link"], [*ip, "addr"], [*ip, "route"], nft):
        out.append(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)
    return out


@contextmanager
def hand_made(tag: str) -> Iterator[tuple[str, Cgroup]]:
    """A netns with a veth pair of its own (192.0.2.1/24 on one end, the peer in the same
    netns: packets go nowhere) and a cgroup, made by hand as another runtime would.
    lo is up, as every runtime leaves it (taking it down again after egress raised it
    leaves the kernel's noqueue qdisc on it, a difference `ip link` shows)."""
    name = unique(tag)
    v2 = find_mounts().v2
    assert v2 is not None
    path = os.path.join(v2, name)
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        cmds = [
            ["link", "add", "d0", "type", "veth", "peer", "name", "d1"],
            ["addr", "add", "192.0.2.1/24", "dev", "d0"],
            ["link", "set", "d0", "up"],
            ["link", "set", "lo", "up"],
        ]
        for cmd in cmds:
            subprocess.run(["ip", "-n", name, *cmd], check=True)
        os.mkdir(path)
        try:
            yield name, Cgroup.attach_existing(path)
        finally:
            os.rmdir(path)
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_attach_enforces_freezes_and_detaches_leaving_the_netns_as_it_was(
    daemon: Egressd, lab: Lab, state_dir: Path
) -> None:
    with hand_made("att") as (ns, cgroup), sleeper(ns, cgroup):
        before = _snapshot(ns)
        # Limits are the runtime's in a netns and cgroup it made: said, and left alone.
        text = policy("att", "allowed.lab.test") + "  limits: {pids: 64}\n"
        body = {"netns": ns, "cgroup": cgroup.v2_path, "policy": text,
                "uplink_netns": lab.uplink_netns, "id": ns[-20:].replace(".", "-")}  # fmt: skip
        box = daemon.client.call("POST", "/v1/sandboxes/attach", body)
        try:
            assert box["kind"] == "attached" and box["pids"] is None
            assert f"sandbox {box['id']}: spec.limits not applied" in daemon.stderr()
            again = daemon.client.request("POST", "/v1/sandboxes/attach", {**body, "id": None})
            assert again[0] == 409, again
            assert dig(ns, "allowed.lab.test") == NAMES["allowed.lab.test"]
            assert dig(ns, "denied.lab.test") == ""
            connect(ns, "192.0.2.7")  # through the dummy link: blocked, then frozen
            assert wait_frozen(cgroup)
            daemon.client.call("POST", f"/v1/sandboxes/{box['id']}/resume", {"note": "test"})
            assert not cgroup.is_frozen()
        finally:
            daemon.client.call("DELETE", f"/v1/sandboxes/{box['id']}")
        assert _snapshot(ns) == before
        with Journal.open(state_dir) as journal:
            kinds = [v["class"] for v in journal.violations(box["id"])]
        assert "blocked_connect" in kinds and "denied_name" in kinds


def test_two_attaches_of_one_netns_at_once_leave_one_serving_it_with_its_rules(
    daemon: Egressd, lab: Lab
) -> None:
    """Both passed egressd's look for a served netns and attach's look for the table
    while neither had loaded it; the loser's undo then removed the winner's table, and
    the netns stayed served with nothing enforced. Now one makes the table, the other
    is refused (409) and undoes nothing of it; three races in a row."""
    with hand_made("race") as (ns, cgroup):
        before = _snapshot(ns)
        body = {"netns": ns, "cgroup": cgroup.v2_path, "uplink_netns": lab.uplink_netns,
                "policy": policy("race", "allowed.lab.test")}  # fmt: skip

        def attach(_: int) -> tuple[int, Any]:
            return daemon.client.request("POST", "/v1/sandboxes/attach", body)

        for _ in range(3):
            with ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(attach, range(2)))
            won = [data["id"] for status, data in answers if 200 <= status < 300]
            try:
                assert len(won) == 1 and 409 in [status for status, _ in answers], answers
                argv = ["ip", "netns", "exec", ns, "nft", "list", "table", "inet", "egress"]
                listed = subprocess.run(argv, capture_output=True, text=True)
                assert listed.returncode == 0 and "chain" in listed.stdout, listed.stderr
                assert dig(ns, "allowed.lab.test") == NAMES["allowed.lab.test"]
            finally:
                for sid in won:
                    daemon.client.call("DELETE", f"/v1/sandboxes/{sid}")
            assert _snapshot(ns) == before


def test_attach_refuses_the_hosts_netns_and_cgroups_that_hold_egressd_or_pid_1(
    daemon: Egressd, lab: Lab, tmp_path: Path
) -> None:
    """Group egress is not root: attached to the host's netns, egress would put its
    default-deny rules on the host; to a cgroup holding egressd or PID 1, a freeze or a
    kill would reach them. Refused (422), and nothing is left behind."""
    v2 = find_mounts().v2
    assert v2 is not None
    mine = cgroup_paths(daemon.pid)[0]
    daemons = os.path.join(v2, mine.lstrip("/"))
    # PID 1 is asked first: where egressd runs in the root cgroup (this VM), it is PID 1's
    pid_1_under = (cgroup_paths(1)[0] + "/").startswith(mine.rstrip("/") + "/")
    host_tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True)
    plain_file = tmp_path / "not-a-netns"
    plain_file.touch()
    with hand_made("host") as (ns, cgroup):
        cases = [
            ({"netns": str(plain_file)}, "is not a network namespace"),
            ({"netns": "/proc/self/ns/net", "cgroup": cgroup.v2_path}, "namespace of egress"),
            ({"netns": f"/proc/{daemon.pid}/ns/net"}, "namespace of egress"),
            ({"netns": ns, "cgroup": v2}, "holds PID 1"),
            ({"netns": ns, "cgroup": daemons}, "holds PID 1" if pid_1_under else "holds egress"),
        ]
        for fields, said in cases:
            body = {**fields, "policy": policy("host", "allowed.lab.test"),
                    "uplink_netns": lab.uplink_netns}  # fmt: skip
            status, data = daemon.client.request("POST", "/v1/sandboxes/attach", body)
            try:
                assert status == 422 and said in data["error"], (fields, status, data)
            finally:
                if 200 <= status < 300:
                    daemon.client.call("DELETE", f"/v1/sandboxes/{data['id']}")
        after = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True)
        assert after.stdout == host_tables.stdout


def test_attach_keeps_the_cgroup_it_checked_not_a_link_to_it(
    daemon: Egressd, lab: Lab, tmp_path: Path
) -> None:
    """A cgroup named through a symlink the caller owns: checked as what it pointed at,
    then kept as the link, a freeze or kill would go wherever the link was turned since
    (a cgroup holding egressd or PID 1). What egress keeps is the cgroup it checked."""
    link = tmp_path / "cgroup-link"
    with hand_made("link") as (ns, cgroup):
        link.symlink_to(cgroup.v2_path)
        body = {"netns": ns, "cgroup": str(link), "uplink_netns": lab.uplink_netns,
                "policy": policy("link", "allowed.lab.test")}  # fmt: skip
        box = daemon.client.call("POST", "/v1/sandboxes/attach", body)
        try:
            shown = daemon.client.call("GET", f"/v1/sandboxes/{box['id']}")
            assert shown["cgroup"] == os.path.realpath(cgroup.v2_path), shown
        finally:
            daemon.client.call("DELETE", f"/v1/sandboxes/{box['id']}")


def test_what_an_attached_sandbox_says_of_its_cgroup_names_its_netns_as_given(
    daemon: Egressd, lab: Lab, state_dir: Path
) -> None:
    """Attach goes through a descriptor of the netns; what it says of the cgroup it
    looks for there names the netns as the caller did, not /proc/PID/fd/N. Attached
    without a cgroup (as CNI does), a process runs there in this test's own cgroup,
    which holds processes outside (or has exited by the look): the violation is
    blocked, not frozen, and says why."""
    with hand_made("label") as (ns, _):
        body = {"netns": ns, "uplink_netns": lab.uplink_netns,
                "policy": policy("label", "allowed.lab.test")}  # fmt: skip
        box = daemon.client.call("POST", "/v1/sandboxes/attach", body)
        try:
            connect(ns, "192.0.2.7")  # blocked; its cgroup is shared (or it is gone): not frozen
            with Journal.open(state_dir) as journal:

                def said() -> list[str]:
                    return [str(v["detail"]) for v in journal.violations(box["id"])
                            if "not frozen" in str(v["detail"])]  # fmt: skip

                assert wait_until(said, 20), journal.violations(box["id"])
                [detail] = said()
            assert f"netns {ns} " in detail and "/proc/" not in detail, detail
        finally:
            daemon.client.call("DELETE", f"/v1/sandboxes/{box['id']}")


def test_attach_refuses_a_cgroup_that_holds_the_process_attaching() -> None:
    """The same refusal for egress's own cgroup where it is not PID 1's (this VM runs
    egressd in the root cgroup): a process moved into a cgroup of its own asks."""
    v2 = find_mounts().v2
    assert v2 is not None
    with hand_made("self") as (ns, cgroup):
        procs = os.path.join(cgroup.v2_path, "cgroup.procs")
        code = (f"import os\nopen({procs!r}, 'w').write(str(os.getpid()))\n"
                "from egress.sandbox.attach import _refuse_the_hosts\n"
                f"pin = os.open('/run/netns/' + {ns!r}, os.O_RDONLY)\n"
                f"_refuse_the_hosts(pin, {ns!r}, {cgroup.v2_path!r}, None)\n")  # fmt: skip
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode == 1 and "holds egress (pid" in done.stderr, done.stderr


def test_detach_acts_on_the_netns_attached_even_where_its_path_names_another_by_then(
    daemon: Egressd, lab: Lab, tmp_path: Path
) -> None:
    """An OCI hook may attach /proc/PID/ns/net; by its poststop PID can be another
    process's, in another netns (another container's, the host's). Detach took lo down
    and removed the queue rule through the path, there. Here the path is a bind mount
    moved to a victim netns (lo up) between attach and delete: the attached netns gets
    its lo down again, the victim keeps its own up."""
    attached, victim = unique("pin-a"), unique("pin-v")
    v2 = find_mounts().v2
    assert v2 is not None
    group = os.path.join(v2, unique("pin"))
    path = tmp_path / "ns"
    path.touch()
    made: list[list[str]] = []
    try:
        for cmd in (["ip", "netns", "add", attached], ["ip", "netns", "add", victim],
                    ["ip", "-n", victim, "link", "set", "lo", "up"],
                    ["mount", "--bind", f"/run/netns/{attached}", str(path)]):  # fmt: skip
            subprocess.run(cmd, check=True)
            made.append(cmd)
        os.mkdir(group)
        body = {"netns": str(path), "cgroup": group, "uplink_netns": lab.uplink_netns,
                "policy": policy("pin", "allowed.lab.test")}  # fmt: skip
        box = daemon.client.call("POST", "/v1/sandboxes/attach", body)
        try:
            assert "UP" in _lo_flags(attached)  # egress raised it
            subprocess.run(["umount", "--lazy", str(path)], check=True)  # egress holds it open
            subprocess.run(["mount", "--bind", f"/run/netns/{victim}", str(path)], check=True)
        finally:
            daemon.client.call("DELETE", f"/v1/sandboxes/{box['id']}")
        assert "UP" not in _lo_flags(attached) and "UP" in _lo_flags(victim)
    finally:
        with suppress(OSError):
            os.rmdir(group)
        if any(cmd[0] == "mount" for cmd in made):
            subprocess.run(["umount", str(path)], check=False)
        for name in (attached, victim):
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def _lo_flags(netns: str) -> str:
    """lo's flags in ``netns``, as ``ip -o link`` prints them (``<LOOPBACK,UP,...>``)."""
    out = subprocess.run(["ip", "-o", "-n", netns, "link", "show", "lo"], check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    return out.split("<", 1)[1].split(">", 1)[0]


def test_clients_without_access_to_the_socket_are_refused(daemon: Egressd) -> None:
    st = os.stat(daemon.socket)
    assert (st.st_mode & 0o777, st.st_uid) == (0o660, 0)
    os.chmod(daemon.dir, 0o755)  # nobody may reach the directory, not the socket
    code = (
        "import socket,sys\ns=socket.socket(socket.AF_UNIX)\n"
        f"try: s.connect({daemon.socket!r})\nexcept PermissionError: sys.exit(13)\n"
    )
    argv = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
            SYSTEM_PYTHON, "-c", code]  # fmt: skip
    assert subprocess.run(argv, timeout=20).returncode == 13


@pytest.mark.parametrize("flags", [(), ("--reset-on-fork",)], ids=["fifo", "reset-on-fork"])
def test_egressd_and_its_observer_started_real_time_run_under_sched_other(
    lab: Lab, state_dir: Path, flags: tuple[str, ...]
) -> None:
    """Started under SCHED_FIFO (``chrt``, or a unit's CPUSchedulingPolicy), egressd starved
    what its freezes wait on (freezes unconfirmed after 5 s at 1,000 sandboxes): it and
    its observer layer go back to SCHED_OTHER before they start anything, every thread
    and child, and say so. With reset-on-fork only the starting thread is real-time.
    Both layers run at nice -10, the observer's shards too: at nice 0 beside egressd it
    judged seconds late under load."""
    with egressd(state_dir, wrapper=("chrt", "--fifo", *flags, "10")) as d:
        threads, children = tasks_under(d.pid)
        assert children  # its nft worker
        assert policies(threads) == {os.SCHED_OTHER}
        assert os.getpriority(os.PRIO_PROCESS, d.pid) == -10
        assert "egressd: started SCHED_FIFO, now SCHED_OTHER" in d.stderr()
        box = d.create(policy("rt", "allowed.lab.test"), lab.uplink_netns)
        observer = d.observer()
        try:
            said = read_until(observer, f"watching {box['id']}")
            threads, children = tasks_under(observer.pid)
            assert children  # its shards
            assert policies(threads) == {os.SCHED_OTHER}
            for pid in (observer.pid, *children):
                assert os.getpriority(os.PRIO_PROCESS, pid) == -10
            assert "egressd observer: started SCHED_FIFO, now SCHED_OTHER" in said
        finally:
            observer.send_signal(signal.SIGTERM)
            observer.communicate(timeout=20)


@pytest.mark.skipif(
    not autogroups_on() or "nice" not in AUTOGROUP.read_text(),  # empty: init's own group
    reason="the kernel does not schedule this test's session as a group (autogroups)",
)
def test_egressd_raises_its_own_session_and_no_one_elses(state_dir: Path) -> None:
    """With autogroups on, a nice of -10 weighs only against egressd's own session. As a
    service (its session's leader) it raises the session to -10, its figures worker
    left out; started from a shell it leaves the shell's session as it was, and
    everything else run there."""
    before = session_nice(os.getpid())
    try:
        with egressd(state_dir) as shared:  # the test's session
            assert os.getsid(shared.pid) == os.getsid(0)
            assert session_nice(shared.pid) == before
        with egressd(state_dir, own_session=True) as leader:
            assert os.getsid(leader.pid) == leader.pid
            assert session_nice(leader.pid) == -10
            assert os.getpriority(os.PRIO_PROCESS, leader.pid) == -10
            # Its figures worker (nice 10: its figures can wait) is not in that session.
            [worker] = figures_workers(leader.pid)
            assert os.getsid(worker) == worker and session_nice(worker) == 0
        assert session_nice(os.getpid()) == before
    finally:  # as it was, whatever a failing egressd did to it
        AUTOGROUP.write_text(str(before))


@pytest.mark.skipif(
    not autogroups_on() or "nice" not in AUTOGROUP.read_text(),  # empty: init's own group
    reason="the kernel does not schedule this test's session as a group (autogroups)",
)
def test_the_observer_raises_its_own_session_and_no_one_elses(state_dir: Path) -> None:
    """As egressd does: `egressd observer` leading its session (a service) raises it to
    -10, its shards in it; started from a shell it leaves the shell's as it was. Else a
    busy egressd's session at -10 takes the second layer's turns."""
    before = session_nice(os.getpid())
    try:
        with egressd(state_dir) as d:
            shared = d.observer()
            try:
                read_until(shared, "egressd observer: following")  # after its priority
                assert os.getpriority(os.PRIO_PROCESS, shared.pid) == -10
                assert session_nice(os.getpid()) == before
            finally:
                shared.send_signal(signal.SIGTERM)
                shared.communicate(timeout=20)
            leader = d.observer(own_session=True)
            try:
                read_until(leader, "egressd observer: following")
                assert session_nice(leader.pid) == -10
                assert wait_until(lambda: tasks_under(leader.pid)[1], START_S)  # its shards
                _, shards = tasks_under(leader.pid)
                for pid in (leader.pid, *shards):
                    assert os.getsid(pid) == leader.pid
                    assert os.getpriority(os.PRIO_PROCESS, pid) == -10
            finally:
                leader.send_signal(signal.SIGTERM)
                leader.communicate(timeout=20)
        assert session_nice(os.getpid()) == before
    finally:  # as it was, whatever a failing observer did to it
        AUTOGROUP.write_text(str(before))


def test_sigterm_leaves_rules_and_a_new_egressd_adopts(lab: Lab, state_dir: Path) -> None:
    with egressd(state_dir) as first:
        box = first.create(policy("keep", "allowed.lab.test"), lab.uplink_netns)
        assert dig(box["netns"], "allowed.lab.test") == NAMES["allowed.lab.test"]
        first.stop()
        with NftHandle.open(box["netns"]) as nft:
            assert nft.table_exists("inet", "egress")
        assert set_ips(box["netns"]) == {"203.0.113.10"}
        assert dig(box["netns"], "allowed.lab.test") == ""  # nothing serves DNS now...
        connect(box["netns"], "198.51.100.12")  # ...and the kernel still drops the rest
        first.start()  # the same run dir: adopts
        rows = first.client.call("GET", "/v1/sandboxes")
        assert [r["id"] for r in rows] == [box["id"]]
        assert dig(box["netns"], "allowed.lab.test") == NAMES["allowed.lab.test"]
        first.client.call("DELETE", f"/v1/sandboxes/{box['id']}")
        assert not os.path.exists(f"/run/netns/{box['netns']}")


def test_observer_layer_freezes_with_egressd_killed(lab: Lab, state_dir: Path) -> None:
    with egressd(state_dir) as d:
        box = d.create(policy("obs", "allowed.lab.test"), lab.uplink_netns)
        observer = d.observer()
        try:
            # Its child says so once it has bound the sandbox's observer NFLOG group.
            read_until(observer, f"watching {box['id']} (created")
            with Journal.open(state_dir) as journal:  # what `egressctl ps` shows
                watcher = (journal.sandbox(box["id"]) or {}).get("observer_pid")
            assert isinstance(watcher, int) and watcher != observer.pid
            d.stop(signal.SIGKILL)
            cgroup = Cgroup.attach_existing(box["cgroup"], box["freezer"])
            with sleeper(box["netns"], cgroup):
                connect(box["netns"], "198.51.100.12")
                assert wait_frozen(cgroup)
                cgroup.thaw()
        finally:
            observer.send_signal(signal.SIGTERM)
            observer.communicate(timeout=20)
        with Journal.open(state_dir) as journal:
            v = journal.violations(box["id"])[0]
        assert v["class"] == "blocked_connect" and v["layer"] == "observer"
        d.start()  # adopts it, so cleanup deletes it through the API


def test_observer_shards_share_the_sandboxes_and_a_killed_shard_comes_back(
    lab: Lab, state_dir: Path
) -> None:
    """`egressd observer --shards 2`: each sandbox is watched by one of two shard
    processes; a shard SIGKILLed is started again and watches its sandboxes again, which
    it then freezes with egressd dead; the other shard's watch never stopped."""
    from egress.observer.shard import shard_of

    with egressd(state_dir) as d:
        boxes: list[dict[str, Any]] = []
        shards: dict[str, int] = {}
        while min(list(shards.values()).count(k) for k in (0, 1)) < 2:  # ids are random
            assert len(boxes) < 24, shards
            boxes.append(d.create(policy(f"sh{len(boxes)}", "allowed.lab.test"),
                                  lab.uplink_netns))  # fmt: skip
            shards[boxes[-1]["id"]] = shard_of(boxes[-1]["id"], 2)
        observer = d.observer(False, "--shards", "2")
        try:
            read_until(observer, "watching", timeout=START_S)

            def watchers() -> dict[str, int | None]:
                with Journal.open(state_dir) as journal:
                    return {b["id"]: (journal.sandbox(b["id"]) or {}).get("observer_pid")
                            for b in boxes}  # fmt: skip

            deadline = time.monotonic() + START_S
            while None in watchers().values():
                assert time.monotonic() < deadline, watchers()
                time.sleep(0.1)
            first = watchers()
            pids = {shards[sid]: pid for sid, pid in first.items()}
            assert len(set(first.values())) == 2 and observer.pid not in pids.values()
            assert all(first[sid] == pids[shards[sid]] for sid in first)
            os.kill(pids[0], signal.SIGKILL)
            deadline = time.monotonic() + START_S
            while any(watchers()[sid] == pids[0] for sid in first if shards[sid] == 0):
                assert time.monotonic() < deadline, "the killed shard never came back"
                time.sleep(0.1)
            again = watchers()
            assert all(again[sid] == pids[1] for sid in again if shards[sid] == 1)
            d.stop(signal.SIGKILL)
            for box in boxes:
                cgroup = Cgroup.attach_existing(box["cgroup"], box["freezer"])
                with sleeper(box["netns"], cgroup):
                    connect(box["netns"], "198.51.100.12")
                    assert wait_frozen(cgroup), (box["id"], shards[box["id"]])
                    cgroup.thaw()
        finally:
            observer.send_signal(signal.SIGTERM)
            observer.communicate(timeout=30)
        with Journal.open(state_dir) as journal:
            for box in boxes:
                v = journal.violations(box["id"])[0]
                assert v["class"] == "blocked_connect" and v["layer"] == "observer", box
        d.start()  # adopts them, so cleanup deletes them through the API


@contextmanager
def freezer_twin(cgroup: Cgroup) -> Iterator[Cgroup]:
    """A hand-made cgroup with a v1 freezer twin where the machine has that hierarchy
    (hybrid systems), as another runtime would make it; removed afterwards."""
    mount = find_mounts().freezer
    if mount is None:
        yield cgroup
        return
    path = os.path.join(mount, os.path.basename(cgroup.v2_path))
    os.mkdir(path)
    try:
        yield Cgroup.attach_existing(cgroup.v2_path, path)
    finally:
        os.rmdir(path)


@contextmanager
def connector(netns: str, cgroup: Cgroup, ip: str) -> Iterator[subprocess.Popen[bytes]]:
    """A process that joins the cgroup before it execs, connects to ip from the netns and
    stays; everything in the cgroup is killed afterwards."""
    code = (
        "import socket, time\ns = socket.socket(); s.settimeout(2)\n"
        f"try: s.connect(('{ip}', 80))\nexcept OSError: pass\ntime.sleep(300)"
    )
    argv = ["ip", "netns", "exec", netns, SYSTEM_PYTHON, "-c", code]
    proc = subprocess.Popen(argv, preexec_fn=lambda: cgroup.add_pid(os.getpid()))
    try:
        yield proc
    finally:
        with suppress(Exception):
            cgroup.kill()
        proc.kill()
        proc.wait(timeout=10)


def test_observer_layer_watches_attached_sandboxes_with_egressd_killed(
    lab: Lab, state_dir: Path
) -> None:
    with hand_made("oba") as (ns, bare), freezer_twin(bare) as cgroup, egressd(state_dir) as d:
        body = {"netns": ns, "cgroup": cgroup.v2_path, "freezer": cgroup.freezer_path,
                "policy": policy("oba", "allowed.lab.test"), "uplink_netns": lab.uplink_netns,
                "id": ns[-20:].replace(".", "-")}  # fmt: skip
        box = d.client.call("POST", "/v1/sandboxes/attach", body)
        observer = d.observer()
        try:
            # Logged once the child has bound the observer NFLOG group in the netns.
            read_until(observer, f"watching {box['id']} (attached")
            d.stop(signal.SIGKILL)  # only the observer layer is left, and the kernel's rules
            with connector(ns, cgroup, "192.0.2.7") as proc:  # through the dummy link
                assert wait_frozen(cgroup)
                assert proc.pid in cgroup.pids()
                if cgroup.freezer_path is not None:  # it froze the record's v1 twin too
                    # Written once v2 confirmed (Cgroup.freeze): the observer may not have
                    # written it yet when this saw v2 frozen.
                    assert wait_until(lambda: cgroup.v1_state() != "THAWED", 5.0)
        finally:
            observer.send_signal(signal.SIGTERM)
            observer.communicate(timeout=20)
        with Journal.open(state_dir) as journal:
            seen = [(v["class"], v["layer"]) for v in journal.violations(box["id"])]
            freeze = journal.freezes(box["id"], limit=1)[0]
        assert ("blocked_connect", "observer") in seen, seen
        assert freeze["layer"] == "observer" and freeze["latency_ms"] is not None
        print(f"observer froze the attached sandbox in {freeze['latency_ms']:.2f} ms")
        d.start()  # adopts it, so cleanup detaches it through the API


# A flow that began from an address not the netns's own, as a container's inbound one did:
# root sends from 198.51.100.7 (IP_TRANSPARENT) to the netns's address, over lo.
FOREIGN_FLOW = """
import socket
b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); b.bind(("192.0.2.1", 0))
a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); a.setsockopt(socket.SOL_IP, 19, 1)
a.bind(("198.51.100.7", 4446)); a.sendto(b"x", b.getsockname())
"""


def foreign_entries(ns: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/nf_conntrack"],
                         capture_output=True, text=True, check=True, timeout=30).stdout  # fmt: skip
    return [line for line in out.splitlines() if "src=198.51.100.7 " in line]


def test_an_attached_sandbox_made_before_the_source_check_gets_it_and_keeps_its_flows(
    lab: Lab, state_dir: Path
) -> None:
    """An attached netns whose table an egress before the source check loaded: the adopter
    renews its rules (the check back, the learned elements kept) and says so, but
    forgets no conntrack entry, as it does for a sandbox it made: a container's inbound
    flows began from addresses not its own, and forgetting them would cut them."""
    with hand_made("ren") as (ns, cgroup), egressd(state_dir) as d:
        body = {"netns": ns, "cgroup": cgroup.v2_path, "policy": policy("ren", "allowed.lab.test"),
                "uplink_netns": lab.uplink_netns, "id": ns[-20:].replace(".", "-")}  # fmt: skip
        box = d.client.call("POST", "/v1/sandboxes/attach", body)  # egressd() detaches it
        assert dig(ns, "allowed.lab.test") == NAMES["allowed.lab.test"]
        learned = set_ips(ns)
        assert learned
        strip_source_check(ns)  # as such an egress left it
        # Unanswered UDP is kept 30 s by default; a busy host's stop and start may take
        # longer than that.
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw",
                        "net.netfilter.nf_conntrack_udp_timeout=600"], check=True)  # fmt: skip
        subprocess.run(["ip", "netns", "exec", ns, SYSTEM_PYTHON, "-c", FOREIGN_FLOW],
                       check=True, timeout=30)  # fmt: skip
        assert len(foreign_entries(ns)) == 1
        d.stop()
        d.start()  # adopts it
        renewed = f"sandbox {box['id']}: rules renewed (an older egress loaded them); flows begun"
        assert renewed in d.stderr()
        with NftHandle.open(ns) as nft:
            assert nft.chain_exists("inet", "egress", "spoofed_source")
        assert set_ips(ns) == learned
        assert len(foreign_entries(ns)) == 1
        assert dig(ns, "allowed.lab.test") == NAMES["allowed.lab.test"]  # and still served


def test_sandbox_exec_from_a_real_time_favoured_caller_starts_its_workload_normal(
    daemon: Egressd, lab: Lab
) -> None:
    """A workload started by a real-time or favoured ``egressctl sandbox exec`` does not
    inherit it (busy, it would keep the layers that must freeze it off the CPU): the
    workload reports SCHED_OTHER and nice 0 from inside."""
    box = daemon.create(policy("exec-rt", "allowed.lab.test"), lab.uplink_netns)
    code = "import os; print(os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))"
    argv = ["chrt", "--fifo", "10", "nice", "-n", "-10", sys.executable, "-m",
            "egress.cli.main", "sandbox", "exec", "--daemon", daemon.socket, "--user",
            str(NOBODY), box["id"], "--", SYSTEM_PYTHON, "-c", code]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(os.SCHED_OTHER), "0"]


def test_sandbox_exec_keeps_a_fork_bomb_to_the_policys_limit_and_a_swap_changes_it(
    daemon: Egressd, lab: Lab
) -> None:
    """The attack, through `egressctl sandbox exec`: fork until the host can start nothing
    (the layers' own work included). Its processes join the sandbox's pids twin too (the
    JSON's `pids`), so ``limits.pids: 32`` refuses the fork past it (EAGAIN; it stops
    itself at 256 without). A policy swap sets the new limit in place; a refused one
    changes nothing."""
    limited = policy("forks", "allowed.lab.test") + "  limits: {pids: 32, memory: 256Mi}\n"
    box = daemon.create(limited, lab.uplink_netns)
    exec_ = [sys.executable, "-m", "egress.cli.main", "sandbox", "exec", "--daemon",
             daemon.socket, "--user", str(NOBODY), box["id"], "--"]  # fmt: skip
    try:
        done = subprocess.run([*exec_, SYSTEM_PYTHON, "-c", FORK_BOMB], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        count, why = forked(done.stdout)
        assert why == errno.EAGAIN and 16 < count < 32, done.stdout
        made = Cgroup.open(box["id"])
        assert (box["pids"], box["memory"]) == (made.pids_path, made.memory_path)
        assert made.limits() == Limits(pids=32, memory=256 << 20)
        path = f"/v1/sandboxes/{box['id']}/policy"
        wider = limited.replace("pids: 32, memory: 256Mi", "pids: 64, memory: max")
        daemon.client.call("PUT", path, {"policy": wider})
        assert made.limits() == Limits(pids=64, memory=None)
        bad = daemon.client.request("PUT", path, {"policy": limited.replace("32", "8")})
        assert bad[0] == 422 and made.limits() == Limits(pids=64, memory=None)
    finally:
        daemon.client.call("DELETE", f"/v1/sandboxes/{box['id']}")


def test_sandbox_exec_runs_a_command_inside_and_a_freeze_names_it(
    daemon: Egressd, lab: Lab
) -> None:
    """`egressctl sandbox exec` puts CMD in the sandbox's netns and cgroups, unprivileged:
    it resolves through the sandbox's resolver, and its blocked connect freezes it and is
    attributed to it; a kill through the API ends it (exit 137)."""
    box = daemon.create(policy("exec", "allowed.lab.test"), lab.uplink_netns)
    exec_ = [sys.executable, "-m", "egress.cli.main", "sandbox", "exec", "--daemon",
             daemon.socket, "--user", str(NOBODY), box["id"], "--"]  # fmt: skip
    script = "import os, socket; print(os.getuid(), socket.gethostbyname('allowed.lab.test'))"
    ok = subprocess.run([*exec_, SYSTEM_PYTHON, "-c", script],
                        capture_output=True, text=True, timeout=30)  # fmt: skip
    assert ok.returncode == 0 and ok.stdout.split() == [str(NOBODY), "203.0.113.10"], ok
    marker = "egress-exec-marker"
    blocked = (
        f"import socket; s=socket.socket(); s.settimeout(20); s.connect(('192.0.2.7', 80))"
        f" # {marker}"
    )
    proc = subprocess.Popen([*exec_, SYSTEM_PYTHON, "-c", blocked])
    cg = Cgroup.attach_existing(box["cgroup"], box.get("freezer"))
    try:
        wait_frozen(cg)
        assert cg.is_frozen(), daemon.stderr()
        cpu = find_mounts().cpu  # where it is mounted, CMD weighs as the sandbox there
        assert box["cpu"] == (os.path.join(cpu, "egress", box["id"]) if cpu else None)
        if cpu:
            with open(os.path.join(box["cpu"], "cgroup.procs")) as f:
                assert cg.pids() and set(cg.pids()) <= {int(p) for p in f.read().split()}

        def blocked() -> list[dict[str, Any]]:
            with Journal.open(daemon.state) as journal:
                found = journal.violations(box["id"])
            return [v for v in found if v["class"] == "blocked_connect"]

        # The freeze is journaled first; the process behind it is read afterwards, with the
        # sandbox still, and attached to the record: wait for that, not only for the freeze.
        wait_until(lambda: any(v["process"] for v in blocked()))
        rows = blocked()
        assert rows and marker in (rows[0]["process"] or {}).get("cmdline", ""), rows
        refused = subprocess.run([*exec_, "/bin/true"], capture_output=True, text=True,
                                 timeout=30)  # fmt: skip
        assert refused.returncode == 1 and "is frozen; resume or kill it" in refused.stderr
        daemon.client.call("POST", f"/v1/sandboxes/{box['id']}/kill", {})
        assert proc.wait(timeout=10) == 128 + signal.SIGKILL
    finally:
        if proc.poll() is None:
            cg.kill()
            proc.wait(timeout=10)
        daemon.client.call("DELETE", f"/v1/sandboxes/{box['id']}")


def test_a_later_sandbox_of_one_egressd_binds_connections_to_their_names_too(
    daemon: Egressd, lab: Lab
) -> None:
    """egressd's first sandbox gets its NFQUEUE rule from iptables-nft, the later ones a
    copy of it (kernel.nft_copy). From inside the second of two, as nobody: a request for
    the allowed name reaches the lab; one for another name on the same address is held,
    judged, frozen, and never reaches the lab's web server."""
    boxes = [daemon.create(policy(f"bind{i}", "allowed.lab.test"), lab.uplink_netns)
             for i in range(2)]  # fmt: skip
    box = boxes[1]
    token = unique("bind")
    exec_ = [sys.executable, "-m", "egress.cli.main", "sandbox", "exec", "--daemon",
             daemon.socket, "--user", str(NOBODY), box["id"], "--"]  # fmt: skip
    script = f"""
import socket
ip = socket.gethostbyname("allowed.lab.test")
for host in ("allowed.lab.test", "https.lab.test"):
    s = socket.create_connection((ip, 80), timeout=20)
    head = "GET /{token} HTTP/1.1\\r\\nHost: " + host + "\\r\\nConnection: close\\r\\n\\r\\n"
    s.sendall(head.encode())
    try:
        print(host, "answered" if s.recv(100) else "closed", flush=True)
    except OSError as exc:
        print(host, "refused", type(exc).__name__, flush=True)
    s.close()
"""
    proc = subprocess.Popen([*exec_, SYSTEM_PYTHON, "-c", script], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split()[:2] == ["allowed.lab.test", "answered"]

        def mismatch() -> list[dict[str, Any]]:
            with Journal.open(daemon.state) as journal:
                found = journal.violations(box["id"])
            return [v for v in found if v["class"] == "name_mismatch"]

        wait_until(lambda: bool(mismatch()))
        [v] = mismatch()
        assert v["action"] == "freeze" and "https.lab.test" in str(v["detail"]), v
        assert wait_frozen(Cgroup.attach_existing(box["cgroup"], box.get("freezer")))
        daemon.client.call("POST", f"/v1/sandboxes/{box['id']}/kill", {})
        proc.wait(timeout=20)
        # What reached the lab: the allowed request, and nothing for the other name.
        seen = [r["host"] for r in lab.requests() if token in str(r.get("path"))]
        assert seen == ["allowed.lab.test"], seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()
        for b in boxes:
            daemon.client.call("DELETE", f"/v1/sandboxes/{b['id']}")


def test_log_journal_prints_each_event_once_as_a_json_line(lab: Lab, state_dir: Path) -> None:
    """`egressd --log-journal`: what a DaemonSet's log collector reads on stdout, the
    same JSON as `egressctl journal --follow --json`, each event once."""
    import json

    with egressd(state_dir, "--log-journal") as d:
        box = d.create(policy("logj", "allowed.lab.test"), lab.uplink_netns)
        connect(box["netns"], "198.51.100.12")
        seen: list[dict[str, Any]] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "frozen" not in [e["kind"] for e in seen]:
            line = d.line(timeout=max(deadline - time.monotonic(), 0.1))
            if line.startswith("{"):
                event = json.loads(line)
                if event["sandbox_id"] == box["id"]:
                    seen.append(event)
        kinds = [e["kind"] for e in seen]
        assert kinds[0] == "sandbox_started" and "frozen" in kinds, kinds
        [v] = [e for e in seen if e["kind"] == "violation"]
        assert v["record"]["class"] == "blocked_connect", v
        assert "198.51.100.12" in v["record"]["detail"]
        with Journal.open(state_dir) as journal:
            logged = {(e["kind"], e["record"]["id"]) for e in journal.events(box["id"])}
        assert len(kinds) == len(set((e["kind"], e["record"]["id"]) for e in seen))  # once
        assert {(e["kind"], e["record"]["id"]) for e in seen} <= logged
        d.delete(box["id"])


def test_metrics_address_serves_metrics_and_nothing_else_over_tcp(state_dir: Path) -> None:
    import socket as socket_mod
    import urllib.error
    import urllib.request

    with socket_mod.socket() as s:  # a free port on loopback (nothing leaves the machine)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with egressd(state_dir, "--metrics-address", f"127.0.0.1:{port}"):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert r.status == 200 and "egress_sandboxes" in text, text[:500]
        for path in ("/v1/sandboxes", "/v1/journal", "/openapi.json"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10)
            err.value.close()
            assert err.value.code == 404  # the API is the unix socket's only
