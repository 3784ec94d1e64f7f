"""Typed access to the positioned tree, recording a problem instead of raising.

The validator never stops at the first problem: each accessor returns the value or
``None`` and, when the node is not what the language expects, records a Problem at the
node's position. Callers fall back to a default and carry on, so one run reports
everything that is wrong with a file.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from egress.errors import Location, Problem
from egress.policy.tree import Map, Node, Scalar, Seq
from egress.policy.values import format_duration, parse_duration


class Report:
    """The problems found so far, errors and warnings, in the order they were found."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def error(self, where: Location, message: str) -> None:
        self.problems.append(Problem(where, message))

    def warn(self, where: Location, message: str) -> None:
        self.problems.append(Problem(where, message, warning=True))

    @property
    def has_errors(self) -> bool:
        return any(not p.warning for p in self.problems)

    def sorted(self) -> list[Problem]:
        """Problems in file order, which is how a person fixes them."""
        return sorted(self.problems, key=lambda p: (p.where.line, p.where.col))


def kind_of(node: Node) -> str:
    """How a node looks to a user: ``a list``, ``a string 'A'``, ``the number 30``."""
    if isinstance(node, Map):
        return "a mapping"
    if isinstance(node, Seq):
        return "a list"
    assert isinstance(node, Scalar)
    value = node.value
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"{node.text!r} (true/false)"
    if isinstance(value, int | float):
        return f"the number {node.text}"
    return f"a string {_short(node.text)!r}"


def _short(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def get_map(
    node: Node,
    path: str,
    report: Report,
    keys: Sequence[str],
    required: Sequence[str] = (),
) -> Map | None:
    """``node`` as a mapping whose keys are all in ``keys`` and include ``required``."""
    if not isinstance(node, Map):
        report.error(node.where, f"{path}: expected a mapping, got {kind_of(node)}")
        return None
    for key, (key_node, _) in node.entries.items():
        if key not in keys:
            report.error(key_node.where, unknown_key(path, key, keys))
    for key in required:
        if key not in node.entries:
            report.error(node.where, f"{path}: missing required key '{key}'")
    return node


def unknown_key(path: str, key: str, keys: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, keys, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"{path}: unknown key {_short(key)!r}{hint}; allowed: {', '.join(keys)}"


def get_list(node: Node, path: str, report: Report, what: str) -> list[Node] | None:
    """``node`` as a list; ``what`` names its items for the message (``record types``)."""
    if isinstance(node, Seq):
        return node.items
    report.error(node.where, f"{path}: expected a list of {what}, got {kind_of(node)}")
    return None


def get_str(node: Node, path: str, report: Report) -> str | None:
    """The text of a scalar, as written: ``1.10`` stays ``1.10``, not the float 1.1.

    YAML's null spellings other than an empty value and ``~`` count as text here:
    ``NULL`` is a record type, and ``null`` could be a label.
    """
    if isinstance(node, Scalar) and (node.value is not None or node.text not in ("", "~")):
        return node.text
    report.error(node.where, f"{path}: expected a string, got {kind_of(node)}")
    return None


def get_choice(node: Node, path: str, report: Report, choices: Sequence[str]) -> str | None:
    """One of ``choices``, exactly as spelt there."""
    text = get_str(node, path, report)
    if text is None:
        return None
    if text not in choices:
        report.error(node.where, f"{path}: {_short(text)!r} is not one of: {', '.join(choices)}")
        return None
    return text


def get_bool(node: Node, path: str, report: Report) -> bool | None:
    if isinstance(node, Scalar) and isinstance(node.value, bool):
        return node.value
    report.error(node.where, f"{path}: expected true or false, got {kind_of(node)}")
    return None


T = TypeVar("T")


def read_values(
    fields: Map | None,
    path: str,
    report: Report,
    readers: Mapping[str, Callable[[Node], T]],
    values: dict[str, T],
) -> dict[str, T]:
    """``values`` (the defaults), with each key of ``fields`` that ``readers`` names read
    by its reader; a value its reader refuses (ValueError) is reported where it is and
    keeps its default, so one run reports every problem."""
    for key, read in readers.items():
        value = entry(fields, key)
        if value is None:
            continue
        try:
            values[key] = read(value)
        except ValueError as exc:
            report.error(value.where, f"{path}.{key}: {exc}")
    return values


def entry(node: Map | None, key: str) -> Node | None:
    """The value under ``key``, or None when the map or the key is missing."""
    if node is None:
        return None
    found = node.entries.get(key)
    return found[1] if found is not None else None


def duration(node: Node, most_s: int) -> int:
    """Seconds of a duration scalar (``30s``, ``5m``, ``1h``), from 1 s to ``most_s``;
    ValueError says what is wrong (the caller adds where)."""
    if not isinstance(node, Scalar):
        raise ValueError(f"expected a duration like 30s, 5m or 1h, got {kind_of(node)}")
    seconds = parse_duration(node.value)
    if seconds < 1:
        raise ValueError("must be at least 1s")
    if seconds > most_s:
        raise ValueError(
            f"{format_duration(seconds)} is longer than the limit of {format_duration(most_s)}"
        )
    return seconds
