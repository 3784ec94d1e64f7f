"""Where a sandbox's resolver asks: the upstream list, and its sockets.

``parse_upstream``/``resolve_upstreams`` turn a policy's ``dns.upstreams`` (or an
``--upstream``) into addresses; ``system`` means the host's resolv.conf, read at start.
``UpstreamPool`` keeps fresh, connected UDP sockets ready in the uplink netns (or, for a
sidecar, in the sandbox netns with SO_MARK), one per query, so every upstream query has
its own random source port and making one is not on a query's critical path.
``query_id_bits`` gives each upstream query its random ID, from a buffer of the kernel's
random bytes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import secrets
import socket
import struct
import threading
from array import array

from egress.errors import EgressError, UpstreamError
from egress.kernel.netns import in_netns, netns_path
from egress.model import Upstream


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


# (netns name, the inode of that netns: one made again under the same name is another
# supply; upstream host, port; SO_MARK)
SupplyKey = tuple[str | None, int, str, int, int | None]

# Fresh upstream sockets are made in batches, one netns switch each (a switch there and
# back costs about twice a socket and its connect), and shared by every server in this
# process that asks the same upstream from the same netns with the same mark: egressd's
# 1,000 sandboxes keep one supply between them, not four sockets each.
SUPPLY_LOW = 8  # fewer ready than this: topped up to SUPPLY_SIZE, between queries
SUPPLY_SIZE = 32
TAKE_BATCH = 4  # none ready when a query needs one: made on its path, this many at once
# A supply is topped up this many at a time, one step per turn of the loop that asked
# for it (however many servers share it), so a query or answer that arrives meanwhile
# waits for one step (~50 us here), not for the whole top-up: 24 sockets at once took
# 0.43-0.69 ms of egressctl run's loop, and the next cache miss waited behind it
# (bench_deployed, 1 miss in 24).
REFILL_STEP = 4


class Supply:
    """Ready sockets for one (netns, upstream, mark), shared by the pools that use it:
    taken and made from any thread, topped up (``top_up``) on the one loop that serves
    them (each process of egress runs one).

    Every socket is handed out once and closed by whoever took it, so sharing the ones not
    yet used changes nothing a query sees: its own socket, its own random source port.
    The netns is entered through a descriptor held from the start, so every batch is made
    in that namespace, and its inode (the key) can't go to another while the supply lives.
    """

    def __init__(self, key: SupplyKey, netns_fd: int | None) -> None:
        self.key = key
        self.users = 0
        self.ready: list[socket.socket] = []
        self.closed = False
        self.filling = False  # fell below SUPPLY_LOW, not yet back up to SUPPLY_SIZE
        self._netns_fd = netns_fd
        self._step: asyncio.Handle | None = None  # the top-up's next step (top_up)

    def take(self) -> socket.socket:
        while True:
            try:
                return self.ready.pop()
            except IndexError:  # none ready (or another thread took the last one)
                self.make(TAKE_BATCH)

    def refill(self, most: int = SUPPLY_SIZE) -> bool:
        """Once fewer than SUPPLY_LOW are ready, up to ``most`` more, until SUPPLY_SIZE
        are. True: still short of that, call again. A batch that fails (the netns is
        gone) ends the top-up: the next query's take says what is wrong."""
        have = len(self.ready)
        if have < SUPPLY_LOW:
            self.filling = True
        if not self.filling or have >= SUPPLY_SIZE:
            self.filling = False
            return False
        try:
            self.make(min(most, SUPPLY_SIZE - have))
        except (OSError, EgressError):
            self.filling = False
            return False
        self.filling = len(self.ready) < SUPPLY_SIZE
        return self.filling

    def top_up(self, loop: asyncio.AbstractEventLoop) -> None:
        """If the supply is low and no top-up is under way, one on ``loop``: REFILL_STEP
        sockets a turn, after whatever I/O that turn found ready (asyncio runs the handles
        queued before a turn's select first, the readers it found after), until it is
        full or a batch fails. One at a time per supply: egressd's sandboxes share one."""
        low = self.filling or len(self.ready) < SUPPLY_LOW
        if low and self._step is None and not self.closed:
            self._step = loop.call_soon(self._top_up_step, loop)

    def _top_up_step(self, loop: asyncio.AbstractEventLoop) -> None:
        self._step = None
        if self.refill(REFILL_STEP) and not self.closed:
            self._step = loop.call_soon(self._top_up_step, loop)

    def make(self, count: int) -> None:
        netns, _, host, port, mark = self.key
        if self._netns_fd is not None:
            netns = f"/proc/self/fd/{self._netns_fd}"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        made = []
        try:
            with in_netns(netns):
                for _ in range(count):
                    sock = socket.socket(family, socket.SOCK_DGRAM)
                    made.append(sock)
                    sock.setblocking(False)
                    set_mark(sock, mark)  # before connect: it picks the route
                    sock.connect((host, port))  # binds a random port; ICMP errors reach us
            with _supplies_lock:
                if self.closed:  # closed meanwhile, by the last pool out on another thread
                    raise UpstreamError("the upstream supply is closed")
                self.ready.extend(made)
        except BaseException:
            for sock in made:
                sock.close()
            raise

    def close(self) -> None:
        with _supplies_lock:
            self.closed = True
            ready, self.ready = self.ready, []
            fd, self._netns_fd = self._netns_fd, None
            step, self._step = self._step, None
        if step is not None:
            step.cancel()
        for sock in ready:
            sock.close()
        if fd is not None:
            os.close(fd)


