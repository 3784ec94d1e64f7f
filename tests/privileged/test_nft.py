"""egress.kernel.nft against the kernel: atomic loads, sets with timeouts, counters."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from egress.errors import DatapathError, SandboxError
from egress.kernel import netns
from egress.kernel.nft import NftHandle
from egress.kernel.nft_sets import NetlinkSets
from egress.kernel.nft_worker import NftWorker
from tests.support.netns import scratch_netns

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.usefixtures("require_root"),
]

TABLE = """
table inet egress {
    counter lo_udp { }
    set allow4 {
        type ipv4_addr . inet_proto . inet_service
        flags timeout
    }
    set plain6 {
        type ipv6_addr
    }
    set nets4 {
        type ipv4_addr
        flags interval
    }
    chain output {
        type filter hook output priority 0; policy accept;
        oif lo udp dport 9 counter name lo_udp
    }
}
"""


@pytest.fixture
def ns() -> Iterator[str]:
    with scratch_netns("nft") as name:
        yield name


@pytest.fixture(scope="module")
def worker() -> Iterator[NftWorker]:
    w = NftWorker()
    try:
        yield w
    finally:
        w.close()


@pytest.fixture(params=["in-process", "worker"])
def nft(request: pytest.FixtureRequest, ns: str, worker: NftWorker) -> Iterator[NftHandle]:
    """Every handle test runs twice: libnftables in this process, and in egressd's
    worker process (same calls, carried over a pipe)."""
    handle = NftHandle.open(ns, worker if request.param == "worker" else None)
    try:
        handle.load(TABLE)
        yield handle
    finally:
        handle.close()


def _tables_via_cli(ns: str) -> str:
    return subprocess.run(
        ["ip", "netns", "exec", ns, "nft", "list", "tables"], capture_output=True, text=True
    ).stdout


def _keys(nft: NftHandle, set_name: str = "allow4") -> set[str]:
    return {e["key"] for e in nft.list_set("inet", "egress", set_name)}


def test_handle_acts_on_its_netns_only(nft: NftHandle, ns: str) -> None:
    assert nft.table_exists("inet", "egress")
    assert "table inet egress" in _tables_via_cli(ns)
    with scratch_netns("other") as other, NftHandle.open(other) as there:
        assert not there.table_exists("inet", "egress")
        assert "egress" not in _tables_via_cli(other)


def test_load_is_atomic(ns: str) -> None:
    # nft 1.0.6 one-liners need ";" or a newline after a nested block: "{ chain c {...}; }"
    bad = "table inet half { chain c { type filter hook output priority 0; }; }\n"
    bad += "add rule inet half c tcp dport 80 jump nowhere\n"
    with NftHandle.open(ns) as nft:
        with pytest.raises(DatapathError, match="No such file or directory") as err:
            nft.load(bad)
        assert "Error: Could not process rule" in str(err.value)  # nft's own text
        assert not nft.table_exists("inet", "half")


def test_check_validates_without_applying(ns: str) -> None:
    with NftHandle.open(ns) as nft:
        nft.check("table inet dry { }")
        assert not nft.table_exists("inet", "dry")
        with pytest.raises(DatapathError, match="syntax error"):
            nft.check("table inet dry { bogus }")
        nft.load("table inet dry { }")  # dry-run flag was reset
        assert nft.table_exists("inet", "dry")


def test_add_elements_batch_with_timeout(nft: NftHandle) -> None:
    elems = ["192.0.2.1 . tcp . 443", "192.0.2.2 . udp . 53", "198.51.100.7 . tcp . 8443"]
    nft.add_elements("inet", "egress", "allow4", elems, timeout_s=60)
    listed = nft.list_set("inet", "egress", "allow4")
    assert {e["key"] for e in listed} == set(elems)
    for e in listed:
        assert e["timeout"] == 60
        assert 55 <= e["expires"] <= 60
    assert listed[0]["value"]["concat"][1] in ("tcp", "udp")


def test_readd_replaces_the_timeout(nft: NftHandle) -> None:
    """Re-adding refreshes an element, and takes the NEW timeout, even a shorter one."""
    elem = ["192.0.2.1 . tcp . 443"]
    nft.add_elements("inet", "egress", "allow4", elem, timeout_s=5)
    nft.add_elements("inet", "egress", "allow4", elem, timeout_s=60)
    assert nft.list_set("inet", "egress", "allow4")[0]["timeout"] == 60
    nft.add_elements("inet", "egress", "allow4", elem, timeout_s=10)
    assert nft.list_set("inet", "egress", "allow4")[0]["timeout"] == 10


def test_elements_expire(nft: NftHandle) -> None:
    nft.add_elements("inet", "egress", "allow4", ["192.0.2.9 . tcp . 443"], timeout_s=0.2)
    deadline = time.monotonic() + 5
    while _keys(nft):
        assert time.monotonic() < deadline, "element did not expire"
        time.sleep(0.05)


def test_plain_and_interval_sets(nft: NftHandle) -> None:
    nft.add_elements("inet", "egress", "plain6", ["2001:db8::1", "2001:db8::2"])
    assert _keys(nft, "plain6") == {"2001:db8::1", "2001:db8::2"}
    assert nft.list_set("inet", "egress", "plain6")[0]["timeout"] is None
    nft.add_elements("inet", "egress", "nets4", ["10.0.0.0/8", "192.0.2.10-192.0.2.20"])
    assert _keys(nft, "nets4") == {"10.0.0.0/8", "192.0.2.10-192.0.2.20"}


def test_delete_elements(nft: NftHandle) -> None:
    elems = ["192.0.2.1 . tcp . 443", "192.0.2.2 . tcp . 443"]
    nft.add_elements("inet", "egress", "allow4", elems, timeout_s=60)
    nft.delete_elements("inet", "egress", "allow4", elems[:1])
    assert _keys(nft) == {elems[1]}
    absent = "203.0.113.1 . tcp . 1"
    with pytest.raises(DatapathError, match="No such file"):
        nft.delete_elements("inet", "egress", "allow4", [elems[1], absent])
    assert _keys(nft) == {elems[1]}  # the failed batch changed nothing
    nft.delete_elements("inet", "egress", "allow4", [elems[1], absent], missing_ok=True)
    assert _keys(nft) == set()


@pytest.mark.parametrize(
    "element",
    [
        "192.0.2.1 . tcp . 443 } ; flush ruleset ; add element inet egress allow4 { 1.1.1.1",
        '192.0.2.1 . tcp . 443 comment "x"',
        "192.0.2.1\n. tcp . 443",
        "",
    ],
)
def test_hostile_element_text_is_refused(nft: NftHandle, element: str) -> None:
    with pytest.raises(DatapathError, match="invalid set element"):
        nft.add_elements("inet", "egress", "allow4", [element], timeout_s=60)
    assert nft.table_exists("inet", "egress")
    assert _keys(nft) == set()


def test_bad_names_and_kernel_errors(nft: NftHandle) -> None:
    with pytest.raises(DatapathError, match="invalid nft set name"):
        nft.add_elements("inet", "egress", "allow4; flush ruleset", ["192.0.2.1 . tcp . 1"])
    with pytest.raises(DatapathError, match="invalid nft family"):
        nft.table_exists("inet6", "egress")
    with pytest.raises(DatapathError, match="mismatch"):
        nft.add_elements("inet", "egress", "allow4", ["192.0.2.1 . tcp"], timeout_s=60)
    with pytest.raises(DatapathError, match="timeout must be positive"):
        nft.add_elements("inet", "egress", "allow4", ["192.0.2.1 . tcp . 1"], timeout_s=0)


def test_counter_counts(nft: NftHandle, ns: str) -> None:
    assert nft.counter("inet", "egress", "lo_udp") == (0, 0)
    netns.loopback_up(ns)
    with netns.in_netns(ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with sock:
        for _ in range(3):
            sock.sendto(b"x" * 10, ("127.0.0.1", 9))
    packets, nbytes = nft.counter("inet", "egress", "lo_udp")
    assert packets == 3
    assert nbytes == 3 * (20 + 8 + 10)
    with pytest.raises(DatapathError):
        nft.counter("inet", "egress", "nosuch")


def test_delete_table_is_idempotent(nft: NftHandle) -> None:
    nft.delete_table("inet", "egress")
    assert not nft.table_exists("inet", "egress")
    nft.delete_table("inet", "egress")


def test_closed_handle_raises(ns: str) -> None:
    nft = NftHandle.open(ns)
    nft.close()
    nft.close()
    with pytest.raises(DatapathError, match="closed"):
        nft.table_exists("inet", "egress")


def test_open_in_missing_netns_raises() -> None:
    with pytest.raises(SandboxError):
        NftHandle.open("egt-no-such-netns")


@pytest.mark.parametrize("engine", ["in-process", "worker"])
def test_handle_keeps_its_netns_after_it_is_gone_from_run(
    ns: str, worker: NftWorker, engine: str
) -> None:
    """A handle pins its netns (the context's socket, or the descriptor the worker enters
    through): after /run/netns/NAME is removed, and even once the name is reused for
    another netns, it acts on the one it was opened on."""
    nft = NftHandle.open(ns, worker if engine == "worker" else None)
    try:
        netns.remove_netns(ns)
        netns.create_netns(ns)  # the same name, another netns
        nft.load("table inet pinned { }")
        assert nft.table_exists("inet", "pinned")
        with NftHandle.open(ns) as other:
            assert not other.table_exists("inet", "pinned")
    finally:
        nft.close()


def test_netlink_sets_add_and_delete(nft: NftHandle, ns: str) -> None:
    """The resolver's own netlink writer: add with a timeout, delete (its revocation of a
    too-late answer), and a delete naming an absent element fails as a whole."""
    sets = NetlinkSets(ns)
    try:
        elems = ("192.0.2.1 . tcp . 443", "192.0.2.2 . udp . 53")
        sets.add("allow4", elems, 60)
        assert _keys(nft) == set(elems)
        sets.delete("allow4", elems[:1])
        assert _keys(nft) == {elems[1]}
        with pytest.raises(OSError):
            sets.delete("allow4", (elems[1], "203.0.113.1 . tcp . 1"))
        assert _keys(nft) == {elems[1]}
    finally:
        sets.close()


def test_worker_handle_in_missing_netns_raises(worker: NftWorker) -> None:
    with pytest.raises(SandboxError, match="egt-no-such-netns"):
        NftHandle.open("egt-no-such-netns", worker)


# A process holding descriptors past FD_SETSIZE, like egressd with ~120 sandboxes.
_MANY_FDS = """
import os, resource, sys
from egress.kernel import nft
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(4096, soft), max(4096, hard)))
held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
if sys.argv[1] == "worker":
    nft.use_worker()
