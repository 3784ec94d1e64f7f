"""Throwaway labs (see egress.lab): random short names, always torn down.

Each test module (and each benchmark run) gets a lab of its own, named ``PREFIX`` plus 4
hex digits, so two test runs on one machine never share DNS state or query logs.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from egress.lab import Lab


def lab_name(prefix: str = "egl") -> str:
    # Short: the lab's netns names derive from it, and humans read them in `ip netns`.
    return f"{prefix}{secrets.token_hex(2)}"


@contextmanager
def running_lab(zones: str | Path | None = None, prefix: str = "egl") -> Iterator[Lab]:
    """A lab that is up for the body and down afterwards, whatever happened."""
    lab = Lab.up(name=lab_name(prefix), zones=zones)
    try:
        yield lab
    finally:
        lab.down()
