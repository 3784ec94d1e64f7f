"""``spec.tunnel``: thresholds and zone overrides in, a TunnelSpec out, or every problem.

Bad input is checked like the other sections (test_policy_errors.py): each test lists
every problem, with its line:col and message, so a missing, extra or moved report fails.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from egress.errors import PolicyError
from egress.model import MAX_ZONE_FREE_BYTES, TunnelSpec, TunnelZoneOverride
from egress.policy import load_policy, parse_policy, tunnelspec, validate
from egress.policy.schema import policy_json_schema

DATA = Path(__file__).resolve().parent.parent / "data" / "policies"
HEAD = "apiVersion: egress/v1\nkind: Policy\nmetadata: {name: t}\nspec:\n  dns: {allow: []}\n"

FULL = (
    HEAD
    + """\
  tunnel:
    enabled: false
    window: 1m
    slow_window: 2h30m
    name_score: 2.5
    shaped_names: 5
    long_text_bytes: 1000
    info_bytes: 400
    text_bytes: 2000
    data_type_names: 8
    slow_names: 300
    slow_info_bytes: 2048
    slow_text_bytes: 4096
    nx_ratio: 1
    nx_min_responses: 32
    sandbox_scale: 1.5
    max_zones: 4096
    zones:
      - {zone: McAfee.COM., exempt: true}
      - {zone: bücher.example, scale: 4}
      - {zone: internal, exempt: false}
      - {zone: corp.internal, exempt: false, scale: 2.5}
