"""Claims on the subnet pool: which sandbox holds which address block.

One JSON file per sandbox under <run dir>/sandboxes/, written under an flock so that
concurrent ``egressctl run``s never pick the same block. Directory 0750 and files 0640,
root's and the egress group's (``paths.private_dir``). A claim whose owner process is
gone and whose netns no longer exists is stale and is reclaimed. A process keeps what it
read of the claims between its claims (``_Known``); egressd learns what changed from
inotify (``track``).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

from egress.datapath.addressing import Pools, Ranges, SandboxNet, add_range, first_free_in, merged
from egress.errors import SandboxError
from egress.store import uids
from egress.store.inotify import DirWatch
from egress.store.paths import (
    netns_name,
    netns_pin,
    private_dir,
    run_dir,
    sandbox_pin,
    tighten,
    workloads_dir,
    write_private,
)


@dataclass
class Claim:
    id: str
    index: int
    netns: str
    host_if: str
    uplink_netns: str | None
    owner_pid: int
    net4: str = ""
    net6: str = ""
    cgroup: str = ""
    keep: bool = False
    uid: int | None = None  # the workload's uid and gid, from store/uids.py's range


class IdTaken(SandboxError):
    """Another claim has this sandbox id (random ids collide, rarely): pick another."""


def sandboxes_dir() -> Path:
    return run_dir() / "sandboxes"


@contextlib.contextmanager
def locked() -> Iterator[None]:
    directory = sandboxes_dir()
    try:
        private_dir(directory)
        fd = os.open(directory / ".lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise SandboxError(f"{directory}: {exc.strerror}") from None
    try:
        tighten(directory / ".lock")  # egress's group, as everything here
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def alive(pid: int) -> bool:
    """Is there a process with this pid (ours to signal or not)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load_all() -> list[Claim]:
    return list(each())


