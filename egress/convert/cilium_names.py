"""Cilium name selectors and egress name patterns, translated exactly or refused.

Cilium (pkg/fqdn/matchpattern): ``matchName`` is one exact name; in ``matchPattern`` a
``*`` stands for any run of ``[-a-zA-Z0-9_]`` inside one label (never a dot), and since
Cilium 1.19 a leading ``**.`` for one or more whole labels. Both are case-insensitive and
take an optional trailing dot. egress: ``x.com`` exact, ``*.x.com`` exactly one more
label, ``**.x.com`` one or more. So ``*.x.com`` and ``**.x.com`` translate as they are (a
``*`` label can only match a whole label: names have no empty labels), and a ``*``
anywhere else (``api-*.x.com``, ``*x.com``, ``a.*.x.com``) or a bare ``*`` has no egress
equivalent.
"""

from __future__ import annotations

import re

from egress.model import NamePattern, PatternKind

MATCH_NAME = "matchName"
MATCH_PATTERN = "matchPattern"
_CHARS = "[-a-zA-Z0-9_]"


def to_egress(key: str, text: str) -> str:
    """The egress pattern for a Cilium selector; ValueError with the reason if none."""
    name = text.strip().lower().rstrip(".")
    if not name:
        raise ValueError(f"{key} is empty")
    if key == MATCH_NAME:
        if "*" in name:
            raise ValueError(f"matchName {text!r} holds '*': Cilium reads it as a character")
        return name
    if name in ("*", "**"):
        raise ValueError(
            f"matchPattern {text!r} matches every name; egress allows names under a domain:"
            " write the domains ('**.example.com')"
        )
    first, _, rest = name.partition(".")
    if first in ("*", "**") and rest and "*" not in rest:
        return name
    raise ValueError(
        f"matchPattern {text!r}: '*' is allowed here only as a whole leftmost label ('*.x.com'"
        " one label, '**.x.com' one or more); egress has no pattern for a '*' inside a label"
        " or further right"
    )


def to_cilium(pattern: NamePattern) -> tuple[str, str]:
    """(``matchName``/``matchPattern``, text) for an egress pattern."""
    if pattern.kind is PatternKind.EXACT:
        return MATCH_NAME, pattern.suffix
    star = "*" if pattern.kind is PatternKind.ONE else "**"
    return MATCH_PATTERN, f"{star}.{pattern.suffix}"


def host_regex(pattern: NamePattern) -> str:
    """The HTTP ``host`` regex (Cilium L7 rules: extended POSIX, matched against the Host
    header) that admits exactly the names of ``pattern``."""
    suffix = re.escape(pattern.suffix).replace("\\-", "-")
    if pattern.kind is PatternKind.EXACT:
        return f"^{suffix}$"
    if pattern.kind is PatternKind.ONE:
        return f"^{_CHARS}+\\.{suffix}$"
    return f"^({_CHARS}+\\.)+{suffix}$"


_HOST_FORMS = (
    (re.compile(r"\^((?:[a-z0-9_-]+\\\.)*[a-z0-9_-]+)\$"), ""),
    (re.compile(r"\^" + re.escape(_CHARS) + r"\+\\\.((?:[a-z0-9_-]+\\\.)*[a-z0-9_-]+)\$"), "*."),
    (re.compile(r"\^\(" + re.escape(_CHARS) + r"\+\\\.\)\+((?:[a-z0-9_-]+\\\.)*[a-z0-9_-]+)\$"),
     "**."),
)  # fmt: skip


def from_host_regex(text: str) -> str:
    """The egress pattern a ``host`` regex of ``host_regex``'s forms admits; ValueError
    for any other regex (egress reads names, not regular expressions)."""
    for form, prefix in _HOST_FORMS:
        found = form.fullmatch(text.strip())
        if found:
            return prefix + found.group(1).replace("\\.", ".")
    raise ValueError(
        f"HTTP host {text!r}: egress binds a Host to names, so only an anchored name"
        " ('^api\\.example\\.com$') or the one-label or many-label forms export writes"
        " convert"
    )
