"""The inline layer of one served sandbox: one wiring for `egressctl run`, egressd and
`egressd sidecar`.

Each serves a sandbox with the same pieces: ``Session`` (NFLOG reader, Enforcer, journal
writer, and ``FlowCheck``: the first-bytes NFQUEUE) and a resolver on 127.0.0.53 in the
sandbox's netns. They differ only in:
- where the resolver's upstream sockets live: `run` and egressd open them in an uplink
  netns; the sidecar, which has none, opens them in the sandbox netns itself, marked
  (``mark``) so that the sandbox's ruleset lets exactly them through;
- whether a freeze's SQLite commits run off the event loop (egressd and the sidecar:
  other sandboxes' answers, or the API, must not wait for them; the freeze is asked on
  the loop) and how long a frozen sandbox waits for a person (``decision_timeout``,
  `run` only).
The resolver is a TrackingResolver in all three: it remembers which question allowed
which address, which a live policy swap needs (egressd, the sidecar's restart) and which
costs `run` a dict update per allowed answer.

    make ─▶ Enforcer ─▶ Session (its NFLOG socket on the loop) ─▶ resolver ─▶ FlowCheck
         (the caller seeds the resolver if it adopts one, then awaits resolver.start())
    stop ─▶ resolver closed ─▶ FlowCheck, then session closed (its journal queue written
         out first)
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import NamedTuple

from egress.freeze.enforcer import Enforcer
from egress.inline.flowcheck import FlowCheck
from egress.inline.server import ResolverServer, make_core
from egress.inline.session import FROZEN_POLL_S, Session
from egress.inline.swap import TrackingResolver
from egress.kernel.nflog import NflogListener
from egress.kernel.nfqueue import NfqueueListener
from egress.model import Layer
from egress.sandbox.lifecycle import Sandbox
from egress.store.journal import Journal


class Inline(NamedTuple):
    session: Session
    resolver: TrackingResolver


def make(
    sb: Sandbox,
    journal: Journal,
    review_hint: str,
    upstreams: list[tuple[str, int]],
    upstream_netns: str | None,
    *,
    listener: NflogListener | None = None,
    queue: NfqueueListener | None = None,
    mark: int | None = None,
    decision_timeout: float | None = None,
    commits_off_loop: bool = True,
    review_poll_max_s: float = FROZEN_POLL_S,
) -> Inline:
    """The inline layer of ``sb``, reading NFLOG already; its resolver is not started.

    ``commits_off_loop``: egressd and the sidecar (True) keep a freeze's SQLite commits
    and attribution off the event loop other sandboxes' answers and the API share (the
    freeze itself is made there: Session.on_violation); `egressctl run` (False) serves
    one sandbox and does all of it at once. ``decision_timeout``: how long a frozen
    sandbox waits for a person (`run`'s --decision-timeout); ``review_poll_max_s``: the
    longest wait between two looks at a frozen sandbox's cgroup for the thaw that ends
    its review, once the review has waited a while (egressd, serving many:
    REVIEW_POLL_MAX_S). ``listener``: an NFLOG socket a predecessor egressd handed over,
    already bound to the inline group; ``queue``: likewise its first-bytes NFQUEUE socket
    (``FlowCheck``, which the session holds and closes)."""
    loop = asyncio.get_running_loop()
    enforcer = Enforcer(sb.id, sb.policy, Layer.INLINE, journal, sb.cgroup)
    session = Session(
        sb=sb, enforcer=enforcer, decision_timeout=decision_timeout, review_hint=review_hint,
        listener=listener, commits_off_loop=commits_off_loop,
        review_poll_max_s=review_poll_max_s,
    )  # fmt: skip
    try:
        loop.add_reader(session.listener.fileno(), session.on_nflog)
        resolver = TrackingResolver(
            core=make_core(sb.policy, len(upstreams)),
            upstreams=upstreams,
            nft=sb.nft,
            on_violation=session.on_violation,
            listen_netns=sb.reach,
            upstream_netns=upstream_netns,
            mark=mark,
        )
        session.flows = FlowCheck(sb.reach, resolver, session.on_violation, listener=queue,
                                  frozen=sb.cgroup.is_frozen)  # fmt: skip
        session.flows.start()
        session.start_tick(resolver.core)
    except BaseException:
        _close_session(session, False)
        raise
    return Inline(session, resolver)


async def stop(
    session: Session | None, resolver: ResolverServer | None, handed_over: bool = False
) -> None:
    """Stop serving: the resolver first, then the session (nothing it saw is lost)."""
    if resolver is not None:
        await resolver.close()
    if session is not None:
        _stop_reading(session, handed_over)
        await session.aclose(handed_over)


def _close_session(session: Session, handed_over: bool) -> None:
    _stop_reading(session, handed_over)
    session.close(handed_over)


def _stop_reading(session: Session, handed_over: bool) -> None:
    session.stopping = True
    if session.flows is not None:
        session.flows.close(handed_over)
    with contextlib.suppress(ValueError, OSError):
        asyncio.get_running_loop().remove_reader(session.listener.fileno())
