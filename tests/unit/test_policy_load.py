"""Valid policies: every field lands in the model, defaults fill the rest."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from egress.errors import Location, PolicyError
from egress.model import (
    DEFAULT_ACTIONS,
    Action,
    DeniedResponse,
    Mode,
    PatternKind,
    PortRange,
    Ports,
    Upstream,
    ViolationClass,
)
from egress.policy import load_policy, load_policy_with_warnings, parse_policy

FULL = """\
apiVersion: egress/v1
kind: Policy
metadata: {name: python-dev}
spec:
  mode: audit
  dns:
    upstreams: [system, 192.0.2.53, "[2001:db8::53]:5353"]
    types: [A, AAAA, CNAME, HTTPS]
    ttl: {min: 10s, max: 1h30m}
    rebinding: allow
    rebinding_exempt: [10.0.0.0/8, "fd00::/8"]
    denied_response: refused
    allow:
      - pypi.org
      - "*.pythonhosted.org"
      - "**.githubusercontent.com"
      - {name: api.example.com, types: [A], ports: [443]}
      - {name: dns.example.com, ports: {tcp: [853], udp: [53, 443]}, check_names: false}
  connect:
    ports: {tcp: [80, 443], udp: [443]}
    check_names: [8080, 80]
    allow:
      - {cidr: 192.0.2.0/24, ports: [443, "8000-8100"], proto: tcp}
      - {cidr: "2001:db8::/32", ports: [53], proto: any}
      - {cidr: 198.51.100.7}
      - {cidr: 203.0.113.0/24, ports: {udp: [4500]}}
  tunnel: {enabled: false}
  violations:
    blocked_connect: log
    denied_name: freeze
"""

MINIMAL = """\
apiVersion: egress/v1
kind: Policy
metadata: {name: minimal}
spec:
  dns:
    allow: []
