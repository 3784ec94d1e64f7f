"""A running egressd hands its sockets to its successor (`egressd --replace`).

A restart must lose no query. Sockets are the state that matters: a query waiting in a
resolver socket's receive queue is lost if that socket closes, however quickly a new
one is bound. So the old egressd passes the sockets themselves (SCM_RIGHTS over a unix
SOCK_SEQPACKET socket, root only, in the run dir): per sandbox the resolver's UDP and
TCP listening sockets, the inline layer's NFLOG socket and its first-bytes NFQUEUE socket
(a held segment's verdict may come from either process: the kernel knows the packet by
its id, not by who reads it), plus the API's listening socket. Both processes then hold
the same sockets; whatever either has not read yet, the other reads. The old one stops
reading only once the new one says it is serving, answers the queries it already sent
upstream, and exits without touching the kernel's rules.

    new ──connect──▶ old: {"op": "takeover"}
    old: refuse changes (503) ──▶ per sandbox {"kind": "sandbox", ...} + 4 fds
                              ──▶ {"kind": "api"} + 1 fd ──▶ {"kind": "done"}
    new: adopt with those sockets, serve ──▶ old: {"op": "serving"}
    old: stop reading, drain its in-flight queries, exit 0

If the new egressd dies before it says "serving", the old one notices the closed
connection and goes on serving as before: a failed upgrade costs nothing.

SIGHUP (systemd's `reload`) does the same within one process, for a service manager that
watches the pid: stop reading, drain, and exec a new image that inherits the sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import socket
import struct
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from egress.errors import Refused, SandboxError
from egress.store.paths import private_dir

SOCKET_NAME = "handoff.sock"
MAX_MESSAGE = 1 << 20
SERVE_DEADLINE_S = 120.0  # sockets handed over -> the successor serves (adopting 200: ~5 s)
STEP_TIMEOUT_S = 10.0  # each message; the whole handoff of 200 sandboxes takes ~0.1 s
CHUNK_BYTES = 64 << 10  # learned entries per message: a SEQPACKET message must fit the
# socket's send buffer (net.core.wmem_default, ~208 KiB), or send fails with EMSGSIZE


def dup(sock: socket.socket) -> socket.socket:
    """The same socket on a descriptor of its own, which outlives ``sock``'s."""
    return socket.socket(fileno=os.dup(sock.fileno()))


def _chunks(entries: list[list[Any]]) -> Iterator[list[list[Any]]]:
    """``entries`` in runs whose JSON stays near CHUNK_BYTES (one entry is < 4 KiB)."""
    chunk: list[list[Any]] = []
    size = 0
    for entry in entries:
        n = len(json.dumps(entry)) + 2
        if chunk and size + n > CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append(entry)
        size += n
    if chunk:
        yield chunk


def path_in(run_dir: Path) -> Path:
    return run_dir / SOCKET_NAME


@dataclass
class Handed:
    """One sandbox's sockets and resolver memory, as the old egressd passed them."""

    udp: socket.socket
    tcp: socket.socket
    nflog: socket.socket
    nfqueue: socket.socket | None  # None from an egressd older than the first-bytes check
    learned: list[list[Any]] = field(default_factory=list)

    def close(self) -> None:
        for sock in (self.udp, self.tcp, self.nflog, self.nfqueue):
            if sock is not None:
                sock.close()


@dataclass
class Taken:
    """What the new egressd received, and the line back to the old one (none when it
    is the old one, re-executed)."""

    conn: socket.socket | None
    old_pid: int
    sandboxes: dict[str, Handed]
    api: socket.socket | None

    def serving(self) -> None:
        """Tell the old egressd to stop reading; it drains and exits. SandboxError if it
        gave up waiting (it serves on): this one must not serve beside it."""
        if self.conn is not None:
            try:
                self.conn.sendall(b'{"op": "serving"}')
            except OSError as exc:
                raise SandboxError(f"the running egressd gave up on this handoff: {exc}") from None
            finally:
                self.conn.close()
                self.conn = None

    def close(self) -> None:
        for handed in self.sandboxes.values():
            handed.close()
        if self.api is not None:
            self.api.close()
        if self.conn is not None:
            self.conn.close()


