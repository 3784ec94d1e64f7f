"""JSON Schema (draft 2020-12) of the policy language, for editors and other tools.

It describes structure: keys, types, enumerations and the shape of strings. What a
schema cannot say well (IDNA, CIDR host bits, min <= max, duplicate rules) is left to
the validator, which is the authority; a file that passes ``egressctl validate`` also
passes this schema (a test checks it for every shipped policy).
"""

from __future__ import annotations

from typing import Any

from egress.model import (
    MAX_ZONE_FREE_BYTES,
    MIN_MEMORY,
    Action,
    Limits,
    RateLimit,
    TunnelSpec,
    ViolationClass,
)
from egress.policy.dnsspec import MAX_RATE
from egress.policy.limitsspec import MAX_MEMORY, MAX_PIDS, MIN_PIDS, NO_LIMIT
from egress.policy.tunnelspec import MAX_ZONES

Schema = dict[str, Any]

NAME_PATTERN = r"^(\*\*?\.)?[^*\s]+$"
DURATION_PATTERN = r"^([0-9]+h)?([0-9]+m)?([0-9]+s)?$"
TYPE_PATTERN = r"^([A-Za-z][A-Za-z0-9]*|TYPE[0-9]{1,5})$"


def _obj(
    description: str, properties: dict[str, Schema], required: list[str] | None = None
) -> Schema:
    schema: Schema = {
        "type": "object",
        "description": description,
        "properties": properties,
        "additionalProperties": False,
    }
    if required:
        schema["required"] = required
    return schema


def _defs() -> dict[str, Schema]:
    port = {
        "oneOf": [
            {"type": "integer", "minimum": 1, "maximum": 65535},
            {"type": "string", "pattern": r"^[0-9]{1,5}$"},
        ]
    }
    port_list = {"type": "array", "items": {"$ref": "#/$defs/port"}}
    range_list = {"type": "array", "items": {"$ref": "#/$defs/portOrRange"}}
    return {
        "port": {**port, "description": "A TCP or UDP port, 1-65535."},
        "portOrRange": {
            "description": 'A port, or a range like "8000-8100" (connect.allow only).',
            "anyOf": [port, {"type": "string", "pattern": r"^[0-9]{1,5}-[0-9]{1,5}$"}],
        },
        "portList": {**port_list, "description": "A list of TCP ports."},
        "ports": {
            "description": "A list of ports (TCP), or {tcp: [...], udp: [...]}. Single ports only:"
            " learned addresses are matched one port each.",
            "oneOf": [port_list, _transports(port_list)],
        },
        "portRanges": {
            "description": "A list of ports or ranges (with proto), or {tcp: [...], udp: [...]}.",
            "oneOf": [range_list, _transports(range_list)],
        },
        "recordType": {
            "type": "string",
            "pattern": TYPE_PATTERN,
            "description": "A DNS record type: A, AAAA, CNAME, HTTPS, TXT, ... or TYPE65280.",
        },
        "recordTypes": {"type": "array", "items": {"$ref": "#/$defs/recordType"}},
        "duration": {
            "type": "string",
            "pattern": DURATION_PATTERN,
            "minLength": 2,
            "description": "A duration with a unit: 30s, 5m, 1h, 1h30m.",
        },
        "cidr": {
            "type": "string",
            "description": "An IPv4 or IPv6 network, no host bits: 192.0.2.0/24, 2001:db8::/32.",
        },
        "action": {"enum": [action.value for action in Action]},
    }


def _transports(items: Schema) -> Schema:
    return _obj("Ports per transport.", {"tcp": items, "udp": items})


