"""An egress policy as one CiliumNetworkPolicy (or CiliumClusterwideNetworkPolicy).

    DNS rule   toEndpoints kube-dns (or the selector import kept), port 53, rules.dns:
               exactly the names egress answers (or "*" where the imported policy had it)
    per port set  toFQDNs: the rules' names, toPorts: those ports; on connect.check_names'
               ports serverNames (TLS) or, on 80 and 8080, HTTP host rules: the names
    per static destination  toCIDR with its ports (ranges as port/endPort)

What Cilium has no words for is said in a comment at the top: record types (Cilium lets
an allowed name be asked for any type), tunnel scoring, rebinding, TTL bounds, the rate
limit, what a violation does. ``mode: audit`` is refused: Cilium's audit mode is per
endpoint, not per policy.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from egress.convert.cilium_names import host_regex, to_cilium
from egress.model import CidrRule, DnsRule, Mode, Policy, PortRange, Ports
from egress.resolver.answer import learned_ports

CNP = "CiliumNetworkPolicy"
CCNP = "CiliumClusterwideNetworkPolicy"
KINDS = (CNP, CCNP)
SELECTOR_NOTE = "cilium.io/endpointSelector"  # annotations import keeps, export reads
NAMESPACE_NOTE = "cilium.io/namespace"
DNS_TO_NOTE = "cilium.io/dnsRuleTo"  # the DNS rule's destination (JSON of its L3 keys)
DNS_ALL_NOTE = "cilium.io/dnsMatchesAll"  # "true": its rules.dns was matchPattern "*"
KUBE_DNS = {
    "toEndpoints": [
        {"matchLabels": {"k8s:io.kubernetes.pod.namespace": "kube-system",
                         "k8s:k8s-app": "kube-dns"}}
    ]
}  # fmt: skip
DNS_TO_KEYS = ("toEndpoints", "toServices", "toEntities", "toCIDR", "toCIDRSet")
HTTP_PORTS = frozenset({80, 8080})  # checked ports exported as HTTP host rules, not SNI
ALL = (PortRange(1, 65535),)


class ExportError(ValueError):
    """Cilium cannot say what this policy says."""


def write(policy: Policy, kind: str = CNP, selector: dict[str, Any] | None = None,
          namespace: str | None = None) -> str:  # fmt: skip
    if policy.mode is Mode.AUDIT:
        raise ExportError(
            f"{policy.source}: mode: audit: Cilium's audit mode is set per endpoint"
            " (PolicyAuditMode), not per policy; export the policy in mode: enforce"
        )
    notes = dict(policy.annotations)
    if selector is None:
        selector = _note(policy, SELECTOR_NOTE, "{}")
    metadata: dict[str, Any] = {"name": policy.name}
    namespace = namespace or notes.get(NAMESPACE_NOTE)
    if namespace and kind == CNP:
        metadata["namespace"] = namespace
    doc = {
        "apiVersion": "cilium.io/v2",
        "kind": kind,
        "metadata": metadata,
        "spec": {"endpointSelector": selector, "egress": egress_rules(policy)},
    }
    body = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=100)
    return _header(policy) + body


def egress_rules(policy: Policy) -> list[dict[str, Any]]:
    notes = dict(policy.annotations)
    rules: list[dict[str, Any]] = []
    dns = [_selector(r) for r in policy.dns.allow]
    if notes.get(DNS_ALL_NOTE) == "true":
        dns = [{"matchPattern": "*"}]
    if dns:
        to = _note(policy, DNS_TO_NOTE, None) if DNS_TO_NOTE in notes else KUBE_DNS
        wrong = sorted(set(to) - set(DNS_TO_KEYS))
        if wrong:
            raise ExportError(f"{policy.source}: metadata.annotations.{DNS_TO_NOTE}: not a"
                              f" DNS server's destination: {', '.join(wrong)}")  # fmt: skip
        port53 = {"ports": [{"port": "53", "protocol": "ANY"}], "rules": {"dns": dns}}
        rules.append({**to, "toPorts": [port53]})
    groups: dict[tuple[Any, ...], list[DnsRule]] = {}
    for rule in policy.dns.allow:
        ports = learned_ports(rule, policy)
        if ports.is_empty():
            continue  # answered, never connected to: in the DNS rule only
        checked = _checked(rule, ports, policy)
        groups.setdefault((ports.tcp, ports.udp, checked), []).append(rule)
    for (tcp, udp, checked), members in groups.items():
        rules.append(_fqdn_rule(members, Ports(tcp, udp), checked))
    rules.extend(_cidr_rule(r) for r in policy.connect.allow)
    return rules


def _note(policy: Policy, key: str, default: str | None) -> dict[str, Any]:
    """An annotation import kept: a JSON object, or ExportError saying where it is."""
    text = dict(policy.annotations).get(key, default)
    try:
        value = json.loads(text or "")
    except json.JSONDecodeError as exc:
        raise ExportError(
            f"{policy.source}: metadata.annotations.{key}: not JSON ({exc})"
        ) from None
    if not isinstance(value, dict):
        raise ExportError(f"{policy.source}: metadata.annotations.{key}: expected a JSON object")
    return value


def _selector(rule: DnsRule) -> dict[str, str]:
    key, text = to_cilium(rule.pattern)
    return {key: text}


def _checked(rule: DnsRule, ports: Ports, policy: Policy) -> tuple[int, ...]:
    if not rule.check_names:
        return ()
    checks = set(policy.connect.check_names)
    return tuple(p for r in ports.tcp for p in range(r.first, r.last + 1) if p in checks)


def _fqdn_rule(members: list[DnsRule], ports: Ports, checked: tuple[int, ...]) -> dict[str, Any]:
    to_ports: list[dict[str, Any]] = []
    plain_tcp = [r for r in ports.tcp if not (r.first == r.last and r.first in checked)]
    entries = _port_entries(tuple(plain_tcp), "TCP") + _port_entries(ports.udp, "UDP")
    if entries:
        to_ports.append({"ports": entries})
    for port in checked:
        entry: dict[str, Any] = {"ports": [{"port": str(port), "protocol": "TCP"}]}
        if port in HTTP_PORTS:
            entry["rules"] = {"http": [{"host": host_regex(m.pattern)} for m in members]}
        else:
            entry["serverNames"] = [to_cilium(m.pattern)[1] for m in members]
        to_ports.append(entry)
    return {"toFQDNs": [_selector(m) for m in members], "toPorts": to_ports}


def _port_entries(ranges: tuple[PortRange, ...], protocol: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for r in ranges:
        entry: dict[str, Any] = {"port": str(r.first), "protocol": protocol}
        if r.last != r.first:
            entry["endPort"] = r.last
        out.append(entry)
    return out


def _cidr_rule(rule: CidrRule) -> dict[str, Any]:
    # Every port is written as the ranges: a bare toCIDR would allow every protocol.
    entries = _port_entries(rule.ports.tcp, "TCP") + _port_entries(rule.ports.udp, "UDP")
    return {"toCIDR": [str(rule.network)], "toPorts": [{"ports": entries}]}


def _header(policy: Policy) -> str:
    types = ", ".join(sorted(_type_names(policy)))
    lines = [
        f"# Exported by `egressctl export cilium` from {policy.source} (policy {policy.name}).",
        "# Cilium does not enforce these parts of it:",
        f"#   record types ({types}): Cilium lets an allowed name be asked for any type;",
        "#   tunnel scoring, rebinding protection, TTL bounds and the rate limit;",
        "#   what a violation does (egress freezes the sandbox; Cilium drops the packet);",
        "#   serverNames and HTTP host rules check the names listed, not which name's",
        "#   answer gave the address (egress binds a flow to that name).",
    ]
    if policy.limits.explicit:  # a pod's are its spec's resources, not a network policy's
        lines.append("#   spec.limits (set the pod's resources.limits and its pids limit instead).")
    return "\n".join(lines) + "\n"


def _type_names(policy: Policy) -> set[str]:
    from egress.policy.rrtypes import type_name

    return {type_name(t) for r in policy.dns.allow for t in r.types} or {"none"}
