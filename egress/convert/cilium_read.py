"""CiliumNetworkPolicy and CiliumClusterwideNetworkPolicy documents as egress policies.

Each document becomes one egress policy; each egress rule of it converts exactly, or
the document is refused with ``FILE:LINE:COL`` and the reason (every problem at once):

- ``toFQDNs`` (``matchName``, ``matchPattern``: cilium_names) with its ``toPorts``
  becomes ``dns.allow`` entries with those ports (a range up to ``MAX_EXPANDED`` ports
  is written out: egress matches a learned address one port at a time). Without
  ``toPorts`` Cilium allows every port: refused.
- A rule whose ``toPorts`` has ``rules.dns`` is the DNS rule: egress's own resolver is
  its destination. Its names may be asked; those no ``toFQDNs`` names are answered but
  given no port. ``matchPattern: "*"`` (Cilium answers every name and only toFQDNs
  addresses are reached) becomes egress's rule: only the toFQDNs names are answered,
  a narrowing kept in an annotation so that export gives the "*" back. A toFQDNs name
  no DNS rule lets be asked is refused (Cilium would never learn its address).
- ``serverNames`` (TLS SNI) and ``rules.http`` with only ``host`` become
  connect.check_names on those ports, for names among the rule's own.
- ``toCIDR``/``toCIDRSet`` become ``connect.allow`` (``except`` and CIDR groups refused).
- Cilium ignores the record type; egress needs one: ``types`` (default A, AAAA, CNAME,
  HTTPS) goes into ``dns.types``.
- Refused: ``egressDeny``, in-cluster destinations (toEndpoints, toEntities, toServices,
  toGroups, toNodes, toRequires) outside the DNS rule, ``toPorts`` with no destination,
  named ports, SCTP, other L7 rules. ``ingress`` is not converted (egress controls
  outbound traffic only) and is said so in the output.

The endpoint selector, namespace and DNS rule destination are kept in
``metadata.annotations``; egress enforces none of them, export reads them back.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from typing import Any

import yaml

from egress.convert.cilium_names import (
    MATCH_NAME,
    MATCH_PATTERN,
    from_host_regex,
    to_egress,
)
from egress.convert.cilium_write import (
    DNS_ALL_NOTE,
    DNS_TO_NOTE,
    KINDS,
    NAMESPACE_NOTE,
    SELECTOR_NOTE,
)
from egress.errors import Location, PolicyError, Problem
from egress.policy.loader import parse_policy
from egress.policy.tree import Map, Node, Scalar, Seq, compose_all
from egress.policy.validate import POLICY_NAME as EGRESS_NAME

DEFAULT_TYPES = ("A", "AAAA", "CNAME", "HTTPS")
MAX_EXPANDED = 64
L3_KEYS = ("toEndpoints", "toEntities", "toServices", "toGroups", "toNodes", "toRequires")
RULE_KEYS = ("toFQDNs", "toPorts", "toCIDR", "toCIDRSet", *L3_KEYS)
ENTRY_KEYS = ("ports", "rules", "serverNames")  # of a toPorts entry
SELECTOR_KEYS = ("endpointSelector", "nodeSelector")


@dataclass(frozen=True)
class Converted:
    name: str
    text: str  # the egress policy (validated)
    source: Location  # where its document starts


@dataclass
class _Name:
    tcp: set[int] = field(default_factory=set)
    udp: set[int] = field(default_factory=set)
    checked: set[int] = field(default_factory=set)  # TCP ports with serverNames/host rules
    where: Location | None = None


@dataclass
class _Doc:
    source: str
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    names: dict[str, _Name] = field(default_factory=dict)  # toFQDNs, in order
    askable: list[tuple[str, Location]] = field(default_factory=list)  # rules.dns
    ask_all: bool = False
    dns_rule: bool = False
    dns_to: dict[str, Any] | None = None
    statics: list[dict[str, Any]] = field(default_factory=list)
    selector: Any = None

    def refuse(self, node: Node | None, message: str) -> None:
        where = node.where if node is not None else Location(self.source, 1, 1)
        self.problems.append(Problem(where, message))


def read(
    text: str, source: str, types: tuple[str, ...] = DEFAULT_TYPES, name: str | None = None
) -> list[Converted]:
    """Every Cilium policy in ``text``; PolicyError with every problem if any is refused."""
    roots, problems = compose_all(text, source)
    docs = [r for r in roots if not (isinstance(r, Scalar) and r.value is None)]
    if name is not None and len(docs) != 1:
        problems.append(
            Problem(Location(source, 1, 1), f"--name names one policy; {source} holds {len(docs)}")
        )
    out: list[Converted] = []
    for root in docs:
        doc = _Doc(source)
        converted = _document(root, doc, types, name)
        problems.extend(doc.problems)
        if converted is not None and any(c.name == converted.name for c in out):
            first = next(c for c in out if c.name == converted.name).source
            problems.append(Problem(converted.source, f"a second policy named"
                                    f" {converted.name!r} (the first at {first})"))  # fmt: skip
        elif converted is not None and not doc.problems:
            out.append(converted)
    if problems:
        raise PolicyError(sorted(problems, key=lambda p: (p.where.line, p.where.col)))
    if not out:
        raise PolicyError([Problem(Location(source, 1, 1), "no Cilium policy in this file")])
    return out


# -- documents ---------------------------------------------------------------------------


def _document(
    root: Node, doc: _Doc, types: tuple[str, ...], rename: str | None
) -> Converted | None:
    if not isinstance(root, Map):
        doc.refuse(root, "expected a Cilium policy (a mapping with apiVersion, kind, ...)")
        return None
    kind = _text(root, "kind")
    if kind not in KINDS:
        where = _at(root, "kind")
        doc.refuse(where, f"kind {kind!r} is not a Cilium policy: expected {' or '.join(KINDS)}")
        return None
    api = _text(root, "apiVersion")
    if api != "cilium.io/v2":
        doc.refuse(_at(root, "apiVersion"), f"apiVersion {api!r}: expected 'cilium.io/v2'")
    meta = _get(root, "metadata")
    name = rename or (_text(meta, "name") if isinstance(meta, Map) else None)
    if not name or not EGRESS_NAME.fullmatch(name):
        doc.refuse(
            _at(meta, "name") if isinstance(meta, Map) else root,
            f"metadata.name {name!r} is no egress policy name (1-63 lowercase letters,"
            " digits and '-'): pass --name",
        )
        return None
    namespace = _text(meta, "namespace") if isinstance(meta, Map) else None
    rules = _rules(root, doc)
    for rule in rules:
        _rule(rule, doc)
    _check_askable(doc)
    if doc.problems:
        return None
    notes = {SELECTOR_NOTE: json.dumps(doc.selector or {}, sort_keys=True)}
    if namespace:
        notes[NAMESPACE_NOTE] = namespace
    if doc.dns_to is not None:
        notes[DNS_TO_NOTE] = json.dumps(doc.dns_to, sort_keys=True)
    if doc.ask_all:
        notes[DNS_ALL_NOTE] = "true"
    text = _egress_text(name, doc, types, notes, kind or "")
    parse_policy(text, f"{doc.source} ({name})")  # a converter bug raises here
    return Converted(name, text, root.where)


def _rules(root: Map, doc: _Doc) -> list[Map]:
    rules: list[Map] = []
    spec = _get(root, "spec")
    if isinstance(spec, Map):
        rules.append(spec)
    specs = _get(root, "specs")
    if isinstance(specs, Seq):
        rules.extend(r for r in specs.items if isinstance(r, Map))
    if spec is None and specs is None:
        doc.refuse(root, "neither spec nor specs: no rules to convert")
    for rule in rules:
        selector: Any = next(
            (_plain(_get(rule, k)) for k in SELECTOR_KEYS if _get(rule, k) is not None), {}
        )
        if doc.selector is None:
            doc.selector = selector
        elif selector != doc.selector:
            doc.refuse(
                rule,
                "these rules select different endpoints; an egress policy"
                " applies to one sandbox: put them in separate documents",
            )
        for key in ("ingress", "ingressDeny"):
            found = _get(rule, key)
            if found is not None:
                doc.notes.append(
                    f"{key} at {found.where} is not converted:"
                    " egress controls outbound traffic only"
                )
        if _get(rule, "egressDeny") is not None:
            doc.refuse(
                _get(rule, "egressDeny"),
                "egressDeny has no egress equivalent (egress"
                " denies whatever no rule allows): remove the allow rules it carves from",
            )
    return rules


def _rule(rule: Map, doc: _Doc) -> None:
    egress = _get(rule, "egress")
    if egress is None:
        return
    if not isinstance(egress, Seq):
        doc.refuse(egress, "egress: expected a list of rules")
        return
    for item in egress.items:
        if isinstance(item, Map):
            _egress_rule(item, doc)
        else:
            doc.refuse(item, "egress rule: expected a mapping")


def _egress_rule(r: Map, doc: _Doc) -> None:
    for key, (key_node, _) in r.entries.items():
        if key not in RULE_KEYS:
            doc.refuse(key_node, f"egress rule key {key!r} is not one egress converts")
    to_ports = _get(r, "toPorts")
    entries = _entries(to_ports, doc)
    if any(_dns_rules(e) is not None for e in entries):
        _dns_rule(r, entries, doc)
        return
    for key in L3_KEYS:
        if _get(r, key) is not None:
            doc.refuse(
                _get(r, key),
                f"{key}: egress has no in-cluster destinations; name them"
                " by address (toCIDR) or by DNS name (toFQDNs)",
            )
    fqdns, cidrs = _get(r, "toFQDNs"), [_get(r, "toCIDR"), _get(r, "toCIDRSet")]
    if fqdns is not None:
        _fqdn_rule(r, fqdns, entries, doc)
    elif any(c is not None for c in cidrs):
        _cidr_rule(r, entries, doc)
    elif to_ports is not None:
        doc.refuse(
            to_ports,
            "toPorts with no destination allows every address on those"
            " ports; egress needs the destinations (toFQDNs or toCIDR)",
        )


def _entries(to_ports: Node | None, doc: _Doc) -> list[Map]:
    """toPorts' entries, each refused unless it is ``{ports, rules, serverNames}``: a key
    egress does not read (listener, terminatingTLS, ...) would change what Cilium allows."""
    if to_ports is None:
        return []
    if not isinstance(to_ports, Seq):
        doc.refuse(to_ports, "toPorts: expected a list of {ports: [...]} entries")
        return []
    out = []
    for entry in to_ports.items:
        if not isinstance(entry, Map):
            doc.refuse(entry, "toPorts entry: expected {ports: [...], ...}")
            continue
        for key, (key_node, _) in entry.entries.items():
            if key not in ENTRY_KEYS:
                doc.refuse(key_node, f"toPorts {key!r} has no egress equivalent")
        out.append(entry)
    return out


# -- the DNS rule ------------------------------------------------------------------------


def _dns_rules(entry: Map) -> Seq | None:
    rules = _get(entry, "rules")
    dns = _get(rules, "dns") if isinstance(rules, Map) else None
    return dns if isinstance(dns, Seq) else None


def _dns_rule(r: Map, entries: list[Map], doc: _Doc) -> None:
    doc.dns_rule = True
    to = {
        k: _plain(_get(r, k))
        for k in ("toEndpoints", "toServices", "toEntities", "toCIDR", "toCIDRSet")
        if _get(r, k) is not None
    }
    if doc.dns_to is None and to:
        doc.dns_to = to
    if _get(r, "toFQDNs") is not None:
        doc.refuse(_get(r, "toFQDNs"), "toFQDNs in the DNS rule: put them in a rule of their own")
    for entry in entries:
        dns = _dns_rules(entry)
        for item in dns.items if dns is not None else ():
            key, node = _selector_of(item, doc)
            if node is None:
                continue
            text = str(getattr(node, "text", ""))
            if key == MATCH_PATTERN and text.strip().rstrip(".") in ("*", "**"):
                doc.ask_all = True
                continue
            try:
                doc.askable.append((to_egress(key, text), node.where))
            except ValueError as exc:
                doc.refuse(node, f"rules.dns: {exc}")


def _check_askable(doc: _Doc) -> None:
    from egress.policy.names import parse_pattern

    if not doc.dns_rule and doc.names:
        doc.notes.append(
            "no rule here lets DNS be asked (toPorts 53 with rules.dns); Cilium"
            " learns toFQDNs addresses only through one: assumed to be in"
            " another policy that selects the same endpoints"
        )
        return
    if doc.ask_all:
        doc.notes.append(
            "the DNS rule's matchPattern '*' let every name be asked; egress"
            " answers only the names below (kept in an annotation for export)"
        )
        return
    patterns = [parse_pattern(p)[0] for p, _ in doc.askable]
    for name, seen in doc.names.items():
        if not any(_covers(p, parse_pattern(name)[0]) for p in patterns):
            doc.problems.append(
                Problem(
                    seen.where or Location(doc.source),
                    f"toFQDNs {name!r}: no rules.dns pattern lets it be asked, so Cilium never"
                    " learns its address; add it to the DNS rule or remove it",
                )
            )


def _covers(wide: Any, narrow: Any) -> bool:
    """Every name ``narrow`` matches, ``wide`` matches (egress NamePatterns)."""
    from egress.model import PatternKind as K

    if wide.kind is K.EXACT:
        return narrow.kind is K.EXACT and narrow.suffix == wide.suffix
    depth = narrow.suffix.count(".") - wide.suffix.count(".")
    under = narrow.suffix.endswith("." + wide.suffix) or narrow.suffix == wide.suffix
    if not under:
        return False
    if wide.kind is K.ONE:
        return (narrow.kind is K.EXACT and depth == 1) or (narrow.kind is K.ONE and depth == 0)
    return (narrow.kind is K.EXACT and depth >= 1) or (narrow.kind is not K.EXACT and depth >= 0)


# -- toFQDNs -----------------------------------------------------------------------------


def _selector_of(item: Node, doc: _Doc) -> tuple[str, Node | None]:
    if not isinstance(item, Map):
        doc.refuse(item, "expected {matchName: ...} or {matchPattern: ...}")
        return "", None
    keys = [k for k in (MATCH_NAME, MATCH_PATTERN) if _get(item, k) is not None]
    extra = [k for k in item.entries if k not in (MATCH_NAME, MATCH_PATTERN)]
    if len(keys) != 1 or extra:
        doc.refuse(item, "a name selector has exactly one of matchName or matchPattern")
        return "", None
    return keys[0], _get(item, keys[0])


def _fqdn_rule(r: Map, fqdns: Node, entries: list[Map], doc: _Doc) -> None:
    if any(_get(r, k) is not None for k in ("toCIDR", "toCIDRSet")):
        doc.refuse(r, "toFQDNs with toCIDR in one rule: Cilium refuses it; egress too")
    if not isinstance(fqdns, Seq):
        doc.refuse(fqdns, "toFQDNs: expected a list")
        return
    names: list[tuple[str, Node]] = []
    for item in fqdns.items:
        key, node = _selector_of(item, doc)
        if node is None:
            continue
        try:
            names.append((to_egress(key, str(getattr(node, "text", ""))), node))
        except ValueError as exc:
            doc.refuse(node, f"toFQDNs: {exc}")
    if not entries:
        doc.refuse(
            r,
            "toFQDNs without toPorts allows every port and protocol; egress needs"
            " the ports: add toPorts",
        )
        return
    for entry in entries:
        tcp, udp = _ports(entry, doc, ranges=False)
        checked = _checks(entry, [n for n, _ in names], doc)
        if checked and not tcp:
            doc.refuse(entry, "serverNames or HTTP rules need TCP ports")
        for name, node in names:
            seen = doc.names.setdefault(name, _Name(where=node.where))
            seen.tcp |= {p for p, _ in tcp}
            seen.udp |= {p for p, _ in udp}
            if checked:
                seen.checked |= {p for p, _ in tcp}


def _checks(entry: Map, names: list[str], doc: _Doc) -> bool:
    """Does this toPorts entry bind flows to names (serverNames, or HTTP host rules)?"""
    server = _get(entry, "serverNames")
    rules = _get(entry, "rules")
    listed: list[tuple[str, Node]] = []
    if isinstance(server, Seq):
        for item in server.items:
            text = str(getattr(item, "text", "")).strip().lower().rstrip(".")
            if (
                text.startswith(("*.", "**.")) and "*" not in text.split(".", 1)[1]
            ) or "*" not in text:
                listed.append((text, item))
            else:
                doc.refuse(
                    item, f"serverNames {text!r}: only whole leftmost '*.'/'**.' labels convert"
                )
    if isinstance(rules, Map):
        for key, (key_node, value) in rules.entries.items():
            if key == "dns":
                continue
            if key != "http" or not isinstance(value, Seq):
                doc.refuse(
                    key_node,
                    f"rules.{key}: egress reads a flow's first request for its"
                    " name only; other L7 rules have no equivalent",
                )
                continue
            for item in value.items:
                host = _get(item, "host") if isinstance(item, Map) else None
                if not isinstance(item, Map) or host is None or len(item.entries) != 1:
                    doc.refuse(
                        item,
                        "rules.http: only {host: ...} converts (egress checks the"
                        " Host, not methods, paths or headers)",
                    )
                    continue
                try:
                    listed.append((from_host_regex(str(getattr(host, "text", ""))), host))
                except ValueError as exc:
                    doc.refuse(host, f"rules.http: {exc}")
    missing = [n for n in names if listed and n not in {t for t, _ in listed}]
    if missing:
        doc.refuse(
            server or rules,
            f"serverNames/HTTP hosts leave out {', '.join(missing)}: Cilium refuses those"
            " names there, egress would check them as allowed; list every toFQDNs name of"
            " the rule, or give the others a rule of their own",
        )
    for text, node in listed:
        if text not in names:
            doc.refuse(
                node,
                f"{text!r} is not one of this rule's toFQDNs names: egress binds"
                " a flow's name to the names whose answers gave its address",
            )
    return bool(listed)


def _ports(
    entry: Map, doc: _Doc, ranges: bool
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(tcp, udp) as (first, last) ranges; a range is expanded unless ``ranges``."""
    tcp: list[tuple[int, int]] = []
    udp: list[tuple[int, int]] = []
    ports = _get(entry, "ports")
    if not isinstance(ports, Seq):
        if ports is not None or not ranges:
            doc.refuse(entry, "toPorts entry: expected ports: [{port: ..., protocol: ...}]")
        return [(1, 65535)], [(1, 65535)]
    for item in ports.items:
        if not isinstance(item, Map):
            doc.refuse(item, "expected {port: ..., protocol: ...}")
            continue
        port_node, end_node = _get(item, "port"), _get(item, "endPort")
        text = str(getattr(port_node, "text", "")) if port_node is not None else ""
        if not _digits(text) or not 0 <= int(text) <= 65535:
            doc.refuse(
                port_node or item,
                f"port {text!r}: named ports have no egress equivalent (write the number)",
            )
            continue
        first = int(text)
        end = str(getattr(end_node, "text", first)) if end_node is not None else str(first)
        if not _digits(end) or int(end) > 65535:
            doc.refuse(end_node, f"endPort {end!r}: expected a port number up to 65535")
            continue
        last = int(end)
        if first == 0:
            first, last = 1, 65535  # Cilium's 0: every port
        if last < first:
            doc.refuse(end_node or item, f"endPort {last} is below port {first}")
            continue
        if not ranges and last - first + 1 > MAX_EXPANDED:
            doc.refuse(
                end_node or item,
                f"ports {first}-{last}: a toFQDNs rule takes single"
                f" ports in egress (at most {MAX_EXPANDED} written out)",
            )
            continue
        spans = [(first, last)] if ranges else [(p, p) for p in range(first, last + 1)]
        proto = str(getattr(_get(item, "protocol"), "text", "ANY") or "ANY").upper()
        if proto not in ("TCP", "UDP", "ANY"):
            doc.refuse(
                _get(item, "protocol") or item, f"protocol {proto}: egress allows TCP and UDP"
            )
            continue
        if proto in ("TCP", "ANY"):
            tcp.extend(spans)
        if proto in ("UDP", "ANY"):
            udp.extend(spans)
    return tcp, udp


