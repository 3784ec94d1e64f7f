"""Issue 15, item 2: egress-cni driven as a runtime drives it, with the spec's environment
and stdin, against a real egressd and hand-made network namespaces.

ADD attaches (and passes prevResult through), CHECK holds while the rules are there and
fails when they are gone, DEL detaches and is idempotent, STATUS says 50 while egressd
is unreachable, GC detaches what the runtime no longer lists, and a bad configuration or
environment gets the spec's error JSON. The cgroup, unknown at ADD, is bound from the
processes that come to run in the netns, and never to one that holds egress itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from egress.kernel.cgroup import Cgroup, find_mounts
from egress.kernel.nft import NftHandle
from egress.lab import Lab
from egress.store.journal import Journal
from tests.support import ROOT, SYSTEM_PYTHON
from tests.support.egressd import Egressd, egressd
from tests.support.netns import unique
from tests.support.probes import wait_until

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: cni-test}
spec:
  dns:
    upstreams: ["198.51.100.53"]
    allow: [allowed.lab.test]
  violations: {blocked_connect: freeze}
"""
PREV = {
    "cniVersion": "1.0.0",
    "interfaces": [{"name": "eth0", "sandbox": "/var/run/netns/x"}],
    "ips": [{"address": "10.88.0.5/16", "gateway": "10.88.0.1", "interface": 0}],
}


@pytest.fixture(scope="module")
def daemon(lab: Lab, state_dir: Path) -> Iterator[Egressd]:
    with egressd(state_dir) as d:
        yield d


@pytest.fixture
def policies(tmp_path: Path) -> Path:
    (tmp_path / "cni-test.yaml").write_text(POLICY)
    (tmp_path / "broken.yaml").write_text(POLICY.replace("allow:", "allow: [x]\n    allow:"))
    return tmp_path


@contextmanager
def netns(tag: str) -> Iterator[str]:
    """A netns as a runtime leaves it for the chained plugins: lo up, a link with an
    address (192.0.2.1/24 on a veth whose peer is in the same netns: packets go nowhere)."""
    name = unique(tag)
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        for cmd in (
            ["link", "add", "d0", "type", "veth", "peer", "name", "d1"],
            ["addr", "add", "192.0.2.1/24", "dev", "d0"],
            ["link", "set", "d0", "up"],
            ["link", "set", "lo", "up"],
        ):
            subprocess.run(["ip", "-n", name, *cmd], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def config(daemon: Egressd, policies: Path, lab: Lab, **extra: Any) -> dict[str, Any]:
    return {
        "cniVersion": "1.0.0", "name": "egtest", "type": "egress-cni", "policy": "cni-test",
        "policyDir": str(policies), "socket": daemon.socket, "uplinkNetns": lab.uplink_netns,
        **extra,
    }  # fmt: skip


def cni(command: str, conf: dict[str, Any] | bytes, ns: str = "", cid: str = "c0ffee",
        **env: str) -> tuple[int, Any]:  # fmt: skip
    """egress-cni as the runtime runs it: a process, environment and stdin; (exit, JSON)."""
    full = {"PATH": os.environ["PATH"], "CNI_COMMAND": command, "CNI_CONTAINERID": cid,
            "CNI_NETNS": f"/run/netns/{ns}" if ns else "", "CNI_IFNAME": "eth0",
            "CNI_PATH": "/usr/lib/cni", **env}  # fmt: skip
    stdin = conf if isinstance(conf, bytes) else json.dumps(conf).encode()
    argv = [sys.executable, "-m", "egress.cli.cni"]
    done = subprocess.run(argv, input=stdin, env=full, capture_output=True, timeout=120)
    out = done.stdout.decode().strip()
    return done.returncode, json.loads(out) if out else None


def served(daemon: Egressd, cid: str = "c0ffee") -> list[dict[str, Any]]:
    rows = daemon.client.call("GET", "/v1/sandboxes")
    return [r for r in rows if r["owner"] == f"cni:egtest:{cid}:eth0"]


def has_table(ns: str) -> bool:
    with NftHandle.open(ns) as nft:
        return nft.table_exists("inet", "egress")


def test_add_check_del_del_and_version(daemon: Egressd, policies: Path, lab: Lab) -> None:
    conf = config(daemon, policies, lab, prevResult=PREV)
    with netns("cni") as ns:
        code, out = cni("ADD", conf, ns)
        assert code == 0, out
        assert out == PREV  # passed through as it came, in the config's version
        [box] = served(daemon)
        assert box["kind"] == "attached" and box["cgroup"] == "" and has_table(ns)
        assert cni("CHECK", conf, ns) == (0, None)
        code, out = cni("ADD", conf, ns)  # a retried ADD: one sandbox, not two
        assert code == 0 and len(served(daemon)) == 1
        subprocess.run(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "egress"],
                       check=True)  # fmt: skip
        code, out = cni("CHECK", conf, ns)
        assert code == 100 and out["code"] == 100 and "gone" in out["msg"], out
        assert cni("DEL", conf, ns) == (0, None)
        assert served(daemon) == []
        assert cni("DEL", conf, ns) == (0, None)  # idempotent
        code, out = cni("CHECK", conf, ns)
        assert code == 100 and "serves no sandbox" in out["msg"], out
    # After the netns is gone, too (the runtime may call DEL late).
    assert cni("DEL", conf, "gone-netns") == (0, None)
    code, out = cni("VERSION", {"cniVersion": "1.1.0"})
    assert code == 0 and out["supportedVersions"] == ["0.4.0", "1.0.0", "1.1.0"], out


