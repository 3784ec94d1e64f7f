"""Detection delay on tunnel-like traffic and zero verdicts on the benign corpus.

Budgets (subdomain text forwarded upstream before the verdict, repeats included):
iodine and dns2tcp, every encoding and query type: < 2,048 B; a slow channel (a query every
few seconds, short encoded labels): < 4,096 B.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_tunnel_samples import IODINE_TYPES, SAMPLES, dns2tcp, iodine, read_samples

from egress.model import TunnelSpec
from egress.tunnel import TunnelScorer, TunnelVerdict

FAST_BUDGET = 2048
SLOW_BUDGET = 4096
DATA = Path(__file__).resolve().parents[1] / "data"
BENIGN = DATA / "benign_names.txt"
# CDN, cloud, registry, telemetry, git and NTP hosts at high cardinality, and the names of a
# pip install of 50 packages and a large npm install (tests/data/make_benign_extra.py)
EXTRA = DATA / "benign_extra.txt"


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def replay(queries: list[tuple[str, int]], gaps: list[float]) -> TunnelVerdict | None:
    clock = Clock()
    scorer = TunnelScorer(TunnelSpec(), clock)
    for (name, qtype), gap in zip(queries, gaps, strict=True):
        clock.now += gap
        verdict = scorer.observe_query(name, qtype)
        if verdict is not None:
            return verdict
        scorer.observe_response(name, 0)
    return None


def tunnel_verdict(queries: list[tuple[str, int]], gap: float) -> TunnelVerdict:
    verdict = replay(queries, [gap] * len(queries))
    assert verdict is not None, "tunnel not detected"
    return verdict


@pytest.mark.parametrize("handshake", [True, False], ids=["handshake", "data-only"])
@pytest.mark.parametrize("qtype", list(IODINE_TYPES.values()), ids=list(IODINE_TYPES))
@pytest.mark.parametrize("encoding", ["base32", "base64", "base64u", "base128"])
def test_iodine_is_caught_before_2k(encoding: str, qtype: int, handshake: bool) -> None:
    names = iodine(encoding, handshake=handshake)
    verdict = tunnel_verdict([(n, qtype) for n in names], gap=0.005)  # 30 KB in 0.2 s
    assert verdict.bytes_before < FAST_BUDGET


@pytest.mark.parametrize("qtype", [16, 25], ids=["TXT", "KEY"])
def test_dns2tcp_is_caught_before_2k(qtype: int) -> None:
    verdict = tunnel_verdict([(n, qtype) for n in dns2tcp()], gap=0.01)
    assert verdict.bytes_before < FAST_BUDGET


@pytest.mark.parametrize(
    "path", sorted(SAMPLES.glob("real_*.txt")) + sorted(SAMPLES.glob("[id]*.txt")), ids=str
)
def test_sample_files_are_caught_before_2k(path: Path) -> None:
    verdict = tunnel_verdict(read_samples(path), gap=0.005)
    assert verdict.bytes_before < FAST_BUDGET, verdict.describe()


@pytest.mark.parametrize("gap", [2.0, 4.0, 6.0])
@pytest.mark.parametrize("path", sorted(SAMPLES.glob("slow_*.txt")), ids=lambda p: p.name)
def test_slow_channel_is_caught_before_4k(path: Path, gap: float) -> None:
    verdict = tunnel_verdict(read_samples(path), gap=gap)
    assert verdict.bytes_before < SLOW_BUDGET, verdict.describe()


# --- benign corpus: zero verdicts ----------------------------------------------------------


def benign() -> list[tuple[str, int]]:
    """Both corpora, one after the other: one sandbox that asks all of it."""
    return read_samples(BENIGN) + read_samples(EXTRA)


def test_benign_corpus_is_large_and_repetitive() -> None:
    queries = benign()
    assert len(queries) >= 2_000
    assert len({n for n, _ in queries}) < len(queries) / 2


def test_benign_corpus_at_a_realistic_rate_gets_no_verdict() -> None:
    rng = random.Random(5)
    queries = benign()
    gaps = [rng.expovariate(1 / 2.0) for _ in queries]  # one query every 2 s on average
    assert replay(queries, gaps) is None


@pytest.mark.parametrize("burst", [150, 400])
def test_benign_corpus_in_bursts_gets_no_verdict(burst: int) -> None:
    # like a parallel `pip install` / `npm install`: `burst` names within 1 s, then a pause
    queries = benign()
    gaps = [20.0 if i % burst == 0 else 1.0 / burst for i in range(len(queries))]
    assert replay(queries, gaps) is None


def test_benign_corpus_all_at_once_gets_no_verdict() -> None:
    queries = benign()
    assert replay(queries, [0.0] * len(queries)) is None


@pytest.mark.parametrize("search", ["default.svc.cluster.local", "corp.example.net"])
def test_benign_search_domain_nxdomains_get_no_verdict(search: str) -> None:
    # A resolver search list asks every external name again under the search domains first,
    # and gets NXDOMAIN. (cluster.local is special-use and exempt; a corporate domain is not,
    # and is declared, as the runtime's resolv.conf says: spec.tunnel.search_domains.)
    clock = Clock()
    scorer = TunnelScorer(TunnelSpec(search_domains=(search, search.split(".", 1)[1])), clock)
    externals = sorted({n for n, _ in benign() if not n.endswith(".local")})
    rng = random.Random(9)
    for name in rng.sample(externals, 150):  # 150 distinct external names in 30 min
        for suffix in (search, search.split(".", 1)[1]):
            expanded = f"{name}.{suffix}"
            assert scorer.observe_query(expanded, 1) is None
            scorer.observe_response(expanded, 3)
        clock.now += 12.0
