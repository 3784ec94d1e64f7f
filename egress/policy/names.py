"""Domain names and name patterns: one normal form for policies and queries alike.

A name is compared in one spelling only: lowercase ASCII, internationalised labels as
punycode (``bücher`` becomes ``xn--bcher-kva``), no trailing dot. Policies and the
resolver both go through :func:`normalize_name`, so ``PyPI.org.`` in a query meets
``pypi.org`` in a policy and an IDN written either way is the same name.

IDNA uses the standard library's IDNA 2003 codec (``encodings.idna``): it needs no extra
dependency, and for the names policies contain (registries, APIs, CDNs) 2003 and 2008
agree. Underscores are accepted because real names use them (``_dmarc``, SRV owners).
"""

from __future__ import annotations

import encodings.idna
import ipaddress
import re

from egress.model import NamePattern, PatternKind

MAX_NAME = 253
MAX_LABEL = 63
LABEL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_")

# What a normalised ASCII name looks like; labels exclude '.', so there is no backtracking.
VALID_ASCII = re.compile(r"(?:[a-z0-9_-]{1,63}\.)*[a-z0-9_-]{1,63}")

KIND_WORDS = {
    PatternKind.EXACT: "exact name",
    PatternKind.ONE: "exactly one more label",
    PatternKind.MANY: "one or more labels",
}


def normalize_name(name: str) -> str:
    """Lowercase punycode form of ``name`` without its trailing dot.

    Raises ValueError with the reason when ``name`` is not a valid host name.
    """
    text = name[:-1] if name.endswith(".") else name
    if not text:
        raise ValueError("empty name")
    # Non-ASCII text may use the ideographic full stops IDNA also treats as dots.
    labels = text.split(".") if text.isascii() else encodings.idna.dots.split(text)
    full = ".".join(_label(label) for label in labels)
    if len(full) > MAX_NAME:
        raise ValueError(f"name is {len(full)} characters long; the limit is {MAX_NAME}")
    return full


def _label(label: str) -> str:
    if not label:
        raise ValueError("empty label (two dots in a row, or a leading dot)")
    if not label.isascii():
        label = _to_ascii(label)
    label = label.lower()
    if len(label) > MAX_LABEL:
        raise ValueError(
            f"label {label[:20]!r}... is {len(label)} characters long; the limit is {MAX_LABEL}"
        )
    bad = sorted(set(label) - LABEL_CHARS)
    if bad:
        raise ValueError(
            f"label {label!r} contains {bad[0]!r}; only letters, digits, '-' and '_' are allowed"
        )
    return label


def _to_ascii(label: str) -> str:
    try:
        return bytes(encodings.idna.ToASCII(label)).decode("ascii")
    except UnicodeError as exc:
        raise ValueError(f"label {label!r} is not a valid internationalised label: {exc}") from None


def parse_pattern(text: str) -> tuple[NamePattern, list[str]]:
    """Parse one ``dns.allow`` name: ``x.com``, ``*.x.com`` or ``**.x.com``.

    Returns the pattern and warnings; raises ValueError with the reason when invalid.
    """
    if _is_address(text):
        raise ValueError(
            "that is an IP address, not a name; put addresses in spec.connect.allow as CIDRs"
        )
    first, _, rest = text.partition(".")
    if first in ("*", "**"):
        if not rest.strip("."):
            raise ValueError(
                f"'{text}' has no suffix and would match every name; "
                "write the domain it covers, e.g. '*.example.com'"
            )
        kind = PatternKind.ONE if first == "*" else PatternKind.MANY
        suffix = _pattern_name(rest)
    elif "*" in first:
        raise ValueError(_bad_star(first))
    else:
        kind, suffix = PatternKind.EXACT, _pattern_name(text)
    return NamePattern(kind=kind, suffix=suffix, text=text), _warnings(kind, suffix)


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return False
    return True


def _pattern_name(text: str) -> str:
    if "*" in text:
        raise ValueError("'*' and '**' are only allowed as the whole leftmost label")
    return normalize_name(text)


def _bad_star(first: str) -> str:
    if set(first) == {"*"}:
        return f"'{first}' is not a wildcard; use '*' (exactly one label) or '**' (one or more)"
    return (
        f"'{first}' mixes '*' with other characters; a wildcard is a whole label: "
        "'*.example.com' (one label) or '**.example.com' (one or more)"
    )


def _warnings(kind: PatternKind, suffix: str) -> list[str]:
    out = [
        f"label '{label}' starts or ends with '-'; host names normally do not"
        for label in suffix.split(".")
        if label.startswith("-") or label.endswith("-")
    ]
    if kind is not PatternKind.EXACT and "." not in suffix:
        out.append(f"this allows every name under the top-level domain '{suffix}'")
    return out


def describe_pattern(pattern: NamePattern) -> str:
    """``**.githubusercontent.com (one or more labels)``: the pattern and what it means."""
    return f"{pattern.text} ({KIND_WORDS[pattern.kind]})"
