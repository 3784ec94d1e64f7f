"""One error tree for all of egress.

Third-party exceptions (yaml, nftables, netlink, OS errors) are translated into these at
the shell boundary, once, so callers handle a closed set of types and users read one
precise message per problem.

Each class carries ``http_status``, the status egressd's API answers it with, and
``http_body()``, the JSON it answers with, so the API maps any error by one lookup. The
classes that never reach the API (the lab's, the client's, ``egressctl run``'s) keep their
parent's. Statuses:
400 a request egressd cannot read; 404 an unknown sandbox; 409 a collision with what is
served; 422 a request that is well-formed but cannot be done (an invalid policy, no usable
upstream, a netns, cgroup or uplink that won't do); 500 egressd's own datapath or journal
failed; 503 egressd is handing over to a successor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


class EgressError(Exception):
    """Root of every error egress raises on purpose."""

    http_status: ClassVar[int] = 422
    exit_code: ClassVar[int] = 1  # what egressctl exits with

    def http_body(self) -> dict[str, Any]:
        """``{"error": message, "where": the part of the request at fault, or None}``."""
        return {"error": str(self), "where": None}


@dataclass(frozen=True)
class Location:
    """Where in a source file a problem sits (1-based line and column)."""

    file: str
    line: int = 0
    col: int = 0

    def __str__(self) -> str:
        if self.line <= 0:
            return self.file
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Problem:
    """One problem found in a policy: an error or, with ``warning``, advice."""

    where: Location
    message: str
    warning: bool = False

    def __str__(self) -> str:
        prefix = "warning: " if self.warning else ""
        return f"{self.where}: {prefix}{self.message}"


class PolicyError(EgressError):
    """A policy could not be loaded. Carries every problem found, not just the first."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = [p for p in problems if not p.warning]
        self.warnings = [p for p in problems if p.warning]
        super().__init__("\n".join(str(p) for p in self.problems))

    def http_body(self) -> dict[str, Any]:
        problems = [str(p) for p in self.problems]
        return {"error": "the policy is invalid", "where": "policy", "problems": problems}


class DatapathError(EgressError):
    """nftables or netlink refused an operation; the message carries the kernel's text."""

    http_status = 500


class UpstreamError(EgressError):
    """No upstream DNS server gave a usable answer."""

    def http_body(self) -> dict[str, Any]:
        return {"error": str(self), "where": "upstream"}


class JournalError(EgressError):
    """The violation journal could not be opened or written."""

    http_status = 500


class SandboxError(EgressError):
    """A sandbox could not be created, entered, attached, served or torn down."""


class UsageError(SandboxError):
    """Bad input that nothing was made for: an unknown or root --user, an invalid --env
    name, an exhausted uid range. egressctl exits 2, as for a bad policy."""

    exit_code: ClassVar[int] = 2


class InputError(EgressError):
    """Input a command cannot use (no audit record to learn from, an unknown sandbox, a
    time it cannot read): nothing was written. egressctl exits 2."""

    exit_code: ClassVar[int] = 2


class AlreadyAttached(SandboxError):
    """Raised by ``sandbox.attach`` when the netns already holds an ``inet egress`` table
    (another egress serves it); egressd's registry answers it as a ``Conflict``."""

    http_status = 409


class Stopped(SandboxError):
    """Raised by ``egressctl run`` on SIGTERM or SIGHUP before its command started: it
    tears down what it made and goes."""


class NotFound(SandboxError):
    """Raised by egressd when no sandbox it serves (or that its journal knows) has the id
    a request names; ``where`` is the id when the request's path names it."""

    http_status = 404

    def __init__(self, message: str, where: str | None = None) -> None:
        super().__init__(message)
        self.where = where

    def http_body(self) -> dict[str, Any]:
        return {"error": str(self), "where": self.where}


class Conflict(SandboxError):
    """Raised by egressd when a request collides with what it already serves: an id or
    netns in use, a resume of a sandbox that is not frozen, a policy swap that would change
    the upstreams."""

    http_status = 409


class Busy(SandboxError):
    """Raised by egressd while it hands its sandboxes to a successor: changes wait for
    the new one."""

    http_status = 503


class Refused(SandboxError):
    """Raised in a new egressd when the running one is alive and turned the handoff down
    (one is already under way): the new one must not start beside it."""

    http_status = 503


class BadRequest(EgressError):
    """Raised by egressd's API on a request it cannot read: malformed JSON, a missing,
    mistyped or unknown field, a bad query parameter. ``where`` names the part at fault."""

    http_status = 400

    def __init__(self, message: str, where: object = None) -> None:
        super().__init__(message)
        self.where = where

    def http_body(self) -> dict[str, Any]:
        return {"error": str(self), "where": self.where}


class DaemonError(EgressError):
    """Raised by egressctl's client when egressd cannot be reached, or refused the request;
    ``status`` and ``data`` are its HTTP status and JSON error (0 and None if unreached).
    Never answered by egressd (it is raised on egressd's answer): ``http_status`` is the
    root's."""

    def __init__(self, message: str, status: int = 0, data: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.data = data


class LabError(EgressError):
    """The lab could not be brought up, inspected or torn down. The lab is test
    infrastructure, but a broken lab must still say precisely what broke (which command,
    which zone-file line) rather than leave a traceback and half a topology."""


class ZoneFileError(LabError):
    """A lab zone file is malformed; the message starts with file:line:col."""

    def __init__(self, where: Location, message: str) -> None:
        self.where = where
        self.message = message
        super().__init__(f"{where}: {message}")


class LabExistsError(LabError):
    """Raised by ``Lab.up`` when the lab (or one of its netns) is already there."""


class WireError(EgressError):
    """Bytes that are not a DNS message egress can answer (``egress.resolver.wire``, and
    dnslib's errors translated in ``egress.resolver.message_dnslib``). ``rcode`` says how to
    refuse a query (None: drop it silently, e.g. a response, which would make the resolver
    a reflector)."""

    def __init__(self, reason: str, rcode: int | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.rcode = rcode
