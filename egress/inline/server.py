"""The resolver's asyncio shell: sockets in, ResolverCore decisions, sockets out.

The listening sockets live in the sandbox's netns (on its loopback resolver address); the
upstream sockets are opened in the uplink netns, where the sandbox's own rules don't
apply and egress's traffic leaves (upstream.py: one fresh socket per query). TCP clients
are served by tcp_front.py; the rate limit and every decision are shared.

Hot path (a repeated UDP query): one readiness callback drains the listening socket,
``ResolverCore.replay`` maps the query's bytes to the reply's, ``sendto``. No transport,
protocol, task or future objects per packet, so it runs the same on asyncio's loop and on
uvloop. Everything else goes through ``ResolverCore.on_query`` and ``perform``.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Callable, Coroutine

from egress.datapath import constants as c
from egress.errors import EgressError
from egress.inline.sets import SetStats, SetWriter
from egress.inline.tcp_front import TcpClient, TcpFront
from egress.inline.upstream import (
    Latencies,
    UpstreamPool,
    query_id_bits,
    recv_frame,
    set_mark,
)
from egress.kernel.netns import in_netns
from egress.kernel.nft import NftHandle
from egress.model import Policy, Violation
from egress.resolver.actions import Action, AllowThenReply, Forward, Reply, Report, Revoke
from egress.resolver.core import ResolverCore
from egress.resolver.ratelimit import TokenBucket
from egress.tunnel import scorer_for

MAX_QUERY = 4096  # bytes read per datagram: a longer "query" is cut short and refused
BATCH = 64  # datagrams per readiness callback, so TCP and upstream replies get turns
MAX_IN_FLIGHT = 1024  # queries waiting on an upstream per sandbox (each holds a socket)


class UdpClient:
    __slots__ = ("addr", "sock")

    def __init__(self, sock: socket.socket, addr: tuple[str, int]) -> None:
        self.sock = sock
        self.addr = addr

    def send(self, data: bytes) -> None:
        # A full socket buffer or an ICMP error loses this one reply, as UDP may. (try, not
        # contextlib.suppress: no context manager's two calls on every miss's reply.)
        try:  # noqa: SIM105
            self.sock.sendto(data, self.addr)
        except OSError:
            pass


def make_core(policy: Policy, upstream_count: int) -> ResolverCore:
    """The resolver core one sandbox is served with, in every wiring (run, egressd):
    random upstream IDs from the OS (``query_id_bits``), and the policy's tunnel scorer on
    the monotonic clock."""
    scorer = scorer_for(policy.tunnel, time.monotonic)  # never steps: tunnel/headroom.py
    return ResolverCore(
        policy, upstream_count, query_id_bits, scorer=scorer, monotonic=time.monotonic
    )


class ResolverServer:
    """Serves one sandbox. ``on_violation`` receives each inline verdict as it happens."""

    def __init__(
        self,
        *,
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
        self.writer = SetWriter(nft)
        self.internal_errors = 0
        self.last_internal_error = ""
        self.dropped_replies = 0
        self.mark = mark  # SO_MARK of upstream sockets (UpstreamPool)
        self.pool = UpstreamPool(upstreams, upstream_netns, mark)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._udp: socket.socket | None = None
        self._tcp: TcpFront | None = None
        self._accepting = False  # the listening socket is being read now
        self._tasks: set[asyncio.Task[None]] = set()
        self._waiting: dict[int, tuple[socket.socket, asyncio.TimerHandle]] = {}
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
            self.pool.top_up(loop)  # a step a turn, if low: other sandboxes share it
            self.writer.open()
        except BaseException:
            udp.close()
            tcp.close()
            self.pool.close()
            self.writer.close()
            raise
        self._udp = udp
        self._tcp = TcpFront(tcp, self._tcp_query, self._admit_tcp)
        self._tcp.start()
        loop.add_reader(udp.fileno(), self._udp_readable)

    @property
    def sets(self) -> SetStats:
        """The set writer's counts (updates, failures, late acks, last duration)."""
        return self.writer.stats

    @property
    def listening(self) -> tuple[socket.socket, socket.socket]:
        """The (UDP, TCP) listening sockets, to hand to a successor egressd."""
        assert self._udp is not None and self._tcp is not None
        return self._udp, self._tcp.sock

    async def drain(self, timeout_s: float) -> None:
        """Stop reading new queries (a successor reads them now) and wait, at most
        ``timeout_s``, for the answers to the ones already sent upstream."""
        loop = asyncio.get_running_loop()
        if self._paused is not None:  # a flood pause must not resume reading later
            self._paused.cancel()
            self._paused = None
        if self._udp is not None:
            loop.remove_reader(self._udp.fileno())
        if self._tcp is not None:
            self._tcp.stop()  # no more accepts here; connections already open go on
        deadline = loop.time() + timeout_s
        while (self._waiting or self._tasks) and loop.time() < deadline:
            await asyncio.sleep(0.01)

    @property
    def addresses(self) -> tuple[tuple[str, int], tuple[str, int]]:
        """(UDP, TCP) addresses listened on: with port 0 the kernel picks them apart."""
        assert self._udp is not None and self._tcp is not None
        return self._udp.getsockname(), self._tcp.sock.getsockname()

    @property
    def tcp_clients(self) -> int:
        return 0 if self._tcp is None else self._tcp.clients

    @property
    def tcp_paused(self) -> int:
        return 0 if self._tcp is None else self._tcp.paused

    def _tcp_query(self, data: bytes, client: TcpClient) -> None:
        self.handle_query(data, client, True)

    def _admit_tcp(self) -> float:
        """0: take this TCP query; else it is dropped, as over UDP, and its connection
        waits this long before it is read again."""
        if self._tokens(1):
            return 0.0
        self.rate_limited += 1
        return max(self.bucket.wait(), 1e-3)

    async def close(self) -> None:
        if self._udp is not None and self._loop is not None:
            self._loop.remove_reader(self._udp.fileno())
            self._udp.close()
            self._udp = None
        if self._tcp is not None:
            self._tcp.close()
        for token in list(self._waiting):
            self._forget(token)
        # Before the wait below (TCP exchanges use no pooled socket): the last pool out
        # of a supply ends its top-up, if one is under way.
        self.pool.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self.writer.close()

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
        if sock is None or self._loop is None or self._tcp is None or not self._tcp.serving:
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
                self.perform(self.allow(action))
            elif isinstance(action, Forward):
                self._forward(action)
            elif isinstance(action, Report):
                self.on_violation(action.violation)
            elif isinstance(action, Revoke):
                self.writer.revoke(action.update)

    def allow(self, action: AllowThenReply) -> list[Action]:
        """Put the planned elements in the kernel's sets, one add at a time, each acked;
        the core hears how far it got (and whether in time) and says what to send."""
        try:
            done = self.writer.apply(action.adds)
        except Exception as exc:  # a bug in the writer: its clients get SERVFAIL, not silence
            self._internal(exc)
            return self.core.on_allowed(action.token, 0, time.time())
        return self.core.on_allowed(action.token, done.acked, time.time(), late=done.late)

    def handle_query(self, data: bytes, client: UdpClient | TcpClient, tcp: bool) -> None:
        """One query in; never raises: a bug must cost one answer, not the server."""
        self.settle()
        try:
            self.perform(self.core.on_query(data, client, tcp, time.time()))
        except Exception as exc:  # the server outlives any single packet
            self._internal(exc)
        self.settle()  # the scorer's part, once the query is upstream

    def settle(self) -> None:
        """The core's deferred work (``ResolverCore.settle``: the scoring of queries sent
        first, answers' rcodes), done: after each send, and before each call into the
        core, so that what it returns is that call's own. A bug in it costs no other work."""
        core = self.core
        if core.later:
            try:
                self.perform(core.settle(time.time()))
            except Exception as exc:
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
        self.settle()
        try:
            actions = self.core.on_upstream_reply(token, data, time.time())
            pending = token in self.core.pending
            if pending and not actions:
                return  # not the answer to our question (spoofed, stale): keep listening
            sent = self._sent_at.pop(token, None)
            if sent is not None:
                self.upstream_latency.observe(received - sent)
            self.perform(actions)
            self.settle()  # the scorer's part, once the answer is out
            if not pending:
                # Answered: this exchange's socket is closed and its reader and timer go
                # after the set update and the reply (~20 us of syscalls off a miss's
                # latency); nothing runs in between. A retry (still pending: over TCP, or
                # at the next upstream) was ended by _forward, before its successor took
                # the token's place.
                self._forget(token)
        except Exception as exc:
            self._internal(exc)
            self._upstream_failed(token)  # still pending? then SERVFAIL, not a lost question

    def _upstream_failed(self, token: int) -> None:
        self._forget(token)
        self.settle()
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
            # Topped up once this answer went out, when low, a few sockets a turn of the
            # loop (Supply.top_up): what arrives meanwhile waits for one step at most.
            self.pool.top_up(self._loop)
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
        self.settle()
        try:
            actions = self.core.on_upstream_reply(fwd.token, data, time.time())
            self.perform(actions)
            self.settle()
        except Exception as exc:
            self._internal(exc)
            self._upstream_failed(fwd.token)  # still pending? then SERVFAIL
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
            return await recv_frame(loop, sock)
        finally:
            sock.close()

    # -- TCP clients ---------------------------------------------------------------------


def _kernel_drops(sock: socket.socket) -> int:
    """Datagrams the kernel dropped at ``sock`` (its receive buffer full), since it was made:
    SO_MEMINFO's SK_MEMINFO_DROPS (Linux 4.6)."""
    so_meminfo, sk_meminfo_drops = 55, 8
    try:
        info = sock.getsockopt(socket.SOL_SOCKET, so_meminfo, 4 * (sk_meminfo_drops + 1))
    except OSError:
        return -1  # unknown: not counted
    return int(struct.unpack_from("=I", info, 4 * sk_meminfo_drops)[0])
