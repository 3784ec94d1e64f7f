"""Issue 15: containers under Debian's podman (CNI backend, runc) behind egress.

A network whose conflist chains egress-cni after bridge and host-local: the container
resolves and reaches an allowed name, a denied connect freezes it (its cgroup, found from
its processes, reports frozen), the journal names the rule and the process, `egressctl
kill` ends it, and `podman rm` leaves nothing of egress behind. With egressd down the
container does not start, and says why.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from egress.kernel.cgroup import Cgroup
from egress.lab import Lab
from egress.store.journal import Journal
from tests.support import ROOT
from tests.support.egressd import Egressd, egressd
from tests.support.podman import IMAGE, Podman, available, podman
from tests.support.probes import wait_until

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: podman-test}
spec:
  dns:
    upstreams: ["198.51.100.53"]
    allow: [allowed.lab.test]
  violations: {blocked_connect: freeze}
"""


@pytest.fixture(scope="module")
def pod(lab: Lab) -> Iterator[Podman]:
    why = available()
    if why is not None:
        pytest.fail(why)  # make setup installs them: missing is a broken machine, not a skip
    with podman(lab.uplink_netns) as p:
        yield p


@pytest.fixture(scope="module")
def daemon(lab: Lab, state_dir: Path) -> Iterator[Egressd]:
    with egressd(state_dir) as d:
        yield d


@pytest.fixture
def network(pod: Podman, daemon: Egressd, lab: Lab, tmp_path: Path) -> str:
    (tmp_path / "podman-test.yaml").write_text(POLICY)
    chained = {"type": "egress-cni", "policy": "podman-test", "policyDir": str(tmp_path),
               "socket": daemon.socket, "uplinkNetns": lab.uplink_netns}  # fmt: skip
    pod.network("egtest", "10.89.7.0/24", chained)
    return "egtest"


def start(pod: Podman, network: str, name: str) -> subprocess.CompletedProcess[str]:
    return pod.run("run", "-d", "--name", name, "--network", network, "--dns", "127.0.0.53",
                   IMAGE, "sleep", "300", check=False)  # fmt: skip


def egress_of(daemon: Egressd, container_id: str) -> list[dict[str, Any]]:
    rows = daemon.client.call("GET", "/v1/sandboxes")
    return [r for r in rows if str(r.get("owner", "")).startswith(f"cni:egtest:{container_id}")]


def attributed(state_dir: Path, sandbox_id: str) -> dict[str, Any]:
    """The blocked connect, once the layer that froze has journaled its process (it
    reads it with the cgroup frozen, after confirming the freeze)."""

    def row() -> dict[str, Any] | None:
        with Journal.open(state_dir) as journal:
            rows = [v for v in journal.violations(sandbox_id) if v["class"] == "blocked_connect"]
        return rows[0] if len(rows) == 1 and rows[0]["process"] else None

    assert wait_until(lambda: row() is not None, 20)
    found = row()
    assert found is not None
    return found