# -- the new egressd ---------------------------------------------------------------------


def take_over(run_dir: Path) -> Taken | None:
    """Receive the running egressd's sockets; None if none is running there."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(STEP_TIMEOUT_S)
    try:
        conn.connect(str(path_in(run_dir)))
    except (FileNotFoundError, ConnectionRefusedError):
        conn.close()
        return None  # nobody to replace: start as usual (and adopt what is recorded)
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    old_pid = struct.unpack("3i", creds)[0]
    taken = Taken(conn, old_pid, {}, None)
    try:
        conn.sendall(json.dumps({"op": "takeover", "pid": os.getpid()}).encode())
        while True:
            data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 8)
            if not data:
                raise SandboxError("the running egressd closed the handoff before it was done")
            socks = [socket.socket(fileno=fd) for fd in fds]
            msg = json.loads(data)
            kind = msg.get("kind")
            if kind == "sandbox" and len(socks) in (3, 4):  # 3: an egressd before NFQUEUE
                queue = socks[3] if len(socks) == 4 else None
                taken.sandboxes[msg["id"]] = Handed(socks[0], socks[1], socks[2], queue)
            elif kind == "learned" and msg["id"] in taken.sandboxes:
                taken.sandboxes[msg["id"]].learned.extend(msg["entries"])
            elif kind == "api" and len(socks) == 1:
                taken.api = socks[0]
            elif kind == "done":
                taken.old_pid = int(msg["pid"])
                return taken
            elif kind == "refused":
                raise Refused(f"the running egressd refused the handoff: {msg['why']}")
            else:
                for sock in socks:
                    sock.close()
                raise SandboxError(f"unexpected handoff message {kind!r}")
    except Refused:
        taken.close()
        raise  # it is alive and busy: say so, don't start beside it
    except (OSError, ValueError, KeyError, SandboxError) as exc:
        taken.close()
        if _ended(old_pid):
            # It died mid-way (and its sockets with it, but for the ones we hold, now
            # closed): nobody serves, so start as usual and adopt what it recorded.
            print(f"egressd: egressd {old_pid} died during the handoff; adopting",
                  file=sys.stderr, flush=True)  # fmt: skip
            return None
        raise SandboxError(f"handoff from the running egressd failed: {exc}") from None
    except BaseException:
        taken.close()
        raise


def _ended(pid: int, wait_s: float = 2.0) -> bool:
    """Has ``pid`` ended (or does it within ``wait_s``)? A pidfd turns readable when the
    process exits, zombie or not; kill(pid, 0) would still find a zombie."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(wait_s * 1000))
    finally:
        os.close(fd)


# -- re-executing in place (SIGHUP; systemd's reload) -------------------------------------

MANIFEST_ENV = "EGRESS_HANDOFF_FD"


def exec_self(argv: list[str], offers: list[Offer], api: socket.socket | None) -> NoReturn:
    """Become a new egressd in this same process (the pid systemd watches stays), keeping
    the sockets open across exec: the same handoff, with exec as the channel.

    The caller has stopped reading and drained; the sockets passed here are duplicates it
    made first (its own descriptors are closed by then, or close on exec).
    """
    manifest: dict[str, Any] = {"pid": os.getpid(), "sandboxes": [], "api": None}
    for offer in offers:
        fds = offer.fds()
        manifest["sandboxes"].append({"id": offer.id, "fds": fds, "learned": offer.learned})
    keep = [fd for entry in manifest["sandboxes"] for fd in entry["fds"]]
    if api is not None:
        manifest["api"] = api.fileno()
        keep.append(api.fileno())
    for fd in keep:
        os.set_inheritable(fd, True)
    memfd = os.memfd_create("egress-handoff", 0)  # no MFD_CLOEXEC: the new image reads it
    os.write(memfd, json.dumps(manifest).encode())
    os.lseek(memfd, 0, os.SEEK_SET)
    os.environ[MANIFEST_ENV] = str(memfd)
    sys.stdout.flush()
    sys.stderr.flush()
    # A handled signal reverts to its default (terminate) across exec: ignored instead,
    # a second reload during the new image's start-up can't kill it and the sockets.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # -P: no module from the working directory. Through the console script if that is
    # how it was started, so `ps` still says egressd.
    script = sys.argv[0] if os.path.basename(sys.argv[0]) == "egressd" else None
    how = [script] if script else ["-m", "egress.daemon.main"]
    os.execv(sys.executable, [sys.executable, "-P", *how, *argv])


