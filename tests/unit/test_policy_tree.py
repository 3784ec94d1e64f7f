"""The positioned tree: hostile YAML is refused precisely and never crashes the loader."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egress.errors import PolicyError
from egress.policy import parse_policy, tree
from egress.policy.tree import MAX_NODES, Map, Scalar, Seq, compose, line_col


def first_problem(text: str | bytes) -> str:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "t.yaml")
    return str((info.value.problems or info.value.warnings)[0])


def test_positions_are_one_based() -> None:
    root, problems = compose("a:\n  - x\n  - {b: 1}\n", "t.yaml")
    assert problems == []
    assert isinstance(root, Map)
    key, value = root.entries["a"]
    assert (key.where.line, key.where.col) == (1, 1)
    assert isinstance(value, Seq)
    assert [(n.where.line, n.where.col) for n in value.items] == [(2, 5), (3, 5)]


def test_scalars_keep_text_and_value() -> None:
    root, _ = compose("a: 1:30\nb: 0x1bb\nc: yes\nd: NULL\ne: '443'\n", "t.yaml")
    assert isinstance(root, Map)
    values = {k: v for k, (_, v) in root.entries.items()}
    assert all(isinstance(v, Scalar) for v in values.values())
    seen = {k: (v.value, v.text) for k, v in values.items() if isinstance(v, Scalar)}
    assert seen == {
        "a": (90, "1:30"),  # YAML 1.1 sexagesimal: why we keep the text
        "b": (443, "0x1bb"),
        "c": (True, "yes"),
        "d": (None, "NULL"),
        "e": ("443", "443"),
    }


def test_aliases_share_nodes_and_count_expanded() -> None:
    root, _ = compose("a: &x [1, 2, 3]\nb: *x\nc: *x\n", "t.yaml")
    assert isinstance(root, Map)
    assert root.entries["a"][1] is root.entries["b"][1]
    assert root.size == 1 + 3 * (1 + 4)


def test_bomb_stops_at_the_limit_quickly() -> None:
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 30)]
    message = first_problem("\n".join(lines))
    assert f"too many nodes in this document (aliases expand to more than {MAX_NODES})" in message


def test_too_many_plain_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree, "MAX_NODES", 1000)  # the real limit takes a second to reach
    # map + key + list are nodes 1-3, so item 998 (column 5 + 2 * 997) is one too many.
    text = "a: [" + ",".join(["1"] * 1000) + "]\n"
    assert "t.yaml:1:1999: too many nodes in this document (more than 1000)" in first_problem(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[" * 100_000, "t.yaml:1:65: nesting is deeper than 64 levels"),
        ("a: &a [*a]\n", "t.yaml:1:8: alias '*a' refers to a node that contains it"),
        ("a: *nope\n", "t.yaml:1:4: alias '*nope' refers to no anchor defined before it"),
        ("a: 1\n---\nb: 2\n", "t.yaml:2:1: expected one YAML document, found a second ('---')"),
        ("kind: \x00\n", "t.yaml:1:7: invalid YAML: character U+0000 is not allowed in YAML"),
        ("a: b\nééé: \x07\n", "t.yaml:2:6: invalid YAML: character U+0007 is not allowed"),
        ("a: \ud800\n", "t.yaml:1:4: file is not UTF-8"),
        ("\tkind: Policy\n", "t.yaml:1:1: invalid YAML: found character that cannot start"),
        ("a: 'open\n", "t.yaml:2:1: invalid YAML: found unexpected end of stream"),
        ("a: b: c\n", "t.yaml:1:5: invalid YAML: mapping values are not allowed"),
    ],
)
def test_fatal_yaml_problems(text: str, message: str) -> None:
    assert message in first_problem(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: !!python/object:os.system x\n", "t.yaml:1:4: YAML tag 'tag:yaml.org,2002:python/"),
        ("a: !custom x\n", "t.yaml:1:4: YAML tag '!custom' is not supported in a policy"),
        ("a: !!map {}\nb: !!set {x}\n", "t.yaml:2:4: YAML tag 'tag:yaml.org,2002:set'"),
        ("a: !!int nope\n", "t.yaml:1:4: 'nope' is not a valid int"),
        ("? [k]\n: v\n", "t.yaml:1:3: mapping keys must be plain words"),
        ("b: &b {x: 1}\nc:\n  <<: *b\n", "t.yaml:3:3: YAML merge keys ('<<') are not supported"),
    ],
)
def test_tree_problems_do_not_stop_validation(text: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "t.yaml")
    messages = [str(p) for p in info.value.problems]
    assert any(message in m for m in messages), messages
    # ... and the validator still ran: it found the missing keys too.
    assert any("missing required key 'apiVersion'" in m for m in messages)


def test_line_col() -> None:
    text = "ab\ncde\n"
    assert [line_col(text, i) for i in (0, 1, 3, 5, 7)] == [(1, 1), (1, 2), (2, 1), (2, 3), (3, 1)]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_crash(data: bytes) -> None:
    try:
        parse_policy(data, "fuzz.yaml")
    except PolicyError as exc:
        assert exc.problems
        assert all(p.where.file == "fuzz.yaml" for p in exc.problems)


YAMLISH = st.text(alphabet="abk:- \n[]{}&*!,'\"#|>?%@`\t.0123456789", max_size=200)


@settings(max_examples=300, deadline=None)
@given(YAMLISH)
def test_yaml_like_text_never_crashes(text: str) -> None:
    try:
        parse_policy("apiVersion: egress/v1\n" + text, "fuzz.yaml")
    except PolicyError as exc:
        assert exc.problems


KEYS = ["apiVersion", "kind", "metadata", "name", "spec", "mode", "dns", "allow", "types",
        "ports", "tcp", "udp", "ttl", "min", "max", "upstreams", "connect", "cidr", "proto",
        "tunnel", "enabled", "violations", "tunnel", "rebinding_exempt", "x"]  # fmt: skip
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-5, 70000)
    | st.sampled_from(["A", "NULL", "pypi.org", "*.x.com", "**", "1-2", "5s", "10.0.0.0/8"])
    | st.text(max_size=8)
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=3)
    ),
    max_leaves=12,
)
PATHS = st.sampled_from(
    [("spec",), ("spec", "dns"), ("spec", "dns", "allow"), ("spec", "dns", "types"),
     ("spec", "dns", "ttl"), ("spec", "connect"), ("spec", "connect", "allow"),
     ("spec", "violations"), ("metadata",), ("spec", "tunnel"), ("spec", "dns", "upstreams")]
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(PATHS, VALUES)
def test_any_value_anywhere_never_crashes(path: tuple[str, ...], value: object) -> None:
    import yaml

    doc: dict[str, object] = {
        "apiVersion": "egress/v1",
        "kind": "Policy",
        "metadata": {"name": "fuzz"},
        "spec": {"dns": {"allow": ["pypi.org"]}, "connect": {"ports": [443]}},
    }
    node = doc
    for key in path[:-1]:
        child = node.setdefault(key, {})
        assert isinstance(child, dict)
        node = child
    node[path[-1]] = value
    try:
        parse_policy(yaml.safe_dump(doc), "fuzz.yaml")
    except PolicyError as exc:
        assert exc.problems
