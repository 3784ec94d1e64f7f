"""The journal's storage: file and pragmas, write locking, tables, migrations, SQL, rows.

Migrations are lists of single statements, not scripts: ``executescript`` commits first,
which would break the one-transaction-per-migration rule that lets several processes open
a fresh journal at the same moment (the loser of ``BEGIN IMMEDIATE`` waits, then sees the
new version and applies nothing).
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import time
from pathlib import Path
from typing import Any

from egress.errors import JournalError
from egress.model import ReviewAction, SandboxState, Violation, ViolationClass
from egress.store.paths import new_private_file, private_dir, tighten

Row = dict[str, Any]

SANDBOX_STATES = tuple(SandboxState)
DECISION_ACTIONS = tuple(ReviewAction)

# Columns ``set_sandbox_state`` may change besides ``state``. A closed list, because the
# names are spliced into SQL.
SANDBOX_FIELDS = (
    "policy", "policy_sha256", "netns", "cgroup", "freezer", "ended_at", "inline_pid",
    "observer_pid", "owner_pid", "uid",
)  # fmt: skip

_V1 = (
    """CREATE TABLE sandboxes (
        id TEXT PRIMARY KEY,
        policy TEXT NOT NULL,
        netns TEXT,
        cgroup TEXT,
        created_at REAL NOT NULL,
        ended_at REAL,
        state TEXT NOT NULL CHECK (state IN ('running', 'frozen', 'exited')),
        inline_pid INTEGER,
        observer_pid INTEGER,
        owner_pid INTEGER
    )""",
    """CREATE TABLE violations (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        sandbox_id TEXT NOT NULL REFERENCES sandboxes (id),
        class TEXT NOT NULL,
        rule TEXT NOT NULL,
        layer TEXT NOT NULL,
        action TEXT NOT NULL,
        detail TEXT NOT NULL,
        at REAL NOT NULL,
        key TEXT NOT NULL,
        evidence TEXT NOT NULL,
        process TEXT,
        detected_by TEXT NOT NULL
    )""",
    "CREATE INDEX violations_by_key ON violations (sandbox_id, class, key, at)",
    "CREATE INDEX violations_by_time ON violations (sandbox_id, at)",
    """CREATE TABLE decisions (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        sandbox_id TEXT NOT NULL REFERENCES sandboxes (id),
        action TEXT NOT NULL CHECK (action IN ('resume', 'kill')),
        uid INTEGER NOT NULL,
        at REAL NOT NULL,
        note TEXT NOT NULL DEFAULT ''
    )""",
    """CREATE TABLE freezes (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        sandbox_id TEXT NOT NULL REFERENCES sandboxes (id),
        requested_at REAL NOT NULL,
        layer TEXT NOT NULL,
        first_violation INTEGER REFERENCES violations (id),
        confirmed_at REAL,
        latency_ms REAL,
        requested_by TEXT NOT NULL,
        decision_id INTEGER REFERENCES decisions (id)
    )""",
    "CREATE INDEX freezes_open ON freezes (sandbox_id, decision_id)",
)

# v2: the v1 freezer cgroup of a sandbox egress did not make (attach, sidecar), so that
# `egressctl resume` can thaw both hierarchies without egressd.
_V2 = ("ALTER TABLE sandboxes ADD COLUMN freezer TEXT",)

# v3: which policy bytes the sandbox enforces (sha256, hex, of the file as read once), and
# the uid its workload runs as.
_V3 = (
    "ALTER TABLE sandboxes ADD COLUMN policy_sha256 TEXT",
    "ALTER TABLE sandboxes ADD COLUMN uid INTEGER",
)

# v4: mode: audit's deduplicated record for `egressctl learn` (store.audit_sql).
_V4 = (
    """CREATE TABLE audit_names (
        sandbox_id TEXT NOT NULL REFERENCES sandboxes (id),
        name TEXT NOT NULL,
        qtype INTEGER NOT NULL,
        verdict TEXT NOT NULL,
        count INTEGER NOT NULL,
        first_seen REAL NOT NULL,
        last_seen REAL NOT NULL,
        risks TEXT NOT NULL DEFAULT '[]',
        chain TEXT NOT NULL DEFAULT '[]',
        PRIMARY KEY (sandbox_id, name, qtype)
    )""",
    """CREATE TABLE audit_connects (
        sandbox_id TEXT NOT NULL REFERENCES sandboxes (id),
        address TEXT NOT NULL,
        proto TEXT NOT NULL,
        port INTEGER NOT NULL,
        verdict TEXT NOT NULL,
        count INTEGER NOT NULL,
        first_seen REAL NOT NULL,
        last_seen REAL NOT NULL,
        names TEXT NOT NULL DEFAULT '[]',
        asked TEXT NOT NULL DEFAULT '[]',
        PRIMARY KEY (sandbox_id, address, proto, port)
    )""",
    """CREATE TABLE audit_overflow (
        sandbox_id TEXT PRIMARY KEY REFERENCES sandboxes (id),
        names INTEGER NOT NULL DEFAULT 0,
        connects INTEGER NOT NULL DEFAULT 0
    )""",
)

# The freeze intents already folded into this journal (store/intents.py), so none is
# folded twice; a file's tokens go when the file does.
_V5 = ("CREATE TABLE folded_intents (token TEXT PRIMARY KEY) WITHOUT ROWID",)

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    _V1,
    _V2,
    _V3,
    _V4,
    _V5,
)  # MIGRATIONS[n - 1] brings n - 1 to n
SCHEMA_VERSION = len(MIGRATIONS)


def migrate(conn: sqlite3.Connection) -> None:
    """Bring the schema to SCHEMA_VERSION, one transaction per version."""
    while True:
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_version "
                "(version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)"
            )
            version = current_version(conn)
            if version > SCHEMA_VERSION:
                raise JournalError(
                    f"journal schema version {version} is newer than this egress "
                    f"understands ({SCHEMA_VERSION}); upgrade egress"
                )
            if version == SCHEMA_VERSION:
                conn.execute("COMMIT")
                return
            for statement in MIGRATIONS[version]:
                conn.execute(statement)
            conn.execute("INSERT INTO schema_version VALUES (?, ?)", (version + 1, time.time()))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise


def current_version(conn: sqlite3.Connection) -> int:
    row = conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()
    return int(row[0])


def violation_key(violation: Violation) -> str:
    """The cross-layer dedup key: ``qname/qtype`` for a DNS verdict, else the flow's
    5-tuple (a ``name_mismatch`` too: two flows asking for one name are two events),
    else ``""``, plus the class when there is neither.

    Both layers must derive it the same way: a DNS verdict is keyed by the question
    (the observer also knows the query's packet, the resolver only its question), and
    the name is folded to lowercase without its trailing dot.
    """
    if violation.qname is not None and violation.cls is not ViolationClass.NAME_MISMATCH:
        return f"{violation.qname.rstrip('.').lower()}/{violation.qtype or ''}"
    if violation.flow is not None:
        return str(violation.flow)
    return violation.cls.value


def evidence(violation: Violation) -> dict[str, object]:
    data = violation.to_json()
    return {k: data[k] for k in ("flow", "qname", "qtype", "uid") if k in data}


def violation_row(sandbox_id: str, v: Violation) -> tuple[object, ...]:
    detected_by = [{"layer": v.layer, "at": v.at}]
    return (
        sandbox_id, v.cls.value, v.rule, v.layer, v.action.value, v.detail, v.at,
        violation_key(v), dumps(evidence(v)), None, dumps(detected_by),
    )  # fmt: skip


# The timeline behind ``Journal.events``: one mark per thing that happened, pointing at
# the row that holds its details (``tbl``, ``ref``); ``ord`` breaks ties in causal order.
_EVENTS = """
SELECT kind, at, sandbox_id, tbl, ref FROM (
    SELECT 'sandbox_started' AS kind, created_at AS at, id AS sandbox_id,
           'sandboxes' AS tbl, id AS ref, 0 AS ord FROM sandboxes
    UNION ALL SELECT 'violation', at, sandbox_id, 'violations', id, 1 FROM violations
    UNION ALL SELECT 'freeze_requested', requested_at, sandbox_id, 'freezes', id, 2 FROM freezes
    UNION ALL SELECT 'frozen', confirmed_at, sandbox_id, 'freezes', id, 3 FROM freezes
              WHERE confirmed_at IS NOT NULL
    UNION ALL SELECT 'decision', at, sandbox_id, 'decisions', id, 4 FROM decisions
    UNION ALL SELECT 'sandbox_ended', ended_at, id, 'sandboxes', id, 5 FROM sandboxes
              WHERE ended_at IS NOT NULL
)
WHERE (? IS NULL OR sandbox_id = ?)
"""
EVENTS_SQL = _EVENTS + "ORDER BY at DESC, ord DESC, ref DESC LIMIT ?"
# From a time on, oldest first: what ``egressctl journal --follow`` polls for.
EVENTS_SINCE_SQL = _EVENTS + "AND at >= ? ORDER BY at, ord, ref LIMIT ?"

_JSON_COLUMNS = ("evidence", "process", "detected_by", "requested_by")


def as_dict(row: sqlite3.Row) -> Row:
    out = dict(row)
    for column in _JSON_COLUMNS:
        if out.get(column) is not None:
            out[column] = json.loads(out[column])
    return out


def dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


FIND_SQL = "SELECT id FROM violations WHERE sandbox_id = ? AND class = ? AND key = ? AND at >= ?"
NEWEST = " ORDER BY at DESC, id DESC LIMIT 1"
NEW_VIOLATION_SQL = (
    "INSERT INTO violations (sandbox_id, class, rule, layer, action, detail, at, key, "
    "evidence, process, detected_by) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
OPEN_FREEZE_SQL = (
    "SELECT * FROM freezes WHERE sandbox_id = ? AND decision_id IS NULL ORDER BY id DESC LIMIT 1"
)
NEW_FREEZE_SQL = (
    "INSERT INTO freezes (sandbox_id, requested_at, layer, first_violation, requested_by) "
    "VALUES (?, ?, ?, ?, ?)"
)


def exists(conn: sqlite3.Connection, table: str, key: object) -> bool:
    return conn.execute(f"SELECT 1 FROM {table} WHERE id = ?", (key,)).fetchone() is not None


def insert(conn: sqlite3.Connection, sql: str, args: tuple[object, ...]) -> int:
    rowid = conn.execute(sql, args).lastrowid
    assert rowid is not None  # an INSERT always sets it
    return rowid


def timeline(
    conn: sqlite3.Connection, sandbox_id: str | None, limit: int, since: float | None = None
) -> list[Row]:
    if since is None:
        marks = conn.execute(EVENTS_SQL, (sandbox_id, sandbox_id, limit)).fetchall()
    else:
        marks = conn.execute(EVENTS_SINCE_SQL, (sandbox_id, sandbox_id, since, limit)).fetchall()
    records = {tbl: _by_id(conn, tbl, [m["ref"] for m in marks if m["tbl"] == tbl])
               for tbl in {m["tbl"] for m in marks}}  # fmt: skip
    return [
        {"kind": m["kind"], "at": m["at"], "sandbox_id": m["sandbox_id"],
         "record": records[m["tbl"]].get(m["ref"])}
        for m in marks
    ]  # fmt: skip


def _by_id(conn: sqlite3.Connection, table: str, ids: list[object]) -> dict[object, Row]:
    marks = ", ".join("?" * len(ids))
    rows = conn.execute(f"SELECT * FROM {table} WHERE id IN ({marks})", ids)
    return {r["id"]: as_dict(r) for r in rows}


def configure(conn: sqlite3.Connection, path: Path, timeout_s: float) -> None:
    conn.row_factory = sqlite3.Row
    mode = _wal_mode(conn, timeout_s)
    if str(mode).lower() != "wal":
        raise JournalError(f"{path}: cannot use WAL (journal_mode is {mode}); local disk?")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute("PRAGMA foreign_keys = ON")


def _wal_mode(conn: sqlite3.Connection, timeout_s: float) -> object:
    """``PRAGMA journal_mode = WAL``, polled while busy until ``timeout_s`` has passed.

    On a journal nobody has written yet the switch needs the exclusive lock while this
    connection holds a shared one; if another process is in its first write transaction
    (holding RESERVED) SQLite returns BUSY at once instead of calling the busy handler,
    which could deadlock there. Processes opening a fresh journal together hit that.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        except sqlite3.OperationalError as exc:
            if not _is_busy(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(random.uniform(0.0001, 0.001))


def begin_immediate(conn: sqlite3.Connection, timeout_s: float) -> None:
    """Take the write lock, polling every ~0.5 ms until ``timeout_s`` has passed.

    SQLite's own busy handler backs off to 100 ms sleeps, so a writer behind another
    process's burst waited 430 ms in tests: too long in front of a freeze. Polling
    brought that worst case to tens of ms.
    """
    deadline = time.monotonic() + timeout_s
    conn.execute("PRAGMA busy_timeout = 0")
    try:
        while True:
            try:
                conn.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc) or time.monotonic() >= deadline:
                    raise
            time.sleep(random.uniform(0.0001, 0.001))  # jitter: waiters do not march
    finally:
        conn.execute(f"PRAGMA busy_timeout = {round(timeout_s * 1000)}")


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)  # the extended code: BUSY_RECOVERY too
    return code & 0xFF == sqlite3.SQLITE_BUSY if code is not None else "locked" in str(exc)


JOURNAL_FILES = ("", "-wal", "-shm")  # the database and SQLite's companions


def make_private(directory: Path, path: Path) -> None:
    """The state dir 0750 and the database 0640, root's and the egress group's
    (``paths.private_dir``); SQLite gives the -wal and -shm files the database's mode and
    owner. Existing ones made looser (by an older egress) are narrowed, never widened."""
    private_dir(directory)
    if not new_private_file(path):
        for suffix in JOURNAL_FILES:
            tighten(path.with_name(path.name + suffix))


def fsync_dir(directory: Path) -> None:
    """Make the new files' directory entries durable too, not only their contents."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise JournalError(f"{directory}: cannot open state dir: {exc.strerror}") from exc
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
