"""``spec.dns``: upstreams, record types, TTL bounds, rebinding, rate limit, allow rules.

Record types work in two layers. ``dns.types`` is the default list every rule inherits;
a rule's own ``types`` replaces it for that rule. Data-only types (NULL, ANY, AXFR, IXFR,
private use; see ``rrtypes``) are never inherited: a default list that names one gets a
warning and the type is dropped, because a single ``**.example.com`` rule would otherwise
open a tunnel for anyone who controls a name under it. A rule that names one itself gets
it, with a warning saying what that costs.
"""

from __future__ import annotations

from egress.model import (
    DeniedResponse,
    DnsRule,
    DnsSpec,
    IPNetwork,
    NamePattern,
    PatternKind,
    Ports,
    RateLimit,
    Upstream,
)
from egress.policy.checks import (
    Report,
    duration,
    entry,
    get_bool,
    get_choice,
    get_list,
    get_map,
    get_str,
    kind_of,
    read_values,
)
from egress.policy.names import parse_pattern
from egress.policy.ports import build_ports
from egress.policy.rrtypes import is_data_only, is_pseudo, type_name, type_number
from egress.policy.tree import Map, Node, Scalar, Seq
from egress.policy.values import format_duration, parse_cidr, parse_upstream

DNS_KEYS = (
    "upstreams",
    "types",
    "ttl",
    "rebinding",
    "rebinding_exempt",
    "denied_response",
    "rate_limit",
    "allow",
)
RULE_KEYS = ("name", "types", "ports", "check_names")
TTL_KEYS = ("min", "max")
RATE_KEYS = ("qps", "burst")
# Beyond what one resolver answers in a second (cache hits: ~200,000): a bigger number can
# only be a typo, and this one already means "no limit".
MAX_RATE = 1_000_000
DEFAULT_TYPES = frozenset({1, 28, 5, 65})  # A, AAAA, CNAME, HTTPS
DEFAULT_TTL = (5, 3600)
MAX_TTL = 86400  # an address learned from DNS is re-checked at least daily
PATH = "spec.dns"


def build_dns(node: Node | None, report: Report, connect_ports: Ports) -> DnsSpec:
    """The DnsSpec of ``spec.dns``; DNS rules without ports inherit ``connect_ports``.

    A missing ``spec.dns`` (already reported by the caller) reads as all defaults.
    """
    dns = get_map(node, PATH, report, DNS_KEYS, required=("allow",)) if node else None
    types_node = entry(dns, "types")
    defaults = _default_types(types_node, report) if types_node else DEFAULT_TYPES
    ttl_node = entry(dns, "ttl")
    ttl_min, ttl_max = _ttl(ttl_node, report) if ttl_node else DEFAULT_TTL
    allow_node = entry(dns, "allow")
    rate_node = entry(dns, "rate_limit")
    return DnsSpec(
        upstreams=_upstreams(entry(dns, "upstreams"), report),
        types=defaults,
        ttl_min=ttl_min,
        ttl_max=ttl_max,
        rebinding_deny=_choice(dns, "rebinding", ("deny", "allow"), "deny", report) == "deny",
        rebinding_exempt=_cidrs(entry(dns, "rebinding_exempt"), report),
        denied_response=DeniedResponse(
            _choice(dns, "denied_response", ("nxdomain", "refused"), "nxdomain", report)
        ),
        allow=_rules(allow_node, report, defaults, connect_ports) if allow_node else (),
        rate_limit=_rate_limit(rate_node, report) if rate_node else RateLimit(),
    )


def _choice(
    dns: Map | None, key: str, choices: tuple[str, ...], default: str, report: Report
) -> str:
    node = entry(dns, key)
    if node is None:
        return default
    return get_choice(node, f"{PATH}.{key}", report, choices) or default


def type_list(node: Node, path: str, report: Report) -> list[tuple[int, Node]]:
    """Record type numbers of a YAML list, each with its node for later messages."""
    out: list[tuple[int, Node]] = []
    for index, item in enumerate(get_list(node, path, report, "record types") or ()):
        text = get_str(item, f"{path}[{index}]", report)
        if text is None:
            continue
        try:
            number = type_number(text)
        except ValueError as exc:
            report.error(item.where, f"{path}[{index}]: {exc}")
            continue
        if is_pseudo(number):
            report.error(item.where, f"{path}[{index}]: {text} is a pseudo-record, never queried")
            continue
        out.append((number, item))
    return out


def _default_types(node: Node, report: Report) -> frozenset[int]:
    path = f"{PATH}.types"
    kept = set()
    for number, item in type_list(node, path, report):
        if is_data_only(number):
            report.warn(
                item.where,
                f"{path}: {type_name(number)} carries only data; "
                "it is refused unless a rule names it explicitly",
            )
        else:
            kept.add(number)
    if not kept and isinstance(node, Seq):
        report.warn(node.where, f"{path}: no default types: rules without 'types' allow nothing")
    return frozenset(kept)


def _ttl(node: Node, report: Report) -> tuple[int, int]:
    path = f"{PATH}.ttl"
    ttl = get_map(node, path, report, TTL_KEYS)
    bounds = list(DEFAULT_TTL)
    for index, key in enumerate(TTL_KEYS):
        value = entry(ttl, key)
        if value is None:
            continue
        try:
            bounds[index] = duration(value, MAX_TTL)
        except ValueError as exc:
            report.error(value.where, f"{path}.{key}: {exc}")
    low, high = bounds
    if low > high:
        report.error(
            node.where,
            f"{path}: min ({format_duration(low)}) is greater than max ({format_duration(high)})",
        )
    return low, high


