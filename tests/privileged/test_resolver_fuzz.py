"""Fuzz the real ResolverServer: 100,000 random and mutated packets, UDP and TCP.

A throwaway netns with the sandbox ruleset loaded holds the server (127.0.0.53:53) and a
stub upstream on its loopback; the upstream sockets are opened there too, so nothing leaves
the netns. A seeded generator mutates valid queries (bit flips, truncations, wrong counts,
compression pointers, huge label lengths, responses, odd opcodes, EDNS garbage, trailing
junk, binary labels) and frames some of them over TCP with lying lengths; the stub answers
most queries and mangles some of its answers, so the upstream path is fuzzed as well.

Asserted: no internal error, a canary query answers within a deadline throughout and after,
and every query that reached the stub is one we would have sent: RD only, one lowercased
LDH question of an allowed name and type, our EDNS OPT and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from egress.datapath.render import render_sandbox
from egress.inline.server import ResolverServer
from egress.kernel import netns
from egress.kernel.netns import in_netns
from egress.kernel.nft import NftHandle
from egress.model import Violation
from egress.policy import Matcher, parse_policy
from egress.resolver import wire
from egress.resolver.core import ResolverCore
from egress.store.paths import read_template
from tests.support.netns import scratch_netns
from tests.support.probes import drain

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

PACKETS = 100_000
TCP_SHARE = 0.02  # of the packets, sent as TCP frames (bad lengths included)
SEED = 20261130
CANARY_EVERY = 10_000
DEADLINE_S = 2.0
POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: fuzz}
spec:
  dns:
    upstreams: ["192.0.2.53"]
    rate_limit: {qps: 1000000, burst: 1000000}  # the fuzzer sends far above the default
    allow:
      - allowed.test
      - "*.wild.test"
      - {name: api.test, types: [A]}
  connect:
    ports: [80]
"""
NAMES = ["allowed.test", "api.test", "denied.test", "wild.test", "a.b.wild.test",
         "allowed.test.evil.test", "", "x" * 63 + ".wild.test"]  # fmt: skip
TYPES = [1, 28, 5, 16, 15, 255, 10, 65280, 0, 41, 252]


# -- the generator -------------------------------------------------------------------------


def encode(name: str) -> bytes:
    return wire.encode_name(name) if name else b"\x00"


def random_name(rng: random.Random) -> str:
    name = f"w{rng.randrange(300)}.wild.test" if rng.random() < 0.5 else rng.choice(NAMES)
    return "".join(ch.upper() if rng.random() < 0.3 else ch for ch in name)


def valid_query(rng: random.Random) -> bytes:
    flags = wire.RD if rng.random() < 0.9 else rng.choice([0, wire.CD | wire.RD, wire.AD])
    ar = 0
    tail = b""
    if rng.random() < 0.4:
        ar = 1
        opts = b""
        if rng.random() < 0.3:  # a cookie, padding or an unknown option
            code = rng.choice([10, 12, 8, 65001])
            data = rng.randbytes(rng.randrange(0, 24))
            opts = struct.pack("!HH", code, len(data)) + data
        tail = b"\x00" + struct.pack("!HHIH", 41, rng.choice([512, 1232, 4096, 0]), 0, len(opts))
        tail += opts
    head = wire.HEADER.pack(rng.randrange(65536), flags, 1, 0, 0, ar)
    qtype = rng.choice(TYPES) if rng.random() < 0.3 else rng.choice([1, 28])
    return head + encode(random_name(rng)) + struct.pack("!HH", qtype, 1) + tail


def flip_bits(rng: random.Random, p: bytearray) -> None:
    for _ in range(rng.randrange(1, 9)):
        i = rng.randrange(len(p) * 8)
        p[i // 8] ^= 1 << (i % 8)


def mutate(rng: random.Random, p: bytearray) -> bytes:
    if len(p) < 14:  # already cut to pieces by an earlier mutation
        return bytes(p) + rng.randbytes(rng.randrange(0, 4))
    kind = rng.randrange(12)
    if kind == 0:
        flip_bits(rng, p)
    elif kind == 1:
        del p[rng.randrange(len(p)) :]  # truncation
    elif kind == 2:
        struct.pack_into("!H", p, rng.choice([4, 6, 8, 10]), rng.choice([0, 2, 255, 65535]))
    elif kind == 3:  # a compression pointer somewhere in the question
        at = rng.randrange(12, max(13, len(p) - 1))
        p[at : at + 2] = struct.pack("!H", 0xC000 | rng.randrange(0, len(p) + 8))
    elif kind == 4:  # a label length that lies
        if len(p) > 12:
            p[12] = rng.choice([63, 64, 127, 128, 191, 255])
    elif kind == 5:  # a response, with an answer record
        p[2] |= 0x80
        struct.pack_into("!H", p, 6, 1)
        p += b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4) + bytes([203, 0, 113, 66])
    elif kind == 6:  # opcodes other than QUERY
        p[2] = (p[2] & 0x87) | (rng.randrange(1, 16) << 3)
    elif kind == 7:  # EDNS garbage: lying rdlen, a name on the OPT, two OPTs
        struct.pack_into("!H", p, 10, rng.choice([1, 2, 3]))
        p += bytes([rng.choice([0, 1, 0xC0])]) + struct.pack("!HH", 41, rng.randrange(65536))
        p += rng.randbytes(rng.randrange(0, 12))
    elif kind == 8:
        p += rng.randbytes(rng.randrange(1, 64))  # trailing junk
    elif kind == 9:  # a binary label
        if len(p) > 14:
            p[13] = rng.choice([0, 0x2E, 0xFF, 0x2A, 0x5C])
    elif kind == 10:
        return rng.randbytes(rng.randrange(0, 600))
    else:  # a name of 255+ bytes in 63-byte labels
        name = b"".join(b"\x3f" + b"a" * 63 for _ in range(rng.randrange(3, 6))) + b"\x00"
        return bytes(p[:12]) + name + b"\x00\x01\x00\x01"
    return bytes(p)


