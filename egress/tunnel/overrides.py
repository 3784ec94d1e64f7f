"""Which zone a name is scored under, and which policy override applies to it.

The scorer keeps one set of windows per zone. A zone is a name's registered domain
(``labels.split_name``: the Public Suffix List), unless a policy override names a zone
below it: ``{zone: g.example.com, exempt: false}`` makes ``g.example.com`` a zone of its
own, scored and limited apart from the rest of ``example.com``. An override applies to
the zone it names and every name under it, at whatever label it sits; of several that
match, the longest wins. Special-use names (RFC 6761 and kin) are never scored unless an
override says otherwise. ``egressctl check`` prints what this module decides.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from egress.model import TunnelZoneOverride
from egress.tunnel.labels import split_name, unescape_labels

# Special-use names never delegated from the root (RFC 6761, 6762, 8375; ICANN's .internal):
# nobody outside can receive their queries, so they carry no tunnel. Kubernetes search-domain
# expansion (every external name asked again under svc.cluster.local) lives here.
SPECIAL_USE = frozenset({"local", "localhost", "invalid", "test", "internal", "home.arpa", "alt"})
SPECIAL = TunnelZoneOverride("special-use", exempt=True)

# Provider zones: names of a cloud's or a service's own endpoints, answered by the
# provider's nameservers, which no tenant can read (a bucket, a region, an org id is a
# name the provider serves, not a zone it delegates). No workload can receive a tunnel
# there, but real software asks hundreds of high-cardinality names in them (every AWS
# region x service, per-bucket hosts, Sentry org ids). So by default their limits are x4
# and they do not feed the sum over all zones; a policy's own override for the zone, or
# one below it, takes precedence (longest match).
PROVIDER_SCALE = 4.0
PROVIDER_ZONES = frozenset(
    {
        "amazonaws.com", "amazon.com", "cloudfront.net", "on.aws",
        "googleapis.com", "gstatic.com", "google.com", "pkg.dev", "gvt1.com",
        "azure.com", "microsoft.com", "windows.net", "microsoftonline.com", "azureedge.net",
        "github.com", "githubusercontent.com", "akamai.net", "akamaiedge.net",
        "sentry.io", "datadoghq.com", "ntp.org", "docker.io", "docker.com",
        "pythonhosted.org", "npmjs.org", "huggingface.co", "cloudflare.com",
    }
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Applied:
    """The zone a name is scored under and the override in force there (or None)."""

    zone: str
    override: TunnelZoneOverride | None

    def describe(self) -> str | None:
        o = self.override
        if o is None:
            return None
        if o is SPECIAL:
            return "not scored: special-use name, never delegated"
        if _builtin(o):
            return f"limits x{o.limit_scale:g}: built in, {o.zone} is a provider zone"
        if o.exempt:
            return f"not scored: spec.tunnel.zones exempts {o.zone}"
        if o.limit_scale != 1.0:
            return f"limits x{o.limit_scale:g}: spec.tunnel.zones scales {o.zone}"
        return f"scored as its own zone: spec.tunnel.zones names {o.zone}"


_PROVIDER = {z: TunnelZoneOverride(z, limit_scale=PROVIDER_SCALE) for z in PROVIDER_ZONES}


def _builtin(o: TunnelZoneOverride) -> bool:
    return _PROVIDER.get(o.zone) is o


class Overrides:
    def __init__(self, zones: Iterable[TunnelZoneOverride]) -> None:
        own = {o.zone.lower().rstrip("."): o for o in zones}
        self._by_zone = {**_PROVIDER, **own}
        # Zones below their registered domain: names under them are scored there.
        self._below = frozenset(z for z in self._by_zone if split_name(z).labels)
        self.below = bool(self._below)  # some override names a zone below its registered one

    @property
    def least_scale(self) -> float:
        """The smallest limit scale a zone can be given (1.0 where no override lowers it)."""
        return min([1.0, *(o.limit_scale for o in self._by_zone.values() if not o.exempt)])

    def zone_of(self, name: str) -> str:
        """The zone ``name`` is scored under."""
        if self._below:
            labels = [label.lower().replace(".", "_") for label in unescape_labels(name) if label]
            for i in range(len(labels)):
                zone = ".".join(labels[i:])
                if zone in self._below:
                    return zone
        return split_name(name).zone

    def for_zone(self, zone: str) -> TunnelZoneOverride | None:
        """The override in force for a zone: the longest suffix of it an override names."""
        labels = zone.split(".")
        for i in range(len(labels) if self._by_zone else 0):
            found = self._by_zone.get(".".join(labels[i:]))
            if found is not None:
                return found
        if labels[-1] in SPECIAL_USE or ".".join(labels[-2:]) in SPECIAL_USE:
            return SPECIAL
        return None

    def applied(self, name: str) -> Applied:
        zone = self.zone_of(name)
        return Applied(zone, self.for_zone(zone) if zone else None)
