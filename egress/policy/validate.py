"""Positioned tree to a validated :class:`~egress.model.Policy`, or every problem in it.

Each section is read by one small function that records problems in a shared Report
and returns its value, or a default when the value is unusable, so checking continues
past the first mistake. Only when the walk is over do we decide: any error and the
caller gets a PolicyError with all of them; otherwise the Policy and the warnings.

The key tuples below are the language's vocabulary; ``schema.py`` describes the same
keys for editors, and a test keeps the two in step.
"""

from __future__ import annotations

import dataclasses
import re

from egress.errors import Problem
from egress.model import (
    DEFAULT_ACTIONS,
    DEFAULT_CHECK_PORTS,
    Action,
    CidrRule,
    ConnectSpec,
    DnsRule,
    Mode,
    Policy,
    PortRange,
    Ports,
    ViolationClass,
)
from egress.policy.checks import (
    Report,
    entry,
    get_bool,
    get_choice,
    get_list,
    get_map,
    get_str,
)
from egress.policy.dnsspec import build_dns
from egress.policy.limitsspec import build_limits
from egress.policy.ports import ALL_PORTS, PROTOCOLS, build_ports, for_proto, port_list
from egress.policy.tree import Map, Node, Scalar, Seq
from egress.policy.tunnelspec import TUNNEL_KEYS as TUNNEL_KEYS  # the vocabulary, in one place
from egress.policy.tunnelspec import build_tunnel
from egress.policy.values import parse_cidr

API_VERSION = "egress/v1"
KIND = "Policy"
TOP_KEYS = ("apiVersion", "kind", "metadata", "spec")
METADATA_KEYS = ("name", "annotations")
MAX_ANNOTATION = 4096  # characters of one annotation's value
SPEC_KEYS = ("mode", "dns", "connect", "tunnel", "violations", "limits")
CONNECT_KEYS = ("ports", "allow", "check_names")
CIDR_RULE_KEYS = ("cidr", "ports", "proto")
VIOLATION_KEYS = tuple(cls.value for cls in ViolationClass)
ACTIONS = tuple(action.value for action in Action)
MODES = tuple(mode.value for mode in Mode)
DEFAULT_CONNECT_PORTS = Ports(tcp=(PortRange(80, 80), PortRange(443, 443)))

POLICY_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")  # metadata.name
_ANNOTATION_KEY = re.compile(
    r"(?:[A-Za-z0-9][-A-Za-z0-9_.]{0,252}/)?[A-Za-z0-9][-A-Za-z0-9_.]{0,62}"
)


def build_policy(root: Node, source: str) -> tuple[Policy | None, list[Problem]]:
    """The Policy in ``root`` (None if any error) and every problem found, in file order."""
    report = Report()
    top = get_map(root, "policy", report, TOP_KEYS, required=TOP_KEYS)
    _expect(top, "apiVersion", API_VERSION, report)
    _expect(top, "kind", KIND, report)
    name = _metadata_name(entry(top, "metadata"), report)
    policy = _spec(entry(top, "spec"), name, source, report)
    policy = dataclasses.replace(policy, annotations=_annotations(entry(top, "metadata"), report))
    return (None if report.has_errors else policy), report.sorted()


def _annotations(metadata: Node | None, report: Report) -> tuple[tuple[str, str], ...]:
    node = entry(metadata, "annotations") if isinstance(metadata, Map) else None
    if node is None:
        return ()
    if not isinstance(node, Map):
        report.error(node.where, "metadata.annotations: expected a mapping of strings")
        return ()
    out = []
    for key, (key_node, value) in node.entries.items():
        text = get_str(value, f"metadata.annotations.{key}", report)
        if text is None:
            continue
        if not _ANNOTATION_KEY.fullmatch(key):
            report.error(key_node.where, f"metadata.annotations: key {key!r}: use letters,"
                         " digits, '-', '_', '.' and one '/' (example.com/note)")  # fmt: skip
        elif len(text) > MAX_ANNOTATION:
            report.error(value.where, f"metadata.annotations.{key}: longer than"
                         f" {MAX_ANNOTATION} characters")  # fmt: skip
        else:
            out.append((key, text))
    return tuple(out)


def _expect(top: Map | None, key: str, wanted: str, report: Report) -> None:
    node = entry(top, key)
    if node is None:
        return
    text = get_str(node, key, report)
    if text is not None and text != wanted:
        report.error(node.where, f"{key}: expected {wanted!r}, got {text!r}")


def _metadata_name(node: Node | None, report: Report) -> str:
    if node is None:
        return ""
    metadata = get_map(node, "metadata", report, METADATA_KEYS, required=("name",))
    name_node = entry(metadata, "name")
    text = get_str(name_node, "metadata.name", report) if name_node else None
    if name_node is None or text is None:
        return ""
    if POLICY_NAME.fullmatch(text) is None:
        report.error(
            name_node.where,
            f"metadata.name {text!r}: use 1-63 lowercase letters, digits and '-', "
            "starting and ending with a letter or digit",
        )
    return text