def packets(rng: random.Random, count: int) -> Iterator[bytes]:
    for _ in range(count):
        q = valid_query(rng)
        if rng.random() < 0.75:
            q = mutate(rng, bytearray(q))
            if rng.random() < 0.2:
                q = mutate(rng, bytearray(q))
        yield q


# -- the stub upstream ---------------------------------------------------------------------


@dataclass
class Stub:
    rng: random.Random
    queries: list[bytes] = field(default_factory=list)
    sock: socket.socket | None = None

    def answer(self, q: bytes) -> bytes | None:
        """Mostly a plain answer; sometimes a mangled one, a wrong ID, or silence."""
        self.queries.append(q)
        roll = self.rng.random()
        if roll < 0.03:
            return None  # the resolver times out, then SERVFAILs
        qid, _, _, _, _, _ = wire.HEADER.unpack_from(q)
        end = wire.skip_name(q, 12) + 4
        qtype = struct.unpack_from("!H", q, end - 4)[0]
        head = wire.HEADER.pack(qid, 0x8180, 1, 1, 0, 0)
        if qtype == 28:
            rr = struct.pack("!HHIH", 28, 1, 300, 16) + bytes.fromhex("20010db8") + bytes(12)
        else:
            rr = struct.pack("!HHIH", 1, 1, 300, 4) + bytes([198, 19, *self.rng.randbytes(2)])
        reply = bytearray(head + q[12:end] + b"\xc0\x0c" + rr)
        if roll < 0.08:
            flip_bits(self.rng, reply)
        elif roll < 0.10:
            del reply[self.rng.randrange(len(reply)) :]
        elif roll < 0.12:
            reply[0] ^= 0xFF  # another ID: ignored, then the real answer never comes
        return bytes(reply)

    def readable(self) -> None:
        assert self.sock is not None
        while True:
            try:
                q, addr = self.sock.recvfrom(4096)
            except BlockingIOError:
                return
            reply = self.answer(q)
            if reply is not None:
                with contextlib.suppress(OSError):
                    self.sock.sendto(reply, addr)


def check_upstream_query(q: bytes, matcher: Matcher) -> str | None:
    """Why ``q`` is not a query we would send, or None."""
    _, flags, qd, an, ns, ar = wire.HEADER.unpack_from(q)
    if flags != wire.RD or (qd, an, ns, ar) != (1, 0, 0, 1):
        return f"header {flags:#x} {qd}/{an}/{ns}/{ar}"
    labels, pos = [], 12
    while q[pos]:
        labels.append(q[pos + 1 : pos + 1 + q[pos]])
        pos += 1 + q[pos]
    qtype, qclass = struct.unpack_from("!HH", q, pos + 1)
    name = b".".join(labels).decode("ascii", "replace")
    if any(not all(ch in b"abcdefghijklmnopqrstuvwxyz0123456789-_" for ch in lb) for lb in labels):
        return f"name {name!r} is not lowercase LDH"
    if qclass != 1 or not matcher.decide(name, qtype).allowed:
        return f"{name} type {qtype} class {qclass} is not allowed"
    if q[pos + 5 :] != wire.opt_record():
        return f"additional section {q[pos + 5 :].hex()} is not our OPT"
    return None


# -- the test ------------------------------------------------------------------------------


@pytest.fixture
def fuzz_netns() -> Iterator[str]:
    with scratch_netns("fuzz") as name:
        netns.loopback_up(name)
        yield name


async def ask(sock: socket.socket, data: bytes, deadline: float) -> bytes:
    loop = asyncio.get_running_loop()
    await loop.sock_sendto(sock, data, ("127.0.0.53", 53))
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        try:
            reply = await asyncio.wait_for(loop.sock_recv(sock, 65535), end - time.monotonic())
        except TimeoutError:
            break
        if reply[:2] == data[:2]:
            return reply
    raise AssertionError(f"no answer within {deadline} s: the server stalled")


