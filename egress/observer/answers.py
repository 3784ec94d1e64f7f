"""The observer's answers kept by their bytes: a repeated answer binds without a parse.

The resolver replays a cached answer to every repeat of its query, and the observer gets
a copy of each (``egress dns answer``). The bytes after the ID are the same answer, so the
same binding (``resolver.bindings.answer_binding``): it is parsed once, kept here by those
bytes, and each later copy applies it again from its own time. Compiled by mypyc
(``observer.native``): at cache hits every other copy the observer reads is one of these.
Pure: ``now`` is passed in.
"""

from __future__ import annotations

from typing import Final

from egress.model import Policy
from egress.policy.matcher import Matcher
from egress.resolver.bindings import AnswerBinding, Bindings, answer_binding

# The copy of an answer is read a little after the kernel's element was made, and its
# TTLs are whole seconds: bind a little longer than the inline layer does, never shorter.
GRACE_S: Final = 2.0
# Bounded; cleared when full.
ANSWERS_MAX: Final = 4096
ANSWER_MAX_BYTES: Final = 1232  # larger ones (up to 64 KiB over UDP) are parsed each time
# The same answer applied again within REAPPLY_S, with nothing in the table dropped or
# replaced meanwhile (``Bindings.changes``), would only push its bindings' ends later by
# that much: it is not applied. Re-applying every copy of the bench's cache hits (4
# names, 70,000 a second) was about a third of the observer's CPU. A binding may so end
# up to REAPPLY_S sooner, well inside GRACE_S.
REAPPLY_S: Final = 0.05


class _Seen:
    """An answer's binding (None: it binds nothing), and when it was last applied, with
    the table's ``Bindings.changes`` before that."""

    __slots__ = ("applied", "binding", "changes")

    def __init__(self, binding: AnswerBinding | None) -> None:
        self.binding = binding
        self.applied = float("-inf")
        self.changes = -1


class Answers:
    """Answers seen, by their bytes after the ID, and what each binds into ``bindings``."""

    def __init__(self, policy: Policy, matcher: Matcher, bindings: Bindings) -> None:
        self.policy = policy
        self.matcher = matcher
        self.bindings = bindings
        self._seen: dict[bytes, _Seen] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def learn(self, data: bytes, now: float) -> None:
        """Bind what the answer ``data`` (a DNS message) names, as of ``now``."""
        key = data[2:]
        seen = self._seen.get(key)
        if seen is None:
            seen = _Seen(answer_binding(data, self.policy, self.matcher))
            if len(data) <= ANSWER_MAX_BYTES:  # bounded: 4,096 x 1,232 bytes at most
                if len(self._seen) >= ANSWERS_MAX:
                    self._seen.clear()
                self._seen[bytes(key)] = seen
        binding = seen.binding
        if binding is None:
            return
        changes = self.bindings.changes
        if changes == seen.changes and 0.0 <= now - seen.applied < REAPPLY_S:
            return  # every pair it binds is there, and ends at most REAPPLY_S sooner
        binding.apply(self.bindings, now, GRACE_S)
        # The count from before: had this apply dropped or replaced some of its own
        # pairs, the next copy applies it again.
        seen.applied, seen.changes = now, changes
