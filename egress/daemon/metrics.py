"""`GET /metrics`: what egressd measures, in the Prometheus text format (version 0.0.4).

Only what is measured: per-sandbox DNS verdict counters (the resolver core's own; a
query *rate* is ``rate(egress_dns_queries_total[1m])``), inline violations by class,
the inline layer's freeze latency (detection to the cgroup reporting frozen), kernel set
sizes and drop counters read from nft at scrape time, and the set-update path's timing.
Upstream round-trip latency is not measured by the resolver shell, so it is not here.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable

from egress.datapath import constants as c
from egress.errors import EgressError

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


def render(registry: Registry) -> str:
    out = _Out()
    served = registry.list()
    out.family("egress_sandboxes", "gauge", "Sandboxes this egressd serves.")
    for kind in ("created", "attached"):
        out.sample("egress_sandboxes", sum(s.record.kind == kind for s in served), kind=kind)
    out.family("egress_sandboxes_created_total", "counter", "Sandboxes created or attached.")
    out.sample("egress_sandboxes_created_total", registry.created_total)
    _dns(out, served)
    _violations(out, served)
    _freezes(out, served)
    _sets(out, served)
    return "\n".join(out.lines) + "\n"


def _dns(out: _Out, served: Iterable[Served]) -> None:
    out.family("egress_dns_queries_total", "counter", "DNS queries by verdict (inline core).")
    rows = list(served)
    for s in rows:
        stats = s.resolver.core.stats
        for verdict in VERDICTS:
            out.sample("egress_dns_queries_total", stats.get(verdict, 0),
                       sandbox=s.id, verdict=verdict)  # fmt: skip
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
    latencies = [f.latency_ms for s in served for f in list(s.session.state.freezes)]
    for bound in FREEZE_BUCKETS_MS:
        out.sample(f"{name}_bucket", sum(x <= bound for x in latencies), le=f"{bound:g}")
    out.sample(f"{name}_bucket", len(latencies), le="+Inf")
    out.sample(f"{name}_sum", round(sum(latencies), 3))
    out.sample(f"{name}_count", len(latencies))


def _sets(out: _Out, served: Iterable[Served]) -> None:
    rows = list(served)
    out.family("egress_set_elements", "gauge", "Elements in a sandbox's allowed sets now.")
    for s in rows:
        with contextlib.suppress(EgressError):
            for set_name in ("allow4", "allow6"):
                n = len(s.sb.nft.list_set("inet", c.TABLE, set_name))
                out.sample("egress_set_elements", n, sandbox=s.id, set=set_name)
    out.family("egress_dropped_packets_total", "counter", "Packets the sandbox rules dropped.")
    for s in rows:
        with contextlib.suppress(EgressError):
            packets, _ = s.sb.nft.counter("inet", c.TABLE, "dropped")
            out.sample("egress_dropped_packets_total", packets, sandbox=s.id)