def test_errors_are_the_specs_json(daemon: Egressd, policies: Path, lab: Lab) -> None:
    conf = config(daemon, policies, lab, prevResult=PREV)
    with netns("cnierr") as ns:
        cases = [
            (cni("ADD", b"{not json", ns), 6, "not JSON"),
            (cni("ADD", {**conf, "cniVersion": "9.9.9"}, ns), 1, "not supported"),
            (cni("ADD", conf), 4, "CNI_NETNS not set"),
            (cni("ADD", conf, ns, cid="bad id!"), 4, "CNI_CONTAINERID"),
            (cni("ADD", {k: v for k, v in conf.items() if k != "prevResult"}, ns), 7,
             "chained plugin"),
            (cni("ADD", {**conf, "policy": "missing"}, ns), 7, "cannot read"),
            (cni("ADD", {**conf, "policy": "../etc"}, ns), 7, "not a file name"),
            (cni("ADD", {**conf, "mapping": [{"pod": "*"}]}, ns, CNI_ARGS="K8S_POD_NAME=p"),
             7, "needs a policy"),
            (cni("NOPE", conf, ns), 4, "not a CNI command"),
        ]  # fmt: skip
        for (code, out), want, text in cases:
            assert code == want and out["code"] == want and text in out["msg"], (want, out)
            assert out["cniVersion"] in ("1.0.0", "1.1.0")
        code, out = cni("ADD", {**conf, "policy": "broken"}, ns)
        assert code == 7 and "broken.yaml:" in out["details"], out  # where it is wrong
        assert served(daemon) == [] and not has_table(ns)  # nothing of a failed ADD stays


def test_the_mapping_picks_a_pods_policy(daemon: Egressd, policies: Path, lab: Lab) -> None:
    (policies / "agents.yaml").write_text(POLICY.replace("cni-test", "agents"))
    mapping = [{"namespace": "agents", "pod": "coder-*", "policy": "agents"}]
    conf = config(daemon, policies, lab, prevResult=PREV, mapping=mapping)
    with netns("cnimap") as ns:
        args = "IgnoreUnknown=1;K8S_POD_NAMESPACE=agents;K8S_POD_NAME=coder-7"
        assert cni("ADD", conf, ns, CNI_ARGS=args)[0] == 0
        assert [b["policy"] for b in served(daemon)] == ["agents"]
        assert cni("DEL", conf, ns)[0] == 0
        args = "K8S_POD_NAMESPACE=agents;K8S_POD_NAME=reviewer"  # no entry: the default
        assert cni("ADD", conf, ns, CNI_ARGS=args)[0] == 0
        assert [b["policy"] for b in served(daemon)] == ["cni-test"]
        assert cni("DEL", conf, ns)[0] == 0


def test_gc_detaches_what_the_runtime_no_longer_lists(
    daemon: Egressd, policies: Path, lab: Lab
) -> None:
    conf = config(daemon, policies, lab, prevResult=PREV)
    with netns("cnigc1") as one, netns("cnigc2") as two:
        assert cni("ADD", conf, one, cid="keep")[0] == 0
        assert cni("ADD", conf, two, cid="stale")[0] == 0
        gc = {**config(daemon, policies, lab), "cniVersion": "1.1.0",
              "cni.dev/attachments": [{"containerID": "keep", "ifname": "eth0"}]}  # fmt: skip
        assert cni("GC", gc) == (0, None)
        assert len(served(daemon, "keep")) == 1 and served(daemon, "stale") == []
        assert has_table(one) and not has_table(two)
        assert cni("DEL", conf, one, cid="keep")[0] == 0


