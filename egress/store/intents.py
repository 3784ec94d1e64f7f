"""The journal's freeze intents: a layer's record of a violation, durable before it freezes.

A freeze must not come before its evidence is on disk (DESIGN.md invariant 5). SQLite's
commit of that evidence (BEGIN, the dedup query and inserts, a few WAL page writes, then
its fdatasync) took p50 0.48-0.53 ms in bench_freeze, and first waits for any other
writer's transaction: the other layer's, committing the same violation (p99 2.2-2.4 ms
with both layers). One write of a block already written, to a file opened ``O_DSYNC``,
is the cheapest durable record this disk has, and shares no lock: p50 0.38-0.40 ms there
(0.09 back to back; the first flush after ~10 ms without one costs ~0.3 ms more on this
VM's disk, whatever writes it). So a layer writes the violation here, freezes, and then
commits it to SQLite in the usual transaction, which also notes the intent's token
(``folded_intents``) so that it is never folded twice.

Each writing process has a file of its own, ``<state dir>/intents/<pid>-<hex>.log``,
flock'd while it lives: SLOTS fixed blocks of SLOT bytes, zero-filled and fsync'd before
the file takes its name (a block only allocated would need the filesystem's metadata
flushed with it: 0.14 ms against 0.09, back to back). A slot holds one record: magic,
length, CRC-32, sequence number, then the record's JSON; a torn or stale slot fails its
CRC or is found folded, and is skipped. A slot is used again only once its record is in SQLite.

Whoever opens the journal next folds the files no live process holds (``Journal.open``):
a layer killed between its intent and its SQLite commit leaves a frozen sandbox whose
violation and freeze request are journaled all the same, from its intent.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from egress.store.journal_schema import fsync_dir

DIR = "intents"
SUFFIX = ".log"
SLOT = 4096  # a filesystem block: one write, never split across two
SLOTS = 64  # freezes in flight at once in one process (egressd: across its sandboxes)
MAGIC = b"EGI1"
_HEAD = struct.Struct("<4sIIQ")  # magic, payload length, crc32(payload), sequence
MAX_PAYLOAD = SLOT - _HEAD.size


@dataclass(frozen=True)
class Intent:
    """One record written: where it is, and the token SQLite keeps once it is folded."""

    token: str  # "<file stem>:<seq>"
    slot: int
    sandbox_id: str
    record: dict[str, object]


def encode(seq: int, record: dict[str, object]) -> bytes | None:
    """``record`` as one slot's bytes; None if it does not fit in one."""
    payload = json.dumps(record, separators=(",", ":"), sort_keys=True).encode()
    if len(payload) > MAX_PAYLOAD:
        return None
    head = _HEAD.pack(MAGIC, len(payload), zlib.crc32(payload), seq)
    return (head + payload).ljust(SLOT, b"\0")


def decode(block: bytes) -> tuple[int, dict[str, object]] | None:
    """(sequence, record) from one slot's bytes; None for an empty, torn or foreign one."""
    if len(block) < _HEAD.size:
        return None
    magic, length, crc, seq = _HEAD.unpack_from(block)
    payload = block[_HEAD.size : _HEAD.size + length]
    if magic != MAGIC or length > MAX_PAYLOAD or len(payload) != length:
        return None
    if zlib.crc32(payload) != crc:
        return None
    try:
        record = json.loads(payload)
    except ValueError:
        return None
    return (seq, record) if isinstance(record, dict) else None


def records(data: bytes) -> list[tuple[int, dict[str, object]]]:
    """Every whole record in a file's bytes, oldest first."""
    found = [decode(data[i : i + SLOT]) for i in range(0, len(data), SLOT)]
    return sorted((r for r in found if r is not None), key=lambda r: r[0])