def inherited() -> Taken | None:
    """The sockets the previous image of this process left open for us, if it did."""
    raw = os.environ.pop(MANIFEST_ENV, None)
    if raw is None:
        return None
    memfd = int(raw)
    data = b""
    while chunk := os.read(memfd, 1 << 20):
        data += chunk
    os.close(memfd)
    manifest = json.loads(data)
    taken = Taken(None, int(manifest["pid"]), {}, None)
    for entry in manifest["sandboxes"]:
        socks = [_adopt_fd(fd) for fd in entry["fds"]]
        queue = socks[3] if len(socks) == 4 else None  # 3: the image before was older
        taken.sandboxes[entry["id"]] = Handed(socks[0], socks[1], socks[2], queue,
                                              entry["learned"])  # fmt: skip
    if manifest["api"] is not None:
        taken.api = _adopt_fd(int(manifest["api"]))
    return taken


def _adopt_fd(fd: int) -> socket.socket:
    os.set_inheritable(fd, False)  # not to be passed on to anything this image runs
    return socket.socket(fileno=fd)


# -- the old egressd ---------------------------------------------------------------------


@dataclass
class Offer:
    """One sandbox's part of the handoff, as the registry gives it."""

    id: str
    udp: socket.socket
    tcp: socket.socket
    nflog: socket.socket
    nfqueue: socket.socket
    learned: list[list[Any]]

    def dup(self) -> Offer:
        """The same sockets on descriptors of their own (they outlive ours)."""
        udp, tcp, nflog, nfqueue = (dup(s) for s in (self.udp, self.tcp, self.nflog, self.nfqueue))
        return Offer(self.id, udp, tcp, nflog, nfqueue, self.learned)

    def fds(self) -> list[int]:
        return [s.fileno() for s in (self.udp, self.tcp, self.nflog, self.nfqueue)]


