"""Following the journal as it grows: each event once, in the order it is read.

Two processes write the journal (the inline layer and the observer), and an event
carries the time its layer saw it, so one may land a little after a later one. Each
poll therefore looks ``SLACK_S`` back and returns only what it has not returned yet.
Both `egressctl journal --follow` and `egressd --log-journal` read it this way.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable

from egress.store.journal import Journal, Row

POLL_S = 0.25  # how often a follower asks the journal (a read costs ~0.1 ms)
SLACK_S = 60.0


class Follower:
    def __init__(self, journal: Journal, sandbox_id: str | None = None) -> None:
        self.journal = journal
        self.sandbox_id = sandbox_id
        self._seen: dict[tuple[str, object], float] = {}  # (kind, row id) -> its time
        self._newest = time.time()

    def backlog(self, limit: int) -> list[Row]:
        """The last ``limit`` events, oldest first; later polls go on from them."""
        events = list(reversed(self.journal.events(self.sandbox_id, limit=limit)))
        if events:
            self._newest = max(e["at"] for e in events)
        return self._fresh(events)

    def skip_recent(self) -> None:
        """Count what the last ``SLACK_S`` wrote as returned already (a follower that
        starts anew, where its predecessor printed those)."""
        self._fresh(self.journal.events_since(self._newest - SLACK_S, self.sandbox_id, 100_000))

    def poll(self) -> list[Row]:
        """Events not returned yet, oldest first."""
        since = self._newest - SLACK_S
        return self._fresh(self.journal.events_since(since, self.sandbox_id, 100_000))

    def _fresh(self, events: Iterable[Row]) -> list[Row]:
        out = []
        for e in events:
            key = (str(e["kind"]), (e["record"] or {}).get("id"))
            if key not in self._seen:
                self._seen[key] = e["at"]
                self._newest = max(self._newest, e["at"])
                out.append(e)
        for key in [k for k, at in self._seen.items() if at < self._newest - SLACK_S]:
            del self._seen[key]
        return out


def event_json(event: Row) -> str:
    """One event as the JSON line log shippers read (`journal --follow --json`)."""
    return json.dumps(event, default=str, separators=(",", ":"))
