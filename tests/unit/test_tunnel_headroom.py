"""``TunnelScorer.can_defer``: a query it clears must never make a verdict when scored.

The resolver forwards a cleared query before scoring it, so one wrong True would let a
tunnel's name out: hypothesis drives sequences of names (random, word-like, hyphenated,
long, many zones, data types, time passing) against small limits, where verdicts are
common, and checks every True. The bound must also clear ordinary traffic, or it saves
nothing."""

from __future__ import annotations

import os
import random
import string
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egress.model import TunnelSpec, TunnelZoneOverride
from egress.tunnel import TunnelScorer
from egress.tunnel.window import Ring

# Small limits: a few names in a zone, or over all zones, cross them.
SMALL = replace(
    TunnelSpec(),
    shaped_names=2,
    long_text_bytes=90,
    info_bytes=30,
    text_bytes=120,
    data_type_names=2,
    names=6,
    name_info_bytes=60,
    slow_names=9,
    slow_name_info_bytes=110,
    slow_info_bytes=50,
    slow_text_bytes=200,
    sandbox_scale=1.5,
    zone_free_bytes=8,
    max_zones=4,  # eviction too
    nx_min_responses=2,
)
ZONES = ("example.com", "lab.test", "a.co.uk", "pkg.dev", "svc.io", "x.org", "d.net")
TYPES = (1, 28, 16, 10, 33, 65300, 255)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


ENCODINGS = (
    "abcdefghijklmnopqrstuvwxyz234567",
    "0123456789abcdef",
    string.ascii_lowercase + "0123456789",
)
# A tunnel's labels: random text in an encoding's alphabet (hypothesis's own text is
# mostly repetitive, low in the information the windows count).
encoded = st.builds(
    lambda seed, n, alphabet: "".join(random.Random(seed).choices(alphabet, k=n)),
    st.integers(0, 2**32),
    st.integers(8, 63),
    st.sampled_from(ENCODINGS),
)
labels = st.one_of(
    encoded,
    st.text(string.ascii_lowercase + string.digits, min_size=1, max_size=63),
    st.text("abcdefghijklmnopqrstuvwxyz234567", min_size=20, max_size=63),  # base32
    st.text("0123456789abcdef", min_size=1, max_size=40),
    st.sampled_from(["www", "api", "cdn", "us-east-1", "ap-southeast-4", "static", "a-b-c"]),
)
steps = st.lists(
    st.tuples(
        st.lists(labels, min_size=1, max_size=4),
        st.sampled_from(ZONES),
        st.sampled_from(TYPES),
        # seconds before it; the wall clock may step back
        st.sampled_from([0.0, 0.0, 0.0, 0.5, 3.0, 31.0, 400.0, -0.2, -3.5, -40.0]),
        st.sampled_from([0, 3, 3, 5]),  # its answer's rcode: NXDOMAIN halves some limits
    ),
    min_size=1,
    max_size=60,
)


def drive(spec: TunnelSpec, queries: list[tuple[list[str], str, int, float, int]]) -> int:
    """Every query the scorer clears makes no verdict; returns how many it cleared."""
    clock = Clock()
    scorer = TunnelScorer(spec, clock)
    cleared = 0
    for parts, zone, qtype, dt, rcode in queries:
        clock.now += dt
        name = ".".join([*parts, zone])
        deferred = scorer.can_defer(name, qtype)
        verdict = scorer.observe_query(name, qtype)
        if deferred:
            cleared += 1
            assert verdict is None, f"{name} type {qtype} was cleared and then crossed"
        if verdict is None:
            scorer.observe_response(name, rcode)
    return cleared


@settings(max_examples=1500, deadline=None)
@given(steps)
def test_a_cleared_query_never_crosses(
    queries: list[tuple[list[str], str, int, float, int]],
) -> None:
    drive(SMALL, queries)


# One limit small at a time, the others out of reach: each part of the bound is then the
# one that must hold (with all small, the tightest hides the others).
LIMITS = {
    "shaped_names": 2,
    "long_text_bytes": 150,
    "info_bytes": 200,
    "text_bytes": 150,
    "data_type_names": 2,
    "names": 5,
    "name_info_bytes": 80,
    "slow_names": 7,
    "slow_name_info_bytes": 120,
    "slow_info_bytes": 300,
    "slow_text_bytes": 200,
}
OUT_OF_REACH = replace(
    TunnelSpec(), **dict.fromkeys(LIMITS, 10**9), max_zones=8, nx_min_responses=2
)


@pytest.mark.parametrize("field", sorted(LIMITS))
@pytest.mark.parametrize("over_all", [False, True], ids=["zones", "sum"])
@settings(max_examples=150, deadline=None)
@given(queries=steps)
def test_each_limit_alone(
    field: str, over_all: bool, queries: list[tuple[list[str], str, int, float, int]]
) -> None:
    """``over_all``: the sum's limits no higher than a zone's and no free allowance, so
    the sum over several zones crosses where no zone does."""
    spec = replace(OUT_OF_REACH, **{field: LIMITS[field]})
    if over_all:
        spec = replace(spec, sandbox_scale=1.0, zone_free_bytes=0)
    drive(spec, queries)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_a_cleared_query_never_crosses_under_overrides(
    queries: list[tuple[list[str], str, int, float, int]],
) -> None:
    """A zone scaled down, one below its registered domain, one exempt."""
    zones = (
        TunnelZoneOverride("svc.io", limit_scale=0.5),
        TunnelZoneOverride("g.pkg.dev"),
        TunnelZoneOverride("x.org", exempt=True),
    )
    drive(replace(SMALL, zones=zones), queries)


