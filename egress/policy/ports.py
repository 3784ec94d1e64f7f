"""Port lists in the tree: ``[80, 443]`` (one transport) or ``{tcp: [...], udp: [...]}``.

Ranges (``8000-8100``) are accepted only where the datapath can hold them: static
``connect.allow`` destinations. Ports of addresses learned from DNS go into a
concatenated nft set keyed by address, protocol and port, one element per port, so
``connect.ports`` and a DNS rule's ``ports`` take single ports only.
"""

from __future__ import annotations

from egress.model import PortRange, Ports
from egress.policy.checks import Report, entry, get_list, get_map, kind_of
from egress.policy.tree import Map, Node, Scalar, Seq
from egress.policy.values import parse_port

TRANSPORT_KEYS = ("tcp", "udp")
PROTOCOLS = ("tcp", "udp", "any")
ALL_PORTS = (PortRange(1, 65535),)


def build_ports(
    node: Node,
    path: str,
    report: Report,
    *,
    ranges: bool,
    proto: str = "tcp",
    empty: str = "nothing here can be reached",
) -> Ports:
    """Ports from a list (for ``proto``: tcp, udp or any) or a ``{tcp, udp}`` mapping.

    On a problem it records it and returns what it could read, so checking goes on.
    """
    if isinstance(node, Seq | Map):
        before = len(report.problems)
        if isinstance(node, Seq):
            ports = for_proto(proto, port_list(node, path, report, ranges=ranges))
        else:
            ports = _transport_map(node, path, report, ranges=ranges)
        if ports.is_empty() and len(report.problems) == before:
            report.warn(node.where, f"{path}: no ports, so {empty}")
        return ports
    report.error(
        node.where,
        f"{path}: expected a list of ports like [80, 443] or a mapping like "
        f"{{tcp: [443], udp: [443]}}, got {kind_of(node)}",
    )
    return Ports()


def _transport_map(node: Map, path: str, report: Report, *, ranges: bool) -> Ports:
    get_map(node, path, report, TRANSPORT_KEYS)
    found = {}
    for transport in TRANSPORT_KEYS:
        value = entry(node, transport)
        found[transport] = (
            port_list(value, f"{path}.{transport}", report, ranges=ranges) if value else ()
        )
    return Ports(tcp=found["tcp"], udp=found["udp"])


def port_list(node: Node, path: str, report: Report, *, ranges: bool) -> tuple[PortRange, ...]:
    """Sorted, de-duplicated ports of a YAML list; bad items are reported and skipped."""
    items = get_list(node, path, report, "ports")
    if items is None:
        return ()
    out: set[PortRange] = set()
    for index, item in enumerate(items):
        if not isinstance(item, Scalar):
            report.error(item.where, f"{path}[{index}]: expected a port, got {kind_of(item)}")
            continue
        try:
            out.add(parse_port(item.value, ranges=ranges))
        except ValueError as exc:
            report.error(item.where, f"{path}[{index}]: {exc}")
    return tuple(sorted(out, key=lambda r: (r.first, r.last)))


def for_proto(proto: str, ranges: tuple[PortRange, ...]) -> Ports:
    """The same ports for tcp, udp, or both (``any``)."""
    tcp = ranges if proto in ("tcp", "any") else ()
    udp = ranges if proto in ("udp", "any") else ()
    return Ports(tcp=tcp, udp=udp)


def describe_ports(ports: Ports) -> str:
    """``tcp 80, 443; udp 53`` for messages and ``egressctl check``."""
    parts = [
        f"{name} {', '.join(str(r) for r in ranges)}"
        for name, ranges in (("tcp", ports.tcp), ("udp", ports.udp))
        if ranges
    ]
    return "; ".join(parts) or "none"
