"""Attach egress to a network namespace and cgroup that another runtime made.

bubblewrap, podman, containerd and systemd-nspawn create their own namespaces. egress
adds exactly three things to such a netns: its ruleset as table ``inet egress`` (the same
template as a sandbox it made), the NFQUEUE rule its checked names need (in
iptables-nft's ``mangle`` table, ``kernel.queue_rule``) and, if it was down, the loopback
link the resolver listens on. Detaching removes exactly those again, so the netns is
left as it was; the cgroup is only ever frozen, thawed or killed, never made or removed.

    netns (name or path, opened once) ─▶ create table inet egress (refused: attached
        already) ─▶ lo up ─▶ NFQUEUE rule ─▶ nft load into the table
    detach ─▶ NFQUEUE rule out ─▶ lo down again if it was down ─▶ delete the table
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import os
import socket
import stat
import struct
import sys
import time

from egress.datapath import constants as c
from egress.datapath.addressing import SandboxNet
from egress.datapath.render import queue_rules as render_queue_rules
from egress.datapath.render import render_sandbox
from egress.errors import AlreadyAttached, EgressError, SandboxError
from egress.kernel import netns
from egress.kernel import queue_rule as queue_rules
from egress.kernel.cgroup import Cgroup
from egress.kernel.cgroup_mounts import find_mounts
from egress.kernel.netns_cgroup import NoCgroup, cgroup_paths, under
from egress.kernel.nft import NftHandle
from egress.model import Policy
from egress.sandbox.lifecycle import Sandbox, renew_rules
from egress.store.paths import read_template

# An attached sandbox has no address block of egress's: its network is the runtime's.
NO_NET = SandboxNet(-1, ipaddress.IPv4Network("0.0.0.0/32"), ipaddress.IPv6Network("::/128"))
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def attach(
    sandbox_id: str,
    policy: Policy,
    netns_ref: str,
    cgroup_v2: str | None,
    freezer: str | None = None,
) -> tuple[Sandbox, bool]:
    """Enforce ``policy`` in a foreign netns: (the sandbox, whether egress raised lo).

    ``cgroup_v2`` None: not known yet (a CNI ADD); bound from the processes that come
    to run in the netns (``Cgroup.in_netns``). On failure nothing of egress's is left
    there. ``Sandbox.destroy`` detaches.

    The netns is opened once, first, and every step after goes through that descriptor
    (``pinned``): a path the caller gave (a symlink, an OCI hook's /proc/PID/ns/net) can
    name another netns a moment later, and the checks, the rules, lo and the queue rule
    would each land wherever it pointed at the time. Cgroup paths are resolved once, for
    the same reason: a freeze writes where the check looked.
    """
    start = time.monotonic()
    pin = _open_netns(netns_ref)
    pinned = netns.fd_path(pin)
    try:
        cgroup_v2 = os.path.realpath(cgroup_v2) if cgroup_v2 else cgroup_v2
        freezer = os.path.realpath(freezer) if freezer else freezer
        _refuse_the_hosts(pin, netns_ref, cgroup_v2, freezer)
        cgroup = _cgroup(pinned, netns_ref, cgroup_v2, freezer)
        nft = NftHandle.open(pinned, label=netns_ref)
    except BaseException:
        os.close(pin)
        raise
    sb = Sandbox(sandbox_id, policy, NO_NET, netns_ref, "", None, cgroup, nft)
    sb.hold(lambda: _unpin(cgroup, pin))
    sb.netns_id, sb.pinned = _id(pin), pinned
    sb.add_undo("nft handle", nft.close)
    try:
        # Made empty first, the claim on the netns: a look for it, then a load, let two
        # attaches at once (egressd's API, or CNI and an OCI hook) both go on, and the
        # loser's undo removed the winner's table and left its netns open.
        if not nft.create_table("inet", c.TABLE):
            raise AlreadyAttached(f"netns {netns_ref} already has table inet {c.TABLE}")
        sb.add_undo(f"table inet {c.TABLE}", lambda: nft.delete_table("inet", c.TABLE))
        lo_raised = not _lo_is_up(pinned, netns_ref)
        if lo_raised:
            netns.loopback_up(pinned)
            sb.add_undo(f"lo of {netns_ref}", lambda: _lo_down(pinned, netns_ref))
        # Ours to remove when detaching, with the table: this netns outlives the sandbox.
        sb.add_undo("NFQUEUE rule", lambda: queue_rules.remove(pinned, render_queue_rules()))
        if policy.connect.check_names:
            queue_rules.install(pinned, render_queue_rules(), check=True)
        nft.load(render_sandbox(read_template("sandbox.nft"), policy))  # into the claim
    except BaseException:
        with contextlib.suppress(EgressError):
            sb.destroy()
        raise
    sb.created_s = time.monotonic() - start
    if policy.limits.explicit:
        print(f"egress: sandbox {sandbox_id}: spec.limits not applied: an attached sandbox's"
              " cgroup, and its limits, are its runtime's (a pod's resources.limits)",
              file=sys.stderr)  # fmt: skip
    return sb, lo_raised


def adopt(
    sandbox_id: str,
    policy: Policy,
    netns_ref: str,
    cgroup_v2: str,
    freezer: str | None,
    lo_raised: bool,
    found: bool = False,
    netns_id: tuple[int, int] | None = None,
) -> Sandbox:
    """An attachment a previous process made, with its learned sets as they are (and its
    rules, unless ``renew_rules`` finds them an older egress's);
    ``Sandbox.destroy`` detaches it the same way. ``found``: its cgroup is the one its
    processes run in (``Cgroup.in_netns``), looked for again at each freeze.
    ``netns_id``: the (device, inode) it was attached as: a path that names another
    netns by now is refused. Pinned as ``attach`` pins it."""
    pin = _open_netns(netns_ref, gone=True)
    pinned = netns.fd_path(pin)
    try:
        if netns_id is not None and _id(pin) != netns_id:
            raise SandboxError(f"netns {netns_ref} is not the one attached any more")
        cgroup = Cgroup.attached(pinned, cgroup_v2, freezer, found, label=netns_ref)
        nft = NftHandle.open(pinned, label=netns_ref)
    except BaseException:
        os.close(pin)
        raise
    sb = Sandbox(sandbox_id, policy, NO_NET, netns_ref, "", None, cgroup, nft)
    sb.hold(lambda: _unpin(cgroup, pin))
    sb.netns_id, sb.pinned = _id(pin), pinned
    sb.add_undo("nft handle", nft.close)
    try:
        if not nft.table_exists("inet", c.TABLE):
            raise SandboxError(f"netns {netns_ref} has no table inet {c.TABLE} any more")
        if renew_rules(nft, policy, pinned):
            # Its conntrack entries stay: a container's inbound flows began from sources
            # not its own too, and forgetting them would cut them.
            print(f"egressd: sandbox {sandbox_id}: rules renewed (an older egress loaded "
                  "them); flows begun before keep going until they end",
                  file=sys.stderr)  # fmt: skip
    except BaseException:
        sb.release()  # nothing of the netns's is undone: it stays as it was found
        raise
    # Undone as attach's are: the queue rule, lo, then the table.
    sb.add_undo(f"table inet {c.TABLE}", lambda: nft.delete_table("inet", c.TABLE))
    if lo_raised:
        sb.add_undo(f"lo of {netns_ref}", lambda: _lo_down(pinned, netns_ref))
    sb.add_undo("NFQUEUE rule", lambda: queue_rules.remove(pinned, render_queue_rules()))
    return sb


_NS_GET_NSTYPE = 0xB703  # ioctl(2) on a namespace file: which kind it is
_CLONE_NEWNET = 0x40000000


def _open_netns(netns_ref: str, gone: bool = False) -> int:
    """A descriptor of the netns ``netns_ref`` names now; refused if it names something
    else (opened non-blocking: a FIFO a caller names does not hang the open)."""
    path = netns.netns_path(netns_ref)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a netns file is; no device is opened
            raise SandboxError(f"netns {netns_ref!r}: {path} is not a network namespace")
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise SandboxError(f"netns {netns_ref!r}: {exc.strerror}") from None
        if gone:
            raise SandboxError(f"netns {netns_ref!r} is gone") from None
        raise SandboxError(
            f"netns {netns_ref!r} does not exist (a name under /run/netns or a path)"
        ) from None
    try:
        kind = fcntl.ioctl(fd, _NS_GET_NSTYPE)
    except OSError:
        kind = -1
    if kind != _CLONE_NEWNET:
        os.close(fd)
        raise SandboxError(f"netns {netns_ref!r}: {path} is not a network namespace")
    return fd


def _unpin(cgroup: Cgroup, fd: int) -> None:
    """Close the netns's descriptor, once the cgroup no longer looks through it (a kill
    that binds it meanwhile would otherwise read whatever netns gets that number next)."""
    cgroup.forget_netns()
    os.close(fd)


def _id(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _refuse_the_hosts(pin: int, netns_ref: str, cgroup_v2: str | None, freezer: str | None) -> None:
    """Refuse the netns of PID 1 or of egress itself, and a cgroup that holds either of
    them: attached there, egress would put default-deny rules on the host, or freeze (and
    at a kill, kill) PID 1 or itself. The API's callers (group egress) are not root."""
    target = _id(pin)
    ours = ((1, "PID 1"), (os.getpid(), "egress"))
    for pid, who in ours:
        if target == netns.netns_id(f"/proc/{pid}/ns/net"):
            raise SandboxError(f"netns {netns_ref} is the network namespace of {who} (pid "
                               f"{pid}): attach to a sandbox's own")  # fmt: skip
    mounts = find_mounts()
    for given, mount, index in ((cgroup_v2, mounts.v2, 0), (freezer, mounts.freezer, 1)):
        if not given or mount is None:
            continue
        rel = os.path.relpath(given, os.path.realpath(mount))  # given: resolved already
        if rel == ".." or rel.startswith("../"):
            continue  # not a cgroup of that mount: Cgroup.attach_existing says so
        rel = "/" if rel == "." else "/" + rel
        for pid, who in ours:
            try:
                held = cgroup_paths(pid)[index]
            except (OSError, NoCgroup):
                continue
            if held is not None and under(held, (rel,)):
                raise SandboxError(f"cgroup {given} holds {who} (pid {pid}): attach to a "
                                   "sandbox's own cgroup")  # fmt: skip


def _cgroup(pinned: str, netns_ref: str, cgroup_v2: str | None, freezer: str | None) -> Cgroup:
    if cgroup_v2 is None and freezer is not None:
        raise SandboxError("a freezer cgroup needs the cgroup v2 directory it mirrors")
    return Cgroup.attached(pinned, cgroup_v2, freezer, label=netns_ref)


def _ifreq(pinned: str, netns_ref: str, request: int, flags: int = 0) -> int:
    with netns.in_netns(pinned):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        raw = fcntl.ioctl(sock.fileno(), request, struct.pack("16sH14x", b"lo", flags))
    except OSError as exc:
        raise SandboxError(f"lo of netns {netns_ref}: {exc.strerror}") from None
    finally:
        sock.close()
    return int(struct.unpack_from("16sH", raw)[1])


def _lo_is_up(pinned: str, netns_ref: str) -> bool:
    return bool(_ifreq(pinned, netns_ref, _SIOCGIFFLAGS) & _IFF_UP)


def _lo_down(pinned: str, netns_ref: str) -> None:
    flags = _ifreq(pinned, netns_ref, _SIOCGIFFLAGS)
    _ifreq(pinned, netns_ref, _SIOCSIFFLAGS, flags & ~_IFF_UP)