def _dns_rule() -> Schema:
    name = {
        "type": "string",
        "pattern": NAME_PATTERN,
        "description": "x.com (exact), *.x.com (exactly one more label) or **.x.com (one or more).",
    }
    rule = _obj(
        "A name with its own record types and ports.",
        {
            "name": name,
            "types": {
                "$ref": "#/$defs/recordTypes",
                "description": "Replaces dns.types for this rule; may name data-only types.",
            },
            "ports": {
                "$ref": "#/$defs/ports",
                "description": "Ports for addresses learned by this rule (else connect.ports).",
            },
            "check_names": {
                "type": "boolean",
                "description": "Default true: a TCP flow to this rule's addresses on a"
                " connect.check_names port must ask (TLS SNI, HTTP Host) for a name this"
                " sandbox resolved to that address. false: reach them unread.",
            },
        },
        ["name"],
    )
    return {"oneOf": [name, rule]}


def _dns() -> Schema:
    return _obj(
        "What the sandbox may resolve.",
        {
            "upstreams": {
                "type": "array",
                "minItems": 1,
                "items": {"type": "string"},
                "description": "system (host resolv.conf), IP, IP:port or [IPv6]:port.",
            },
            "types": {
                "$ref": "#/$defs/recordTypes",
                "description": "Record types every rule allows unless it lists its own."
                " Default [A, AAAA, CNAME, HTTPS].",
            },
            "ttl": _obj(
                "Bounds on how long a learned address stays allowed.",
                {
                    "min": {"$ref": "#/$defs/duration", "description": "Default 5s."},
                    "max": {"$ref": "#/$defs/duration", "description": "Default 1h, at most 24h."},
                },
            ),
            "rebinding": {
                "enum": ["deny", "allow"],
                "description": "Refuse answers pointing at private/local addresses. Default deny.",
            },
            "rebinding_exempt": {
                "type": "array",
                "items": {"$ref": "#/$defs/cidr"},
                "description": "Networks exempt from rebinding protection.",
            },
            "denied_response": {
                "enum": ["nxdomain", "refused"],
                "description": "What a denied query gets back. Default nxdomain.",
            },
            "rate_limit": _rate_limit(),
            "allow": {
                "type": "array",
                "items": _dns_rule(),
                "description": "Names the sandbox may resolve (required; may be empty).",
            },
        },
        ["allow"],
    )


def _rate_limit() -> Schema:
    d = RateLimit()
    rate = {"type": "integer", "minimum": 1, "maximum": MAX_RATE}
    return _obj(
        "Queries the sandbox's resolver answers (a token bucket per sandbox); queries over"
        " it are dropped without a reply, so a flood cannot slow other sandboxes down.",
        {
            "qps": {
                **rate,
                "default": d.qps,
                "description": f"Queries per second, sustained. Default {d.qps}.",
            },
            "burst": {
                **rate,
                "default": d.burst,
                "description": "Queries answered at once after a quiet spell (the bucket's"
                f" size); may be below qps. Default {d.burst}.",
            },
        },
    )


def _connect() -> Schema:
    cidr_rule = _obj(
        "A static destination that needs no DNS.",
        {
            "cidr": {"$ref": "#/$defs/cidr"},
            "ports": {"$ref": "#/$defs/portRanges", "description": "Default: every port."},
            "proto": {"enum": ["tcp", "udp", "any"], "description": "Default tcp."},
        },
        ["cidr"],
    )
    return _obj(
        "Where the sandbox may connect.",
        {
            "ports": {
                "$ref": "#/$defs/ports",
                "description": "Ports for addresses learned from DNS. Default [80, 443].",
            },
            "allow": {"type": "array", "items": cidr_rule},
            "check_names": {
                "oneOf": [{"type": "boolean"}, {"$ref": "#/$defs/portList"}],
                "description": "TCP ports on which a flow to a DNS-learned address is held"
                " until its first bytes (TLS SNI, HTTP Host) name a name this sandbox"
                " resolved to it; else it is a name_mismatch. Default [80, 443]; false: none.",
            },
        },
    )


