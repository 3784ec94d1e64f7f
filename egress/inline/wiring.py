"""The inline layer of one served sandbox, wired one way for egressd and `egressd sidecar`.

Both serve a sandbox with the pieces `egressctl run` uses: ``Session`` (NFLOG reader,
Enforcer, journal writer) and a resolver on 127.0.0.53 in the sandbox's netns. They differ
only in where the resolver's upstream sockets live: egressd opens them in an uplink netns;
the sidecar, which has none, opens them in the sandbox netns itself, marked (``mark``) so
that the sandbox's ruleset lets exactly them through.

    make ─▶ Enforcer ─▶ Session (its NFLOG socket on the loop) ─▶ TrackingResolver
         (the caller seeds the resolver if it adopts one, then awaits resolver.start())
    stop ─▶ resolver closed ─▶ session closed (its journal queue written out first)
"""

from __future__ import annotations

import asyncio
import contextlib

from egress.freeze.enforcer import Enforcer
from egress.inline.server import make_core
from egress.inline.session import Session
from egress.inline.swap import TrackingResolver
from egress.kernel.nflog import NflogListener
from egress.sandbox.lifecycle import Sandbox
from egress.store.journal import Journal


def make(
    sb: Sandbox,
    journal: Journal,
    review_hint: str,
    upstreams: list[tuple[str, int]],
    upstream_netns: str | None,
    *,
    listener: NflogListener | None = None,
    mark: int | None = None,
) -> tuple[Session, TrackingResolver]:
    """The inline layer of ``sb``, reading NFLOG already; its resolver is not started."""
    loop = asyncio.get_running_loop()
    enforcer = Enforcer(sb.id, sb.policy, "inline", journal, sb.cgroup)
    session = Session(sb, enforcer, None, review_hint, listener, freeze_off_loop=True)
    try:
        loop.add_reader(session.listener.fileno(), session.on_nflog)
        resolver = TrackingResolver(
            make_core(sb.policy, len(upstreams)),
            upstreams,
            sb.nft,
            session.on_violation,
            sb.netns,
            upstream_netns,
            mark=mark,
        )
    except BaseException:
        _close_session(session, False)
        raise
    return session, resolver


async def stop(
    session: Session | None, resolver: TrackingResolver | None, handed_over: bool = False
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
