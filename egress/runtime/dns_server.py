"""The resolver's asyncio shell: sockets in, ResolverCore decisions, sockets out.

The listening sockets live in the sandbox's netns (on its loopback resolver address); the
upstream sockets are opened in the uplink netns, where the sandbox's own rules don't
apply and egress's traffic leaves. One fresh UDP socket per upstream query gives each a
random source port as well as a random ID.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import struct
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

from egress.datapath import constants as c
from egress.datapath.elements import SetUpdate
from egress.errors import EgressError, UpstreamError
from egress.model import Upstream, Violation
from egress.resolver.actions import Action, AllowThenReply, Forward, Reply, Report
from egress.resolver.core import ResolverCore
from egress.runtime.netns import in_netns
from egress.runtime.nft import NftHandle

SET_UPDATE_DEADLINE_S = 0.100  # slower than this and the answer becomes SERVFAIL
TCP_IDLE_S = 10.0


class UdpClient:
    __slots__ = ("addr", "transport")

    def __init__(self, transport: asyncio.DatagramTransport, addr: tuple[str, int]) -> None:
        self.transport = transport
        self.addr = addr

    def send(self, data: bytes) -> None:
        self.transport.sendto(data, self.addr)


class TcpClient:
    __slots__ = ("writer",)

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer

    def send(self, data: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(struct.pack("!H", len(data)) + data)


def system_upstreams(resolv_conf: str = "/etc/resolv.conf") -> list[tuple[str, int]]:
    """The host's nameservers, read once at start ("system" in a policy)."""
    servers = []
    try:
        with open(resolv_conf) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver":
                    servers.append((parts[1].split("%")[0], 53))
    except OSError as exc:
        raise UpstreamError(f"{resolv_conf}: {exc.strerror}") from None
    if not servers:
        raise UpstreamError(f"{resolv_conf} names no nameserver; set dns.upstreams")
    return servers


def parse_upstream(text: str) -> tuple[str, int]:
    """``IP``, ``IP:PORT``, ``[IPv6]:PORT`` or a bare IPv6 address."""
    host, port = text, "53"
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else "53"
    elif text.count(":") == 1:
        host, port = text.split(":")
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        raise UpstreamError(f"upstream {text!r}: expected IP, IP:PORT or [IPv6]:PORT") from None
    if not 0 < number < 65536:
        raise UpstreamError(f"upstream {text!r}: port {number} is out of range")
    return host, number


def resolve_upstreams(upstreams: tuple[Upstream, ...]) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for up in upstreams:
        out.extend(system_upstreams() if up.host is None else [(up.host, up.port)])
    return out


@dataclass
class SetStats:
    updates: int = 0
    failures: int = 0
    slow: int = 0
    last_ms: float = 0.0


