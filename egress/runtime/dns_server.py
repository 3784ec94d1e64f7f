"""The resolver's asyncio shell: sockets in, ResolverCore decisions, sockets out.

The listening sockets live in the sandbox's netns (on its loopback resolver address); the
upstream sockets are opened in the uplink netns, where the sandbox's own rules don't
apply and egress's traffic leaves. One fresh UDP socket per upstream query gives each a
random source port as well as a random ID; a few are made ahead of time (UpstreamPool), so
making one is not on a query's critical path.

Hot path (a repeated UDP query): one readiness callback drains the listening socket,
``ResolverCore.replay`` maps the query's bytes to the reply's, ``sendto``. No transport,
protocol, task or future objects per packet, so it runs the same on asyncio's loop and on
uvloop. Everything else goes through ``ResolverCore.on_query`` and ``perform``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import secrets
import socket
import struct
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

from egress.datapath import constants as c
from egress.datapath.elements import ExpiryBook, SetUpdate
from egress.errors import EgressError, UpstreamError
from egress.model import Policy, Upstream, Violation
from egress.resolver.actions import Action, AllowThenReply, Forward, Reply, Report
from egress.resolver.core import ResolverCore
from egress.resolver.ratelimit import TokenBucket
from egress.runtime.netns import in_netns
from egress.runtime.nft import NftHandle
from egress.runtime.nft_netlink import SET_UPDATE_DEADLINE_S, NetlinkSets
from egress.tunnel import scorer_for

TCP_IDLE_S = 10.0
MAX_QUERY = 4096  # bytes read per datagram: a longer "query" is cut short and refused
BATCH = 64  # datagrams per readiness callback, so TCP and upstream replies get turns
POOL_SIZE = 4  # fresh upstream sockets kept ready per upstream
MAX_IN_FLIGHT = 1024  # queries waiting on an upstream per sandbox (each holds a socket)
MAX_TCP_CLIENTS = 64  # open TCP connections per sandbox (a stub resolver uses one or two)
MAX_TCP_BACKLOG = 256 << 10  # unread answer bytes on one connection before it is dropped


class UdpClient:
    __slots__ = ("addr", "sock")

    def __init__(self, sock: socket.socket, addr: tuple[str, int]) -> None:
        self.sock = sock
        self.addr = addr

    def send(self, data: bytes) -> None:
        # A full socket buffer or an ICMP error loses this one reply, as UDP may.
        with contextlib.suppress(OSError):
            self.sock.sendto(data, self.addr)


class TcpClient:
    __slots__ = ("writer",)

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer

    def send(self, data: bytes) -> None:
        if self.writer.is_closing():
            return
        if self.writer.transport.get_write_buffer_size() > MAX_TCP_BACKLOG:
            # A client that asks and never reads would grow our buffer without end.
            self.writer.transport.abort()
            return
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


def make_core(policy: Policy, upstream_count: int) -> ResolverCore:
    """The resolver core one sandbox is served with, in every wiring (run, egressd):
    random upstream IDs from the OS, and the policy's tunnel scorer on the wall clock."""
    scorer = scorer_for(policy.tunnel, time.time)
    return ResolverCore(policy, upstream_count, secrets.randbits, scorer=scorer)


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
        mark: int | None = None,
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
        self.expiry = ExpiryBook()  # no answer may shorten what an earlier one allowed
        self.internal_errors = 0
        self.last_internal_error = ""
        self.dropped_replies = 0
        self.mark = mark  # SO_MARK of upstream sockets (UpstreamPool)
        self.pool = UpstreamPool(upstreams, upstream_netns, mark)
        self._sets: NetlinkSets | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._udp: socket.socket | None = None
        self._tcp_sock: socket.socket | None = None
        self._tcp_open = False  # accepting TCP clients (until drain or close)
        self._accepting = False  # the listening socket is being read now
        self._clients: set[asyncio.Task[None]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._waiting: dict[int, tuple[socket.socket, asyncio.TimerHandle]] = {}
        self._refill: asyncio.Handle | None = None
        # Fairness: one bucket per sandbox (spec.dns.rate_limit), on the monotonic clock. Its
        # rate is read from core.policy (see _tokens), so a policy swap changes it too.
        self.rate_limited = 0  # queries dropped for being over the limit
        self._limit = core.policy.dns.rate_limit
        self.bucket = TokenBucket(self._limit.qps, self._limit.burst, time.monotonic())
        self.upstream_latency = Latencies()  # forward to reply, UDP and TCP, answered ones
        self._sent_at: dict[int, float] = {}  # token -> when its UDP query went upstream
        # 2 ms unread: while flooded, 64 datagrams read per 2 ms (~5% of a core), and once
        # it stops, a full buffer's stale queries (~10,000 in 8 MiB) are gone in ~0.3 s.
        self.flood_pause_s = 0.002
        self._paused: asyncio.TimerHandle | None = None
        # Tokens taken but not yet spent by UDP queries (at most BATCH: what a policy swap
        # that lowers the rate still lets through at the old one).
        self._allowance = 0
        self._drops_seen = -1  # the kernel's drop count at this socket when last read
        self.tcp_clients = 0  # open TCP connections from the sandbox
        self.tcp_paused = 0  # times accepting stopped: MAX_TCP_CLIENTS were open
        self.overloaded = 0  # SERVFAIL without asking: MAX_IN_FLIGHT were upstream

    async def start(self, handed: tuple[socket.socket, socket.socket] | None = None) -> None:
        """Bind 127.0.0.53:53 (UDP, TCP) in the sandbox netns, or serve the bound
        ``handed`` (UDP, TCP) sockets a previous egressd passed on, unread queries and all."""
        loop = self._loop = asyncio.get_running_loop()
        if handed is not None:
            udp, tcp = handed
        else:
            with in_netns(self.listen_netns):
                udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if handed is None:
                for s in (udp, tcp):
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind((self.listen_addr, self.port))
                udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
                tcp.listen(128)
            udp.setblocking(False)
            tcp.setblocking(False)
            self.pool.refill()
            self._sets = _open_sets(self.nft)
        except BaseException:
            udp.close()
            tcp.close()
            self.pool.close()
            if self._sets is not None:
                self._sets.close()
                self._sets = None
            raise
        self._udp = udp
        self._tcp_sock = tcp
        self._tcp_open = True
        self._accept_on()
        loop.add_reader(udp.fileno(), self._udp_readable)

    @property
    def listening(self) -> tuple[socket.socket, socket.socket]:
        """The (UDP, TCP) listening sockets, to hand to a successor egressd."""
        assert self._udp is not None and self._tcp_sock is not None
        return self._udp, self._tcp_sock

    async def drain(self, timeout_s: float) -> None:
        """Stop reading new queries (a successor reads them now) and wait, at most
        ``timeout_s``, for the answers to the ones already sent upstream."""
        loop = asyncio.get_running_loop()
        if self._paused is not None:  # a flood pause must not resume reading later
            self._paused.cancel()
            self._paused = None
        if self._udp is not None:
            loop.remove_reader(self._udp.fileno())
        self._tcp_open = False  # no more accepts here; connections already open go on
        self._accept_off()
        deadline = loop.time() + timeout_s
        while (self._waiting or self._tasks) and loop.time() < deadline:
            await asyncio.sleep(0.01)

    @property
    def addresses(self) -> tuple[tuple[str, int], tuple[str, int]]:
        """(UDP, TCP) addresses listened on: with port 0 the kernel picks them apart."""
        assert self._udp is not None and self._tcp_sock is not None
        return self._udp.getsockname(), self._tcp_sock.getsockname()

    async def close(self) -> None:
        if self._udp is not None and self._loop is not None:
            self._loop.remove_reader(self._udp.fileno())
            self._udp.close()
            self._udp = None
        self._tcp_open = False
        self._accept_off()
        if self._tcp_sock is not None:
            self._tcp_sock.close()
        for task in list(self._clients):
            task.cancel()
        for token in list(self._waiting):
            self._forget(token)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._refill is not None:
            self._refill.cancel()
        self.pool.close()
        if self._sets is not None:
            self._sets.close()
            self._sets = None

    # -- the listening UDP socket --------------------------------------------------------

    def _udp_readable(self) -> None:
        sock = self._udp
        if sock is None:
            return
        replay = self.core.replay
        now = time.time()
        # Tokens are taken from the bucket BATCH at a time and held in _allowance: per
        # datagram the limit costs one integer test, and the bucket is asked once in 64.
        allowance = self._allowance
        dropped = 0
        try:
            for _ in range(BATCH):
                try:
                    data, addr = sock.recvfrom(MAX_QUERY)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    continue  # e.g. an ICMP error queued for an earlier reply
                if not allowance:
                    allowance = 0 if dropped else self._tokens(BATCH)
                    if not allowance:
                        # Over the sandbox's rate: dropped unanswered, as unbound's
                        # ratelimit and BIND's RRL do. A REFUSED would cost a sendto per
                        # flooded query (the work the limit is there to shed) and answer
                        # spoofed sources; a stub resolver retries a lost query after its
                        # timeout, by which time the bucket has refilled.
                        dropped += 1
                        continue
                allowance -= 1
                try:
                    reply = replay(data, now)
                    if reply is None:
                        self.handle_query(data, UdpClient(sock, addr), False)
                    else:
                        sock.sendto(reply, addr)
                except OSError:
                    self.dropped_replies += 1  # the client's socket is full or gone
                except Exception as exc:  # the server outlives any single packet
                    self._internal(exc)
            if dropped:  # a whole batch, more waiting, and over the limit: a flood
                self._pause_udp(sock)
        finally:
            self._allowance = allowance
            if dropped:
                self.rate_limited += dropped

    def _pause_udp(self, sock: socket.socket) -> None:
        """Leave a flooding sandbox's socket unread for ``flood_pause_s``.

        Reading a flood only to drop it still costs a ``recvfrom`` per datagram: a flood of
        500,000 a second fills this process's CPU, and the other sandboxes it serves wait
        for it (measured: bench/bench_fairness.py). Unread, the socket's receive buffer
        fills and the kernel drops the rest in the sender's own context, which costs this
        process nothing; what it dropped counts as rate-limited too.
        """
        loop = self._loop
        if loop is None or self._paused is not None:
            return
        self._count_kernel_drops(sock)
        loop.remove_reader(sock.fileno())
        self._paused = loop.call_later(self.flood_pause_s, self._resume_udp)

    def _resume_udp(self) -> None:
        self._paused = None
        sock = self._udp
        # Not after close(), nor after drain() handed the socket to a successor egressd
        # (both stop the TCP server): reading then would take the successor's queries.
        if sock is None or self._loop is None or not self._tcp_open:
            return
        self._count_kernel_drops(sock)
        self._loop.add_reader(sock.fileno(), self._udp_readable)

    def _count_kernel_drops(self, sock: socket.socket) -> None:
        # From the first pause on: the kernel drops at a full buffer, i.e. while flooded.
        drops = _kernel_drops(sock)
        if drops >= 0 and self._drops_seen >= 0:
            self.rate_limited += (drops - self._drops_seen) % (1 << 32)  # a u32 counter
        self._drops_seen = drops

    def _tokens(self, want: int) -> int:
        """Up to ``want`` queries this sandbox may have answered now (its rate limit)."""
        now = time.monotonic()
        limit = self.core.policy.dns.rate_limit
        if limit is not self._limit:  # a policy swap: see TokenBucket.configure
            self._limit = limit
            self.bucket.configure(limit.qps, limit.burst)
        return self.bucket.take(now, want)

    # -- actions -------------------------------------------------------------------------

    def perform(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Reply):
                action.client.send(action.data)  # type: ignore[attr-defined]
            elif isinstance(action, AllowThenReply):
                ok = self.allow(action.update)
                if ok and action.on_allowed is not None:
                    action.on_allowed()
                for client, data, fallback in action.replies:
                    client.send(data if ok else fallback)  # type: ignore[attr-defined]
            elif isinstance(action, Forward):
                self._forward(action)
            elif isinstance(action, Report):
                self.on_violation(action.violation)

    def allow(self, update: SetUpdate) -> bool:
        """Put the addresses in the kernel's sets; True only once the kernel has them."""
        start = time.monotonic()
        fresh = {
            "allow4": self.expiry.fresh(update.elements4, start),
            "allow6": self.expiry.fresh(update.elements6, start),
        }
        try:
            for family_set, elements in (
                ("allow4", update.elements4),
                ("allow6", update.elements6),
            ):
                for timeout, group in self.expiry.plan(elements, update.timeout_s, start).items():
                    self._add(family_set, tuple(group), timeout)
                    self.expiry.record(group, timeout, start)
        except (EgressError, OSError, ValueError, struct.error):  # any failure: SERVFAIL
            self.sets.failures += 1
            return False
        elapsed = time.monotonic() - start
        self.sets.updates += 1
        self.sets.last_ms = elapsed * 1000
        if elapsed > SET_UPDATE_DEADLINE_S:
            # Too late to trust: the client gets SERVFAIL, so take the addresses back too.
            self.sets.slow += 1
            with contextlib.suppress(EgressError):
                # Only what this answer added: an earlier answer's elements stay allowed.
                self._revoke(SetUpdate(tuple(fresh["allow4"]), tuple(fresh["allow6"]), 0))
            return False
        return True

    def _add(self, family_set: str, elements: tuple[str, ...], timeout_s: int) -> None:
        if self._sets is not None:
            try:
                self._sets.add(family_set, elements, timeout_s)
                return
            except (ValueError, KeyError):
                pass  # not elements this writer understands: libnftables knows more
        self.nft.add_elements("inet", c.TABLE, family_set, list(elements), timeout_s)

    def _revoke(self, update: SetUpdate) -> None:
        for family_set, elements in (("allow4", update.elements4), ("allow6", update.elements6)):
            if not elements:
                continue
            if self._sets is not None:
                try:
                    self._sets.delete(family_set, elements)
                    continue
                except (ValueError, KeyError, OSError):
                    pass  # libnftables says why, or skips the ones already gone
            self.nft.delete_elements("inet", c.TABLE, family_set, list(elements), missing_ok=True)

    def handle_query(self, data: bytes, client: UdpClient | TcpClient, tcp: bool) -> None:
        """One query in; never raises: a bug must cost one answer, not the server."""
        try:
            self.perform(self.core.on_query(data, client, tcp, time.time()))
        except Exception as exc:  # the server outlives any single packet
            self._internal(exc)

    def _internal(self, exc: Exception) -> None:
        self.internal_errors += 1
        self.last_internal_error = f"{type(exc).__name__}: {exc}"

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- upstream ------------------------------------------------------------------------

    def _forward(self, fwd: Forward) -> None:
        self._forget(fwd.token)  # a retry (TCP, next upstream) replaces the last attempt
        loop = self._loop
        assert loop is not None
        if len(self._waiting) + len(self._tasks) >= MAX_IN_FLIGHT:
            # Each query upstream holds a socket: one sandbox asking slow names must not
            # use up the descriptors egressd shares among all of them. SERVFAIL instead.
            self.overloaded += 1
            loop.call_soon(self._upstream_failed, fwd.token)
            return
        if fwd.tcp:
            self._spawn(self._forward_tcp(fwd))
            return
        try:
            sock = self.pool.take(fwd.upstream)
        except (OSError, EgressError):
            loop.call_soon(self._upstream_failed, fwd.token)
            return
        sent = time.monotonic()
        try:
            sock.send(fwd.data)
        except OSError:
            sock.close()
            loop.call_soon(self._upstream_failed, fwd.token)
            return
        timer = loop.call_later(self.timeout_s, self._upstream_failed, fwd.token)
        self._waiting[fwd.token] = (sock, timer)
        loop.add_reader(sock.fileno(), self._upstream_readable, fwd.token)
        self._sent_at[fwd.token] = sent
        if len(self._sent_at) > 2 * len(self._waiting) + 64:
            # Exchanges that failed (timeout, ICMP error) left theirs: keep the live ones.
            self._sent_at = {t: at for t, at in self._sent_at.items() if t in self._waiting}
        if self._refill is None:
            self._refill = loop.call_soon(self._refill_pool)

    def _refill_pool(self) -> None:
        self._refill = None
        self.pool.refill()

    def _upstream_readable(self, token: int) -> None:
        waiting = self._waiting.get(token)
        if waiting is None:
            return
        try:
            data = waiting[0].recv(65535)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # ECONNREFUSED: nothing listens there
            self._upstream_failed(token)
            return
        received = time.monotonic()
        try:
            actions = self.core.on_upstream_reply(token, data, time.time())
            if token not in self.core.pending or actions:
                self._forget(token)  # answered, or retried (the retry made a new socket)
                sent = self._sent_at.pop(token, None)
                if sent is not None:
                    self.upstream_latency.observe(received - sent)
            # else: not the answer to our question (spoofed, stale): keep listening
            self.perform(actions)
        except Exception as exc:
            self._forget(token)
            self._internal(exc)

    def _upstream_failed(self, token: int) -> None:
        self._forget(token)
        try:
            self.perform(self.core.on_upstream_failure(token, time.time()))
        except Exception as exc:
            self._internal(exc)

    def _forget(self, token: int) -> None:
        waiting = self._waiting.pop(token, None)
        if waiting is None:
            return
        sock, timer = waiting
        timer.cancel()
        if self._loop is not None:
            self._loop.remove_reader(sock.fileno())
        sock.close()

    async def _forward_tcp(self, fwd: Forward) -> None:
        host, port = self.upstreams[fwd.upstream]
        sent = time.monotonic()
        try:
            data = await asyncio.wait_for(self._exchange_tcp(host, port, fwd), self.timeout_s)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, EgressError):
            self._upstream_failed(fwd.token)
            return
        self.upstream_latency.observe(time.monotonic() - sent)  # over TCP, connect included
        try:
            actions = self.core.on_upstream_reply(fwd.token, data, time.time())
            self.perform(actions)
        except Exception as exc:
            self._internal(exc)
            return
        if not actions and fwd.token in self.core.pending:
            # Not the answer to our question, and a TCP exchange carries one frame: no
            # other answer is coming on it. Fail over (or SERVFAIL) instead of waiting.
            self._upstream_failed(fwd.token)

    async def _exchange_tcp(self, host: str, port: int, fwd: Forward) -> bytes:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with in_netns(self.upstream_netns):
            sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            set_mark(sock, self.mark)
            await loop.sock_connect(sock, (host, port))
            await loop.sock_sendall(sock, struct.pack("!H", len(fwd.data)) + fwd.data)
            return await _recv_frame(loop, sock)
        finally:
            sock.close()

    # -- TCP clients ---------------------------------------------------------------------

    # One sandbox must not take egressd's descriptors (shared by every sandbox it serves)
    # by opening connections: with MAX_TCP_CLIENTS open, the listening socket is not read
    # until one closes. Further connections wait in the kernel's backlog, then its SYN
    # queue drops them: the cost stays with the sandbox.

    def _accept_on(self) -> None:
        sock, loop = self._tcp_sock, self._loop
        if self._accepting or not self._tcp_open or sock is None or loop is None:
            return
        if self.tcp_clients < MAX_TCP_CLIENTS:
            loop.add_reader(sock.fileno(), self._tcp_acceptable)
            self._accepting = True

    def _accept_off(self) -> None:
        if self._accepting and self._tcp_sock is not None and self._loop is not None:
            self._loop.remove_reader(self._tcp_sock.fileno())
        self._accepting = False

    def _tcp_acceptable(self) -> None:
        sock, loop = self._tcp_sock, self._loop
        assert sock is not None and loop is not None
        for _ in range(BATCH):
            if self.tcp_clients >= MAX_TCP_CLIENTS:
                self.tcp_paused += 1
                self._accept_off()
                return
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # EMFILE, ENOBUFS: try again a little later
                self._accept_off()
                loop.call_later(0.1, self._accept_on)
                return
            conn.setblocking(False)
            self.tcp_clients += 1
            task = loop.create_task(self._tcp_client(conn))
            self._clients.add(task)
            task.add_done_callback(self._clients.discard)

    async def _tcp_client(self, conn: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=conn)
        except OSError:
            conn.close()
            self.tcp_clients -= 1
            self._accept_on()
            return
        await self._serve_tcp(reader, writer)

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = TcpClient(writer)
        try:
            while True:
                head = await asyncio.wait_for(reader.readexactly(2), TCP_IDLE_S)
                data = await asyncio.wait_for(
                    reader.readexactly(struct.unpack("!H", head)[0]), TCP_IDLE_S
                )
                if self._tokens(1):
                    self.handle_query(data, client, True)
                else:
                    # Dropped as over UDP, and this connection is not read again before a
                    # token is due: a pipelined flood waits in its own socket buffers (TCP
                    # flow control), not on this process's CPU.
                    self.rate_limited += 1
                    await asyncio.sleep(self.bucket.wait())
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            pass
        finally:
            self.tcp_clients -= 1
            self._accept_on()
            with contextlib.suppress(ConnectionError):
                writer.close()


