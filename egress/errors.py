"""One error tree for all of egress.

Third-party exceptions (yaml, nftables, netlink, OS errors) are translated into these at
the shell boundary, once, so callers handle a closed set of types and users read one
precise message per problem.
"""

from __future__ import annotations

from dataclasses import dataclass


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


class SandboxError(EgressError):
    """A sandbox could not be created, entered, or torn down."""


class JournalError(EgressError):
    """The violation journal could not be opened or written."""


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
