"""egress.kernel.netns against the real kernel: namespaces, setns, links, sysctls."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from egress.errors import SandboxError
from egress.kernel import netns
from tests.support import ROOT
from tests.support.netns import Pair, ifname, ns_inode, sandbox_pair, scratch_netns, unique

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.usefixtures("require_root"),
]

SIOCGSKNS = 0x894C  # ioctl: an fd for the netns a socket belongs to


@pytest.fixture
def ns() -> Iterator[str]:
    with scratch_netns() as name:
        yield name


@pytest.fixture
def pair() -> Iterator[Pair]:
    with sandbox_pair() as p:
        yield p


def _here() -> int:
    return ns_inode("/proc/thread-self/ns/net")


def test_create_is_visible_to_iproute2_and_removal_is_idempotent() -> None:
    name = unique("vis")
    netns.create_netns(name)
    try:
        assert netns.netns_exists(name)
        assert netns.netns_path(name) == f"/run/netns/{name}"
        assert (
            name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        )
        r = subprocess.run(["ip", "netns", "exec", name, "ip", "-o", "link"], capture_output=True)
        assert r.returncode == 0
        assert r.stdout.decode().count("\n") == 1  # a fresh netns has only lo
    finally:
        netns.remove_netns(name)
    assert not netns.netns_exists(name)
    netns.remove_netns(name)  # again: no error


def test_create_existing_raises(ns: str) -> None:
    with pytest.raises(SandboxError, match="already exists"):
        netns.create_netns(ns)
    assert netns.netns_exists(ns)  # the failed attempt did not remove the original


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b"])
def test_invalid_names_raise(bad: str) -> None:
    with pytest.raises(SandboxError):
        netns.create_netns(bad)


def test_create_leaves_caller_in_its_netns(ns: str) -> None:
    before = _here()
    with scratch_netns():
        assert _here() == before


def test_in_netns_switches_and_restores(ns: str) -> None:
    host = _here()
    with netns.in_netns(ns):
        assert _here() == ns_inode(netns.netns_path(ns))
        with netns.in_netns(None):
            assert _here() == ns_inode(netns.netns_path(ns))
    assert _here() == host


def test_in_netns_restores_on_exception(ns: str) -> None:
    host = _here()
    with pytest.raises(RuntimeError), netns.in_netns(ns):
        raise RuntimeError("boom")
    assert _here() == host


# A pool thread whose caller swallows the error (as /metrics' kernel read does) and which
# then takes another job: it must not get to that job from inside the sandbox's netns.
_STUCK = """
import sys, threading
from egress.kernel import netns
real, calls = netns._setns, []
def setns(fd):
    calls.append(fd)
    if len(calls) == 2:  # the way back
        raise OSError(12, "Cannot allocate memory")
    real(fd)
netns._setns = setns
def job():
    try:
        with netns.in_netns(sys.argv[1]):
            pass
    except Exception:
        pass
    print("next job ran", flush=True)
