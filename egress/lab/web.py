"""The lab's web servers: every lab HTTP address, ports 80, 443 and 8080, plus UDP echo.

One asyncio process serves them all. ``GET /`` answers ``lab 203.0.113.10:80`` (IPv6 as
``lab [2001:db8:80::10]:80``), the address and port the request actually reached, so a test
can assert which server it hit rather than merely that something answered. ``GET /bytes/N``
returns N bytes, for benchmarks. UDP port 9999 echoes each datagram back, so tests have a
"UDP to anything" target; ICMP echo needs nothing, the kernel answers it.

Port 443 speaks both TLS and plain HTTP, told apart by the first byte a client sends (a TLS
handshake record starts with 0x16): real tools need HTTPS, while the lab's own tests reach
443 with plain HTTP. The certificate (sites.py) is for lab.test and *.lab.test, signed by a
CA made for the lab. A request whose Host names a site (a directory under ``--sites``:
pypi.lab.test, npm.lab.test, git.lab.test) is answered from that directory, on any lab
address and port: a static tree, ``index.html`` or ``index.json`` for a directory. Every
request is written to the access log (accesslog.py) before its answer goes out.

Run inside the lab's internet netns::

    python -m egress.lab.web --listen 203.0.113.10 --listen 2001:db8:80::10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import ssl
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, cast

from aiohttp import web

from egress.lab.accesslog import AccessLog, entry

DEFAULT_PORTS = (80, 443, 8080)
TLS_PORT = 443
UDP_ECHO_PORT = 9999
MAX_BYTES = 100 * 1024 * 1024
SNIFF_SECONDS = 10.0  # a client that connects and says nothing is dropped after this
TLS_RECORD_HANDSHAKE = 0x16
_SNI = "egress_lab_sni"  # where the SNI callback leaves the name on the SSL object
_TYPES = {".html": "text/html", ".json": "application/json", ".txt": "text/plain"}
_SITES = web.AppKey("sites", Path)
_LOG = web.AppKey("access_log", AccessLog)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def hostport(sockname: Sequence[Any]) -> str:
    """'203.0.113.10:80' or '[2001:db8:80::10]:80'."""
    host, port = str(sockname[0]), int(sockname[1])
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def body_for(sockname: Sequence[Any]) -> str:
    return f"lab {hostport(sockname)}\n"


async def _index(request: web.Request) -> web.Response:
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    return web.Response(text=body_for(sockname) if sockname else "lab ?\n")


async def _bytes(request: web.Request) -> web.Response:
    try:
        count = int(request.match_info["count"])
    except ValueError:
        raise web.HTTPBadRequest(text="count must be an integer\n") from None
    if not 0 <= count <= MAX_BYTES:
        raise web.HTTPBadRequest(text=f"count must be 0..{MAX_BYTES}\n")
    return web.Response(body=b"x" * count, content_type="application/octet-stream")


# -- sites: static trees chosen by the Host header ---------------------------------------


def request_host(request: web.Request) -> str:
    """The Host header's name, lower case, without a port ('' when absent)."""
    host = (request.headers.get("Host") or "").strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def site_file(root: Path, path: str) -> Path | None:
    """The file ``path`` names under ``root``; a directory's index; None if neither."""
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") or "\0" in p or "\\" in p for p in parts):
        return None
    target = root.joinpath(*parts)
    if target.is_dir():
        target = next(
            (target / i for i in ("index.html", "index.json") if (target / i).is_file()), target
        )
    if not target.is_file() or not target.resolve().is_relative_to(root.resolve()):
        return None
    return target


def site_root(sites: Path | None, host: str) -> Path | None:
    """The directory that serves ``host``, when ``host`` is one of the sites."""
    if sites is None or not host or "/" in host or host.startswith("."):
        return None
    root = sites / host
    return root if root.is_dir() else None