class IntentLog:
    """This process's intent file. ``write`` is durable when it returns; ``done`` frees
    the slot once SQLite holds the record. Threads may share one (egressd's writers)."""

    def __init__(self, directory: Path, fd: int, stem: str) -> None:
        self.directory = directory
        self.path = directory / f"{stem}{SUFFIX}"
        self.stem = stem
        self._fd: int | None = fd
        # Held across each write, so that close never comes between a write's look at
        # the descriptor and its pwrite (and no write lands in a file close removed).
        self._lock = threading.Lock()
        self._live: dict[int, str] = {}  # slot -> the token of the record it holds
        self._seq = 0
        self._pinned: list[Intent] = []  # records SQLite refused, to commit again

    @classmethod
    def create(cls, state_dir: Path) -> IntentLog:
        """A new file, locked, zero-filled and fsync'd, then named (linked: a name some
        file has already is never taken over): nobody folds it while this process
        lives, nor a half-made one ever (a dot-name is never folded)."""
        directory = state_dir / DIR
        directory.mkdir(mode=0o700, exist_ok=True)
        tmp = directory / f".{os.getpid()}-{secrets.token_hex(16)}{SUFFIX}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_DSYNC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.pwrite(fd, bytes(SLOT * SLOTS), 0)  # O_DSYNC: on disk when it returns
            while True:
                stem = f"{os.getpid()}-{secrets.token_hex(16)}"
                try:
                    os.link(tmp, directory / f"{stem}{SUFFIX}")
                    break
                except FileExistsError:
                    continue
            os.unlink(tmp)
            fsync_dir(directory)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            os.close(fd)
            raise
        return cls(directory, fd, stem)

    def write(self, sandbox_id: str, record: dict[str, object]) -> Intent | None:
        """Write ``record`` durably; None when it cannot be here (no slot free, too big,
        closed): the caller commits to SQLite first instead, as before."""
        with self._lock:
            slot = next((n for n in range(SLOTS) if n not in self._live), None)
            if self._fd is None or slot is None:
                return None
            block = encode(self._seq + 1, {"sandbox_id": sandbox_id, **record})
            if block is None:
                return None
            os.pwrite(self._fd, block, slot * SLOT)
            self._seq += 1
            token = f"{self.stem}:{self._seq}"
            self._live[slot] = token
            return Intent(token, slot, sandbox_id, record)

    def done(self, intent: Intent, folded: bool) -> None:
        """SQLite holds ``intent`` (``folded``): its slot may be written again, once (a
        second ``done`` for it frees nothing). Not folded, it stays, and ``take_pinned``
        hands it out to be committed again."""
        with self._lock:
            if not folded:
                self._pinned.append(intent)
            elif self._live.get(intent.slot) == intent.token:
                del self._live[intent.slot]

    def take_pinned(self) -> list[Intent]:
        """The records SQLite refused, each handed to one caller only: it calls ``done``
        for each, folded or (pinned again) not."""
        if not self._pinned:  # the usual case, without waiting on a write for the lock
            return []
        with self._lock:
            taken, self._pinned = self._pinned, []
            return taken

    def close(self) -> bool:
        """Close; where every record is in SQLite, delete the file too (True)."""
        with self._lock:
            fd, self._fd = self._fd, None
            if fd is None:
                return False
            idle = not self._live
            try:
                if idle:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.path)
                    fsync_dir(self.directory)
            finally:
                os.close(fd)  # the lock goes with it: a file left is for others to fold
            return idle


@contextlib.contextmanager
def orphans(state_dir: Path) -> Iterator[list[tuple[Path, str, bytes]]]:
    """The intent files no live process holds, locked for the caller to fold: (path,
    stem, bytes) each. They are unlocked when the block ends; the caller unlinks each
    it folded whole. Nothing where the directory cannot be read (not root)."""
    directory = state_dir / DIR
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(SUFFIX) and n[0] != ".")
    except OSError:
        names = []
    held: list[tuple[Path, str, bytes]] = []
    fds: list[int] = []
    try:
        for name in names:
            path = directory / name
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue  # gone meanwhile (folded by another), or not ours to read
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # Folded and unlinked by another between our open and our lock: skip.
                if os.fstat(fd).st_ino != os.stat(path, follow_symlinks=False).st_ino:
                    raise FileNotFoundError(path)
                data = os.pread(fd, SLOT * SLOTS, 0)
            except OSError:
                os.close(fd)  # held by its live writer, or gone
                continue
            fds.append(fd)
            held.append((path, name[: -len(SUFFIX)], data))
        yield held
    finally:
        for fd in fds:
            os.close(fd)


def remove(paths: list[Path]) -> None:
    """Unlink folded intent files, then make that durable."""
    if not paths:
        return
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    fsync_dir(paths[0].parent)
