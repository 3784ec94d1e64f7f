"""Network namespaces and their links, in-process.

Every sandbox lives in a named netns (bind-mounted at /run/netns/NAME exactly like
``ip netns add``, so ``ip netns exec`` works on it) wired to an uplink by a veth pair.
Creating one must stay well under 100 ms, so nothing here forks: namespaces are made
with unshare+bind-mount on the calling thread, and links are looked up, changed and
deleted over rtnetlink (pyroute2) from a socket opened while the thread is switched into
the target netns. A sandbox's own veth, addresses and routes go as batches (rtnl.py).

Namespace switches apply to the calling thread only (setns(2) semantics), so these
helpers are safe to call from any thread, but a thread must not run unrelated network
code while it sits inside ``in_netns``; in asyncio code never ``await`` inside it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, NoReturn

from egress.datapath import constants as c
from egress.errors import SandboxError

NETNS_RUN_DIR = c.NETNS_DIR
CLONE_NEWNET = 0x40000000
_MS_BIND = 4096
_MS_REC = 16384
_MS_SHARED = 1 << 20
_MNT_DETACH = 2
# /proc/self/ns/net names the thread-group leader's netns; after setns in another
# thread only thread-self tells the truth.
_SELF_NS = "/proc/thread-self/ns/net"

# A new netns copies part of its sysctls from the host's (which part, the kernel's
# net.core.devconf_inherit_init_net decides): once anything turns the host's forwarding on,
# every new netns would forward too. Each netns made here starts from these instead: no
# forwarding (an uplink forwards on egress's interfaces only, see egress.sandbox.uplink)
# and IPv6 enabled, which every sandbox's addresses and rules assume.
NEW_NETNS_SYSCTLS = (
    ("net/ipv4/conf/all/forwarding", "0"),  # also net.ipv4.ip_forward: the same knob
    ("net/ipv4/conf/default/forwarding", "0"),
    ("net/ipv6/conf/all/forwarding", "0"),
    ("net/ipv6/conf/default/forwarding", "0"),
    ("net/ipv6/conf/all/disable_ipv6", "0"),
    ("net/ipv6/conf/default/disable_ipv6", "0"),
)
# The same, for knobs only some kernels have: written where they exist. force_forwarding
# (Linux 6.17+) forwards IPv6 arriving on one interface whatever the global setting says;
# a new interface copies it from default, which a netns may copy from the host's.
NEW_NETNS_SYSCTLS_IF_PRESENT = (
    ("net/ipv6/conf/all/force_forwarding", "0"),
    ("net/ipv6/conf/default/force_forwarding", "0"),
)

FATAL_EXIT = 1  # a thread stuck in another netns (_restore): egress's errors' status

_libc = ctypes.CDLL(None, use_errno=True)
_run_dir_ready = False


def _os_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def netns_path(name_or_path: str) -> str:
    """The file that pins a netns: /run/netns/NAME for a name, else the path itself."""
    if "/" in name_or_path:
        return name_or_path
    if name_or_path in ("", ".", ".."):
        raise SandboxError(f"invalid netns name {name_or_path!r}")
    return os.path.join(NETNS_RUN_DIR, name_or_path)


def netns_exists(name: str) -> bool:
    return os.path.exists(netns_path(name))


def fd_path(fd: int) -> str:
    """A path to the netns this process holds open as ``fd``, for whatever takes a path
    (``in_netns``, another process of ours it is handed to): it names that netns, not
    whatever a name or /proc/PID path names by now, for as long as ``fd`` is open."""
    return f"/proc/{os.getpid()}/fd/{fd}"


def netns_id(name_or_path: str) -> tuple[int, int] | None:
    """Which netns the name or path pins now (its nsfs device and inode), None if none:
    a path like /proc/PID/ns/net can come to pin another one when the PID is reused."""
    try:
        st = os.stat(netns_path(name_or_path))
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        raise _os_error("setns")


@contextmanager
def in_netns(name_or_path: str | None) -> Iterator[None]:
    """Run the body with the current thread in that netns (None: stay where we are).

    Sockets and handles opened inside keep acting on that netns after the block ends.
    A thread that cannot come back ends the process (``_restore``).
    """
    if name_or_path is None:
        yield
        return
    try:
        target = os.open(netns_path(name_or_path), os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise SandboxError(f"netns {name_or_path}: {exc.strerror}") from exc
    saved = os.open(_SELF_NS, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            _setns(target)
        except OSError as exc:
            raise SandboxError(f"cannot enter netns {name_or_path}: {exc}") from exc
        try:
            yield
        finally:
            _restore(saved)
    finally:
        os.close(target)
        os.close(saved)


def _restore(saved_fd: int) -> None:
    """Back to the netns ``saved_fd`` pins, or end the process.

    A thread left in another netns goes on without a sign of it: every socket, link and
    ruleset it makes afterwards lands there (one sandbox's rules loaded into another's
    netns, an upstream socket opened inside a sandbox). An exception would not help: a
    pool thread outlives the call that failed, and its caller may catch the error (a
    /metrics read skips a sandbox it cannot read) while the thread takes the next job. So
    the process ends here. The kernel keeps enforcing every sandbox meanwhile: egressd's
    successor adopts the ones it served, an observer shard or nft worker is started again
    by its parent, and `egressctl run`'s observer sees its inline layer gone. A sandbox
    being made at that moment is left half-made, for `egressctl gc` to remove.

    A signal handler's exception (egressctl run's Stopped) can land before the setns ran:
    it is made once more (harmless if it had), and then the exception goes on.
    """
    try:
        _return_to(saved_fd)
    except BaseException:
        _return_to(saved_fd)
        raise


def _return_to(saved_fd: int) -> None:
    try:
        _setns(saved_fd)
    except OSError as exc:
        _fatal(f"a thread cannot return to its network namespace ({exc.strerror or exc})")


def _fatal(why: str) -> NoReturn:
    who = f"{os.path.basename(sys.argv[0]) or 'python'} (pid {os.getpid()})"
    line = f"egress: fatal: {who}: {why}; it exits, so that nothing runs in the wrong one; "
    line += "`egressctl gc` removes a sandbox it left half-made\n"
    with suppress(OSError):  # stderr closed: the exit status still says it
        os.write(2, line.encode())
    os._exit(FATAL_EXIT)


def _prepare_run_dir() -> None:
    """Make /run/netns a shared mount point, as iproute2 does, so the bind mounts of
    namespaces propagate into other mount namespaces (containers, ip netns exec)."""
    global _run_dir_ready
    if _run_dir_ready:
        return
    os.makedirs(NETNS_RUN_DIR, mode=0o755, exist_ok=True)
    d = NETNS_RUN_DIR.encode()
    if _libc.mount(b"", d, b"none", _MS_SHARED | _MS_REC, None) != 0:
        # EINVAL: not a mount point yet. Bind it onto itself, then share it.
        if _libc.mount(d, d, b"none", _MS_BIND | _MS_REC, None) != 0:
            raise _os_error(f"bind mount {NETNS_RUN_DIR}")
        if _libc.mount(b"", d, b"none", _MS_SHARED | _MS_REC, None) != 0:
            raise _os_error(f"share {NETNS_RUN_DIR}")
    _run_dir_ready = True


def create_netns(name: str, extra: tuple[tuple[str, str], ...] = ()) -> None:
    """Create a new, empty netns pinned at /run/netns/NAME; SandboxError if it exists.
    ``extra`` sysctls (key, value) are written in it with NEW_NETNS_SYSCTLS, before
    it is pinned."""
    path = netns_path(name)
    if "/" in name:
        raise SandboxError(f"netns name must not contain '/': {name!r}")
    try:
        _prepare_run_dir()
        os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0))
    except FileExistsError as exc:
        raise SandboxError(f"netns {name} already exists") from exc
    except OSError as exc:
        raise SandboxError(f"cannot create netns {name}: {exc}") from exc
    try:
        _unshare_and_pin(path, extra)
    except OSError as exc:
        _unlink_quietly(path)
        raise SandboxError(f"cannot create netns {name}: {exc}") from exc


def _unshare_and_pin(path: str, extra: tuple[tuple[str, str], ...]) -> None:
    """unshare(CLONE_NEWNET) on this thread, set its sysctls, bind the new netns to path,
    switch back (or end the process: ``_restore``)."""
    saved = os.open(_SELF_NS, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.unshare(CLONE_NEWNET) != 0:
            raise _os_error("unshare(CLONE_NEWNET)")
        try:
            found = Sysctls(None)
            try:
                _write_sysctls(found, NEW_NETNS_SYSCTLS + extra)
                _write_sysctls(found, NEW_NETNS_SYSCTLS_IF_PRESENT, if_present=True)
            finally:
                found.close()
            if _libc.mount(_SELF_NS.encode(), path.encode(), b"none", _MS_BIND, None) != 0:
                raise _os_error(f"bind mount {path}")
        finally:
            _restore(saved)
    finally:
        os.close(saved)


def _write_sysctls(
    found: Sysctls, settings: tuple[tuple[str, str], ...], if_present: bool = False
) -> None:
    """Write KEY = VALUE in the netns this thread is in (see Sysctls); with
    ``if_present``, a key this kernel lacks is skipped."""
    for key, value in settings:
        try:
            found.write(key, value)
        except FileNotFoundError:
            if not if_present:
                raise
        except OSError as exc:
            raise OSError(exc.errno, f"sysctl {key}={value}: {exc.strerror}") from exc


def _unlink_quietly(path: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


def remove_netns(name: str) -> None:
    """Unpin a netns (idempotent). The kernel frees it once no process or socket uses it."""
    path = netns_path(name)
    # EINVAL (not mounted) and ENOENT (gone) are both "already removed".
    if _libc.umount2(path.encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):
            raise SandboxError(f"cannot unmount {path}: {os.strerror(err)}")
    try:
        _unlink_quietly(path)
    except OSError as exc:
        raise SandboxError(f"cannot remove {path}: {exc.strerror}") from exc


# ---- links (rtnetlink through pyroute2) -------------------------------------------


def _open_rtnl(netns: str | None, what: str) -> Any:
    # Imported here: pyroute2 is 20 MB of a process, and egressd's worker processes
    # (nft_worker.py, figures_worker.py) need this module's setns, not its links.
    from pyroute2 import IPRoute

    try:
        with in_netns(netns):
            return IPRoute(groups=0)
    except OSError as exc:
        raise SandboxError(f"{what}: cannot open rtnetlink: {exc}") from exc


@contextmanager
def _rtnl(netns: str | None, what: str) -> Iterator[Any]:
    """An IPRoute bound to netns; netlink errors become SandboxError naming the step.
    (A sandbox's own wiring goes through egress.kernel.rtnl's batches instead.)"""
    from pyroute2.netlink.exceptions import NetlinkError  # see _open_rtnl

    ipr = _open_rtnl(netns, what)
    try:
        yield ipr
    except NetlinkError as exc:
        where = netns or "host netns"
        raise SandboxError(f"{what} in {where}: {exc.args[-1]} (errno {exc.code})") from exc
    finally:
        ipr.close()


def _index(ipr: Any, ifname: str, netns: str | None) -> int:
    found = ipr.link_lookup(ifname=ifname)
    if not found:
        raise SandboxError(f"no link {ifname} in {netns or 'host netns'}")
    return int(found[0])


def create_veth_pair(
    host_if: str, peer_if: str, peer_netns: str, host_netns: str | None = None
) -> None:
    """A veth pair with host_if in host_netns (None: current) and peer_if in peer_netns."""
    fd = os.open(netns_path(peer_netns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        with _rtnl(host_netns, f"create veth {host_if}/{peer_if}") as ipr:
            ipr.link("add", ifname=host_if, kind="veth", peer={"ifname": peer_if, "net_ns_fd": fd})
    finally:
        os.close(fd)


def set_up(ifname: str, netns: str | None) -> None:
    with _rtnl(netns, f"set {ifname} up") as ipr:
        ipr.link("set", index=_index(ipr, ifname, netns), state="up")


def loopback_up(netns: str | None) -> None:
    set_up("lo", netns)


def add_address(ifname: str, addr_with_prefix: str, netns: str | None, nodad: bool = True) -> None:
    """Add an address like 10.0.0.1/30 or fd00::1/64; v6 skips DAD so it is usable at once."""
    addr, _, prefix = addr_with_prefix.partition("/")
    v6 = ":" in addr
    if not prefix:
        prefix = "128" if v6 else "32"
    extra: dict[str, Any] = {}
    if v6 and nodad:
        extra["flags"] = 0x02  # IFA_F_NODAD
    with _rtnl(netns, f"add address {addr_with_prefix} to {ifname}") as ipr:
        idx = _index(ipr, ifname, netns)
        ipr.addr("add", index=idx, address=addr, prefixlen=int(prefix), **extra)


def add_default_route(gateway: str, netns: str | None, ifname: str | None = None) -> None:
    """Default route via gateway (family from the address); ifname pins the device."""
    v6 = ":" in gateway
    spec: dict[str, Any] = {"dst": "::/0" if v6 else "0.0.0.0/0", "gateway": gateway}
    with _rtnl(netns, f"add default route via {gateway}") as ipr:
        if ifname is not None:
            spec["oif"] = _index(ipr, ifname, netns)
        ipr.route("add", **spec)


def delete_link(ifname: str, netns: str | None) -> None:
    """Delete a link (and a veth's peer with it); nothing to do if it is gone."""
    if netns is not None and not netns_exists(netns):
        return
    from pyroute2.netlink.exceptions import NetlinkError  # see _open_rtnl

    with _rtnl(netns, f"delete link {ifname}") as ipr:
        found = ipr.link_lookup(ifname=ifname)
        if found:
            try:
                ipr.link("del", index=found[0])
            except NetlinkError as exc:
                if exc.code != errno.ENODEV:  # lost a race with another deleter
                    raise


def link_exists(ifname: str, netns: str | None) -> bool:
    with _rtnl(netns, f"look up {ifname}") as ipr:
        return bool(ipr.link_lookup(ifname=ifname))


def default_route_ifname(netns: str | None) -> str | None:
    """The device of the default route (IPv4 first, then IPv6), or None if there is none.

    Read from /proc/thread-self/net/{route,ipv6_route}: an uplink holding a route per
    sandbox makes a netlink dump (and pyroute2's parse of it) cost ~0.4 ms per sandbox,
    which made every new sandbox slower than the last. Multipath defaults fall back to
    the netlink dump, which knows their next hops.
    """
    found = _default_route_from_proc(netns)
    if found is not None:
        return found
    with _rtnl(netns, "read default route") as ipr:
        for family in (2, 10):  # AF_INET, AF_INET6
            for route in ipr.route("dump", family=family, table=254):
                oif = _oif(route) if route["dst_len"] == 0 else None
                if oif is not None:
                    return _ifname(ipr, oif)
    return None


def _default_route_from_proc(netns: str | None) -> str | None:
    # Read line by line and stop at the first default route: the kernel writes these
    # files a page at a time as they are read, and lists the default route first, so an
    # uplink's route per sandbox is neither written nor split (it was, for every create).
    try:
        with in_netns(netns):
            with open("/proc/thread-self/net/route") as f:
                next(f, None)  # the header
                for line in f:  # Iface Destination Gateway Flags RefCnt Use Metric Mask ..
                    fields = line.split()
                    if len(fields) > 7 and fields[1] == "00000000" and fields[7] == "00000000":
                        return fields[0]
            with open("/proc/thread-self/net/ipv6_route") as f:
                for line in f:  # dest dest_len src src_len next_hop metric refcnt use flags if
                    fields = line.split()
                    # The kernel's own unreachable default route sits on lo: not a way out.
                    if (
                        len(fields) == 10
                        and fields[0] == "0" * 32
                        and fields[1] == "00"
                        and fields[9] != "lo"
                    ):
                        return fields[9]
    except OSError:
        return None
    return None


def _oif(route: Any) -> int | None:
    """The output device of a route; for a multipath route, its first next hop's."""
    oif = route.get_attr("RTA_OIF")
    if oif is None:
        hops = route.get_attr("RTA_MULTIPATH") or []
        oif = hops[0]["oif"] if hops else None
    return None if oif is None else int(oif)


def _ifname(ipr: Any, index: int) -> str | None:
    links = ipr.link("get", index=index)
    return str(links[0].get_attr("IFLA_IFNAME")) if links else None


class Sysctls:
    """Sysctls of the netns the calling thread is in, read and written through the
    directories /proc/sys/net/ipv4 and /proc/sys/net/ipv6, each opened once.

    The kernel keeps one dentry of ``ipv4`` (and of ``ipv6``) per netns, all in the
    hash chain of the one ``net`` directory, and a path walked through it compares them
    one by one: opening any /proc/sys/net/ipv4/... cost 13 µs with 10 namespaces and
    158 µs with 1,000, and a create opened about 15. A path opened relative to the
    directory costs 5 µs at any count. Opened files, and the directories, resolve
    against the netns of the thread that opens them (verified in
    tests/privileged/test_netns.py), so use one only while the thread is in that netns.
    """

    def __init__(self, where: str | None) -> None:
        self._where = where or "host netns"  # for messages
        self._dirs: dict[str, int] = {}

    def find(self, key: str) -> str | None:
        """A sysctl's value, or None if there is no such key (an older kernel, a link
        gone)."""
        try:
            fd = self._open(key, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SandboxError(f"sysctl {key} in {self._where}: {exc}") from exc
        try:
            return os.read(fd, 4096).decode().strip()
        except OSError as exc:
            raise SandboxError(f"sysctl {key} in {self._where}: {exc}") from exc
        finally:
            os.close(fd)

    def get(self, key: str) -> str:
        value = self.find(key)
        if value is None:
            raise SandboxError(f"sysctl {key} in {self._where}: no such key")
        return value

    def set(self, key: str, value: str | int) -> None:
        """Write a sysctl such as net.ipv4.ip_forward (OSError: see ``write``)."""
        try:
            self.write(key, value)
        except OSError as exc:
            raise SandboxError(f"sysctl {key}={value} in {self._where}: {exc}") from exc

    def write(self, key: str, value: str | int) -> None:
        fd = self._open(key, os.O_WRONLY)
        try:
            os.write(fd, f"{value}\n".encode())
        finally:
            os.close(fd)

    def _open(self, key: str, flags: int) -> int:
        rel = _sysctl_path(key).removeprefix("/proc/sys/")
        top, _, rest = rel.partition("/")
        family, _, leaf = rest.partition("/")
        if top != "net" or family not in ("ipv4", "ipv6") or not leaf:
            return os.open("/proc/sys/" + rel, flags | os.O_CLOEXEC)
        try:
            parent = self._dirs.get(family)
            if parent is None:
                parent = os.open(
                    f"/proc/sys/net/{family}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
                )
                self._dirs[family] = parent
            return os.open(leaf, flags | os.O_CLOEXEC, dir_fd=parent)
        except OSError as exc:
            exc.filename = "/proc/sys/" + rel  # the whole path, not the part under the fd
            raise

    def close(self) -> None:
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()


@contextmanager
def sysctls(netns: str | None) -> Iterator[Sysctls]:
    """The sysctls of ``netns`` (None: this thread's), with the thread in it meanwhile:
    in the body, do nothing else that depends on the thread's netns (see in_netns)."""
    with in_netns(netns):
        found = Sysctls(netns)
        try:
            yield found
        finally:
            found.close()


def set_sysctl(netns: str | None, key: str, value: str | int) -> None:
    """Write one sysctl such as net.ipv4.ip_forward inside netns (several: ``sysctls``)."""
    with sysctls(netns) as found:
        found.set(key, value)


def get_sysctl(netns: str | None, key: str) -> str:
    with sysctls(netns) as found:
        return found.get(key)


def find_sysctl(netns: str | None, key: str) -> str | None:
    """A sysctl's value, or None if there is no such key (an older kernel, a link gone)."""
    with sysctls(netns) as found:
        return found.find(key)


def netns_inode(netns: str | None) -> int:
    """The inode of a netns (None: the calling thread's): tells a netns from a later one
    pinned under the same name."""
    path = _SELF_NS if netns is None else netns_path(netns)
    try:
        return os.stat(path).st_ino
    except OSError as exc:
        raise SandboxError(f"netns {netns or 'of this thread'}: {exc.strerror}") from exc


def _sysctl_path(key: str) -> str:
    """net.ipv4.ip_forward -> /proc/sys/net/ipv4/ip_forward. A key written with slashes
    (net/ipv4/conf/eth0.100/forwarding) is taken as a path, for names that contain dots."""
    rel = key if "/" in key else key.replace(".", "/")
    if not rel or ".." in rel.split("/") or rel.startswith("/"):
        raise SandboxError(f"invalid sysctl key {key!r}")
    return "/proc/sys/" + rel
