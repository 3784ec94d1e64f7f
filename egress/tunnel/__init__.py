"""DNS-tunnel scoring: pure code, clock injected, memory bounded per sandbox.

Its part of the flow (see DESIGN.md: the resolver calls it for every query the policy
allows, BEFORE forwarding it; a verdict means "don't forward, freeze"; where
``TunnelScorer.can_defer`` proves no verdict can come of a query (``headroom``: a sound
bound), the resolver forwards it and scores it right after, before judging anything
else, so the same queries go upstream and scoring is off a miss's path)::

    query name, qtype
        │  spec.tunnel.search_domains: a search-list expansion is scored as the name;
        │  labels.split_name: PSL registered domain (zone) + subdomain labels;
        │  overrides.Overrides: a policy override's zone below it, if the name is under
        │  one (longest match), is the zone instead
        ▼
    features.score_name ──▶ NameScore: lengths, character mix, entropy normalised by
        │                   length and alphabet, word-likeness, raw bytes, case flips,
        │                   data-only types ──▶ score, information estimate
        ▼
    scorer.TunnelScorer: exempt zones (overrides, special-use TLDs) stop here
        │
        ▼
    zone.ZoneState per (sandbox, zone), LRU-capped, and one over all zones:
        fast window: tunnel-shaped names, long-name text, information, text, data types,
                     unique names, information in new names
        slow window: unique names, information, text, NXDOMAIN/REFUSED share,
                     information in new names
        │  vocab: a new name (or a known name's new type) priced as an adaptive code
        │  against the names its zone sent: label count, labels by position, type
        │  any limit crossed (TunnelSpec, per-zone overrides)
        ▼
    verdict.TunnelVerdict(zone, score, crossings, bytes/queries before) ── idempotent
        ▲
    observe_response(name, rcode) feeds the NXDOMAIN/REFUSED share

The modules are also compiled by mypyc (``native``), and the compiled ones are imported
when they were built from exactly these sources.

Entry points: ``TunnelScorer(config, clock)`` (``observe_query``, ``observe_response``,
``explain``), ``score_name(name, qtype)``. Names are ``str``: raw (one char per byte) or
presentation form with ``\\DDD`` escapes; ``name_from_labels`` makes the latter from wire
labels, which keeps a raw '.' inside a label apart from a label boundary.
"""

from egress.tunnel.native import NATIVE

NATIVE.activate(__path__)  # before the modules below: the compiled ones, if fresh

from egress.tunnel.features import NameScore, score_name  # noqa: E402
from egress.tunnel.labels import name_from_labels  # noqa: E402
from egress.tunnel.scorer import MEMORY_BOUND, TunnelScorer, scorer_for  # noqa: E402
from egress.tunnel.verdict import Crossing, TunnelVerdict  # noqa: E402

__all__ = [
    "MEMORY_BOUND",
    "Crossing",
    "NameScore",
    "TunnelScorer",
    "TunnelVerdict",
    "name_from_labels",
    "score_name",
    "scorer_for",
]