def test_status_and_add_fail_while_egressd_is_down(
    lab: Lab, policies: Path, state_dir: Path
) -> None:
    with egressd(state_dir) as d:
        conf = config(d, policies, lab, prevResult=PREV, cniVersion="1.1.0")
        assert cni("STATUS", conf) == (0, None)
        d.stop()
        with netns("cnidown") as ns:
            code, out = cni("STATUS", conf)
            assert code == 50 and out["code"] == 50 and "unreachable" in out["msg"], out
            code, out = cni("ADD", conf, ns)
            assert code == 11 and "egress" in out["msg"] and "not started" in out["msg"], out
            assert not has_table(ns)  # fail closed: the runtime does not start it
            assert cni("DEL", conf, ns) == (0, None)  # best effort


@contextmanager
def cgroup_of_its_own(tag: str) -> Iterator[Cgroup]:
    """A cgroup a runtime would make for the container (and its v1 freezer twin)."""
    mounts = find_mounts()
    assert mounts.v2 is not None
    name = unique(tag)
    dirs = [os.path.join(mounts.v2, name)]
    if mounts.freezer:
        dirs.append(os.path.join(mounts.freezer, name))
    for d in dirs:
        os.mkdir(d)
    try:
        yield Cgroup.attach_existing(dirs[0], dirs[1] if len(dirs) > 1 else None)
    finally:
        cg = Cgroup.attach_existing(dirs[0], dirs[1] if len(dirs) > 1 else None)
        with suppress(Exception):
            cg.kill()
        for d in reversed(dirs):
            with suppress(OSError):
                os.rmdir(d)


def connector(ns: str, cgroup: Cgroup | None, ip: str) -> subprocess.Popen[bytes]:
    """A process in the netns (and in ``cgroup``, joined before it execs) that connects
    to ``ip`` and stays."""
    code = (
        "import socket, time\ns = socket.socket(); s.settimeout(2)\n"
        f"try: s.connect(('{ip}', 80))\nexcept OSError: pass\ntime.sleep(300)"
    )
    argv = ["nsenter", f"--net=/run/netns/{ns}", SYSTEM_PYTHON, "-c", code]
    join = (lambda: cgroup.add_pid(os.getpid())) if cgroup is not None else None
    return subprocess.Popen(argv, preexec_fn=join)


def test_the_cgroup_is_bound_from_the_containers_processes(
    daemon: Egressd, policies: Path, lab: Lab, state_dir: Path
) -> None:
    conf = config(daemon, policies, lab, prevResult=PREV)
    with netns("cnicg") as ns, cgroup_of_its_own("cnicg") as cgroup:
        assert cni("ADD", conf, ns, cid="bindme")[0] == 0
        [box] = served(daemon, "bindme")
        # A host process in the netns (egress's own cgroup, the root here): blocked, and
        # journaled as not frozen, never freezing the host.
        host = connector(ns, None, "192.0.2.7")
        try:
            assert wait_until(lambda: _violations(state_dir, box["id"]), 20)
            [v] = _violations(state_dir, box["id"])
            assert v["action"] == "block" and "not frozen" in v["detail"], v
        finally:
            host.kill()
            host.wait(timeout=10)
        # The container's process, in a cgroup of its own: that cgroup is bound and frozen.
        proc = connector(ns, cgroup, "192.0.2.8")
        try:
            assert wait_until(cgroup.is_frozen, 20), _violations(state_dir, box["id"])
            assert proc.pid in cgroup.pids()
            [box] = served(daemon, "bindme")
            assert box["cgroup"] == cgroup.v2_path and box["state"] == "frozen"
            with Journal.open(state_dir) as journal:
                row = journal.sandbox(box["id"])
            assert row is not None and row["cgroup"] == cgroup.v2_path
            assert row["freezer"] == cgroup.freezer_path
        finally:
            with suppress(Exception):
                cgroup.kill()
            proc.kill()
            proc.wait(timeout=10)
        assert cni("DEL", conf, ns, cid="bindme")[0] == 0


