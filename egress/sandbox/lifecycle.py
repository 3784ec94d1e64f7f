"""Create and destroy one sandbox: netns, veth, addresses, routes, nft rulesets, cgroup.

Creation records an undo step for everything it makes, so a failure half-way removes
exactly what was made; ``destroy`` runs the same steps for a finished sandbox. The host end
of the veth lives in the uplink namespace (the host, or ``--uplink-netns``), where the
sandbox's own nft table forwards and masquerades its traffic out of the default route.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path

from egress.datapath import constants as c
from egress.datapath.addressing import Pools, SandboxNet
from egress.datapath.render import NEWEST_CHAIN, reload_rules, render_sandbox
from egress.datapath.render import queue_rules as render_queue_rules
from egress.errors import EgressError, SandboxError
from egress.kernel import conntrack, netns, rtnl
from egress.kernel import queue_rule as queue_rules
from egress.kernel.cgroup import Cgroup
from egress.kernel.nft import NftHandle
from egress.model import Policy
from egress.sandbox import uplink as uplink_mod
from egress.sandbox import view
from egress.store import claims, uids
from egress.store.paths import read_template, workloads_dir

ETC_NETNS = Path("/etc/netns")
# Written as the sandbox's netns is made. Let unprivileged ICMP echo sockets exist, so a
# ping is sent, blocked and reported rather than failing before it reaches the rules.
SANDBOX_SYSCTLS = (("net/ipv4/ping_group_range", "0 2147483647"),)


def new_id() -> str:
    return secrets.token_hex(3)


@dataclass
class Sandbox:
    id: str
    policy: Policy
    net: SandboxNet
    netns: str
    host_if: str
    uplink_netns: str | None
    cgroup: Cgroup
    nft: NftHandle
    created_s: float = 0.0  # create-to-ready time
    uid: int | None = None  # the workload's own uid (and gid), when egress allocated one
    _undo: list[tuple[str, Callable[[], None]]] = field(default_factory=list, repr=False)
    # What this process holds for the sandbox beyond its nft handle (an attached netns's
    # descriptor): closed by release, and by destroy after the undo steps.
    _held: list[Callable[[], None]] = field(default_factory=list, repr=False)
    netns_id: tuple[int, int] | None = None  # an attached netns's (device, inode), pinned
    pinned: str | None = None  # and the path to its descriptor, while this process holds it
    # Where the create's time went, ms by step in order (claim, netns, ...): egressd's
    # sandbox JSON and `egressctl run --report` show it.
    create_steps_ms: dict[str, float] = field(default_factory=dict)

    def add_undo(self, what: str, step: Callable[[], None]) -> None:
        """Something made for this sandbox after creation, removed with it."""
        self._undo.append((what, step))

    @property
    def reach(self) -> str:
        """The path this process enters the netns by: an attached one's descriptor (the
        path it was given may name another netns by now), else its name."""
        return self.pinned or self.netns

    @property
    def resolv_conf(self) -> Path:
        return ETC_NETNS / self.netns / "resolv.conf"

    def hold(self, close: Callable[[], None]) -> None:
        """Something this process keeps open for the sandbox while it serves it."""
        self._held.append(close)

    def release(self) -> None:
        """Let go of what this process holds for the sandbox (its nft handle, ``hold``s)
        and undo nothing in the kernel: it stays for another process to adopt."""
        self.nft.close()
        self._let_go()

    def _let_go(self) -> list[str]:
        """Close what ``hold`` was given; what resisted. The pinned path goes with it:
        its number is free now, and ``reach`` goes by the name again."""
        failures = _unwind([("held", close) for close in self._held])
        self._held.clear()
        self.pinned = None
        return failures

    def destroy(self) -> None:
        """Remove everything this sandbox made, newest first; report what resisted."""
        failures = _unwind(self._undo) + self._let_go()
        if failures:
            raise SandboxError(f"sandbox {self.id}: teardown left: " + "; ".join(failures))


def _unwind(undo: list[tuple[str, Callable[[], None]]]) -> list[str]:
    failures = []
    while undo:
        what, step = undo.pop()
        try:
            step()
        except Exception as exc:
            failures.append(f"{what}: {exc}")
    return failures


ID_DRAWS = 8  # a taken id means another draw; 8 taken in a row is a full id space


def draw_id(taken: Callable[[str], bool] | None = None) -> str:
    """A new sandbox id that ``taken`` does not refuse (ids are random: another draw)."""
    for _ in range(ID_DRAWS):
        drawn = new_id()
        if taken is None or not taken(drawn):
            return drawn
    raise SandboxError(f"{ID_DRAWS} sandbox ids drawn were all taken")


def create(
    policy: Policy,
    pools: Pools,
    uplink_netns: str | None,
    uid_range: range | None = None,
    id_taken: Callable[[str], bool] | None = None,
) -> Sandbox:
    """Make a ready sandbox for ``policy``; on any failure nothing is left behind.

    With ``uid_range``, the sandbox gets a workload uid of its own from that range.
    ``id_taken`` says whether an id was used before (the journal keeps every id it
    recorded, ended sandboxes' too); a live claim's id is refused by the claim itself."""
    if uplink_netns is not None and not netns.netns_exists(uplink_netns):
        raise SandboxError(
            f"uplink netns {uplink_netns!r} does not exist (see `ip netns list`; "
            "`egressctl lab up` makes one for testing)"
        )
    start = time.monotonic()
    undo: list[tuple[str, Callable[[], None]]] = []
    try:
        for attempt in range(ID_DRAWS):  # an id a claim refuses means another draw too
            sandbox_id = draw_id(id_taken)
            try:
                claim = claims.claim(sandbox_id, pools, uplink_netns, uid_range)
                break
            except claims.IdTaken:
                if attempt == ID_DRAWS - 1:
                    raise
        # Last out: the claim goes with the uplink table check, under one lock, so of
        # sandboxes ending together exactly the last one removes the shared table.
        undo.append(("address claim", lambda: uplink_mod.detach(uplink_netns, sandbox_id)))
        # Undone after everything but the claim: the cgroup's processes are dead by then,
        # so the mounts of their view, their $HOME and the uid's ledger entry can go.
        undo.append((f"workload files of {sandbox_id}", lambda: view.remove(sandbox_id)))
        steps = _Steps(start)
        steps.done("claim")
        sb = _build(policy, pools.network(claim.index), claim, undo, steps)
    except BaseException:
        _unwind(undo)
        raise
    sb.created_s = time.monotonic() - start
    sb.create_steps_ms = steps.ms
    claim.cgroup = sb.cgroup.v2_path or ""
    claims.save(claim)
    return sb


class _Steps:
    """Milliseconds each step of a create took, in order."""

    def __init__(self, start: float) -> None:
        self.ms: dict[str, float] = {}
        self._last = start

    def done(self, step: str) -> None:
        now = time.monotonic()
        self.ms[step] = round((now - self._last) * 1000, 2)
        self._last = now


def _build(
    policy: Policy,
    net: SandboxNet,
    claim: claims.Claim,
    undo: list[tuple[str, Callable[[], None]]],
    steps: _Steps,
) -> Sandbox:
    name, host_if, uplink = claim.netns, claim.host_if, claim.uplink_netns
    netns.create_netns(name, SANDBOX_SYSCTLS)
    undo.append((f"netns {name}", lambda: netns.remove_netns(name)))
    steps.done("netns")
    with rtnl.opened(uplink) as outside, rtnl.opened(name) as inside:
        veth = rtnl.Batch()
        fd = os.open(netns.netns_path(name), os.O_RDONLY | os.O_CLOEXEC)
        try:
            # Set, not left to the kernel: each end's neighbour entries name the other's,
            # and udev would replace a random one in the host netns after we read it.
            veth.veth(host_if, c.SANDBOX_IF, fd, (_local_mac(), _local_mac()))
            outside.run(veth)
        finally:
            os.close(fd)
        undo.append((f"veth {host_if}", lambda: netns.delete_link(host_if, uplink)))
        steps.done("veth")
        _addresses(net, name, host_if, outside, inside)
    steps.done("addresses")
    nft = NftHandle.open(name)
    undo.append(("nft handle", nft.close))
    if policy.connect.check_names:  # before the ruleset: a flow it holds is then queued
        queue_rules.install(name, render_queue_rules())
        steps.done("queue")
    nft.load(render_sandbox(read_template("sandbox.nft"), policy))
    steps.done("rules")
    uplink_mod.attach(uplink, host_if)
    steps.done("uplink")
    cgroup = Cgroup.create(claim.id, limits=policy.limits)
    for note in cgroup.notes:
        print(f"egress: sandbox {claim.id}: {note}", file=sys.stderr)
    undo.append((f"cgroup {claim.id}", lambda: _remove_cgroup(cgroup)))
    _write_resolv_conf(name, undo)
    steps.done("cgroup")
    return Sandbox(claim.id, policy, net, name, host_if, uplink, cgroup, nft, 0.0, claim.uid, undo)


def _addresses(
    net: SandboxNet, name: str, host_if: str, outside: rtnl.Rtnl, inside: rtnl.Rtnl
) -> None:
    host_link = outside.link(host_if)
    link = inside.link(c.SANDBOX_IF)
    host_index, index = host_link[0], link[0]
    host, sandbox = rtnl.Batch(), rtnl.Batch()
    host.address(host_index, host_if, f"{net.gateway4}/{net.net4.prefixlen}")
    host.address(host_index, host_if, f"{net.gateway6}/{net.net6.prefixlen}")
    host.up(host_index, host_if)
    sandbox.up(rtnl.LOOPBACK_INDEX, "lo")
    sandbox.address(index, c.SANDBOX_IF, f"{net.address4}/{net.net4.prefixlen}")
    sandbox.address(index, c.SANDBOX_IF, f"{net.address6}/{net.net6.prefixlen}")
    sandbox.up(index, c.SANDBOX_IF)
    sandbox.default_route(str(net.gateway4), index)
    sandbox.default_route(str(net.gateway6), index)
    _pin(net, host_if, host, host_link, sandbox, link)
    outside.run(host)
    inside.run(sandbox)


def pin_neighbours(net: SandboxNet, name: str, host_if: str, uplink: str | None) -> None:
    """What ``create`` pins (``_pin``), for a sandbox an egress before it made: each end
    of its veth knows the other's addresses without asking."""
    with rtnl.opened(uplink) as outside, rtnl.opened(name) as inside:
        host, sandbox = rtnl.Batch(), rtnl.Batch()
        _pin(net, host_if, host, outside.link(host_if), sandbox, inside.link(c.SANDBOX_IF))
        outside.run(host)
        inside.run(sandbox)


def renew_rules(nft: NftHandle, policy: Policy, netns: str | None) -> bool:
    """A table an older egress loaded gets this template's rules, in one transaction that
    keeps its learned elements, and the NFQUEUE rules it lacks; True if it did. Older:
    before the source check (it has no ``spoofed_source`` chain), or before plain-HTTP
    flows were read request by request (no ``read_on``). An adopter calls it: a sandbox
    outlives the egressd that made it, and its workload could otherwise still send from
    any IPv6 address, or any request after a connection's first."""
    if nft.chain_exists("inet", c.TABLE, "spoofed_source") and nft.chain_exists(
        "inet", c.TABLE, NEWEST_CHAIN
    ):
        return False
    if policy.connect.check_names:  # the queue's rules first: until they are, fail closed
        queue_rules.install(netns, render_queue_rules(), check=True)
    nft.load(reload_rules(read_template("sandbox.nft"), policy))
    return True


def forget_spoofed_flows(name: str) -> str:
    """After ``renew_rules``, for a sandbox egress made: the conntrack entries of flows
    that began from an address not its own go (their replies would still pass as
    established). Nothing can open a flow into such a sandbox (the uplink forwards it
    only replies), so every such entry is one its workload spoofed. What to say."""
    try:
        gone = conntrack.forget_foreign(name)
    except EgressError as exc:
        return f"flows from other sources than its own may go on until they end: {exc}"
    return f"{len(gone)} flows from other sources than its own forgotten" if gone else ""


def _local_mac() -> bytes:
    """A random unicast, locally administered MAC address."""
    mac = bytearray(secrets.token_bytes(6))
    mac[0] = mac[0] & 0xFC | 0x02
    return bytes(mac)


def _pin(
    net: SandboxNet,
    host_if: str,
    host: rtnl.Batch,
    host_link: tuple[int, bytes],
    sandbox: rtnl.Batch,
    link: tuple[int, bytes],
) -> None:
    """Each end of the veth (its ifindex and MAC) holds the other end's addresses as
    permanent neighbour entries. Learned by ARP and neighbour discovery instead, they
    took two entries a sandbox in the kernel's one table for every netns, whose default
    bound (gc_thresh3) is 1,024: past ~500 sandboxes it learned no more, and the rest
    could send nothing past their veth (tests/privileged/test_daemon_scale.py, 1,000
    sandboxes). A permanent entry is not counted against it (Linux 5.0 and later), needs
    no host sysctl raised, and goes with the veth."""
    for address in (net.address4, net.address6):
        host.neighbour(host_link[0], host_if, str(address), link[1])
    for address in (net.gateway4, net.gateway6):
        sandbox.neighbour(link[0], c.SANDBOX_IF, str(address), host_link[1])


def _remove_cgroup(cgroup: Cgroup) -> None:
    # remove()'s own test, not the procs list: a task another teardown killed has left
    # cgroup.procs but keeps the cgroup populated until it is reaped. kill() waits for that.
    if os.path.isdir(cgroup.v2_path) and not cgroup.empty():
        cgroup.kill()
    cgroup.remove()


def _write_resolv_conf(name: str, undo: list[tuple[str, Callable[[], None]]]) -> None:
    # `ip netns exec` bind-mounts /etc/netns/NAME/* over /etc/* in the workload's private
    # mount namespace: that is how the workload finds its resolver.
    directory = ETC_NETNS / name
    directory.mkdir(parents=True, exist_ok=True)
    undo.append((f"{directory}", lambda: shutil.rmtree(directory, ignore_errors=True)))
    (directory / "resolv.conf").write_text(f"nameserver {c.RESOLVER4}\noptions edns0\n")
    # Names are looked up in /etc/hosts and DNS only: no nsswitch module that asks a
    # host service (resolve, mdns, nis) behind the resolver's back.
    (directory / "nsswitch.conf").write_text(nsswitch_for_sandbox())


def nsswitch_for_sandbox(host_file: str = "/etc/nsswitch.conf") -> str:
    """The host's nsswitch.conf with its ``hosts:`` line replaced by ``files dns``."""
    try:
        lines = Path(host_file).read_text().splitlines()
    except OSError:
        lines = ["passwd: files", "group: files", "shadow: files"]
    kept = [line for line in lines if not line.strip().startswith("hosts:")]
    return "\n".join([*kept, "hosts: files dns"]) + "\n"


def teardown_claim(claim: claims.Claim) -> list[str]:
    """Remove a sandbox known only by its claim (its egress process died, or --keep).

    The same steps as ``destroy``, each one tolerant of what is already gone; returns what
    could not be removed. Whoever removes a sandbox this way (`egressctl gc`, the observer
    of a dead `egressctl run`, egressd, a test) holds its claim file locked meanwhile: of
    two at once, the second finds the claim gone and has nothing left to do. The claim
    goes last and only if every other step worked, so what resisted can be retried.
    """
    held = _hold_claim(claim.id)
    if held is None:
        return []  # removed meanwhile, by whoever held it before us
    try:
        undo: list[tuple[str, Callable[[], None]]] = [
            (f"netns {claim.netns}", lambda: netns.remove_netns(claim.netns)),
            (
                f"veth {claim.host_if}",
                lambda: netns.delete_link(claim.host_if, claim.uplink_netns),
            ),
            # Undone after the cgroup (newest first): its processes are dead by then.
            (f"workload files of {claim.id}", lambda: view.remove(claim.id)),
            (f"cgroup {claim.id}", lambda: _remove_cgroup_by_name(claim.id)),
            (
                f"{ETC_NETNS / claim.netns}",
                lambda: shutil.rmtree(ETC_NETNS / claim.netns, ignore_errors=True),
            ),
        ]
        failures = _unwind(undo)
        if failures:
            return failures
        return _unwind([("address claim", lambda: uplink_mod.detach(claim.uplink_netns, claim.id))])
    finally:
        os.close(held)


def _hold_claim(sandbox_id: str) -> int | None:
    """The claim file, open and flocked; None if there is no claim (any more).

    A claim is released by unlinking its file, and rewritten by replacing it: a lock
    taken on a file no longer at the path is retried on the one there now, if any."""
    path = claims.sandboxes_dir() / f"{sandbox_id}.json"
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SandboxError(f"{path}: {exc.strerror}") from None
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            now = os.stat(path).st_ino
        except FileNotFoundError:
            now = None
        if now == os.fstat(fd).st_ino:
            return fd
        os.close(fd)
        if now is None:
            return None


def _remove_cgroup_by_name(name: str) -> None:
    try:
        cgroup = Cgroup.open(name)
    except SandboxError:
        return  # never made, or already gone
    _remove_cgroup(cgroup)


@dataclass(frozen=True)
class Orphan:
    """Workload files nothing else of their sandbox is left with (``uids.Entry.orphaned``:
    its run dir was removed, or a reboot emptied /run). Their uid stays held until they go."""

    entry: uids.Entry
    pids: list[int]  # processes of its uid still running: the files are kept while any do


def orphans(only: AbstractSet[str] = frozenset()) -> list[Orphan]:
    """The orphaned workload files (those of ``only``, if given), each with the processes
    of its uid that still run. To act on them, call under ``uids.locked()``: a create
    writes its ledger entry and its claim under it."""
    entries = uids.ledger()
    found = [e for e in entries if (not only or e.sandbox_id in only) and e.orphaned()]
    if not found:
        return []
    lo, hi = min(e.uid for e in found), max(e.uid for e in found)
    running = uids.live_processes(range(lo, hi + 1))
    return [Orphan(e, running.get(e.uid, [])) for e in found]


def remove_orphan(orphan: Orphan) -> str:
    """Remove its files (``view.remove``: never through a mount); what went wrong, or ""."""
    try:
        view.remove(orphan.entry.sandbox_id)
    except SandboxError as exc:
        if not os.path.lexists(workloads_dir() / orphan.entry.sandbox_id):
            return ""  # another gc removed them meanwhile
        return str(exc)
    return ""