@web.middleware
async def _sites(request: web.Request, handler: Handler) -> web.StreamResponse:
    host = request_host(request)
    root = site_root(request.app.get(_SITES), host)
    if root is None:
        return await handler(request)  # an address, or a name that is not a site
    if request.method not in ("GET", "HEAD"):
        raise web.HTTPMethodNotAllowed(request.method, ["GET", "HEAD"])
    target = site_file(root, request.path)
    if target is None:
        raise web.HTTPNotFound(text=f"no {request.path} on {host}\n")
    kind = _TYPES.get(target.suffix, "application/octet-stream")
    return web.Response(body=target.read_bytes(), content_type=kind)


# -- the access log ----------------------------------------------------------------------


def _log_request(request: web.Request, log: AccessLog, status: int, size: int) -> None:
    transport = request.transport
    extra = transport.get_extra_info if transport else (lambda _name: None)
    peer, sock, ssl_object = extra("peername"), extra("sockname"), extra("ssl_object")
    log.write(entry(
        remote=str(peer[0]) if peer else "", local=hostport(sock) if sock else "",
        tls=ssl_object is not None, sni=getattr(ssl_object, _SNI, None),
        host=request_host(request), method=request.method, path=request.path_qs,
        status=status, size=size, agent=request.headers.get("User-Agent", ""),
    ))  # fmt: skip


@web.middleware
async def _access(request: web.Request, handler: Handler) -> web.StreamResponse:
    log = request.app.get(_LOG)
    if log is None:
        return await handler(request)
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        _log_request(request, log, exc.status, len((exc.text or "").encode()))
        raise
    except Exception:
        _log_request(request, log, 500, 0)
        raise
    _log_request(request, log, response.status, getattr(response, "content_length", 0) or 0)
    return response


def make_app(sites: Path | None = None, log: AccessLog | None = None) -> web.Application:
    app = web.Application(middlewares=[_access, _sites])
    if sites is not None:
        app[_SITES] = sites
    if log is not None:
        app[_LOG] = log
    app.router.add_get("/bytes/{count}", _bytes)
    app.router.add_get("/{tail:.*}", _index)
    return app


# -- port 443: TLS or plain HTTP, by the first byte ---------------------------------------


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)

    def note_sni(
        obj: ssl.SSLSocket | ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext
    ) -> None:
        setattr(obj, _SNI, name)  # read back by the access log

    ctx.sni_callback = note_sni
    return ctx


async def _readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


async def _first_byte(conn: socket.socket) -> bytes:
    """The client's first byte, left in the socket for whoever reads next."""
    while True:
        try:
            return conn.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            await _readable(conn.fileno())


async def _hand_over(conn: socket.socket, factory: web.Server, ctx: ssl.SSLContext) -> None:
    try:
        first = await asyncio.wait_for(_first_byte(conn), SNIFF_SECONDS)
        if not first:
            conn.close()
            return
        tls = ctx if first[0] == TLS_RECORD_HANDSHAKE else None
        await asyncio.get_running_loop().connect_accepted_socket(factory, conn, ssl=tls)
    except (OSError, TimeoutError, ssl.SSLError):
        conn.close()  # a client that hung up, stalled or failed its handshake
    except asyncio.CancelledError:
        conn.close()  # shutting down
        raise


