"""Which cgroup the processes in a network namespace run in: for a sandbox attached
before its processes existed (a CNI ADD runs before the container's first process).

The runtime exposes the cgroup nowhere egress can read at ADD time, but once the
container runs, its processes are in the netns and in its cgroup. The cgroup to freeze
is the deepest one that holds every process in the netns (a pod's containers share the
netns and sit in sibling cgroups under the pod's). Never one that holds egress itself,
or the root: a host process that entered the netns (``ip netns exec``, a debugger) would
otherwise turn the answer into a cgroup with the host in it.
"""

from __future__ import annotations

import os

from egress.kernel.cgroup import find_mounts


class NoCgroup(Exception):
    """Why no cgroup could be bound (for the journal)."""


def processes_in(netns_path: str) -> list[int]:
    """PIDs (thread-group leaders) whose network namespace is the one at ``netns_path``."""
    want = os.stat(netns_path)
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue  # gone, or a kernel thread
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
            out.append(int(entry))
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


def discover(netns_path: str) -> tuple[str, str | None]:
    """(v2 directory, v1 freezer directory or None) to freeze for the processes in the
    netns; NoCgroup says why there is none (no process yet, or only a host one)."""
    mounts = find_mounts()
    if mounts.v2 is None:
        raise NoCgroup("no cgroup2 filesystem is mounted")
    try:
        pids = processes_in(netns_path)
    except OSError as exc:
        raise NoCgroup(f"netns {netns_path}: {exc.strerror}") from None
    found: list[tuple[str, str | None]] = []
    for pid in pids:
        try:
            found.append(cgroup_paths(pid))
        except OSError:
            continue  # exited meanwhile
    if not found:
        raise NoCgroup(f"no process runs in netns {netns_path} yet")
    v2 = common([p for p, _ in found])
    mine = cgroup_paths(os.getpid())[0]
    if v2 == "/" or common([v2, mine]) == v2:
        raise NoCgroup(
            f"the processes in netns {netns_path} share only cgroup {v2}, which holds "
            "egress too: not frozen (a host process entered the netns?)"
        )
    freezers = [f for _, f in found]
    freezer = None
    if mounts.freezer and all(f is not None for f in freezers):
        shared = common([f for f in freezers if f is not None])
        if shared != "/":
            freezer = os.path.join(mounts.freezer, shared.lstrip("/"))
    return os.path.join(mounts.v2, v2.lstrip("/")), freezer
