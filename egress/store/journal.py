"""The violation journal: what each sandbox tried, who froze it, who let it go.

Journal before act (DESIGN.md invariant 5). A layer that decides to freeze calls
``write_intent`` and only freezes after it returns; by then the violation and the freeze
request are on disk in its intent file (store/intents.py), and ``record_for_freeze``
commits them here right after the freeze. Without an intent file it calls
``record_for_freeze`` first and freezes after that commit. Either way, if the freeze then
kills the box, the person who resumes it still reads why. The order is: violation and
freeze request durable -> cgroup frozen -> committed here (with an intent) ->
``confirm_freeze`` (the confirmation is journaled after the fact, with its latency).

Storage is one SQLite file, ``<state dir>/journal.db``, in WAL mode with
``synchronous=FULL``. What survives what:

- The writer being killed (``kill -9``, OOM, a crash mid-commit): every transaction that
  returned survives, a half-written one vanishes whole. WAL recovery runs on next open.
- The machine losing power or the kernel panicking: still every returned transaction,
  because FULL fsyncs the WAL at each commit (NORMAL, the usual WAL setting, may lose the
  last few). That is one fdatasync per violation (0.2 ms on the dev VM, a few ms on a
  real disk); violations are rare, evidence is not optional.
- Not covered: a disk that acknowledges flushes it has not done, and copying
  ``journal.db`` without its ``-wal`` file (use ``sqlite3 journal.db .backup``).

Several processes write at once (inline layer, observer layer, ``egressctl``). Every
write takes the write lock up front (``BEGIN IMMEDIATE``) and waits up to the busy timeout
for it, so a reader never has to upgrade to a writer (SQLite cannot wait for that: it
fails "database is locked" at once). Within a process, one lock serialises the one
connection, so threads may share a Journal. Calls block (one fsync, or a wait for the
lock): asyncio code calls them through ``asyncio.to_thread``.

sqlite3 and OS errors become JournalError here, once, with the file's path.
"""

from __future__ import annotations

import contextlib
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

from egress.errors import JournalError
from egress.model import SandboxState, Violation, ViolationClass
from egress.resolver.audit import AuditBatch
from egress.store import audit_sql
from egress.store import intents as intents_file
from egress.store import journal_schema as schema
from egress.store.intents import Intent, IntentLog

JOURNAL_FILE = "journal.db"
BUSY_TIMEOUT_S = 10.0
# Why a person's resume left the sandbox frozen (Journal.resume; freeze.review says it).
STILL_PENDING = "a layer's freeze of it is not journaled yet"
FROZEN_AGAIN = "a freeze of it was journaled as it was resumed"
_RUNNING_AGAIN = "UPDATE sandboxes SET state = 'running' WHERE id = ? AND state = 'frozen'"

Row = schema.Row


class Recorded(NamedTuple):
    violation_id: int
    first: bool  # this call created the row (else it added a detection to it)


class FreezeRecorded(NamedTuple):
    violation_id: int
    first: bool
    freeze_id: int | None  # None: a person already decided on this violation's freeze


class Retried(NamedTuple):
    """A refused record committed again (Journal.commit_pinned), and its violation."""

    violation_id: int
    first: bool
    freeze_id: int | None  # None: a person already decided on this violation's freeze
    violation: Violation


