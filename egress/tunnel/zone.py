"""Per-zone windows and the rules that turn them into crossings.

One ``ZoneState`` per (sandbox, registered domain), plus one for the sum over all zones.
Only queries with a subdomain reach it: a name that IS a registered domain carries nothing
its owner's nameserver could read. A unique subdomain adds to:

  fast window (``window_s``, 10 buckets)   slow window (``slow_window_s``, 30 buckets)
  - tunnel-shaped names (score >= limit)   - unique names
  - text of long names                     - information estimate
  - information estimate                   - unique subdomain text
  - unique subdomain text                  - responses, NXDOMAIN/REFUSED responses
  - names asked with data-only types       - information in new names
  - unique names
  - information in new names

Text and the (randomness-based) information estimate count per new LABEL
(``ZoneState.new_parts``), so labels every name shares count once. What a vocabulary of
known labels carries by its order, number and combination is the "information in new
names": each new name (or new type of a known name) priced as an adaptive code against
the names this zone has sent (``vocab``; the zone's ``Vocab`` table is here).

A zone whose NXDOMAIN/REFUSED share is high (exfiltration needs no answer) has its
randomness-based information limits halved; not its plain-text or name-information
limits, because search-domain expansion (``pypi.org.svc.cluster.local``) is plain text
that always gets NXDOMAIN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import ge
from typing import Final

from egress.model import TunnelSpec
from egress.tunnel.features import LONG_LABEL, LONG_SUB, TXT, NameFeatures, data_type_name
from egress.tunnel.verdict import Crossing
from egress.tunnel.vocab import SANDBOX_SLOTS, ZONE_SLOTS, Vocab
from egress.tunnel.window import M62, Ring, Seen

# Fast-window metrics
SHAPED: Final = 0
LONG_TEXT: Final = 1
INFO: Final = 2
TEXT: Final = 3
DATA: Final = 4
FAST_NAMES: Final = 5
NAME_INFO: Final = 6
# Slow-window metrics
NAMES: Final = 0
SLOW_INFO: Final = 1
SLOW_TEXT: Final = 2
RESPONSES: Final = 3
FAILS: Final = 4
SLOW_NAME_INFO: Final = 5
FAST_WIDTH: Final = 7
SLOW_WIDTH: Final = 6
FAST_BUCKETS: Final = 10
SLOW_BUCKETS: Final = 30
MAX_TYPES: Final = 8  # distinct record types remembered per zone for the verdict's type mix
NX_RCODES: Final = frozenset({3, 5})  # NXDOMAIN, REFUSED
ALL_ZONES: Final = ""  # zone name of the state that sums every zone of a sandbox
_LABEL_SALT: Final = 0x5BD1E995  # keeps a label's hash apart from a one-label subdomain's


@dataclass(frozen=True, slots=True)
class Rule:
    field: str  # TunnelSpec attribute holding the limit
    slow: bool
    metric: int
    what: str
    count: bool  # counts fire at >= limit; byte volumes above it
    nx: bool  # halved when the zone's NXDOMAIN share is high


RULES: Final = (
    Rule("shaped_names", False, SHAPED, "tunnel-shaped names", True, False),
    Rule("long_text_bytes", False, LONG_TEXT, "unique text of long names", False, False),
    Rule("info_bytes", False, INFO, "information in unique subdomain text", False, True),
    Rule("text_bytes", False, TEXT, "unique subdomain text", False, False),
    Rule("data_type_names", False, DATA, "unique names asked with data-only types", True, False),
    Rule("names", False, FAST_NAMES, "unique names", True, False),
    Rule("name_info_bytes", False, NAME_INFO, "information in new names", False, False),
    Rule("slow_names", True, NAMES, "unique names", True, False),
    Rule("slow_name_info_bytes", True, SLOW_NAME_INFO, "information in new names", False, False),
    Rule("slow_info_bytes", True, SLOW_INFO, "information in unique subdomain text", False, True),
    Rule("slow_text_bytes", True, SLOW_TEXT, "unique subdomain text", False, False),
)
# Over all zones: what random or tunnel-shaped text adds up to, and the information in
# new names (priced against the sandbox's own vocabulary, ``vocab``); not plain text or
# counts of names, which many zones (a crawler, a big `npm install`) add up to honestly.
SANDBOX_RULES: Final = tuple(
    r for r in RULES if r.field not in ("text_bytes", "names", "slow_names", "slow_text_bytes")
)


# Limits the sum over all zones keeps at one zone's: the slow leak budget is per sandbox.
UNSCALED: Final = frozenset({"slow_name_info_bytes"})


@dataclass(frozen=True, slots=True)
class Limits:
    """The limits of ``rules``, scaled, and per window the value at which each metric
    crosses (for byte volumes the next float above the limit, so one ``>=`` serves both
    kinds; inf for a metric no rule watches), plain and with the NXDOMAIN halving: most
    new names cross nothing, and comparing two arrays in C says so."""

    rules: tuple[Rule, ...]
    values: tuple[float, ...]
    fast_at: tuple[tuple[float, ...], tuple[float, ...]]  # [halved]
    slow_at: tuple[tuple[float, ...], tuple[float, ...]]


def limits(spec: TunnelSpec, rules: tuple[Rule, ...], scale: float, whole: bool = False) -> Limits:
    """The limits of ``rules`` times ``scale``; ``whole``: for the sum over all zones."""
    values = tuple(
        float(getattr(spec, r.field)) * (1.0 if whole and r.field in UNSCALED else scale)
        for r in rules
    )
    fast_at, slow_at = [], []
    for halved in (False, True):
        at = {False: [math.inf] * FAST_WIDTH, True: [math.inf] * SLOW_WIDTH}
        for rule, limit in zip(rules, values, strict=True):
            if halved and rule.nx:
                limit /= 2
            # A value is clamped at 0 before it is compared: a limit <= 0 always crosses.
            cross = limit if rule.count else math.nextafter(limit, math.inf)
            at[rule.slow][rule.metric] = cross if cross > 0.0 else -math.inf
        fast_at.append(tuple(at[False]))
        slow_at.append(tuple(at[True]))
    return Limits(rules, values, (fast_at[0], fast_at[1]), (slow_at[0], slow_at[1]))


def span(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


# What every new name adds to, per window: a name, its new text, that text's information,
# and the information in the name itself.
_FAST_NEW: Final = (FAST_NAMES, TEXT, INFO, NAME_INFO)
_SLOW_NEW: Final = (NAMES, SLOW_TEXT, SLOW_INFO, SLOW_NAME_INFO)


def _add_new(
    ring: Ring, metrics: tuple[int, int, int, int], text: float, info: float, bits: float
) -> None:
    """``Ring.add`` of a new name's four values, its lists updated directly (see ``Ring``):
    a new name does this in both windows of its zone and of the sum."""
    current, totals = ring.current, ring.totals
    names, texts, infos, name_infos = metrics
    current[names] += 1.0
    totals[names] += 1.0
    current[texts] += text
    totals[texts] += text
    current[infos] += info
    totals[infos] += info
    current[name_infos] += bits
    totals[name_infos] += bits


class ZoneState:
    __slots__ = (
        "bytes",
        "fast",
        "queries",
        "recorded",
        "remade",
        "scale",
        "seen",
        "slow",
        "types",
        "unique",
        "vocab",
        "zone",
    )

    def __init__(self, zone: str, spec: TunnelSpec, scale: float) -> None:
        self.zone = zone
        self.scale = scale
        self.fast = Ring(spec.window_s, FAST_BUCKETS, FAST_WIDTH)
        self.slow = Ring(spec.slow_window_s, SLOW_BUCKETS, SLOW_WIDTH)
        self.seen = Seen()
        # The sum over all zones keeps the sandbox-wide table (``vocab``'s fallback).
        self.vocab = Vocab(SANDBOX_SLOTS if zone == ALL_ZONES else ZONE_SLOTS)
        self.queries = 0  # forwarded queries (not the one a verdict stopped)
        self.bytes = 0  # their subdomain text, repeats scored included (not replays)
        self.unique = 0
        self.types: dict[int, int] = {}
        # Made again while Spent has its eviction (``TunnelScorer._state``):
        # what it sent then is off its allowance (``window.Spent``), and what it forgot
        # of its names, the sandbox-wide memory of names remembers.
        self.remade = False
        self.recorded = False  # made once the memory of names was: its names are in it

    def advance(self, now: float) -> None:
        self.fast.advance(now)
        self.slow.advance(now)

    def new_parts(self, f: NameFeatures, among: int = -1) -> tuple[int, float, int]:
        """(bytes, information, which) of the labels of ``f`` this zone has not seen yet;
        ``which`` and ``among`` are bit masks of label indexes (``among``: the only ones
        that can be new, -1 for all).

        Text and information count per label, so that one name asked under several
        suffixes (search-domain expansion) or labels that every name shares ("api",
        "us-east-1") count once; a tunnel's data labels are all new.
        """
        text, info, which = 0, 0.0, 0
        seen = self.seen
        for i, part in enumerate(f.parts):
            if among >> i & 1 and seen.add((hash(part) & M62) ^ _LABEL_SALT):
                text += len(part) + 1
                info += f.part_info[i]
                which |= 1 << i
        return text, info, which

    def add_unique(
        self, f: NameFeatures, qtype: int, shaped: bool, bits: float, among: int = -1
    ) -> int:
        """Count a subdomain seen for the first time in this zone, and the ``bits`` of
        information its name carried (``vocab``); ``among``: as for ``new_parts``. Returns
        the mask of its labels that were new here."""
        text, info, which = self.new_parts(f, among)
        # Known labels in a new order add no text (``text`` 0): their information is in
        # ``bits``.
        fast = self.fast
        _add_new(fast, _FAST_NEW, text, info, bits / 8)
        _add_new(self.slow, _SLOW_NEW, text, info, bits / 8)
        if shaped:
            fast.add(SHAPED, 1.0)
        if f.sub_len >= LONG_SUB or f.max_label >= LONG_LABEL:
            fast.add(LONG_TEXT, f.sub_len)
        if data_type_name(qtype) is not None:
            fast.add(DATA, 0.25 if qtype == TXT else 1.0)
        return which

    def add_info(self, fast: float, slow: float) -> None:
        """Bytes of information in new names (or new types of known names), to the fast
        and the slow window."""
        if fast:
            self.fast.add(NAME_INFO, fast)
        if slow:
            self.slow.add(SLOW_NAME_INFO, slow)

    def forwarded(self, f: NameFeatures, qtype: int, new: bool) -> None:
        self.queries += 1
        self.bytes += f.sub_len
        self.unique += new
        if qtype in self.types or len(self.types) < MAX_TYPES:
            self.types[qtype] = self.types.get(qtype, 0) + 1

    def response(self, rcode: int) -> None:
        self.slow.add(RESPONSES, 1)
        if rcode in NX_RCODES:
            self.slow.add(FAILS, 1)

    def weight(self) -> float:
        """How much this zone has to lose if evicted; the lightest of the oldest goes first."""
        slow = self.slow
        return (
            slow.total(SLOW_INFO)
            + slow.total(SLOW_NAME_INFO) / 4
            + self.fast.total(SHAPED) * 64
            + self.queries / 1024
        )

    def nx_note(self, spec: TunnelSpec) -> str | None:
        """Why the information limits are halved, or None when they are not."""
        responses, fails = self.slow.total(RESPONSES), self.slow.total(FAILS)
        if responses < spec.nx_min_responses or fails < spec.nx_ratio * responses:
            return None
        return f"NXDOMAIN/REFUSED {fails:,.0f} of {responses:,.0f} responses: limit halved"

    def crossings(self, spec: TunnelSpec, limits: Limits) -> list[Crossing]:
        """The rules of ``limits`` whose (already scaled) limit this zone crossed."""
        fast, slow = self.fast.totals, self.slow.totals
        nx = self.nx_note(spec) if slow[RESPONSES] >= spec.nx_min_responses else None
        half = nx is not None
        if not any(map(ge, fast, limits.fast_at[half])) and not any(
            map(ge, slow, limits.slow_at[half])
        ):
            return []
        out = []
        for rule, limit in zip(limits.rules, limits.values, strict=True):
            halved = nx if rule.nx else None
            if halved:
                limit /= 2
            value = (slow if rule.slow else fast)[rule.metric]
            value = value if value > 0.0 else 0.0  # float drift from add/subtract
            if value >= limit if rule.count else value > limit:
                text = self._text(rule, value, limit, spec.name_score)
                out.append(
                    Crossing(rule.field, value, limit, f"{text} ({halved})" if halved else text)
                )
        return out

    def _text(self, rule: Rule, value: float, limit: float, name_score: float) -> str:
        window = span(self.slow.seconds if rule.slow else self.fast.seconds)
        where = " over all zones" if self.zone == ALL_ZONES else ""
        unit, op = ("", ">=") if rule.count else (" B", ">")
        text = f"{rule.what}{where} {value:,.0f}{unit} in {window} {op} {limit:,.0f}{unit}"
        return f"{text} (name score >= {name_score:g})" if rule.field == "shaped_names" else text
