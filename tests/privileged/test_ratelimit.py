"""Issue 7 item 6: per-sandbox DNS rate limit (spec.dns.rate_limit) in a real sandbox.

A sandbox made from a policy with a small limit is served by a ResolverServer on this
test's event loop (as ``egressctl run`` serves one), so the test reads the server's own
counters; the workload's side is real: ``dnsperf`` and sockets inside the sandbox netns,
the lab's DNS server upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import shutil
import socket
import struct
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from egress.datapath.addressing import Pools
from egress.inline.server import ResolverServer, make_core
from egress.kernel.netns import in_netns
from egress.lab import Lab
from egress.model import Policy, Violation
from egress.policy import parse_policy
from egress.resolver import wire
from egress.sandbox import lifecycle as sandbox
from egress.sandbox.lifecycle import Sandbox

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {{name: ratelimit}}
spec:
  dns:
    upstreams: ["{dns}"]
    rate_limit: {{qps: {qps}, burst: {burst}}}
    allow: [allowed.lab.test, www.allowed.lab.test]
"""
RESOLVER = "127.0.0.53"
FLOOD_QPS = 1000  # what dnsperf offers: 20 times the limit
FLOOD_S = 4


def make_policy(lab: Lab, qps: int, burst: int) -> Policy:
    text = POLICY.format(dns=lab.dns4, qps=qps, burst=burst)
    return parse_policy(text, "ratelimit.yaml")[0]


@pytest.fixture
def box(lab: Lab) -> Iterator[Sandbox]:
    sb = sandbox.create(make_policy(lab, 50, 50), Pools.parse(None), lab.uplink_netns)
    try:
        yield sb
    finally:
        sb.destroy()


@contextlib.asynccontextmanager
async def served(sb: Sandbox, lab: Lab) -> AsyncIterator[ResolverServer]:
    seen: list[Violation] = []
    server = ResolverServer(
        core=make_core(sb.policy, 1), upstreams=[(lab.dns4, 53)], nft=sb.nft,
        on_violation=seen.append, listen_netns=sb.netns, upstream_netns=lab.uplink_netns,
    )  # fmt: skip
    await server.start()
    try:
        yield server
    finally:
        await server.close()
    assert seen == [] and server.internal_errors == 0, server.last_internal_error


def client(sb: Sandbox, kind: int = socket.SOCK_DGRAM) -> socket.socket:
    with in_netns(sb.netns):
        sock = socket.socket(socket.AF_INET, kind)
    sock.setblocking(False)
    return sock


async def answered(sock: socket.socket, count: int, wait_s: float = 1.0) -> int:
    """Send ``count`` queries at once; how many replies come back within ``wait_s``."""
    loop = asyncio.get_running_loop()
    for _ in range(count):
        query = wire.build_query(secrets.randbits(16), "allowed.lab.test", 1)
        await loop.sock_sendto(sock, query, (RESOLVER, 53))
    replies = 0
    end = time.monotonic() + wait_s
    with contextlib.suppress(TimeoutError):
        while replies < count:
            await asyncio.wait_for(loop.sock_recv(sock, 4096), end - time.monotonic())
            replies += 1
    return replies


async def dnsperf(sb: Sandbox, qfile: Path) -> dict[str, int]:
    # -q: enough outstanding queries that the dropped ones, waiting out -t, never hold
    # back the offered rate.
    argv = ["ip", "netns", "exec", sb.netns, "dnsperf", "-s", RESOLVER, "-d", str(qfile),
            "-l", str(FLOOD_S), "-Q", str(FLOOD_QPS), "-q", "5000", "-t", "1"]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()  # the loop serves the sandbox meanwhile
    text = out.decode()
    found = {}
    for key in ("sent", "completed", "lost"):
        m = re.search(rf"Queries {key}:\s+(\d+)", text)
        assert m is not None, f"dnsperf output not understood:\n{text}\n{err.decode()}"
        found[key] = int(m.group(1))
    return found


