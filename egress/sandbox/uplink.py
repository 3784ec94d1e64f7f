"""The uplink side: forwarding and NAT for every sandbox behind one uplink namespace.

One shared table (nft-templates/uplink.nft) serves all sandboxes of an uplink: a new
sandbox adds nothing to it, so creating the hundredth costs what the first did. The first
sandbox loads it and the last one removes it, both under the claims lock, so a sandbox
being created never finds the table half-removed.

Forwarding is turned on per interface, never for the namespace: ``net.ipv4.ip_forward``
and ``conf.all``/``conf.default`` stay as they were, so the uplink (often the host) does
not start routing between its other interfaces. The kernel asks the interface a packet
*arrives* on (IPv4 ``conf.IF.forwarding``; IPv6 ``conf.IF.force_forwarding``, Linux
6.17+), so two kinds of interface need it: the host end of each sandbox veth (egress's
own; it goes with the veth) and the uplink's default-route device, where the replies
arrive. That device was there before egress, so what egress changes on it is put back::

    first in:  read its values ─▶ save them (<run dir>/uplinks/) ─▶ load the table, with
               a guard for each family egress opens there ─▶ turn its forwarding on
    last out:  put the saved values back ─▶ delete the table ─▶ drop the saved file

The guard: what enters on the default-route device is forwarded into a sandbox as a reply,
or not at all. Where the host forwarded there already (a router, docker) egress changes
nothing on that device and adds no guard: the host's routing is its own. The saved file
outlives a crash; the last-out that ``egressctl gc`` runs for a dead sandbox, or the next
first-in, puts the values back.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import quote

from egress.datapath import constants as c
from egress.datapath.render import render_uplink
from egress.errors import SandboxError
from egress.kernel import netns
from egress.kernel.nft import NftHandle
from egress.store import claims
from egress.store.paths import private_dir, read_template, run_dir, write_private

ON = "1"
V4_ALL = "net/ipv4/conf/all/forwarding"  # net.ipv4.ip_forward is the same knob
V6_ALL = "net/ipv6/conf/all/forwarding"
NO_IPV6 = (
    "egress: sandboxes behind {where} get no IPv6: this kernel ({release}) has no "
    "per-interface net.ipv6.conf.<if>.force_forwarding (Linux 6.17 or later), and egress "
    "does not turn IPv6 forwarding on for a whole namespace (net.ipv6.conf.all.forwarding). "
    "IPv4 is not affected."
)
_warned: set[str | None] = set()


def v4_key(ifname: str) -> str:
    return f"net/ipv4/conf/{ifname}/forwarding"


def v6_key(ifname: str) -> str:
    return f"net/ipv6/conf/{ifname}/force_forwarding"


@dataclass(frozen=True)
class Seen:
    """The uplink's default-route device and namespace, before egress acts."""

    ipv4: str  # conf.IF.forwarding
    ipv6_all: str | None  # IPv6 conf.all.forwarding (None: no IPv6 at all)
    ipv6_force: str | None  # conf.IF.force_forwarding (None: this kernel lacks the knob)


@dataclass(frozen=True)
class Plan:
    open4: bool  # egress turns IPv4 forwarding on at the device, and guards it
    open6: bool  # egress turns IPv6 force_forwarding on at the device, and guards it
    ipv6: bool  # whether sandboxes' IPv6 can be forwarded at all


def ipv6_forwards(ipv6_all: str | None, has_force: bool) -> bool:
    """Can IPv6 arriving on an interface be forwarded: the namespace forwards IPv6
    already, or the kernel has per-interface force_forwarding."""
    return ipv6_all == ON or has_force


def plan(seen: Seen) -> Plan:
    """What egress changes on the default-route device: only what is off, and never a
    namespace-wide knob. With global IPv6 forwarding on there is nothing to open."""
    open6 = seen.ipv6_all != ON and seen.ipv6_force is not None and seen.ipv6_force != ON
    ipv6 = ipv6_forwards(seen.ipv6_all, seen.ipv6_force is not None)
    return Plan(open4=seen.ipv4 != ON, open6=open6, ipv6=ipv6)


@dataclass(frozen=True)
class Saved:
    """<run dir>/uplinks/NAME.json: written before egress changes the device."""

    netns_inode: int  # a netns pinned later under the same name is not this one
    ifname: str
    before: Mapping[str, str]  # each sysctl egress set to 1, and its value before
    namespace: Mapping[str, str | None]  # V4_ALL and V6_ALL then (see restore_plan)