# -- toCIDR ------------------------------------------------------------------------------


def _cidr_rule(r: Map, entries: list[Map], doc: _Doc) -> None:
    cidrs: list[str] = []
    plain = _get(r, "toCIDR")
    if plain is not None and not isinstance(plain, Seq):
        doc.refuse(plain, "toCIDR: expected a list of networks")
    for item in plain.items if isinstance(plain, Seq) else ():
        cidrs.append(_network(item, doc))
    sets = _get(r, "toCIDRSet")
    if isinstance(sets, Seq):
        for item in sets.items:
            if not isinstance(item, Map) or _get(item, "cidr") is None:
                doc.refuse(
                    item,
                    "toCIDRSet: only {cidr: ...} converts (CIDR groups have no egress equivalent)",
                )
                continue
            if _get(item, "except") is not None:
                doc.refuse(
                    _get(item, "except"),
                    "toCIDRSet except: egress has no exceptions; list the networks that remain",
                )
                continue
            cidrs.append(_network(_get(item, "cidr"), doc))
    for entry in entries:
        if _get(entry, "serverNames") is not None or _get(entry, "rules") is not None:
            doc.refuse(
                entry,
                "toCIDR with serverNames or L7 rules: egress checks names only"
                " for DNS-learned addresses",
            )
    port_sets = [_ports(e, doc, ranges=True) for e in entries]
    if not entries and cidrs:
        doc.notes.append(
            f"toCIDR without toPorts at {r.where}: Cilium allows every protocol"
            " there (ICMP too); egress allows TCP and UDP, every port"
        )
    for network in (c for c in cidrs if c):
        if not entries:
            doc.statics.append({"cidr": network, "proto": "any"})
            continue
        for tcp, udp in port_sets:
            for proto, spans in (("tcp", tcp), ("udp", udp)):
                if spans:
                    ports = [f"{a}-{b}" if a != b else str(a) for a, b in spans]
                    doc.statics.append({"cidr": network, "proto": proto, "ports": ports})