thread = threading.Thread(target=job)
thread.start()
thread.join()
print("process went on", flush=True)
"""


def test_a_thread_that_cannot_return_to_its_netns_ends_the_process(ns: str) -> None:
    proc = subprocess.run([sys.executable, "-c", _STUCK, ns], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)  # fmt: skip
    assert proc.returncode == netns.FATAL_EXIT, proc.stderr
    assert proc.stdout == ""
    assert "egress: fatal: " in proc.stderr
    assert "a thread cannot return to its network namespace" in proc.stderr


def _interrupted_on_the_way_back(monkeypatch: pytest.MonkeyPatch, nth: int) -> None:
    """The ``nth`` setns raises what a signal handler would, before it ran."""
    real, calls = netns._setns, []

    def setns(fd: int) -> None:
        calls.append(fd)
        if len(calls) == nth:
            raise KeyboardInterrupt
        real(fd)

    monkeypatch.setattr(netns, "_setns", setns)


def test_a_signal_on_the_way_back_out_of_in_netns_still_returns(
    ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = _here()
    _interrupted_on_the_way_back(monkeypatch, 2)  # the first enters
    with pytest.raises(KeyboardInterrupt), netns.in_netns(ns):
        assert _here() != host
    assert _here() == host


def test_a_signal_on_the_way_back_from_a_new_netns_still_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    host = _here()
    name = unique("sig")
    _interrupted_on_the_way_back(monkeypatch, 1)  # unshare enters; the first setns returns
    try:
        with pytest.raises(KeyboardInterrupt):
            netns.create_netns(name)
        assert _here() == host
    finally:
        monkeypatch.undo()
        with contextlib.suppress(SandboxError):
            netns.remove_netns(name)


def test_in_netns_nests(pair: Pair) -> None:
    host = _here()
    with netns.in_netns(pair.uplink):
        with netns.in_netns(pair.sandbox):
            assert _here() == ns_inode(netns.netns_path(pair.sandbox))
        assert _here() == ns_inode(netns.netns_path(pair.uplink))
    assert _here() == host


def test_in_netns_accepts_a_proc_path(ns: str) -> None:
    child = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "30"])
    try:
        path = f"/proc/{child.pid}/ns/net"
        deadline = time.monotonic() + 5
        while ns_inode(path) != ns_inode(netns.netns_path(ns)):  # until exec has setns'd
            assert time.monotonic() < deadline
            time.sleep(0.005)
        with netns.in_netns(path):
            assert _here() == ns_inode(netns.netns_path(ns))
    finally:
        child.kill()
        child.wait()


def test_in_netns_missing_raises() -> None:
    with pytest.raises(SandboxError), netns.in_netns(unique("missing")):
        pass


def test_in_netns_affects_only_the_calling_thread(ns: str) -> None:
    host = _here()
    seen: dict[str, int] = {}
    inside, release = threading.Event(), threading.Event()

    def worker() -> None:
        with netns.in_netns(ns):
            seen["worker"] = _here()
            inside.set()
            release.wait(5)

    t = threading.Thread(target=worker)
    t.start()
    try:
        assert inside.wait(5)
        assert _here() == host
        assert seen["worker"] == ns_inode(netns.netns_path(ns))
    finally:
        release.set()
        t.join()


def test_socket_opened_inside_stays_in_that_netns(ns: str) -> None:
    with netns.in_netns(ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        fd = fcntl.ioctl(sock.fileno(), SIOCGSKNS)
        try:
            assert os.fstat(fd).st_ino == ns_inode(netns.netns_path(ns))
            assert _here() != ns_inode(netns.netns_path(ns))
        finally:
            os.close(fd)
    finally:
        sock.close()


def test_veth_addresses_routes_connect_v4_and_v6(pair: Pair) -> None:
    assert netns.link_exists(pair.sandbox_if, pair.sandbox)
    assert netns.link_exists(pair.uplink_if, pair.uplink)
    assert not netns.link_exists(pair.sandbox_if, pair.uplink)
    assert netns.default_route_ifname(pair.sandbox) == pair.sandbox_if
    assert netns.default_route_ifname(pair.uplink) is None
    for family, server, client in (
        (socket.AF_INET, pair.uplink4, pair.sandbox4),
        (socket.AF_INET6, pair.uplink6, pair.sandbox6),
    ):
        assert _tcp_roundtrip(pair, family, server) == client


def _tcp_roundtrip(pair: Pair, family: int, server_addr: str) -> str:
    """Connect from the sandbox to a listener in the uplink; return the peer address."""
    with netns.in_netns(pair.uplink):
        srv = socket.socket(family, socket.SOCK_STREAM)
    with srv:
        srv.bind((server_addr, 0))
        srv.listen(1)
        with netns.in_netns(pair.sandbox):
            cli = socket.create_connection((server_addr, srv.getsockname()[1]), timeout=5)
        with cli:
            conn, peer = srv.accept()
            conn.close()
            return str(peer[0])


def test_default_route_ifname_v6_only(ns: str) -> None:
    dev = ifname("v")
    with scratch_netns("peer") as peer:
        netns.create_veth_pair(dev, "eth0", peer, ns)
        netns.set_up(dev, ns)
        netns.add_address(dev, "fd00:202::1/64", ns)
        assert netns.default_route_ifname(ns) is None
        netns.add_default_route("fd00:202::2", ns, dev)
        assert netns.default_route_ifname(ns) == dev


def test_veth_with_current_netns_as_host_side(ns: str) -> None:
    """host_netns=None puts the host end where the calling thread is; run it inside a
    scratch netns so the real host namespace is never touched."""
    dev = ifname("h")
    with scratch_netns("peer") as peer:
        with netns.in_netns(ns):
            netns.create_veth_pair(dev, "eth0", peer, None)
            assert netns.link_exists(dev, None)
        assert netns.link_exists(dev, ns)
        assert netns.link_exists("eth0", peer)


def test_delete_link_removes_both_ends_and_is_idempotent(pair: Pair) -> None:
    netns.delete_link(pair.uplink_if, pair.uplink)
    assert not netns.link_exists(pair.uplink_if, pair.uplink)
    assert not netns.link_exists(pair.sandbox_if, pair.sandbox)
    netns.delete_link(pair.uplink_if, pair.uplink)
    netns.delete_link(pair.uplink_if, unique("gone"))  # missing netns: nothing to do


def test_link_errors_are_sandbox_errors(ns: str) -> None:
    with pytest.raises(SandboxError, match="no link"):
        netns.set_up("nosuch0", ns)
    with pytest.raises(SandboxError, match="no link"):
        netns.add_address("nosuch0", "10.0.0.1/24", ns)
    with pytest.raises(SandboxError, match="default route"):
        netns.add_default_route("10.9.9.9", ns)  # no route to the gateway: ENETUNREACH


def test_sysctl_is_per_netns_even_from_a_worker_thread(pair: Pair) -> None:
    """/proc/sys/net resolves against the opening THREAD's netns (unlike /proc/self/net,
    which follows the thread-group leader)."""
    host_value = netns.get_sysctl(None, "net.ipv4.ip_forward")
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            netns.set_sysctl(pair.uplink, "net.ipv4.ip_forward", 1)
            netns.set_sysctl(pair.uplink, "net.ipv6.conf.all.forwarding", 1)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert not errors
    assert netns.get_sysctl(pair.uplink, "net.ipv4.ip_forward") == "1"
    assert netns.get_sysctl(pair.uplink, "net.ipv6.conf.all.forwarding") == "1"
    assert netns.get_sysctl(pair.sandbox, "net.ipv4.ip_forward") == "0"
    assert netns.get_sysctl(None, "net.ipv4.ip_forward") == host_value


def test_one_sysctls_session_reads_and_writes_its_own_netns(pair: Pair) -> None:
    """A session opens /proc/sys/net/ipv4 and ipv6 once and the rest relative to them:
    what it reads and writes is its netns's, key after key, and the next session in
    another netns sees that one's."""
    keys = ["net.ipv4.ip_forward", "net/ipv6/conf/all/forwarding",
            f"net/ipv4/conf/{pair.uplink_if}/forwarding", "net.ipv4.ping_group_range"]  # fmt: skip
    with netns.sysctls(pair.uplink) as found:
        found.set(keys[0], 1)
        found.set(keys[1], 1)
        assert [found.find(k) for k in keys[:3]] == ["1", "1", "1"]
        assert found.find("net/ipv4/conf/no-such-if/forwarding") is None
        with pytest.raises(SandboxError, match="no such key"):
            found.get("net/ipv6/conf/no-such-if/forwarding")
    with netns.sysctls(pair.sandbox) as found:
        assert [found.find(k) for k in keys[:2]] == ["0", "0"]
        found.set(keys[3], "0 2147483647")
    assert netns.get_sysctl(pair.sandbox, keys[3]).split() == ["0", "2147483647"]
    assert netns.get_sysctl(pair.uplink, keys[3]).split() != ["0", "2147483647"]
    assert netns.get_sysctl(pair.uplink, keys[1]) == "1"


