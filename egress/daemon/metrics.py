"""`GET /metrics`: what egressd measures, in the Prometheus text format (version 0.0.4).

Only what is measured: per-sandbox DNS verdict counters (the resolver core's own; a
query *rate* is ``rate(egress_dns_queries_total[1m])``), queries dropped by the
sandbox's rate limit, upstream round trips (forward to answer, per sandbox), inline
violations by class, the inline layer's freeze latency (detection to the cgroup
reporting frozen), kernel set sizes and drop counters read from nft at scrape time, and
the set-update path's timing, and how late egressd's event loop runs (``lag.py``). The
latencies are histograms rendered by ``_histogram`` from a fixed-size ``Latencies``.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from egress.datapath import constants as c
from egress.errors import EgressError
from egress.inline.upstream import Latencies
from egress.model import SandboxKind

from .collect import Collector
from .lag import LoopLag
from .registry import Registry, Served

FREEZE_BUCKETS_MS = (0.5, 1, 2, 5, 10, 25, 50, 100, 250, 1000)
VERDICTS = ("queries", "allowed", "denied", "cache_hits", "forwarded", "servfail", "malformed")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Out:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, text: str) -> None:
        self.lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]

    def sample(self, name: str, value: float, **labels: str) -> None:
        inner = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
        self.lines.append(f"{name}{{{inner}}} {value:g}" if inner else f"{name} {value:g}")


@dataclass
class Kernel:
    """One sandbox's figures read from nft: set sizes and the drop counter."""

    sets: dict[str, int]
    dropped: int | None


def read_kernel(served: list[Served]) -> dict[str, Kernel]:
    """Blocking (one nft worker round trip per figure, ~0.25 ms each): call it in a
    thread, so 200 sandboxes' reads don't hold up every sandbox's DNS for 150 ms."""
    out = {}
    for s in served:
        sets: dict[str, int] = {}
        dropped = None
        with contextlib.suppress(EgressError):
            for set_name in ("allow4", "allow6"):
                sets[set_name] = len(s.sb.nft.list_set("inet", c.TABLE, set_name))
            dropped = s.sb.nft.counter("inet", c.TABLE, "dropped").packets
        out[s.id] = Kernel(sets, dropped)
    return out


def render(registry: Registry, kernel: dict[str, Kernel]) -> str:
    """The metrics text; ``kernel`` is what ``read_kernel`` read for these sandboxes."""
    out = _Out()
    served = registry.list()
    out.family("egress_sandboxes", "gauge", "Sandboxes this egressd serves.")
    for kind in SandboxKind:
        out.sample("egress_sandboxes", sum(s.record.kind == kind for s in served), kind=kind)
    out.family("egress_sandboxes_created_total", "counter", "Sandboxes created or attached.")
    out.sample("egress_sandboxes_created_total", registry.created_total)
    _dns(out, served)
    _violations(out, served)
    _freezes(out, served)
    _sets(out, served, kernel)
    if registry.collector is not None:
        _collector(out, registry.collector)
    if registry.lag is not None:
        _lag(out, registry.lag)
    return "\n".join(out.lines) + "\n"


def _collector(out: _Out, collector: Collector) -> None:
    """The one pause egressd takes on purpose (daemon/collect.py), so it can be seen."""
    out.family("egress_gc_full_collections_total", "counter",
               "Full garbage collections egressd ran (each holds all DNS).")  # fmt: skip
    out.sample("egress_gc_full_collections_total", collector.collections)
    out.family("egress_gc_full_collection_last_seconds", "gauge",
               "How long the last full garbage collection held egressd's loop.")  # fmt: skip
    out.sample("egress_gc_full_collection_last_seconds", collector.last_ms / 1000)


