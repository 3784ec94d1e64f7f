"""Cilium policies to egress and back (egress.convert): every example keeps its meaning
through import then export, shipped egress policies through export then import, and each
construct egress cannot say exactly is refused at its line and column, with the reason.

The meaning of a Cilium document is read here independently of the converter, from its
plain YAML: which names may be asked, which (name, protocol, port) may be connected and
whether a name check (serverNames, HTTP host) applies, which (network, protocol, ports)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from egress.convert.cilium_read import read
from egress.convert.cilium_write import ExportError, write
from egress.errors import PolicyError
from egress.policy import parse_policy
from egress.policy.loader import load_policy

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "policies" / "cilium").glob("*.yaml"))
PROTOS = {"TCP": ("tcp",), "UDP": ("udp",), "ANY": ("tcp", "udp"), None: ("tcp", "udp")}


def _ports(entry: dict[str, Any]) -> set[tuple[str, int, int]]:
    out = set()
    for p in entry.get("ports") or []:
        first = int(p["port"])
        last = int(p.get("endPort", first))
        for proto in PROTOS[p.get("protocol")]:
            out.add((proto, first, last))
    return out


def _name(selector: dict[str, str]) -> str:
    return (selector.get("matchName") or selector.get("matchPattern") or "").lower().rstrip(".")


def meaning(doc: dict[str, Any]) -> dict[str, Any]:
    rules = ([doc["spec"]] if "spec" in doc else []) + list(doc.get("specs") or [])
    asked: set[str] = set()
    fqdn: set[tuple[str, str, int, bool]] = set()
    cidr: set[tuple[str, str, int, int]] = set()
    selector = None
    for rule in rules:
        selector = rule.get("endpointSelector") or rule.get("nodeSelector") or {}
        for e in rule.get("egress") or []:
            for entry in e.get("toPorts") or []:
                for sel in (entry.get("rules") or {}).get("dns") or []:
                    asked.add(_name(sel))
            for entry in e.get("toPorts") or []:
                checked = bool(entry.get("serverNames") or (entry.get("rules") or {}).get("http"))
                for sel in e.get("toFQDNs") or []:
                    for proto, first, last in _ports(entry):
                        for port in range(first, last + 1):
                            fqdn.add((_name(sel), proto, port, checked))
            nets = list(e.get("toCIDR") or []) + [c["cidr"] for c in e.get("toCIDRSet") or []]
            entries = e.get("toPorts") or [{"ports": [{"port": "1", "endPort": 65535}]}]
            for net in nets:
                for entry in entries:
                    for proto, first, last in _ports(entry):
                        cidr.add((net, proto, first, last))
    return {"kind": doc["kind"], "name": doc["metadata"]["name"],
            "namespace": doc["metadata"].get("namespace"), "selector": selector,
            "asked": asked, "fqdn": fqdn, "cidr": cidr}  # fmt: skip


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_cilium_to_egress_to_cilium_keeps_the_meaning(path: Path) -> None:
    originals = documents(path)
    converted = read(path.read_text(), str(path))
    assert [c.name for c in converted] == [d["metadata"]["name"] for d in originals]
    for original, c in zip(originals, converted, strict=True):
        policy, warnings = parse_policy(c.text, f"{path} ({c.name})")
        # A name that may only be asked (rules.dns, no toFQDNs) has no port: said so.
        assert all("spec.connect.ports: no ports" in w.message for w in warnings), warnings
        back = yaml.safe_load(write(policy, original["kind"]))
        assert meaning(back) == meaning(original), c.text


def test_examples_cover_what_the_converter_handles() -> None:
    """The examples are worth round-tripping: each feature appears in at least one."""
    text = "\n".join(p.read_text() for p in EXAMPLES)
    for feature in ("matchName", "matchPattern", '"**.', '"*.', "serverNames", "host:",
                    "endPort", "toCIDRSet", "toCIDR:", "specs:", "CiliumClusterwide",
                    'matchPattern: "*"', "protocol: UDP"):  # fmt: skip
        assert feature in text, feature


@pytest.mark.parametrize("name", ["python-dev", "node-dev", "git-https", "llm-api-only"])
def test_egress_to_cilium_to_egress_keeps_names_ports_checks_and_networks(name: str) -> None:
    policy = load_policy(str(ROOT / "policies" / f"{name}.yaml"))
    exported = write(policy)
    [back] = read(exported, "exported.yaml")
    again, _ = parse_policy(back.text, "back.yaml")

    def rules(p: Any) -> set[tuple[Any, ...]]:
        checks = set(p.connect.check_names)
        out = set()
        for r in p.dns.allow:
            ports = r.ports if not r.ports.is_empty() else p.connect.ports
            for proto, ranges in (("tcp", ports.tcp), ("udp", ports.udp)):
                for pr in ranges:
                    for port in range(pr.first, pr.last + 1):
                        checked = proto == "tcp" and r.check_names and port in checks
                        out.add((r.pattern.text, proto, port, checked))
        return out

    assert rules(again) == rules(policy)
    assert [str(r.network) for r in again.connect.allow] == [
        str(r.network) for r in policy.connect.allow
    ]
    assert again.name == policy.name


def test_an_audit_policy_is_not_exported() -> None:
    policy, _ = parse_policy(
        "apiVersion: egress/v1\nkind: Policy\nmetadata: {name: a}\nspec:\n  mode: audit\n"
        "  dns: {allow: [x.example.com]}\n", "a.yaml")  # fmt: skip
    with pytest.raises(ExportError, match="mode: audit: Cilium's audit mode is set per endpoint"):
        write(policy)


def test_the_export_says_limits_are_not_carried_only_when_set() -> None:
    text = "apiVersion: egress/v1\nkind: Policy\nmetadata: {name: a}\nspec:\n" \
        "  dns: {allow: [x.example.com]}\n"  # fmt: skip
    plain, _ = parse_policy(text, "a.yaml")
    limited, _ = parse_policy(text + "  limits: {memory: 1Gi}\n", "a.yaml")
    assert "spec.limits" not in write(plain)
    assert "#   spec.limits (set the pod's resources.limits" in write(limited)


HEAD = """apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: t}
spec:
  endpointSelector: {}
  egress:
