"""egress.kernel.nflog against the kernel: logged drops arrive with 5-tuple, prefix, uid."""

from __future__ import annotations

import contextlib
import select
import socket
import statistics
import subprocess
import time
from collections.abc import Iterator

import pytest

from egress.errors import DatapathError
from egress.kernel import netns
from egress.kernel.nflog import NflogEvent, NflogListener
from egress.kernel.nft import NftHandle
from tests.support import NOBODY, SYSTEM_PYTHON
from tests.support.netns import Pair, run_as_nobody, sandbox_pair

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.usefixtures("require_root"),
]

RULES = """
table inet t {
    counter logged { }
    chain output {
        type filter hook output priority 0; policy accept;
        ip daddr 192.0.2.0/24 counter name logged log group 7 prefix "egress-test" drop
        ip6 daddr 2001:db8::/32 counter name logged log group 7 prefix "egress-test" drop
        ip daddr 198.51.100.0/24 log group 7 prefix "layer-a" log group 8 prefix "layer-b" drop
    }
}
"""

WORKLOAD = """
import socket
t = socket.socket(); t.setblocking(False)
try:
    t.connect(("192.0.2.10", 443))
except BlockingIOError:
    pass
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    u.sendto(b"query-bytes", ("192.0.2.11", 53))
except PermissionError:  # a dropped UDP send fails at once with EPERM
    pass
u6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
try:
    u6.sendto(b"v6-bytes", ("2001:db8::53", 5353))
except PermissionError:
    pass
print(t.getsockname()[1], u.getsockname()[1], u6.getsockname()[1])
"""


@pytest.fixture
def pair() -> Iterator[Pair]:
    with sandbox_pair() as p, NftHandle.open(p.sandbox) as nft:
        nft.load(RULES)
        yield p


def collect(listener: NflogListener, want: int, timeout: float = 5.0) -> list[NflogEvent]:
    events: list[NflogEvent] = []
    deadline = time.monotonic() + timeout
    while len(events) < want:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        select.select([listener], [], [], remaining)
        events += listener.read_events()
    return events


