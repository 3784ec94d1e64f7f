"""The channels of ``channels.py`` through a ``TunnelScorer`` on a fake clock.

Shared by tests/unit/test_tunnel_channels.py (which asserts the budgets) and
bench/bench_tunnel.py (which prints the figures), so both measure the same thing.
"""

from __future__ import annotations

from egress.model import TunnelSpec
from egress.tunnel import TunnelScorer, TunnelVerdict
from tests.support import channels as ch

START = 1_800_000_000.0
Sent = list[tuple[float, tuple[str, int]]]  # (seconds since the start, query) forwarded


def zones(channel: ch.Channel) -> list[str]:
    """The zones a channel's names go to: 16 sibling subzones of one registered domain,
    or that many registered domains of their own."""
    if channel.zones == 16:
        return [f"s{i}.exfil-lab.net" for i in range(16)]
    return [f"exfil{i}-lab.net" for i in range(channel.zones)]


def replay(
    channel: ch.Channel, gaps: list[float], payload: bytes, spec: TunnelSpec | None = None
) -> tuple[TunnelVerdict | None, Sent]:
    """The verdict (None if none came) and what was forwarded before it."""
    now = [START]
    scorer = TunnelScorer(spec or TunnelSpec(), lambda: now[0])
    sent: Sent = []
    for query, gap in zip(channel.queries(payload, zones(channel)), gaps, strict=False):
        now[0] += gap
        verdict = scorer.observe_query(*query)
        if verdict is not None:
            return verdict, sent
        scorer.observe_response(query[0], 0)
        sent.append((now[0] - START, query))
    return None, sent


def decoded(channel: ch.Channel, sent: Sent) -> int:
    """Payload bytes the receiver recovers from what was forwarded."""
    return len(channel.decode_all((q for _, q in sent), zones(channel)))


def per_hour(channel: ch.Channel, sent: Sent, hours: int = 2) -> list[int]:
    """Payload bytes decoded from what was forwarded in each hour."""
    return [
        decoded(channel, [(t, q) for t, q in sent if h * 3600 <= t < (h + 1) * 3600])
        for h in range(hours)
    ]
