"""Claims on the subnet pool: which sandbox holds which address block.

One JSON file per sandbox under <run dir>/sandboxes/, written under an flock so that
concurrent ``egressctl run``s never pick the same block. Directory 0750 and files 0640,
root's and the egress group's (``paths.private_dir``). A claim whose owner process is
gone and whose netns no longer exists is stale and is reclaimed.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from egress.datapath.addressing import Pools, SandboxNet, first_free_spans
from egress.errors import SandboxError
from egress.store import uids
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


# Claim files read before, by (file name, inode): each save replaces the file, so a
# rewritten claim has another inode. ``claim()`` looks at every claim under the lock;
# reading and parsing each file again made a create at 300 sandboxes spend 14 ms there.
_held: dict[tuple[str, int], _Held] = {}


def _holdings() -> list[_Held]:
    """What every live claim holds (stale ones released on the way). A known claim of
    this process's own is live (its owner runs) and costs nothing; another known one
    whose netns exists is live whoever owns it, which costs a stat; any other, or one
    whose netns was made again since (another inode), is read."""
    me = os.getpid()
    try:
        entries = [
            e
            for e in os.scandir(sandboxes_dir())
            if e.name.endswith(".json") and not e.name.startswith(".")
        ]
    except FileNotFoundError:
        entries = []
    known, out = {}, []
    for entry in entries:
        key = (entry.name, entry.inode())
        held = _held.get(key)
        if held is None or (
            held.owner_pid != me
            and (held.netns_inode is None or _netns_inode(held.netns) != held.netns_inode)
        ):
            try:
                existing = Claim(**json.loads(Path(entry.path).read_text()))
            except (OSError, ValueError, TypeError):
                continue  # a half-written or foreign file holds no claim
            if is_stale(existing):
                release(existing.id)
                continue
            both = bool(existing.net4 and existing.net6)  # an older claim may lack them
            held = _Held(existing.id, existing.owner_pid, existing.netns,
                         _netns_inode(existing.netns), _spans(existing.net4) if both else (),
                         _spans(existing.net6) if both else (), existing.uid)  # fmt: skip
        known[key] = held
        out.append(held)
    _held.clear()
    _held.update(known)
    return out


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
        holdings = _holdings()
        net = first_free_spans(pools, (s for h in holdings for s in h.spans4),
                               (s for h in holdings for s in h.spans6))  # fmt: skip
        held = {h.uid for h in holdings if h.uid is not None}
        if uid_range is None:
            return _save_new(sandbox_id, net, uplink_netns, None)
        with uids.locked():
            # The ledger's entries for these claims name what ``held`` has already.
            uid = uids.pick(uid_range, held, known={h.id for h in holdings})
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
