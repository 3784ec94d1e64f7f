"""egress.kernel.nfqueue against the kernel: queued TCP segments wait for our verdict.

Each test gets a netns of its own (random name, loopback only) whose output chain queues
every client-to-server TCP segment that is not SYN, FIN or RST (so the handshake's last
ACK too, which the verdict functions here always accept) to queue 5, without ``bypass``.
The server is a socket of this process in that netns; the client runs as nobody in a
subprocess; one select loop serves the queue and the server, with bounded waits only.
"""

from __future__ import annotations

import select
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from egress.datapath.firstbytes import Outcome, judge
from egress.errors import DatapathError
from egress.kernel import netns
from egress.kernel.nfqueue import NfqueueListener, QueuedPacket
from egress.kernel.nft import NftHandle
from tests.support import NOBODY
from tests.support.netns import nobody_argv, scratch_netns

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.usefixtures("require_root"),
]

PORT, QUEUE, MARK = 8080, 5, 0x2A
MATCH = f'oif "lo" tcp dport {PORT} tcp flags & (syn | fin | rst) == 0'
RULES = f"""
table inet t {{
    counter queued {{ }}
    counter repeated {{ }}
    chain output {{
        type filter hook output priority 0; policy accept;
        meta mark {MARK} counter name repeated accept
        {MATCH} counter name queued queue num {QUEUE}
    }}
}}
"""
# The same through iptables-nft, for kernels without nft_queue (CONFIG_NFT_QUEUE unset,
# as on this project's test machines): its NFQUEUE target runs through nft_compat.
XT_RULES = f"""*filter
:OUTPUT ACCEPT [0:0]
-A OUTPUT -m mark --mark {MARK} -j ACCEPT
-A OUTPUT -o lo -p tcp --dport {PORT} --tcp-flags SYN,FIN,RST NONE -j NFQUEUE --queue-num {QUEUE}
COMMIT
"""
DATA = b"GET / HTTP/1.1\r\nHost: queued.example\r\n\r\n" + bytes(range(256)) * 8
# Sends DATA, then waits for the server to close (no FIN of its own before that: a FIN
# may be merged into a retransmitted data segment, which the rule above would let by).
CLIENT = f"""
import socket, sys
s = socket.create_connection(("127.0.0.1", {PORT}), timeout=60)
s.sendall(bytes.fromhex(sys.argv[1]))
s.recv(1)
"""
NF_INET_LOCAL_OUT = 3
POSITIVE_WAIT = 15.0  # generous: a busy 2-vCPU machine
Verdict = Callable[[QueuedPacket], dict[str, Any] | None]  # verdict()'s kwargs; None: hold


@dataclass(frozen=True)
class Netns:
    name: str
    nft: NftHandle
    xt: bool  # the rules are iptables-nft's

    def counter(self, name: str) -> int:
        """Packets that hit the mark rule ("repeated") or the queue rule ("queued")."""
        if not self.xt:
            return self.nft.counter("inet", "t", name).packets
        argv = ["ip", "netns", "exec", self.name, "iptables-nft", "-w", "-nvxL", "OUTPUT"]
        out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=10)
        rows = out.stdout.splitlines()[2:]
        return int(rows[["repeated", "queued"].index(name)].split()[0])


def load_rules(name: str, nft: NftHandle) -> bool:
    """Load the queue rules, natively if the kernel can; True if iptables-nft did it."""
    try:
        nft.load(RULES)
        return False
    except DatapathError as exc:
        if "No such file or directory" not in str(exc):
            raise
    if shutil.which("iptables-nft-restore") is None:
        pytest.skip("the kernel has no nft queue expression and iptables-nft is missing")
    argv = ["ip", "netns", "exec", name, "iptables-nft-restore", "-w"]
    subprocess.run(argv, input=XT_RULES, text=True, check=True, timeout=10)
    return True


@pytest.fixture
def ns() -> Iterator[Netns]:
    with scratch_netns("nfq") as name:
        netns.loopback_up(name)
        with NftHandle.open(name) as nft:
            yield Netns(name, nft, load_rules(name, nft))


@pytest.fixture
def server(ns: Netns) -> Iterator[socket.socket]:
    with netns.in_netns(ns.name):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", PORT))
        sock.listen(8)
        sock.setblocking(False)
        yield sock


