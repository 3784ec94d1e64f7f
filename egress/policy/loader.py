"""Bytes to Policy: size limit, UTF-8, then tree, then validation.

``load_policy_with_warnings`` is the only function in ``egress.policy`` that touches the
file system, and it only reads one file. Everything else works on text, so tests and
the daemon (which may receive a policy over its API) share one path.
"""

from __future__ import annotations

from egress.errors import Location, PolicyError, Problem
from egress.model import Policy
from egress.policy.tree import compose, line_col
from egress.policy.validate import build_policy

MAX_BYTES = 1 << 20  # 1 MiB: a 10,000-rule policy is about 300 KiB


def load_policy(path: str) -> Policy:
    """The policy in file ``path``; PolicyError with every problem if it is not valid."""
    return load_policy_with_warnings(path)[0]


def load_policy_with_warnings(path: str) -> tuple[Policy, list[Problem]]:
    """The policy in file ``path`` and its warnings; PolicyError if it is not valid."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_BYTES + 1)  # never read more than we would accept
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise PolicyError([Problem(Location(path), f"cannot read: {reason}")]) from None
    return parse_policy(data, path)


def parse_policy(text: str | bytes, source: str) -> tuple[Policy, list[Problem]]:
    """The policy in ``text`` and its warnings; PolicyError with all problems if invalid.

    ``source`` names the text in messages (a file name, or ``<api>``).
    """
    root, problems = compose(_decode(text, source), source)
    policy, found = build_policy(root, source)
    problems = sorted(problems + found, key=lambda p: (p.where.line, p.where.col))
    if policy is None or any(not p.warning for p in problems):
        raise PolicyError(problems)
    return policy, problems


def _decode(text: str | bytes, source: str) -> str:
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if len(data) > MAX_BYTES:
        message = f"file is larger than 1 MiB ({MAX_BYTES} bytes); refusing to parse it"
        raise PolicyError([Problem(Location(source, 1, 1), message)])
    try:
        # strict UTF-8 also refuses the lone surrogates a str can smuggle in
        return data.decode("utf-8-sig")  # a byte order mark is harmless; drop it
    except UnicodeDecodeError as exc:
        before = data[: exc.start].decode("utf-8", "replace")
        where = Location(source, *line_col(before, len(before)))
        message = f"file is not UTF-8: byte 0x{data[exc.start]:02x} ({exc.reason})"
        raise PolicyError([Problem(where, message)]) from None