@pytest.mark.skipif(shutil.which("dnsperf") is None, reason="needs dnsperf (Debian package)")
async def test_a_flood_gets_the_limit_and_the_rest_is_dropped_then_the_bucket_refills(
    box: Sandbox, lab: Lab, tmp_path: Path
) -> None:
    qfile = tmp_path / "queries.txt"
    qfile.write_text("allowed.lab.test A\nwww.allowed.lab.test A\n")
    async with served(box, lab) as server:
        start = time.monotonic()
        perf = await dnsperf(box, qfile)
        elapsed = time.monotonic() - start
        print(f"dnsperf {perf} in {elapsed:.2f} s; server dropped {server.rate_limited}")
        # burst 50, then 50 a second for the FLOOD_S seconds dnsperf sends (plus the one
        # it spends waiting out its timeout, when nothing more is asked)
        assert perf["sent"] >= FLOOD_QPS * FLOOD_S * 0.9, perf
        assert 50 + 50 * FLOOD_S * 0.8 <= perf["completed"] <= 50 + 50 * elapsed, perf
        assert server.rate_limited == perf["lost"] == perf["sent"] - perf["completed"]
        sock = client(box)
        try:
            assert await answered(sock, 1) == 1  # dnsperf's timeout let the bucket refill
        finally:
            sock.close()
        assert server.rate_limited == perf["lost"]


async def test_tcp_queries_spend_the_same_bucket_and_a_swap_changes_the_rate(
    box: Sandbox, lab: Lab
) -> None:
    async with served(box, lab) as server:
        server.core.set_policy(make_policy(lab, 1, 3))  # as a live policy swap does
        tcp = client(box, socket.SOCK_STREAM)
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_connect(tcp, (RESOLVER, 53))
            for qid in range(6):
                query = wire.build_query(qid, "allowed.lab.test", 1)
                await loop.sock_sendall(tcp, struct.pack("!H", len(query)) + query)
            reader, writer = await asyncio.open_connection(sock=tcp)
            assert await tcp_replies(reader, 0.5) == [0, 1, 2]  # the new burst: 3
            # the 4th was dropped, and the connection is not read again for a second
            assert server.rate_limited == 1
            server.core.set_policy(make_policy(lab, 1000, 1000))
            udp = client(box)
            try:  # the half second since earns at the new rate: 500 tokens
                assert await answered(udp, 20) == 20
            finally:
                udp.close()
            assert await tcp_replies(reader, 3.0, 2) == [4, 5]  # read again, under the new rate
            writer.close()
        finally:
            tcp.close()
        assert server.rate_limited == 1


async def tcp_replies(reader: asyncio.StreamReader, wait_s: float, most: int = 99) -> list[int]:
    """IDs of the framed replies that arrive within ``wait_s`` (at most ``most``)."""
    ids: list[int] = []
    end = time.monotonic() + wait_s
    with contextlib.suppress(TimeoutError):
        while len(ids) < most:
            head = await asyncio.wait_for(reader.readexactly(2), end - time.monotonic())
            reply = await reader.readexactly(struct.unpack("!H", head)[0])
            ids.append(struct.unpack("!H", reply[:2])[0])
    return ids


BLAST = r"""
import socket, struct, sys, time
name = b"".join(bytes([len(p)]) + p.encode() for p in "allowed.lab.test".split(".")) + b"\0"
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect(("127.0.0.53", 53))
sent, end = 0, time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    for i in range(1000):
        s.send(struct.pack("!6H", i, 0x0100, 1, 0, 0, 0) + name + struct.pack("!HH", 1, 1))
    sent += 1000
s.settimeout(1.0)
answered = 0
try:
    while True:
        s.recv(4096)
        answered += 1
except OSError:
    pass
print(sent, answered)
"""


async def test_a_blast_is_left_to_the_kernel_counted_and_then_the_sandbox_resolves_again(
    box: Sandbox, lab: Lab
) -> None:
    """Faster than it could be read: the server stops reading the socket for a while, the
    kernel drops the rest, and every query is either answered or counted as dropped."""
    async with served(box, lab) as server:
        argv = ["ip", "netns", "exec", box.netns, sys.executable, "-c", BLAST, "1.0"]
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()  # the loop serves the sandbox meanwhile
        elapsed = time.monotonic() - start
        sent, got = map(int, out.split())
        print(f"blast: {sent} sent, {got} answered, {server.rate_limited} dropped")
        assert sent >= 50_000
        assert 50 <= got <= 50 + 50 * elapsed  # burst 50, then 50 a second
        assert server.rate_limited == sent - got
        sock = client(box)
        try:
            assert await answered(sock, 1) == 1  # the stale backlog is gone; tokens again
        finally:
            sock.close()
