"""Which cgroup the processes in a network namespace run in: for a sandbox attached
before its processes existed (a CNI ADD runs before the container's first process).

The runtime exposes the cgroup nowhere egress can read at ADD time, but once the
container runs, its processes are in the netns and in its cgroup. The cgroup to freeze
is the deepest one that holds every process in the netns (a pod's containers share the
netns and sit in sibling cgroups under the pod's), and it must hold nothing else: a
host process that entered the netns (``ip netns exec``, a debugger, another pod's
shell) would otherwise widen it to a cgroup with other workloads, or the host, in it.
Such a cgroup is refused, and says why.

A process counts as in the netns if any of its threads is: a workload whose main thread
exited (a zombie leader) or moved to another netns is still found by its others.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection

from egress.kernel.cgroup import find_mounts


class NoCgroup(Exception):
    """Why no cgroup could be bound (for the journal). ``nobody``: no process runs in
    the netns yet (as opposed to a cgroup refused)."""

    def __init__(self, message: str, nobody: bool = False) -> None:
        super().__init__(message)
        self.nobody = nobody


def _same(path: str, want: os.stat_result) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False  # gone, a kernel thread, or a zombie leader
    return (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino)


def processes_in(netns_path: str) -> set[int]:
    """PIDs (thread-group ids) with a thread in the network namespace at ``netns_path``."""
    want = os.stat(netns_path)
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        if _same(f"/proc/{entry}/ns/net", want):
            out.add(int(entry))
            continue
        try:
            tasks = os.listdir(f"/proc/{entry}/task")
        except OSError:
            continue
        if tasks != [entry] and any(_same(f"/proc/{entry}/task/{t}/ns/net", want) for t in tasks):
            out.add(int(entry))  # another thread is: a zombie leader, or one that moved
    return out


def cgroup_paths(pid: int) -> tuple[str, str | None]:
    """(v2 path relative to the cgroup2 root, v1 freezer path or None) of ``pid``."""
    v2, freezer = None, None
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            hid, controllers, path = line.rstrip("\n").split(":", 2)
            if hid == "0" and controllers == "":
                v2 = path
            elif "freezer" in controllers.split(","):
                freezer = path
    if v2 is None:
        raise NoCgroup(f"process {pid} is in no cgroup v2")
    return v2, freezer


def common(paths: list[str]) -> str:
    """The deepest cgroup that holds every one of ``paths`` (relative, from "/")."""
    parts = [[p for p in path.split("/") if p] for path in paths]
    shared: list[str] = []
    for level in zip(*parts, strict=False):
        if any(name != level[0] for name in level):
            break
        shared.append(level[0])
    return "/" + "/".join(shared)


def procs_below(directory: str) -> set[int]:
    """Every process in the cgroup at ``directory`` and its descendants."""
    out: set[int] = set()
    for root, _dirs, _files in os.walk(directory):
        try:
            with open(os.path.join(root, "cgroup.procs")) as f:
                out.update(int(p) for p in f.read().split())
        except OSError:
            continue  # removed meanwhile
    return out


def under(path: str, roots: Collection[str]) -> bool:
    """``path`` is one of the cgroups ``roots`` or below one (paths from "/")."""
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def discover(
    netns_path: str, exclude: Collection[str] = (), skip_init: bool = False
) -> tuple[str, str | None]:
    """(v2 directory, v1 freezer directory or None) to freeze for the processes in the
    netns; NoCgroup says why there is none.

    ``exclude``: v2 cgroup paths (from the root, as /proc/PID/cgroup says) that hold
    egress's own processes in the netns (a sidecar and its observer in a pod): their
    processes are not the workload's, and the cgroup found must hold none of them.
    ``skip_init``: leave out PID 1 of this PID namespace (a pod's pause or infra process,
    which holds the namespaces and runs nothing)."""
    mounts = find_mounts()
    if mounts.v2 is None:
        raise NoCgroup("no cgroup2 filesystem is mounted")
    try:
        pids = processes_in(netns_path)
    except OSError as exc:
        raise NoCgroup(f"netns {netns_path}: {exc.strerror}") from None
    if skip_init:
        pids.discard(1)
    found: list[tuple[str, str | None]] = []
    ours: set[int] = set()
    for pid in sorted(pids):
        try:
            paths = cgroup_paths(pid)
        except OSError:
            continue  # exited meanwhile
        if exclude and under(paths[0], exclude):
            ours.add(pid)
            continue
        found.append(paths)
    pids -= ours
    if not found:
        raise NoCgroup(f"no process runs in netns {netns_path} yet", nobody=True)
    if any("/.." in v2 or v2.startswith("..") for v2, _ in found):
        raise NoCgroup("egressd runs in a cgroup namespace of its own, which hides where "
                       "the netns's processes are: run it in the host's (podman "
                       "--cgroupns=host)")  # fmt: skip
    v2 = common([p for p, _ in found])
    v2_dir = os.path.join(mounts.v2, v2.lstrip("/"))
    outside = _outsiders(v2_dir, pids, netns_path) if v2 != "/" else set()
    if v2 == "/" or outside:
        shown = ", ".join(str(p) for p in sorted(outside)[:5]) or "the host's"
        raise NoCgroup(f"the processes in netns {netns_path} share only cgroup {v2}, which "
                       f"also holds processes outside it ({shown}): not frozen")  # fmt: skip
    if ours and procs_below(v2_dir) & ours:
        raise NoCgroup(f"the workload's processes in netns {netns_path} share only cgroup "
                       f"{v2}, which also holds egress's own: not frozen (one workload "
                       "container per pod, beside the sidecar's)")  # fmt: skip
    freezer = None
    freezers = [f for _, f in found]
    if mounts.freezer and all(f is not None and "/.." not in f for f in freezers):
        shared = common([f for f in freezers if f is not None])
        candidate = os.path.join(mounts.freezer, shared.lstrip("/"))
        if shared != "/" and not _outsiders(candidate, pids, netns_path):
            freezer = candidate  # else v2 alone freezes it
    return v2_dir, freezer


def _outsiders(directory: str, inside: set[int], netns_path: str) -> set[int]:
    """Processes under the cgroup that are alive and provably not in the netns: each
    candidate is asked on its own. One forked after ``inside`` was listed is in the netns
    (a child starts in its parent's), and one that exited meanwhile is no outsider: a
    workload forking and exiting in a loop must not make its cgroup look shared."""
    try:
        want = os.stat(netns_path)
    except OSError as exc:  # removed meanwhile (a pod torn down): as discover says it
        raise NoCgroup(f"netns {netns_path}: {exc.strerror}") from None
    outside = set()
    for pid in procs_below(directory) - inside:
        where = _netns_of(pid, want)
        if where is None:
            continue  # gone (or a zombie): nothing to freeze
        if where:
            inside.add(pid)
        else:
            outside.add(pid)
    return outside


def _netns_of(pid: int, want: os.stat_result) -> bool | None:
    """Is any thread of ``pid`` in the netns ``want``; None if it is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    seen = False
    for task in tasks:
        try:
            st = os.stat(f"/proc/{pid}/task/{task}/ns/net")
        except OSError:
            continue
        seen = True
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
            return True
    return False if seen else None


def own_cgroup() -> str:
    """This process's v2 cgroup, from the root (as /proc/PID/cgroup says)."""
    return cgroup_paths(os.getpid())[0]


class Peers:
    """egress's own processes in a pod, each in a container (a cgroup) of its own: the
    sidecar and its observer. Each announces its cgroup in a directory they share (an
    emptyDir no workload container mounts); discovery leaves every announced cgroup out.
    Without a directory only this process's own cgroup is left out."""

    def __init__(self, directory: str | None, role: str) -> None:
        self.directory = directory
        self.file: str | None = None
        if directory is not None:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            self.file = os.path.join(directory, f"{role}-{os.getpid()}")
            tmp = self.file + ".tmp"
            with open(tmp, "w") as f:
                f.write(own_cgroup() + "\n")
            os.replace(tmp, self.file)

    def exclusions(self) -> set[str]:
        out = {own_cgroup()}
        if self.directory is None:
            return out
        try:
            names = os.listdir(self.directory)
        except OSError:
            return out
        for name in names:
            if name.endswith(".tmp"):
                continue
            try:
                with open(os.path.join(self.directory, name)) as f:
                    path = f.read().strip()
            except OSError:
                continue
            if path.startswith("/") and "/.." not in path:
                out.add(path)
        return out

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.file)
            self.file = None


CLONE_NEWCGROUP = 0x02000000


def enter_host_cgroupns(pid: int = 1) -> bool:
    """Join the cgroup namespace of PID 1 (``pid``: the host's, with the host's PID namespace: a
    DaemonSet's hostPID, podman's --pid host) if this process is in another; True if it
    moved. Call it before any thread starts: a namespace is per thread, and threads
    take their creator's. Without it, /proc/PID/cgroup says ``/..`` for everything
    outside this container, and ``discover`` refuses (it cannot say which cgroup)."""
    try:
        if os.stat(f"/proc/{pid}/ns/cgroup").st_ino == os.stat("/proc/self/ns/cgroup").st_ino:
            return False
    except OSError:
        return False  # no cgroup namespaces here, or PID 1 is not ours to see
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/proc/{pid}/ns/cgroup", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWCGROUP) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns(cgroup of PID {pid}): {os.strerror(err)}")
    finally:
        os.close(fd)
    return True