def restore_plan(saved: Saved, now: Mapping[str, str | None]) -> dict[str, str]:
    """The values to write back. A value someone changed since egress set it (it is not
    1 any more) is theirs; so is every value of a family whose namespace-wide forwarding
    changed since (writing conf.all sets every interface: the host chose)."""
    out = {}
    for key, value in saved.before.items():
        family_all = V4_ALL if key.startswith("net/ipv4/") else V6_ALL
        if now.get(key) == ON and now.get(family_all) == saved.namespace.get(family_all):
            out[key] = value
    return out


def attach(uplink: str | None, host_if: str | None = None) -> None:
    """Make sure the uplink forwards and masquerades sandbox traffic, and that the host
    end ``host_if`` of a sandbox's veth forwards. Without ``host_if``: the host ends of
    this process's claimed sandboxes on this uplink."""
    uplink_if = netns.default_route_ifname(uplink)
    if uplink_if is None:
        where = f"uplink netns {uplink!r}" if uplink else "the host"
        raise SandboxError(f"{where} has no default route: the sandbox's traffic can't leave")
    hosts = [host_if] if host_if else _own_host_ends(uplink)
    with claims.locked():
        handle = _handle(uplink)
        saved = _load(uplink)
        set_up = saved is not None and handle.table_exists("inet", c.UPLINK_TABLE)
        if not set_up:
            _set_up(uplink, uplink_if, handle, saved)
        # One walk to the uplink's /proc/sys/net/ipv4 and ipv6 for the rest (Sysctls);
        # no nft call in it: a worker started again from this thread would be in there.
        with netns.sysctls(uplink) as found:
            if set_up and saved is not None:  # what the first one turned on is still on
                for key in saved.before:
                    if found.find(key) != ON:
                        found.set(key, ON)
            for name in hosts:
                _forward(found, name)
            v6_off = not ipv6_forwards(found.find(V6_ALL), _has_force_forwarding(found))
    if v6_off:
        _warn_no_ipv6(uplink)


def detach(uplink: str | None, sandbox_id: str) -> None:
    """Give up the sandbox's address claim; if no other live sandbox uses this uplink,
    put its forwarding back and remove the shared table. Under the claims lock: of
    sandboxes ending at once, the last one sees no other claim and does it. The claim
    goes last, so a crash half-way leaves it for ``egressctl gc`` to finish the job."""
    with claims.locked():
        if uplink is not None and not netns.netns_exists(uplink):
            _forget(uplink)  # its interfaces went with it
        elif not _another(uplink, sandbox_id):
            saved = _load(uplink)
            if saved is not None:  # first, while the guard still stands
                with netns.sysctls(uplink) as found:
                    _put_back(found, saved)
            _handle(uplink).delete_table("inet", c.UPLINK_TABLE)
            _forget(uplink)
        claims.release(sandbox_id)


# One libnftables context per uplink namespace, kept for the process's life: freeing one
# that loaded the uplink table costs ~7 ms (nft_ctx_free), which every sandbox's create
# and teardown would pay. Keyed by the namespace's inode too: a namespace removed and
# made again under the same name is another one, and the old context's socket is not in
# it. An fd of the namespace is kept with the context, so the namespace (and with it its
# inode number) lives as long as the entry: a later namespace can't take that number.
# Used only under the claims lock, so never by two threads at once.
_handles: dict[tuple[str | None, int], tuple[NftHandle, int]] = {}


def _handle(uplink: str | None) -> NftHandle:
    key = (uplink, netns.netns_inode(uplink))
    entry = _handles.get(key)
    if entry is None:
        for stale in [k for k in _handles if k[0] == uplink]:
            old, fd = _handles.pop(stale)
            old.close()
            os.close(fd)
        path = "/proc/thread-self/ns/net" if uplink is None else netns.netns_path(uplink)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise SandboxError(f"{path}: {exc.strerror}") from None
        if os.fstat(fd).st_ino != key[1]:  # replaced between the stat and the open
            os.close(fd)
            return _handle(uplink)
        entry = _handles[key] = (NftHandle.open(uplink), fd)
    return entry[0]


def _another(uplink: str | None, sandbox_id: str) -> bool:
    """Does a live sandbox other than this one still use this uplink? (The first found
    ends the look.)"""
    return any(
        other.id != sandbox_id and other.uplink_netns == uplink and not claims.is_stale(other)
        for other in claims.each()
    )


