"""What the resolver core asks its shell to do. The shell performs them in order.

One exchange goes back into the core as an event: after an ``AllowThenReply`` the shell
tells ``ResolverCore.on_allowed(token, acked, now, late=...)`` what the kernel answered,
and performs the actions that returns (the replies, or SERVFAILs and a ``Revoke``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from egress.datapath.elements import SetAdd, SetUpdate
from egress.model import IPAddress, Violation

# Whom a reply goes to: opaque here, the shell's own (a UDP address, a TCP connection).
# An alias, not ``object`` itself, where a dataclass names it: mypyc looks the annotation's
# name up in the module, and ``object`` is not one of its globals.
Client = object


@dataclass(frozen=True, slots=True)
class Reply:
    """Send ``data`` to ``client`` (the opaque token the shell passed in)."""

    client: Client
    data: bytes


class Release(NamedTuple):
    """One client's answer, and what it gets instead if the kernel does not allow it."""

    client: Client
    data: bytes
    fallback: bytes  # SERVFAIL


@dataclass(frozen=True, slots=True)
class AllowThenReply:
    """Perform ``adds`` in order (the elements of ``update``, grouped by the timeout each
    needs, planned once in the core); each one must be acked by the kernel. Then call
    ``core.on_allowed(token, acked, now, late=...)`` with how many were acked and whether
    the last ack came after ``SET_UPDATE_DEADLINE_S``, and perform what it returns: the
    ``replies``' data if all were acked in time, their fallbacks (SERVFAIL) otherwise.
    Nothing is released, or remembered as released, that the kernel does not allow.

    ``qname``/``qtype`` is the question and ``ips`` the addresses it allows: what egressd
    tracks to keep exactly the justified elements across a policy swap."""

    token: int
    update: SetUpdate
    adds: tuple[SetAdd, ...]
    replies: tuple[Release, ...]
    qname: str
    qtype: int
    ips: tuple[IPAddress, ...]


@dataclass(frozen=True, slots=True)
class Revoke:
    """Delete these elements again (they were acked too late to be trusted; an earlier
    answer's elements are not among them). Best effort: a failure changes nothing."""

    update: SetUpdate


@dataclass(frozen=True, slots=True)
class Forward:
    """Send ``data`` to upstream number ``upstream``; report back with ``token``."""

    token: int
    upstream: int
    data: bytes
    tcp: bool


@dataclass(frozen=True, slots=True)
class Report:
    """A violation to journal and act on as the policy says."""

    violation: Violation


Action = Reply | AllowThenReply | Revoke | Forward | Report