def test_a_container_on_a_chained_network_is_enforced_frozen_and_killed(
    pod: Podman, daemon: Egressd, network: str, lab: Lab, state_dir: Path
) -> None:
    done = start(pod, network, "egc1")
    assert done.returncode == 0, done.stderr
    cid = done.stdout.strip()
    [box] = egress_of(daemon, cid)
    lab.clear_queries()
    lab.clear_requests()
    got = pod.run("exec", "egc1", "wget", "-q", "-O", "-", "http://allowed.lab.test/")
    assert got.stdout == "lab 203.0.113.10:80\n"
    denied = pod.run("exec", "egc1", "nslookup", "denied.lab.test", check=False)
    assert denied.returncode != 0 and "203.0.113" not in denied.stdout
    assert lab.saw("allowed.lab.test") and not lab.saw("denied.lab.test")
    # A connect the policy does not allow: the container's cgroup is frozen.
    pod.run("exec", "-d", "egc1", "wget", "-q", "-O", "-", "http://198.51.100.12/")
    assert wait_until(lambda: egress_of(daemon, cid)[0]["state"] == "frozen", 20)
    [box] = egress_of(daemon, cid)
    pid = pod.pid("egc1")
    assert box["cgroup"] and Cgroup.attach_existing(box["cgroup"], box["freezer"]).is_frozen()
    assert pid in Cgroup.attach_existing(box["cgroup"]).pids()
    v = attributed(state_dir, box["id"])
    assert "198.51.100.12" in v["detail"] and v["rule"], v
    assert "wget" in json.dumps(v["process"]), v
    assert [r["local"] for r in lab.requests()] == ["203.0.113.10:80"]  # nothing else got in
    killed = subprocess.run([sys.executable, "-m", "egress.cli.main", "kill", "--state-dir",
                             str(state_dir), box["id"]], capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert killed.returncode == 0, killed.stderr
    assert wait_until(lambda: pod.run("inspect", "-f", "{{.State.Running}}", "egc1")
                      .stdout.strip() == "false", 30)  # fmt: skip
    netns = box["netns"]
    pod.run("rm", "egc1")
    assert egress_of(daemon, cid) == []  # CNI DEL detached it
    assert list(daemon.run_dir.glob(f"{box['id']}*")) == []  # no record for a successor
    assert not Path(netns).exists()  # and the netns went with the container
    with Journal.open(state_dir) as journal:
        row = journal.sandbox(box["id"])
    assert row is not None and row["state"] == "exited"


def test_with_egressd_down_the_container_does_not_start(
    pod: Podman, daemon: Egressd, network: str
) -> None:
    daemon.stop()
    try:
        done = start(pod, network, "egc2")
        assert done.returncode != 0
        assert "egress" in done.stderr and "egressd is unreachable" in done.stderr, done.stderr
        state = pod.run("inspect", "-f", "{{.State.Status}}", "egc2", check=False)
        assert state.stdout.strip() != "running"
        pod.run("rm", "--force", "egc2", check=False)
    finally:
        daemon.start()


def test_egressd_restarted_while_a_container_runs_adopts_it(
    pod: Podman, daemon: Egressd, network: str, state_dir: Path
) -> None:
    done = start(pod, network, "egc3")
    assert done.returncode == 0, done.stderr
    cid = done.stdout.strip()
    [box] = egress_of(daemon, cid)
    daemon.stop()  # the rules stay in the container's netns: nothing new gets out
    blocked = pod.run("exec", "egc3", "timeout", "3", "wget", "-q", "-O", "-",
                      "http://allowed.lab.test/", check=False)  # fmt: skip
    # No resolver serves while egressd is down (busybox: "bad address"), not a timeout
    assert blocked.returncode == 1 and "bad address" in blocked.stderr, blocked
    daemon.start()
    assert [b["id"] for b in egress_of(daemon, cid)] == [box["id"]]
    got = pod.run("exec", "egc3", "wget", "-q", "-O", "-", "http://allowed.lab.test/")
    assert got.stdout == "lab 203.0.113.10:80\n"
    pod.run("exec", "-d", "egc3", "wget", "-q", "-O", "-", "http://198.51.100.12/")
    assert wait_until(lambda: egress_of(daemon, cid)[0]["state"] == "frozen", 20)
    with Journal.open(state_dir) as journal:
        classes = [v["class"] for v in journal.violations(box["id"])]
    assert "blocked_connect" in classes, classes
    pod.run("rm", "--force", "--time", "0", "egc3")
    assert egress_of(daemon, cid) == []


def hooks(pod: Podman, daemon: Egressd, lab: Lab, policies: Path) -> None:
    """containers/oci-hooks/, pointed at this test's egressd, policies and hook program."""
    program = str(ROOT / ".venv" / "bin" / "egress-oci-hook")
    options = ["--socket", daemon.socket, "--policy-dir", str(policies),
               "--uplink-netns", lab.uplink_netns]  # fmt: skip
    for src in (ROOT / "containers" / "oci-hooks").glob("*.json"):
        hook = json.loads(src.read_text())
        hook["hook"]["path"] = program
        hook["hook"]["args"] += options
        (pod.hooks / src.name).write_text(json.dumps(hook))


def test_the_oci_hook_attaches_an_annotated_container_on_the_default_network(
    pod: Podman, daemon: Egressd, lab: Lab, tmp_path: Path, state_dir: Path
) -> None:
    (tmp_path / "podman-test.yaml").write_text(POLICY)
    hooks(pod, daemon, lab, tmp_path)
    plain = pod.run("run", "-d", "--name", "egh0", IMAGE, "sleep", "300")
    annotated = pod.run("run", "-d", "--name", "egh1", "--annotation",
                        "io.egress.policy=podman-test", "--dns", "127.0.0.53", IMAGE, "sleep",
                        "300")  # fmt: skip
    try:
        rows = daemon.client.call("GET", "/v1/sandboxes")
        cid = annotated.stdout.strip()
        [box] = [r for r in rows if r["owner"] == f"oci:{cid}"]
        assert not [r for r in rows if r["owner"] == f"oci:{plain.stdout.strip()}"]  # left alone
        pid = pod.pid("egh1")
        assert pid in Cgroup.attach_existing(box["cgroup"]).pids()  # the hook's cgroup
        got = pod.run("exec", "egh1", "wget", "-q", "-O", "-", "http://allowed.lab.test/")
        assert got.stdout == "lab 203.0.113.10:80\n"
        pod.run("exec", "-d", "egh1", "wget", "-q", "-O", "-", "http://198.51.100.12/")
        cgroup = Cgroup.attach_existing(box["cgroup"], box["freezer"])
        assert wait_until(cgroup.is_frozen, 20)
        v = attributed(state_dir, box["id"])
        assert "wget" in json.dumps(v["process"]), v
        cgroup.thaw()
    finally:
        pod.run("rm", "--force", "--time", "0", "egh0", "egh1", check=False)
    rows = daemon.client.call("GET", "/v1/sandboxes")
    assert [r for r in rows if r["owner"] == f"oci:{cid}"] == []  # poststop detached it
    for hook in pod.hooks.glob("*.json"):
        hook.unlink()


PARALLEL = 20
OWN_POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {{name: own{i}}}
spec:
  dns:
    upstreams: ["198.51.100.53"]
    allow: [ip-198-19-7-{i}.any.lab.test]
  connect:
    ports: [8081]
  violations: {{blocked_connect: block, denied_name: log}}
"""


def test_twenty_containers_started_at_once_each_enforce_their_own_policy(
    pod: Podman, daemon: Egressd, lab: Lab, tmp_path: Path
) -> None:
    for i in range(1, PARALLEL + 1):
        (tmp_path / f"own{i}.yaml").write_text(OWN_POLICY.format(i=i))
    hooks(pod, daemon, lab, tmp_path)
    names = [f"egp{i}" for i in range(1, PARALLEL + 1)]

    def run(i: int) -> subprocess.CompletedProcess[str]:
        return pod.run("run", "-d", "--name", names[i - 1], "--annotation",
                       f"io.egress.policy=own{i}", "--dns", "127.0.0.53", IMAGE, "sleep", "300",
                       check=False, timeout=300)  # fmt: skip

    # A script per container, all in one exec each: its own name, then its neighbour's.
    script = (
        "timeout 5 wget -q -O - http://ip-198-19-7-{i}.any.lab.test:8081/ && echo OWN; "
        "nslookup ip-198-19-7-{j}.any.lab.test >/dev/null 2>&1 && echo NEIGHBOUR; "
        "timeout 2 wget -q -O - http://198.19.7.{j}:8081/ >/dev/null 2>&1 && echo DIRECT; true"
    )
    try:
        with ThreadPoolExecutor(PARALLEL) as pool:
            started = list(pool.map(run, range(1, PARALLEL + 1)))
        assert [s.returncode for s in started] == [0] * PARALLEL, [s.stderr for s in started]
        rows = daemon.client.call("GET", "/v1/sandboxes")
        ids = {s.stdout.strip() for s in started}
        assert sorted(r["policy"] for r in rows if r["owner"][4:] in ids) == sorted(
            f"own{i}" for i in range(1, PARALLEL + 1)
        )

        def probe(i: int) -> str:
            j = i % PARALLEL + 1
            cmd = script.format(i=i, j=j)
            return pod.run("exec", names[i - 1], "sh", "-c", cmd, timeout=120).stdout

        with ThreadPoolExecutor(PARALLEL) as pool:
            outs = list(pool.map(probe, range(1, PARALLEL + 1)))
        for i, out in enumerate(outs, start=1):
            assert out.split()[-1:] == ["OWN"], (i, out)  # its own only: no neighbour, no IP
    finally:
        pod.run("rm", "--force", "--time", "0", *names, check=False, timeout=300)
        for hook in pod.hooks.glob("*.json"):
            hook.unlink()
