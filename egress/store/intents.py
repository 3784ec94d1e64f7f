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
import errno
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

from egress.store.claims import alive
from egress.store.journal_schema import fsync_dir

DIR = "intents"
SUFFIX = ".log"
KEPT = "kept"  # under DIR: records no journal here could take, for a person (keep_aside)
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

    @property
    def stored(self) -> dict[str, object]:
        """The record as its slot holds it (and a fold reads it)."""
        return {"sandbox_id": self.sandbox_id, **self.record}


def token(stem: str, seq: int) -> str:
    """What SQLite's folded_intents keeps of a record: its file's stem and sequence."""
    return f"{stem}:{seq}"


def _json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def _sandbox_field(sandbox_id: str) -> bytes:
    """How an encoded record names its sandbox, byte for byte."""
    return b'"sandbox_id":' + _json(sandbox_id)


def encode(seq: int, record: dict[str, object]) -> bytes | None:
    """``record`` as one slot's bytes; None if it does not fit in one."""
    payload = _json(record)
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
        lives, nor a half-made one ever. It is made without a name (O_TMPFILE), so a
        crash while making it leaves nothing; where the filesystem can't, under a
        dot-name, which is never folded, and removed by a fold once its maker is gone."""
        directory = state_dir / DIR
        directory.mkdir(mode=0o700, exist_ok=True)
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_DSYNC
        tmp: Path | None = None
        try:
            fd = os.open(directory, flags | os.O_TMPFILE, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            tmp = directory / f".{os.getpid()}-{secrets.token_hex(16)}{SUFFIX}"
            fd = os.open(tmp, flags | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.pwrite(fd, bytes(SLOT * SLOTS), 0)  # O_DSYNC: on disk when it returns
            source = f"/proc/self/fd/{fd}" if tmp is None else str(tmp)
            stem = _link_new(source, directory)
            if tmp is not None:
                os.unlink(tmp)
            fsync_dir(directory)
        except BaseException:
            if tmp is not None:
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
            intent = Intent(token(self.stem, self._seq + 1), slot, sandbox_id, record)
            block = encode(self._seq + 1, intent.stored)
            if block is None:
                return None
            os.pwrite(self._fd, block, slot * SLOT)
            self._seq += 1
            self._live[slot] = intent.token
            return intent

    def done(self, intent: Intent, folded: bool) -> None:
        """SQLite holds ``intent`` (``folded``): its slot may be written again, once (a
        second ``done`` for it frees nothing). Not folded, it stays, and ``take_pinned``
        hands it out to be committed again."""
        with self._lock:
            if not folded:
                self._pinned.append(intent)
            elif self._live.get(intent.slot) == intent.token:
                del self._live[intent.slot]

    def has_pinned(self, sandbox_id: str) -> bool:
        """Whether ``take_pinned(sandbox_id)`` would hand anything out now."""
        # Without the lock: a record pinned while this reads is seen at the next look.
        pinned = self._pinned
        return bool(pinned) and any(i.sandbox_id == sandbox_id for i in pinned)

    def take_pinned(self, sandbox_id: str | None = None) -> list[Intent]:
        """The records SQLite refused (those of ``sandbox_id``, if given), each handed to
        one caller only: it calls ``done`` for each, folded or (pinned again) not."""
        if not self._pinned:  # the usual case, without waiting on a write for the lock
            return []
        with self._lock:
            taken: list[Intent] = []
            kept: list[Intent] = []
            for intent in self._pinned:
                (taken if sandbox_id in (None, intent.sandbox_id) else kept).append(intent)
            self._pinned = kept
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


def _link_new(source: str, directory: Path) -> str:
    """Give ``source``'s inode a new ``<pid>-<hex>`` name in ``directory``; its stem.
    Through linkat with AT_SYMLINK_FOLLOW (os.link does that only given a directory
    descriptor), so that ``/proc/self/fd/N`` names the O_TMPFILE, not the link to it."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        while True:
            stem = f"{os.getpid()}-{secrets.token_hex(16)}"
            try:
                os.link(source, f"{stem}{SUFFIX}", dst_dir_fd=dfd, follow_symlinks=True)
                return stem
            except FileExistsError:
                continue
    finally:
        os.close(dfd)