def set_mark(sock: socket.socket, mark: int | None) -> None:
    """SO_MARK ``mark`` on ``sock`` (None: leave it unmarked). Needs CAP_NET_ADMIN (or
    CAP_NET_RAW): PermissionError without."""
    if mark is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)


def _kernel_drops(sock: socket.socket) -> int:
    """Datagrams the kernel dropped at ``sock`` (its receive buffer full), since it was made:
    SO_MEMINFO's SK_MEMINFO_DROPS (Linux 4.6)."""
    so_meminfo, sk_meminfo_drops = 55, 8
    try:
        info = sock.getsockopt(socket.SOL_SOCKET, so_meminfo, 4 * (sk_meminfo_drops + 1))
    except OSError:
        return -1  # unknown: not counted
    return int(struct.unpack_from("=I", info, 4 * sk_meminfo_drops)[0])


def _open_sets(nft: NftHandle) -> NetlinkSets | None:
    """A netlink writer in the netns of the sandbox's nft handle (None: use libnftables)."""
    try:
        return NetlinkSets(nft.netns)
    except (OSError, EgressError, AttributeError):
        return None


async def _recv_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    buf = b""
    while len(buf) < 2 or len(buf) < 2 + struct.unpack("!H", buf[:2])[0]:
        chunk = await loop.sock_recv(sock, 65537)
        if not chunk:
            raise asyncio.IncompleteReadError(buf, None)
        buf += chunk
    return buf[2 : 2 + struct.unpack("!H", buf[:2])[0]]
