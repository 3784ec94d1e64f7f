"""What the resolver core asks its shell to do. The shell performs them in order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from egress.datapath.elements import SetUpdate
from egress.model import Violation


@dataclass(frozen=True, slots=True)
class Reply:
    """Send ``data`` to ``client`` (the opaque token the shell passed in)."""

    client: object
    data: bytes


@dataclass(frozen=True, slots=True)
class AllowThenReply:
    """Add ``update`` to the sandbox's sets and wait for the kernel's ack; then send each
    ``(client, data, fallback)`` reply and call ``on_allowed`` (which caches the answer).
    If the update fails or takes longer than the deadline, send each ``fallback``
    (SERVFAIL) instead and call nothing: nothing is released, or remembered as released,
    that the kernel does not already allow."""

    update: SetUpdate
    replies: tuple[tuple[object, bytes, bytes], ...]
    on_allowed: Callable[[], None] | None = None


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


Action = Reply | AllowThenReply | Forward | Report