class ResolverServer:
    """Serves one sandbox. ``on_violation`` receives each inline verdict as it happens."""

    def __init__(
        self,
        core: ResolverCore,
        upstreams: list[tuple[str, int]],
        nft: NftHandle,
        on_violation: Callable[[Violation], None],
        listen_netns: str | None,
        upstream_netns: str | None,
        listen_addr: str = c.RESOLVER4,
        port: int = 53,
        timeout_s: float = 2.0,
    ) -> None:
        self.core = core
        self.upstreams = upstreams
        self.nft = nft
        self.on_violation = on_violation
        self.listen_netns = listen_netns
        self.upstream_netns = upstream_netns
        self.listen_addr = listen_addr
        self.port = port
        self.timeout_s = timeout_s
        self.sets = SetStats()
        self.internal_errors = 0
        self.last_internal_error = ""
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        with in_netns(self.listen_netns):
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        for s in (udp, tcp):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((self.listen_addr, self.port))
            s.setblocking(False)
        udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        tcp.listen(128)
        self._udp, _ = await loop.create_datagram_endpoint(lambda: _UdpProtocol(self), sock=udp)
        self._tcp = await asyncio.start_server(self._serve_tcp, sock=tcp)

    async def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- actions -------------------------------------------------------------------------

    def perform(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Reply):
                action.client.send(action.data)  # type: ignore[attr-defined]
            elif isinstance(action, AllowThenReply):
                ok = self.allow(action.update)
                for client, data, fallback in action.replies:
                    client.send(data if ok else fallback)  # type: ignore[attr-defined]
            elif isinstance(action, Forward):
                self._spawn(self._forward(action))
            elif isinstance(action, Report):
                self.on_violation(action.violation)

    def allow(self, update: SetUpdate) -> bool:
        """Put the addresses in the kernel's sets; True only once the kernel has them."""
        start = time.monotonic()
        try:
            for family_set, elements in (
                ("allow4", update.elements4),
                ("allow6", update.elements6),
            ):
                if elements:
                    self.nft.add_elements(
                        "inet", c.TABLE, family_set, list(elements), update.timeout_s
                    )
        except EgressError:
            self.sets.failures += 1
            return False
        elapsed = time.monotonic() - start
        self.sets.updates += 1
        self.sets.last_ms = elapsed * 1000
        if elapsed > SET_UPDATE_DEADLINE_S:
            # Too late to trust: the client gets SERVFAIL, so take the addresses back too.
            self.sets.slow += 1
            with contextlib.suppress(EgressError):
                self._revoke(update)
            return False
        return True

    def _revoke(self, update: SetUpdate) -> None:
        for family_set, elements in (("allow4", update.elements4), ("allow6", update.elements6)):
            if elements:
                self.nft.delete_elements("inet", c.TABLE, family_set, list(elements))

    def handle_query(self, data: bytes, client: UdpClient | TcpClient, tcp: bool) -> None:
        """One query in; never raises: a bug must cost one answer, not the server."""
        try:
            self.perform(self.core.on_query(data, client, tcp, time.time()))
        except Exception as exc:  # the server outlives any single packet
            self.internal_errors += 1
            self.last_internal_error = f"{type(exc).__name__}: {exc}"

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _forward(self, fwd: Forward) -> None:
        host, port = self.upstreams[fwd.upstream]
        try:
            data = await asyncio.wait_for(self._exchange(host, port, fwd), self.timeout_s)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, EgressError):
            self.perform(self.core.on_upstream_failure(fwd.token, time.time()))
            return
        self.perform(self.core.on_upstream_reply(fwd.token, data, time.time()))

    async def _exchange(self, host: str, port: int, fwd: Forward) -> bytes:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        kind = socket.SOCK_STREAM if fwd.tcp else socket.SOCK_DGRAM
        with in_netns(self.upstream_netns):
            sock = socket.socket(family, kind)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_connect(sock, (host, port))
            if not fwd.tcp:
                await loop.sock_sendall(sock, fwd.data)
                return await loop.sock_recv(sock, 65535)
            await loop.sock_sendall(sock, struct.pack("!H", len(fwd.data)) + fwd.data)
            return await _recv_frame(loop, sock)
        finally:
            sock.close()

    # -- TCP clients ---------------------------------------------------------------------

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = TcpClient(writer)
        try:
            while True:
                head = await asyncio.wait_for(reader.readexactly(2), TCP_IDLE_S)
                data = await asyncio.wait_for(
                    reader.readexactly(struct.unpack("!H", head)[0]), TCP_IDLE_S
                )
                self.handle_query(data, client, True)
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            pass
        finally:
            with contextlib.suppress(ConnectionError):
                writer.close()


async def _recv_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    buf = b""
    while len(buf) < 2 or len(buf) < 2 + struct.unpack("!H", buf[:2])[0]:
        chunk = await loop.sock_recv(sock, 65537)
        if not chunk:
            raise asyncio.IncompleteReadError(buf, None)
        buf += chunk
    return buf[2 : 2 + struct.unpack("!H", buf[:2])[0]]


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, server: ResolverServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self.transport is not None
        self.server.handle_query(data, UdpClient(self.transport, addr), False)

    def error_received(self, exc: Exception) -> None:
        pass  # an ICMP error for one client must not stop the server