def _send_udp(ns: str, dst: str, count: int = 1, size: int = 8) -> None:
    with netns.in_netns(ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with sock:
        for _ in range(count):
            with contextlib.suppress(PermissionError):  # a dropped send fails with EPERM
                sock.sendto(b"x" * size, (dst, 9))


def test_tcp_and_udp_from_nobody_arrive_with_flow_prefix_and_uid(pair: Pair) -> None:
    with NflogListener.open(pair.sandbox, 7) as listener:
        result = run_as_nobody(pair.sandbox, WORKLOAD)
        assert result.returncode == 0, result.stderr
        tport, uport, u6port = (int(p) for p in result.stdout.split())
        events = collect(listener, 3)
    assert len(events) == 3
    by_dst = {e.flow.dst: e for e in events if e.flow is not None}
    tcp, udp, udp6 = by_dst["192.0.2.10"], by_dst["192.0.2.11"], by_dst["2001:db8::53"]
    for e in events:
        assert (e.group, e.prefix, e.uid, e.gid) == (7, "egress-test", NOBODY, NOBODY)
    assert (tcp.family, tcp.hw_protocol) == (4, 0x0800)
    assert (udp6.family, udp6.hw_protocol) == (6, 0x86DD)
    assert tcp.flow is not None and tcp.packet is not None
    assert (tcp.flow.proto, tcp.flow.src, tcp.flow.sport, tcp.flow.dport) == (
        "tcp",
        pair.sandbox4,
        tport,
        443,
    )
    assert tcp.packet.tcp_flags == 0x02  # the SYN
    assert udp.flow is not None and udp.packet is not None
    assert (udp.flow.proto, udp.flow.sport, udp.flow.dport) == ("udp", uport, 53)
    assert udp.packet.payload == b"query-bytes"
    assert udp6.flow is not None and udp6.packet is not None
    assert (udp6.flow.src, udp6.flow.sport, udp6.flow.dport) == (pair.sandbox6, u6port, 5353)
    assert udp6.packet.payload == b"v6-bytes"
    assert all(abs(e.timestamp - time.time()) < 30 for e in events)


def test_two_listeners_on_two_groups_both_get_copies(pair: Pair) -> None:
    with NflogListener.open(pair.sandbox, 7) as a, NflogListener.open(pair.sandbox, 8) as b:
        _send_udp(pair.sandbox, "198.51.100.1")
        got_a, got_b = collect(a, 1), collect(b, 1)
    assert [(e.group, e.prefix) for e in got_a] == [(7, "layer-a")]
    assert [(e.group, e.prefix) for e in got_b] == [(8, "layer-b")]
    assert got_a[0].payload == got_b[0].payload
    assert got_a[0].uid == 0  # sent by this (root) test process


def test_one_listener_per_group_and_rebind_after_close(pair: Pair) -> None:
    first = NflogListener.open(pair.sandbox, 7)
    try:
        with pytest.raises(DatapathError, match="Operation not permitted"):
            NflogListener.open(pair.sandbox, 7)
    finally:
        first.close()
    first.close()  # idempotent
    with NflogListener.open(pair.sandbox, 7) as again:
        _send_udp(pair.sandbox, "192.0.2.1")
        assert len(collect(again, 1)) == 1
    with pytest.raises(DatapathError, match="closed"):
        again.read_events()


def test_groups_are_per_netns(pair: Pair) -> None:
    with NflogListener.open(pair.sandbox, 7), NflogListener.open(pair.uplink, 7) as up:
        _send_udp(pair.sandbox, "192.0.2.1")
        assert collect(up, 1, timeout=0.2) == []


def test_read_events_does_not_block_when_empty(pair: Pair) -> None:
    with NflogListener.open(pair.sandbox, 7) as listener:
        start = time.monotonic()
        assert listener.read_events() == []
        assert time.monotonic() - start < 0.1


def test_copy_range_cuts_payload(pair: Pair) -> None:
    with NflogListener.open(pair.sandbox, 7, copy_range=64) as listener:
        _send_udp(pair.sandbox, "192.0.2.1", size=1000)
        (event,) = collect(listener, 1)
    assert len(event.payload) == 64
    assert event.packet is not None and event.packet.truncated
    assert event.packet.payload == b"x" * (64 - 28)


def test_overflow_is_counted_and_the_counter_sees_everything(pair: Pair) -> None:
    sent = 2000
    with (
        NftHandle.open(pair.sandbox) as nft,
        NflogListener.open(pair.sandbox, 7, rcvbuf=4096) as listener,
    ):
        _send_udp(pair.sandbox, "192.0.2.1", count=sent)
        events = collect(listener, sent, timeout=0.5)
        assert listener.overruns >= 1
        assert len(events) < sent
        assert nft.counter("inet", "t", "logged")[0] == sent


SENDER = """
import socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(300):
    try:
        s.sendto(repr(time.time()).encode(), ("192.0.2.1", 9))
    except PermissionError:
        pass
    time.sleep(0.002)
"""


def test_drop_to_receipt_latency_is_printed(pair: Pair) -> None:
    """Not a timed assertion: another process sends stamped datagrams into the drop rule;
    prints the time from its sendto to this process holding the event."""
    with NflogListener.open(pair.sandbox, 7) as listener:
        sender = subprocess.Popen(
            ["ip", "netns", "exec", pair.sandbox, SYSTEM_PYTHON, "-c", SENDER]
        )
        try:
            events = collect(listener, 300, timeout=20)
        finally:
            sender.wait(timeout=30)
    lat = sorted(
        (e.timestamp - float(e.packet.payload)) * 1000 for e in events if e.packet is not None
    )
    assert lat
    print(
        f"\nNFLOG drop->received (other process): median {statistics.median(lat):.3f} ms,"
        f" p99 {lat[max(0, int(len(lat) * 0.99) - 1)]:.3f} ms (n={len(lat)})"
    )