@contextmanager
def pod_cgroups(tag: str) -> Iterator[tuple[Cgroup, Cgroup, Cgroup]]:
    """A pod's cgroup with two containers' under it, as a kubelet lays them out (v2, and
    the v1 freezer twins where the machine has them); everything in them killed after."""
    mounts = find_mounts()
    assert mounts.v2 is not None
    name = unique(tag)
    roots = [mounts.v2] + ([mounts.freezer] if mounts.freezer else [])
    rels = [name, f"{name}/c1", f"{name}/c2"]
    for root in roots:
        for rel in rels:
            os.mkdir(os.path.join(root, rel))

    def cg(rel: str) -> Cgroup:
        twin = os.path.join(mounts.freezer, rel) if mounts.freezer else None
        return Cgroup.attach_existing(os.path.join(roots[0], rel), twin)

    try:
        yield cg(rels[0]), cg(rels[1]), cg(rels[2])
    finally:
        with suppress(Exception):
            cg(rels[0]).kill()
        for root in roots:
            for rel in reversed(rels):
                with suppress(OSError):
                    os.rmdir(os.path.join(root, rel))


def test_a_pods_containers_are_frozen_together_and_reading_binds_nothing(
    daemon: Egressd, policies: Path, lab: Lab, state_dir: Path
) -> None:
    conf = config(daemon, policies, lab, prevResult=PREV)
    with netns("cnipod") as ns, pod_cgroups("cnipod") as (pod, c1, c2):
        assert cni("ADD", conf, ns, cid="pod")[0] == 0
        pause = subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", "sleep", "300"],
                                 preexec_fn=lambda: c1.add_pid(os.getpid()))  # fmt: skip
        assert wait_until(lambda: pause.pid in c1.pids(), 10)
        for _ in range(3):  # the API's reads (and CNI's, a probe's) bind nothing
            [box] = served(daemon, "pod")
            assert box["cgroup"] == "", box
        # A process outside the netns in the pod's cgroup: the only common cgroup holds
        # it, so it is refused (and the connect blocked, journaled as not frozen).
        outsider = subprocess.Popen(["sleep", "300"], preexec_fn=lambda: c2.add_pid(os.getpid()))
        first = connector(ns, c2, "192.0.2.9")
        assert wait_until(lambda: _violations(state_dir, box["id"]), 20)
        [v] = _violations(state_dir, box["id"])
        assert "not frozen" in v["detail"] and "outside" in v["detail"], v
        assert not pod.is_frozen() and not c1.is_frozen()
        outsider.kill()
        outsider.wait(timeout=10)
        # Now the pod's cgroup holds only the netns's processes, in both containers: it
        # is the one frozen, pause and app alike.
        second = connector(ns, c2, "192.0.2.10")
        try:
            assert wait_until(pod.is_frozen, 20), _violations(state_dir, box["id"])
            [box] = served(daemon, "pod")
            assert box["cgroup"] == pod.v2_path, box
            assert {pause.pid, first.pid, second.pid} <= set(pod.pids()) | set(c1.pids()) | set(
                c2.pids()
            )
        finally:
            with suppress(Exception):
                pod.kill()
            for proc in (pause, first, second):
                proc.kill()
                proc.wait(timeout=10)
        assert cni("DEL", conf, ns, cid="pod")[0] == 0