"""

WEB = Ports(tcp=(PortRange(80, 80), PortRange(443, 443)))


def test_full_policy() -> None:
    policy, warnings = parse_policy(FULL, "full.yaml")
    assert warnings == []
    assert (policy.name, policy.source, policy.mode) == ("python-dev", "full.yaml", Mode.AUDIT)
    dns = policy.dns
    assert dns.upstreams == (Upstream(None), Upstream("192.0.2.53"), Upstream("2001:db8::53", 5353))
    assert dns.types == frozenset({1, 28, 5, 65})
    assert (dns.ttl_min, dns.ttl_max) == (10, 5400)
    assert dns.rebinding_deny is False
    assert dns.rebinding_exempt == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("fd00::/8"),
    )
    assert dns.denied_response is DeniedResponse.REFUSED
    assert policy.tunnel.enabled is False
    assert policy.violations[ViolationClass.BLOCKED_CONNECT] is Action.LOG
    assert policy.violations[ViolationClass.DENIED_NAME] is Action.FREEZE
    assert policy.violations[ViolationClass.TUNNEL] is DEFAULT_ACTIONS[ViolationClass.TUNNEL]
    assert set(policy.violations) == set(ViolationClass)


def test_full_policy_rules() -> None:
    policy, _ = parse_policy(FULL, "full.yaml")
    rules = policy.dns.allow
    assert [(r.index, r.pattern.kind, r.pattern.suffix) for r in rules] == [
        (0, PatternKind.EXACT, "pypi.org"),
        (1, PatternKind.ONE, "pythonhosted.org"),
        (2, PatternKind.MANY, "githubusercontent.com"),
        (3, PatternKind.EXACT, "api.example.com"),
        (4, PatternKind.EXACT, "dns.example.com"),
    ]
    assert rules[0].where == Location("full.yaml", 14, 9)
    assert rules[3].where == Location("full.yaml", 17, 9)
    assert rules[0].types == policy.dns.types and rules[0].explicit_types == frozenset()
    assert rules[3].types == rules[3].explicit_types == frozenset({1})
    connect_ports = Ports(tcp=WEB.tcp, udp=(PortRange(443, 443),))
    assert rules[0].ports == connect_ports  # inherited from connect.ports
    assert rules[3].ports == Ports(tcp=(PortRange(443, 443),))
    assert rules[4].ports == Ports(
        tcp=(PortRange(853, 853),), udp=(PortRange(53, 53), PortRange(443, 443))
    )
    assert rules[3].describe() == "dns.allow[3] api.example.com"
    assert [r.check_names for r in rules] == [True, True, True, True, False]
    assert policy.connect.check_names == (80, 8080)


def test_full_policy_connect() -> None:
    policy, _ = parse_policy(FULL, "full.yaml")
    cidrs = policy.connect.allow
    assert [str(r.network) for r in cidrs] == [
        "192.0.2.0/24",
        "2001:db8::/32",
        "198.51.100.7/32",
        "203.0.113.0/24",
    ]
    assert cidrs[0].ports == Ports(tcp=(PortRange(443, 443), PortRange(8000, 8100)))
    assert cidrs[1].ports == Ports(tcp=(PortRange(53, 53),), udp=(PortRange(53, 53),))
    assert cidrs[2].ports == Ports(tcp=(PortRange(1, 65535),))  # no ports: every port, tcp
    assert cidrs[3].ports == Ports(udp=(PortRange(4500, 4500),))
    assert cidrs[0].where == Location("full.yaml", 23, 9)
    assert cidrs[2].describe() == "connect.allow[2] 198.51.100.7/32"


def test_defaults() -> None:
    policy, warnings = parse_policy(MINIMAL, "min.yaml")
    assert warnings == []
    assert policy.mode is Mode.ENFORCE
    assert policy.dns.upstreams == (Upstream(None),)
    assert policy.dns.types == frozenset({1, 28, 5, 65})
    assert (policy.dns.ttl_min, policy.dns.ttl_max) == (5, 3600)
    assert policy.dns.rebinding_deny is True
    assert policy.dns.rebinding_exempt == ()
    assert policy.dns.denied_response is DeniedResponse.NXDOMAIN
    assert policy.dns.allow == ()
    assert policy.connect.ports == WEB
    assert policy.connect.allow == ()
    assert policy.connect.check_names == (80, 443)
    assert policy.tunnel.enabled is True
    assert policy.violations == DEFAULT_ACTIONS


def test_rule_ports_default_to_connect_ports() -> None:
    text = MINIMAL.replace("allow: []", "allow: [pypi.org]") + "  connect: {ports: [443]}\n"
    policy, _ = parse_policy(text, "p.yaml")
    assert policy.dns.allow[0].ports == Ports(tcp=(PortRange(443, 443),))


def test_ports_are_sorted_and_deduplicated() -> None:
    text = MINIMAL + "  connect: {ports: [443, 80, 443, '80']}\n"
    policy, _ = parse_policy(text, "p.yaml")
    assert policy.connect.ports == WEB


def test_bytes_text_and_byte_order_mark() -> None:
    policy, _ = parse_policy(b"\xef\xbb\xbf" + MINIMAL.encode(), "bom.yaml")
    assert policy.name == "minimal"


def test_yaml_spellings_of_text_stay_text() -> None:
    # NULL is YAML's null, 1.10 a float, yes a boolean: here they are what was written.
    text = MINIMAL.replace(
        "allow: []", "allow: [{name: data.example.com, types: [NULL]}, yes.example]"
    )
    policy, warnings = parse_policy(text, "p.yaml")
    assert policy.dns.allow[0].types == frozenset({10})
    assert [w.message.split(":")[0] for w in warnings] == ["spec.dns.allow[0].types"]


def test_load_policy_from_file(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(FULL)
    policy = load_policy(str(path))
    assert policy.source == str(path)
    assert policy.dns.allow[0].where == Location(str(path), 14, 9)


def test_load_policy_with_warnings(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(MINIMAL.replace("allow: []", "allow: ['**.com']"))
    policy, warnings = load_policy_with_warnings(str(path))
    assert [str(w) for w in warnings] == [
        f"{path}:6:13: warning: spec.dns.allow[0] **.com: "
        "this allows every name under the top-level domain 'com'"
    ]
    assert policy.dns.allow[0].pattern.suffix == "com"


def test_load_missing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.yaml")
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert [str(p) for p in info.value.problems] == [
        f"{path}: cannot read: No such file or directory"
    ]


def test_load_directory(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(str(tmp_path))
    assert str(info.value.problems[0]) == f"{tmp_path}: cannot read: Is a directory"


def test_policy_error_carries_warnings_separately() -> None:
    text = MINIMAL.replace("allow: []", "allow: ['**.com', 'a..b']")
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    assert [p.message.split(":")[0] for p in info.value.problems] == ["spec.dns.allow[1]"]
    assert [p.warning for p in info.value.warnings] == [True]


@pytest.mark.parametrize(
    ("value", "ports"),
    [("false", ()), ("true", (80, 443)), ("[]", ()), ("[8443, 443]", (443, 8443))],
)
def test_check_names_ports(value: str, ports: tuple[int, ...]) -> None:
    policy, _ = parse_policy(MINIMAL + f"  connect: {{check_names: {value}}}\n", "p.yaml")
    assert policy.connect.check_names == ports


def test_udp_443_is_allowed_where_it_is_not_checked() -> None:
    rules = "allow: [{name: a.example, ports: {udp: [443]}, check_names: false}]"
    policy, _ = parse_policy(MINIMAL.replace("allow: []", rules), "p.yaml")
    assert policy.dns.allow[0].check_names is False
    text = MINIMAL.replace("allow: []", "allow: [{name: a.example, ports: {udp: [443]}}]")
    policy, _ = parse_policy(text + "  connect: {check_names: [80]}\n", "p.yaml")
    assert policy.dns.allow[0].ports.udp == (PortRange(443, 443),)
