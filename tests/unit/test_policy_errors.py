"""Bad policies: every problem reported, each with its message and line:col.

The fixtures live in tests/data/policies/; each test lists every problem its file must
produce, so a missing report, an extra one, or a drifting position all fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from egress.errors import PolicyError
from egress.policy import load_policy, parse_policy

DATA = Path(__file__).resolve().parent.parent / "data" / "policies"

Expected = list[tuple[str, str]]  # ("line:col", fragment of the message)

HEAD = "apiVersion: egress/v1\nkind: Policy\nmetadata: {name: t}\nspec:\n"


def problems_of(path: Path) -> list[tuple[str, str]]:
    with pytest.raises(PolicyError) as info:
        load_policy(str(path))
    found = info.value.problems + info.value.warnings
    for problem in found:
        assert problem.where.file == str(path)
    ordered = sorted(found, key=lambda p: (p.where.line, p.where.col, p.message))
    return [(f"{p.where.line}:{p.where.col}", str(p).split(": ", 1)[1]) for p in ordered]


def text_problems(text: str) -> list[tuple[str, str]]:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "t.yaml")
    found = info.value.problems + info.value.warnings
    return [(f"{p.where.line}:{p.where.col}", str(p).split(": ", 1)[1]) for p in found]


def assert_problems(found: list[tuple[str, str]], expected: Expected) -> None:
    assert len(found) == len(expected), "\n".join(f"{at}: {msg}" for at, msg in found)
    for (at, message), (want_at, fragment) in zip(found, expected, strict=True):
        assert at == want_at, (at, message)
        assert fragment in message, (at, message)


def test_malformed_yaml_reports_the_parsers_mark() -> None:
    assert_problems(
        problems_of(DATA / "malformed.yaml"),
        [("4:5", "invalid YAML: did not find expected ',' or '}' (while parsing a flow mapping "
          "started at 3:11)")],
    )  # fmt: skip


def test_wrong_types() -> None:
    assert_problems(
        problems_of(DATA / "wrong_types.yaml"),
        [
            ("5:9", "spec.mode: '3' is not one of: enforce, audit"),
            ("7:12", "spec.dns.types: expected a list of record types, got a string 'A'"),
            ("8:10", "spec.dns.ttl: expected a mapping, got a string '5s'"),
            ("10:33", "spec.dns.allow[0].ports: expected a list of ports like [80, 443]"),
            ("11:9", "spec.dns.allow[1]: expected a name or a mapping with 'name', got a list"),
            ("13:18", "spec.connect.ports.tcp: expected a list of ports, got the number 443"),
            ("14:21", "spec.tunnel.enabled: expected true or false, got a string 'yes please'"),
        ],
    )


def test_unknown_keys_are_errors_with_suggestions() -> None:
    assert_problems(
        problems_of(DATA / "unknown_keys.yaml"),
        [
            ("3:32", "metadata: unknown key 'labels'; allowed: name"),
            ("6:5", "spec.dns: unknown key 'tpyes' (did you mean 'types'?)"),
            ("8:26", "spec.dns.allow[0]: unknown key 'port' (did you mean 'ports'?)"),
            ("9:3", "spec: unknown key 'conect' (did you mean 'connect'?)"),
            ("10:16", "spec.violations: unknown key 'dns_tunnel'"),
        ],
    )


def test_invalid_names() -> None:
    assert_problems(
        problems_of(DATA / "bad_names.yaml"),
        [
            ("7:9", "invalid name 'exa mple.com': label 'exa mple' contains ' '"),
            ("8:9", "invalid name 'a..b.com': empty label"),
            ("9:9", "invalid name '*': '*' has no suffix and would match every name"),
            ("10:9", "invalid name '**': '**' has no suffix"),
            ("11:9", "invalid name '***.x.com': '***' is not a wildcard"),
            ("12:9", "invalid name '*foo.x.com': '*foo' mixes '*' with other characters"),
            ("13:9", "invalid name 'x.*.com': '*' and '**' are only allowed as the whole leftmost"),
            ("14:9", "is 64 characters long; the limit is 63"),
            ("15:9", "warning: spec.dns.allow[8] ok-.example.com: label 'ok-' starts or ends"),
            (
                "17:9",
                "spec.dns.allow[10]: 'PyPI.org.' is the same pattern as dns.allow[9] (line 16)",
            ),
        ],
    )


def test_record_types() -> None:
    assert_problems(
        problems_of(DATA / "bad_types.yaml"),
        [
            ("6:22", "warning: spec.dns.types: NULL carries only data; it is refused unless a rule "
                     "names it explicitly"),
            ("6:28", "spec.dns.types[3]: unknown record type 'TXTT' (did you mean TXT?)"),
            ("8:41", "spec.dns.allow[0].types[0]: OPT is a pseudo-record, never queried"),
            ("8:46", "record type 'TYPE70000' is out of range"),
            ("9:47", "warning: spec.dns.allow[1].types: TYPE65280 carries only data; allowing it "
                     "opens a DNS tunnel"),
            ("10:41", "spec.dns.allow[2].types: empty"),
        ],
    )  # fmt: skip


def test_cidrs_ports_and_upstreams() -> None:
    assert_problems(
        problems_of(DATA / "bad_network.yaml"),
        [
            ("6:25", "spec.dns.upstreams[1]: port 99999 is out of range 1-65535"),
            ("6:43", "invalid upstream 'dns.google'"),
            ("6:55", "mapping keys must be plain words"),
            ("6:55", 'quote IPv6 upstreams with a port, like "[2001:db8::53]:53"'),
            ("7:24", "CIDR '10.0.0.1/8' has host bits set: the network is 10.0.0.0/8"),
            ("9:41", "spec.dns.allow[0].ports[0]: port 0 is out of range 1-65535"),
            ("9:49", "port range '8000-8100': port ranges are not allowed here"),
            ("11:17", "spec.connect.ports[1]: port 65536 is out of range"),
            ("11:24", "spec.connect.ports[2]: invalid port 'http'"),
            ("13:16", "CIDR '192.0.2.1/24' has host bits set: the network is 192.0.2.0/24"),
            ("14:16", "the network is 2001:db8::/32"),
            ("14:40", "port range '9000-8000' is reversed: write 8000-9000"),
            ("15:16", "invalid CIDR '300.1.2.3/8'"),
            ("16:60", "spec.connect.allow[3].proto: leave it out when ports name tcp/udp"),
        ],
    )


def test_durations() -> None:
    assert_problems(
        problems_of(DATA / "durations.yaml"),
        [
            ("6:16", "spec.dns.ttl.min: duration '30' needs a unit: s, m or h"),
            ("6:25", "spec.dns.ttl.max: invalid duration '2d'"),
        ],
    )


def test_yaml_bomb_is_refused_without_expanding() -> None:
    assert_problems(
        problems_of(DATA / "bomb.yaml"),
        [("6:8", "too many nodes in this document (aliases expand to more than 200000)")],
    )


def test_duplicate_keys() -> None:
    assert_problems(
        problems_of(DATA / "duplicate_keys.yaml"),
        [
            ("8:3", "duplicate key 'mode' (first at line 7:3)"),
            ("9:3", "duplicate key 'dns' (first at line 5:3)"),
        ],
    )


def test_non_utf8_bytes() -> None:
    assert_problems(
        problems_of(DATA / "non_utf8.yaml"),
        [("3:21", "file is not UTF-8: byte 0xe9 (invalid continuation byte)")],
    )


@pytest.mark.parametrize("name", ["empty.yaml", "comments_only.yaml"])
def test_empty_file(name: str) -> None:
    assert_problems(problems_of(DATA / name), [("1:1", "file is empty: no policy")])


def test_top_level_list() -> None:
    assert_problems(
        problems_of(DATA / "top_list.yaml"), [("1:1", "policy: expected a mapping, got a list")]
    )


def test_wrong_api_version_kind_and_name() -> None:
    assert_problems(
        problems_of(DATA / "wrong_api.yaml"),
        [
            ("1:13", "apiVersion: expected 'egress/v1', got 'egress/v2'"),
            ("2:7", "kind: expected 'Policy', got 'Deployment'"),
            ("3:18", "metadata.name 'Bad_Name': use 1-63 lowercase letters"),
        ],
    )


def test_missing_required_keys() -> None:
    assert_problems(
        problems_of(DATA / "missing_dns.yaml"), [("5:3", "spec: missing required key 'dns'")]
    )
    assert_problems(
        text_problems("kind: Policy\n"),
        [
            ("1:1", "policy: missing required key 'apiVersion'"),
            ("1:1", "policy: missing required key 'metadata'"),
            ("1:1", "policy: missing required key 'spec'"),
        ],
    )
    assert_problems(
        text_problems(HEAD + "  dns: {}\n"), [("5:8", "spec.dns: missing required key 'allow'")]
    )


def test_ten_megabyte_file_is_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * (10 << 20))
    assert_problems(problems_of(path), [("1:1", "file is larger than 1 MiB (1048576 bytes)")])


def test_one_mebibyte_exactly_is_parsed(tmp_path: Path) -> None:
    body = HEAD + "  dns: {allow: []}\n"
    path = tmp_path / "padded.yaml"
    path.write_bytes(body.encode() + b"#" * ((1 << 20) - len(body)))
    assert load_policy(str(path)).name == "t"


def test_ttl_bounds() -> None:
    assert_problems(
        text_problems(HEAD + "  dns:\n    ttl: {min: 10m, max: 5m}\n    allow: []\n"),
        [("6:10", "spec.dns.ttl: min (10m) is greater than max (5m)")],
    )
    assert_problems(
        text_problems(HEAD + "  dns:\n    ttl: {min: 0s, max: 25h}\n    allow: []\n"),
        [
            ("6:16", "spec.dns.ttl.min: must be at least 1s"),
            ("6:25", "spec.dns.ttl.max: 25h is longer than the limit of 24h"),
        ],
    )


def test_enumerations_and_lists() -> None:
    text = HEAD + (
        "  mode: Enforce\n"
        "  dns:\n"
        "    rebinding: maybe\n"
        "    denied_response: servfail\n"
        "    upstreams: []\n"
        "    rebinding_exempt: 10.0.0.0/8\n"
        "    allow: pypi.org\n"
        "  connect: {allow: [{cidr: 192.0.2.0/24, proto: sctp}, 192.0.2.0/24]}\n"
        "  violations: {tunnel: kill}\n"
    )
    assert_problems(
        text_problems(text),
        [
            ("5:9", "spec.mode: 'Enforce' is not one of: enforce, audit"),
            ("7:16", "spec.dns.rebinding: 'maybe' is not one of: deny, allow"),
            ("8:22", "spec.dns.denied_response: 'servfail' is not one of: nxdomain, refused"),
            ("9:16", "spec.dns.upstreams: name at least one upstream"),
            ("10:23", "spec.dns.rebinding_exempt: expected a list of CIDRs, got a string"),
            ("11:12", "spec.dns.allow: expected a list of names, got a string 'pypi.org'"),
            ("12:49", "spec.connect.allow[0].proto: 'sctp' is not one of: tcp, udp, any"),
            ("12:56", "spec.connect.allow[1]: expected a mapping, got a string '192.0.2.0/24'"),
            ("13:24", "spec.violations.tunnel: 'kill' is not one of: freeze, block, log"),
        ],
    )


def test_null_values_say_nothing() -> None:
    text = HEAD + "  dns:\n    allow:\n      -\n      - {name: }\n"
    assert_problems(
        text_problems(text),
        [
            ("7:8", "spec.dns.allow[0]: expected a string, got nothing (null)"),
            ("8:16", "spec.dns.allow[1]: expected a string, got nothing (null)"),
        ],
    )


def test_warnings_for_wide_cidrs_and_empty_defaults() -> None:
    text = HEAD + (
        "  dns: {types: [NULL], allow: [pypi.org]}\n"
        "  connect: {allow: [{cidr: 0.0.0.0/0, ports: [443]}]}\n"
    )
    policy, warnings = parse_policy(text, "t.yaml")
    assert [str(w) for w in warnings] == [
        "t.yaml:5:16: warning: spec.dns.types: no default types: rules without 'types' allow "
        "nothing",
        "t.yaml:5:17: warning: spec.dns.types: NULL carries only data; it is refused unless a "
        "rule names it explicitly",
        "t.yaml:6:28: warning: spec.connect.allow[0].cidr: 0.0.0.0/0 is every IPv4 address",
    ]
    assert policy.dns.allow[0].types == frozenset()  # NULL is not applied through defaults


def test_problems_of_one_file_come_in_file_order() -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(str(DATA / "bad_network.yaml"))
    lines = [(p.where.line, p.where.col) for p in info.value.problems]
    assert lines == sorted(lines)
    assert str(info.value).splitlines()[0].startswith(f"{DATA / 'bad_network.yaml'}:6:25: ")


def test_empty_port_lists_warn() -> None:
    text = HEAD + "  dns: {allow: [{name: x.com, ports: []}]}\n  connect: {ports: {tcp: []}}\n"
    _, warnings = parse_policy(text, "t.yaml")
    assert [str(w) for w in warnings] == [
        "t.yaml:5:38: warning: spec.dns.allow[0].ports: no ports, so its addresses take"
        " spec.connect.ports",
        "t.yaml:6:20: warning: spec.connect.ports: no ports, so addresses of rules without"
        " ports of their own cannot be reached",
    ]


def test_rate_limit_values() -> None:
    text = HEAD + "  dns:\n    rate_limit: {qps: 0, burst: 1.5}\n    allow: []\n"
    assert_problems(
        text_problems(text),
        [
            ("6:23", "spec.dns.rate_limit.qps: must be at least 1, got 0"),
            ("6:33", "spec.dns.rate_limit.burst: expected a whole number of queries, got the "
                     "number 1.5"),
        ],
    )  # fmt: skip
    text = HEAD + (
        "  dns:\n"
        "    rate_limit:\n"
        "      qps: fast\n"
        "      burst: 2000000\n"
        "      per: 1s\n"
        "    allow: []\n"
    )
    assert_problems(
        text_problems(text),
        [
            ("7:12", "spec.dns.rate_limit.qps: expected a whole number of queries, got a string"),
            ("8:14", "spec.dns.rate_limit.burst: 2000000 is more than the limit of 1,000,000"),
            ("9:7", "spec.dns.rate_limit: unknown key 'per'; allowed: qps, burst"),
        ],
    )
    assert_problems(
        text_problems(HEAD + "  dns: {rate_limit: 500, allow: []}\n"),
        [("5:21", "spec.dns.rate_limit: expected a mapping, got the number 500")],
    )
    assert_problems(
        text_problems(HEAD + "  dns: {rate_limit: {qps: true, burst: -5}, allow: []}\n"),
        [
            ("5:27", "spec.dns.rate_limit.qps: expected a whole number of queries, got 'true'"),
            ("5:40", "spec.dns.rate_limit.burst: must be at least 1, got -5"),
        ],
    )


def test_quic_on_a_checked_port_is_refused_and_check_names_must_be_ports() -> None:
    text = HEAD + (
        "  dns:\n"
        "    allow:\n"
        "      - {name: a.example, ports: {tcp: [443], udp: [443]}}\n"
        "      - {name: b.example, check_names: maybe}\n"
        "  connect:\n"
        "    check_names: {tcp: [443]}\n"
    )
    assert_problems(
        text_problems(text),
        [
            (
                "7:9",
                "spec.dns.allow[0] a.example: udp 443 (QUIC) can't be name-checked yet;"
                " leave it out (clients fall back to TCP), or set check_names: false",
            ),
            ("8:40", "spec.dns.allow[1].check_names: expected true or false, got"),
            ("10:18", "spec.connect.check_names: expected true or false, got a mapping"),
        ],
    )


def test_annotations_are_strings_under_plain_keys() -> None:
    ok = HEAD.replace("metadata: {name: t}", "metadata:\n  name: t\n  annotations: {a.io/b: x}")
    policy, _ = parse_policy(ok + "  dns: {allow: []}\n", "t.yaml")
    assert policy.annotations == (("a.io/b", "x"),)
    bad = HEAD.replace(
        "metadata: {name: t}", "metadata:\n  name: t\n  annotations: {'bad key': x, k: [1]}"
    )
    with pytest.raises(PolicyError) as info:
        parse_policy(bad + "  dns: {allow: []}\n", "t.yaml")
    text = str(info.value)
    assert "metadata.annotations: key 'bad key': use letters" in text
    assert "metadata.annotations.k: expected a string, got a list" in text


def test_limits_values() -> None:
    text = HEAD + ("  dns: {allow: []}\n  limits:\n    pids: 8\n    memory: 2G\n    swap: max\n")
    assert_problems(
        text_problems(text),
        [
            ("7:11", "spec.limits.pids: must be 16-4194304 (or 'max'), got 8"),
            (
                "8:13",
                "spec.limits.memory: '2G' is ambiguous (10^n bytes to Kubernetes, 2^n to"
                " systemd): write 2Gi, or the number of bytes",
            ),
            ("9:5", "spec.limits: unknown key 'swap'; allowed: pids, memory"),
        ],
    )
    assert_problems(
        text_problems(HEAD + "  dns: {allow: []}\n  limits: {pids: '64', memory: 16Mi}\n"),
        [
            ("6:18", "spec.limits.pids: expected a whole number of tasks or 'max', got a string"),
            ("6:32", "spec.limits.memory: 16Mi is below the least a workload starts in (32Mi)"),
        ],
    )
    assert_problems(
        text_problems(HEAD + "  dns: {allow: []}\n  limits: {memory: 1.5Gi}\n"),
        [("6:20", "spec.limits.memory: expected a size like 512Mi or 2Gi, or 'max', got '1.5Gi'")],
    )


@pytest.mark.parametrize(
    ("text", "pids", "memory", "explicit"),
    [
        ("", 2048, None, set()),
        ("  limits: {}\n", 2048, None, set()),
        ("  limits: {pids: max, memory: max}\n", None, None, {"pids", "memory"}),
        ("  limits: {pids: 100, memory: 512Mi}\n", 100, 512 << 20, {"pids", "memory"}),
        ("  limits: {memory: 1Gi}\n", 2048, 1 << 30, {"memory"}),
        ("  limits: {memory: 33554432}\n", 2048, 32 << 20, {"memory"}),
        ("  limits: {pids: 2048, memory: '2Ti'}\n", 2048, 2 << 40, {"pids", "memory"}),
    ],
)
def test_limits_read(text: str, pids: int | None, memory: int | None, explicit: set[str]) -> None:
    policy, _ = parse_policy(HEAD + "  dns: {allow: []}\n" + text, "t.yaml")
    limits = policy.limits
    assert (limits.pids, limits.memory, limits.explicit) == (pids, memory, explicit)
