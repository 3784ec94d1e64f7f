"""The inline layer of one served sandbox: one wiring for `egressctl run`, egressd and
`egressd sidecar`.

Each serves a sandbox with the same pieces: ``Session`` (NFLOG reader, Enforcer, journal
writer) and a resolver on 127.0.0.53 in the sandbox's netns. They differ only in:
- where the resolver's upstream sockets live: `run` and egressd open them in an uplink
  netns; the sidecar, which has none, opens them in the sandbox netns itself, marked
  (``mark``) so that the sandbox's ruleset lets exactly them through;
- whether a freeze runs off the event loop (egressd and the sidecar: other sandboxes'
  answers, or the API, must not wait for it) and how long a frozen sandbox waits for a
  person (``decision_timeout``, `run` only);
- whether the resolver tracks which question allowed which address (``tracking``: a live
  policy swap needs it; `run` never swaps).

    make ─▶ Enforcer ─▶ Session (its NFLOG socket on the loop) ─▶ resolver
         (the caller seeds the resolver if it adopts one, then awaits resolver.start())
    stop ─▶ resolver closed ─▶ session closed (its journal queue written out first)
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import NamedTuple

from egress.freeze.enforcer import Enforcer
from egress.inline.server import ResolverServer, make_core
from egress.inline.session import Session
from egress.inline.swap import TrackingResolver
from egress.kernel.nflog import NflogListener
from egress.model import Layer
from egress.sandbox.lifecycle import Sandbox
from egress.store.journal import Journal


class Inline(NamedTuple):
    session: Session
    resolver: TrackingResolver


class InlineRun(NamedTuple):
    session: Session
    resolver: ResolverServer


def make(
    sb: Sandbox,
    journal: Journal,
    review_hint: str,
    upstreams: list[tuple[str, int]],
    upstream_netns: str | None,
    *,
    listener: NflogListener | None = None,
    mark: int | None = None,
) -> Inline:
    """egressd's and the sidecar's inline layer of ``sb``, reading NFLOG already; its
    resolver (a TrackingResolver, for policy swaps) is not started."""
    session, resolver = _make(sb, journal, review_hint, upstreams, upstream_netns,
                              listener=listener, mark=mark, tracking=True)  # fmt: skip
    assert isinstance(resolver, TrackingResolver)
    return Inline(session, resolver)


def make_for_run(
    sb: Sandbox,
    journal: Journal,
    review_hint: str,
    upstreams: list[tuple[str, int]],
    upstream_netns: str | None,
    decision_timeout: float | None,
) -> InlineRun:
    """`egressctl run`'s inline layer: one sandbox on this loop, so a freeze acts at once."""
    session, resolver = _make(sb, journal, review_hint, upstreams, upstream_netns,
                              decision_timeout=decision_timeout, freeze_off_loop=False)  # fmt: skip
    return InlineRun(session, resolver)


def _make(
    sb: Sandbox,
    journal: Journal,
    review_hint: str,
    upstreams: list[tuple[str, int]],
    upstream_netns: str | None,
    *,
    listener: NflogListener | None = None,
    mark: int | None = None,
    decision_timeout: float | None = None,
    freeze_off_loop: bool = True,
    tracking: bool = False,
) -> tuple[Session, ResolverServer]:
    loop = asyncio.get_running_loop()
    enforcer = Enforcer(sb.id, sb.policy, Layer.INLINE, journal, sb.cgroup)
    session = Session(
        sb=sb, enforcer=enforcer, decision_timeout=decision_timeout, review_hint=review_hint,
        listener=listener, freeze_off_loop=freeze_off_loop,
    )  # fmt: skip
    try:
        loop.add_reader(session.listener.fileno(), session.on_nflog)
        server = TrackingResolver if tracking else ResolverServer
        resolver = server(
            core=make_core(sb.policy, len(upstreams)),
            upstreams=upstreams,
            nft=sb.nft,
            on_violation=session.on_violation,
            listen_netns=sb.netns,
            upstream_netns=upstream_netns,
            mark=mark,
        )
    except BaseException:
        _close_session(session, False)
        raise
    return session, resolver


async def stop(
    session: Session | None, resolver: ResolverServer | None, handed_over: bool = False
) -> None:
    """Stop serving: the resolver first, then the session (nothing it saw is lost)."""
    if resolver is not None:
        await resolver.close()
    if session is not None:
        _close_session(session, handed_over)


def _close_session(session: Session, handed_over: bool) -> None:
    session.stopping = True
    with contextlib.suppress(ValueError, OSError):
        asyncio.get_running_loop().remove_reader(session.listener.fileno())
    session.close(handed_over)
