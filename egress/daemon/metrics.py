"""`GET /metrics`: what egressd measures, in the Prometheus text format (version 0.0.4).

Only what is measured: per-sandbox DNS verdict counters (the resolver core's own; a
query *rate* is ``rate(egress_dns_queries_total[1m])``), queries dropped by the
sandbox's rate limit, upstream round trips (forward to answer, per sandbox), inline
violations by class, the inline layer's freeze latency (detection to the cgroup
reporting frozen), kernel set sizes and drop counters read at scrape time, and
the set-update path's timing, and how late egressd's event loop runs (``lag.py``). The
latencies are histograms rendered by ``_histogram`` from a fixed-size ``Latencies``.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Generator, Iterable
from dataclasses import dataclass

from egress.datapath import constants as c
from egress.errors import EgressError
from egress.inline.upstream import Latencies
from egress.kernel import nft_figures
from egress.model import SandboxKind

from .collect import Collector
from .lag import LoopLag
from .registry import Registry, Served

CHUNK = 25  # sandboxes rendered per turn of the loop: ~1.4 ms of it
FREEZE_BUCKETS_MS = (0.5, 1, 2, 5, 10, 25, 50, 100, 250, 1000)
VERDICTS = ("queries", "allowed", "denied", "cache_hits", "forwarded", "servfail", "malformed")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Out:
    """Samples by family: a family named again (the next chunk of sandboxes) gets its
    samples added under its one header, as the text format wants them together."""

    def __init__(self) -> None:
        self._families: dict[str, list[str]] = {}  # in the order first named
        self._current: list[str] = []

    def family(self, name: str, kind: str, text: str) -> None:
        lines = self._families.get(name)
        if lines is None:
            lines = self._families[name] = [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        self._current = lines

    def sample(self, name: str, value: float, **labels: str) -> None:
        inner = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
        self._current.append(f"{name}{{{inner}}} {value:g}" if inner else f"{name} {value:g}")

    def text(self) -> str:
        return "\n".join(line for lines in self._families.values() for line in lines) + "\n"


@dataclass
class Kernel:
    """One sandbox's figures read from nft: set sizes and the drop counter."""

    sets: dict[str, int]
    dropped: int | None


def read_kernel(served: list[Served]) -> dict[str, Kernel]:
    """Each sandbox's set sizes and drop counter, asked of the kernel directly
    (kernel/nft_figures.py; none of it in the nft worker): 0.4-0.7 s for 1,000 sandboxes
    under 5,000 qps. Blocking, for a thread: mostly system calls, each letting the loop
    have the GIL."""
    out = {}
    for s in served:
        sets: dict[str, int] = {}
        dropped = None
        with contextlib.suppress(EgressError):  # gone meanwhile, or its table: no figures
            fd = s.sb.nft.netns_fd()  # its own copy: a delete may close the handle's now
            try:
                reader = nft_figures.Reader(None if fd is None else f"/proc/self/fd/{fd}", c.TABLE)
            finally:
                if fd is not None:
                    os.close(fd)
            with reader as kernel:
                for set_name in c.ALLOW_SETS:
                    sets[set_name] = kernel.set_size(set_name)
                dropped = kernel.counter_packets("dropped")
        out[s.id] = Kernel(sets, dropped)
    return out


def render(
    registry: Registry, kernel: dict[str, Kernel], served: list[Served]
) -> Generator[None, None, str]:
    """The metrics text (the generator's return value); ``kernel`` is what
    ``read_kernel`` read for these sandboxes. It stops after every CHUNK sandboxes, for
    the caller to let the loop answer DNS meanwhile: at 1,000 sandboxes the text is
    30,000 lines, and rendered at once it held every sandbox's DNS for 55 ms. Rendered in
    a thread instead, it held the GIL against the loop, which stalled it longer still (5
    scrapes at 5,000 qps: 5 ticks of the loop late by 100-250 ms)."""
    out = _Out()
    out.family("egress_sandboxes", "gauge", "Sandboxes this egressd serves.")
    for kind in SandboxKind:
        out.sample("egress_sandboxes", sum(s.record.kind == kind for s in served), kind=kind)
    out.family("egress_sandboxes_created_total", "counter", "Sandboxes created or attached.")
    out.sample("egress_sandboxes_created_total", registry.created_total)
    # Every family's header, sandboxes or not (each chunk adds its samples under it).
    _dns(out, [])
    _violations(out, [])
    _sets(out, [], kernel)
    for start in range(0, len(served), CHUNK):
        chunk = served[start : start + CHUNK]
        _dns(out, chunk)
        _violations(out, chunk)
        _sets(out, chunk, kernel)
        yield
    _freezes(out, served)
    if registry.collector is not None:
        _collector(out, registry.collector)
    if registry.lag is not None:
        _lag(out, registry.lag)
    return out.text()


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
