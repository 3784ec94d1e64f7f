"""``Headroom``: a sound bound saying that one query cannot cross any tunnel limit now.

The resolver must not forward a query that makes a verdict (its name would carry data
out). Scoring a new name before its send put the scorer on every cache miss's path: tens
of µs, more from cold caches. When this bound says that the query cannot cross any limit,
the resolver sends it first and scores it right after, off the answer's path; the scoring
is the same, only its moment moves. Otherwise it scores first, as before.

The bound, per window metric (``zone``: the fast and slow metrics):
- the most a query of ``name`` and ``qtype`` could add to any zone's window or to the sum
  over all zones, from its length, its label count, its type and ``vocab``'s largest
  count, without parsing it (``safe``);
- ``room``: at most the least, over every zone's windows and the sum's, of the value at
  which a limit is crossed minus the window's total (totals clamped at 0, as
  ``ZoneState.crossings`` clamps them), with NXDOMAIN halving always applied, and a zone
  not made yet counted with totals 0 at the smallest scale a zone can get.
A query is safe when its bound is below the room in every metric. Totals only grow
between bucket retirements, and each growth lowers ``room`` (``account``), so between
recomputations ``room`` is exact or lower. Retired buckets lower the totals only, so a
stale ``room`` errs low: ``recompute`` (when a bound fails after a bucket boundary) takes
every window's totals as ``Ring.advance`` would leave them now, without changing them.

What a new name adds (``ZoneState.add_unique``, ``TunnelScorer._account``), with
L = len(name) + 1 and n = the labels:
- names, tunnel-shaped names, data-type names: 1 each (data-type only for such a type);
- text of new labels: sum of len(label) + 1 <= L; its information estimate (``features``:
  len x log2(alphabet <= 128) x randomness <= 1, / 8) <= L; text of long names <= L, and
  nothing for a name shorter than ``LONG_LABEL`` (its subdomain and labels are shorter);
- information in new names, in bits (``vocab.new_name_bits``): each of the n + 2 symbols
  (count, labels, type) costs at most the zone's price or escape plus the sandbox's
  price or escape, each <= log2(n + d of its context when priced) <= log2(N + 2 u),
  where N is the largest n + d of any context before the query and u bounds the uses
  of any one context of one table in the query (each use adds at most 2 to that
  context's n + d): a position context is used once per label at most, the token
  context once per hyphenated part (<= hyphens + labels), count, type and zone once:
  u = n + hyphens + 4 covers each; plus, spelled, at most 10 + 7 per
  character (a label: 1 + its class, length and characters at log2(alphabet <= 128);
  by its parts only when cheaper), 16 (a type) or 5 (a count); the sum adds the zone's
  price (<= the same log2). So <= (n + 3) x 2 x log2(N + 2 u) + 10 n + 7 L + 21, / 8.

The scorer's time never goes back (``TunnelScorer._time``): ``recompute`` takes the
totals as they will be at ``now`` (``Ring.totals_at``), changing no window, and a window
later advanced to an earlier time would keep what the room no longer counts. The shells
run the scorer on ``time.monotonic``, which neither steps back nor glitches forward (a
glitch would hold every window at its time until real time caught up); a verdict's
moment in the journal is the resolver's wall clock. A scorer whose accounting raised
defers nothing more (its windows may hold what its room does not).
"""

from __future__ import annotations

import math
from typing import Final

from egress.tunnel.features import LONG_LABEL, data_type_name
from egress.tunnel.zone import (
    DATA,
    FAST_NAMES,
    INFO,
    LONG_TEXT,
    NAME_INFO,
    NAMES,
    SHAPED,
    SLOW_INFO,
    SLOW_NAME_INFO,
    SLOW_TEXT,
    TEXT,
    Limits,
    ZoneState,
)

# Float sums differ from exact ones by far less than this, relative and absolute: the bound
# must stay below the room with it added.
_SLACK_REL: Final = 1e-6
_SLACK_ABS: Final = 1e-3


class Headroom:
    """``room`` per fast and slow metric, kept at or below the true least headroom."""

    __slots__ = ("_bucket", "_new_fast", "_new_slow", "_span", "fast", "largest", "slow")

    def __init__(self, new_zone: Limits, fast_span: float, slow_span: float) -> None:
        # A zone not made yet: totals 0, so its room is its crossing values (halved).
        self._new_fast = list(new_zone.fast_at[1])
        self._new_slow = list(new_zone.slow_at[1])
        self.fast = list(self._new_fast)
        self.slow = list(self._new_slow)
        self._span = min(fast_span, slow_span)  # totals fall only at a bucket boundary
        self._bucket = -1  # the bucket of the last recompute
        self.largest = 1.0  # an upper bound of every vocab context's n + d

    def safe(self, name: str, qtype: int) -> bool:
        """True when a query of ``name`` and ``qtype`` cannot cross a limit (see above)."""
        length = len(name) + 1.0
        labels = name.count(".") + 1
        # Each symbol priced adds at most 2 to its context's n + d: this query's own uses
        # (count, labels, type, a hyphenated label's parts, the zone in the sum) raise
        # the count the later ones are priced with.
        uses = labels + name.count("-") + 4
        escape = math.log2(self.largest + 2.0 * uses)
        bits = (labels + 3) * 2.0 * escape + 10.0 * labels + 7.0 * length + 21.0
        fast, slow = self.fast, self.slow
        return (
            _fits(1.0, fast[SHAPED])
            and _fits(length if len(name) >= LONG_LABEL else 0.0, fast[LONG_TEXT])
            and _fits(length, fast[INFO])
            and _fits(length, fast[TEXT])
            and _fits(0.0 if data_type_name(qtype) is None else 1.0, fast[DATA])
            and _fits(1.0, fast[FAST_NAMES])
            and _fits(bits / 8.0, fast[NAME_INFO])
            and _fits(1.0, slow[NAMES])
            and _fits(length, slow[SLOW_INFO])
            and _fits(length, slow[SLOW_TEXT])
            and _fits(bits / 8.0, slow[SLOW_NAME_INFO])
        )

    def account(self, state: ZoneState, limits: Limits, vocab_largest: float) -> None:
        """After ``state`` took a query (and the sandbox's table, ``vocab_largest``)."""
        _lower(self.fast, state.fast.totals, limits.fast_at[1])
        _lower(self.slow, state.slow.totals, limits.slow_at[1])
        if vocab_largest > self.largest:
            self.largest = vocab_largest

    def stale(self, now: float) -> bool:
        """Whether a bucket boundary passed since the last ``recompute``."""
        return int(now // self._span) != self._bucket

    def recompute(self, now: float, states: list[tuple[ZoneState, Limits]]) -> None:
        """The least room over a zone not made yet and ``states`` (each with its limits),
        from the totals their windows would have after ``advance(now)``; taken whole or
        not at all."""
        fast = list(self._new_fast)
        slow = list(self._new_slow)
        for state, limits in states:
            _lower(fast, state.fast.totals_at(now), limits.fast_at[1])
            _lower(slow, state.slow.totals_at(now), limits.slow_at[1])
        self.fast, self.slow = fast, slow
        self._bucket = int(now // self._span)


def _fits(added: float, room: float) -> bool:
    return added + added * _SLACK_REL + _SLACK_ABS < room


def _lower(room: list[float], totals: list[float], at: tuple[float, ...]) -> None:
    for m in range(len(room)):
        total = totals[m]
        left = at[m] - (total if total > 0.0 else 0.0)
        if left < room[m]:
            room[m] = left
