"""``TunnelScorer``: one per sandbox; sees every allowed query before it is forwarded, or
right after where ``can_defer`` proves it cannot make a verdict (``headroom``).

Memory bound per sandbox, ``MEMORY_BOUND`` = 2 MiB at the default ``max_zones`` = 256:
at most ``max_zones`` zone states plus one for the sum over all zones, each of fixed size
(two ``Ring`` arrays of 10x7 and 30x6 float32 cells, a two-generation 1 KiB Bloom filter,
at most 8 record-type counters, a 512-symbol ``vocab.Vocab``: about 7 KiB measured), one
16 KiB sandbox-wide ``Vocab``, at most ``MAX_VERDICTS`` verdicts, and once a zone has
been evicted, a 96 KiB ``Spent`` and a ``Seen`` of names of 32 KiB a generation.
Measured after 1,000,000 unique names over 5,000 zones: 2.03 MB reachable, 2.06 MB
compiled (tests/unit/test_tunnel_memory.py). The memo caches of ``name_features``
(2,048 names) and ``split_name`` (1,024 names) are process-wide, shared by all
sandboxes: 1.3 MB; so is the set of PSL rule suffixes ``labels.registered_domain``
walks: 1.2 MB.

Eviction: when a new zone would exceed ``max_zones``, the lightest (least suspicious)
of the 8 least recently used zones goes, so a flood of fresh zones cannot push a zone
that is building up towards a verdict out of the table.

A zone evicted and made again gets no new allowance (``zone_free_bytes``, the name
information per window the sum over all zones leaves out): what it sent in each window
is kept (``window.Spent``, 4,096 zones, in half-window buckets) and taken off until the
bucket of its eviction has left that window (up to a window and a half after it, where
a zone that stayed in the table lets what it sent go as it ages). Without it, a
workload cycling through more zones than are tracked had a new allowance at each return
(an attacker's review: 1,000 zones, 50 names a second, moved ~240 KB of names before
the slow window's sum caught it; now ~34 KB, at the first returns, in the fast window).
What stays open is each zone's allowance, once a window: a sandbox allowed thousands of
zones an attacker runs can move about 27 B of name through each (5,000 zones: ~150 KB
before the slow window's sum, was 1.2 MB; 20,000, more than ``Spent`` holds: ~780 KB,
was 4.8 MB). A crawler that asks a few names of each of thousands of zones once keeps
each allowance (charging every evicted zone's whole allowance to the sum caught one
after ~1,300 zones an hour; zones sharing a cell sharing the largest amount caught one
asking six names a site after ~1,400).

A zone made again has also forgotten its names, and a sandbox that asks more zones than
are tracked again as their TTLs run out would have each name count as new and use up
the zone's allowance again. So from the first eviction on, every name and (name, type)
scored, or asked again, goes into a sandbox-wide ``Seen`` of names (by name and zone),
which a zone made again asks before it counts one as new: what the sandbox asked before
carries nothing its zone's nameserver could not already read. A zone made before that
memory was comes back as a new zone, once. The memory holds the last 16,384-32,768
names and (name, type)s, and one asked again is kept there: 800 zones of six names, A
and AAAA, asked again every 5 minutes (14,400 a round), or 1,200 every 10, get no
verdict; at 1,500 every 10 minutes what it forgot adds up to one within the hour. (Names
alone, their types priced again on a zone's return, froze 300 zones of six names every
5 minutes.)
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from itertools import islice
from typing import Final

from egress.model import MAX_ZONE_FREE_BYTES, TunnelSpec
from egress.tunnel import vocab
from egress.tunnel.features import (
    NameFeatures,
    NameScore,
    data_type_name,
    name_features,
    score_name,
    type_points,
)
from egress.tunnel.headroom import Headroom
from egress.tunnel.labels import split_name
from egress.tunnel.overrides import Applied, Overrides
from egress.tunnel.verdict import Crossing, TunnelVerdict
from egress.tunnel.window import M62, Seen, Spent
from egress.tunnel.zone import (
    ALL_ZONES,
    FAST_BUCKETS,
    NAME_INFO,
    RULES,
    SANDBOX_RULES,
    SLOW_BUCKETS,
    SLOW_NAME_INFO,
    Limits,
    ZoneState,
    limits,
)

MAX_VERDICTS: Final = 64  # a sandbox with one verdict is frozen; more are kept only as evidence
MEMORY_BOUND: Final = 2 * 1024 * 1024  # bytes per sandbox at the default max_zones
EVICTION_SCAN: Final = 8
# Keeps (name, type) apart from the name alone; times a type it stays below 2**62, which
# the compiled scorer (``native``) keeps as a machine integer.
_TYPE_SALT: Final = 0x9E3779B1
_LOW_39: Final = (1 << 39) - 1
SANDBOX_SEEN_WORDS: Final = 4096  # the memory of names: 32 KiB a generation


class TunnelScorer:
    def __init__(self, config: TunnelSpec, clock: Callable[[], float]) -> None:
        if config.zone_free_bytes > MAX_ZONE_FREE_BYTES:  # a policy cannot say more
            raise ValueError(
                f"zone_free_bytes {config.zone_free_bytes} is over {MAX_ZONE_FREE_BYTES}"
            )
        self._spec = config
        self._clock = clock
        self._zones: OrderedDict[str, ZoneState] = OrderedDict()
        self._verdicts: dict[str, TunnelVerdict] = {}
        self._all = ZoneState(ALL_ZONES, config, config.sandbox_scale)
        self._vocab = self._all.vocab  # every zone's labels, for the ones a zone lacks
        self._overrides = Overrides(config.zones)
        self._search = tuple("." + s for s in config.search_domains)
        self._all_limits = limits(config, SANDBOX_RULES, config.sandbox_scale, whole=True)
        self._limits: dict[float, Limits] = {}  # per zone scale: a handful
        self._latest = -math.inf  # the latest time seen (``_time``)
        self._sound = True  # False once an accounting raised midway: nothing is deferred
        # Made at the first eviction (none for most sandboxes): what zones evicted had
        # used of their allowance, and the names and (name, type)s scored since.
        self._spent: Spent | None = None
        self._names: Seen | None = None
        new_zone = limits(config, RULES, self._overrides.least_scale)
        self._room = Headroom(
            new_zone, config.window_s / FAST_BUCKETS, config.slow_window_s / SLOW_BUCKETS
        )
        self._room.account(self._all, self._all_limits, 1.0)

    def _time(self) -> float:
        """The clock, never going back: a wall clock stepped back would have a window keep
        totals that ``Headroom.recompute`` already took as retired, and room it counted on
        would be gone (windows ignore a step back; this makes the bound see time alike)."""
        now = self._clock()
        if now < self._latest:
            return self._latest
        self._latest = now
        return now

    @property
    def verdicts(self) -> tuple[TunnelVerdict, ...]:
        return tuple(self._verdicts.values())

    def explain(self, name: str, qtype: int = 1) -> NameScore:
        """Per-query features and score (for ``egressctl check``) of what ``observe_query``
        scores for ``name`` (``scored_as``); changes no state."""
        name = self.scored_as(name)
        return score_name(name, qtype, self._sub_zone(name))

    def applied(self, name: str) -> Applied:
        """The zone ``name`` is scored under and the override in force there."""
        return self._overrides.applied(self.scored_as(name))

    def scored_as(self, name: str) -> str:
        """``name`` as scored: without a ``search_domains`` suffix it was expanded with."""
        return self._unexpanded(name) if self._search else name

    def _sub_zone(self, name: str) -> str | None:
        """An override's zone below the registered domain that ``name`` is under."""
        return _below(self._overrides.zone_of(name), name)

    def can_defer(self, name: str, qtype: int) -> bool:
        """True when ``observe_query(name, qtype)``, asked next, cannot return a verdict:
        what the query could add is below what every window has left before a limit
        (``headroom``, a sound bound). The resolver then sends it upstream first and calls
        ``observe_query`` right after, before it judges anything else. A sandbox with a
        verdict scores first; so does a query the bound cannot clear, once the room has
        been recomputed, at most once per bucket boundary."""
        if not self._spec.enabled:
            return True
        if self._verdicts or not self._sound:
            return False
        room = self._room
        if room.safe(name, qtype):
            return True
        now = self._time()
        if not room.stale(now):
            return False
        states = [(z, self._scaled(z.scale)) for z in self._zones.values()]
        states.append((self._all, self._all_limits))
        room.recompute(now, states)
        return room.safe(name, qtype)

    def observe_query(self, name: str, qtype: int) -> TunnelVerdict | None:
        """Account one allowed query; a verdict means: do not forward it."""
        if not self._spec.enabled:
            return None
        name = self.scored_as(name)
        zone = self._overrides.zone_of(name)
        if self._verdicts:  # idempotent, and cheap once the sandbox is caught
            verdict = self._verdicts.get(zone)
            if verdict is not None:
                return verdict
        f = name_features(name, _below(zone, name) if self._overrides.below else None)
        if not f.labels:
            return None  # a bare registered domain carries nothing its owner could read
        now = self._time()
        state = self._state(f.zone, now)
        if state is None:
            return None  # exempt zone
        state.advance(now)
        key = hash(f.folded) & M62  # cut once: machine integers from here (``native``)
        typed = key ^ (qtype * _TYPE_SALT)
        seen = state.seen
        new = not seen.has(key)
        # The pair (name, type) too: a type is a choice the nameserver sees. A repeat of
        # both adds nothing to any window, so only something new can cross a limit.
        pair = new or not seen.has(typed)
        names = self._names  # once a zone has been evicted
        wide = wide_typed = 0
        if names is not None:
            # The memory's keys: a zone's are of the name below it (``folded``), so they
            # are its own, mixed with the zone's hash turned, so that name N under zone
            # Z is not Z under N.
            where = hash(state.zone) & M62
            where = (where & _LOW_39) << 23 | where >> 39
            wide, wide_typed = key ^ where, typed ^ where
            if not pair:  # still asked: kept past the memory's rotations, for a return
                names.note(wide)
                names.note(wide_typed)
            elif state.remade:  # what it forgot at its eviction, the sandbox has not
                if new and names.keep(wide):
                    new = False
                    seen.add(key)
                if names.keep(wide_typed):
                    seen.add(typed)
                    pair = new
        crossings = None
        if pair:
            self._sound = False  # until the room has what the windows took
            crossings = self._account(state, f, qtype, now, new)
            # Seen once accounted, not before: where the accounting raised (a bug; the
            # resolver refuses the query), a retry is new again and scored, not let go
            # upstream as a repeat of something never counted. (What a zone made again
            # took from the memory above was counted before its eviction.)
            seen.add(key)
            seen.add(typed)
            if names is not None:
                names.add(wide)
                names.add(wide_typed)
            self._sound = True
        if crossings:
            return self._decide(state, f, qtype, crossings, now)
        state.forwarded(f, qtype, new)
        return None

    def observe_response(self, name: str, rcode: int) -> None:
        """Account the response code the upstream gave to a forwarded query."""
        if not self._spec.enabled:
            return
        zone = self._overrides.zone_of(self.scored_as(name))
        state = self._zones.get(zone) if zone else None
        if state is not None:
            state.advance(self._time())
            state.response(rcode)

    def _unexpanded(self, name: str) -> str:
        """``name`` without a search domain it was asked under, if what is left is a name
        with a subdomain of its own: the same information as that name asked directly."""
        lowered = name.lower().rstrip(".")
        for suffix in self._search:
            if lowered.endswith(suffix):
                inner = name[: len(lowered) - len(suffix)]
                if split_name(inner).labels:
                    return inner
        return name

    def _account(
        self, state: ZoneState, f: NameFeatures, qtype: int, now: float, new: bool
    ) -> list[Crossing]:
        """Add a new name (or a known name's new type) to its zone's windows and the
        sum's; the limits it crossed."""
        points = type_points(qtype)
        shaped = new and f.base_score + points >= self._spec.name_score
        if new:
            bits = vocab.new_name_bits(
                state.vocab, self._vocab, f.folded_parts, f.part_alphabet, qtype
            )
            which = state.add_unique(f, qtype, shaped, bits)
        else:
            which = 0
            bits = vocab.type_price(state.vocab, self._vocab, qtype)
            state.add_info(bits / 8, bits / 8)
        scaled = self._scaled(state.scale)
        out = state.crossings(self._spec, scaled)
        room = self._room
        room.account(state, scaled, max(state.vocab.largest(), self._vocab.largest()))
        # A zone with raised limits is trusted: it does not feed the sum. Of the rest, a
        # name's information does once its zone has sent more than a small allowance in
        # the window (with the price of choosing among such zones), its text only if it is
        # random, long or data-typed. The allowance keeps a sandbox that asks a few names
        # in each of hundreds of zones (the benign corpus: 265) from adding up to a tunnel.
        if state.scale > 1.0:
            return out
        fast_free, slow_free = self._allowance(state, now)
        fast = _over(state.fast.totals[NAME_INFO], bits / 8, fast_free)
        slow = _over(state.slow.totals[SLOW_NAME_INFO], bits / 8, slow_free)
        text = new and (shaped or f.info_bytes or f.long or points)
        if fast or slow or text:  # nothing added, nothing the sum could newly cross
            everything = self._all
            everything.advance(now)
            if fast or slow:
                choice = vocab.zone_price(self._vocab, hash(state.zone) & M62) / 8
                everything.add_info(fast + choice if fast else 0.0, slow + choice if slow else 0.0)
            # Labels its zone already counted are not asked of the sum again: a label the
            # zone repeats adds no text anywhere. (The two Bloom filters fill and rotate
            # apart, so this differs from asking the sum for every label by a few bytes.)
            if text:
                everything.add_unique(f, qtype, shaped, 0.0, which)
            out += everything.crossings(self._spec, self._all_limits)
            room.account(everything, self._all_limits, self._vocab.largest())
        return out

    def _scaled(self, scale: float) -> Limits:
        scaled = self._limits.get(scale)
        if scaled is None:
            scaled = self._limits[scale] = limits(self._spec, RULES, scale)
        return scaled

    def _decide(
        self, state: ZoneState, f: NameFeatures, qtype: int, crossings: list[Crossing], now: float
    ) -> TunnelVerdict:
        verdict = TunnelVerdict(
            zone=f.zone,
            name=f.name,
            qtype=qtype,
            at=now,
            score=max(c.value / c.limit if c.limit else float("inf") for c in crossings),
            reasons=tuple(crossings),
            queries_before=state.queries,
            bytes_before=state.bytes,
            unique_before=state.unique,
            types=tuple((data_type_name(t) or str(t), n) for t, n in state.types.items()),
        )
        if len(self._verdicts) >= MAX_VERDICTS:
            del self._verdicts[next(iter(self._verdicts))]
        self._verdicts[f.zone] = verdict
        self._zones.pop(f.zone, None)  # the verdict stands in for the zone's windows
        return verdict

    def _allowance(self, state: ZoneState, now: float) -> tuple[float, float]:
        """What the sum over all zones leaves out of ``state``'s name information in
        the fast and the slow window: ``zone_free_bytes``, less what the zone sent in
        that window before its eviction."""
        free = float(self._spec.zone_free_bytes)
        spent = self._spent
        if not state.remade or spent is None:
            return free, free
        fast, slow = spent.used(hash(state.zone) & M62, now)
        return max(0.0, free - fast), max(0.0, free - slow)

    def _state(self, zone: str, now: float) -> ZoneState | None:
        state = self._zones.get(zone)
        if state is not None:
            self._zones.move_to_end(zone)
            return state
        override = self._overrides.for_zone(zone)
        if override is not None and override.exempt:
            return None
        scale = override.limit_scale if override is not None else 1.0
        if len(self._zones) >= self._spec.max_zones:
            self._evict(now)
        state = self._zones[zone] = ZoneState(zone, self._spec, scale)
        spent = self._spent
        if spent is not None:
            state.recorded = True  # its names go into the memory
            # Back while Spent has its eviction: what it sent is off its allowance.
            state.remade = spent.known(hash(zone) & M62, now)
        return state

    def _evict(self, now: float) -> None:
        oldest = islice(self._zones.items(), EVICTION_SCAN)
        victim = min(oldest, key=lambda item: item[1].weight())[0]
        state = self._zones.pop(victim)
        spent = self._spent
        if spent is None:  # the first eviction: from here on zones come back
            spent = self._spent = Spent(self._spec.window_s, self._spec.slow_window_s, now)
            self._names = Seen(SANDBOX_SEEN_WORDS)
        if not state.recorded:
            # Made before the memory of names, which lacks what it asked: back, it is a
            # new zone (once), rather than one whose names all count as new again.
            return
        # What it sent since it was made, as far as each window still holds it.
        fast = max(0.0, state.fast.totals_at(now)[NAME_INFO])  # (float drift below 0)
        slow = max(0.0, state.slow.totals_at(now)[SLOW_NAME_INFO])
        spent.add(hash(victim) & M62, now, fast, slow)


def _below(zone: str, name: str) -> str | None:
    """``zone`` if it lies below ``name``'s registered domain (a policy override's), else
    None: ``name_features`` then splits at the registered domain itself."""
    return zone if zone != split_name(name).zone else None


def _over(total: float, added: float, free: float) -> float:
    """The part of ``added`` (already in ``total``) above the allowance ``free``."""
    over = total - free
    return 0.0 if over <= 0.0 else added if added < over else over


def scorer_for(spec: TunnelSpec, clock: Callable[[], float]) -> TunnelScorer | None:
    """The scorer ``spec.tunnel`` asks for: None when detection is switched off."""
    return TunnelScorer(spec, clock) if spec.enabled else None
