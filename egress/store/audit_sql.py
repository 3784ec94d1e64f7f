"""The journal's audit tables: what a sandbox in mode: audit asked and connected to.

One row per distinct (sandbox, name, type) and (sandbox, address, proto, port), so a day
of audit costs kilobytes: a batch from the resolver's AuditLog adds its counts and widens
first/last seen. The cap per sandbox holds here too (a restarted egressd starts a fresh
AuditLog): a key beyond it is counted in ``audit_overflow``, not stored.
"""

from __future__ import annotations

import json
import sqlite3

from egress.resolver.audit import AUDIT_CAP, AuditBatch
from egress.store.journal_schema import Row, as_dict


def record(
    conn: sqlite3.Connection, sandbox_id: str, batch: AuditBatch, cap: int = AUDIT_CAP
) -> None:
    """Add ``batch`` to the sandbox's rows (inside the caller's write transaction)."""
    over_names = batch.over_cap_names + _names(conn, sandbox_id, batch, cap)
    over_connects = batch.over_cap_connects + _connects(conn, sandbox_id, batch, cap)
    if over_names or over_connects:
        conn.execute(
            "INSERT INTO audit_overflow (sandbox_id, names, connects) VALUES (?, ?, ?) "
            "ON CONFLICT (sandbox_id) DO UPDATE SET names = names + excluded.names, "
            "connects = connects + excluded.connects",
            (sandbox_id, over_names, over_connects),
        )


class _Cap:
    """How many distinct rows a sandbox's table may still take; what it refused."""

    def __init__(self, conn: sqlite3.Connection, table: str, sandbox_id: str, cap: int) -> None:
        row = conn.execute(f"SELECT COUNT(*) FROM {table} WHERE sandbox_id = ?", (sandbox_id,))
        self.stored = int(row.fetchone()[0])
        self.cap = cap
        self.over = 0

    def admit(self, count: int) -> bool:
        if self.stored >= self.cap:
            self.over += count
            return False
        self.stored += 1
        return True


def _merged(old: str | None, new: tuple[str, ...]) -> str:
    """A JSON list column with ``new`` appended, once each, in order."""
    return json.dumps(list(dict.fromkeys([*json.loads(old or "[]"), *new])))


def _names(conn: sqlite3.Connection, sandbox_id: str, batch: AuditBatch, cap: int) -> int:
    room = _Cap(conn, "audit_names", sandbox_id, cap)
    for r in batch.names:
        key = (sandbox_id, r.name, r.qtype)
        old = conn.execute(
            "SELECT risks, chain FROM audit_names WHERE sandbox_id = ? AND name = ? AND qtype = ?",
            key,
        ).fetchone()
        if old is None:
            if room.admit(r.count):
                conn.execute(
                    "INSERT INTO audit_names VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (*key, r.verdict, r.count, r.first, r.last, _merged(None, r.risks),
                     _merged(None, r.chain)),
                )  # fmt: skip
            continue
        conn.execute(
            "UPDATE audit_names SET count = count + ?, first_seen = MIN(first_seen, ?), "
            "last_seen = MAX(last_seen, ?), risks = ?, chain = ? "
            "WHERE sandbox_id = ? AND name = ? AND qtype = ?",
            (r.count, r.first, r.last, _merged(old[0], r.risks), _merged(old[1], r.chain), *key),
        )
    return room.over


def _connects(conn: sqlite3.Connection, sandbox_id: str, batch: AuditBatch, cap: int) -> int:
    room = _Cap(conn, "audit_connects", sandbox_id, cap)
    for r in batch.connects:
        key = (sandbox_id, r.address, r.proto, r.port)
        old = conn.execute(
            "SELECT verdict, names, asked FROM audit_connects "
            "WHERE sandbox_id = ? AND address = ? AND proto = ? AND port = ?",
            key,
        ).fetchone()
        if old is None:
            if room.admit(r.count):
                conn.execute(
                    "INSERT INTO audit_connects VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (*key, r.verdict, r.count, r.first, r.last, _merged(None, r.names),
                     _merged(None, r.asked)),
                )  # fmt: skip
            continue
        verdict = r.verdict if r.verdict != "allowed" else old[0]  # a block, once, stays
        conn.execute(
            "UPDATE audit_connects SET verdict = ?, count = count + ?, "
            "first_seen = MIN(first_seen, ?), last_seen = MAX(last_seen, ?), names = ?, "
            "asked = ? WHERE sandbox_id = ? AND address = ? AND proto = ? AND port = ?",
            (verdict, r.count, r.first, r.last, _merged(old[1], r.names),
             _merged(old[2], r.asked), *key),
        )  # fmt: skip
    return room.over


def read(conn: sqlite3.Connection, table: str, sandbox_ids: list[str], since: float) -> list[Row]:
    """Rows of ``table`` (audit_names, audit_connects) of these sandboxes last seen at or
    after ``since``; the JSON columns decoded."""
    if table not in ("audit_names", "audit_connects"):
        raise ValueError(table)
    marks = ", ".join("?" * len(sandbox_ids))
    rows = [
        as_dict(r)
        for r in conn.execute(
            f"SELECT * FROM {table} WHERE sandbox_id IN ({marks}) AND last_seen >= ? "
            "ORDER BY sandbox_id, first_seen",
            (*sandbox_ids, since),
        )
    ]
    for row in rows:
        for column in ("risks", "names", "chain", "asked"):
            if column in row:
                row[column] = json.loads(row[column])
    return rows


def overflow(conn: sqlite3.Connection, sandbox_ids: list[str]) -> Row:
    """Entries not recorded because a sandbox's cap was reached, summed."""
    marks = ", ".join("?" * len(sandbox_ids))
    found = conn.execute(
        f"SELECT COALESCE(SUM(names), 0), COALESCE(SUM(connects), 0) FROM audit_overflow "
        f"WHERE sandbox_id IN ({marks})",
        tuple(sandbox_ids),
    ).fetchone()
    return {"names": int(found[0]), "connects": int(found[1])}


def sandboxes(conn: sqlite3.Connection, since: float) -> list[str]:
    """Sandboxes with audit rows seen at or after ``since``, oldest first."""
    rows = conn.execute(
        "SELECT sandbox_id, MIN(first_seen) AS f FROM ("
        "SELECT sandbox_id, first_seen, last_seen FROM audit_names UNION ALL "
        "SELECT sandbox_id, first_seen, last_seen FROM audit_connects) "
        "WHERE last_seen >= ? GROUP BY sandbox_id ORDER BY f",
        (since,),
    )
    return [str(r[0]) for r in rows]