def each() -> Iterator[Claim]:
    """Every claim, read one file at a time in id order: a caller that stops at the first
    it looks for reads no more (a sandbox's teardown among 1,000 read them all)."""
    for path in sorted(sandboxes_dir().glob("*.json")):
        try:
            claim = Claim(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # a half-written or foreign file holds no claim
        yield claim


def is_stale(claim: Claim) -> bool:
    return not alive(claim.owner_pid) and not os.path.exists(netns_pin(claim.netns))


@dataclass(frozen=True)
class _Held:
    """What a claim file holds (a save replaces the file, so this never changes while
    the file lives): its sandbox, owner, netns, address block and uid."""

    id: str
    owner_pid: int
    netns: str
    netns_inode: int | None  # of /run/netns/<netns> when read: a netns made again differs
    spans4: tuple[tuple[int, int], ...]  # the block's first and last address, as integers
    spans6: tuple[tuple[int, int], ...]
    uid: int | None


def _netns_inode(name: str) -> int | None:
    try:
        return os.stat(netns_pin(name)).st_ino
    except OSError:
        return None


K = TypeVar("K")


class _Known:
    """Every live claim's holdings by file name, as this process last read them, and the
    address ranges they take (merged, built when first asked for).

    Each look (``claim``, under the lock) reads again only what may have changed: a file
    whose inode is another (a save replaces the file), and a claim of another process
    whose netns is gone or was made again (its owner may have died). A known claim of
    this process's own is live (its owner runs) and costs nothing. With ``track()``
    (egressd), the directory is not even listed: its inotify events name what changed
    (listed whole again when the kernel lost some, or the watch went).
    Reading and parsing every file again made a create at 300 sandboxes spend 14 ms;
    listing 1,000 and merging their ranges cost one at 1,000 sandboxes 5 ms.
    """

    def __init__(self) -> None:
        self.held: dict[str, tuple[int, _Held]] = {}  # file name -> (its inode, holdings)
        self.foreign: set[str] = set()  # those of other processes' claims
        self.unread: set[str] = set()  # files that hold no claim now (not JSON, say)
        self.uids: Counter[int] = Counter()  # the workload uids they hold
        self.ids: Counter[str] = Counter()  # their sandbox ids
        self.directory: tuple[str, int, int] | None = None  # path, st_dev, st_ino
        self.watch: DirWatch | None = None
        self._ranges: tuple[Ranges, Ranges] | None = None

    def look(self, directory: Path, tracked: bool) -> None:
        """Bring ``held`` up to date with ``directory`` (call under the lock). On an
        error, the next look lists the directory whole: the events it had drained are
        gone."""
        try:
            self._look(directory, tracked)
        except BaseException:
            self.forget_watch()
            raise

    def _look(self, directory: Path, tracked: bool) -> None:
        st = os.stat(directory)
        here = (str(directory), st.st_dev, st.st_ino)
        if here != self.directory:  # another run dir, or the same made again
            self.forget()
            self.directory = here
        changed = self.watch.changes() if self.watch is not None else None
        if changed is None and tracked:
            self.forget_watch()
            with contextlib.suppress(OSError):  # no inotify (limits): list it each time
                self.watch = DirWatch(str(directory))  # before the listing: nothing missed
        if changed is None:
            self._list(directory)
        else:
            for name in changed | self.unread:
                self._read(directory, name)
        for name in list(self.foreign):
            held = self.held[name][1]
            if held.netns_inode is None or _netns_inode(held.netns) != held.netns_inode:
                self._read(directory, name)

    def _list(self, directory: Path) -> None:
        inodes = {
            e.name: e.inode()
            for e in os.scandir(directory)
            if e.name.endswith(".json") and not e.name.startswith(".")
        }
        for name in [n for n in self.held if n not in inodes]:
            self._drop(name)
        for name, inode in inodes.items():
            known = self.held.get(name)
            if known is None or known[0] != inode:
                self._read(directory, name)

    def _read(self, directory: Path, name: str) -> None:
        if not name.endswith(".json") or name.startswith("."):
            return  # a save's temporary file, or nothing of ours
        path = directory / name
        self.unread.discard(name)
        try:
            with open(path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                existing = Claim(**json.loads(f.read()))
            both = bool(existing.net4 and existing.net6)  # an older claim may lack them
            spans4 = _spans(existing.net4) if both else ()
            spans6 = _spans(existing.net6) if both else ()
        except FileNotFoundError:
            self._drop(name)
            return
        except OSError as exc:  # it may hold a claim: no claim is made without it
            raise SandboxError(f"{path}: {exc.strerror}") from None
        except (ValueError, TypeError):
            self._drop(name)  # not a claim (what else is there): read again at each look
            self.unread.add(name)
            return
        if is_stale(existing):
            release(existing.id)
            self._drop(name)
            return
        held = _Held(existing.id, existing.owner_pid, existing.netns,
                     _netns_inode(existing.netns), spans4, spans6, existing.uid)  # fmt: skip
        before = self.held.get(name)
        if before is not None:
            self._count(before[1], -1)
        self.held[name] = (inode, held)
        self._count(held, 1)
        if held.owner_pid == os.getpid():
            self.foreign.discard(name)
        else:
            self.foreign.add(name)
        if before is not None:
            if (before[1].spans4, before[1].spans6) != (held.spans4, held.spans6):
                self._ranges = None  # a span may have gone: merge again when asked
        elif self._ranges is not None:
            for span in held.spans4:
                add_range(self._ranges[0], span)
            for span in held.spans6:
                add_range(self._ranges[1], span)

    def _drop(self, name: str) -> None:
        self.foreign.discard(name)
        gone = self.held.pop(name, None)
        if gone is not None:
            self._count(gone[1], -1)
            self._ranges = None

    def _count(self, held: _Held, n: int) -> None:
        _add(self.ids, held.id, n)
        if held.uid is not None:
            _add(self.uids, held.uid, n)

    def ranges(self) -> tuple[Ranges, Ranges]:
        """The v4 and v6 address ranges the live claims take."""
        if self._ranges is None:
            holdings = [h for _, h in self.held.values()]
            self._ranges = (merged(s for h in holdings for s in h.spans4),
                            merged(s for h in holdings for s in h.spans6))  # fmt: skip
        return self._ranges

    def forget_watch(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None

    def forget(self) -> None:
        self.forget_watch()
        self.held.clear()
        self.foreign.clear()
        self.unread.clear()
        self.uids.clear()
        self.ids.clear()
        self._ranges = None
        self.directory = None


def _add(counter: Counter[K], key: K, n: int) -> None:
    counter[key] += n
    if counter[key] <= 0:
        del counter[key]


_known = _Known()
_tracked = False
os.register_at_fork(after_in_child=_known.forget)  # a child shares no queue, no claims


def track() -> None:
    """Learn the claims directory's changes from inotify from now on, instead of
    listing it at every claim: for a process that makes many sandboxes (egressd). Without
    inotify (a limit reached), it lists it as before."""
    global _tracked
    _tracked = True


def _spans(net: str) -> tuple[tuple[int, int], ...]:
    """A claim's block as a (first, last) integer span; none for a claim without one."""
    if not net:
        return ()
    n = ipaddress.ip_network(net)
    return ((int(n.network_address), int(n.broadcast_address)),)


def claim(
    sandbox_id: str, pools: Pools, uplink_netns: str | None, uid_range: range | None = None
) -> Claim:
    """Atomically take the lowest address block of ``pools`` that overlaps no live
    sandbox's (sandboxes started with other --subnet-pool values included) and, with
    ``uid_range``, the lowest uid of it no live sandbox or process holds."""
    with locked():
        if (sandboxes_dir() / f"{sandbox_id}.json").exists():
            raise IdTaken(f"sandbox id {sandbox_id} is taken already")
        # Names every run dir on the host shares: another run dir's live sandbox with this
        # id has them, and a failed create's undo would remove its workload files.
        if os.path.lexists(sandbox_pin(sandbox_id)) or os.path.lexists(
            workloads_dir() / sandbox_id
        ):
            raise IdTaken(f"sandbox id {sandbox_id} is in use on this host")
        _known.look(sandboxes_dir(), _tracked)
        net = first_free_in(pools, *_known.ranges())
        if uid_range is None:
            return _save_new(sandbox_id, net, uplink_netns, None)
        with uids.locked():
            # The ledger's entries for these claims name the uids they hold already.
            uid = uids.pick(uid_range, _known.uids.keys(), known=_known.ids.keys())
            uids.record(sandbox_id, uid, sandboxes_dir() / f"{sandbox_id}.json")
            return _save_new(sandbox_id, net, uplink_netns, uid)


def _save_new(sandbox_id: str, net: SandboxNet, uplink_netns: str | None, uid: int | None) -> Claim:
    new = Claim(
        id=sandbox_id,
        index=net.index,
        net4=str(net.net4),
        net6=str(net.net6),
        netns=netns_name(sandbox_id),
        host_if=f"eg-{sandbox_id}",
        uplink_netns=uplink_netns,
        owner_pid=os.getpid(),
        uid=uid,
    )
    save(new)
    return new


def save(c: Claim) -> None:
    write_private(sandboxes_dir() / f"{c.id}.json", json.dumps(asdict(c), indent=2).encode())


def release(sandbox_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (sandboxes_dir() / f"{sandbox_id}.json").unlink()


def mark_kept(sandbox_id: str) -> None:
    """Record that the sandbox was kept on purpose (`egressctl run --keep`)."""
    with locked():
        for c in load_all():
            if c.id == sandbox_id:
                c.keep = True
                save(c)