def _set_up(uplink: str | None, uplink_if: str, handle: NftHandle, saved: Saved | None) -> None:
    """First in (no table, or no record of what egress changed): set the uplink up."""
    with netns.sysctls(uplink) as found:
        if saved is not None:  # left by a crash: the host's own values first
            _put_back(found, saved)
        seen = Seen(
            ipv4=found.get(v4_key(uplink_if)),
            ipv6_all=found.find(V6_ALL),
            ipv6_force=found.find(v6_key(uplink_if)),
        )
        namespace = {key: found.find(key) for key in (V4_ALL, V6_ALL)}
    p = plan(seen)
    before = {v4_key(uplink_if): seen.ipv4} if p.open4 else {}
    if p.open6 and seen.ipv6_force is not None:
        before[v6_key(uplink_if)] = seen.ipv6_force
    _save(uplink, Saved(netns.netns_inode(uplink), uplink_if, before, namespace))
    # A table a crash left is replaced in the same transaction ("add; delete" makes the
    # delete valid whether or not it exists): one nft call, not two.
    table = f"inet {c.UPLINK_TABLE}"
    text = render_uplink(read_template("uplink.nft"), uplink_if, guard4=p.open4, guard6=p.open6)
    # The context is kept (``_handle``), and nft keeps a load's defines in it: undefine
    # them, or the next first-in would redefine them.
    names = [line.split()[1] for line in text.splitlines() if line.startswith("define ")]
    undefine = "".join(f"undefine {name}\n" for name in names)
    handle.load(f"add table {table}\ndelete table {table}\n{text}\n{undefine}")
    with netns.sysctls(uplink) as found:
        for key in before:
            found.set(key, ON)


def _put_back(found: netns.Sysctls, saved: Saved) -> None:
    keys = [*saved.before, V4_ALL, V6_ALL]
    now = {key: found.find(key) for key in keys}
    for key, value in restore_plan(saved, now).items():
        found.set(key, value)


def _forward(found: netns.Sysctls, host_if: str) -> None:
    """Forwarding on for what arrives on a sandbox veth's host end (nothing if the link
    is gone). IPv6 only where the kernel has the per-interface knob."""
    for key in (v4_key(host_if), v6_key(host_if)):
        value = found.find(key)
        if value is not None and value != ON:
            found.set(key, ON)


def _has_force_forwarding(found: netns.Sysctls) -> bool:
    return found.find(v6_key("lo")) is not None


def _own_host_ends(uplink: str | None) -> list[str]:
    pid = os.getpid()
    return [
        claim.host_if
        for claim in claims.load_all()
        if claim.uplink_netns == uplink and claim.owner_pid == pid
    ]


def _warn_no_ipv6(uplink: str | None) -> None:
    if uplink in _warned:
        return
    _warned.add(uplink)
    where = f"uplink netns {uplink!r}" if uplink else "the host"
    print(NO_IPV6.format(where=where, release=os.uname().release), file=sys.stderr, flush=True)


# ---- the saved values: one small file per uplink --------------------------------------


def saved_path(uplink: str | None) -> Path:
    name = "host" if uplink is None else "netns-" + quote(uplink, safe="")
    return run_dir() / "uplinks" / f"{name}.json"


def _save(uplink: str | None, saved: Saved) -> None:
    """Durable before the sysctl changes: a crash right after still knows the old value."""
    path = saved_path(uplink)
    try:
        private_dir(path.parent)
        write_private(path, json.dumps(asdict(saved), indent=2).encode(), durable=True)
    except OSError as exc:
        raise SandboxError(f"{path}: cannot save the uplink's forwarding: {exc}") from exc


def _load(uplink: str | None) -> Saved | None:
    """The saved values for this uplink, or None (none, unreadable, or of a netns that
    is gone: its interfaces went with it)."""
    path = saved_path(uplink)
    try:
        saved = Saved(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        print(f"egress: ignoring {path}: {exc}", file=sys.stderr)
        return None
    if saved.netns_inode != netns.netns_inode(uplink):
        return None
    return saved


def _forget(uplink: str | None) -> None:
    try:
        saved_path(uplink).unlink(missing_ok=True)
    except OSError as exc:
        raise SandboxError(f"{saved_path(uplink)}: {exc.strerror}") from exc
