"""``spec.tunnel``: the DNS-tunnel scorer's switch, thresholds and per-zone overrides.

The YAML keys are the :class:`~egress.model.TunnelSpec` field names, except that the two
windows drop their ``_s``: they are durations with a unit (``window: 30s``), read by the
same parser as ``dns.ttl``. A key left out keeps the TunnelSpec default. Scoring itself
lives in ``egress.tunnel``, a sibling this package must not import: here we only build the
TunnelSpec, and ``egressctl check`` runs the scorer on it.

``zones`` tunes the scorer per zone: an override applies to the zone it names and every
name under it, at whatever label it sits (the longest matching override wins;
``egress.tunnel.overrides``). One below a registered domain (``gti.mcafee.com``) makes
that subtree a zone of its own, scored apart from the rest of ``mcafee.com``.
``{zone: X, exempt: true}`` never scores X; ``{zone: X, scale: N}`` multiplies X's
limits by N >= 1. ``exempt: false`` alone is meaningful too: it makes the scorer look at
a special-use zone (``.internal``, ``.local``) it would otherwise skip, or at a subtree of
an exempt zone.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from typing import Any

from egress.model import MAX_ZONE_FREE_BYTES, TunnelSpec, TunnelZoneOverride
from egress.policy.checks import (
    Report,
    duration,
    entry,
    get_bool,
    get_list,
    get_map,
    get_str,
    kind_of,
)
from egress.policy.names import normalize_name
from egress.policy.tree import Map, Node, Scalar
from egress.policy.values import format_duration

PATH = "spec.tunnel"
DURATIONS = {"window": "window_s", "slow_window": "slow_window_s"}
COUNTS = (
    "shaped_names",
    "long_text_bytes",
    "info_bytes",
    "text_bytes",
    "data_type_names",
    "names",
    "name_info_bytes",
    "slow_names",
    "slow_info_bytes",
    "slow_text_bytes",
    "slow_name_info_bytes",
    "nx_min_responses",
    "zone_free_bytes",
    "max_zones",
)
POSITIVE = ("name_score", "sandbox_scale")
TUNNEL_KEYS = (
    "enabled",
    "window",
    "slow_window",
    "name_score",
    "shaped_names",
    "long_text_bytes",
    "info_bytes",
    "text_bytes",
    "data_type_names",
    "names",
    "name_info_bytes",
    "slow_names",
    "slow_info_bytes",
    "slow_text_bytes",
    "slow_name_info_bytes",
    "nx_ratio",
    "nx_min_responses",
    "sandbox_scale",
    "zone_free_bytes",
    "max_zones",
    "zones",
    "search_domains",
)
ZONE_KEYS = ("zone", "exempt", "scale")
MAX_WINDOW = 86400  # a day: longer windows would only hide that the limits are too high
MAX_ZONES = 4096  # about 7 KiB each per sandbox: 28 MiB at most
ZONE_EXAMPLE = "{zone: example.com, exempt: true} or {zone: example.com, scale: 4}"


def build_tunnel(node: Node | None, report: Report) -> TunnelSpec:
    """The TunnelSpec of ``spec.tunnel``; defaults for what is missing or unusable."""
    tunnel = get_map(node, PATH, report, TUNNEL_KEYS) if node is not None else None
    if tunnel is None:
        return TunnelSpec()
    changes: dict[str, Any] = {}  # field -> value, each checked by its reader
    unusable = set()
    for key, (_, value) in tunnel.entries.items():
        if key in TUNNEL_KEYS:  # the others are already reported as unknown
            found = _read(key, value, report)
            if found is None:
                unusable.add(key)
            else:
                changes[DURATIONS.get(key, key)] = found
    spec = dataclasses.replace(TunnelSpec(), **changes)
    if spec.slow_window_s < spec.window_s and not unusable & DURATIONS.keys():
        _windows_reversed(tunnel, spec, report)
    return spec


def _windows_reversed(tunnel: Map, spec: TunnelSpec, report: Report) -> None:
    slow = entry(tunnel, "slow_window")
    at = slow or entry(tunnel, "window") or tunnel
    default = "" if slow else ", the default"
    report.error(
        at.where,
        f"{PATH}: slow_window ({format_duration(int(spec.slow_window_s))}{default}) is "
        f"shorter than window ({format_duration(int(spec.window_s))})",
    )


def _read(key: str, node: Node, report: Report) -> object | None:
    path = f"{PATH}.{key}"
    if key == "enabled":
        return get_bool(node, path, report)
    if key == "zones":
        return _zones(node, report)
    if key == "search_domains":
        return _search_domains(node, report)
    try:
        if key in DURATIONS:
            return float(duration(node, MAX_WINDOW))
        if key in COUNTS:
            return _count(node, key)
        if key == "nx_ratio":
            return _ratio(node)
        return _positive(node)
    except ValueError as exc:
        report.error(node.where, f"{path}: {exc}")
        return None


def _count(node: Node, key: str) -> int:
    value = node.value if isinstance(node, Scalar) else None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected a whole number, got {kind_of(node)}")
    least = 0 if key == "zone_free_bytes" else 1
    if value < least:
        raise ValueError(f"must be at least {least}, got {value}")
    if key == "zone_free_bytes" and value > MAX_ZONE_FREE_BYTES:
        raise ValueError(f"must be at most {MAX_ZONE_FREE_BYTES}, got {value}")
    if key == "max_zones" and value > MAX_ZONES:
        raise ValueError(
            f"{value} is more than the limit of {MAX_ZONES} (each tracked zone costs "
            "about 7 KiB per sandbox)"
        )
    return value


def _number(node: Node) -> float:
    value = node.value if isinstance(node, Scalar) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a number, got {kind_of(node)}")
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {node_text(node)}")
    return float(value)


def _positive(node: Node) -> float:
    value = _number(node)
    if value <= 0:
        raise ValueError(f"must be greater than 0, got {node_text(node)}")
    return value


def _ratio(node: Node) -> float:
    value = _number(node)
    if not 0 < value <= 1:
        raise ValueError(f"must be greater than 0 and at most 1, got {node_text(node)}")
    return value


def node_text(node: Node) -> str:
    return node.text if isinstance(node, Scalar) else kind_of(node)


def _zones(node: Node, report: Report) -> tuple[TunnelZoneOverride, ...]:
    out: list[TunnelZoneOverride] = []
    first: dict[str, tuple[int, Node]] = {}
    for index, item in enumerate(get_list(node, f"{PATH}.zones", report, "zones") or ()):
        override = _zone(index, item, report)
        if override is None:
            continue
        seen = first.setdefault(override.zone, (index, item))
        if seen[1] is not item:
            report.error(
                item.where,
                f"{PATH}.zones[{index}]: {override.zone!r} is the same zone as "
                f"zones[{seen[0]}] (line {seen[1].where.line}); merge the two entries",
            )
            continue
        out.append(override)
    return tuple(out)


def _search_domains(node: Node, report: Report) -> tuple[str, ...]:
    out: list[str] = []
    for index, item in enumerate(get_list(node, f"{PATH}.search_domains", report, "domains") or ()):
        name = _zone_name(item, f"{PATH}.search_domains[{index}]", report)
        if name is not None and "." not in name:
            report.error(
                item.where,
                f"{PATH}.search_domains[{index}]: {name!r} is a top-level domain; a search "
                "domain is a domain like corp.example.com",
            )
        elif name is not None and name not in out:
            out.append(name)
    return tuple(out)


def _zone(index: int, item: Node, report: Report) -> TunnelZoneOverride | None:
    path = f"{PATH}.zones[{index}]"
    if not isinstance(item, Map):
        report.error(item.where, f"{path}: expected {ZONE_EXAMPLE}, got {kind_of(item)}")
        return None
    fields = get_map(item, path, report, ZONE_KEYS, required=("zone",))
    zone_node, exempt_node, scale_node = (entry(fields, key) for key in ZONE_KEYS)
    zone = _zone_name(zone_node, f"{path}.zone", report) if zone_node else None
    exempt = get_bool(exempt_node, f"{path}.exempt", report) if exempt_node else None
    scale = _scale(scale_node, f"{path}.scale", report) if scale_node else None
    if exempt and scale_node is not None:
        report.error(
            item.where,
            f"{path}: exempt: true never scores the zone, so scale has no effect; keep one",
        )
    elif exempt_node is None and scale_node is None:
        report.error(item.where, f"{path}: say what to do with the zone: {ZONE_EXAMPLE}")
    if zone is None:
        return None
    loosened = "exempts" if exempt else "raises the limits of" if scale and scale > 1 else ""
    if "." not in zone and loosened and zone_node is not None:
        report.warn(
            zone_node.where,
            f"{path}.zone: this {loosened} every zone under the top-level domain '{zone}'",
        )
    return TunnelZoneOverride(zone=zone, exempt=bool(exempt), limit_scale=scale or 1.0)


def _zone_name(node: Node, path: str, report: Report) -> str | None:
    text = get_str(node, path, report)
    if text is None:
        return None
    try:
        return _normal_zone(text)
    except ValueError as exc:
        report.error(node.where, f"{path}: invalid zone {text!r}: {exc}")
        return None


def _normal_zone(text: str) -> str:
    if "*" in text:
        raise ValueError("no wildcards: a zone already covers every name under it")
    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return normalize_name(text)
    raise ValueError("that is an IP address; a zone is a domain name like example.com")


def _scale(node: Node, path: str, report: Report) -> float | None:
    try:
        value = _number(node)
    except ValueError as exc:
        report.error(node.where, f"{path}: {exc}")
        return None
    if value < 1:
        report.error(
            node.where,
            f"{path}: must be at least 1, got {node_text(node)} (scale raises a zone's "
            "limits; to lower every limit, lower the thresholds)",
        )
        return None
    return value
