"""Which learned names may become one pattern: ``*.P`` or ``**.P``.

Only where at least ``min_siblings`` distinct names were seen right under one parent P,
and P is the registered domain of all of them or lies below it (the Public Suffix List,
private section included): never a public suffix (``*.github.io`` would be every user's
site), never across registered domains. ``*.P`` when the siblings are P's direct
children; ``**.P`` when at least ``min_siblings`` of P's children lead to names deeper
down (a.x.P, b.y.P, ...), which one-label patterns could not cover. Deepest parent
first, and names a pattern covers are not counted again above it: four ``*.`` subtrees
do not make a ``**.`` over their registered domain.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from publicsuffixlist import PublicSuffixList

DEFAULT_MIN_SIBLINGS = 4


@functools.cache
def _psl() -> PublicSuffixList:
    return PublicSuffixList()  # the list in the wheel; never fetched at run time


def registered_domain(name: str) -> str | None:
    """``pypi.org`` for ``files.pypi.org``; None when ``name`` is a public suffix."""
    found = _psl().privatesuffix(name)
    return str(found) if found else None


def is_public_suffix(name: str) -> bool:
    return bool(_psl().is_public(name))


@dataclass(frozen=True)
class Group:
    pattern: str  # "*.cdn.example.com" or "**.example.com", or an exact name
    members: tuple[str, ...]  # the names seen that it covers


@dataclass
class _Level:
    direct: set[str] = field(default_factory=set)  # names one label below
    deep: dict[str, set[str]] = field(default_factory=dict)  # child label -> names below it


def group(names: list[str], min_siblings: int = DEFAULT_MIN_SIBLINGS) -> list[Group]:
    """Exact names and patterns covering every name in ``names``, in a stable order."""
    remaining = set(names)
    out: list[Group] = []
    for parent in _parents_deepest_first(remaining):
        level = _level(parent, remaining)
        if len(level.direct) >= min_siblings:
            members = tuple(sorted(level.direct))
            out.append(Group(f"*.{parent}", members))
            remaining -= level.direct
            level = _level(parent, remaining)
        deep_children = [label for label, below in level.deep.items() if below]
        if len(deep_children) >= min_siblings:
            members = tuple(sorted(set().union(*level.deep.values()) | level.direct))
            out.append(Group(f"**.{parent}", members))
            remaining -= set(members)
    out.extend(Group(name, (name,)) for name in remaining)
    return sorted(out, key=lambda g: (_sort_key(g.pattern), g.pattern))


def _sort_key(pattern: str) -> tuple[str, ...]:
    return tuple(reversed(pattern.lstrip("*.").split(".")))


def _parents_deepest_first(names: set[str]) -> list[str]:
    """Every parent a pattern may sit on: at or below each name's registered domain."""
    parents: set[str] = set()
    for name in names:
        domain = registered_domain(name)
        if domain is None:
            continue
        labels = name.split(".")
        for i in range(1, len(labels)):
            parent = ".".join(labels[i:])
            if len(parent) < len(domain) or is_public_suffix(parent):
                break
            parents.add(parent)
    return sorted(parents, key=lambda p: (-p.count("."), p))


def _level(parent: str, names: set[str]) -> _Level:
    """Names under ``parent`` in the same registered domain as ``parent``."""
    level = _Level()
    domain = registered_domain(parent)
    suffix = "." + parent
    for name in names:
        if not name.endswith(suffix) or registered_domain(name) != domain:
            continue
        rest = name[: -len(suffix)].split(".")
        if len(rest) == 1:
            level.direct.add(name)
            level.deep.setdefault(rest[0], set())
        else:
            level.deep.setdefault(rest[-1], set()).add(name)
    return level