handle = nft.NftHandle.open(sys.argv[2])
handle.load("table inet manyfds { set s { type ipv4_addr; }; }")
handle.add_elements("inet", "manyfds", "s", ["192.0.2.1"])
print(len(handle.list_set("inet", "manyfds", "s")))
"""


@pytest.mark.parametrize("engine", ["in-process", "worker"])
def test_many_descriptors(ns: str, engine: str) -> None:
    """Why egressd uses the worker: with 1,100 descriptors open, libnftables in-process
    aborts the process (select() on a descriptor >= 1024); through the worker it works."""
    out = subprocess.run(
        [sys.executable, "-c", _MANY_FDS, engine, ns], capture_output=True, text=True, timeout=60
    )
    if engine == "worker":
        assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr
    else:
        assert out.returncode < 0, (out.returncode, out.stdout, out.stderr)  # killed: SIGABRT


def test_a_dead_worker_is_started_again(ns: str) -> None:
    """A worker killed between commands costs nothing: the next command starts a new one
    (nothing of it had been sent, so nothing is ambiguous)."""
    w = NftWorker()
    try:
        handle = NftHandle.open(ns, w)
        handle.load(TABLE)
        assert w._proc is not None
        w._proc.kill()
        w._proc.wait()
        assert handle.table_exists("inet", "egress")
        assert w.restarts == 1 and w.requests == 2
    finally:
        w.close()
