"""The policies in policies/ load cleanly and say what their comments promise."""

from __future__ import annotations

from pathlib import Path

import pytest

from egress.model import PortRange, Ports
from egress.policy import Matcher, load_policy_with_warnings

ROOT = Path(__file__).resolve().parents[2] / "policies"
A, AAAA, TXT, HTTPS = 1, 28, 16, 65
HTTPS_ONLY = Ports(tcp=(PortRange(443, 443),))


def matcher(name: str) -> Matcher:
    policy, warnings = load_policy_with_warnings(str(ROOT / name))
    assert warnings == [], warnings
    assert policy.name == name.removesuffix(".yaml")
    return Matcher(policy)


@pytest.mark.parametrize(
    ("policy", "allowed", "denied"),
    [
        (
            "python-dev.yaml",
            ["pypi.org", "files.pythonhosted.org"],
            ["upload.pypi.org", "evil.pythonhosted.org", "github.com"],
        ),
        (
            "node-dev.yaml",
            ["registry.npmjs.org", "registry.yarnpkg.com", "nodejs.org"],
            ["npmjs.org", "evil.npmjs.org", "pypi.org"],
        ),
        (
            "git-https.yaml",
            [
                "github.com",
                "codeload.github.com",
                "objects.githubusercontent.com",
                "raw.githubusercontent.com",
            ],
            ["gist.github.com", "a.raw.githubusercontent.com", "evil-github.com", "gitlab.com"],
        ),
        (
            "llm-api-only.yaml",
            ["api.anthropic.com", "api.openai.com"],
            ["anthropic.com", "console.anthropic.com", "pypi.org"],
        ),
    ],
)
def test_names(policy: str, allowed: list[str], denied: list[str]) -> None:
    m = matcher(policy)
    for name in allowed:
        assert m.decide(name, A).allowed, name
        assert m.decide(name, AAAA).allowed, name
        assert not m.decide(name, TXT).allowed, name
    for name in denied:
        assert not m.decide(name, A).name_allowed, name


@pytest.mark.parametrize(
    "policy", ["python-dev.yaml", "node-dev.yaml", "git-https.yaml", "llm-api-only.yaml"]
)
def test_https_only(policy: str) -> None:
    m = matcher(policy)
    assert m.policy.connect.ports == HTTPS_ONLY
    assert all(rule.ports == HTTPS_ONLY for rule in m.policy.dns.allow)
    assert m.policy.connect.allow == ()


def test_llm_api_only_is_tight() -> None:
    m = matcher("llm-api-only.yaml")
    assert not m.decide("api.anthropic.com", HTTPS).allowed  # no HTTPS records here
    assert all(action.value == "freeze" for action in m.policy.violations.values())
