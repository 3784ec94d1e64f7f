"""egressd's HTTP API (aiohttp), served on a unix socket only; see openapi.yaml.

Who may call it is decided by the socket file's owner, group and mode (root, --group,
0660): a client that cannot open the file never reaches a handler. The caller's uid, read
from the connection (SO_PEERCRED), goes into every journaled decision.

Every refusal is a 4xx with ``{"error": "...", "where": ...}``: malformed JSON (400, with
line and column), a missing or mistyped field (400, the field), an unknown id (404), a
collision with what is served (409), a policy that does not validate (422, with every
problem as FILE:LINE:COL). A request that fails changes nothing.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import sys
from collections.abc import Awaitable, Callable
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from egress.errors import BadRequest, EgressError, NotFound
from egress.model import ReviewAction

from . import metrics
from .registry import Registry

REGISTRY: web.AppKey[Registry] = web.AppKey("registry", Registry)
OPENAPI = Path(__file__).with_name("openapi.yaml")
MAX_BODY = 1 << 20  # a policy is a few KB; a MB is generous
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error(status: int, message: str, where: object = None, **extra: Any) -> web.Response:
    return web.json_response({"error": message, "where": where, **extra}, status=status)


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except EgressError as exc:  # each error knows its status and body (egress.errors)
        return web.json_response(exc.http_body(), status=exc.http_status)
    except web.HTTPException as exc:
        if exc.status >= 400:
            return error(exc.status, exc.reason, request.path)
        raise


def peer_uid(request: web.Request) -> int:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is None or sock.family != socket.AF_UNIX:
        raise BadRequest("the caller's uid is unknown (egressd serves unix sockets only)")
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", raw)[1])


async def body(request: web.Request, fields: dict[str, bool]) -> dict[str, Any]:
    """The JSON object, with ``fields`` (name -> required) as strings and nothing else."""
    raw = await request.read()
    try:
        data = json.loads(raw or b"null")
    except json.JSONDecodeError as exc:
        where = {"line": exc.lineno, "column": exc.colno}
        raise BadRequest(f"malformed JSON: {exc.msg}", where) from None
    except UnicodeDecodeError:
        raise BadRequest("the body is not UTF-8", "body") from None
    if not isinstance(data, dict):
        raise BadRequest("expected a JSON object", "body")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r} (known: {', '.join(fields)})", unknown[0])
    for name, required in fields.items():
        if name not in data or data[name] is None:
            if required:
                raise BadRequest(f"missing field {name!r}", name)
            data[name] = None
        elif not isinstance(data[name], str) or not data[name]:
            raise BadRequest(f"field {name!r} must be a non-empty string", name)
    return data


def _registry(request: web.Request) -> Registry:
    return request.app[REGISTRY]


async def create(request: web.Request) -> web.Response:
    data = await body(request, {"policy": True, "uplink_netns": False, "upstream": False})
    served = await _registry(request).create(data["policy"], data["uplink_netns"], data["upstream"])
    return web.json_response(served.to_json(), status=201)


async def attach(request: web.Request) -> web.Response:
    fields = {"netns": True, "cgroup": False, "policy": True, "freezer": False,
              "uplink_netns": False, "upstream": False, "id": False, "owner": False}  # fmt: skip
    data = await body(request, fields)
    served = await _registry(request).attach(
        data["netns"], data["cgroup"], data["policy"], freezer=data["freezer"],
        uplink_netns=data["uplink_netns"], upstream=data["upstream"], sandbox_id=data["id"],
        owner=data["owner"],
    )  # fmt: skip
    return web.json_response(served.to_json(), status=201)


async def list_sandboxes(request: web.Request) -> web.Response:
    return web.json_response([s.to_json() for s in _registry(request).list()])


async def show(request: web.Request) -> web.Response:
    served = _registry(request).get(request.match_info["id"])
    loop = asyncio.get_running_loop()
    # Whether its table is still in the netns (egress-cni's CHECK): one netlink read.
    rules = await loop.run_in_executor(None, served.rules_present)
    return web.json_response({**served.to_json(), "rules": rules})


async def resume(request: web.Request) -> web.Response:
    return await _decide(request, ReviewAction.RESUME)


async def kill(request: web.Request) -> web.Response:
    return await _decide(request, ReviewAction.KILL)


async def _decide(request: web.Request, action: str) -> web.Response:
    data = await body(request, {"note": False})
    sid = request.match_info["id"]
    uid = peer_uid(request)
    await _registry(request).decide(sid, action, uid, data["note"] or "")
    return web.json_response({"id": sid, "action": action, "uid": uid})


async def delete(request: web.Request) -> web.Response:
    sid = request.match_info["id"]
    await _registry(request).delete(sid)
    return web.json_response({"id": sid, "deleted": True})


async def set_policy(request: web.Request) -> web.Response:
    data = await body(request, {"policy": True})
    sid = request.match_info["id"]
    result = _registry(request).set_policy(sid, data["policy"])
    return web.json_response({"id": sid, **result})


async def journal(request: web.Request) -> web.Response:
    registry = _registry(request)
    sid = request.query.get("sandbox")
    text = request.query.get("limit", "100")
    if not (len(text) <= 5 and text.isascii() and text.isdigit()) or not 1 <= int(text) <= 10_000:
        raise BadRequest(f"limit must be an integer from 1 to 10000, not {text!r}", "limit")
    if sid is not None and registry.journal.sandbox(sid) is None:
        raise NotFound(f"no sandbox {sid!r} in the journal")
    events = registry.journal.events(sid, limit=int(text))
    return web.json_response(json.loads(json.dumps(events, default=str)))


async def prometheus(request: web.Request) -> web.Response:
    registry = _registry(request)
    served = registry.list()
    kernel: dict[str, metrics.Kernel] | None = None
    if registry.figures is not None:
        try:
            kernel = await registry.figures.read(served)
        except EgressError as exc:  # the rest is still worth having: egress_kernel_figures 0
            print(f"egressd: /metrics: {exc}", file=sys.stderr, flush=True)
    steps = metrics.render(registry, kernel, served)
    while True:  # a chunk of sandboxes at a time, the loop answering DNS in between
        try:
            next(steps)
        except StopIteration as done:
            text = str(done.value)
            break
        await asyncio.sleep(0)
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


@cache
def openapi_document() -> dict[str, Any]:
    doc = yaml.safe_load(OPENAPI.read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


def make_metrics_app(registry: Registry) -> web.Application:
    """``--metrics-address``: /metrics alone, read-only, for a scraper over TCP (the API
    itself stays on the unix socket: it can resume, kill and detach)."""
    app = web.Application(middlewares=[errors])
    app[REGISTRY] = registry
    app.router.add_get("/metrics", prometheus)
    return app


def make_app(registry: Registry) -> web.Application:
    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY)
    app[REGISTRY] = registry
    app.router.add_post("/v1/sandboxes", create)
    app.router.add_post("/v1/sandboxes/attach", attach)
    app.router.add_get("/v1/sandboxes", list_sandboxes)
    app.router.add_get("/v1/sandboxes/{id}", show)
    app.router.add_post("/v1/sandboxes/{id}/resume", resume)
    app.router.add_post("/v1/sandboxes/{id}/kill", kill)
    app.router.add_delete("/v1/sandboxes/{id}", delete)
    app.router.add_put("/v1/sandboxes/{id}/policy", set_policy)
    app.router.add_get("/v1/journal", journal)
    app.router.add_get("/metrics", prometheus)
    app.router.add_get("/openapi.json", openapi)
    return app
