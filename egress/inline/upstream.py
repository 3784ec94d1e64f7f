"""Where a sandbox's resolver asks: the upstream list, and its sockets.

``parse_upstream``/``resolve_upstreams`` turn a policy's ``dns.upstreams`` (or an
``--upstream``) into addresses; ``system`` means the host's resolv.conf, read at start.
``UpstreamPool`` keeps fresh, connected UDP sockets ready in the uplink netns (or, for a
sidecar, in the sandbox netns with SO_MARK), one per query, so every upstream query has
its own random source port and making one is not on a query's critical path.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import struct

from egress.errors import EgressError, UpstreamError
from egress.kernel.netns import in_netns
from egress.model import Upstream

POOL_SIZE = 4  # fresh upstream sockets kept ready per upstream


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


class UpstreamPool:
    """Fresh, connected, non-blocking UDP sockets in the uplink netns, one per query.

    Each is used once and closed, so every upstream query still gets its own random source
    port; making them (setns, socket, connect) happens between queries, not during one.
    ``mark`` (SO_MARK) is set on each when egress's own upstream traffic leaves from the
    sandbox netns itself (`egressd sidecar`): its ruleset accepts only marked packets there.
    """

    def __init__(
        self, upstreams: list[tuple[str, int]], netns: str | None, mark: int | None = None
    ) -> None:
        self.upstreams = upstreams
        self.netns = netns
        self.mark = mark
        self._ready: list[list[socket.socket]] = [[] for _ in upstreams]

    def take(self, index: int) -> socket.socket:
        ready = self._ready[index]
        if not ready:
            self._make(index, 1)
        return ready.pop()

    def refill(self) -> None:
        for index, ready in enumerate(self._ready):
            if len(ready) < POOL_SIZE:
                with contextlib.suppress(OSError, EgressError):
                    self._make(index, POOL_SIZE - len(ready))

    def _make(self, index: int, count: int) -> None:
        host, port = self.upstreams[index]
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        made = []
        try:
            with in_netns(self.netns):
                for _ in range(count):
                    sock = socket.socket(family, socket.SOCK_DGRAM)
                    made.append(sock)
                    sock.setblocking(False)
                    set_mark(sock, self.mark)  # before connect: it picks the route
                    sock.connect((host, port))  # binds a random port; ICMP errors reach us
        except BaseException:
            for sock in made:
                sock.close()
            raise
        self._ready[index].extend(made)

    def close(self) -> None:
        for ready in self._ready:
            for sock in ready:
                sock.close()
            ready.clear()


def set_mark(sock: socket.socket, mark: int | None) -> None:
    """SO_MARK ``mark`` on ``sock`` (None: leave it unmarked). Needs CAP_NET_ADMIN (or
    CAP_NET_RAW): PermissionError without."""
    if mark is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)


async def recv_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    buf = b""
    while len(buf) < 2 or len(buf) < 2 + struct.unpack("!H", buf[:2])[0]:
        chunk = await loop.sock_recv(sock, 65537)
        if not chunk:
            raise asyncio.IncompleteReadError(buf, None)
        buf += chunk
    return buf[2 : 2 + struct.unpack("!H", buf[:2])[0]]


class Latencies:
    """A histogram: a count per bucket (``counts[i]``: at most ``bounds[i]``, above the one
    before; the last: above every bound), their sum and count. Fixed memory, however many
    are observed; ``egress.daemon.metrics`` renders it the cumulative way Prometheus wants.
    The default bounds suit upstream DNS round trips (seconds): a lab or LAN answers in
    under a millisecond, the internet in 1-250 ms, and the timeout is 2 s.
    """

    UPSTREAM_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = UPSTREAM_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound), -1)
        self.counts[index] += 1
        self.sum += value
        self.count += 1
