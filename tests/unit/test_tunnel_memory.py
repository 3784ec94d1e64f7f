"""Memory of one sandbox's scorer stays bounded after 1,000,000 unique names.

Worst case for the tables: every name unique, spread over 5,000 zones (so the 256-zone
table churns on every query) with limits raised so that no verdict ends the tracking.
tracemalloc runs for the last 40,000 names: it slows every allocation about fourfold, and
since every zone state is rebuilt within a few hundred queries, what is alive at the end
was allocated while it ran. A walk of the scorer's object graph covers all of it too.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
from collections.abc import Iterator

from egress.model import TunnelSpec, TunnelZoneOverride
from egress.tunnel import MEMORY_BOUND, TunnelScorer
from egress.tunnel.features import name_features
from egress.tunnel.labels import split_name

TOTAL, TRACED = 1_000_000, 40_000


def deep_size(obj: object, seen: set[int] | None = None) -> int:
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        return size + sum(deep_size(k, seen) + deep_size(v, seen) for k, v in obj.items())
    if isinstance(obj, list | tuple | set | frozenset):
        return size + sum(deep_size(x, seen) for x in obj)
    return size + sum(deep_size(v, seen) for v in _attributes(obj))


def _attributes(obj: object) -> Iterator[object]:
    for cls in type(obj).__mro__:
        # __mypyc_attrs__: a class compiled by mypyc (``egress.tunnel.native``) lists its
        # attributes there, not in __slots__.
        for name in (*getattr(cls, "__slots__", ()), *cls.__dict__.get("__mypyc_attrs__", ())):
            if hasattr(obj, name):
                yield getattr(obj, name)
    yield from getattr(obj, "__dict__", {}).values()


def test_memory_stays_bounded_after_a_million_unique_names() -> None:
    clock = [0.0]
    spec = TunnelSpec(zones=(TunnelZoneOverride("example", limit_scale=1e9),))
    scorer = TunnelScorer(spec, lambda: clock[0])
    scorer.observe_query("warm.up.example", 1)  # loads the PSL: process-wide, not per sandbox

    def run(first: int, last: int) -> None:
        for i in range(first, last):
            clock[0] += 0.001
            assert scorer.observe_query(f"n{i:x}.z{i % 5000}.example", 1) is None

    run(0, TOTAL - TRACED)
    name_features.cache_clear()  # process-wide caches refill (bounded) while traced
    split_name.cache_clear()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        run(TOTAL - TRACED, TOTAL - TRACED // 2)
        middle = tracemalloc.get_traced_memory()[0] - base
        run(TOTAL - TRACED // 2, TOTAL)
        with_caches = tracemalloc.get_traced_memory()[0] - base
        name_features.cache_clear()
        split_name.cache_clear()
        gc.collect()
        state = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    reachable = deep_size(scorer) - deep_size(spec)
    print(f"\nscorer state {state:,} B (traced), {reachable:,} B (reachable); "
          f"with caches {with_caches:,} B")  # fmt: skip
    assert len(scorer._zones) == spec.max_zones
    assert reachable > 256 * 4096  # the walk sees the zones' tables, compiled or not
    assert state < MEMORY_BOUND and reachable < MEMORY_BOUND
    assert with_caches < MEMORY_BOUND + 2 * 1024 * 1024  # + the bounded memo caches
    assert abs(with_caches - middle) < 64 * 1024  # steady state: no growth per name