class Giver:
    """Listens for a successor; ``done`` is set once one is serving in our place."""

    def __init__(
        self,
        run_dir: Path,
        offers: Callable[[], list[Offer]],
        api_socket: Callable[[], socket.socket | None],
        pause: Callable[[bool], None],
        settled: Callable[[], Awaitable[None]],
    ) -> None:
        self.path = path_in(run_dir)
        self._offers = offers
        self._api_socket = api_socket
        self._pause = pause  # True: refuse changes while sockets are in flight
        self._settled = settled  # returns once no change is half-done
        self._task: asyncio.Task[None] | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self.done = asyncio.Event()
        self.successor = 0
        self._listener: socket.socket | None = None
        self._conn: socket.socket | None = None
        self._inode: tuple[int, int] | None = None

    def listen(self) -> None:
        """Bind under a temporary name, then rename into place: a successor binding its
        own replaces the path atomically, and we never unlink one that isn't ours."""
        private_dir(self.path.parent)
        tmp = self.path.with_name(f".{SOCKET_NAME}.{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)  # root only, from the first moment
        try:
            sock.bind(str(tmp))
        finally:
            os.umask(old)
        sock.listen(1)
        sock.setblocking(False)
        os.replace(tmp, self.path)
        st = os.stat(self.path)
        self._inode = (st.st_dev, st.st_ino)
        self._listener = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._accept)

    def close(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None:
            self._task.cancel()
        if self._deadline is not None:
            self._deadline.cancel()
        for sock in (self._listener, self._conn):
            if sock is not None:
                with contextlib.suppress(ValueError, OSError):
                    loop.remove_reader(sock.fileno())
                sock.close()
        self._listener = self._conn = None
        with contextlib.suppress(OSError):
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:
                self.path.unlink()

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        if self._conn is not None:  # one successor at a time
            with contextlib.suppress(OSError):
                conn.send(json.dumps({"kind": "refused", "why": "a handoff is under way"}).encode())
            conn.close()
            return
        self._conn = conn
        conn.setblocking(False)  # the request is read when it comes, not waited for here
        asyncio.get_running_loop().add_reader(conn.fileno(), self._request)

    def _request(self) -> None:
        conn = self._conn
        assert conn is not None
        asyncio.get_running_loop().remove_reader(conn.fileno())
        self._task = asyncio.ensure_future(self._hand_over(conn))

    @property
    def busy(self) -> bool:
        """A successor is connected (until it serves, or leaves)."""
        return self._conn is not None

    async def _hand_over(self, conn: socket.socket) -> None:
        try:
            request = json.loads(conn.recv(MAX_MESSAGE) or b"{}")
            if request.get("op") != "takeover":
                raise ValueError(f"unknown request {request!r}")
            self.successor = int(request.get("pid", 0))
            self._pause(True)
            # A create that is half-done would be served here and missed there.
            await asyncio.wait_for(self._settled(), STEP_TIMEOUT_S)
            conn.settimeout(STEP_TIMEOUT_S)  # the successor reads as fast as we send
            self._give(conn)
            conn.setblocking(False)
        except (OSError, ValueError, TimeoutError) as exc:
            print(f"egressd: handoff failed, serving on: {exc}", file=sys.stderr, flush=True)
            self._abandon()
            return
        loop = asyncio.get_running_loop()
        loop.add_reader(conn.fileno(), self._answer)
        self._deadline = loop.call_later(SERVE_DEADLINE_S, self._give_up)

    def _give(self, conn: socket.socket) -> None:
        for offer in self._offers():
            head = {"kind": "sandbox", "id": offer.id}
            socket.send_fds(conn, [json.dumps(head).encode()], offer.fds())
            for chunk in _chunks(offer.learned):
                conn.sendall(
                    json.dumps({"kind": "learned", "id": offer.id, "entries": chunk}).encode()
                )
        api = self._api_socket()
        if api is not None:
            socket.send_fds(conn, [b'{"kind": "api"}'], [api.fileno()])
        conn.sendall(json.dumps({"kind": "done", "pid": os.getpid()}).encode())

    def _answer(self) -> None:
        assert self._conn is not None
        try:
            data = self._conn.recv(MAX_MESSAGE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data and json.loads(data).get("op") == "serving":
            # Done: its closing the connection later is no news.
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
            if self._deadline is not None:
                self._deadline.cancel()
            print(
                f"egressd: egressd {self.successor} serves in our place; draining",
                file=sys.stderr,
                flush=True,
            )
            self.done.set()
            return
        # The successor went away before serving: ours to serve again.
        print("egressd: the successor left before serving; serving on", file=sys.stderr)
        self._abandon()

    def _give_up(self) -> None:
        """A successor that never says it serves must not keep us refusing changes: we
        serve on, and its "serving" finds the connection closed (it then stops)."""
        print(f"egressd: egressd {self.successor} did not serve within "
              f"{SERVE_DEADLINE_S:g} s; serving on", file=sys.stderr, flush=True)  # fmt: skip
        self._abandon()

    def _abandon(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self._conn is not None:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self._conn.fileno())
            self._conn.close()
            self._conn = None
        self._pause(False)
        self._relisten()

    def _relisten(self) -> None:
        """Take the path back: a successor that got as far as listening replaced it."""
        with contextlib.suppress(OSError):
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:
                return  # still ours
        if self._listener is not None:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
        try:
            self.listen()
        except OSError as exc:
            print(f"egressd: cannot listen for a successor again: {exc}", file=sys.stderr)