def _network(node: Node | None, doc: _Doc) -> str:
    """The network a toCIDR item names, checked here (at its place in the Cilium file);
    a bare address is its /32 or /128. "" when refused."""
    text = node.text if isinstance(node, Scalar) else None
    if text is None:
        doc.refuse(node, "expected a network like 192.0.2.0/24")
        return ""
    try:
        return str(ipaddress.ip_network(text.strip(), strict=True))
    except ValueError as exc:
        doc.refuse(node, f"{text!r} is not a network egress takes: {exc}")
        return ""


# -- output ------------------------------------------------------------------------------


def _egress_text(
    name: str, doc: _Doc, types: tuple[str, ...], notes: dict[str, str], kind: str
) -> str:
    checks = sorted({p for n in doc.names.values() for p in n.checked})
    allow: list[Any] = []
    for pattern, seen in doc.names.items():
        entry: dict[str, Any] = {"name": pattern}
        entry["ports"] = (
            {"tcp": sorted(seen.tcp), "udp": sorted(seen.udp)} if seen.udp else sorted(seen.tcp)
        )
        unchecked = [p for p in checks if p in seen.tcp and p not in seen.checked]
        if unchecked and seen.checked:
            doc.problems.append(
                Problem(
                    seen.where or Location(doc.source),
                    f"toFQDNs {pattern!r}: ports {unchecked} carry no serverNames or HTTP rules"
                    f" while {sorted(seen.checked)} do; egress checks a name on all of"
                    " connect.check_names' ports or on none",
                )
            )
        elif unchecked:
            entry["check_names"] = False
        allow.append(entry)
    asked_only = [p for p, _ in doc.askable if p not in doc.names]
    allow += list(dict.fromkeys(asked_only))
    spec: dict[str, Any] = {
        "mode": "enforce",
        "dns": {"upstreams": ["system"], "types": list(types), "allow": allow},
        "connect": {"ports": [], "check_names": checks or False, "allow": doc.statics},
    }
    if not asked_only:
        del spec["connect"]["ports"]  # every rule has its own
    data = {
        "apiVersion": "egress/v1",
        "kind": "Policy",
        "metadata": {"name": name, "annotations": notes},
        "spec": spec,
    }
    head = [
        f"# Converted by `egressctl import cilium` from {kind} {name} ({doc.source}).",
        f"# Cilium does not filter record types; egress allows {', '.join(types)} (--types).",
        "# Names given no port (asked, never connected to) take connect.ports: none.",
    ]
    head += [f"# Note: {n}" for n in doc.notes]
    body = yaml.safe_dump(data, sort_keys=False, width=100, default_flow_style=None)
    return "\n".join(head) + "\n" + body


# -- tree helpers ------------------------------------------------------------------------


def _get(node: Node | None, key: str) -> Node | None:
    if isinstance(node, Map) and key in node.entries:
        return node.entries[key][1]
    return None


def _at(node: Node | None, key: str) -> Node | None:
    found = _get(node, key)
    return found if found is not None else node


def _text(node: Node | None, key: str) -> str | None:
    found = _get(node, key)
    return found.text if isinstance(found, Scalar) else None


def _plain(node: Node | None) -> Any:
    if isinstance(node, Map):
        return {k: _plain(v) for k, (_, v) in node.entries.items()}
    if isinstance(node, Seq):
        return [_plain(i) for i in node.items]
    return node.value if isinstance(node, Scalar) else None


def _digits(text: str) -> bool:
    """A port number's digits: ASCII (``int`` takes others, or raises on '²'), at most
    five (past 4,300 digits ``int`` raises)."""
    return len(text) <= 5 and text.isascii() and text.isdigit()