_supplies: dict[SupplyKey, Supply] = {}
_supplies_lock = threading.Lock()


def _acquire(netns: str | None, host: str, port: int, mark: int | None) -> Supply:
    fd = _open_netns(netns)
    ino = 0 if fd is None else os.fstat(fd).st_ino
    key = (netns, ino, host, port, mark)
    with _supplies_lock:
        supply = _supplies.get(key)
        if supply is None:
            supply = _supplies[key] = Supply(key, fd)
            fd = None  # the new supply's now
        supply.users += 1
    if fd is not None:  # the supply holds one already
        os.close(fd)
    return supply


def _release(supply: Supply) -> None:
    with _supplies_lock:
        supply.users -= 1
        if supply.users > 0:
            return
        if _supplies.get(supply.key) is supply:
            del _supplies[supply.key]
    supply.close()


def _open_netns(netns: str | None) -> int | None:
    """A descriptor of the netns named (None: this thread's own one is used as it is, and
    a netns that can't be opened is named again at each batch: making a socket there then
    says what is wrong)."""
    if netns is None:
        return None
    try:
        return os.open(netns_path(netns), os.O_RDONLY | os.O_CLOEXEC)
    except (OSError, EgressError):
        return None


class UpstreamPool:
    """Fresh, connected, non-blocking UDP sockets in the uplink netns, one per query.

    Each is used once and closed, so every upstream query still gets its own random source
    port; making them (setns, socket, connect) happens between queries, in batches, not
    during one. ``mark`` (SO_MARK) is set on each when egress's own upstream traffic leaves
    from the sandbox netns itself (`egressd sidecar`): its ruleset accepts only marked
    packets there. The ready sockets come from a ``Supply`` shared with every other pool of
    this process with the same netns, upstream and mark. A pool is used from one thread
    (its server's loop); closed, it takes and makes nothing.
    """

    def __init__(
        self, upstreams: list[tuple[str, int]], netns: str | None, mark: int | None = None
    ) -> None:
        self.upstreams = upstreams
        self.netns = netns
        self.mark = mark
        self._supplies: list[Supply] | None = None
        self._closed = False

    def _open(self) -> list[Supply]:
        if self._closed:
            raise UpstreamError("the upstream pool is closed")
        if self._supplies is None:
            self._supplies = [
                _acquire(self.netns, host, port, self.mark) for host, port in self.upstreams
            ]
        return self._supplies

    def take(self, index: int) -> socket.socket:
        return self._open()[index].take()

    def refill(self) -> None:
        """Each supply topped up at once if it is low (Supply.refill); a server uses
        ``top_up``, a step a turn of its loop."""
        if not self._closed:
            for supply in self._open():
                supply.refill()

    def top_up(self, loop: asyncio.AbstractEventLoop) -> None:
        """Each supply topped up a step a turn of ``loop`` if it is low (Supply.top_up)."""
        if not self._closed:
            for supply in self._open():
                supply.top_up(loop)

    def close(self) -> None:
        self._closed = True
        supplies, self._supplies = self._supplies, None
        for supply in supplies or ():
            _release(supply)


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


ID_BUFFER = 2048  # upstream query IDs read from the kernel at once (4 KiB)
# Process-wide: every core of egressd takes from it. pop() is one step under the GIL, so
# threads never get the same ID from it; a forked child starts empty, so it never repeats
# its parent's.
_ids = array("H")


def _forget_ids() -> None:
    del _ids[:]


os.register_at_fork(after_in_child=_forget_ids)


def query_id_bits(k: int) -> int:
    """``secrets.randbits(k)`` (the resolver core's ``randbits``), whose 16-bit asks, an
    upstream query's ID, come from a buffer refilled from ``os.urandom``: a getrandom(2)
    per query cost a syscall (~5-20 µs on a miss's path, cold) between its decision and its
    send. Unpredictable alike: only this process sees the buffer."""
    if k != 16:
        return secrets.randbits(k)
    try:
        return _ids.pop()
    except IndexError:
        _ids.frombytes(os.urandom(2 * ID_BUFFER))
        return _ids.pop()


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