def test_many_zones_add_up_over_the_sum() -> None:
    """Each zone stays under its limits; the sum over them crosses. The sum's room must
    stop the bound before that (a bound that watched only zones clears the crossing)."""
    rng = random.Random(7)
    spec = replace(SMALL, max_zones=64, sandbox_scale=1.0, zone_free_bytes=0)
    queries = [
        (["".join(rng.choices("abcdefghijklmnopqrstuvwxyz234567", k=30))], f"z{i}.com", 1, 0.0, 3)
        for i in range(40)
    ]
    drive(spec, queries)


def test_a_clock_stepped_back_does_not_bring_back_retired_totals() -> None:
    """The room recomputed at a bucket boundary counts one zone's old text as retired; the
    wall clock then steps back across that boundary, and the zone's next name must not be
    cleared on room that is not there (found in review: it was, then crossed)."""
    spec = replace(OUT_OF_REACH, text_bytes=100)
    clock = Clock()
    scorer = TunnelScorer(spec, clock)
    clock.now = 1000.0
    for word in ("alpha", "bravo", "delta", "oscar", "tango", "romeo"):
        assert scorer.observe_query(f"{word * 3}.example.com", 1) is None  # 96 B of text
    clock.now = 1029.1  # a fast bucket boundary passed: the recompute drops those names
    assert scorer.can_defer("golfgolfgolfgolf.other.org", 1)
    assert scorer.observe_query("golfgolfgolfgolf.other.org", 1) is None
    clock.now = 1028.9  # back across the boundary
    name = "hotelhotelhotel.example.com"
    assert not scorer.can_defer(name, 1) or scorer.observe_query(name, 1) is None


def test_ordinary_names_are_cleared() -> None:
    """Default limits, a fresh sandbox: 300 names over 30 zones in 60 s, as a package
    install asks them, all cleared (the bound is loose, but not useless)."""
    queries = [
        ([f"files-{i % 7}", "cdn"], f"registry{i % 30}.example", 1 if i % 2 else 28, 0.2, 0)
        for i in range(300)
    ]
    assert drive(TunnelSpec(), queries) == 300


def test_a_verdict_stops_all_deferral() -> None:
    clock = Clock()
    scorer = TunnelScorer(SMALL, clock)
    rng = random.Random(1)
    for _ in range(50):
        label = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz234567", k=50))
        if scorer.observe_query(f"{label}.example.com", 16) is not None:
            break
    assert scorer.verdicts
    assert not scorer.can_defer("www.example.com", 1)


def test_totals_at_looks_ahead_as_advance_goes() -> None:
    ring = Ring(10.0, 10, 2)
    rng = random.Random(3)
    now = 0.0
    for _ in range(400):
        now += rng.choice([0.0, 0.3, 1.0, 2.5, 7.0, 12.0])
        ahead = ring.totals_at(now)
        ring.advance(now)
        assert ahead == ring.totals  # the same floats, not only close ones
        ring.add(rng.randrange(2), rng.random() * 100)


# Run on the sources (a compiled class takes no patch): the zone's crossing check raises
# once, after the windows took the name and before the room did.
BREAK_CROSSINGS_ONCE = """
from egress.tunnel import zone
crossings = zone.ZoneState.crossings
def broken(self, spec, limits):
    zone.ZoneState.crossings = crossings
    raise RuntimeError("a bug")
zone.ZoneState.crossings = broken
"""
BROKEN_ACCOUNTING = (
    """
from dataclasses import replace
from egress.model import TunnelSpec
from egress.tunnel import TunnelScorer
spec = replace(TunnelSpec(), text_bytes=200)
scorer = TunnelScorer(spec, lambda: 1000.0)
assert scorer.observe_query("a" * 40 + ".example.com", 1) is None
"""
    + BREAK_CROSSINGS_ONCE
    + """
try:
    scorer.observe_query("b" * 60 + ".example.com", 1)
except RuntimeError:
    pass
print(scorer.can_defer("c" * 63 + ".example.com", 1), scorer.can_defer("x.example.com", 1))
"""
)


def test_a_scorer_whose_accounting_raised_defers_nothing_more() -> None:
    """Its windows may hold a name its room never took: no bound holds after that."""
    env = {**os.environ, "EGRESS_NATIVE": "0", "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run([sys.executable, "-c", BROKEN_ACCOUNTING], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("field", ["name_info_bytes", "slow_name_info_bytes"])
@settings(max_examples=400, deadline=None)
@given(queries=steps)
def test_a_cleared_query_never_crosses_through_an_eviction(
    field: str, queries: list[tuple[list[str], str, int, float, int]]
) -> None:
    """Two zones tracked, a large allowance: zones are evicted and made again with what
    they had used of it taken off (``TunnelScorer._allowance``), and names they forgot
    known again from the sandbox-wide memory of names."""
    spec = replace(OUT_OF_REACH, **{field: LIMITS[field]}, max_zones=2, zone_free_bytes=60)
    drive(replace(spec, sandbox_scale=1.0), queries)
