"""The lab's authoritative DNS server: "the internet's" DNS, over UDP and TCP, on asyncio.

Run inside the lab's internet netns::

    python -m egress.lab.dns --zones FILE --listen 198.51.100.53 \\
        --listen 2001:db8:53::53 --query-log PATH --status-file PATH

Per packet: log it (querylog.py, before anything else can fail), then either relay it raw
to a tunnel server (a relay zone, matched on the hand-read question name) or parse it with
dnslib and answer from the zones (authority.py); a UDP query for a synthesized AnyIP
name's A record is answered from its bytes, without a task or dnslib (quick_answer).
Nothing a client sends may stop the server: unparseable packets get FORMERR built from
the raw header, responses (QR=1) are dropped, and any unexpected exception answers
SERVFAIL and is printed to stderr.

SIGHUP re-reads the zone file (a broken file keeps the old zones); every load is reported
in the status file, which is how the lab knows a reload has taken effect.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import ipaddress
import json
import os
import signal
import socket
import struct
import sys
import time
import traceback
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, cast

from dnslib import DNSRecord

from egress.errors import LabError
from egress.lab import dnsmsg
from egress.lab.authority import answer, encode, is_relay, quick_answer
from egress.lab.querylog import QueryLog, entry
from egress.lab.zones import Relay, ZoneSet, load_zones, parse_hostport

TCP_IDLE_SECONDS = 10.0
DEFAULT_RELAY_TIMEOUT = 5.0
# A resolver that was busy (an egressd re-executing, a cold cache) forwards its backlog in
# one burst. The default receive buffer (rmem_default, 208 KiB) holds ~250 queries, and
# the rest would be dropped before this server saw them, so the lab would fail queries no
# real upstream fails. 8 MiB holds ~10,000.
UDP_RCVBUF = 8 << 20
_SO_RCVBUFFORCE = 33  # not exported by the socket module; root may exceed rmem_max


class LabDnsServer:
    """Serves one ZoneSet on any number of addresses; usable in-process on 127.0.0.1:0."""

    def __init__(
        self,
        zones: ZoneSet,
        query_log: QueryLog | None = None,
        relay_timeout: float = DEFAULT_RELAY_TIMEOUT,
    ) -> None:
        self.zones = zones
        self.query_log = query_log
        self.relay_timeout = relay_timeout
        self._tasks: set[asyncio.Task[None]] = set()
        self._udp: list[asyncio.DatagramTransport] = []
        self._tcp: list[asyncio.Server] = []

    async def start(self, listen: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
        """Bind UDP then TCP on each (host, port); port 0 picks one, the same for both."""
        loop = asyncio.get_running_loop()
        bound: list[tuple[str, int]] = []
        for host, port in listen:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _UdpProtocol(self), local_addr=(host, port)
            )
            self._udp.append(transport)
            _grow_rcvbuf(transport.get_extra_info("socket"))
            port = transport.get_extra_info("sockname")[1]
            server = await asyncio.start_server(self._tcp_client, host, port, reuse_address=True)
            self._tcp.append(server)
            bound.append((host, port))
        return bound

    async def close(self) -> None:
        for transport in self._udp:
            transport.close()
        for server in self._tcp:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # a strong reference, or the loop may drop the task
        task.add_done_callback(self._tasks.discard)

    def received(
        self, packet: bytes, proto: str, src: tuple[Any, ...]
    ) -> dnsmsg.RawQuestion | None:
        """Log the packet; the log line is on disk before the packet is processed."""
        question = dnsmsg.parse_question(packet)
        if self.query_log is not None:
            try:
                self.query_log.write(entry(packet, proto, src, question))
            except (OSError, ValueError) as exc:  # a full disk must not stop answers
                print(f"lab dns: query log write failed: {exc}", file=sys.stderr)
        return question

    async def respond(
        self, packet: bytes, proto: str, question: dnsmsg.RawQuestion | None
    ) -> bytes | None:
        """The reply to send, or None to stay silent."""
        try:
            return await self._respond(packet, proto, question)
        except asyncio.CancelledError:
            raise
        except Exception:
            traceback.print_exc(file=sys.stderr)
            return dnsmsg.error_reply(packet, dnsmsg.RCODE_SERVFAIL, question)

    async def _respond(
        self, packet: bytes, proto: str, question: dnsmsg.RawQuestion | None
    ) -> bytes | None:
        if dnsmsg.header(packet) is None or dnsmsg.is_response(packet):
            return None
        if question is not None and dnsmsg.opcode(packet) == 0:
            relay = is_relay(self.zones, question.key)
            if relay is not None:
                return await self._relay(packet, relay, question)
        try:
            request = DNSRecord.parse(packet)
        except Exception:  # dnslib raises many types on bad input
            return dnsmsg.error_reply(packet, dnsmsg.RCODE_FORMERR, question)
        result = answer(self.zones, request)
        if result.delay:
            await asyncio.sleep(result.delay)
        return encode(result, request, udp=proto == "udp")

    async def _relay(
        self, packet: bytes, relay: Relay, question: dnsmsg.RawQuestion
    ) -> bytes | None:
        """Forward the packet byte for byte; its reply goes back byte for byte."""
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[bytes] = loop.create_future()
        try:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _OneReply(reply), remote_addr=(relay.host, relay.port)
            )
        except OSError:
            return dnsmsg.error_reply(packet, dnsmsg.RCODE_SERVFAIL, question)
        try:
            transport.sendto(packet)
            return await asyncio.wait_for(reply, self.relay_timeout)
        except (TimeoutError, OSError):
            # Nobody serving the relay zone: say so now rather than let the client time out.
            return dnsmsg.error_reply(packet, dnsmsg.RCODE_SERVFAIL, question)
        finally:
            transport.close()

    async def _tcp_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or ()
        try:
            while True:
                head = await asyncio.wait_for(reader.readexactly(2), TCP_IDLE_SECONDS)
                packet = await asyncio.wait_for(
                    reader.readexactly(struct.unpack("!H", head)[0]), TCP_IDLE_SECONDS
                )
                question = self.received(packet, "tcp", peer)
                # One query at a time per connection: simple, and enough for a lab.
                reply = await self.respond(packet, "tcp", question)
                if reply is not None:
                    writer.write(struct.pack("!H", len(reply)) + reply)
                    await writer.drain()
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()


def _grow_rcvbuf(sock: Any) -> None:
    """UDP_RCVBUF, forced past rmem_max when root (the lab is), else as much as allowed."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, UDP_RCVBUF)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UDP_RCVBUF)


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, server: LabDnsServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The selector transport is not a registered DatagramTransport subclass: cast.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        question = self.server.received(data, "udp", addr)
        if question is not None and self.transport is not None:
            # A synthesized name's A record: its reply's bytes at once, no task, no dnslib.
            try:
                quick = quick_answer(self.server.zones, data, question)
            except Exception:  # the slow path answers it, or says SERVFAIL
                traceback.print_exc(file=sys.stderr)
                quick = None
            if quick is not None:
                self.transport.sendto(quick, addr)
                return
        self.server.spawn(self._answer(data, addr, question))

    async def _answer(
        self, data: bytes, addr: tuple[Any, ...], q: dnsmsg.RawQuestion | None
    ) -> None:
        reply = await self.server.respond(data, "udp", q)
        if reply is not None and self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(reply, addr)

    def error_received(self, exc: Exception) -> None:
        pass  # ICMP errors about clients that went away are not our problem


