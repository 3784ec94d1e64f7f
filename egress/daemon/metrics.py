"""`GET /metrics`: what egressd measures, in the Prometheus text format (version 0.0.4).

Only what is measured: per-sandbox DNS verdict counters (the resolver core's own; a
query *rate* is ``rate(egress_dns_queries_total[1m])``), queries dropped by the
sandbox's rate limit, upstream round trips (forward to answer, per sandbox), inline
violations by class, the inline layer's freeze latency (detection to the cgroup
reporting frozen), kernel set sizes and drop counters read at scrape time (by egressd's
figures worker: figures.py), the set-update path's timing, and how late egressd's event
loop runs (``lag.py``). The latencies are histograms rendered by ``_histogram_lines``
from a fixed-size ``Latencies``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from functools import cache

from egress.collect import Collector
from egress.inline.upstream import Latencies
from egress.model import SandboxKind

from .lag import LoopLag
from .registry import Registry, Served

CHUNK = 25  # sandboxes rendered per turn of the loop: ~1.4 ms of it
FREEZE_BUCKETS_MS = (0.5, 1, 2, 5, 10, 25, 50, 100, 250, 1000)
VERDICTS = ("queries", "allowed", "denied", "cache_hits", "forwarded", "servfail", "malformed")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _value(value: float) -> str:
    """A sample's value, exact: an integer in full (``:g`` made 1,234,567 queries
    "1.23457e+06", so a counter past a million moved in steps of ten or more), a float as
    its shortest round-trip text, and the text format's spellings of the rest."""
    if isinstance(value, int):
        return str(int(value))  # bool too: 0 or 1
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class _Out:
    """Samples by family: a family named again (the next chunk of sandboxes) gets its
    samples added under its one header, as the text format wants them together.

    The per-sandbox families take their lines whole (``lines``), with the sandbox's label
    escaped once per scrape rather than once per sample; each chunk's lines are joined
    when it ends (``seal``), so the text at the end is a join of a few hundred blocks,
    not of 30,000 lines in one turn of the loop."""

    def __init__(self) -> None:
        self._families: dict[str, list[str]] = {}  # in the order first named
        self._sealed: dict[str, int] = {}  # how many of a family's items are joined blocks
        self._current: list[str] = []

    def family(self, name: str, kind: str, text: str) -> None:
        lines = self._families.get(name)
        if lines is None:
            lines = self._families[name] = [f"# HELP {name} {text}\n# TYPE {name} {kind}\n"]
            self._sealed[name] = 1
        self._current = lines

    def sample(self, name: str, value: float, **labels: str) -> None:
        inner = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
        v = _value(value)
        self._current.append(f"{name}{{{inner}}} {v}\n" if inner else f"{name} {v}\n")

    def lines(self, lines: list[str]) -> None:
        """Sample lines, each ending in a newline, of the family named last."""
        self._current.extend(lines)

    def seal(self) -> None:
        """Join what each family took since the last seal into one block."""
        for name, lines in self._families.items():
            done = self._sealed[name]
            if len(lines) > done + 1:
                lines[done:] = ["".join(lines[done:])]
            self._sealed[name] = len(lines)

    def text(self) -> str:
        return "".join(line for lines in self._families.values() for line in lines)


@dataclass
class Kernel:
    """One sandbox's figures read from nft: set sizes and the drop counter."""

    sets: dict[str, int]
    dropped: int | None


