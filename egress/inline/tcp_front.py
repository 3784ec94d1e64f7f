"""The resolver's TCP side for one sandbox: accept, read framed queries, answer.

At most MAX_TCP_CLIENTS connections are open at once: one sandbox must not take egressd's
descriptors (shared by every sandbox it serves) by opening connections, so at the cap the
listening socket is not read until one closes; further connections wait in the kernel's
backlog, then its SYN queue drops them, and the cost stays with the sandbox. A query over
the sandbox's rate limit is dropped, and that connection is not read again before a token
is due: a pipelined flood waits in its own socket buffers (TCP flow control), not on
egressd's CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable

TCP_IDLE_S = 10.0
BATCH = 64  # connections accepted per readiness callback
MAX_TCP_CLIENTS = 64  # open TCP connections per sandbox (a stub resolver uses one or two)
MAX_TCP_BACKLOG = 256 << 10  # unread answer bytes on one connection before it is dropped


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


class TcpFront:
    """Serves ``sock`` (listening): each query goes to ``handle`` once ``admit`` lets it
    (``admit`` returns 0 to take it, else how long this connection must wait)."""

    def __init__(
        self,
        sock: socket.socket,
        handle: Callable[[bytes, TcpClient], None],
        admit: Callable[[], float],
    ) -> None:
        self.sock = sock
        self._handle = handle
        self._admit = admit
        self.clients = 0  # open connections
        self.paused = 0  # times accepting stopped: MAX_TCP_CLIENTS were open
        self._open = False  # accepting (until stop or close)
        self._accepting = False  # the listening socket is being read now
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._open = True
        self._accept_on()

    @property
    def serving(self) -> bool:
        return self._open

    def stop(self) -> None:
        """No more accepts here (a successor takes the socket); open connections go on."""
        self._open = False
        self._accept_off()

    def close(self) -> None:
        self.stop()
        self.sock.close()
        for task in list(self._tasks):
            task.cancel()

    def _accept_on(self) -> None:
        loop = self._loop
        if self._accepting or not self._open or loop is None:
            return
        if self.clients < MAX_TCP_CLIENTS:
            loop.add_reader(self.sock.fileno(), self._acceptable)
            self._accepting = True

    def _accept_off(self) -> None:
        if self._accepting and self._loop is not None:
            self._loop.remove_reader(self.sock.fileno())
        self._accepting = False

    def _acceptable(self) -> None:
        loop = self._loop
        assert loop is not None
        for _ in range(BATCH):
            if self.clients >= MAX_TCP_CLIENTS:
                self.paused += 1
                self._accept_off()
                return
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # EMFILE, ENOBUFS: try again a little later
                self._accept_off()
                loop.call_later(0.1, self._accept_on)
                return
            conn.setblocking(False)
            self.clients += 1
            task = loop.create_task(self._client(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _client(self, conn: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=conn)
        except OSError:
            conn.close()
            self._left()
            return
        await self._serve(reader, writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = TcpClient(writer)
        try:
            while True:
                # asyncio.timeout, not wait_for: no task per read, and the client's end
                # (IncompleteReadError) leaves no garbage cycle through that task's frames:
                # on loopback, 14 objects a connection in cycles, not 38, each kept until
                # a full collection (egress/collect.py).
                async with asyncio.timeout(TCP_IDLE_S):
                    head = await reader.readexactly(2)
                async with asyncio.timeout(TCP_IDLE_S):
                    data = await reader.readexactly(struct.unpack("!H", head)[0])
                wait = self._admit()
                if wait == 0:
                    self._handle(data, client)
                else:
                    await asyncio.sleep(wait)
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            pass
        finally:
            self._left()
            with contextlib.suppress(ConnectionError):
                writer.close()

    def _left(self) -> None:
        self.clients -= 1
        self._accept_on()
