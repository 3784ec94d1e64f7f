"""egressd's /metrics text rendered a chunk of sandboxes at a time (daemon/metrics.py):
the loop answers DNS between chunks, and the text is the same as rendered at once, each
family under one header with every sandbox's samples."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from egress.daemon import metrics
from egress.inline.upstream import Latencies
from egress.model import SandboxKind


def sandbox(i: int) -> Any:
    latency = Latencies()
    latency.observe(0.001 * (i + 1))
    return SimpleNamespace(
        id=f"s{i:03d}",
        record=SimpleNamespace(kind=SandboxKind.CREATED),
        resolver=SimpleNamespace(
            core=SimpleNamespace(stats={"queries": i, "allowed": i}),
            rate_limited=i % 3,
            upstream_latency=latency,
            sets=SimpleNamespace(updates=i, failures=0, slow=0, last_ms=0.5),
        ),
        session=SimpleNamespace(state=SimpleNamespace(violations=[], freezes=[])),
    )


def families(text: str) -> dict[str, list[str]]:
    """Each family's sample lines, asserting every header comes once and its samples
    follow it without another family's in between."""
    out: dict[str, list[str]] = {}
    current = ""
    for line in text.splitlines():
        if line.startswith("# HELP "):
            current = line.split()[2]
            assert current not in out, f"{current} has two headers"
            out[current] = []
        elif not line.startswith("#"):
            assert line.startswith(current), f"{line!r} outside its family {current!r}"
            out[current].append(line)
    return out


def test_render_stops_after_every_chunk_and_keeps_each_family_together() -> None:
    served = [sandbox(i) for i in range(2 * metrics.CHUNK + 5)]
    kernel = {s.id: metrics.Kernel({"allow4": 2, "allow6": 0}, 7) for s in served}
    registry = SimpleNamespace(created_total=len(served), collector=None, lag=None)
    steps = metrics.render(registry, kernel, served)  # type: ignore[arg-type]
    stops = 0
    while True:
        try:
            next(steps)
            stops += 1
        except StopIteration as done:
            text = str(done.value)
            break
    assert stops == 3  # 25 + 25 + 5 sandboxes
    by_family = families(text)
    queries = by_family["egress_dns_queries_total"]
    assert len(queries) == len(served) * len(metrics.VERDICTS)
    assert 'egress_dns_queries_total{sandbox="s054",verdict="queries"} 54' in queries
    assert len(by_family["egress_set_elements"]) == 2 * len(served)
    assert len(by_family["egress_dropped_packets_total"]) == len(served)
    latency = by_family["egress_upstream_latency_seconds"]
    assert len(latency) == len(served) * (len(Latencies.UPSTREAM_S) + 3)
    assert 'egress_sandboxes{kind="created"} 55' in by_family["egress_sandboxes"]
    assert by_family["egress_freeze_latency_ms"][-1] == "egress_freeze_latency_ms_count 0"


def test_every_family_is_there_with_no_sandbox() -> None:
    registry = SimpleNamespace(created_total=0, collector=None, lag=None)
    steps = metrics.render(registry, {}, [])  # type: ignore[arg-type]
    with pytest.raises(StopIteration) as done:
        next(steps)
    text = str(done.value.value)
    for family in ("egress_dns_queries_total", "egress_upstream_latency_seconds",
                   "egress_violations_total", "egress_set_elements",
                   "egress_dropped_packets_total", "egress_freeze_latency_ms"):  # fmt: skip
        assert f"# TYPE {family} " in text


def test_values_are_exact_however_large() -> None:
    """A counter past a million is rendered in full (``:g`` gave 1.23457e+06: the
    counter then moved in steps of ten or more), a float as its shortest exact text."""
    s = sandbox(0)
    s.resolver.core.stats = {"queries": 1_234_567, "allowed": 10**12 + 1}
    s.resolver.sets.last_ms = 0.123456789
    registry = SimpleNamespace(created_total=1, collector=None, lag=None)
    steps = metrics.render(registry, {}, [s])  # type: ignore[arg-type]
    next(steps)
    with pytest.raises(StopIteration) as done:
        next(steps)
    text = str(done.value.value)
    assert 'egress_dns_queries_total{sandbox="s000",verdict="queries"} 1234567\n' in text
    assert 'egress_dns_queries_total{sandbox="s000",verdict="allowed"} 1000000000001\n' in text
    assert 'egress_set_update_last_ms{sandbox="s000"} 0.123456789\n' in text
    assert "egress_kernel_figures 1\n" in text


@pytest.mark.parametrize(
    ("value", "text"),
    [(0, "0"), (True, "1"), (2.5, "2.5"), (1e-05, "1e-05"), (float("nan"), "NaN"),
     (float("inf"), "+Inf"), (float("-inf"), "-Inf")],
)  # fmt: skip
def test_value_spellings(value: float, text: str) -> None:
    assert metrics._value(value) == text


def test_kernel_figures_that_failed_are_said_so() -> None:
    registry = SimpleNamespace(created_total=0, collector=None, lag=None)
    steps = metrics.render(registry, None, [sandbox(0)])  # type: ignore[arg-type]
    next(steps)
    with pytest.raises(StopIteration) as done:
        next(steps)
    text = str(done.value.value)
    assert "egress_kernel_figures 0\n" in text
    assert "egress_set_elements{" not in text
