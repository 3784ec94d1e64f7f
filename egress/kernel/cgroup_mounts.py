"""Where the cgroup hierarchies are mounted, read from /proc/self/mountinfo, never assumed.

cgroup v2 holds every sandbox; on hybrid hosts the v1 freezer (a second freeze, see
cgroup.py), the v1 cpu controller (the workload's share of the CPUs, see
``Cgroup.cpu_path``) and the v1 pids and memory controllers (its limits, see
``Cgroup.set_limits``) are mounted beside it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class CgroupMounts:
    v2: str | None  # the cgroup2 mount point
    freezer: str | None  # the v1 freezer hierarchy's mount point, if any
    cpu: str | None = None  # the v1 cpu controller's (often shared with cpuacct), if any
    pids: str | None = None  # the v1 pids controller's, if any
    memory: str | None = None  # the v1 memory controller's, if any


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo (octal)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> CgroupMounts:
    v2 = freezer = cpu = pids = memory = None
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        mount_point, fstype, options = _unescape(fields[4]), tail[0], tail[2].split(",")
        if fstype == "cgroup2" and v2 is None:
            v2 = mount_point
        if fstype != "cgroup":
            continue
        # Each on its own: one v1 hierarchy may hold several controllers (the same twin).
        if "freezer" in options and freezer is None:
            freezer = mount_point
        if "cpu" in options and cpu is None:
            cpu = mount_point
        if "pids" in options and pids is None:
            pids = mount_point
        if "memory" in options and memory is None:
            memory = mount_point
    return CgroupMounts(v2=v2, freezer=freezer, cpu=cpu, pids=pids, memory=memory)


@cache
def find_mounts() -> CgroupMounts:
    with open("/proc/self/mountinfo") as f:
        return parse_mountinfo(f.read())