"""


A = "  - toFQDNs: [{matchName: a.example.com}]\n"
P443 = '    toPorts: [{ports: [{port: "443"}]}]\n'


def fqdn(pattern: str) -> str:
    return f'  - toFQDNs: [{{matchPattern: "{pattern}"}}]\n' + P443


def ports(entry: str) -> str:
    return f"    toPorts: [{{{entry}}}]\n"


@pytest.mark.parametrize(
    ("rules", "where", "message"),
    [
        (fqdn("api-*.example.com"), "7:30", "'*' is allowed here only as a whole leftmost"),
        (fqdn("*"), "7:30", "matches every name"),
        (fqdn("*.*.example.com"), "7:30", "'*' is allowed here only"),
        ("  - toFQDNs: [{matchName: x.com}]\n", "7:5", "toFQDNs without toPorts allows every"),
        (A + ports('ports: [{port: "1000", endPort: 2000}]'), "8:48", "takes single ports"),
        (A + ports('ports: [{port: "https"}]'), "8:31", "named ports have no egress equivalent"),
        (A + ports('ports: [{port: "²"}]'), "8:31", "named ports have no egress equivalent"),
        (A + ports('ports: [{port: "1", endPort: "²"}]'), "8:45", "expected a port number"),
        (A + ports('ports: [{port: "' + "9" * 4301 + '"}]'), "8:31", "named ports have no"),
        (A + ports('ports: [{port: "443", protocol: SCTP}]'), "8:48", "protocol SCTP: egress"),
        ("  - toEndpoints: [{matchLabels: {app: db}}]\n", "7:18", "no in-cluster destinations"),
        ("  - toEntities: [world]\n", "7:17", "egress has no in-cluster destinations"),
        ('  - toPorts: [{ports: [{port: "443"}]}]\n', "7:14", "toPorts with no destination"),
        ("  - toCIDRSet: [{cidr: 10.0.0.0/8, except: [10.1.0.0/16]}]\n", "7:44", "no exceptions"),
        (A + ports('ports: [{port: "443"}], serverNames: [b.example.com]'), "8:54",
         "'b.example.com' is not one of this rule's toFQDNs names"),
        (A + ports('ports: [{port: "80"}], rules: {http: [{method: GET}]}'), "8:54",
         "only {host: ...} converts"),
        (A + ports('ports: [{port: "80"}], rules: {http: [{host: "a.*"}]}'), "8:61",
         "HTTP host 'a.*'"),
        (A + ports('ports: [{port: "9092"}], rules: {kafka: [{topic: x}]}'), "8:49",
         "rules.kafka: egress reads a flow's first request"),
        ("  - toEndpoints: [{}]\n"
         + ports('ports: [{port: "53"}], rules: {dns: [{matchName: b.example.com}]}') + A + P443,
         "9:27", "toFQDNs 'a.example.com': no rules.dns pattern lets it be asked"),
        ("  - toFQDNs: [{matchName: a.example.com}, {matchName: b.example.com}]\n"
         + ports('ports: [{port: "443"}], serverNames: [a.example.com]'), "8:53",
         "serverNames/HTTP hosts leave out b.example.com"),
        ("  - toCIDR: [192.0.2.1]\n    icmps: [{fields: [{type: 8}]}]\n", "8:5",
         "egress rule key 'icmps' is not one egress converts"),
        ("  - toCIDR: [192.0.2.1]\n    authentication: {mode: required}\n", "8:5",
         "egress rule key 'authentication'"),
        ("  - toCIDR: [192.0.2.1]\n" + ports('ports: [{port: "443"}], listener: {name: x}'),
         "8:40", "toPorts 'listener' has no egress equivalent"),
        ("  - toCIDR: [192.0.2.1]\n    toPorts: {ports: []}\n", "8:14", "toPorts: expected a list"),
        (A + ports('ports: [{port: "80", endPort: abc}]'), "8:46", "endPort 'abc'"),
        ("  - toCIDR: [192.0.2.1]\n" + ports('ports: [{port: "80", endPort: 70000}]'), "8:46",
         "endPort '70000': expected a port number up to 65535"),
        ("  - toCIDR: [192.0.2.1/24]\n", "7:14", "'192.0.2.1/24' is not a network egress takes"),
        ("  - toCIDR: 192.0.2.0/24\n", "7:13", "toCIDR: expected a list of networks"),
    ],
    ids=["star-in-label", "bare-star", "two-stars", "no-ports", "wide-range", "named-port",
         "superscript-port", "superscript-end-port", "4301-digits", "sctp",
         "to-endpoints", "to-entities", "ports-only", "except", "server-name", "http-method",
         "http-regex", "kafka", "not-askable", "server-names-partial", "icmps", "authentication",
         "listener", "to-ports-map", "end-port-text", "end-port-range", "host-bits",
         "to-cidr-scalar"],
)  # fmt: skip
def test_refused_constructs_say_where_and_why(rules: str, where: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        read(HEAD + rules, "cnp.yaml")
    text = str(info.value)
    assert f"cnp.yaml:{where}: " in text and message in text, text


def test_every_problem_of_a_file_is_reported_at_once() -> None:
    bad = HEAD + "  - toEntities: [world]\n  - toFQDNs: [{matchName: x.example.com}]\n"
    with pytest.raises(PolicyError) as info:
        read(bad + "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n", "many.yaml")
    lines = str(info.value).splitlines()
    assert [line.split(": ")[0] for line in lines] == [
        "many.yaml:7:17",
        "many.yaml:8:5",
        "many.yaml:11:7",
    ]
    assert "kind 'ConfigMap' is not a Cilium policy" in lines[2]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("apiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\nmetadata: {name: t}\nspec: [\n",
         "cnp.yaml:5:1: invalid YAML"),
        ("", "cnp.yaml:1:1: file is empty"),
        ("apiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\nmetadata: {name: My.Policy}\n"
         "spec: {}\n", "cnp.yaml:3:18: metadata.name 'My.Policy' is no egress policy name"),
        ("- a\n- b\n", "cnp.yaml:1:1: expected a Cilium policy"),
        ("apiVersion: cilium.io/v1\nkind: CiliumNetworkPolicy\nmetadata: {name: t}\nspec: {}\n",
         "cnp.yaml:1:13: apiVersion 'cilium.io/v1': expected 'cilium.io/v2'"),
        (HEAD.replace("spec:\n  endpointSelector: {}\n  egress:\n", "spec:\n  egressDeny:\n")
         + "  - toCIDR: [10.0.0.0/8]\n", "egressDeny has no egress equivalent"),
    ],
    ids=["syntax", "empty", "name", "not-a-map", "api-version", "egress-deny"],
)  # fmt: skip
def test_malformed_documents_are_refused_precisely(text: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        read(text, "cnp.yaml")
    assert message in str(info.value), str(info.value)


def test_the_endpoint_selector_and_dns_star_come_back_from_annotations() -> None:
    [c] = read((ROOT / "policies/cilium/fqdn-dns-star.yaml").read_text(), "star.yaml")
    policy, _ = parse_policy(c.text, "star.yaml")
    notes = dict(policy.annotations)
    assert json.loads(notes["cilium.io/endpointSelector"]) == {"matchLabels": {"role": "agent"}}
    assert notes["cilium.io/dnsMatchesAll"] == "true"
    back = yaml.safe_load(write(policy))
    assert back["spec"]["egress"][0]["toPorts"][0]["rules"]["dns"] == [{"matchPattern": "*"}]
    # egress answers only the toFQDNs names, though Cilium let every name be asked
    assert [r.pattern.text for r in policy.dns.allow] == ["pypi.org", "files.pythonhosted.org"]


def test_two_documents_with_one_name_are_refused() -> None:
    doc = HEAD + "  - toCIDR: [192.0.2.1]\n"
    with pytest.raises(PolicyError, match=r"dup.yaml:9:1: a second policy named 't' \(the first"):
        read(doc + "---\n" + doc, "dup.yaml")


def test_export_refuses_annotations_it_cannot_read_and_never_widens_a_static_rule() -> None:
    text = """apiVersion: egress/v1
kind: Policy
metadata:
  name: e
  annotations: {ANNOTATION}
spec:
  dns: {allow: [a.example.com]}
  connect: {allow: [{cidr: 192.0.2.0/24, proto: any}]}
"""
    fqdns = "{cilium.io/dnsRuleTo: '{\"toFQDNs\": []}'}"
    bad = [("{cilium.io/endpointSelector: 'not json'}", "not JSON"),
           ("{cilium.io/dnsRuleTo: '[1]'}", "expected a JSON object"),
           (fqdns, "not a DNS server's destination")]  # fmt: skip
    for note, message in bad:
        policy, _ = parse_policy(text.replace("{ANNOTATION}", note), "e.yaml")
        with pytest.raises(ExportError, match=message):
            write(policy)
    policy, _ = parse_policy(text.replace("{ANNOTATION}", "{}"), "e.yaml")
    [static] = [r for r in yaml.safe_load(write(policy))["spec"]["egress"] if "toCIDR" in r]
    every = [{"port": "1", "protocol": p, "endPort": 65535} for p in ("TCP", "UDP")]
    assert static["toPorts"] == [{"ports": every}]
