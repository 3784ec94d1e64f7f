"""ResolverServer on loopback, on asyncio's loop and on uvloop (when installed), against a
stub upstream on 127.0.0.1:0 and a fake nft handle that records what the kernel was told."""

from __future__ import annotations

import asyncio
import random
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from dnslib import QTYPE, RR, A, DNSRecord

from egress.errors import DatapathError
from egress.inline.server import ResolverServer
from egress.model import Violation
from egress.policy import parse_policy
from egress.resolver import wire
from egress.resolver.core import ResolverCore

pytestmark = pytest.mark.usefixtures("no_upstream_supply_left")


POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: t}
spec:
  dns:
    upstreams: ["192.0.2.53"]
    allow: [allowed.test, slow.test, "*.slow.test", spoofed.test, truncated.test, rebind.test]
    rate_limit: {qps: 1000000, burst: 1000000}
  connect:
    ports: [443]
"""


@dataclass
class FakeNft:
    """No ``netns``: the server falls back from netlink to this handle's add_elements."""

    added: list[tuple[str, list[str], float | None]] = field(default_factory=list)
    fail: bool = False

    def add_elements(
        self, family: str, table: str, set_name: str, elements: list[str], timeout_s: float
    ) -> None:
        if self.fail:
            raise DatapathError("nft failed: No such file or directory")
        self.added.append((set_name, elements, timeout_s))

    def delete_elements(self, *args: object, **kwargs: object) -> None:
        pass


class Stub(asyncio.DatagramProtocol):
    """allowed.test answers; slow.test never does; spoofed.test first gets a wrong ID;
    rebind.test is answered with a private address.
    ``garbled``: every answer is a header cut short after its ID and flags."""

    def __init__(self, garbled: bool = False) -> None:
        self.queries: list[bytes] = []
        self.transport: asyncio.DatagramTransport | None = None
        self.garbled = garbled

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self.transport is not None
        self.queries.append(data)
        if self.garbled:
            self.transport.sendto(data[:2] + b"\x81\x80\x00", addr)
            return
        q = DNSRecord.parse(data)
        name = str(q.q.qname).rstrip(".")
        if name == "slow.test" or name.endswith(".slow.test"):
            return
        if name == "truncated.test":  # "ask me over TCP"
            r = q.reply()
            r.header.tc = 1
            self.transport.sendto(r.pack(), addr)
            return
        r = q.reply()
        inside = name == "rebind.test"  # an answer pointing inside: a rebinding finding
        r.add_answer(RR(name, QTYPE.A, rdata=A("10.1.2.3" if inside else "203.0.113.10"), ttl=60))
        if name == "spoofed.test":
            bad = DNSRecord.parse(r.pack())
            bad.header.id ^= 0x5A5A
            bad.rr[0].rdata = A("203.0.113.66")
            self.transport.sendto(bad.pack(), addr)
        self.transport.sendto(r.pack(), addr)


LOOPS: list[str] = ["asyncio"]
try:
    import uvloop  # noqa: F401

    LOOPS.append("uvloop")
except ImportError:
    pass


def run(loop_kind: str, main: Callable[[], Awaitable[None]]) -> None:
    if loop_kind == "uvloop":
        import uvloop

        uvloop.run(main())  # type: ignore[arg-type]
    else:
        asyncio.run(main())  # type: ignore[arg-type]


async def serving(
    nft: FakeNft,
    *,
    before: list[tuple[str, int]] | None = None,
    on_violation: Callable[[Violation], None] = lambda v: None,
) -> tuple[ResolverServer, Stub, asyncio.DatagramTransport]:
    """A server whose upstreams are ``before`` (if any), then a new Stub."""
    loop = asyncio.get_running_loop()
    transport, stub = await loop.create_datagram_endpoint(Stub, local_addr=("127.0.0.1", 0))
    policy, _ = parse_policy(POLICY, "t.yaml")
    upstreams = [*(before or []), transport.get_extra_info("sockname")]
    core = ResolverCore(policy, len(upstreams), random.Random(3).getrandbits)
    server = ResolverServer(
        core=core, upstreams=upstreams, nft=nft, on_violation=on_violation,  # type: ignore[arg-type]
        listen_netns=None, upstream_netns=None, listen_addr="127.0.0.1", port=0, timeout_s=0.3,
    )  # fmt: skip
    await server.start()
    return server, stub, transport