class SniffingListener:
    """One listening socket whose connections go to aiohttp as TLS or plain HTTP."""

    def __init__(self, addr: str, port: int, factory: web.Server, ctx: ssl.SSLContext) -> None:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((addr, port))
        self.sock.listen(128)
        self.sock.setblocking(False)
        self._factory, self._ctx = factory, ctx
        self._tasks: set[asyncio.Task[None]] = set()
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self.sock)
            except OSError:  # out of file descriptors, say: the next one may work
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            task = loop.create_task(_hand_over(conn, self._factory, self._ctx))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in (self._accepting, *self._tasks):
            task.cancel()
        for task in (self._accepting, *self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.sock.close()


# -- serving -----------------------------------------------------------------------------


class _Echo(asyncio.DatagramProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        self.transport.sendto(data, addr)

    def error_received(self, exc: Exception) -> None:
        pass  # the sender went away; echo servers do not care


class Served:
    """What ``serve`` started, and how to stop it all."""

    def __init__(self, runner: web.AppRunner) -> None:
        self.runner = runner
        self.listeners: list[SniffingListener] = []
        self.echoes: list[asyncio.DatagramTransport] = []

    async def close(self) -> None:
        for transport in self.echoes:
            transport.close()
        for listener in self.listeners:
            await listener.close()
        await self.runner.cleanup()


async def serve(
    addresses: Sequence[str],
    ports: Sequence[int],
    udp_port: int | None,
    any_port: int = 0,
    *,
    app: web.Application | None = None,
    tls: ssl.SSLContext | None = None,
) -> Served:
    """Start HTTP on every address x port (443 also TLS, given ``tls``) and UDP echo on
    every address."""
    served = Served(web.AppRunner(app or make_app(), access_log=None))
    await served.runner.setup()
    server = served.runner.server
    assert server is not None  # set by setup()
    for addr in addresses:
        for port in ports:
            if tls is not None and port == TLS_PORT:
                served.listeners.append(SniffingListener(addr, port, server, tls))
            else:
                await web.TCPSite(served.runner, addr, port, reuse_address=True).start()
    if any_port:
        # Every address routed local (the AnyIP range) reaches this one socket.
        await web.TCPSite(served.runner, "0.0.0.0", any_port, reuse_address=True).start()
    if udp_port is not None:
        loop = asyncio.get_running_loop()
        for addr in addresses:
            transport, _ = await loop.create_datagram_endpoint(_Echo, local_addr=(addr, udp_port))
            served.echoes.append(transport)
    return served


async def _run(args: argparse.Namespace) -> None:
    ports = [int(p) for p in args.ports.split(",") if p]
    log = AccessLog(args.access_log) if args.access_log else None
    app = make_app(Path(args.sites) if args.sites else None, log)
    tls = tls_context(args.tls_cert, args.tls_key) if args.tls_cert else None
    served = await serve(
        args.listen, ports, args.udp_echo_port or None, args.any_port, app=app, tls=tls
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tls_note = f", TLS on {TLS_PORT}" if tls else ""
    print(f"lab http: serving {len(args.listen)} addresses on ports {ports}{tls_note}", flush=True)
    await stop.wait()
    await served.close()
    if log is not None:
        log.close()


_EPILOG = """\
example:
  ip netns exec egresslab-inet python -m egress.lab.web \\
    --listen 203.0.113.10 --listen 2001:db8:80::10 --ports 80,443,8080 \\
    --sites /run/egress/lab/egresslab/sites --access-log /tmp/access.jsonl \\
    --tls-cert /run/egress/lab/egresslab/tls/server.pem \\
    --tls-key /run/egress/lab/egresslab/tls/server.key
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m egress.lab.web",
        description="The egress lab's HTTP servers and UDP echo.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    parser.add_argument("--listen", action="append", required=True, metavar="ADDR")
    parser.add_argument("--ports", default=",".join(map(str, DEFAULT_PORTS)))
    parser.add_argument("--udp-echo-port", type=int, default=UDP_ECHO_PORT, help="0: none")
    parser.add_argument("--any-port", type=int, default=0, help="HTTP on 0.0.0.0:PORT (AnyIP)")
    parser.add_argument("--sites", metavar="DIR", help="one directory per Host name to serve")
    parser.add_argument("--access-log", metavar="FILE", help="JSON lines, one per request")
    parser.add_argument("--tls-cert", metavar="PEM", help=f"TLS (with plain HTTP) on {TLS_PORT}")
    parser.add_argument("--tls-key", metavar="PEM")
    args = parser.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    try:
        asyncio.run(_run(args))
    except (OSError, ssl.SSLError) as exc:
        print(f"lab http: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