_TUNNEL_LIMITS = {  # key: what one zone may send upstream before the verdict
    "shaped_names": "Tunnel-shaped names (score >= name_score) per zone in one window.",
    "long_text_bytes": "Bytes of unique text of long names (a label >= 40 or a subdomain"
    " >= 64 characters) per zone in one window.",
    "info_bytes": "Information estimate (bytes) of unique subdomain text per zone in one"
    " window; halved when the zone's NXDOMAIN/REFUSED share reaches nx_ratio.",
    "text_bytes": "Bytes of raw unique subdomain text per zone in one window.",
    "data_type_names": "Unique names asked with data-only types (NULL, private use, ...;"
    " TXT counts 1/4) per zone in one window.",
    "names": "Unique names (the subdomain, case-folded) per zone in one window.",
    "name_info_bytes": "Information (bytes) in new names per zone in one window, priced"
    " as an adaptive code against the names the zone has already sent (a vocabulary"
    " re-ordered or re-combined is information). Not halved by the NXDOMAIN share:"
    " search-list expansion is plain names that always get NXDOMAIN.",
    "slow_names": "Unique names (the subdomain, case-folded) per zone in one slow_window.",
    "slow_info_bytes": "Information estimate (bytes) per zone in one slow_window; halved"
    " like info_bytes.",
    "slow_text_bytes": "Bytes of raw unique subdomain text per zone in one slow_window.",
    "slow_name_info_bytes": "Information (bytes) in new names per zone in one slow_window."
    " The sum over all zones has the same limit, not sandbox_scale times it: the slow"
    " budget is per sandbox.",
}


def _tunnel_zone() -> Schema:
    zone = _obj(
        "Tuning for one zone and every name under it: a registered domain (example.com),"
        " a parent of one, or a subtree below one (gti.mcafee.com), which then is scored"
        " as a zone of its own. Of several that match a name, the longest applies.",
        {
            "zone": {"type": "string", "description": "A DNS name, no wildcards."},
            "exempt": {
                "type": "boolean",
                "description": "true: never score this zone (an AV vendor's hash lookups)."
                " false: score even a special-use zone (.internal, .local).",
            },
            "scale": {
                "type": "number",
                "minimum": 1,
                "description": "Multiply every limit of this zone by this; not with exempt: true.",
            },
        },
        ["zone"],
    )
    exempt = {"properties": {"exempt": {"const": True}}, "required": ["exempt"]}
    says = [{"required": ["exempt"]}, {"required": ["scale"]}]
    return {**zone, "anyOf": says, "if": exempt, "then": {"not": {"required": ["scale"]}}}


def _tunnel() -> Schema:
    d = TunnelSpec()
    count = {"type": "integer", "minimum": 1}
    limits = {
        key: {**count, "default": getattr(d, key), "description": text}
        for key, text in _TUNNEL_LIMITS.items()
    }
    return _obj(
        "DNS tunnel detection: every query the rules allow is scored, and none that makes"
        " a verdict is forwarded; a zone crossing a limit gets a verdict (see"
        " violations.tunnel). Leave a key out for its default.",
        {
            "enabled": {
                "type": "boolean",
                "default": d.enabled,
                "description": "Score queries at all. Default true.",
            },
            "window": {
                "$ref": "#/$defs/duration",
                "description": f"The fast sliding window, 1s-24h. Default {d.window_s:g}s.",
            },
            "slow_window": {
                "$ref": "#/$defs/duration",
                "description": "The slow-channel window, 1s-24h, at least window."
                f" Default {d.slow_window_s / 3600:g}h.",
            },
            "name_score": {
                "type": "number",
                "exclusiveMinimum": 0,
                "default": d.name_score,
                "description": "A query name scoring at least this is tunnel-shaped"
                " (egressctl check prints a name's score).",
            },
            **limits,
            "nx_ratio": {
                "type": "number",
                "exclusiveMinimum": 0,
                "maximum": 1,
                "default": d.nx_ratio,
                "description": "NXDOMAIN/REFUSED share of a zone's responses that halves"
                " its information limits (exfiltration needs no answer).",
            },
            "nx_min_responses": {
                **count,
                "default": d.nx_min_responses,
                "description": "Responses a zone needs in one slow_window before nx_ratio applies.",
            },
            "sandbox_scale": {
                "type": "number",
                "exclusiveMinimum": 0,
                "default": d.sandbox_scale,
                "description": "Limits for the sum over all zones, relative to one zone's.",
            },
            "zone_free_bytes": {
                "type": "integer",
                "minimum": 0,
                "maximum": MAX_ZONE_FREE_BYTES,
                "default": d.zone_free_bytes,
                "description": "Information in new names (bytes) each zone may send in a"
                " window before the rest counts towards the sum over all zones.",
            },
            "max_zones": {
                **count,
                "maximum": MAX_ZONES,
                "default": d.max_zones,
                "description": "Zones tracked per sandbox (about 7 KiB each).",
            },
            "zones": {
                "type": "array",
                "items": _tunnel_zone(),
                "description": "Per-zone exemptions and raised limits, one entry per zone.",
            },
            "search_domains": {
                "type": "array",
                "items": {"type": "string", "description": "A domain name, no wildcards."},
                "default": [],
                "description": "The sandbox's resolver search list, where its container"
                " runtime writes one (egressctl run's sandboxes have none): a name asked"
                " under one (pypi.org.corp.example.com) is scored as the name itself"
                " (pypi.org), so search-list expansion of every lookup is not counted as"
                " information sent to the search domain's nameserver. A name whose own"
                " part is a bare registered domain is scored as sent.",
            },
        },
    )