def _lag(out: _Out, lag: LoopLag) -> None:
    """How late the one loop every sandbox's DNS waits on ran what was due (daemon/lag.py)."""
    name = "egress_loop_lag_seconds"
    text = f"How late egressd's event loop ran a callback due every {lag.tick_s:g} s."
    out.family(name, "histogram", text)
    _histogram(out, name, lag.latencies)
    out.family("egress_loop_lag_max_seconds", "gauge",
               "The longest egressd's event loop was late since it started.")  # fmt: skip
    out.sample("egress_loop_lag_max_seconds", lag.worst)


def _dns(out: _Out, served: Iterable[Served]) -> None:
    out.family("egress_dns_queries_total", "counter", "DNS queries by verdict (inline core).")
    rows = list(served)
    for s in rows:
        stats = s.resolver.core.stats
        for verdict in VERDICTS:
            out.sample("egress_dns_queries_total", stats.get(verdict, 0),
                       sandbox=s.id, verdict=verdict)  # fmt: skip
    out.family("egress_dns_rate_limited_total", "counter",
               "DNS queries dropped unanswered: over the sandbox's dns.rate_limit.")  # fmt: skip
    for s in rows:
        out.sample("egress_dns_rate_limited_total", s.resolver.rate_limited, sandbox=s.id)
    name = "egress_upstream_latency_seconds"
    out.family(name, "histogram", "Upstream DNS round trips, query sent to answer received.")
    for s in rows:
        _histogram(out, name, s.resolver.upstream_latency, sandbox=s.id)
    out.family("egress_set_updates_total", "counter", "Set updates by outcome.")
    for s in rows:
        sets = s.resolver.sets
        for outcome, n in (("ok", sets.updates), ("failed", sets.failures), ("slow", sets.slow)):
            out.sample("egress_set_updates_total", n, sandbox=s.id, outcome=outcome)
    out.family("egress_set_update_last_ms", "gauge", "Duration of the last set update.")
    for s in rows:
        out.sample("egress_set_update_last_ms", s.resolver.sets.last_ms, sandbox=s.id)


def _violations(out: _Out, served: Iterable[Served]) -> None:
    out.family("egress_violations_total", "counter", "Violations the inline layer saw.")
    for s in served:
        counts = Counter(v.cls.value for v in list(s.session.state.violations))
        for cls, n in sorted(counts.items()):
            out.sample("egress_violations_total", n, sandbox=s.id, **{"class": cls})


def _freezes(out: _Out, served: Iterable[Served]) -> None:
    name = "egress_freeze_latency_ms"
    out.family(name, "histogram", "Detection to cgroup frozen, inline layer (ms).")
    latencies = Latencies(FREEZE_BUCKETS_MS)
    for s in served:
        for freeze in list(s.session.state.freezes):
            latencies.observe(freeze.latency_ms)
    _histogram(out, name, latencies)


def _histogram(out: _Out, name: str, latencies: Latencies, **labels: str) -> None:
    """One histogram's samples: cumulative buckets, then +Inf, sum and count."""
    below = 0
    for bound, n in zip(latencies.bounds, latencies.counts, strict=False):
        below += n
        out.sample(f"{name}_bucket", below, **labels, le=f"{bound:g}")
    out.sample(f"{name}_bucket", latencies.count, **labels, le="+Inf")
    out.sample(f"{name}_sum", latencies.sum, **labels)
    out.sample(f"{name}_count", latencies.count, **labels)


def _sets(out: _Out, served: Iterable[Served], kernel: dict[str, Kernel]) -> None:
    rows = [(s, kernel[s.id]) for s in served if s.id in kernel]
    out.family("egress_set_elements", "gauge", "Elements in a sandbox's allowed sets now.")
    for s, k in rows:
        for set_name, n in k.sets.items():
            out.sample("egress_set_elements", n, sandbox=s.id, set=set_name)
    out.family("egress_dropped_packets_total", "counter", "Packets the sandbox rules dropped.")
    for s, k in rows:
        if k.dropped is not None:
            out.sample("egress_dropped_packets_total", k.dropped, sandbox=s.id)