"""
)


def tunnel_of(text: str) -> TunnelSpec:
    policy, warnings = parse_policy(text, "t.yaml")
    assert warnings == []
    return policy.tunnel


def problems(text: str | None = None, path: Path | None = None) -> list[str]:
    """``line:col: message`` of every problem, errors and warnings, in file order."""
    with pytest.raises(PolicyError) as info:
        if path is not None:
            load_policy(str(path))
        else:
            assert text is not None
            parse_policy(text, "t.yaml")
    found = sorted(info.value.problems + info.value.warnings, key=lambda p: p.where.line)
    return [str(p).split(":", 1)[1] for p in found]


def test_every_key_reaches_the_tunnel_spec() -> None:
    assert tunnel_of(FULL) == TunnelSpec(
        enabled=False,
        window_s=60.0,
        slow_window_s=9000.0,
        name_score=2.5,
        shaped_names=5,
        long_text_bytes=1000,
        info_bytes=400,
        text_bytes=2000,
        data_type_names=8,
        slow_names=300,
        slow_info_bytes=2048,
        slow_text_bytes=4096,
        nx_ratio=1.0,
        nx_min_responses=32,
        sandbox_scale=1.5,
        max_zones=4096,
        zones=(
            TunnelZoneOverride("mcafee.com", exempt=True),
            TunnelZoneOverride("xn--bcher-kva.example", limit_scale=4.0),
            TunnelZoneOverride("internal", exempt=False),
            TunnelZoneOverride("corp.internal", limit_scale=2.5),
        ),
    )


def test_the_keys_are_the_tunnel_spec_fields() -> None:
    names = {f.name for f in fields(TunnelSpec)}
    keys = {tunnelspec.DURATIONS.get(key, key) for key in tunnelspec.TUNNEL_KEYS}
    assert keys == names
    assert set(tunnelspec.DURATIONS) == {"window", "slow_window"}
    assert validate.TUNNEL_KEYS is tunnelspec.TUNNEL_KEYS


@pytest.mark.parametrize(
    "tunnel", [None, "  tunnel: {}\n", "  tunnel: {enabled: true}\n", "  tunnel: {zones: []}\n"]
)
def test_missing_keys_keep_the_defaults(tunnel: str | None) -> None:
    assert tunnel_of(HEAD + (tunnel or "")) == TunnelSpec()


def test_one_threshold_changes_only_itself() -> None:
    spec = tunnel_of(HEAD + "  tunnel:\n    info_bytes: 256\n    window: 45s\n")
    assert spec == TunnelSpec(info_bytes=256, window_s=45.0)
    assert isinstance(spec.window_s, float) and isinstance(spec.info_bytes, int)


def test_bad_tunnel_file_reports_every_problem_with_its_position() -> None:
    assert problems(path=DATA / "bad_tunnel.yaml") == [
        "8:14: spec.tunnel.enabled: expected true or false, got a string 'yes'",
        "9:13: spec.tunnel.window: duration '30' needs a unit: s, m or h",
        "10:18: spec.tunnel.slow_window: invalid duration '2d': expected a number and a unit: "
        "30s, 5m, 1h",
        "11:17: spec.tunnel.name_score: must be greater than 0, got 0",
        "12:19: spec.tunnel.shaped_names: expected a whole number, got the number 2.5",
        "13:17: spec.tunnel.info_bytes: must be at least 1, got -1",
        "14:17: spec.tunnel.text_bytes: expected a whole number, got a string '1536'",
        "15:22: spec.tunnel.data_type_names: must be at least 1, got 0",
        "16:15: spec.tunnel.nx_ratio: must be greater than 0 and at most 1, got 1.5",
        "17:20: spec.tunnel.sandbox_scale: expected a finite number, got .inf",
        "18:16: spec.tunnel.max_zones: 100000 is more than the limit of 4096 (each tracked "
        "zone costs about 7 KiB per sandbox)",
        "19:5: spec.tunnel: unknown key 'windw' (did you mean 'window'?); allowed: enabled, "
        "window, slow_window, name_score, shaped_names, long_text_bytes, info_bytes, "
        "text_bytes, data_type_names, names, name_info_bytes, slow_names, slow_info_bytes, "
        "slow_text_bytes, slow_name_info_bytes, nx_ratio, nx_min_responses, sandbox_scale, "
        "zone_free_bytes, max_zones, zones, search_domains",
        "22:9: spec.tunnel.zones[1]: exempt: true never scores the zone, so scale has no "
        "effect; keep one",
        "23:16: spec.tunnel.zones[2].zone: invalid zone '*.x.com': no wildcards: a zone "
        "already covers every name under it",
        "23:34: spec.tunnel.zones[2].scale: must be at least 1, got 0.5 (scale raises a "
        "zone's limits; to lower every limit, lower the thresholds)",
        "24:16: spec.tunnel.zones[3].zone: invalid zone '192.0.2.1': that is an IP address; "
        "a zone is a domain name like example.com",
        "25:9: spec.tunnel.zones[4]: say what to do with the zone: {zone: example.com, "
        "exempt: true} or {zone: example.com, scale: 4}",
        "25:16: spec.tunnel.zones[4].zone: invalid zone 'a..b': empty label (two dots in a "
        "row, or a leading dot)",
        "26:9: spec.tunnel.zones[5]: expected {zone: example.com, exempt: true} or "
        "{zone: example.com, scale: 4}, got a string 'example.org'",
        "27:9: spec.tunnel.zones[6]: 'mcafee.com' is the same zone as zones[0] (line 21); "
        "merge the two entries",
        "28:16: warning: spec.tunnel.zones[7].zone: this exempts every zone under the "
        "top-level domain 'com'",
        "29:9: spec.tunnel.zones[8]: missing required key 'zone'",
        "29:18: spec.tunnel.zones[8].exempt: expected true or false, got a string 'maybe'",
        "29:25: spec.tunnel.zones[8]: unknown key 'sclae' (did you mean 'scale'?); allowed: "
        "zone, exempt, scale",
    ]


@pytest.mark.parametrize(
    ("tunnel", "expected"),
    [
        ("  tunnel: true\n", ["6:11: spec.tunnel: expected a mapping, got 'true' (true/false)"]),
        (
            "  tunnel: {zones: {zone: x.com}}\n",
            ["6:19: spec.tunnel.zones: expected a list of zones, got a mapping"],
        ),
        ("  tunnel: {window: 2m}\n", []),
        (
            "  tunnel: {window: 2h}\n",
            ["6:20: spec.tunnel: slow_window (1h, the default) is shorter than window (2h)"],
        ),
        (
            "  tunnel: {window: 5m, slow_window: 4m}\n",
            ["6:37: spec.tunnel: slow_window (4m) is shorter than window (5m)"],
        ),
        (
            "  tunnel: {window: 0s, slow_window: 25h}\n",
            [
                "6:20: spec.tunnel.window: must be at least 1s",
                "6:37: spec.tunnel.slow_window: 25h is longer than the limit of 24h",
            ],
        ),
        (
            "  tunnel: {window: [30s], nx_ratio: 0, nx_min_responses: 1.0}\n",
            [
                "6:20: spec.tunnel.window: expected a duration like 30s, 5m or 1h, got a list",
                "6:37: spec.tunnel.nx_ratio: must be greater than 0 and at most 1, got 0",
                "6:58: spec.tunnel.nx_min_responses: expected a whole number, got the number 1.0",
            ],
        ),
        (
            "  tunnel: {zone_free_bytes: 65536}\n",
            ["6:29: spec.tunnel.zone_free_bytes: must be at most 65535, got 65536"],
        ),
        (
            "  tunnel: {name_score: '3', sandbox_scale: -2, max_zones: 0, slow_names: null}\n",
            [
                "6:24: spec.tunnel.name_score: expected a number, got a string '3'",
                "6:44: spec.tunnel.sandbox_scale: must be greater than 0, got -2",
                "6:59: spec.tunnel.max_zones: must be at least 1, got 0",
                "6:74: spec.tunnel.slow_names: expected a whole number, got nothing (null)",
            ],
        ),
        (
            "  tunnel:\n    zones:\n      - {zone: org, scale: 2}\n      - {zone: x.com, "
            "scale: true}\n      - {zone: [a], exempt: false}\n",
            [
                "8:16: warning: spec.tunnel.zones[0].zone: this raises the limits of every "
                "zone under the top-level domain 'org'",
                "9:30: spec.tunnel.zones[1].scale: expected a number, got 'true' (true/false)",
                "10:16: spec.tunnel.zones[2].zone: expected a string, got a list",
            ],
        ),
    ],
    ids=[
        "not-a-map",
        "zones-not-a-list",
        "window-within-default",
        "window-over-default-slow",
        "windows-reversed",
        "window-bounds",
        "types",
        "allowance-over-16-bits",
        "numbers",
        "zone-items",
    ],
)
def test_inline_problems(tunnel: str, expected: list[str]) -> None:
    text = HEAD + tunnel
    if not expected:  # the case that must load
        tunnel_of(text)  # loads cleanly
        return
    assert problems(text) == expected


def test_a_warning_alone_does_not_fail() -> None:
    policy, warnings = parse_policy(HEAD + "  tunnel: {zones: [{zone: com, exempt: true}]}\n", "t")
    assert policy.tunnel.zones == (TunnelZoneOverride("com", exempt=True),)
    assert [str(w) for w in warnings] == [
        "t:6:27: warning: spec.tunnel.zones[0].zone: this exempts every zone under the "
        "top-level domain 'com'"
    ]


def test_tunnel_problems_come_with_the_rest_of_the_file() -> None:
    text = HEAD.replace("{allow: []}", "{allow: [a..b]}") + "  tunnel: {info_bytes: 0}\n"
    assert problems(text) == [
        "5:17: spec.dns.allow[0]: invalid name 'a..b': empty label (two dots in a row, or a "
        "leading dot)",
        "6:24: spec.tunnel.info_bytes: must be at least 1, got 0",
    ]


# -- schema --------------------------------------------------------------------------------


def tunnel_schema() -> dict[str, Any]:
    schema: dict[str, Any] = policy_json_schema()["properties"]["spec"]["properties"]["tunnel"]
    return schema


def test_schema_describes_every_key_with_its_default() -> None:
    props = tunnel_schema()["properties"]
    assert list(props) == list(tunnelspec.TUNNEL_KEYS)
    defaults = TunnelSpec()
    for key, prop in props.items():
        assert prop.get("description"), key
        if key in tunnelspec.COUNTS or key in ("name_score", "nx_ratio", "sandbox_scale"):
            assert prop["default"] == getattr(defaults, key), key
    assert props["max_zones"]["maximum"] == tunnelspec.MAX_ZONES
    assert props["zone_free_bytes"]["maximum"] == MAX_ZONE_FREE_BYTES
    zone = props["zones"]["items"]
    assert list(zone["properties"]) == list(tunnelspec.ZONE_KEYS)
    assert zone["additionalProperties"] is False and zone["required"] == ["zone"]


def test_schema_agrees_with_the_validator_on_tunnel_examples() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(policy_json_schema())

    def doc(tunnel: dict[str, Any]) -> dict[str, Any]:
        spec = {"dns": {"allow": []}, "tunnel": tunnel}
        return {
            "apiVersion": "egress/v1",
            "kind": "Policy",
            "metadata": {"name": "x"},
            "spec": spec,
        }

    good: list[dict[str, Any]] = [
        {"enabled": False, "window": "30s", "slow_window": "1h", "nx_ratio": 1},
        {"name_score": 2.5, "info_bytes": 1, "max_zones": 4096},
        {"zones": [{"zone": "x.com", "exempt": True}, {"zone": "y.com", "scale": 1}]},
        {"zones": [{"zone": "internal", "exempt": False, "scale": 2}]},
    ]
    bad: list[dict[str, Any]] = [
        {"window": "30"},
        {"info_bytes": 0},
        {"info_bytes": 1.5},
        {"nx_ratio": 0},
        {"nx_ratio": 1.5},
        {"sandbox_scale": 0},
        {"max_zones": 4097},
        {"windw": "30s"},
        {"zones": [{"zone": "x.com", "exempt": True, "scale": 2}]},
        {"zones": [{"zone": "x.com", "scale": 0.5}]},
        {"zones": [{"zone": "x.com"}]},
        {"zones": [{"exempt": True}]},
        {"zones": ["x.com"]},
    ]
    for tunnel in good:
        assert validator.is_valid(doc(tunnel)), tunnel
        parse_policy(_yaml(doc(tunnel)), "t.yaml")  # and the validator agrees
    for tunnel in bad:
        assert not validator.is_valid(doc(tunnel)), tunnel
        with pytest.raises(PolicyError):
            parse_policy(_yaml(doc(tunnel)), "t.yaml")


def _yaml(document: dict[str, Any]) -> str:
    return json.dumps(document)  # JSON is YAML