def render(
    registry: Registry, kernel: dict[str, Kernel] | None, served: list[Served]
) -> Generator[None, None, str]:
    """The metrics text (the generator's return value); ``kernel`` is what
    ``KernelFigures.read`` (figures.py) read for these sandboxes (None: it failed, and
    ``egress_kernel_figures`` says so). It stops after every CHUNK sandboxes, for
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
    out.family("egress_kernel_figures", "gauge",
               "1 if this scrape read the kernel's set sizes and drop counters, 0 if not "
               "(egressd's stderr says why).")  # fmt: skip
    out.sample("egress_kernel_figures", int(kernel is not None))
    kernel = kernel or {}
    # Every family's header, sandboxes or not (each chunk adds its samples under it).
    _dns(out, [])
    _violations(out, [])
    _sets(out, [], kernel)
    for start in range(0, len(served), CHUNK):
        rows = _sandbox_labels(served[start : start + CHUNK])  # escaped once a scrape
        _dns(out, rows)
        _violations(out, rows)
        _sets(out, rows, kernel)
        out.seal()
        yield
    _freezes(out, served)
    if registry.collector is not None:
        _collector(out, registry.collector)
    if registry.lag is not None:
        _lag(out, registry.lag)
    return out.text()


def _collector(out: _Out, collector: Collector) -> None:
    """The one pause egressd takes on purpose (egress/collect.py), so it can be seen."""
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
    out.lines(_histogram_lines(name, lag.latencies, ""))
    out.family("egress_loop_lag_max_seconds", "gauge",
               "The longest egressd's event loop was late since it started.")  # fmt: skip
    out.sample("egress_loop_lag_max_seconds", lag.worst)


def _sandbox_labels(served: Iterable[Served]) -> list[tuple[Served, str]]:
    """Each sandbox with its label text (``sandbox="ID"``), escaped once."""
    return [(s, f'sandbox="{_label(s.id)}"') for s in served]


def _dns(out: _Out, rows: list[tuple[Served, str]]) -> None:
    name = "egress_dns_queries_total"
    out.family(name, "counter", "DNS queries by verdict (inline core).")
    for s, sb in rows:
        stats = s.resolver.core.stats
        out.lines([f'{name}{{{sb},verdict="{v}"}} {_value(stats.get(v, 0))}\n' for v in VERDICTS])
    name = "egress_dns_rate_limited_total"
    out.family(name, "counter",
               "DNS queries dropped unanswered: over the sandbox's dns.rate_limit.")  # fmt: skip
    out.lines([f"{name}{{{sb}}} {_value(s.resolver.rate_limited)}\n" for s, sb in rows])
    name = "egress_upstream_latency_seconds"
    out.family(name, "histogram", "Upstream DNS round trips, query sent to answer received.")
    for s, sb in rows:
        out.lines(_histogram_lines(name, s.resolver.upstream_latency, sb))
    name = "egress_set_updates_total"
    out.family(name, "counter", "Set updates by outcome.")
    for s, sb in rows:
        sets = s.resolver.sets
        out.lines([f'{name}{{{sb},outcome="ok"}} {_value(sets.updates)}\n',
                   f'{name}{{{sb},outcome="failed"}} {_value(sets.failures)}\n',
                   f'{name}{{{sb},outcome="slow"}} {_value(sets.slow)}\n'])  # fmt: skip
    name = "egress_set_update_last_ms"
    out.family(name, "gauge", "Duration of the last set update.")
    out.lines([f"{name}{{{sb}}} {_value(s.resolver.sets.last_ms)}\n" for s, sb in rows])


def _violations(out: _Out, rows: list[tuple[Served, str]]) -> None:
    name = "egress_violations_total"
    out.family(name, "counter", "Violations the inline layer saw.")
    for s, sb in rows:
        counts = Counter(v.cls.value for v in list(s.session.state.violations))
        out.lines([f'{name}{{{sb},class="{_label(cls)}"}} {n}\n'
                   for cls, n in sorted(counts.items())])  # fmt: skip


def _freezes(out: _Out, served: Iterable[Served]) -> None:
    name = "egress_freeze_latency_ms"
    out.family(name, "histogram", "Detection to cgroup frozen, inline layer (ms).")
    latencies = Latencies(FREEZE_BUCKETS_MS)
    for s in served:
        for freeze in list(s.session.state.freezes):
            latencies.observe(freeze.latency_ms)
    out.lines(_histogram_lines(name, latencies, ""))


def _histogram_lines(name: str, latencies: Latencies, labels: str) -> list[str]:
    """One histogram's sample lines (``labels``: its label text, "" for none): cumulative
    buckets, then +Inf, sum and count."""
    pre = f"{name}_bucket{{{labels},le=" if labels else f"{name}_bucket{{le="
    out = []
    below = 0
    for le, n in zip(_le(latencies.bounds), latencies.counts, strict=False):
        below += n
        out.append(f"{pre}{le}}} {below}\n")
    out.append(f'{pre}"+Inf"}} {latencies.count}\n')
    braces = f"{{{labels}}}" if labels else ""
    out.append(f"{name}_sum{braces} {_value(latencies.sum)}\n")
    out.append(f"{name}_count{braces} {latencies.count}\n")
    return out


@cache
def _le(bounds: tuple[float, ...]) -> tuple[str, ...]:
    """A histogram's bucket bounds as their ``le`` label values."""
    return tuple(f'"{bound:g}"' for bound in bounds)


def _sets(out: _Out, rows: list[tuple[Served, str]], kernel: dict[str, Kernel]) -> None:
    figures = [(sb, kernel[s.id]) for s, sb in rows if s.id in kernel]
    name = "egress_set_elements"
    out.family(name, "gauge", "Elements in a sandbox's allowed sets now.")
    for sb, k in figures:
        out.lines([f'{name}{{{sb},set="{_label(set_name)}"}} {n}\n'
                   for set_name, n in k.sets.items()])  # fmt: skip
    name = "egress_dropped_packets_total"
    out.family(name, "counter", "Packets the sandbox rules dropped.")
    out.lines([f"{name}{{{sb}}} {k.dropped}\n" for sb, k in figures if k.dropped is not None])