class Journal:
    """One connection to the journal. Open with ``Journal.open(state_dir)``."""

    def __init__(
        self, conn: sqlite3.Connection, path: Path, busy_timeout_s: float = BUSY_TIMEOUT_S
    ) -> None:
        self._conn: sqlite3.Connection | None = conn
        self._path = path
        self._busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()
        self._intents: IntentLog | None = None  # made by a layer (open_intents)

    @classmethod
    def open(cls, state_dir: str | Path, *, busy_timeout_s: float = BUSY_TIMEOUT_S) -> Journal:
        """Open (creating dir 0750 and file 0640, egress's group, if needed), migrate, and
        fold what layers that died left in their intent files (store/intents.py)."""
        directory = Path(state_dir)
        path = directory / JOURNAL_FILE
        try:
            schema.make_private(directory, path)
        except OSError as exc:
            raise JournalError(f"{path}: cannot create: {exc.strerror}") from exc
        try:
            conn = sqlite3.connect(
                path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise JournalError(f"{path}: cannot open: {exc}") from exc
        journal = cls(conn, path, busy_timeout_s)
        try:
            with journal._errors("open"):
                schema.configure(conn, path, busy_timeout_s)
                schema.migrate(conn)
            schema.fsync_dir(directory)
        except BaseException:
            journal.close()
            raise
        journal.fold_intents_or_say("egress")
        return journal

    @property
    def path(self) -> Path:
        return self._path

    def close(self) -> None:
        log, self._intents = self._intents, None
        if log is not None:
            self._commit_pinned(log)
            # Every record committed: the file goes, and its tokens after it (a crash in
            # between leaves tokens naming no file, which fold nothing). Else it stays,
            # unlocked, for the next open to fold.
            removed = False
            with contextlib.suppress(OSError, JournalError):
                removed = log.close()
            if removed:
                with contextlib.suppress(JournalError):
                    self._forget_intents([log.stem])
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> Journal:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- sandboxes ---------------------------------------------------------------------

    def record_sandbox(
        self,
        sandbox_id: str,
        policy: str,
        *,
        netns: str | None = None,
        cgroup: str | None = None,
        created_at: float | None = None,
        state: str = SandboxState.RUNNING,
        inline_pid: int | None = None,
        observer_pid: int | None = None,
        owner_pid: int | None = None,
        freezer: str | None = None,
        policy_sha256: str | None = None,
        uid: int | None = None,
    ) -> None:
        """Journal a new sandbox. ``policy`` is its policy's name; ``policy_sha256`` the
        hex sha256 of the policy file's bytes as egress read them; ``uid`` its workload's."""
        self._check_state(state)
        at = time.time() if created_at is None else created_at
        row = (sandbox_id, policy, policy_sha256, netns, cgroup, freezer, at, state,
               inline_pid, observer_pid, owner_pid, uid)  # fmt: skip
        with self._write(f"record sandbox {sandbox_id!r}") as conn:
            if schema.exists(conn, "sandboxes", sandbox_id):
                raise JournalError(f"{self._path}: sandbox {sandbox_id!r} is already journaled")
            conn.execute(
                "INSERT INTO sandboxes (id, policy, policy_sha256, netns, cgroup, freezer, "
                "created_at, state, inline_pid, observer_pid, owner_pid, uid) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                row,
            )

    def set_sandbox_state(self, sandbox_id: str, state: str, **fields: object) -> None:
        """Set ``state`` and any of SANDBOX_FIELDS; ``exited`` stamps ``ended_at`` if unset."""
        self._check_state(state)
        unknown = sorted(set(fields) - set(schema.SANDBOX_FIELDS))
        if unknown:
            raise JournalError(f"{self._path}: not a sandbox field: {', '.join(unknown)}")
        if state == SandboxState.EXITED:
            fields.setdefault("ended_at", time.time())
        sets = "".join(f", {name} = ?" for name in fields)
        with self._write(f"set state of sandbox {sandbox_id!r}") as conn:
            self._require(conn, "sandboxes", sandbox_id, "sandbox")
            conn.execute(
                f"UPDATE sandboxes SET state = ?{sets} WHERE id = ?",
                (state, *fields.values(), sandbox_id),
            )

    def update_sandbox(self, sandbox_id: str, **fields: object) -> None:
        """Set any of SANDBOX_FIELDS, leaving the state as it is."""
        unknown = sorted(set(fields) - set(schema.SANDBOX_FIELDS))
        if unknown or not fields:
            raise JournalError(f"{self._path}: not sandbox fields: {', '.join(unknown)}")
        sets = ", ".join(f"{name} = ?" for name in fields)
        with self._write(f"update sandbox {sandbox_id!r}") as conn:
            self._require(conn, "sandboxes", sandbox_id, "sandbox")
            conn.execute(
                f"UPDATE sandboxes SET {sets} WHERE id = ?", (*fields.values(), sandbox_id)
            )

    def sandboxes(self) -> list[Row]:
        return self._select("SELECT * FROM sandboxes ORDER BY created_at DESC, id", ())

    def sandbox(self, sandbox_id: str) -> Row | None:
        rows = self._select("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,))
        return rows[0] if rows else None

    # -- violations --------------------------------------------------------------------

    def record_violation(self, sandbox_id: str, violation: Violation) -> int:
        """Journal one violation; it is durable (committed, fsync'd) when this returns.

        If it raises JournalError nothing was recorded. Whether to freeze anyway is the
        caller's decision (failing closed says yes, and log it).
        """
        with self._write(f"record violation for sandbox {sandbox_id!r}") as conn:
            return self._insert_violation(conn, sandbox_id, violation)

    def record_or_detect(self, sandbox_id: str, violation: Violation, within_s: float) -> Recorded:
        """``find_recent_violation`` then record or detect, as one transaction.

        Two layers seeing the same packet race; done in two calls, both may insert.
        Returns (violation id, whether this call created the row).
        """
        with self._write(f"record violation for sandbox {sandbox_id!r}") as conn:
            return self._record_or_detect(conn, sandbox_id, violation, within_s)

    def _record_or_detect(
        self, conn: sqlite3.Connection, sandbox_id: str, violation: Violation, within_s: float
    ) -> Recorded:
        key = schema.violation_key(violation)
        args = (sandbox_id, violation.cls.value, key,
                violation.at - within_s, violation.at + within_s)  # fmt: skip
        row = conn.execute(schema.FIND_SQL + " AND at <= ?" + schema.NEWEST, args).fetchone()
        if row is None:
            return Recorded(self._insert_violation(conn, sandbox_id, violation), True)
        self._add_detection(conn, int(row[0]), violation.layer, violation.at)
        return Recorded(int(row[0]), False)

    def record_for_freeze(
        self,
        sandbox_id: str,
        violation: Violation,
        within_s: float,
        at: float,
        intent: Intent | None = None,
    ) -> FreezeRecorded:
        """``record_or_detect`` and ``record_freeze_request`` as ONE durable commit: the
        freeze path pays one fsync before the freeze instead of two.

        Returns (violation id, whether this layer saw it first, freeze id). The freeze id
        is None when the violation already caused a freeze a person has decided on: the
        caller must not freeze again for it.

        ``intent``: this record, written by ``write_intent`` before the freeze; its
        token is committed with it, and its slot freed once that commit returns.
        """
        folded = False
        try:
            with self._write(f"record violation for sandbox {sandbox_id!r}") as conn:
                acted = intent is not None
                recorded = self._record_for_freeze(
                    conn, sandbox_id, violation, within_s, at, acted=acted
                )
                if intent is not None:
                    conn.execute("INSERT INTO folded_intents VALUES (?)", (intent.token,))
            folded = True
        finally:
            log = self._intents
            if intent is not None and log is not None:
                log.done(intent, folded)
        return recorded

    def commit_pinned(
        self,
        wait: bool = True,
        sandbox_id: str | None = None,
        freeze_again: Callable[[], object] | None = None,
    ) -> list[Retried]:
        """Commit the records of this process's intent file SQLite refused before (a
        full disk, a lock held past the busy timeout), those of ``sandbox_id`` if given:
        durable in the file, but no one reads them there while this process lives.

        Each is committed as its layer's own commit would have been (``record_for_freeze``
        with its intent): it opens a freeze for a person, or joins the freeze a person
        already decided on that violation (``freeze_id`` None: the caller settles it,
        Enforcer.retry_pinned). The sandbox must be frozen for one it opened:
        ``freeze_again`` (given with ``sandbox_id``) is called after each such commit, in
        its transaction, as a resume while the record was pinned found no freeze open
        and thawed. It should only write, not wait; a commit that fails after it leaves
        the sandbox frozen with the record pending, which counts as open. Without
        ``wait``, where another holds SQLite's write lock, the records are left for the
        next try (the layer's tick); close calls it with ``wait``."""
        log = self._intents
        if log is None:
            return []
        return self._commit_pinned(log, wait, sandbox_id, freeze_again)

    def has_pinned(self, sandbox_id: str) -> bool:
        """Whether this process holds records of ``sandbox_id`` SQLite refused (no lock
        taken, no read: a tick may ask it of every sandbox)."""
        log = self._intents
        return log is not None and log.has_pinned(sandbox_id)

    def _commit_pinned(
        self,
        log: IntentLog,
        wait: bool = True,
        sandbox_id: str | None = None,
        freeze_again: Callable[[], object] | None = None,
    ) -> list[Retried]:
        left = log.take_pinned(sandbox_id)
        committed: list[Retried] = []
        try:
            while left:
                intent = left[0]
                record = intent.stored
                recorded = None
                try:
                    with self._write("commit a freeze intent again", None if wait else 0.0) as conn:
                        recorded = self._retry_one(conn, intent.token, record)
                        opened = recorded is not None and recorded.freeze_id is not None
                        if opened and freeze_again is not None:
                            freeze_again()
                except _NotAnIntent as exc:  # its sandbox gone from the journal meanwhile
                    try:
                        self._keep_aside(log.stem, [exc.entry(intent.token, record)])
                    except OSError:
                        left.pop(0)
                        log.done(intent, folded=False)  # kept in the file: the next open's
                        continue
                except JournalError:
                    return committed  # still refused: the next try, or the next open's fold
                left.pop(0)
                log.done(intent, folded=True)
                if recorded is not None:
                    committed.append(recorded)
        finally:
            for intent in left:  # refused, or anything raised: pinned again, none dropped
                log.done(intent, folded=False)
        return committed

    def _retry_one(
        self, conn: sqlite3.Connection, token: str, record: dict[str, object]
    ) -> Retried | None:
        """A live layer's refused record, committed (within ``conn``'s transaction) as
        its own commit would have been; None where SQLite holds it already."""
        if _folded(conn, token):
            return None
        sandbox_id, violation, within_s, at = self._intent_of(conn, record)
        recorded = self._record_for_freeze(conn, sandbox_id, violation, within_s, at, acted=True)
        _folded_in(conn, token, sandbox_id if recorded.freeze_id is not None else None)
        return Retried(*recorded, violation)

    def _record_for_freeze(
        self,
        conn: sqlite3.Connection,
        sandbox_id: str,
        violation: Violation,
        within_s: float,
        at: float,
        *,
        acted: bool = False,
    ) -> FreezeRecorded:
        """``acted``: the layer froze already (its intent was durable first); where a
        person has decided this violation's freeze, its request joins that one, so the
        thaw that undoes it (``thaw_if_resumed``) is journaled on it."""
        vid, first = self._record_or_detect(conn, sandbox_id, violation, within_s)
        decided = None if first else self._decided_freeze(conn, vid)
        if decided is not None:
            if acted:
                row = conn.execute("SELECT id, requested_by FROM freezes WHERE id = ?", (decided,))
                ask = {"layer": violation.layer, "at": at, "violation_id": vid}
                self._join(conn, row.fetchone(), ask)
            return FreezeRecorded(vid, first, None)
        freeze_id = self._freeze_request(conn, sandbox_id, violation.layer, vid, at)
        return FreezeRecorded(vid, first, freeze_id)

    # -- freeze intents (store/intents.py) ---------------------------------------------

    def open_intents(self) -> None:
        """Give this process an intent file, so that its freezes need not wait for
        SQLite's commit (``write_intent``). A layer calls it once, before its first
        violation; where the file cannot be made, freezes commit to SQLite first."""
        if self._intents is not None:
            return
        try:
            self._intents = IntentLog.create(self._path.parent)
        except OSError as exc:
            raise JournalError(
                f"{self._path.parent / intents_file.DIR}: cannot make an intent file: "
                f"{exc.strerror or exc}"
            ) from exc

    def write_intent(
        self, sandbox_id: str, violation: Violation, within_s: float, at: float
    ) -> Intent | None:
        """What ``record_for_freeze`` (same arguments) will commit, durable when this
        returns, in this process's intent file: freeze, then call that with it. None
        where there is none (no ``open_intents``, or no slot free): commit first."""
        log = self._intents
        if log is None:
            return None
        record: dict[str, object] = {
            "violation": violation.to_json(), "within_s": within_s, "asked_at": at,
        }  # fmt: skip
        try:
            return log.write(sandbox_id, record)
        except OSError as exc:
            raise JournalError(f"{log.path}: cannot write: {exc.strerror or exc}") from exc

    def decided_freeze(self, violation_id: int) -> int | None:
        """The freeze a person decided on that ``violation_id`` caused or joined."""
        with self._read(f"read freezes of violation {violation_id}") as conn:
            return self._decided_freeze(conn, violation_id)

    def fold_intents(self) -> int:
        """Fold into SQLite the intents of layers that ended before they could (a crash
        between an intent and its commit); returns how many records were new here.

        A record this journal cannot take (its sandbox unknown here, or not a freeze
        intent this version reads) is kept aside, ``intents/kept/``, with a line on
        stderr: it cannot be attached to anything a person reviews here."""
        folded = 0
        with intents_file.orphans(self._path.parent) as found:
            if not found:
                return 0
            done: list[str] = []
            kept: dict[str, list[dict[str, object]]] = {}
            with self._write("fold freeze intents") as conn:
                for _, stem, data in found:
                    for seq, record in intents_file.records(data):
                        token = intents_file.token(stem, seq)
                        try:
                            folded += self._fold_one(conn, token, record)
                        except _NotAnIntent as exc:
                            kept.setdefault(stem, []).append(exc.entry(token, record))
                    done.append(stem)
            try:
                for stem, entries in kept.items():  # before their files go
                    self._keep_aside(stem, entries)
            except OSError as exc:
                raise JournalError(
                    f"cannot keep aside freeze intents this journal cannot take: {exc}; "
                    "their files stay, for the next open"
                ) from exc
            try:
                intents_file.remove([path for path, _, _ in found])
            except OSError as exc:
                raise JournalError(f"cannot remove folded intent files: {exc}") from exc
        self._forget_intents(done)
        return folded

    def _keep_aside(self, stem: str, entries: list[dict[str, object]]) -> None:
        """Raises OSError where they cannot be kept: their intent file stays then."""
        path = intents_file.keep_aside(self._path.parent, stem, entries)
        why = "; ".join(sorted({str(e["why"]) for e in entries}))
        print(f"egress: {len(entries)} freeze intent(s) not journaled ({why}): kept in {path}",
              file=sys.stderr)  # fmt: skip

    def fold_intents_or_say(self, who: str) -> None:
        """``fold_intents``, where a failure is only said on stderr: the journal is still
        there to read, and the next open (or death of a layer) folds them again."""
        try:
            self.fold_intents()
        except JournalError as exc:
            print(f"{who}: could not fold freeze intents: {exc}", file=sys.stderr)

    def _fold_one(self, conn: sqlite3.Connection, token: str, record: dict[str, object]) -> bool:
        """Commit one intent's record (within ``conn``'s transaction); False where SQLite
        holds it already. _NotAnIntent, before any write, where it cannot be taken."""
        if _folded(conn, token):
            return False
        sandbox_id, violation, within_s, at = self._intent_of(conn, record)
        # Whether the dead layer's freeze landed, and when, is unknown: a person decides
        # it, even where a freeze of this violation was decided before (that freeze may
        # have landed after the decision, with no layer left to thaw it again).
        vid, _ = self._record_or_detect(conn, sandbox_id, violation, within_s)
        self._freeze_request(conn, sandbox_id, violation.layer, vid, at)
        _folded_in(conn, token, sandbox_id)
        return True

    def _intent_of(
        self, conn: sqlite3.Connection, record: dict[str, object]
    ) -> tuple[str, Violation, float, float]:
        """An intent's sandbox, violation, dedup window and time asked; _NotAnIntent
        where this version can't read it or this journal has no such sandbox."""
        try:
            sandbox_id = str(record["sandbox_id"])
            raw = record["violation"]
            if not isinstance(raw, dict):
                raise TypeError("no violation")
            violation = Violation.from_json(raw)
            within_s = float(record["within_s"])  # type: ignore[arg-type]
            at = float(record["asked_at"])  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError) as exc:
            raise _NotAnIntent(f"not a freeze intent this version reads: {exc}") from None
        if not schema.exists(conn, "sandboxes", sandbox_id):
            raise _NotAnIntent(f"no sandbox {sandbox_id!r} in {self._path}")
        return sandbox_id, violation, within_s, at

    def _forget_intents(self, stems: list[str]) -> None:
        """The tokens of intent files that are gone: nothing will fold them again."""
        if not stems:
            return
        with self._write("forget folded intents") as conn:
            for stem in stems:
                conn.execute(
                    "DELETE FROM folded_intents WHERE token >= ? AND token < ?",
                    (f"{stem}:", f"{stem};"),
                )

    def record_detection(self, violation_id: int, layer: str, at: float) -> None:
        """Note that ``layer`` also saw violation ``violation_id`` at ``at`` (first sighting)."""
        with self._write(f"record detection of violation {violation_id}") as conn:
            self._add_detection(conn, violation_id, layer, at)

    def attach_process(self, violation_id: int, info: Mapping[str, object]) -> None:
        """Attach process attribution (pid, cmdline, cwd, parents); earlier keys win."""
        with self._write(f"attach process to violation {violation_id}") as conn:
            self._require(conn, "violations", violation_id, "violation")
            old = conn.execute("SELECT process FROM violations WHERE id = ?", (violation_id,))
            known = schema.as_dict(old.fetchone())["process"] or {}
            merged = {**info, **known}
            conn.execute(
                "UPDATE violations SET process = ? WHERE id = ?",
                (schema.dumps(merged), violation_id),
            )

    def find_recent_violation(
        self,
        sandbox_id: str,
        cls: ViolationClass | str,
        key: str,
        within_s: float,
        *,
        now: float | None = None,
    ) -> int | None:
        """The newest violation with this class and key seen within ``within_s`` of now.

        ``key`` is ``violation_key(v)``: the flow's 5-tuple string or ``qname/qtype``.
        """
        value = cls.value if isinstance(cls, ViolationClass) else cls
        since = (time.time() if now is None else now) - within_s
        rows = self._select(schema.FIND_SQL + schema.NEWEST, (sandbox_id, value, key, since))
        return int(rows[0]["id"]) if rows else None

    def violation(self, violation_id: int) -> Row | None:
        rows = self._select("SELECT * FROM violations WHERE id = ?", (violation_id,))
        return rows[0] if rows else None

    def violations(self, sandbox_id: str | None = None, limit: int = 100) -> list[Row]:
        return self._newest("violations", "at", sandbox_id, limit)

    # -- freezes and decisions ---------------------------------------------------------

    def record_freeze_request(
        self, sandbox_id: str, layer: str, violation_id: int | None, at: float
    ) -> int:
        """Journal that ``layer`` is about to freeze the sandbox; returns the freeze id.

        While a freeze is open (no decision yet) every layer's request joins it, so the
        row names the first layer and ``requested_by`` lists when each one asked.
        """
        with self._write(f"record freeze of sandbox {sandbox_id!r}") as conn:
            return self._freeze_request(conn, sandbox_id, layer, violation_id, at)

    def _freeze_request(
        self,
        conn: sqlite3.Connection,
        sandbox_id: str,
        layer: str,
        violation_id: int | None,
        at: float,
    ) -> int:
        ask = {"layer": layer, "at": at, "violation_id": violation_id}
        self._require(conn, "sandboxes", sandbox_id, "sandbox")
        row = conn.execute(schema.OPEN_FREEZE_SQL, (sandbox_id,)).fetchone()
        if row is None:
            first = (sandbox_id, at, layer, violation_id, schema.dumps([ask]))
            return schema.insert(conn, schema.NEW_FREEZE_SQL, first)
        self._join(conn, row, ask)
        return int(row["id"])

    def _join(self, conn: sqlite3.Connection, row: sqlite3.Row, ask: dict[str, object]) -> None:
        """``ask`` added to the freeze ``row``'s requests, unless its layer asked already."""
        asks = schema.as_dict(row)["requested_by"]
        if all(a["layer"] != ask["layer"] for a in asks):
            conn.execute(
                "UPDATE freezes SET requested_by = ? WHERE id = ?",
                (schema.dumps([*asks, ask]), row["id"]),
            )

    def confirm_freeze(
        self, freeze_id: int, confirmed_at: float, latency_ms: float, layer: str | None = None
    ) -> None:
        """Journal that the cgroup reports frozen; the earliest confirmation wins. Both
        layers confirm one freeze, and the one that froze first may journal it second
        (the other layer's record commit can take the lock in between). The latency is
        counted from the freeze's first violation (``latency_ms`` where it has none);
        ``layer``'s request is marked confirmed too."""
        with self._write(f"confirm freeze {freeze_id}") as conn:
            self._require(conn, "freezes", freeze_id, "freeze")
            conn.execute(
                "UPDATE freezes SET confirmed_at = ?, latency_ms = COALESCE("
                "(? - (SELECT at FROM violations WHERE id = first_violation)) * 1000, ?) "
                "WHERE id = ? AND (confirmed_at IS NULL OR confirmed_at > ?)",
                (confirmed_at, confirmed_at, latency_ms, freeze_id, confirmed_at),
            )
            if layer is not None:
                self._mark_request(conn, freeze_id, layer, "confirmed_at", confirmed_at)
            conn.execute(  # a freeze a person already decided does not mark it again
                "UPDATE sandboxes SET state = 'frozen' WHERE state = 'running' "
                "AND id = (SELECT sandbox_id FROM freezes WHERE id = ? AND decision_id IS NULL)",
                (freeze_id,),
            )

    def _mark_request(
        self, conn: sqlite3.Connection, freeze_id: int, layer: str, key: str, at: float
    ) -> None:
        """Note ``key: at`` on ``layer``'s request of the freeze (its first such note)."""
        row = conn.execute("SELECT requested_by FROM freezes WHERE id = ?", (freeze_id,))
        asks = schema.as_dict(row.fetchone())["requested_by"] or []
        marked = [{**a, key: at} if a["layer"] == layer and key not in a else a for a in asks]
        if marked != asks:
            conn.execute(
                "UPDATE freezes SET requested_by = ? WHERE id = ?",
                (schema.dumps(marked), freeze_id),
            )

    def thaw_if_resumed(
        self,
        freeze_id: int,
        layer: str,
        thaw: Callable[[], object],
        freeze_again: Callable[[], object] | None = None,
    ) -> bool:
        """Call ``thaw`` when a person resumed ``freeze_id`` before ``layer``'s freeze of
        it landed, and no other freeze of the sandbox is open; True when it did.

        Both layers freeze for one violation, each once its record is durable. If the
        first layer froze, a person resumed (journal, then thaw), and only then the second
        layer's write reached the cgroup, the sandbox would stand frozen with nothing
        left to decide. The check, the note (``thawed_at`` on the layer's request:
        journal before act) and ``thaw`` run under the write lock, so a new violation's
        freeze request committed before its freeze cannot slip between them and have its
        freeze undone. Nor is it thawed while a freeze of the sandbox is durable in an
        intent file and not yet here (``_intent_pending``). An intent written after that
        look, whose freeze this thaw may then have undone, is looked for again after the
        thaw: if there is one, ``freeze_again`` (the one it misses was written after the
        thaw, and its freeze lands after it). Its layer looks too, once its commit
        returns or fails (Enforcer._fold). ``thaw`` and ``freeze_again``
        should only write, not wait, as they hold the lock (and a person's resume of
        that freeze must not come between the look and them). What they raise rolls the
        note back and propagates.
        """
        decided = "SELECT 1 FROM freezes WHERE id = ? AND decision_id IS NOT NULL"
        if not self._select(decided, (freeze_id,)):
            return False  # the usual case: a read, no lock
        with self._write(f"settle freeze {freeze_id}") as conn:
            row = conn.execute(
                "SELECT f.sandbox_id, d.action FROM freezes f "
                "JOIN decisions d ON d.id = f.decision_id WHERE f.id = ?",
                (freeze_id,),
            ).fetchone()
            if row is None or row["action"] != "resume":
                return False  # a kill reaps it frozen or not
            sandbox_id = str(row["sandbox_id"])
            if self._held(conn, sandbox_id):
                return False
            self._mark_request(conn, freeze_id, layer, "thawed_at", time.time())
            thaw()
            if freeze_again is not None and self._intent_pending(conn, sandbox_id):
                freeze_again()
            else:
                conn.execute(_RUNNING_AGAIN, (sandbox_id,))  # what ps and gc read
            return True

    def freeze_held(self, sandbox_id: str) -> bool:
        """A freeze of ``sandbox_id`` open here, or pending in an intent file."""
        with self._read(f"read freezes of sandbox {sandbox_id!r}") as conn:
            return self._held(conn, sandbox_id)

    def _held(self, conn: sqlite3.Connection, sandbox_id: str) -> bool:
        return bool(conn.execute(schema.OPEN_FREEZE_SQL, (sandbox_id,)).fetchone()) or (
            self._intent_pending(conn, sandbox_id)
        )

    def _intent_pending(self, conn: sqlite3.Connection, sandbox_id: str) -> bool:
        """A freeze of ``sandbox_id`` is durable in an intent file and not in SQLite: a
        layer between its freeze and its commit, one whose commit SQLite refused (its
        record pinned, Journal.commit_pinned), or one that died before it (folded at the
        next open). Its freeze stands for a person to decide, as if it were open here.
        So does any freeze where the files cannot be read."""
        try:
            for stem, seq, _ in intents_file.every_record(self._path.parent, sandbox_id):
                if not _folded(conn, intents_file.token(stem, seq)):
                    return True
        except OSError as exc:
            where = self._path.parent / intents_file.DIR
            print(f"egress: {where}: cannot read ({exc}); sandbox {sandbox_id} stays frozen "
                  "for a person to decide", file=sys.stderr)  # fmt: skip
            return True
        return False

    def record_decision(
        self, sandbox_id: str, action: str, uid: int, at: float, note: str = ""
    ) -> int:
        """Journal a person's resume or kill (before doing it); closes the open freeze.
        A person's resume goes through ``resume``, which looks again after its thaw."""
        if action not in schema.DECISION_ACTIONS:
            raise JournalError(f"{self._path}: decision must be resume or kill, not {action!r}")
        with self._write(f"record decision for sandbox {sandbox_id!r}") as conn:
            return self._decide(conn, sandbox_id, action, uid, at, note)

    def resume(
        self,
        sandbox_id: str,
        uid: int,
        at: float,
        thaw: Callable[[], object],
        freeze_again: Callable[[], object],
        note: str = "",
    ) -> str | None:
        """Journal a person's resume of ``sandbox_id``, then ``thaw``, then look again;
        None when it stays thawed, else why it stays frozen (for the person).

        Not thawed while a freeze of the sandbox is durable in an intent file and not yet
        here (``_intent_pending``, looked at in the decision's transaction): its layer's
        commit settles it, joining this decision and thawing (``thaw_if_resumed``) where
        it is the freeze resumed, or opening a new one for a person. A layer's freeze
        request committed after the decision and before the thaw (its freeze landing
        before the thaw, or its commit reading the cgroup frozen still) would have that
        freeze undone, open in the journal with the workload running; so once thawed, a
        freeze open or pending for the sandbox is looked for under the write lock, and
        if there is one, ``freeze_again`` (a commit after that look freezes after it; a
        layer freezing from its intent looks after its commit, Enforcer._fold).
        Where none is, the sandbox's state is running again. Where that look fails,
        ``freeze_again`` all the same (fail closed), and the error propagates. ``thaw``
        and ``freeze_again`` should only write, not wait."""
        with self._write(f"record resume of sandbox {sandbox_id!r}") as conn:
            self._decide(conn, sandbox_id, "resume", uid, at, note)
            if self._intent_pending(conn, sandbox_id):
                return STILL_PENDING
        thaw()
        try:
            with self._write(f"look for freezes of {sandbox_id!r} after its resume") as conn:
                if self._held(conn, sandbox_id):
                    freeze_again()
                    return FROZEN_AGAIN
                conn.execute(_RUNNING_AGAIN, (sandbox_id,))
        except JournalError:
            freeze_again()
            raise
        return None

    def _decide(
        self, conn: sqlite3.Connection, sandbox_id: str, action: str, uid: int, at: float,
        note: str,
    ) -> int:  # fmt: skip
        self._require(conn, "sandboxes", sandbox_id, "sandbox")
        decision_id = schema.insert(
            conn,
            "INSERT INTO decisions (sandbox_id, action, uid, at, note) VALUES (?, ?, ?, ?, ?)",
            (sandbox_id, action, uid, at, note),
        )
        conn.execute(
            "UPDATE freezes SET decision_id = ? WHERE sandbox_id = ? AND decision_id IS NULL",
            (decision_id, sandbox_id),
        )
        return decision_id

    def decided(self, violation_id: int) -> bool:
        """Has a person already resumed or killed a freeze this violation caused?

        A layer that sees a violation after the other one froze for it, and after someone
        decided, must not freeze again for the same thing.
        """
        return self.decided_freeze(violation_id) is not None

    def _decided_freeze(self, conn: sqlite3.Connection, violation_id: int) -> int | None:
        """The newest freeze a person decided that ``violation_id`` caused or joined."""
        rows = conn.execute(
            "SELECT id, first_violation, requested_by FROM freezes WHERE decision_id IS NOT "
            "NULL AND sandbox_id = (SELECT sandbox_id FROM violations WHERE id = ?) "
            "ORDER BY id DESC",
            (violation_id,),
        ).fetchall()
        for r in rows:
            asks = schema.as_dict(r)["requested_by"] or []
            if r["first_violation"] == violation_id or any(
                a.get("violation_id") == violation_id for a in asks
            ):
                return int(r["id"])
        return None

    def freezes(self, sandbox_id: str | None = None, limit: int = 100) -> list[Row]:
        return self._newest("freezes", "requested_at", sandbox_id, limit)

    def open_freeze(self, sandbox_id: str) -> Row | None:
        """The sandbox's freeze no decision has closed yet (there is one at most)."""
        rows = self._select(schema.OPEN_FREEZE_SQL, (sandbox_id,))
        return rows[0] if rows else None

    def decisions(self, sandbox_id: str | None = None, limit: int = 100) -> list[Row]:
        return self._newest("decisions", "at", sandbox_id, limit)

    def events(self, sandbox_id: str | None = None, limit: int = 100) -> list[Row]:
        """Newest-first timeline: {kind, at, sandbox_id, record} for ``egressctl journal``.

        Kinds: sandbox_started, violation, freeze_requested, frozen, decision,
        sandbox_ended. ``record`` is the full row of the sandbox, violation, freeze or
        decision the event comes from.
        """
        with self._read("read events") as conn:
            return schema.timeline(conn, sandbox_id, limit)

    def events_since(
        self, since: float, sandbox_id: str | None = None, limit: int = 1000
    ) -> list[Row]:
        """The timeline from ``since`` on, oldest first (as ``events``' rows)."""
        with self._read("read events") as conn:
            return schema.timeline(conn, sandbox_id, limit, since)

    # -- mode: audit -------------------------------------------------------------------

    def record_audit(self, sandbox_id: str, batch: AuditBatch) -> None:
        """Add what a sandbox's resolver saw in mode: audit (store.audit_sql)."""
        with self._write(f"record audit of sandbox {sandbox_id!r}") as conn:
            self._require(conn, "sandboxes", sandbox_id, "sandbox")
            audit_sql.record(conn, sandbox_id, batch)

    def audit(self, sandbox_ids: list[str], since: float = 0.0) -> dict[str, object]:
        """The audit record of ``sandbox_ids`` seen since ``since``: names, connects and
        what the cap left out (``overflow``)."""
        with self._read("read audit") as conn:
            return {
                "names": audit_sql.read(conn, "audit_names", sandbox_ids, since),
                "connects": audit_sql.read(conn, "audit_connects", sandbox_ids, since),
                "overflow": audit_sql.overflow(conn, sandbox_ids),
            }

    def audited_sandboxes(self, since: float = 0.0) -> list[str]:
        with self._read("read audit") as conn:
            return audit_sql.sandboxes(conn, since)

    def check(self) -> str:
        """``PRAGMA integrity_check``: ``"ok"`` or SQLite's list of problems."""
        rows = self._select("PRAGMA integrity_check", ())
        return "\n".join(str(next(iter(r.values()))) for r in rows)

    # -- plumbing ----------------------------------------------------------------------

    def _insert_violation(self, conn: sqlite3.Connection, sandbox_id: str, v: Violation) -> int:
        self._require(conn, "sandboxes", sandbox_id, "sandbox")
        return schema.insert(conn, schema.NEW_VIOLATION_SQL, schema.violation_row(sandbox_id, v))

    def _add_detection(
        self, conn: sqlite3.Connection, violation_id: int, layer: str, at: float
    ) -> None:
        self._require(conn, "violations", violation_id, "violation")
        row = conn.execute("SELECT detected_by FROM violations WHERE id = ?", (violation_id,))
        seen = schema.as_dict(row.fetchone())["detected_by"]
        if any(d["layer"] == layer for d in seen):
            return
        seen = sorted([*seen, {"layer": layer, "at": at}], key=lambda d: d["at"])
        # A violation is dated by its first sighting, whichever layer committed first
        # (one freezing from its intent commits after its freeze, so the other, later to
        # see it, may be first here), and so is the freeze latency counted from it.
        conn.execute(
            "UPDATE violations SET detected_by = ?, at = MIN(at, ?) WHERE id = ?",
            (schema.dumps(seen), at, violation_id),
        )
        conn.execute(
            "UPDATE freezes SET latency_ms = "
            "(confirmed_at - (SELECT at FROM violations WHERE id = ?)) * 1000 "
            "WHERE first_violation = ? AND confirmed_at IS NOT NULL",
            (violation_id, violation_id),
        )

    def _check_state(self, state: str) -> None:
        if state not in schema.SANDBOX_STATES:
            states = ", ".join(schema.SANDBOX_STATES)
            raise JournalError(f"{self._path}: sandbox state must be one of {states}")

    def _require(self, conn: sqlite3.Connection, table: str, key: object, what: str) -> None:
        if not schema.exists(conn, table, key):
            raise JournalError(f"{self._path}: no {what} {key!r} in the journal")

    def _newest(self, table: str, at: str, sandbox_id: str | None, limit: int) -> list[Row]:
        where = "" if sandbox_id is None else " WHERE sandbox_id = ?"
        args = () if sandbox_id is None else (sandbox_id,)
        sql = f"SELECT * FROM {table}{where} ORDER BY {at} DESC, id DESC LIMIT ?"
        return self._select(sql, (*args, limit))

    def _select(self, sql: str, args: tuple[object, ...]) -> list[Row]:
        with self._read("read") as conn:
            return [schema.as_dict(r) for r in conn.execute(sql, args)]

    @contextlib.contextmanager
    def _write(
        self, what: str, busy_timeout_s: float | None = None
    ) -> Iterator[sqlite3.Connection]:
        """A write transaction; the write lock waited for ``busy_timeout_s`` (None: the
        journal's own)."""
        with self._transaction(True, what, busy_timeout_s) as conn:
            yield conn

    @contextlib.contextmanager
    def _read(self, what: str) -> Iterator[sqlite3.Connection]:
        with self._transaction(False, what) as conn:
            yield conn

    @contextlib.contextmanager
    def _transaction(
        self, write: bool, what: str, busy_timeout_s: float | None = None
    ) -> Iterator[sqlite3.Connection]:
        with self._lock, self._errors(what):
            if self._conn is None:
                raise JournalError(f"{self._path}: {what}: the journal is closed")
            conn = self._conn
            if write:
                wait = self._busy_timeout_s if busy_timeout_s is None else busy_timeout_s
                schema.begin_immediate(conn, wait)
            else:
                conn.execute("BEGIN DEFERRED")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                raise

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            raise JournalError(f"{self._path}: {what}: {exc}") from exc


class _NotAnIntent(Exception):
    """An intent's record this journal cannot take; kept aside (intents.keep_aside)."""

    def entry(self, token: str, record: dict[str, object]) -> dict[str, object]:
        return {"token": token, "why": str(self), "record": record}


def _folded(conn: sqlite3.Connection, token: str) -> bool:
    """SQLite holds the intent record ``token`` names."""
    row = conn.execute("SELECT 1 FROM folded_intents WHERE token = ?", (token,)).fetchone()
    return row is not None


def _folded_in(conn: sqlite3.Connection, token: str, frozen: str | None) -> None:
    """An intent's record is in SQLite (its token kept, so none folds it again), and the
    sandbox ``frozen`` (if given) shows so, as it awaits a person."""
    if frozen is not None:
        conn.execute(
            "UPDATE sandboxes SET state = 'frozen' WHERE id = ? AND state = 'running'", (frozen,)
        )
    conn.execute("INSERT INTO folded_intents VALUES (?)", (token,))
