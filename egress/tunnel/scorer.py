"""``TunnelScorer``: one per sandbox; sees every allowed query before it is forwarded.

Memory bound per sandbox, ``MEMORY_BOUND`` = 2 MiB at the default ``max_zones`` = 256:
at most ``max_zones`` zone states plus one for the sum over all zones, each of fixed size
(two ``Ring`` arrays of 10x5 and 30x5 float32 cells, a two-generation 1 KiB Bloom filter,
at most 8 record-type counters: 3.4 KiB measured), and at most ``MAX_VERDICTS`` verdicts.
Measured after 1,000,000 unique names over 5,000 zones: 0.8 MB (tests/unit/
test_tunnel_memory.py, tracemalloc). The memo caches of ``name_features`` (2,048 names)
and ``split_name`` (1,024 names) are process-wide, shared by all sandboxes: 1.3 MB.

Eviction: when a new zone would exceed ``max_zones``, the lightest (least suspicious)
of the 8 least recently used zones goes, so a flood of fresh zones cannot push a zone
that is building up towards a verdict out of the table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from itertools import islice

from egress.model import TunnelSpec
from egress.tunnel.features import (
    NameFeatures,
    NameScore,
    data_type_name,
    name_features,
    score_name,
    type_points,
)
from egress.tunnel.labels import split_name
from egress.tunnel.overrides import Applied, Overrides
from egress.tunnel.verdict import Crossing, TunnelVerdict
from egress.tunnel.zone import ALL_ZONES, RULES, SANDBOX_RULES, ZoneState, limits

MAX_VERDICTS = 64  # a sandbox with one verdict is frozen; more are kept only as evidence
MEMORY_BOUND = 2 * 1024 * 1024  # bytes per sandbox at the default max_zones
EVICTION_SCAN = 8


class TunnelScorer:
    def __init__(self, config: TunnelSpec, clock: Callable[[], float]) -> None:
        self._spec = config
        self._clock = clock
        self._zones: OrderedDict[str, ZoneState] = OrderedDict()
        self._verdicts: dict[str, TunnelVerdict] = {}
        self._all = ZoneState(ALL_ZONES, config, config.sandbox_scale)
        self._overrides = Overrides(config.zones)
        self._all_limits = limits(config, SANDBOX_RULES, config.sandbox_scale)
        self._limits: dict[float, tuple[float, ...]] = {}  # per zone scale: a handful

    @property
    def verdicts(self) -> tuple[TunnelVerdict, ...]:
        return tuple(self._verdicts.values())

    def explain(self, name: str, qtype: int = 1) -> NameScore:
        """Per-query features and score (for ``egressctl check``); changes no state."""
        return score_name(name, qtype, self._sub_zone(name))

    def applied(self, name: str) -> Applied:
        """The zone ``name`` is scored under and the override in force there."""
        return self._overrides.applied(name)

    def _sub_zone(self, name: str) -> str | None:
        """An override's zone below the registered domain that ``name`` is under."""
        zone = self._overrides.zone_of(name)
        return zone if zone != split_name(name).zone else None

    def observe_query(self, name: str, qtype: int) -> TunnelVerdict | None:
        """Account one allowed query; a verdict means: do not forward it."""
        if not self._spec.enabled:
            return None
        zone = self._overrides.zone_of(name)
        if self._verdicts:  # idempotent, and cheap once the sandbox is caught
            verdict = self._verdicts.get(zone)
            if verdict is not None:
                return verdict
        f = name_features(name, None if zone == split_name(name).zone else zone)
        if not f.labels:
            return None  # a bare registered domain carries nothing its owner could read
        state = self._state(f.zone)
        if state is None:
            return None  # exempt zone
        now = self._clock()
        state.advance(now)
        new = state.seen.add(hash(f.subdomain))
        # A repeat adds nothing to any window, so only a new name can cross a limit.
        crossings = self._account(state, f, qtype, now) if new else None
        if crossings:
            return self._decide(state, f, qtype, crossings, now)
        state.forwarded(f, qtype, new)
        return None

    def observe_response(self, name: str, rcode: int) -> None:
        """Account the response code the upstream gave to a forwarded query."""
        if not self._spec.enabled:
            return
        zone = self._overrides.zone_of(name)
        state = self._zones.get(zone) if zone else None
        if state is not None:
            state.advance(self._clock())
            state.response(rcode)

    def _account(self, state: ZoneState, f: NameFeatures, qtype: int, now: float) -> list[Crossing]:
        """Add a new subdomain to its zone's windows and the sum's; the limits it crossed."""
        points = type_points(qtype)
        shaped = f.base_score + points >= self._spec.name_score
        state.add_unique(f, qtype, shaped)
        scaled = self._limits.get(state.scale)
        if scaled is None:
            scaled = self._limits[state.scale] = limits(self._spec, RULES, state.scale)
        out = state.crossings(self._spec, RULES, scaled)
        # Only names that add something random, long or data-typed can move the sum; a zone
        # with raised limits is trusted, so it does not feed the sum either.
        if state.scale <= 1.0 and (shaped or f.info_bytes or f.long or points):
            self._all.advance(now)
            self._all.add_unique(f, qtype, shaped)
            out += self._all.crossings(self._spec, SANDBOX_RULES, self._all_limits)
        return out

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

    def _state(self, zone: str) -> ZoneState | None:
        state = self._zones.get(zone)
        if state is not None:
            self._zones.move_to_end(zone)
            return state
        override = self._overrides.for_zone(zone)
        if override is not None and override.exempt:
            return None
        scale = override.limit_scale if override is not None else 1.0
        if len(self._zones) >= self._spec.max_zones:
            self._evict()
        state = self._zones[zone] = ZoneState(zone, self._spec, scale)
        return state

    def _evict(self) -> None:
        oldest = islice(self._zones.items(), EVICTION_SCAN)
        victim = min(oldest, key=lambda item: item[1].weight())[0]
        del self._zones[victim]


def scorer_for(spec: TunnelSpec, clock: Callable[[], float]) -> TunnelScorer | None:
    """The scorer ``spec.tunnel`` asks for: None when detection is switched off."""
    return TunnelScorer(spec, clock) if spec.enabled else None