@contextlib.contextmanager
def orphans(state_dir: Path) -> Iterator[list[tuple[Path, str, bytes]]]:
    """The intent files no live process holds, locked for the caller to fold: (path,
    stem, bytes) each. They are unlocked when the block ends; the caller unlinks each
    it folded whole. Nothing where the directory cannot be read (not root)."""
    directory = state_dir / DIR
    _remove_abandoned(directory)
    try:
        names = _names(directory)
    except OSError:
        names = []  # not ours to fold (not root)
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


def every_record(
    state_dir: Path, sandbox_id: str | None = None
) -> Iterator[tuple[str, int, dict[str, object]]]:
    """(file stem, sequence, record) of every whole record in every intent file, live
    (its writer's, read without its lock) or left by a process that ended. A slot being
    written as this reads it fails its CRC and is not seen: this is a look, not a fold.
    Records already in SQLite are among them (their tokens say so). ``sandbox_id``: only
    that sandbox's (a file that never names it is not decoded). OSError where the
    directory or a file in it is there and cannot be read."""
    needle = None if sandbox_id is None else _sandbox_field(sandbox_id)
    directory = state_dir / DIR
    for name in _names(directory):
        try:
            fd = os.open(directory / name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            continue  # folded and removed meanwhile
        try:
            data = os.pread(fd, SLOT * SLOTS, 0)
        finally:
            os.close(fd)
        if needle is not None and needle not in data:
            continue
        for seq, record in records(data):
            if sandbox_id is None or record.get("sandbox_id") == sandbox_id:
                yield name[: -len(SUFFIX)], seq, record


def keep_aside(state_dir: Path, stem: str, entries: list[dict[str, object]]) -> Path:
    """Keep records no journal here can take (their sandbox unknown to it, or not a freeze
    intent this version reads) for a person, as JSON lines in ``intents/kept/<stem>.jsonl``
    (``token``, ``why``, ``record``), synced when this returns. Appended, never rewritten:
    a line already there stays whatever it holds, and an entry whose token is there
    already (a fold done again after a crash) is not added twice. Only one process
    writes a stem's file (the intent file's owner, or the one fold holding its lock), so
    this process's lock orders its threads."""
    directory = state_dir / DIR / KEPT
    for made in (directory.parent, directory):
        made.mkdir(mode=0o700, exist_ok=True)
    path = directory / f"{stem}.jsonl"
    with _kept_lock:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)  # fmt: skip
        try:
            there = b""
            while chunk := os.read(fd, 1 << 16):
                there += chunk
            tokens = {_token_of(line) for line in there.splitlines()}
            lines = [json.dumps(e, sort_keys=True) for e in entries if e["token"] not in tokens]
            if lines:
                torn = there and not there.endswith(b"\n")  # a crash mid-append: its own line
                text = ("\n" if torn else "") + "".join(line + "\n" for line in lines)
                view = memoryview(text.encode())
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
        finally:
            os.close(fd)
        if not there:
            fsync_dir(directory)  # its name, new (or empty before)
    return path


def _token_of(line: bytes) -> str | None:
    """The token a kept line names; None for one torn, not UTF-8, or not ours (kept as it
    is), whatever it holds."""
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):
        return None
    token = entry.get("token") if isinstance(entry, dict) else None
    return token if isinstance(token, str) else None


_kept_lock = threading.Lock()


def _remove_abandoned(directory: Path) -> None:
    """Remove the dot-named files of makers that died making them (``IntentLog.create``
    without O_TMPFILE): none of them holds a record."""
    try:
        names = [n for n in os.listdir(directory) if n[0] == "." and n.endswith(SUFFIX)]
    except OSError:
        return
    for name in names:
        pid = name[1:].partition("-")[0]
        if pid.isdigit() and not alive(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(directory / name)


def _names(directory: Path) -> list[str]:
    """The intent files' names, sorted; none where there is no directory yet, OSError
    where it cannot be read (not root, or worse). A dot-name is a file being made."""
    try:
        return sorted(n for n in os.listdir(directory) if n.endswith(SUFFIX) and n[0] != ".")
    except FileNotFoundError:
        return []


def remove(paths: list[Path]) -> None:
    """Unlink folded intent files, then make that durable."""
    if not paths:
        return
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    fsync_dir(paths[0].parent)
