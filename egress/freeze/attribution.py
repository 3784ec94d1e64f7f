"""Which process is behind a violation, read while its cgroup is frozen.

The kernel's evidence names a socket by its 5-tuple (and its uid), not a process. The
sandbox's own /proc/PID/net/{tcp,udp}{,6} tables (a process's view is its netns's) map the
5-tuple to a socket inode; the fds of the cgroup's processes map the inode to a pid. When
the socket is already gone (a rejected connect closes at once), the processes of that uid
are named as candidates instead, and the record says which method found it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import struct
from typing import Any

from egress.datapath.constants import RESOLVER4
from egress.model import Flow, Violation

_TABLES = {"tcp": ("tcp", "tcp6"), "udp": ("udp", "udp6")}
MAX_PARENTS = 8


def attribute(v: Violation, pids: list[int]) -> dict[str, Any]:
    """The process record for ``v`` among ``pids`` (the sandbox cgroup's processes)."""
    if not pids:
        return {"method": "none", "note": "the sandbox had no processes left"}
    flow = v.flow
    if flow is None and v.qname is not None:
        flow = Flow("udp", "", RESOLVER4, None, 53)  # a query to the resolver, port unknown
    if flow is not None and flow.proto in _TABLES:
        inodes = _socket_inodes(flow, pids[0])
        owners = [p for p in pids if inodes & _fd_inodes(p)]
        if owners:
            return {"method": "socket", **describe(owners[0]), "others": owners[1:]}
    return _by_uid(v.uid, pids)


def _by_uid(uid: int | None, pids: list[int]) -> dict[str, Any]:
    candidates = [p for p in pids if uid is None or _uid(p) == uid]
    if not candidates:
        return {"method": "none", "note": f"no process of uid {uid} left in the sandbox"}
    out: dict[str, Any] = {"method": "uid", **describe(candidates[-1])}
    out["note"] = "the socket was already closed; newest process of that uid shown"
    out["candidates"] = [describe(p, parents=False) for p in candidates[:10]]
    return out


def describe(pid: int, parents: bool = True) -> dict[str, Any]:
    info: dict[str, Any] = {"pid": pid, "cmdline": _cmdline(pid), "uid": _uid(pid)}
    with contextlib.suppress(OSError):
        info["cwd"] = os.readlink(f"/proc/{pid}/cwd")
    with contextlib.suppress(OSError):
        info["exe"] = os.readlink(f"/proc/{pid}/exe")
    if parents:
        info["parents"] = _parents(pid)
    return info


def _parents(pid: int) -> list[dict[str, Any]]:
    """Ancestors inside the same cgroup: the workload's own chain, never the host's."""
    chain = []
    own = _cgroup_of(pid)
    for _ in range(MAX_PARENTS):
        pid = _ppid(pid)
        if pid <= 1 or _cgroup_of(pid) != own:
            break
        chain.append({"pid": pid, "cmdline": _cmdline(pid)})
    return chain


def _cgroup_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return next((line for line in f if line.startswith("0::")), "")
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _status_field(pid: int, key: str) -> str | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _uid(pid: int) -> int | None:
    field = _status_field(pid, "Uid")
    return int(field.split()[0]) if field else None


def _ppid(pid: int) -> int:
    field = _status_field(pid, "PPid")
    return int(field) if field else 0


def _fd_inodes(pid: int) -> set[int]:
    found = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    found.add(int(target[8:-1]))
    return found


def _socket_inodes(flow: Flow, pid: int) -> set[int]:
    """Inodes of the sandbox's sockets matching the flow's local and remote ends."""
    inodes = set()
    for table in _TABLES[flow.proto]:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            next(f, None)
            for line in f:
                inode = _match(line.split(), flow)
                if inode:
                    inodes.add(inode)
    return inodes


def _match(fields: list[str], flow: Flow) -> int | None:
    if len(fields) < 10:
        return None
    local, remote, inode = fields[1], fields[2], int(fields[9])
    lhost, lport = _endpoint(local)
    rhost, rport = _endpoint(remote)
    if flow.sport is not None and lport != flow.sport:
        return None
    if flow.src and lhost not in (flow.src, None):
        return None
    if rport == flow.dport and rhost == flow.dst:
        return inode or None
    # An unconnected socket (remote 0) may be the sender, but only its own port says so.
    if rport == 0 and rhost is None and flow.sport is not None:
        return inode or None
    return None


def _endpoint(text: str) -> tuple[str | None, int]:
    """/proc/net hex 'ADDR:PORT' (host byte order words) -> (address text, port)."""
    addr, _, port = text.partition(":")
    raw = bytes.fromhex(addr)
    words = struct.unpack(f"<{len(raw) // 4}I", raw)
    packed = struct.pack(f">{len(words)}I", *words)
    ip = ipaddress.ip_address(packed)
    if ip.is_unspecified:
        return None, int(port, 16)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        return str(ip.ipv4_mapped), int(port, 16)
    return str(ip), int(port, 16)