async def ask(addr: tuple[str, int], name: str, qid: int = 77, timeout_s: float = 2.0) -> DNSRecord:
    loop = asyncio.get_running_loop()
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setblocking(False)
    try:
        s.sendto(wire.build_query(qid, name, 1), addr)  # uvloop has no sock_sendto
        data = await asyncio.wait_for(loop.sock_recv(s, 65535), timeout_s)
    finally:
        s.close()
    return DNSRecord.parse(data)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_answers_after_the_set_update_then_replays_hits(loop_kind: str) -> None:
    nft = FakeNft()

    async def main() -> None:
        server, stub, transport = await serving(nft)
        try:
            udp, _ = server.addresses
            first = await ask(udp, "allowed.test", qid=1)
            assert [str(r.rdata) for r in first.rr] == ["203.0.113.10"]
            assert nft.added == [("allow4", ["203.0.113.10 . tcp . 443"], 60)]
            # The exchange is over once answered: its socket, reader and timer are gone.
            assert not server._waiting and server.upstream_latency.count == 1
            for qid in (2, 3, 4):
                hit = await ask(udp, "allowed.test", qid=qid)
                assert hit.header.id == qid and [str(r.rdata) for r in hit.rr] == ["203.0.113.10"]
            assert len(stub.queries) == 1 and server.core.stats["cache_hits"] == 3
            assert server.internal_errors == 0
        finally:
            await server.close()
            transport.close()

    run(loop_kind, main)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_spoofed_reply_is_ignored_and_the_real_one_still_counts(loop_kind: str) -> None:
    nft = FakeNft()

    async def main() -> None:
        server, _, transport = await serving(nft)
        try:
            reply = await ask(server.addresses[0], "spoofed.test")
            assert [str(r.rdata) for r in reply.rr] == ["203.0.113.10"]
            assert not server._waiting and server.upstream_latency.count == 1  # the real one
            assert [e for _, els, _ in nft.added for e in els] == ["203.0.113.10 . tcp . 443"]
        finally:
            await server.close()
            transport.close()

    run(loop_kind, main)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_garbage_from_an_upstream_fails_over_to_the_next_at_once(loop_kind: str) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        bad_transport, bad = await loop.create_datagram_endpoint(
            lambda: Stub(garbled=True), local_addr=("127.0.0.1", 0)
        )
        server, good, transport = await serving(
            FakeNft(), before=[bad_transport.get_extra_info("sockname")]
        )
        try:
            start = loop.time()
            reply = await ask(server.addresses[0], "allowed.test")
            assert [str(r.rdata) for r in reply.rr] == ["203.0.113.10"]
            assert loop.time() - start < server.timeout_s  # not after the first one's timeout
            assert len(bad.queries) == 1 and len(good.queries) == 1
            assert not server._waiting and server.internal_errors == 0
        finally:
            await server.close()
            transport.close()
            bad_transport.close()

    run(loop_kind, main)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_an_answer_whose_actions_fail_still_ends_its_exchange(loop_kind: str) -> None:
    """A failure while an answer's actions run (here: reporting its rebinding finding)
    costs that answer, not the exchange's socket, reader and timer."""

    def report(v: Violation) -> None:
        raise RuntimeError("the journal is gone")

    async def main() -> None:
        server, _, transport = await serving(FakeNft(), on_violation=report)
        try:
            with pytest.raises(TimeoutError):  # nothing was sent: the reply came after it
                await ask(server.addresses[0], "rebind.test", timeout_s=0.5)
            assert server.internal_errors == 1 and "journal is gone" in server.last_internal_error
            assert not server._waiting
        finally:
            await server.close()
            transport.close()

    run(loop_kind, main)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_silence_and_set_failures_are_servfail_and_the_server_lives(loop_kind: str) -> None:
    nft = FakeNft()

    async def main() -> None:
        server, _, transport = await serving(nft)
        try:
            udp, _ = server.addresses
            assert (await ask(udp, "slow.test")).header.rcode == wire.SERVFAIL
            nft.fail = True
            failed = await ask(udp, "allowed.test")
            assert failed.header.rcode == wire.SERVFAIL and failed.rr == []
            nft.fail = False
            server.core.cache.clear()
            assert (await ask(udp, "allowed.test")).header.rcode == wire.NOERROR
            assert server.core.pending == {} and server.internal_errors == 0
        finally:
            await server.close()
            transport.close()

    run(loop_kind, main)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_tcp_queries_and_broken_frames(loop_kind: str) -> None:
    nft = FakeNft()

    async def main() -> None:
        server, _, transport = await serving(nft)
        try:
            _, tcp = server.addresses
            reader, writer = await asyncio.open_connection(*tcp)
            q = wire.build_query(5, "allowed.test", 1)
            writer.write(struct.pack("!H", len(q)) + q + struct.pack("!H", 3) + b"\x00\x01\x02")
            n = struct.unpack("!H", await reader.readexactly(2))[0]
            reply = DNSRecord.parse(await reader.readexactly(n))
            assert reply.header.id == 5 and [str(r.rdata) for r in reply.rr] == ["203.0.113.10"]
            writer.write(struct.pack("!H", 500) + b"cut short")
            writer.close()
            assert (await ask(server.addresses[0], "allowed.test")).header.rcode == 0
            assert server.internal_errors == 0
        finally:
            await server.close()
            transport.close()

    run(loop_kind, main)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_tcp_upstream_answer_to_another_question_fails_over_at_once(loop_kind: str) -> None:
    """A TCP exchange carries one answer: one with the wrong ID must not leave the query
    waiting for another that never comes."""

    async def wrong_id(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        size = int.from_bytes(await reader.readexactly(2), "big")
        q = DNSRecord.parse(await reader.readexactly(size))
        r = q.reply()
        r.header.id ^= 0x5A5A
        data = r.pack()
        writer.write(len(data).to_bytes(2, "big") + data)
        await writer.drain()
        writer.close()

    async def main() -> None:
        server, _stub, transport = await serving(FakeNft())
        host, port = transport.get_extra_info("sockname")
        tcp = await asyncio.start_server(wrong_id, host, port)
        try:
            udp, _ = server.addresses
            start = asyncio.get_running_loop().time()
            answer = await ask(udp, "truncated.test")
            assert answer.header.rcode == wire.SERVFAIL
            assert asyncio.get_running_loop().time() - start < 1.0
            assert not server._waiting  # the UDP exchange the TCP retry replaced is over
        finally:
            tcp.close()
            await server.close()
            transport.close()

    run(loop_kind, main)


async def until(condition: Callable[[], bool], seconds: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_tcp_connections_past_the_cap_wait_for_a_free_slot(loop_kind: str) -> None:
    """A sandbox opening connections without end must not take egressd's descriptors:
    with MAX_TCP_CLIENTS open, the next one is not accepted until one of them closes."""
    from egress.inline.tcp_front import MAX_TCP_CLIENTS

    nft = FakeNft()
    q = wire.build_query(9, "allowed.test", 1)
    frame = struct.pack("!H", len(q)) + q

    async def answer(reader: asyncio.StreamReader, seconds: float) -> DNSRecord:
        n = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), seconds))[0]
        return DNSRecord.parse(await reader.readexactly(n))

    async def main() -> None:
        server, _, transport = await serving(nft)
        held = []
        try:
            _, tcp = server.addresses
            for _ in range(MAX_TCP_CLIENTS):
                held.append(await asyncio.open_connection(*tcp))
            await until(lambda: server.tcp_clients == MAX_TCP_CLIENTS)  # all accepted
            r_extra, w_extra = await asyncio.open_connection(*tcp)  # in the backlog
            w_extra.write(frame)
            with pytest.raises(TimeoutError):
                await answer(r_extra, 0.3)
            assert server.tcp_clients == MAX_TCP_CLIENTS and server.tcp_paused >= 1
            r0, w0 = held.pop(0)  # one within the cap is served, then leaves
            w0.write(frame)
            assert (await answer(r0, 2.0)).header.id == 9
            w0.close()
            assert (await answer(r_extra, 2.0)).header.id == 9  # now accepted and served
            w_extra.close()
        finally:
            for _, w in held:
                w.close()
            await server.close()
            transport.close()

    run(loop_kind, main)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_queries_upstream_are_capped_per_sandbox(loop_kind: str) -> None:
    """Past MAX_IN_FLIGHT questions waiting on the upstream (each holds a socket), the
    next is SERVFAIL at once instead of one more socket."""
    from egress.inline.server import MAX_IN_FLIGHT

    nft = FakeNft()

    async def main() -> None:
        server, _, transport = await serving(nft)
        server.timeout_s = 5.0  # the slow ones stay in flight for the whole test
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            udp, _ = server.addresses
            for i in range(MAX_IN_FLIGHT):
                client.sendto(wire.build_query(i, f"q{i}.slow.test", 1), udp)
            await until(lambda: server.core.stats["forwarded"] == MAX_IN_FLIGHT)
            started = asyncio.get_running_loop().time()
            over = await ask(udp, "one-more.slow.test", qid=4242)
            assert over.header.rcode == wire.SERVFAIL
            assert asyncio.get_running_loop().time() - started < 1.0  # not the timeout
            assert server.overloaded == 1 and len(server._waiting) == MAX_IN_FLIGHT
        finally:
            client.close()
            await server.close()
            transport.close()

    run(loop_kind, main)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_low_supply_is_topped_up_a_step_a_turn_once_however_many_servers_share_it(
    loop_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After answers that left the shared upstream supply low, REFILL_STEP sockets are
    made a turn of the loop until it is full: one top-up for the supply, not one per
    server (egressd's sandboxes share it), and not all at once. A hit asked right after
    an answer is answered before the top-up ends. The last server out ends a top-up.
    A step of one here: ~30 turns to full, so the hit's few turns are well inside it."""
    from egress.inline import upstream
    from egress.inline.upstream import SUPPLY_LOW, SUPPLY_SIZE, TAKE_BATCH

    monkeypatch.setattr(upstream, "REFILL_STEP", 1)
    nft = FakeNft()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        one, _, transport = await serving(nft)
        two = ResolverServer(
            core=ResolverCore(one.core.policy, 1, random.Random(4).getrandbits),
            upstreams=one.pool.upstreams, nft=nft, on_violation=lambda v: None,  # type: ignore[arg-type]
            listen_netns=None, upstream_netns=None, listen_addr="127.0.0.1", port=0,
            timeout_s=0.3,
        )  # fmt: skip
        await two.start()
        [supply] = upstream._supplies.values()  # the two servers' one supply
        await until(lambda: len(supply.ready) == SUPPLY_SIZE and supply._step is None)
        taken = [supply.take() for _ in range(SUPPLY_SIZE)]  # the next query makes its own
        events: list[str] = []  # "make N", and "|" at each turn of the loop
        make = supply.make

        def counted(count: int) -> None:
            events.append(f"make {count}")
            make(count)

        def turn() -> None:
            events.append("|")
            marker[0] = loop.call_soon(turn)

        supply.make = counted  # type: ignore[method-assign]
        marker = [loop.call_soon(turn)]
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        client.setblocking(False)
        try:
            # Awaited as they are: wait_for's own task would take turns of the loop.
            async with asyncio.timeout(5):
                # Two misses, one to each server, at once: each makes TAKE_BATCH on its
                # path (the supply is empty), so both answers find it low.
                client.sendto(wire.build_query(1, "allowed.test", 1), one.addresses[0])
                client.sendto(wire.build_query(2, "allowed.test", 1), two.addresses[0])
                ids = {DNSRecord.parse(await loop.sock_recv(client, 512)).header.id
                       for _ in range(2)}  # fmt: skip
                assert ids == {1, 2} and SUPPLY_LOW > 2
                client.sendto(wire.build_query(3, "allowed.test", 1), one.addresses[0])
                hit = DNSRecord.parse(await loop.sock_recv(client, 512))
            during = len(supply.ready)
            assert hit.header.id == 3 and one.core.stats["cache_hits"] == 1
            await until(lambda: len(supply.ready) == SUPPLY_SIZE and supply._step is None)
            assert during < SUPPLY_SIZE, "the top-up ended before the hit was answered"
            steps = [e for e in "".join(e if e == "|" else "m" for e in events).split("|") if e]
            assert steps and max(len(s) for s in steps) == 1, f"more than a step a turn: {events}"
            made = [int(e.split()[1]) for e in events if e != "|"]
            assert made[0] == TAKE_BATCH  # the first miss's own, on its path
            assert set(made[1:]) == {1} and len(made) > 20
            # The last server out ends a top-up under way: nothing made after it.
            taken += [supply.take() for _ in range(SUPPLY_SIZE - 1)]
            supply.top_up(loop)
            await one.close()
            await asyncio.sleep(0)
            so_far = len([e for e in events if e != "|"])
            await two.close()
            await asyncio.sleep(0.05)
            assert len([e for e in events if e != "|"]) == so_far and supply._step is None
            assert one.internal_errors == two.internal_errors == 0
        finally:
            marker[0].cancel()
            client.close()
            for s in taken:
                s.close()
            await one.close()
            await two.close()
            transport.close()

    run(loop_kind, main)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_an_idle_tcp_client_is_let_go_and_one_still_connected_ends_with_the_server(
    loop_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TCP_IDLE_S without a whole frame: the server closes the connection (none sent, or
    half a length), and counts it gone; at close, a connected client's task ends too."""
    from egress.inline import tcp_front

    monkeypatch.setattr(tcp_front, "TCP_IDLE_S", 0.2)

    async def main() -> None:
        server, _, transport = await serving(FakeNft())
        try:
            _, tcp = server.addresses
            for first in (b"", b"\x00"):
                reader, writer = await asyncio.open_connection(*tcp)
                writer.write(first)
                await until(lambda: server.tcp_clients == 1)
                assert await asyncio.wait_for(reader.read(), 3) == b""  # closed by the server
                await until(lambda: server.tcp_clients == 0)
                writer.close()
            reader, writer = await asyncio.open_connection(*tcp)
            await until(lambda: server.tcp_clients == 1)
        finally:
            await asyncio.wait_for(server.close(), 3)
            transport.close()
        assert await asyncio.wait_for(reader.read(), 3) == b""
        writer.close()

    run(loop_kind, main)