def test_extra_sysctls_are_written_as_the_netns_is_made(ns: str) -> None:
    name = ns + "x"
    netns.create_netns(name, (("net/ipv4/ping_group_range", "0 2147483647"),))
    try:
        assert netns.get_sysctl(name, "net.ipv4.ping_group_range").split() == ["0", "2147483647"]
        assert netns.get_sysctl(name, "net.ipv6.conf.default.forwarding") == "0"
    finally:
        netns.remove_netns(name)


@pytest.mark.parametrize("key", ["net.ipv4.no_such_knob", "net/../../etc/passwd", ""])
def test_sysctl_unknown_or_hostile_key_raises(ns: str, key: str) -> None:
    with pytest.raises(SandboxError):
        netns.set_sysctl(ns, key, 1)


def test_sysctl_path_form_for_names_with_dots(pair: Pair) -> None:
    key = f"net/ipv4/conf/{pair.sandbox_if}/forwarding"
    netns.set_sysctl(pair.sandbox, key, 1)
    assert netns.get_sysctl(pair.sandbox, key) == "1"


def test_create_wire_speed_is_printed() -> None:
    """Not a timed assertion: prints how long a sandbox-shaped setup takes."""
    start = time.perf_counter()
    with sandbox_pair():
        made = time.perf_counter()
    done = time.perf_counter()
    print(
        f"\n2 netns + veth + 4 addresses + 2 routes: {(made - start) * 1000:.1f} ms;"
        f" teardown {(done - made) * 1000:.1f} ms"
    )
