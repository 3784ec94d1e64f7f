"""The observer's per-copy path compiled by mypyc, used when a build matches the sources
(``egress.native``). At cache hits the observer reads two copies a query, a repeat and
its answer, and deals with both here without making an event of either."""

from __future__ import annotations

from pathlib import Path

from egress.native import Native

NATIVE = Native("egress.observer", Path(__file__).resolve().parent, ("answers", "replays", "sift"))