async def canary(sock: socket.socket) -> None:
    q = wire.build_query(secrets.randbits(16), "allowed.test", 1)
    reply = await ask(sock, q, DEADLINE_S)
    rcode = reply[3] & 0xF
    assert rcode in (wire.NOERROR, wire.SERVFAIL), rcode  # SERVFAIL: the stub was silent


async def send_tcp(ns: str, frames: list[bytes], rng: random.Random) -> None:
    """Frames over TCP, with lengths that lie, split writes and abrupt closes."""
    with in_netns(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(s, ("127.0.0.53", 53))
        reader, writer = await asyncio.open_connection(sock=s)
        for frame in frames:
            length = len(frame)
            roll = rng.random()
            if roll < 0.1:
                length = rng.choice([0, 1, 65535, length + 5])
            elif roll < 0.15:
                length = max(0, length - 3)
            writer.write(struct.pack("!H", length) + frame)
        if rng.random() < 0.5:
            writer.write(rng.randbytes(rng.randrange(1, 4)))  # a broken frame header
        await writer.drain()
        with contextlib.suppress(TimeoutError, ConnectionError):
            await asyncio.wait_for(reader.read(65536), 0.02)
        writer.close()
    except ConnectionError:
        pass
    finally:
        s.close()


async def fuzz(server: ResolverServer, ns: str, rng: random.Random) -> tuple[int, int]:
    with in_netns(ns):
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        canary_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.setblocking(False)
    canary_sock.setblocking(False)
    sent = replies = 0
    tcp_frames: list[bytes] = []
    try:
        for i, packet in enumerate(packets(rng, PACKETS)):
            if rng.random() < TCP_SHARE:
                tcp_frames.append(packet)
                if len(tcp_frames) >= 8:
                    await send_tcp(ns, tcp_frames, rng)
                    tcp_frames = []
            else:
                with contextlib.suppress(BlockingIOError):
                    client.sendto(packet, ("127.0.0.53", 53))
            sent += 1
            if i % 64 == 63:
                await asyncio.sleep(0)  # let the server read, answer and forward
                replies += drain(client)
            if i % CANARY_EVERY == CANARY_EVERY - 1:
                await canary(canary_sock)
        if tcp_frames:
            await send_tcp(ns, tcp_frames, rng)
        await asyncio.sleep(server.timeout_s + 0.5)  # stub silences run into their timeouts
        replies += drain(client)
        await canary(canary_sock)
    finally:
        client.close()
        canary_sock.close()
    return sent, replies


def test_the_resolver_survives_100k_fuzzed_packets(fuzz_netns: str) -> None:
    policy, _ = parse_policy(POLICY, "fuzz.yaml")
    nft = NftHandle.open(fuzz_netns)
    try:
        nft.load(render_sandbox(read_template("sandbox.nft"), policy))
        stub = Stub(random.Random(SEED + 1))
        violations: list[Violation] = []
        start = time.monotonic()
        sent, replies, server = asyncio.run(run(policy, nft, fuzz_netns, stub, violations))
        elapsed = time.monotonic() - start
    finally:
        nft.close()
    print(f"\nfuzz: {sent} packets in {elapsed:.1f} s, {replies} replies, "
          f"{len(stub.queries)} upstream queries, {len(violations)} violations, "
          f"stats {server.core.stats}")  # fmt: skip
    assert server.internal_errors == 0, server.last_internal_error
    assert server.core.stats["malformed"] > PACKETS // 5
    matcher = Matcher(policy)
    bad = [(q.hex(), why) for q in stub.queries if (why := check_upstream_query(q, matcher))]
    assert bad == [], bad[:5]
    assert stub.queries, "nothing was forwarded: the fuzz did not reach the upstream path"
    assert server.core.pending == {} and server.core.inflight == {}


async def run(
    policy: object, nft: NftHandle, ns: str, stub: Stub, violations: list[Violation]
) -> tuple[int, int, ResolverServer]:
    loop = asyncio.get_running_loop()
    with in_netns(ns):
        stub.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stub.sock.bind(("127.0.0.1", 0))
    stub.sock.setblocking(False)
    loop.add_reader(stub.sock.fileno(), stub.readable)
    core = ResolverCore(policy, 1, secrets.randbits)  # type: ignore[arg-type]
    server = ResolverServer(
        core=core, upstreams=[stub.sock.getsockname()], nft=nft, on_violation=violations.append,
        listen_netns=ns, upstream_netns=ns, timeout_s=0.5,
    )  # fmt: skip
    await server.start()
    try:
        sent, replies = await fuzz(server, ns, random.Random(SEED))
    finally:
        await server.close()
        loop.remove_reader(stub.sock.fileno())
        stub.sock.close()
    return sent, replies, server
