"""A Draft as policy text, every entry with its evidence in a comment.

The result is always ``mode: enforce`` and is checked by the policy validator before it
is handed back (a learner that wrote an invalid policy would be a bug, so it raises).
Settings the learner has no opinion on (upstreams, TTL bounds, tunnel limits, violation
actions) come from ``--base`` when given, else the defaults; the base's own rules come
first, unchanged.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from egress.learn.draft import Draft, Rule, Static, span
from egress.policy.loader import parse_policy
from egress.policy.tree import Map, Node, Scalar, Seq

INDENT = "  "


def plain(node: Node) -> Any:
    """A positioned tree as plain data (a base policy's settings, to carry over)."""
    if isinstance(node, Map):
        return {key: plain(value) for key, (_, value) in node.entries.items()}
    if isinstance(node, Seq):
        return [plain(item) for item in node.items]
    assert isinstance(node, Scalar)
    return node.value


def policy_text(draft: Draft, name: str, base: dict[str, Any] | None = None) -> str:
    """The learned policy; raises PolicyError if it would not validate (a bug)."""
    spec = dict((base or {}).get("spec") or {})
    dns = dict(spec.pop("dns", None) or {})
    connect = dict(spec.pop("connect", None) or {})
    spec.pop("mode", None)
    base_rules = list(dns.pop("allow", None) or [])
    base_static = list(connect.pop("allow", None) or [])
    dns.setdefault("upstreams", ["system"])
    # The base's connect.ports stay when its own rules rely on them (a rule with no
    # ports of its own); learned rules without a port then take them too, and say so.
    keep_ports = "ports" in connect and any(
        not isinstance(r, dict) or "ports" not in r for r in base_rules
    )
    if not keep_ports:
        connect.pop("ports", None)
    lines = _header(draft, base is not None)
    lines += ["apiVersion: egress/v1", "kind: Policy", "metadata:", f"  name: {name}", "spec:"]
    lines += ["  mode: enforce", "  dns:"]
    lines += _block(dns, 2)
    lines.append("    allow:")
    if base_rules:
        lines.append("      # from the base policy")
        lines += _block(base_rules, 3)
    for rule in draft.rules:
        lines += _rule(rule, keep_ports)
    if not base_rules and not draft.rules:
        lines[-1] += " []"
    if draft.risks:
        lines.append("      # Risks: never allowed by the learner. Uncomment only after review.")
        by_why: dict[str, list[tuple[str, str]]] = {}
        for what, why, evidence in draft.risks:
            by_why.setdefault(why, []).append((what, evidence))
        for why, items in by_why.items():  # one reason, then the names it covers
            count = f" ({len(items)} names)" if len(items) > 1 else ""
            lines.append(f"      # RISK: {why}{count}")
            lines += [f"      # - {what}  # {evidence}" for what, evidence in items]
    lines.append("  connect:")
    if not keep_ports and any(not (r.tcp or r.udp) for r in draft.rules):
        lines += [
            "    # Each rule above lists the ports its names were connected on;",
            "    # a name asked but never connected to gets none.",
            "    ports: []",
        ]
    lines += _block(connect, 2)
    lines += _statics(draft.statics, base_static)
    lines += _block(spec, 1)
    text = "\n".join(lines) + "\n"
    parse_policy(text, "<learned policy>")  # raises on a learner bug: never write it
    return text


def _header(draft: Draft, based: bool) -> list[str]:
    n = len(draft.sandboxes)
    out = [
        f"# Learned by `egressctl learn` from {n} audit run{'s' if n != 1 else ''}"
        f" ({', '.join(draft.sandboxes)}),",
        f"# {span(draft.first, draft.last)}. Review it before use: every entry",
        "# says what was seen; risks are listed commented out; static destinations are flagged.",
    ]
    if draft.in_base:
        out.append(f"# Already allowed by the base policy: {', '.join(draft.in_base)}.")
    if draft.overflow_names or draft.overflow_connects:
        out.append(
            f"# WARNING: the audit record was full (cap reached): {draft.overflow_names} queries"
            f" and {draft.overflow_connects} connects were not recorded, so this is incomplete."
        )
    if not based:
        out.append("# Settings not learned (upstreams, TTLs, tunnel, violations) are defaults.")
    return out


def _block(data: dict[str, Any] | list[Any], depth: int) -> list[str]:
    if not data:
        return []
    # A list of rules is written one per line (a list of scalars would come out in flow
    # style, and learned rules follow it); nested values stay compact.
    flow = False if isinstance(data, list) and not all(isinstance(i, dict) for i in data) else None
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=flow, width=90)
    return [INDENT * depth + line for line in text.splitlines()]


def _ports(tcp: tuple[int, ...], udp: tuple[int, ...]) -> str:
    if not udp:
        return json.dumps(list(tcp))
    return json.dumps({"tcp": list(tcp), "udp": list(udp)}).replace('"', "")


def _rule(rule: Rule, base_ports: bool = False) -> list[str]:
    out = [f"      # {rule.evidence}"]
    if rule.pattern.startswith("*"):
        under = rule.pattern.split(".", 1)[1]
        out.append(f"      # REVIEW: a pattern: every such name under {under} is allowed, not"
                   " only those seen")  # fmt: skip
    out += [f"      # {note}" for note in rule.notes]
    out.append(f"      - name: {_quote(rule.pattern)}")
    out.append(f"        types: [{', '.join(rule.types)}]")
    if rule.tcp or rule.udp:
        out.append(f"        ports: {_ports(rule.tcp, rule.udp)}")
    elif base_ports:
        out.append("        # never connected to: it takes the base's connect.ports")
    else:
        out.append("        # never connected to: no ports")
    return out


def _quote(text: str) -> str:
    return json.dumps(text) if text.startswith("*") else text


def _statics(statics: tuple[Static, ...], base: list[Any]) -> list[str]:
    if not statics and not base:
        return ["    allow: []"]
    out = ["    allow:"]
    if base:
        out.append("      # from the base policy")
        out += _block(base, 3)
    for s in statics:
        cidr = f"{s.address}/{32 if ':' not in s.address else 128}"
        out.append(f"      # FLAGGED: no DNS answer named {s.address}; {s.evidence}")
        ports = json.dumps(list(s.ports))
        out.append(f"      - {{cidr: {_quote(cidr)}, proto: {s.proto}, ports: {ports}}}")
    return out


def base_settings(tree: Node) -> dict[str, Any]:
    """The plain data of a (validated) base policy's tree, for ``policy_text``."""
    data = plain(tree)
    return data if isinstance(data, dict) else {}
