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
from egress.policy import parse_policy
from egress.resolver import wire
from egress.resolver.core import ResolverCore
from egress.runtime.dns_server import ResolverServer

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: t}
spec:
  dns:
    upstreams: ["192.0.2.53"]
    allow: [allowed.test, slow.test, spoofed.test, truncated.test]
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
    """allowed.test answers; slow.test never does; spoofed.test first gets a wrong ID."""

    def __init__(self) -> None:
        self.queries: list[bytes] = []
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self.transport is not None
        self.queries.append(data)
        q = DNSRecord.parse(data)
        name = str(q.q.qname).rstrip(".")
        if name == "slow.test":
            return
        if name == "truncated.test":  # "ask me over TCP"
            r = q.reply()
            r.header.tc = 1
            self.transport.sendto(r.pack(), addr)
            return
        r = q.reply()
        r.add_answer(RR(name, QTYPE.A, rdata=A("203.0.113.10"), ttl=60))
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


async def serving(nft: FakeNft) -> tuple[ResolverServer, Stub, asyncio.DatagramTransport]:
    loop = asyncio.get_running_loop()
    transport, stub = await loop.create_datagram_endpoint(Stub, local_addr=("127.0.0.1", 0))
    policy, _ = parse_policy(POLICY, "t.yaml")
    core = ResolverCore(policy, 1, random.Random(3).getrandbits)
    upstream = transport.get_extra_info("sockname")
    server = ResolverServer(core, [upstream], nft, lambda v: None, None, None,  # type: ignore[arg-type]
                            listen_addr="127.0.0.1", port=0, timeout_s=0.3)  # fmt: skip
    await server.start()
    return server, stub, transport


async def ask(addr: tuple[str, int], name: str, qid: int = 77) -> DNSRecord:
    loop = asyncio.get_running_loop()
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setblocking(False)
    try:
        s.sendto(wire.build_query(qid, name, 1), addr)  # uvloop has no sock_sendto
        data = await asyncio.wait_for(loop.sock_recv(s, 65535), 2.0)
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
            assert [e for _, els, _ in nft.added for e in els] == ["203.0.113.10 . tcp . 443"]
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
def test_tcp_connections_past_the_cap_are_closed_and_the_rest_served(loop_kind: str) -> None:
    """A sandbox opening connections without end must not take egressd's descriptors."""
    from egress.runtime.dns_server import MAX_TCP_CLIENTS

    nft = FakeNft()

    async def main() -> None:
        server, _, transport = await serving(nft)
        held = []
        try:
            _, tcp = server.addresses
            for _ in range(MAX_TCP_CLIENTS):
                held.append(await asyncio.open_connection(*tcp))
            await until(lambda: server.tcp_clients == MAX_TCP_CLIENTS)  # all accepted
            reader, writer = await asyncio.open_connection(*tcp)
            assert await asyncio.wait_for(reader.read(), 2.0) == b""  # closed at once
            writer.close()
            assert server.tcp_refused == 1 and server.tcp_clients == MAX_TCP_CLIENTS
            # The connections within the cap still get answers; one freed makes room.
            r0, w0 = held[0]
            q = wire.build_query(9, "allowed.test", 1)
            w0.write(struct.pack("!H", len(q)) + q)
            n = struct.unpack("!H", await r0.readexactly(2))[0]
            assert DNSRecord.parse(await r0.readexactly(n)).header.id == 9
            w0.close()
            await until(lambda: server.tcp_clients < MAX_TCP_CLIENTS)
            r1, w1 = await asyncio.open_connection(*tcp)
            w1.write(struct.pack("!H", len(q)) + q)
            n = struct.unpack("!H", await r1.readexactly(2))[0]
            assert DNSRecord.parse(await r1.readexactly(n)).header.id == 9
            w1.close()
        finally:
            for _, w in held:
                w.close()
            await server.close()
            transport.close()

    run(loop_kind, main)