@contextmanager
def client(ns: Netns, data: bytes = DATA) -> Iterator[subprocess.Popen[bytes]]:
    """The client as nobody, without capabilities; killed (by its PID) on the way out."""
    proc = subprocess.Popen([*nobody_argv(ns.name, CLIENT), data.hex()], stdout=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


@dataclass
class Seen:
    packets: list[QueuedPacket] = field(default_factory=list)
    received: bytearray = field(default_factory=bytearray)
    accepted: int = 0  # connections the server accepted
    dropped: list[QueuedPacket] = field(default_factory=list)


def pump(
    listener: NfqueueListener | None,
    server: socket.socket,
    decide: Verdict,
    done: Callable[[Seen], bool],
    timeout: float,
) -> Seen:
    """Serve the queue (decide() gives each packet's verdict) and the server until
    done(seen) or the timeout; the server's connections are closed on return."""
    seen, conns = Seen(), list[socket.socket]()
    deadline = time.monotonic() + timeout
    try:
        while not done(seen):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            fds: list[Any] = [server, *conns] + ([listener] if listener else [])
            # Short rounds so that done() may also poll a counter.
            readable, _, _ = select.select(fds, [], [], min(remaining, 0.05))
            for r in readable:
                if r is listener and listener is not None:
                    for p in listener.read_packets():
                        seen.packets.append(p)
                        kwargs = decide(p)
                        if kwargs is None:
                            continue
                        if not kwargs.get("accept", True):
                            seen.dropped.append(p)
                        listener.verdict(p.packet_id, **kwargs)
                elif r is server:
                    conn, _ = server.accept()
                    conn.setblocking(False)
                    conns.append(conn)
                    seen.accepted += 1
                else:
                    chunk = r.recv(1 << 16)
                    seen.received += chunk
                    if not chunk:
                        conns.remove(r)
                        r.close()
        return seen
    finally:
        for conn in conns:
            conn.close()


def accept_all(p: QueuedPacket) -> dict[str, Any]:
    return {"accept": True}


def drop_data(p: QueuedPacket) -> dict[str, Any]:
    return {"accept": not p.tcp_payload}


def repeat_marked(p: QueuedPacket) -> dict[str, Any]:
    return {"accept": True, "mark": MARK, "repeat": True}


def got_all(seen: Seen) -> bool:
    return bytes(seen.received) == DATA


def got_all_counting(ns: Netns, counts: list[int]) -> Callable[[Seen], bool]:
    """got_all, which also reads the (queued, repeated) counters once all data is in:
    before the server closes, since the client's ACK of that FIN is queued too."""

    def done(seen: Seen) -> bool:
        if not got_all(seen):
            return False
        counts[:] = [ns.counter("queued"), ns.counter("repeated")]
        return True

    return done


def seq(p: QueuedPacket) -> int:
    ihl = (p.payload[0] & 0x0F) * 4
    return int(struct.unpack_from("!I", p.payload, ihl + 4)[0])


def test_accepted_segments_arrive_with_the_client_uid(ns: Netns, server: socket.socket) -> None:
    with NfqueueListener.open(ns.name, QUEUE) as listener, client(ns):
        counts: list[int] = []
        seen = pump(listener, server, accept_all, got_all_counting(ns, counts), POSITIVE_WAIT)
        assert (listener.overruns, listener.verdict_errors) == (0, 0)
    assert bytes(seen.received) == DATA
    assert seen.packets and counts == [len(seen.packets), 0]
    for p in seen.packets:
        assert p.packet is not None
        assert (p.packet.proto, p.packet.dst, p.packet.dport) == ("tcp", "127.0.0.1", PORT)
        assert p.packet.tcp_flags is not None and p.packet.tcp_flags & 0x07 == 0
        assert (p.uid, p.gid) == (NOBODY, NOBODY)
        assert (p.family, p.hw_protocol, p.hook, p.mark) == (4, 0x0800, NF_INET_LOCAL_OUT, None)
        assert abs(p.timestamp - time.time()) < 60
    data = [p for p in seen.packets if p.tcp_payload]
    assert data, "no payload segment was queued"
    first = data[0].tcp_payload
    assert DATA.startswith(first)
    found = judge(first)
    assert (found.outcome, found.name) == (Outcome.NAME, "queued.example")


def test_a_dropped_segment_never_reaches_the_server(ns: Netns, server: socket.socket) -> None:
    with NfqueueListener.open(ns.name, QUEUE) as listener, client(ns):
        # The original segment and at least one retransmission of it (RTO >= 200 ms): the
        # retransmission shows the server never acknowledged the bytes.
        seen = pump(listener, server, drop_data, lambda s: len(s.dropped) >= 2, POSITIVE_WAIT)
    assert len(seen.dropped) >= 2
    assert seq(seen.dropped[0]) == seq(seen.dropped[1])
    assert DATA.startswith(seen.dropped[0].tcp_payload)
    assert seen.received == b""


def test_without_a_listener_queued_packets_are_dropped(ns: Netns, server: socket.socket) -> None:
    NfqueueListener.open(ns.name, QUEUE).close()  # bound once, then gone: no bypass
    with client(ns):
        # Wait until the rule has seen the handshake's ACK and data (or retries of them).
        def done(seen: Seen) -> bool:
            return bool(seen.received) or ns.counter("queued") >= 3

        seen = pump(None, server, accept_all, done, POSITIVE_WAIT)
    assert seen.received == b""
    assert ns.counter("queued") >= 3
    assert seen.accepted == 0  # even the handshake's last ACK was dropped


def test_a_full_queue_drops_what_it_cannot_hold(ns: Netns, server: socket.socket) -> None:
    """No FAIL_OPEN: past maxlen the kernel drops instead of letting packets by."""
    with NfqueueListener.open(ns.name, QUEUE, maxlen=1) as listener, client(ns):

        def done(seen: Seen) -> bool:
            return bool(seen.received) or ns.counter("queued") >= 3

        seen = pump(listener, server, lambda p: None, done, POSITIVE_WAIT)  # hold them all
    assert seen.received == b""
    assert ns.counter("queued") >= 3
    assert len(seen.packets) == 1  # the handshake's ACK, held; the data found no room


def test_repeat_with_a_mark_reinjects_once(ns: Netns, server: socket.socket) -> None:
    with NfqueueListener.open(ns.name, QUEUE) as listener, client(ns):
        counts: list[int] = []
        seen = pump(listener, server, repeat_marked, got_all_counting(ns, counts), POSITIVE_WAIT)
        assert listener.verdict_errors == 0
    assert bytes(seen.received) == DATA
    ids = [p.packet_id for p in seen.packets]
    assert ids and len(set(ids)) == len(ids)
    assert all(p.mark is None for p in seen.packets)  # marked only by our verdict
    # Each segment was queued once, and re-ran the chain once, accepted by the mark rule.
    assert counts == [len(seen.packets), len(seen.packets)]
    assert any(p.tcp_payload for p in seen.packets)


def test_one_listener_per_queue_per_netns(ns: Netns, server: socket.socket) -> None:
    first = NfqueueListener.open(ns.name, QUEUE)
    try:
        refused = f"NFQUEUE {QUEUE} in {ns.name}: bind: Operation not permitted"
        with pytest.raises(DatapathError, match=refused):
            NfqueueListener.open(ns.name, QUEUE).close()
        # The refused bind left the first listener bound and working.
        with client(ns):
            seen = pump(first, server, accept_all, got_all, POSITIVE_WAIT)
        assert bytes(seen.received) == DATA
        # Queue numbers are per netns: the same number binds in another one.
        with scratch_netns("nfq") as other:
            NfqueueListener.open(other, QUEUE).close()
    finally:
        first.close()
    first.close()  # idempotent
    with pytest.raises(DatapathError, match="closed"):
        first.read_packets()
    NfqueueListener.open(ns.name, QUEUE).close()  # closing unbound it


def test_a_refused_verdict_is_counted(ns: Netns) -> None:
    with NfqueueListener.open(ns.name, QUEUE) as listener:
        start = time.monotonic()
        assert listener.read_packets() == []
        assert time.monotonic() - start < 0.1  # does not block when empty
        listener.verdict(123456, accept=True)  # no such packet held
        select.select([listener], [], [], 5.0)
        assert listener.read_packets() == []
        assert listener.verdict_errors == 1
        assert listener.last_verdict_error == "No such file or directory"