def _violations() -> Schema:
    return _obj(
        "What happens on each class of violation: freeze the sandbox, block, or only log.",
        {cls.value: {"$ref": "#/$defs/action"} for cls in ViolationClass},
    )


def _limits() -> Schema:
    d = Limits()
    return _obj(
        "What a sandbox egress makes may hold at once, through its cgroup (a container's"
        " or pod's runtime sets its own). 'max': no limit.",
        {
            "pids": {
                "oneOf": [
                    {"type": "integer", "minimum": MIN_PIDS, "maximum": MAX_PIDS},
                    {"const": NO_LIMIT},
                ],
                "default": d.pids,
                "description": f"Processes and threads at once. Default {d.pids}.",
            },
            "memory": {
                "oneOf": [
                    {"type": "integer", "minimum": MIN_MEMORY, "maximum": MAX_MEMORY},
                    {"type": "string", "pattern": r"^[0-9]{1,16}(Ki|Mi|Gi|Ti)?$"},
                    {"const": NO_LIMIT},
                ],
                "default": NO_LIMIT,
                "description": "RAM and swap, its private /tmp included, in bytes or binary"
                " units (512Mi, 2Gi); the OOM killer acts inside the sandbox. Default no limit.",
            },
        },
    )


def policy_json_schema() -> dict[str, Any]:
    """The schema as a JSON-ready dict."""
    spec = _obj(
        "The policy itself.",
        {
            "mode": {"enum": ["enforce", "audit"], "description": "Default enforce."},
            "dns": _dns(),
            "connect": _connect(),
            "tunnel": _tunnel(),
            "violations": _violations(),
            "limits": _limits(),
        },
        ["dns"],
    )
    metadata = _obj(
        "Identity of the policy.",
        {
            "name": {"type": "string", "pattern": r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"},
            "annotations": {
                "type": "object",
                "additionalProperties": {"type": "string", "maxLength": 4096},
                "description": "Notes other tools keep with the policy (egressctl import"
                " cilium keeps the endpoint selector here); egress enforces none of them.",
            },
        },
        ["name"],
    )
    top = _obj(
        "An egress policy: which DNS names a sandbox may resolve and where it may connect.",
        {
            "apiVersion": {"const": "egress/v1"},
            "kind": {"const": "Policy"},
            "metadata": metadata,
            "spec": spec,
        },
        ["apiVersion", "kind", "metadata", "spec"],
    )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "egress policy v1",
        **top,
        "$defs": _defs(),
    }
