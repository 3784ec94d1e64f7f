"""The lab's web servers: every lab HTTP address, ports 80, 443 and 8080, plus UDP echo.

One asyncio process serves them all. ``GET /`` answers ``lab 203.0.113.10:80`` (IPv6 as
``lab [2001:db8:80::10]:80``), the address and port the request actually reached, so a test
can assert which server it hit rather than merely that something answered. Port 443 is
plain HTTP: the lab tests reachability, not TLS. ``GET /bytes/N`` returns N bytes, for
benchmarks. UDP port 9999 echoes each datagram back, so tests have a "UDP to anything"
target; ICMP echo needs nothing, the kernel answers it.

Run inside the lab's internet netns::

    python -m egress.lab.web --listen 203.0.113.10 --listen 2001:db8:80::10
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from typing import Any, cast

from aiohttp import web

DEFAULT_PORTS = (80, 443, 8080)
UDP_ECHO_PORT = 9999
MAX_BYTES = 100 * 1024 * 1024


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


def make_app() -> web.Application:
    app = web.Application()
    app.router.add_get("/bytes/{count}", _bytes)
    app.router.add_get("/{tail:.*}", _index)
    return app


class _Echo(asyncio.DatagramProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        self.transport.sendto(data, addr)

    def error_received(self, exc: Exception) -> None:
        pass  # the sender went away; echo servers do not care


async def serve(
    addresses: Sequence[str], ports: Sequence[int], udp_port: int | None, any_port: int = 0
) -> tuple[web.AppRunner, list[asyncio.DatagramTransport]]:
    """Start HTTP on every address x port and UDP echo on every address."""
    runner = web.AppRunner(make_app(), access_log=None)
    await runner.setup()
    for addr in addresses:
        for port in ports:
            await web.TCPSite(runner, addr, port, reuse_address=True).start()
    if any_port:
        # Every address routed local (the AnyIP range) reaches this one socket.
        await web.TCPSite(runner, "0.0.0.0", any_port, reuse_address=True).start()
    echoes: list[asyncio.DatagramTransport] = []
    if udp_port is not None:
        loop = asyncio.get_running_loop()
        for addr in addresses:
            transport, _ = await loop.create_datagram_endpoint(_Echo, local_addr=(addr, udp_port))
            echoes.append(transport)
    return runner, echoes


async def _run(args: argparse.Namespace) -> None:
    ports = [int(p) for p in args.ports.split(",") if p]
    runner, echoes = await serve(args.listen, ports, args.udp_echo_port or None, args.any_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"lab http: serving {len(args.listen)} addresses on ports {ports}", flush=True)
    await stop.wait()
    for transport in echoes:
        transport.close()
    await runner.cleanup()


_EPILOG = """\
example:
  ip netns exec egresslab-inet python -m egress.lab.web \\
    --listen 203.0.113.10 --listen 2001:db8:80::10 --ports 80,443,8080
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
    args = parser.parse_args(argv)
    try:
        asyncio.run(_run(args))
    except OSError as exc:
        print(f"lab http: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
