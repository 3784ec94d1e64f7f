"""The uids (and equal gids) egress hands to sandboxes' workloads.

Each created sandbox's workload runs under a uid of its own, so nothing it does can reach
a process, file or IPC object of anyone else's: ``kill -9 -1`` finds nobody, ptrace finds
nobody, and nothing on the host is owned by it. The uid is taken with the sandbox's
address claim (store/claims.py), under the same lock, so concurrent ``egressctl run``s and
egressd never pick the same one; it is freed when the workload's files go (teardown, or
``gc`` after a crash; ``gc --orphans`` for files a sandbox left behind when its claim went
without a teardown) and is never handed out while any process of it still lives.

Default range: 2000000000-2000065535 (EGRESS_UID_RANGE, --uid-range). systemd's
allocation table (systemd.io/UIDS-GIDS) leaves 1879048192…2147352575 unused: it sits
above the container ranges systemd-nspawn picks from (524288…1879048191) and the
subordinate ids shadow's useradd hands out (/etc/subuid: SUB_UID_MIN 100000 up to
SUB_UID_MAX 600100000 by default), below systemd's foreign-UID range (from 2147352576)
and below 2^31, past which some tools misread ids as negative. Nothing else on a stock
Debian host allocates there; egress still checks, at every allocation, that no account
(passwd, group) and no /etc/subuid or /etc/subgid entry overlaps the range.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import os
import pwd
from collections.abc import Iterable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

from egress.errors import SandboxError, UsageError
from egress.store.paths import sandbox_pin, workloads_dir

DEFAULT_UID_RANGE = "2000000000-2000065535"
ENV = "EGRESS_UID_RANGE"


def parse_range(text: str | None) -> range:
    """``START-END`` (inclusive) → range; None means $EGRESS_UID_RANGE, else the default."""
    spec = text or os.environ.get(ENV) or DEFAULT_UID_RANGE
    start_s, sep, end_s = spec.partition("-")
    try:
        if not sep:
            raise ValueError
        start, end = int(start_s), int(end_s)
    except ValueError:
        raise UsageError(
            f"uid range {spec!r}: write it as START-END, e.g. {DEFAULT_UID_RANGE}"
        ) from None
    if not 1000 <= start <= end < 2**31 - 1:
        raise UsageError(f"uid range {spec!r}: it must lie within 1000-2147483646 and START <= END")
    return range(start, end + 1)


def _subid_overlaps(ids: range, files: Iterable[str]) -> list[str]:
    found = []
    for name in files:
        try:
            lines = Path(name).read_text().splitlines()
        except OSError:
            continue
        for n, line in enumerate(lines, 1):
            parts = line.strip().split(":")
            if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
                continue
            lo, count = int(parts[1]), int(parts[2])
            if lo < ids.stop and ids.start < lo + count:
                found.append(f"{name}:{n} ({parts[0]}: {lo}-{lo + count - 1})")
    return found


def check_range(ids: range, subid_files: Iterable[str] = ("/etc/subuid", "/etc/subgid")) -> None:
    """Refuse a range that overlaps subordinate ids someone else was given."""
    overlaps = _subid_overlaps(ids, subid_files)
    if overlaps:
        raise UsageError(
            f"uid range {ids.start}-{ids.stop - 1} overlaps subordinate ids in "
            f"{', '.join(overlaps)}; pick another with --uid-range or {ENV}"
        )


def live_uids(ids: range, proc: str = "/proc", known: AbstractSet[int] = frozenset()) -> set[int]:
    """uids of ``ids`` that some living process on the host runs under; those of
    ``known`` (held already, whatever runs) are not looked for."""
    return set(live_processes(ids, proc, known))


def live_processes(
    ids: range, proc: str = "/proc", known: AbstractSet[int] = frozenset()
) -> dict[int, list[int]]:
    """The living processes of each uid of ``ids`` that has any: uid -> pids. A process
    whose effective uid is of ``known`` is not read further, nor counted (reading every
    sandbox's status files cost a create at 1,000 sandboxes with a process each 30 ms):
    its real and saved uids, which only a set-uid program makes differ (refused inside
    a sandbox, see below), go unseen.

    /proc/PID belongs to the task's effective uid, so one stat per process finds them;
    only those are read further, for their real and saved uids and to skip zombies (dead:
    they hold nothing of the uid but an entry their parent has yet to reap). A process
    whose effective uid is another while its real or saved one is in the range is a
    set-uid program run by a sandbox's uid, which no_new_privs rules out inside one.
    """
    found: dict[int, list[int]] = {}
    try:
        entries = list(os.scandir(proc))
    except OSError:
        return found
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            euid = entry.stat(follow_symlinks=False).st_uid
            if euid not in ids or euid in known:
                continue
            with open(f"{proc}/{entry.name}/status", "rb") as f:
                status = f.read()
        except OSError:
            continue  # exited meanwhile
        state = uid_line = b""
        for line in status.splitlines():
            if line.startswith(b"State:"):
                state = line
            elif line.startswith(b"Uid:"):
                uid_line = line
                break
        if b"(zombie)" in state or not uid_line:
            continue
        with contextlib.suppress(ValueError):
            for uid in {u for u in map(int, uid_line.split()[1:4]) if u in ids}:
                found.setdefault(uid, []).append(int(entry.name))
    return found


def _account_exists(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        pass
    try:
        grp.getgrgid(uid)
        return True
    except KeyError:
        return False


# -- the host-wide ledger ---------------------------------------------------------------
# Claims live in a run dir ($EGRESS_RUN_DIR), and two egress instances may use two. The
# uid is the host's, so its holder is also written where every instance looks: a file
# ``uid`` in the sandbox's workload directory (<workloads dir>/<id>/, host-wide), naming
# the claim that holds it. It goes with that directory at teardown.


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """The host-wide lock uids are picked under (after the run dir's claims lock)."""
    directory = workloads_dir()
    try:
        directory.mkdir(mode=0o711, parents=True, exist_ok=True)
        fd = os.open(directory / ".uids.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise SandboxError(f"{directory}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# Ledger entries read before, by (directory name, inode, mtime): ``record`` replaces the
# uid file, which changes its directory's mtime. Every create looks at every entry;
# reading each uid file again cost a create at 300 sandboxes several ms.
_entries: dict[tuple[str, int, int], tuple[int, str]] = {}


@dataclass(frozen=True)
class Entry:
    """One ledger entry: the sandbox (its directory's name), its uid, and the claim file
    that holds it. Its uid is held while the entry is there, whatever became of the claim:
    the workload's files are still that uid's."""

    sandbox_id: str
    uid: int
    claim_file: str

    def orphaned(self) -> bool:
        """Nothing of its sandbox is left but these files: its claim file and its netns
        are both gone (its run dir was removed, or a reboot emptied /run without a
        teardown). Only "no such file" counts as gone: a path that can't be read (a
        permission, a loop) is not taken for one."""
        for path in (self.claim_file, sandbox_pin(self.sandbox_id)):
            try:
                os.lstat(path)
                return False
            except FileNotFoundError:
                continue
            except OSError:
                return False
        return os.path.isabs(self.claim_file)  # a relative one names no file for sure


def ledger(skip: AbstractSet[str] = frozenset()) -> list[Entry]:
    """Every readable ledger entry but those of ``skip`` (to act on it: under ``locked``)."""
    try:
        entries = list(os.scandir(workloads_dir()))
    except OSError:
        return []
    known, out = {}, []
    for entry in entries:
        if entry.name in skip or entry.name.startswith("."):
            continue
        try:
            key = (entry.name, entry.inode(), entry.stat(follow_symlinks=False).st_mtime_ns)
            found = _entries.get(key)
            if found is None:
                uid_text, _, claim_file = Path(entry.path, "uid").read_text().partition("\n")
                found = (int(uid_text), claim_file.strip())
        except (OSError, ValueError):
            continue
        known[key] = found
        out.append(Entry(entry.name, *found))
    _entries.clear()
    _entries.update(known)
    return out


def ledger_held(skip: AbstractSet[str] = frozenset()) -> set[int]:
    """uids the ledger names (every run dir's sandboxes, and files a sandbox left behind
    until `egressctl gc` removes them). Entries of the sandboxes in ``skip`` are not
    looked at: the caller knows their uids already."""
    return {e.uid for e in ledger(skip)}


def record(sandbox_id: str, uid: int, claim_file: Path) -> None:
    """Write the ledger entry for a uid just picked (call under ``locked``)."""
    base = workloads_dir() / sandbox_id
    try:
        base.mkdir(mode=0o711, exist_ok=True)
        tmp = base / ".uid.tmp"
        tmp.write_text(f"{uid}\n{os.path.abspath(claim_file)}\n")
        os.replace(tmp, base / "uid")
    except OSError as exc:
        raise SandboxError(f"{base}: {exc.strerror}") from None


def pick(ids: range, taken: AbstractSet[int], known: AbstractSet[str] = frozenset()) -> int:
    """The lowest uid of ``ids`` no claim holds, no process runs as and no account names.

    Call with the claims lock and ``locked`` held; ``taken`` is what this run dir's live
    claims hold, ``known`` their sandbox ids (the ledger adds every other run dir's:
    looking at each entry cost a create at 1,000 sandboxes 10 ms).
    """
    check_range(ids)
    busy = ledger_held(known) | taken
    busy |= live_uids(ids, known=busy)
    for uid in ids:
        if uid not in busy and not _account_exists(uid):
            return uid
    raise UsageError(
        f"no free uid left in {ids.start}-{ids.stop - 1} ({len(busy)} held by sandboxes or "
        f"their processes); end some sandboxes (`egressctl gc` reclaims crashed ones, "
        f"`egressctl gc --orphans` the files sandboxes left behind) or "
        f"widen --uid-range / {ENV}"
    )
