"""What egressd serves, on disk: one JSON file per sandbox under the run dir.

A record is written (atomically) once the sandbox is served and after each policy swap,
and removed when the sandbox is deleted. Stopping egressd leaves the records (and the
kernel's rules) in place, so the next egressd adopts them; `egressd observer` reads the
same records to know which sandboxes to watch. A record holds the sandbox's whole
policy: directory 0750, files 0640, root's and the egress group's (``paths.private_dir``).

    <run dir>/ID.json  {id, kind, netns, cgroup, freezer, uplink_netns, upstream,
                        policy, policy_sha256, lo_raised, created_at, daemon_pid}
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from egress.store.paths import private_dir, run_dir, tighten, write_private

RECORDS_SUBDIR = "daemon"  # under egress's run dir (/run/egress)


def records_dir() -> Path:
    """Where egressd keeps its records by default: /run/egress/daemon (``--run-dir``)."""
    return run_dir() / RECORDS_SUBDIR


@dataclass(kw_only=True)
class Record:
    id: str
    kind: str  # a SandboxKind
    netns: str
    cgroup: str
    policy: str  # the policy text, as the API received it
    freezer: str | None = None
    uplink_netns: str | None = None
    upstream: str | None = None
    lo_raised: bool = False
    created_at: float = 0.0
    daemon_pid: int = 0
    uid: int | None = None  # the workload's uid and gid (created sandboxes)
    # Who asked for it, for that caller to find its own again (a CNI plugin's GC):
    # free text, e.g. "cni:NETWORK:CONTAINERID:IFNAME".
    owner: str | None = None
    cgroup_found: bool = False  # cgroup found from the netns's processes: look again later
    # The netns's (st_dev, st_ino) when attached: a /proc/PID/ns/net path names another
    # netns once the PID is reused, and an adoption must not follow it there.
    netns_inode: list[int] | None = None

    @property
    def policy_sha256(self) -> str:
        return hashlib.sha256(self.policy.encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "policy_sha256": self.policy_sha256}


def prepare(directory: Path) -> None:
    """Make the records' directory, or narrow it and the records an older egressd left
    looser (0755 and 0644 before): they hold policies. OSError as is."""
    private_dir(directory)
    for path in directory.glob("*.json"):
        tighten(path)


def save(directory: Path, record: Record) -> None:
    private_dir(directory)
    data = json.dumps(record.to_json()).encode()
    write_private(directory / f"{record.id}.json", data, durable=True)


def remove(directory: Path, sandbox_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (directory / f"{sandbox_id}.json").unlink()


def load(directory: Path, sandbox_id: str) -> Record | None:
    """One sandbox's record, or None if it has none (deleted) or it can't be read."""
    try:
        data = json.loads((directory / f"{sandbox_id}.json").read_text())
        fields = set(Record.__dataclass_fields__)
        return Record(**{k: v for k, v in data.items() if k in fields})
    except (OSError, ValueError, TypeError):
        return None


def load_all(directory: Path) -> list[Record]:
    """Every readable record; unreadable ones are skipped (a crash mid-write leaves only
    the .tmp file, never a torn record)."""
    found = (load(directory, path.stem) for path in sorted(directory.glob("*.json")))
    return [record for record in found if record is not None]


class Records:
    """``load_all`` for a reader that asks again and again (each observer shard, four
    times a second while sandboxes come and go): a record is read again only if its
    file is not the one read before. A save replaces the file (another inode) and a
    swap's record differs in its size or time; that a later file has all three of an
    earlier one's would take its inode freed and reused, and the same size, within one
    timestamp tick. ``refresh`` reads the kept ones anew anyway, a share at a time (a
    shard reads each about every RESCAN_S, so no such match outlives that for long).
    ``wanted``: the sandbox ids this reader keeps (a shard's own); the others' files are
    never read. 1,000 records: 23 ms to read and parse them all, 2.6 ms to look, on a
    quiet machine; under egressd's load at 1,000 sandboxes a shard's full read held its
    loop 35-106 ms."""

    def __init__(self, directory: Path, wanted: Callable[[str], bool] | None = None) -> None:
        self.directory = directory
        self.wanted = wanted
        self._read: dict[str, tuple[tuple[int, int, int], Record]] = {}
        self._last = ""  # the last name a refresh read: the next one starts after it

    def load_all(self) -> list[Record]:
        try:
            entries = sorted(
                (e for e in os.scandir(self.directory) if e.name.endswith(".json")),
                key=lambda e: e.name,
            )
        except FileNotFoundError:
            entries = []
        read, out = {}, []
        for entry in entries:
            if self.wanted is not None and not self.wanted(entry.name[: -len(".json")]):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed meanwhile
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            known = self._read.get(entry.name)
            # Read after the stat: a file replaced in between is read new and kept
            # under the old key, so the next look reads it again.
            record = (
                known[1]
                if known is not None and known[0] == key
                else load(self.directory, entry.name[: -len(".json")])
            )
            if record is not None:
                read[entry.name] = (key, record)
                out.append(record)
        self._read = read
        return out

    def refresh(self, share: float) -> bool:
        """Read the next ``share`` of the kept records anew (at least one, in name order
        after the last one read, wrapping), whatever their files say, and keep what was
        read: called at each look with share = the time since the last look over a
        period, every record is read anew about once a period, a slice per look (records
        made meanwhile take their turn by name). True when one differs from the copy
        kept, or is gone: the caller looks again (``load_all``)."""
        names = list(self._read)  # in name order: load_all keeps them sorted
        if not names:
            return False
        count = min(len(names), max(1, math.ceil(len(names) * share)))
        start = bisect.bisect_right(names, self._last) % len(names)
        chosen = (names[start:] + names[:start])[:count]
        self._last = chosen[-1]
        differs = False
        for name in chosen:
            try:
                st = os.stat(self.directory / name, follow_symlinks=False)
            except FileNotFoundError:
                differs = True  # removed: load_all drops it
                continue
            record = load(self.directory, name[: -len(".json")])
            if record is None:
                differs = True
                continue
            differs = differs or record != self._read[name][1]
            self._read[name] = ((st.st_ino, st.st_mtime_ns, st.st_size), record)
        return differs
