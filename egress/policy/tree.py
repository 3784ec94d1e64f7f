"""YAML text to a positioned tree: every node knows its file, line and column.

We do not use ``yaml.safe_load``: it forgets positions, keeps the last of duplicate keys,
and expands aliases without limit (a "billion laughs" file of a few hundred bytes turns
into gigabytes). Instead we consume the parser's event stream (the parser is iterative,
so deep nesting cannot exhaust the Python stack) and build our own nodes, which lets us:

- count the nodes the tree would have with every alias expanded, and stop at
  ``MAX_NODES`` without expanding anything (an alias shares its anchor's node);
- refuse duplicate keys, non-scalar keys, merge keys and recursive aliases;
- bound nesting depth, so the validator's walks stay shallow.

Scalars keep both the value YAML 1.1 would give them (int, bool, None, ...) and the text
as written, because several of our values are strings that YAML would otherwise turn
into numbers (``1:30`` is sexagesimal 90 in YAML 1.1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml

from egress.errors import Location, PolicyError, Problem

MAX_NODES = 200_000  # a 10,000-rule policy has about 100,000
MAX_DEPTH = 64

_PARSER_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when available
_RESOLVER = yaml.resolver.Resolver()
_CONSTRUCTOR = yaml.constructor.SafeConstructor()
_SCALAR_TAGS = {
    "tag:yaml.org,2002:str": None,
    "tag:yaml.org,2002:int": _CONSTRUCTOR.construct_yaml_int,
    "tag:yaml.org,2002:float": _CONSTRUCTOR.construct_yaml_float,
    "tag:yaml.org,2002:bool": _CONSTRUCTOR.construct_yaml_bool,
    "tag:yaml.org,2002:null": _CONSTRUCTOR.construct_yaml_null,
    "tag:yaml.org,2002:timestamp": None,  # no policy value is a date: keep the text
}
_COLLECTION_TAGS = {None, "!", "tag:yaml.org,2002:seq", "tag:yaml.org,2002:map"}

Value = str | int | float | bool | None


@dataclass(eq=False)
class Node:
    where: Location
    size: int = field(default=1, init=False)  # nodes in this subtree, aliases expanded


@dataclass(eq=False)
class Scalar(Node):
    value: Value = None
    text: str = ""


@dataclass(eq=False)
class Seq(Node):
    items: list[Node] = field(default_factory=list)


@dataclass(eq=False)
class Map(Node):
    entries: dict[str, tuple[Scalar, Node]] = field(default_factory=dict)


_WANT_KEY = Scalar(Location("<want key>"))  # sentinel: the next node of a Map is a key


class _Stop(Exception):
    """Raised inside the builder to end parsing on a fatal problem."""


def compose(text: str, source: str) -> tuple[Node, list[Problem]]:
    """Positioned tree of the single YAML document in ``text``, and problems found on the way.

    Problems that leave a usable tree (a duplicate key, an unsupported tag) are returned
    so validation can still report the rest of the file; the others (syntax errors,
    too many nodes, bad aliases, an empty file) raise PolicyError.
    """
    builder = _Builder(source)
    fatal = True
    try:
        for event in yaml.parse(text, Loader=_PARSER_LOADER):
            builder.feed(event)
        fatal = False
    except _Stop:
        pass
    except yaml.MarkedYAMLError as exc:
        builder.problems.append(_yaml_problem(exc, source))
    except yaml.YAMLError as exc:  # ReaderError: a character YAML does not accept
        builder.problems.append(_reader_problem(exc, text, source))
    if builder.root is None and not fatal:
        builder.problems.append(Problem(Location(source, 1, 1), "file is empty: no policy"))
    if fatal or builder.root is None:
        raise PolicyError(builder.problems)
    return builder.root, builder.problems


def compose_all(text: str, source: str) -> tuple[list[Node], list[Problem]]:
    """Positioned trees of every YAML document in ``text`` (``---`` between them), with
    the same limits as ``compose`` over the whole text (other tools' files, such as a
    Cilium policy list, hold several)."""
    builder = _Builder(source, many=True)
    try:
        for event in yaml.parse(text, Loader=_PARSER_LOADER):
            builder.feed(event)
    except _Stop:
        raise PolicyError(builder.problems) from None
    except yaml.MarkedYAMLError as exc:
        raise PolicyError([*builder.problems, _yaml_problem(exc, source)]) from None
    except yaml.YAMLError as exc:
        raise PolicyError([*builder.problems, _reader_problem(exc, text, source)]) from None
    if not builder.roots:
        raise PolicyError([Problem(Location(source, 1, 1), "file is empty: no document")])
    return builder.roots, builder.problems


class _Builder:
    def __init__(self, source: str, many: bool = False) -> None:
        self.source = source
        self.many = many
        self.roots: list[Node] = []
        self.problems: list[Problem] = []
        self.root: Node | None = None
        self.documents = 0
        self.total = 0  # nodes so far, aliases counted at their expanded size
        self.aliases = False
        self.stack: list[tuple[Seq | Map, str | None]] = []  # open collection, its anchor
        self.keys: list[Scalar | None] = []  # per open Map: _WANT_KEY, its key, None = drop
        self.anchors: dict[str, Node | None] = {}  # None while the anchored node is open

    def feed(self, event: yaml.Event) -> None:
        if isinstance(event, yaml.DocumentStartEvent):
            self.documents += 1
            self.anchors.clear()  # an alias never reaches into another document
            if self.documents > 1 and not self.many:
                self._fatal(event, "expected one YAML document, found a second ('---')")
        elif isinstance(event, yaml.ScalarEvent):
            self._finish(self._scalar(event), event.anchor)
        elif isinstance(event, yaml.SequenceStartEvent | yaml.MappingStartEvent):
            self._open(event)
        elif isinstance(event, yaml.CollectionEndEvent):
            node, anchor = self.stack.pop()
            if isinstance(node, Map):
                self.keys.pop()
            self._finish(node, anchor)
        elif isinstance(event, yaml.AliasEvent):
            self._alias(event)

    def _open(self, event: yaml.CollectionStartEvent) -> None:
        if event.tag not in _COLLECTION_TAGS:
            self._error(event, f"YAML tag '{event.tag}' is not supported in a policy")
        if len(self.stack) >= MAX_DEPTH:
            self._fatal(event, f"nesting is deeper than {MAX_DEPTH} levels")
        where = self._where(event)
        node: Seq | Map = Map(where) if isinstance(event, yaml.MappingStartEvent) else Seq(where)
        if isinstance(node, Map):
            self.keys.append(_WANT_KEY)
        if event.anchor is not None:
            self.anchors[event.anchor] = None  # open: an alias to it now would recurse
        self.stack.append((node, event.anchor))
        self._count(1, event)

    def _alias(self, event: yaml.AliasEvent) -> None:
        self.aliases = True
        name = event.anchor or ""
        if name not in self.anchors:
            self._fatal(event, f"alias '*{name}' refers to no anchor defined before it")
        target = self.anchors[name]
        if target is None:
            self._fatal(event, f"alias '*{name}' refers to a node that contains it")
            return
        self._count(target.size, event)
        self._attach(target)

    def _scalar(self, event: yaml.ScalarEvent) -> Scalar:
        tag = event.tag
        if tag is None or tag == "!":
            tag = _RESOLVER.resolve(yaml.ScalarNode, event.value, event.implicit)  # type: ignore[no-untyped-call]
        node = Scalar(self._where(event), value=event.value, text=event.value)
        self._count(1, event)
        if tag not in _SCALAR_TAGS:
            self._error(event, f"YAML tag '{tag}' is not supported in a policy")
            return node
        construct = _SCALAR_TAGS[tag]
        if construct is not None:
            try:
                node.value = construct(yaml.ScalarNode(tag, event.value))
            except (ValueError, TypeError, KeyError):
                self._error(event, f"'{event.value}' is not a valid {tag.rsplit(':', 1)[-1]}")
        return node

    def _finish(self, node: Node, anchor: str | None) -> None:
        if isinstance(node, Seq):
            node.size = 1 + sum(item.size for item in node.items)
        elif isinstance(node, Map):
            node.size = 1 + sum(k.size + v.size for k, v in node.entries.values())
        if anchor is not None:
            self.anchors[anchor] = node
        self._attach(node)

    def _attach(self, node: Node) -> None:
        if not self.stack:
            self.root = node
            self.roots.append(node)
            return
        parent = self.stack[-1][0]
        if isinstance(parent, Seq):
            parent.items.append(node)
            return
        key = self.keys[-1]
        if key is _WANT_KEY:
            self.keys[-1] = self._take_key(parent, node)
            return
        self.keys[-1] = _WANT_KEY
        if key is not None:
            parent.entries[key.text] = (key, node)

    def _take_key(self, parent: Map, node: Node) -> Scalar | None:
        """The key for the next value, or None to drop that value (the key was an error)."""
        if not isinstance(node, Scalar):
            self._error_at(node.where, "mapping keys must be plain words, not lists or mappings")
            return None
        if node.text == "<<":
            self._error_at(node.where, "YAML merge keys ('<<') are not supported; write keys out")
            return None
        if node.text in parent.entries:
            first = parent.entries[node.text][0].where
            self._error_at(
                node.where, f"duplicate key '{node.text}' (first at line {first.line}:{first.col})"
            )
            return None
        return node

    def _count(self, nodes: int, event: yaml.Event) -> None:
        self.total += nodes
        if self.total > MAX_NODES:
            why = "aliases expand to more than" if self.aliases else "more than"
            self._fatal(event, f"too many nodes in this document ({why} {MAX_NODES})")

    def _where(self, event: yaml.Event) -> Location:
        mark = event.start_mark
        if mark is None:  # the stubs allow it; the parsers always set one
            return Location(self.source, 1, 1)
        return Location(self.source, mark.line + 1, mark.column + 1)

    def _error(self, event: yaml.Event, message: str) -> None:
        self._error_at(self._where(event), message)

    def _error_at(self, where: Location, message: str) -> None:
        self.problems.append(Problem(where, message))

    def _fatal(self, event: yaml.Event, message: str) -> None:
        self._error(event, message)
        raise _Stop


def _yaml_problem(exc: yaml.MarkedYAMLError, source: str) -> Problem:
    mark = exc.problem_mark or exc.context_mark
    line, col = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
    message = f"invalid YAML: {exc.problem or 'syntax error'}"
    ctx = exc.context_mark
    if exc.context and ctx is not None:
        message += f" ({exc.context} started at {ctx.line + 1}:{ctx.column + 1})"
    return Problem(Location(source, line, col), message)


def _reader_problem(exc: yaml.YAMLError, text: str, source: str) -> Problem:
    position = getattr(exc, "position", 0)
    position = position if isinstance(position, int) else 0
    character = getattr(exc, "character", None)
    if _PARSER_LOADER is not yaml.SafeLoader:  # libyaml counts bytes of UTF-8, not characters
        before = text.encode("utf-8")[:position].decode("utf-8", "ignore")
    else:
        before = text[:position]
    line, col = line_col(before, len(before))
    if isinstance(character, str) and len(character) == 1:
        character = ord(character)
    what = f"character U+{character:04X}" if isinstance(character, int) else "a character"
    return Problem(Location(source, line, col), f"invalid YAML: {what} is not allowed in YAML")


def line_col(text: str, offset: int) -> tuple[int, int]:
    """1-based line and column of character ``offset`` in ``text``."""
    line = text.count("\n", 0, offset) + 1
    col = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return line, col