def _spec(node: Node | None, name: str, source: str, report: Report) -> Policy:
    spec = get_map(node, "spec", report, SPEC_KEYS, required=("dns",)) if node else None
    connect = _connect(entry(spec, "connect"), report)
    dns = build_dns(entry(spec, "dns"), report, connect.ports)
    _no_quic_checks(dns.allow, connect, report)
    mode_node = entry(spec, "mode")
    mode = get_choice(mode_node, "spec.mode", report, MODES) if mode_node else None
    return Policy(
        name=name,
        source=source,
        mode=Mode(mode or "enforce"),
        dns=dns,
        connect=connect,
        tunnel=build_tunnel(entry(spec, "tunnel"), report),
        violations=_violations(entry(spec, "violations"), report),
        limits=build_limits(entry(spec, "limits"), report),
    )


def _connect(node: Node | None, report: Report) -> ConnectSpec:
    if node is None:
        return ConnectSpec(ports=DEFAULT_CONNECT_PORTS, allow=())
    connect = get_map(node, "spec.connect", report, CONNECT_KEYS)
    ports_node = entry(connect, "ports")
    ports = (
        build_ports(
            ports_node,
            "spec.connect.ports",
            report,
            ranges=False,
            empty="addresses of rules without ports of their own cannot be reached",
        )
        if ports_node
        else DEFAULT_CONNECT_PORTS
    )
    allow_node = entry(connect, "allow")
    items = get_list(allow_node, "spec.connect.allow", report, "CIDR rules") if allow_node else []
    rules = (_cidr_rule(i, item, report) for i, item in enumerate(items or ()))
    check_node = entry(connect, "check_names")
    return ConnectSpec(
        ports=ports,
        allow=tuple(r for r in rules if r is not None),
        check_names=_check_ports(check_node, report) if check_node else DEFAULT_CHECK_PORTS,
    )


def _check_ports(node: Node, report: Report) -> tuple[int, ...]:
    """``connect.check_names``: TCP ports (single ones), or true/false for the default
    or none."""
    path = "spec.connect.check_names"
    if isinstance(node, Scalar) and isinstance(node.value, bool):
        return DEFAULT_CHECK_PORTS if node.value else ()
    if not isinstance(node, Seq):
        get_bool(node, path, report)  # the error says what was expected
        return DEFAULT_CHECK_PORTS
    return tuple(r.first for r in port_list(node, path, report, ranges=False))


def _no_quic_checks(rules: tuple[DnsRule, ...], connect: ConnectSpec, report: Report) -> None:
    """A checked rule may not open UDP on a checked port: that is QUIC (HTTP/3), whose
    Initial packet's SNI egress does not read yet, so the flow could not be bound to its
    name. Clients fall back to TCP when UDP 443 is blocked."""
    checked = set(connect.check_names)
    for rule in rules:
        quic = [r.first for r in rule.ports.udp if rule.check_names and checked & _span(r)]
        for port in quic:
            report.error(
                rule.where,
                f"spec.dns.allow[{rule.index}] {rule.pattern.text}: udp {port} (QUIC) can't be "
                f"name-checked yet; leave it out (clients fall back to TCP), or set "
                f"check_names: false on this rule to reach its addresses unchecked",
            )


def _span(r: PortRange) -> set[int]:
    return set(range(r.first, r.last + 1))


def _cidr_rule(index: int, node: Node, report: Report) -> CidrRule | None:
    path = f"spec.connect.allow[{index}]"
    rule = get_map(node, path, report, CIDR_RULE_KEYS, required=("cidr",))
    cidr_node, ports_node, proto_node = (entry(rule, key) for key in CIDR_RULE_KEYS)
    proto = get_choice(proto_node, f"{path}.proto", report, PROTOCOLS) if proto_node else "tcp"
    if proto_node and isinstance(ports_node, Map):
        report.error(proto_node.where, f"{path}.proto: leave it out when ports name tcp/udp")
    ports = (
        build_ports(ports_node, f"{path}.ports", report, ranges=True, proto=proto or "tcp")
        if ports_node
        else for_proto(proto or "tcp", ALL_PORTS)
    )
    text = get_str(cidr_node, f"{path}.cidr", report) if cidr_node else None
    if cidr_node is None or text is None:
        return None
    try:
        network = parse_cidr(text)
    except ValueError as exc:
        report.error(cidr_node.where, f"{path}.cidr: {exc}")
        return None
    if network.prefixlen == 0:
        report.warn(
            cidr_node.where, f"{path}.cidr: {network} is every IPv{network.version} address"
        )
    return CidrRule(index=index, network=network, ports=ports, where=node.where)


def _violations(node: Node | None, report: Report) -> dict[ViolationClass, Action]:
    actions = dict(DEFAULT_ACTIONS)
    violations = get_map(node, "spec.violations", report, VIOLATION_KEYS) if node else None
    for key, (_, value) in violations.entries.items() if violations else ():
        if key not in VIOLATION_KEYS:
            continue  # already reported as an unknown key
        action = get_choice(value, f"spec.violations.{key}", report, ACTIONS)
        if action is not None:
            actions[ViolationClass(key)] = Action(action)
    return actions