class _OneReply(asyncio.DatagramProtocol):
    def __init__(self, future: asyncio.Future[bytes]) -> None:
        self.future = future

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        if not self.future.done():
            self.future.set_result(data)

    def error_received(self, exc: Exception) -> None:
        if not self.future.done():
            self.future.set_exception(exc)  # e.g. ICMP port unreachable: nobody listens


# -- the process -------------------------------------------------------------------------


def parse_listen(text: str, default_port: int) -> tuple[str, int]:
    """'ADDR', 'ADDR:PORT' or '[IPv6]:PORT' -> (addr, port)."""
    try:
        return str(ipaddress.ip_address(text)), default_port
    except ValueError:
        pass
    host, port = parse_hostport(text)
    if not host:
        raise LabError(f"--listen {text!r}: {port}")
    return host, int(port)


def write_status(path: str | None, status: dict[str, Any]) -> None:
    """Replace the status file atomically, so a reader never sees half of it."""
    if not path:
        return
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(json.dumps(status) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class _Process:
    """The long-running server process: zones from a file, reload on SIGHUP."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.generation = 0
        self.status: dict[str, Any] = {"pid": os.getpid(), "listening": [], "attempt": 0}

    def load(self) -> ZoneSet:
        digest = hashlib.sha256(Path(self.args.zones).read_bytes()).hexdigest()
        zones = load_zones(self.args.zones)
        self.generation += 1
        self.status.update(zones_sha256=digest, generation=self.generation, error=None)
        self.status["loaded_at"] = time.time()
        return zones

    def reload(self, server: LabDnsServer) -> None:
        # Counted per attempt, so a waiter can tell this reload's result from an old one.
        self.status["attempt"] = self.status.get("attempt", 0) + 1
        try:
            server.zones = self.load()
            print(f"lab dns: reloaded {self.args.zones}", file=sys.stderr, flush=True)
        except (LabError, OSError) as exc:
            self.status["error"] = str(exc)
            print(f"lab dns: reload failed, keeping old zones: {exc}", file=sys.stderr, flush=True)
        write_status(self.args.status_file, self.status)

    async def run(self) -> None:
        zones = self.load()
        log = QueryLog(self.args.query_log) if self.args.query_log else None
        server = LabDnsServer(zones, log, self.args.relay_timeout)
        listen = [parse_listen(item, self.args.port) for item in self.args.listen]
        bound = await server.start(listen)
        self.status["listening"] = [f"{h}:{p}" if ":" not in h else f"[{h}]:{p}" for h, p in bound]
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGHUP, self.reload, server)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        write_status(self.args.status_file, self.status)
        print(f"lab dns: serving on {', '.join(self.status['listening'])}", flush=True)
        await stop.wait()
        await server.close()
        if log is not None:
            log.close()


_EPILOG = """\
example:
  ip netns exec egresslab-inet python -m egress.lab.dns \\
    --zones zones.yaml --listen 198.51.100.53 --listen 2001:db8:53::53 \\
    --query-log /tmp/queries.jsonl
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m egress.lab.dns",
        description="The egress lab's authoritative DNS server (UDP and TCP).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    parser.add_argument("--zones", required=True, help="zone file (YAML, see zones.py)")
    parser.add_argument("--listen", action="append", required=True, metavar="ADDR[:PORT]")
    parser.add_argument("--port", type=int, default=53, help="port for --listen without one")
    parser.add_argument("--query-log", metavar="PATH", help="append one JSON line per query")
    parser.add_argument("--status-file", metavar="PATH", help="JSON status, rewritten per load")
    parser.add_argument("--relay-timeout", type=float, default=DEFAULT_RELAY_TIMEOUT)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        asyncio.run(_Process(args).run())
    except (LabError, OSError) as exc:
        print(f"lab dns: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
