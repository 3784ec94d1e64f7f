"""One error tree for all of egress.

Third-party exceptions (yaml, nftables, netlink, OS errors) are translated into these at
the shell boundary, once, so callers handle a closed set of types and users read one
precise message per problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class EgressError(Exception):
    """Root of every error egress raises on purpose."""


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


class DatapathError(EgressError):
    """nftables or netlink refused an operation; the message carries the kernel's text."""


class UpstreamError(EgressError):
    """No upstream DNS server gave a usable answer."""


class JournalError(EgressError):
    """The violation journal could not be opened or written."""


class SandboxError(EgressError):
    """A sandbox could not be created, entered, attached, served or torn down."""


class AlreadyAttached(SandboxError):
    """Raised by ``sandbox.attach`` when the netns already holds an ``inet egress`` table
    (another egress serves it); egressd's registry answers it as a ``Conflict``."""


class Stopped(SandboxError):
    """Raised by ``egressctl run`` on SIGTERM or SIGHUP before its command started: it
    tears down what it made and goes."""


class NotFound(SandboxError):
    """Raised by egressd when no sandbox it serves (or that its journal knows) has the id
    a request names."""


class Conflict(SandboxError):
    """Raised by egressd when a request collides with what it already serves: an id or
    netns in use, a resume of a sandbox that is not frozen."""


class Busy(SandboxError):
    """Raised by egressd while it hands its sandboxes to a successor: changes wait for
    the new one."""


class Refused(SandboxError):
    """Raised in a new egressd when the running one is alive and turned the handoff down
    (one is already under way): the new one must not start beside it."""


class BadRequest(EgressError):
    """Raised by egressd's API on a request it cannot read: malformed JSON, a missing,
    mistyped or unknown field, a bad query parameter. ``where`` names the part at fault."""

    def __init__(self, message: str, where: object = None) -> None:
        super().__init__(message)
        self.where = where


class DaemonError(EgressError):
    """Raised by egressctl's client when egressd cannot be reached, or refused the request;
    ``status`` and ``data`` are its HTTP status and JSON error (0 and None if unreached)."""

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