def test_a_freeze_takes_in_a_container_started_since_the_cgroup_was_bound(
    daemon: Egressd, policies: Path, lab: Lab, state_dir: Path
) -> None:
    """Bound to the first container's cgroup at its freeze, then resumed; a second
    container's process joins the netns and connects where its policy does not allow.
    egressd's loop asks the freeze of the cgroup it had bound; finishing it, egressd looks
    again and freezes what it finds now: the pod's cgroup, both containers."""
    conf = config(daemon, policies, lab, prevResult=PREV)
    with netns("cniwide") as ns, pod_cgroups("cniwide") as (pod, c1, c2):
        assert cni("ADD", conf, ns, cid="wide")[0] == 0
        procs = [connector(ns, c1, "192.0.2.11")]
        try:
            assert wait_until(c1.is_frozen, 20), _violations(state_dir, "wide")
            [box] = served(daemon, "wide")
            assert box["cgroup"] == c1.v2_path, box
            daemon.client.call("POST", f"/v1/sandboxes/{box['id']}/resume", {})
            assert wait_until(lambda: not c1.is_frozen(), 10)
            procs.append(connector(ns, c2, "192.0.2.12"))
            assert wait_until(pod.is_frozen, 20), _violations(state_dir, box["id"])
            [box] = served(daemon, "wide")
            assert box["cgroup"] == pod.v2_path and box["state"] == "frozen", box
            assert procs[1].pid in c2.pids() and procs[0].pid in c1.pids()

            # Nothing of the first ask stands on its own (let go of once the pod's freeze
            # is confirmed): the first container's cgroup is frozen by the pod's only,
            # and a resume thaws both containers.
            def own_freeze(path: str, name: str) -> str:
                with open(os.path.join(path, name)) as own:
                    return own.read().strip()

            def let_go() -> bool:
                v1 = c1.freezer_path
                return own_freeze(c1.v2_path, "cgroup.freeze") == "0" and (
                    v1 is None or own_freeze(v1, "freezer.self_freezing") == "0"
                )

            assert wait_until(let_go, 10)
            assert c1.v1_state() in (None, "FROZEN")  # FROZEN through its parent's
            daemon.client.call("POST", f"/v1/sandboxes/{box['id']}/resume", {})
            assert wait_until(lambda: not (c1.is_frozen() or c2.is_frozen()), 10)
        finally:
            for cg in (c1, c2):  # a v1-frozen task ignores SIGKILL until thawed
                with suppress(Exception):
                    cg.thaw(wait=False)
            with suppress(Exception):
                pod.kill()
            for proc in procs:
                proc.kill()
                proc.wait(timeout=10)
        assert cni("DEL", conf, ns, cid="wide")[0] == 0


def _violations(state_dir: Path, sandbox_id: str) -> list[dict[str, Any]]:
    with Journal.open(state_dir) as journal:
        return journal.violations(sandbox_id)


def test_egressd_in_a_cgroup_namespace_of_its_own_joins_the_hosts(tmp_path: Path) -> None:
    """A DaemonSet's containers get a cgroup namespace of their own, where every other
    process's cgroup reads as /..: enter_host_cgroupns joins the one of a process
    outside (PID 1 in the DaemonSet; here a process of the test's, PID 1 not being
    readable on this machine), and the real paths show again."""
    mounts = find_mounts()
    assert mounts.v2 is not None
    name = unique("cgns")
    inner = os.path.join(mounts.v2, name)
    os.mkdir(inner)
    outside = subprocess.Popen(["sleep", "60"])  # in the host's cgroup namespace
    code = (
        "import sys\nfrom egress.kernel.netns_cgroup import enter_host_cgroupns as e\n"
        "print(open('/proc/self/cgroup').read().splitlines()[-1])\n"
        f"print(e({outside.pid}), e({outside.pid}))\n"
        "print(open('/proc/self/cgroup').read().splitlines()[-1])\n"
    )
    try:
        argv = ["sh", "-c", f'echo $$ > {inner}/cgroup.procs && exec unshare --cgroup "$@"',
                "sh", sys.executable, "-c", code]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=ROOT)
    finally:
        outside.kill()
        outside.wait(timeout=10)
        os.rmdir(inner)
    assert done.stdout.split("\n")[:3] == ["0::/", "True False", f"0::/{name}"], done


def test_adoption_refuses_a_netns_that_is_not_the_one_attached(
    lab: Lab, policies: Path, state_dir: Path
) -> None:
    """A record names its netns by path, and /proc/PID/ns/net names another netns once
    the PID is reused: the next egressd checks the inode the record kept."""
    with egressd(state_dir) as d, netns("cniino") as ns:
        conf = config(d, policies, lab, prevResult=PREV)
        assert cni("ADD", conf, ns, cid="ino")[0] == 0
        [box] = served(d, "ino")
        d.stop()
        path = d.run_dir / f"{box['id']}.json"
        record = json.loads(path.read_text())
        st = os.stat(f"/run/netns/{ns}")
        assert record["netns_inode"] == [st.st_dev, st.st_ino]
        record["netns_inode"] = [0, 0]  # as if the path named another netns now
        path.write_text(json.dumps(record))
        d.start()
        assert served(d, "ino") == []
        assert "is not the one attached any more" in d.stderr()
        subprocess.run(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "egress"],
                       check=False)  # fmt: skip
        path.unlink()
