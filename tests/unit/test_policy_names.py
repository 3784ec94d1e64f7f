"""Names and name patterns: one normal form, precise refusals."""

from __future__ import annotations

import pytest

from egress.model import PatternKind
from egress.policy.names import describe_pattern, normalize_name, parse_pattern


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("pypi.org", "pypi.org"),
        ("PyPI.ORG", "pypi.org"),
        ("pypi.org.", "pypi.org"),
        ("_dmarc.example.com", "_dmarc.example.com"),
        ("bücher.example", "xn--bcher-kva.example"),
        ("BÜCHER.example.", "xn--bcher-kva.example"),
        ("xn--bcher-kva.example", "xn--bcher-kva.example"),
        ("bücher。example", "xn--bcher-kva.example"),  # ideographic full stop is a dot in IDNA
        ("localhost", "localhost"),
        ("a" * 63 + ".com", "a" * 63 + ".com"),
        ("-edge-.example", "-edge-.example"),  # allowed in queries; patterns get a warning
    ],
)
def test_normalize_name(raw: str, normal: str) -> None:
    assert normalize_name(raw) == normal


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("", "empty name"),
        (".", "empty name"),
        ("a..b.com", "empty label"),
        (".a.com", "empty label"),
        ("a.com..", "empty label"),
        ("a" * 64 + ".com", "64 characters long; the limit is 63"),
        (".".join(["a" * 63] * 4), "255 characters long; the limit is 253"),
        ("exa mple.com", "contains ' '"),
        ("evil.com/path", "contains '/'"),
        ("a\x00b.com", "contains '\\x00'"),
        ("a*.com", "contains '*'"),
        ("a" * 70 + "ü.com", "not a valid internationalised label"),
    ],
)
def test_normalize_name_refuses(raw: str, reason: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        normalize_name(raw)
    assert reason in str(info.value)


def test_253_characters_is_the_limit_exactly() -> None:
    name = ".".join(["a" * 63] * 3 + ["b" * 61])
    assert len(name) == 253
    assert normalize_name(name) == name
    with pytest.raises(ValueError, match="254 characters"):
        normalize_name(name + "b")


@pytest.mark.parametrize(
    ("text", "kind", "suffix"),
    [
        ("pypi.org", PatternKind.EXACT, "pypi.org"),
        ("*.pythonhosted.org", PatternKind.ONE, "pythonhosted.org"),
        ("**.githubusercontent.com", PatternKind.MANY, "githubusercontent.com"),
        ("*.Bücher.Example.", PatternKind.ONE, "xn--bcher-kva.example"),
    ],
)
def test_parse_pattern(text: str, kind: PatternKind, suffix: str) -> None:
    pattern, warnings = parse_pattern(text)
    assert (pattern.kind, pattern.suffix, pattern.text) == (kind, suffix, text)
    assert warnings == []


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("*", "no suffix"),
        ("**", "no suffix"),
        ("*.", "no suffix"),
        ("***.x.com", "'***' is not a wildcard"),
        ("*foo.x.com", "mixes '*' with other characters"),
        ("foo*.x.com", "mixes '*'"),
        ("x.*.com", "only allowed as the whole leftmost label"),
        ("*.*.x.com", "only allowed as the whole leftmost label"),
        ("*..x.com", "empty label"),
        ("*.x..com", "empty label"),
        ("x.com*", "only allowed as the whole leftmost label"),
        ("192.0.2.1", "that is an IP address, not a name; put addresses in spec.connect.allow"),
        ("2001:db8::1", "that is an IP address"),
    ],
)
def test_parse_pattern_refuses(text: str, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_pattern(text)
    assert reason in str(info.value)


def test_pattern_warnings() -> None:
    _, warnings = parse_pattern("-x.example.com")
    assert warnings == ["label '-x' starts or ends with '-'; host names normally do not"]
    _, warnings = parse_pattern("**.com")
    assert warnings == ["this allows every name under the top-level domain 'com'"]


def test_describe_pattern() -> None:
    assert describe_pattern(parse_pattern("x.com")[0]) == "x.com (exact name)"
    assert describe_pattern(parse_pattern("*.x.com")[0]) == "*.x.com (exactly one more label)"
    assert describe_pattern(parse_pattern("**.x.com")[0]) == "**.x.com (one or more labels)"
