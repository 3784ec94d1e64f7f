"""Compiled ``dns.allow``: which rule, if any, decides a query, in well under a microsecond.

Semantics:

- ``x.com`` matches the name ``x.com`` only.
- ``*.x.com`` matches names with exactly one more label (``a.x.com``, not ``a.b.x.com``).
- ``**.x.com`` matches names with one or more labels more (``a.x.com``, ``a.b.x.com``).
- Neither wildcard matches ``x.com`` itself. Matching is on whole labels, so
  ``evil-x.com`` and ``x.com.evil.net`` never match a pattern for ``x.com``.
- Names are compared in normal form (see ``names``): case, a trailing dot and the
  spelling of an IDN make no difference.

Precedence, when several rules match a name: an exact rule beats ``*.``, which beats
``**.``; among ``**.`` rules the longest suffix wins. That order is also the only order
of the lookups, so the first hit is the answer. The chosen rule alone then decides the
record type: a less specific rule that allows the type does not help. This keeps a
narrow rule (``{name: api.x.com, types: [A]}``) narrow even under a broad ``**.x.com``.

How it is fast: three dicts, exact names, ``*.`` suffixes and ``**.`` suffixes. A name
costs one exact lookup, one lookup of the name minus its first label in each wildcard
dict, and then one ``**.`` lookup per remaining label boundary, right after left.
Decisions that do not depend on the name (every allow, every type denial) are built
once per rule. Matches are memoised per name as written, in a bounded dict that is
simply emptied when full; denials are not memoised, so a flood of unique names (a
tunnel, a scan) costs no memory and cannot push the real names out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from egress.model import DnsRule, PatternKind, Policy
from egress.policy.names import VALID_ASCII, describe_pattern, normalize_name
from egress.policy.rrtypes import names_of, type_name

CACHE_SIZE = 65536
_SHOWN = 100  # characters of a hostile name worth quoting in a reason


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer for one query: allowed or not, which rule decided, and why."""

    allowed: bool
    rule: DnsRule | None
    reason: str
    name_allowed: bool  # False: denied_name (no rule, bad name); True + not allowed: denied_type


class _Entry:
    """A rule with its precomputed decisions; what the lookup dicts hold."""

    __slots__ = ("allow", "denied", "rule", "types")

    def __init__(self, rule: DnsRule) -> None:
        self.rule = rule
        self.types = rule.types
        self.allow = Decision(True, rule, f"matched {_describe(rule)}", True)
        self.denied: dict[int, Decision] = {}

    def deny_type(self, qtype: int) -> Decision:
        found = self.denied.get(qtype)
        if found is None:
            reason = (
                f"type {type_name(qtype)} not allowed by {self.rule.describe()} "
                f"(allows {names_of(self.types)})"
            )
            found = self.denied[qtype] = Decision(False, self.rule, reason, True)
        return found


def _describe(rule: DnsRule) -> str:
    return f"dns.allow[{rule.index}] {describe_pattern(rule.pattern)}"


class Matcher:
    """Decide DNS queries against one policy's ``dns.allow`` rules."""

    def __init__(self, policy: Policy, *, cache_size: int = CACHE_SIZE) -> None:
        self.policy = policy
        self._tables: dict[PatternKind, dict[str, _Entry]] = {kind: {} for kind in PatternKind}
        for rule in policy.dns.allow:
            # setdefault: validation refuses duplicates, but a hand-built Policy may not.
            self._tables[rule.pattern.kind].setdefault(rule.pattern.suffix, _Entry(rule))
        self._exact = self._tables[PatternKind.EXACT]
        self._one = self._tables[PatternKind.ONE]
        self._many = self._tables[PatternKind.MANY]
        # Only hits are memoised: they point at long-lived entries, so the cache allocates
        # nothing per name, while denials (rare, and unique when a tunnel is at work)
        # would fill it with garbage.
        self._cache: dict[str, _Entry] = {}
        self._cache_size = max(cache_size, 0)

    def decide(self, name: str, qtype: int) -> Decision:
        """Allow or deny a query for ``name`` (any case, trailing dot or not) and ``qtype``."""
        found = self._cache.get(name)
        if found is None:
            found = self._lookup(name)
            if type(found) is Decision:  # a denial that holds for every type
                return found
            cache = self._cache
            if len(cache) >= self._cache_size:
                cache.clear()
            if self._cache_size:
                cache[name] = found
        if qtype in found.types:
            return found.allow
        return found.deny_type(qtype)

    def rule_for(self, name: str) -> DnsRule | None:
        """The rule that decides queries for ``name``, or None (no match, or not a name)."""
        found = self._lookup(name)
        return None if type(found) is Decision else found.rule

    def _lookup(self, name: str) -> Any:  # _Entry | Decision; Any keeps the hot path cheap
        # Written flat on purpose: each extra call or attribute lookup costs ~30 ns a query.
        key = name.lower() if name.isascii() else name
        if key.endswith("."):
            key = key[:-1]
        found = self._exact.get(key)
        if found is not None:  # keys of _exact are valid names, so key is one too
            return found
        if len(key) > 253 or _VALID(key) is None:
            try:
                key = normalize_name(name)  # an IDN, or a clear reason why it is no name
            except ValueError as exc:
                return Decision(False, None, f"invalid name {name[:_SHOWN]!r}: {exc}", False)
            found = self._exact.get(key)
            if found is not None:
                return found
        dot = key.find(".")
        rest = key[dot + 1 :] if dot >= 0 else ""
        found = self._one.get(rest)
        if found is not None:
            return found
        many = self._many
        while many and rest:  # ``**.`` suffixes, longest first: each drops the leftmost label
            found = many.get(rest)
            if found is not None:
                return found
            dot = rest.find(".")
            rest = rest[dot + 1 :] if dot >= 0 else ""
        return Decision(False, None, f"no rule matches '{key}'", False)  # key is valid LDH


_VALID = VALID_ASCII.fullmatch
