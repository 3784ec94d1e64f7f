"""The JSON Schema stays in step with the validator and accepts every shipped policy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from egress.policy import dnsspec, limitsspec, ports, validate
from egress.policy.schema import policy_json_schema

POLICIES = sorted((Path(__file__).resolve().parents[2] / "policies").glob("*.yaml"))


def props(schema: dict[str, Any], *path: str) -> dict[str, Any]:
    node = schema
    for key in path:
        node = node["properties"][key]
    return node


def test_schema_is_json_and_2020_12() -> None:
    schema = policy_json_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert json.loads(json.dumps(schema)) == schema


def test_schema_keys_match_the_validator() -> None:
    schema = policy_json_schema()
    expected = {
        (): validate.TOP_KEYS,
        ("metadata",): validate.METADATA_KEYS,
        ("spec",): validate.SPEC_KEYS,
        ("spec", "dns"): dnsspec.DNS_KEYS,
        ("spec", "dns", "ttl"): dnsspec.TTL_KEYS,
        ("spec", "dns", "rate_limit"): dnsspec.RATE_KEYS,
        ("spec", "connect"): validate.CONNECT_KEYS,
        ("spec", "tunnel"): validate.TUNNEL_KEYS,
        ("spec", "violations"): validate.VIOLATION_KEYS,
        ("spec", "limits"): limitsspec.LIMITS_KEYS,
    }
    for path, keys in expected.items():
        node = props(schema, *path)
        assert set(node["properties"]) == set(keys), path
        assert node["additionalProperties"] is False, path
    rule = props(schema, "spec", "dns", "allow")["items"]["oneOf"][1]
    assert set(rule["properties"]) == set(dnsspec.RULE_KEYS)
    cidr_rule = props(schema, "spec", "connect", "allow")["items"]
    assert set(cidr_rule["properties"]) == set(validate.CIDR_RULE_KEYS)
    assert set(schema["$defs"]["ports"]["oneOf"][1]["properties"]) == set(ports.TRANSPORT_KEYS)


def test_there_are_shipped_policies() -> None:
    names = {path.name for path in POLICIES}
    assert {"python-dev.yaml", "node-dev.yaml", "git-https.yaml", "llm-api-only.yaml"} <= names


@pytest.mark.parametrize("path", POLICIES, ids=lambda p: p.name)
def test_shipped_policies_validate_against_the_schema(path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = policy_json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(yaml.safe_load(path.read_text()))


def test_schema_rejects_what_the_validator_rejects() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(policy_json_schema())
    good = {
        "apiVersion": "egress/v1",
        "kind": "Policy",
        "metadata": {"name": "x"},
        "spec": {"dns": {"allow": ["pypi.org", {"name": "*.x.com", "types": ["A"]}]}},
    }
    assert validator.is_valid(good)
    bad_specs: list[dict[str, Any]] = [
        {"dns": {"allow": [], "tpyes": ["A"]}},
        {"dns": {"allow": ["*foo.x.com"]}},
        {"dns": {"allow": [], "ttl": {"min": "30"}}},
        {"dns": {"allow": [], "rate_limit": {"qps": 0}}},
        {"dns": {"allow": [], "rate_limit": {"burst": 2.5}}},
        {"dns": {}},
        {"dns": {"allow": []}, "mode": "Enforce"},
        {"dns": {"allow": []}, "connect": {"ports": [0]}},
        {"dns": {"allow": []}, "limits": {"pids": 8}},
        {"dns": {"allow": []}, "limits": {"pids": "4096"}},
        {"dns": {"allow": []}, "limits": {"memory": "2G"}},
        {"dns": {"allow": []}, "limits": {"memory": 1024}},
        {"dns": {"allow": []}, "limits": {"swap": "max"}},
    ]
    for bad_spec in bad_specs:
        assert not validator.is_valid({**good, "spec": bad_spec}), bad_spec