def _rate_limit(node: Node, report: Report) -> RateLimit:
    """``{qps, burst}``, each a whole number in 1..MAX_RATE; a key left out keeps its default.

    A burst below qps is allowed: the same sustained rate, delivered more smoothly (at most
    ``burst`` at once). A bad value keeps its default, so one run reports every problem.
    """
    path = f"{PATH}.rate_limit"
    fields = get_map(node, path, report, RATE_KEYS)
    defaults = {"qps": RateLimit.qps, "burst": RateLimit.burst}
    values = read_values(fields, path, report, dict.fromkeys(RATE_KEYS, _rate), defaults)
    return RateLimit(qps=values["qps"], burst=values["burst"])


def _rate(node: Node) -> int:
    value = node.value if isinstance(node, Scalar) else None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected a whole number of queries, got {kind_of(node)}")
    if value < 1:
        raise ValueError(f"must be at least 1, got {value}")
    if value > MAX_RATE:
        raise ValueError(f"{value} is more than the limit of {MAX_RATE:,}")
    return value


def _upstreams(node: Node | None, report: Report) -> tuple[Upstream, ...]:
    if node is None:
        return (Upstream(host=None),)
    path = f"{PATH}.upstreams"
    items = get_list(node, path, report, "upstream servers")
    if items == []:
        report.error(node.where, f"{path}: name at least one upstream (or leave it out: system)")
    out: list[Upstream] = []
    for index, item in enumerate(items or ()):
        text = _upstream_text(item, f"{path}[{index}]", report)
        if text is None:
            continue
        try:
            upstream = parse_upstream(text)
        except ValueError as exc:
            report.error(item.where, f"{path}[{index}]: {exc}")
            continue
        if upstream in out:
            report.warn(item.where, f"{path}[{index}]: {upstream} is listed twice")
        else:
            out.append(upstream)
    return tuple(out) or (Upstream(host=None),)


def _upstream_text(item: Node, path: str, report: Report) -> str | None:
    if isinstance(item, Scalar):
        return get_str(item, path, report)
    # An unquoted [2001:db8::53]:53 is a YAML flow list; say how to write it.
    report.error(
        item.where,
        f"{path}: expected an address, got {kind_of(item)}; quote IPv6 "
        'upstreams with a port, like "[2001:db8::53]:53"',
    )
    return None


def _cidrs(node: Node | None, report: Report) -> tuple[IPNetwork, ...]:
    path = f"{PATH}.rebinding_exempt"
    items = get_list(node, path, report, "CIDRs") if node else None
    out: list[IPNetwork] = []
    for index, item in enumerate(items or ()):
        text = get_str(item, f"{path}[{index}]", report)
        if text is None:
            continue
        try:
            out.append(parse_cidr(text))
        except ValueError as exc:
            report.error(item.where, f"{path}[{index}]: {exc}")
    return tuple(dict.fromkeys(out))


def _rules(
    node: Node, report: Report, defaults: frozenset[int], connect_ports: Ports
) -> tuple[DnsRule, ...]:
    rules: list[DnsRule] = []
    seen: dict[tuple[PatternKind, str], DnsRule] = {}
    for index, item in enumerate(get_list(node, f"{PATH}.allow", report, "names") or ()):
        rule = _rule(index, item, report, defaults, connect_ports)
        if rule is None:
            continue
        key = (rule.pattern.kind, rule.pattern.suffix)
        first = seen.setdefault(key, rule)
        if first is not rule:
            report.error(
                rule.where,
                f"{PATH}.allow[{index}]: {rule.pattern.text!r} is the same pattern as "
                f"dns.allow[{first.index}] (line {first.where.line}); merge the two rules",
            )
        rules.append(rule)
    return tuple(rules)


def _rule(
    index: int, item: Node, report: Report, defaults: frozenset[int], connect_ports: Ports
) -> DnsRule | None:
    path = f"{PATH}.allow[{index}]"
    if isinstance(item, Map):
        fields = get_map(item, path, report, RULE_KEYS, required=("name",))
        name_node, types_node, ports_node, check_node = (entry(fields, k) for k in RULE_KEYS)
    elif isinstance(item, Scalar):
        name_node, types_node, ports_node, check_node = item, None, None, None
    else:
        report.error(item.where, f"{path}: expected a name or a mapping with 'name', got a list")
        return None
    pattern = _pattern(name_node, path, report) if name_node else None
    explicit = _rule_types(types_node, path, report) if types_node else frozenset()
    ports = (
        build_ports(
            ports_node,
            f"{path}.ports",
            report,
            ranges=False,
            empty="its addresses take spec.connect.ports",
        )
        if ports_node
        else connect_ports
    )
    check = get_bool(check_node, f"{path}.check_names", report) if check_node else None
    if pattern is None:
        return None
    return DnsRule(
        index=index,
        pattern=pattern,
        types=explicit if types_node else defaults,
        explicit_types=explicit,
        ports=ports,
        where=item.where,
        check_names=check is not False,
    )


def _pattern(node: Node, path: str, report: Report) -> NamePattern | None:
    text = get_str(node, path, report)
    if text is None:
        return None
    try:
        pattern, warnings = parse_pattern(text)
    except ValueError as exc:
        report.error(node.where, f"{path}: invalid name {text!r}: {exc}")
        return None
    for warning in warnings:
        report.warn(node.where, f"{path} {text}: {warning}")
    return pattern


def _rule_types(node: Node, path: str, report: Report) -> frozenset[int]:
    found = type_list(node, f"{path}.types", report)
    if isinstance(node, Seq) and not node.items:
        report.error(node.where, f"{path}.types: empty; name at least one type or drop the key")
    for number, item in found:
        if is_data_only(number):
            report.warn(
                item.where,
                f"{path}.types: {type_name(number)} carries only data; allowing it opens a "
                "DNS tunnel to whoever controls these names",
            )
    return frozenset(number for number, _ in found)
