"""Errors of the lab, rooted in ``EgressError`` so egressctl prints them as one line.

The lab is test infrastructure, but a broken lab must still say precisely what broke
(which command, which zone-file line) rather than leave a traceback and half a topology.
"""

from __future__ import annotations

from egress.errors import EgressError, Location


class LabError(EgressError):
    """The lab could not be brought up, inspected or torn down."""


class ZoneFileError(LabError):
    """A lab zone file is malformed; the message starts with file:line:col."""

    def __init__(self, where: Location, message: str) -> None:
        self.where = where
        self.message = message
        super().__init__(f"{where}: {message}")
