"""`egressd sidecar`: one sandbox's inline layer, running inside the sandbox's own netns.

A container beside the workload that shares its pod's netns, or ``nsenter --net=PATH
egressd sidecar``: the process never enters another netns. It serves the sandbox exactly as egressd
serves one (``wiring.make``: Session + TrackingResolver on 127.0.0.53), with the ruleset of
an attached sandbox (table inet egress) plus one block: with no uplink netns to ask from,
its upstream queries leave through the sandbox's own rules, so they carry SO_MARK
``c.SIDECAR_MARK`` and the rules accept marked packets of the sidecar's uid to its upstreams
and nothing else. Setting SO_MARK takes CAP_NET_ADMIN or CAP_NET_RAW; a workload with
either could also rewrite the rules or forge packets, so it has neither (invariant 6).

    lock (one sidecar per netns) ─▶ checks (cgroup, id, SO_MARK, 127.0.0.53:53 free) ─▶ lo up
    ─▶ rules: load, or replace in one transaction ─▶ journal ─▶ inline layer ─▶ "serving"
    SIGTERM ─▶ stop serving ─▶ rules stay (fail closed), or --remove-on-exit: table deleted

A restarted sidecar finds its table: it replaces the rules in one transaction (no moment
without them) and keeps the learned addresses only if the policy is the one they were
learned under. That policy is named in the table by a counter object ``sidecar_<digest>``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import hashlib
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from egress.collect import Collector
from egress.datapath import constants as c
from egress.datapath.render import Sidecar, reload_rules, render_sandbox
from egress.datapath.render import queue_rules as render_queue_rules
from egress.errors import DatapathError, EgressError, SandboxError, UpstreamError
from egress.inline import wiring
from egress.inline.upstream import parse_upstream, resolve_upstreams, set_mark
from egress.kernel import netns, oom
from egress.kernel import queue_rule as queue_rules
from egress.kernel.cgroup import Cgroup, find_mounts
from egress.kernel.netns_cgroup import NoCgroup, Peers
from egress.kernel.nft import NftHandle
from egress.kernel.sched import leave_realtime
from egress.model import Policy, SandboxState
from egress.policy import parse_policy
from egress.sandbox import lifecycle as sbx
from egress.sandbox.attach import NO_NET
from egress.store.journal import Journal
from egress.store.paths import read_template, state_dir

from .registry import _ID as SANDBOX_ID

NO_CGROUPFS = (
    "no cgroup2 filesystem is mounted in this mount namespace (`ip netns exec` mounts a "
    "fresh /sys without one): enter the netns with `nsenter --net=/run/netns/NAME` instead"
)
EPILOG = f"""\
examples:
  nsenter --net=/run/netns/agent1 egressd sidecar --policy policies/python-dev.yaml \\
      --cgroup /sys/fs/cgroup/unified/agent1 --id agent1
  egressd sidecar --policy /etc/egress/policy.yaml --cgroup /sys/fs/cgroup/agent \\
      --upstream 10.96.0.10 --remove-on-exit     # a container sharing the pod's netns
  egressd sidecar --policy /etc/egress/policy.yaml --upstream 10.96.0.10 --id agent \\
      --peers /run/egress-pod/peers              # a pod: the agent's cgroup found
                                                 # (containers/kubernetes/examples/sidecar)

Without --cgroup it finds the workload's cgroup when a violation needs it: the cgroup
every process in this netns runs in but PID 1 (a pod's pause process) and egress's own
(its own cgroup, and those its observer names in --peers DIR, `egressctl observe
--peers DIR`). That needs the pod's processes in sight (shareProcessNamespace) and the
host's cgroup namespace (a privileged container has it under containerd and CRI-O).

It runs in the sandbox's netns, beside the workload and NOT in its cgroup (it refuses to).
Enter the netns with `nsenter --net=PATH` (as a container runtime would), not with
`ip netns exec`: that mounts a fresh /sys, without the cgroup filesystems it freezes.
It answers DNS on {c.RESOLVER4} (UDP and TCP), puts allowed answers' addresses in the
netns's table inet {c.TABLE} before releasing them, and on a violation journals it, then
freezes --cgroup (and --freezer) until a person thaws or kills it with
`egressctl resume|kill [--state-dir DIR] ID` (the journal keeps the cgroup's paths).
Prints "egressd sidecar: serving ID ..." on stdout once it answers.

Its own upstream queries leave from this same netns, so they carry SO_MARK
{c.SIDECAR_MARK:#x}: the ruleset accepts marked packets of the sidecar's uid to the
upstreams' address and port, and nothing else. SO_MARK takes CAP_NET_ADMIN or
CAP_NET_RAW: run the workload with neither (the defaults of Docker and containerd include
NET_RAW: drop it), else, as the sidecar's uid, it could query the upstream directly.

start:    a table inet {c.TABLE} left by an earlier sidecar (a restart) has its rules
          replaced in one transaction, so enforcement never lapses; the addresses it
          learned stay if the policy is the same, and go if it changed. One sidecar per
          netns: it refuses to start beside another of the same state dir (a lock file
          there, named by the netns), or where something listens on {c.RESOLVER4}:53
          already (egressd serving it).
SIGTERM:  stop serving; the rules stay (fail closed: no DNS, no new flows but to the
          addresses already learned, until their TTL ends). --remove-on-exit deletes
          the table instead. lo stays up either way.
journal:  --state-dir, else $EGRESS_STATE_DIR, else /var/lib/egress. --id names the
          sandbox (default: random); a restart with the same --id and --cgroup continues
          its record. The observer layer is not in this process.
"""


@dataclass
class Config:
    policy: Policy
    policy_bytes: bytes
    upstreams: list[tuple[str, int]]
    cgroup: Cgroup
    state: Path
    review_hint: str
    remove_on_exit: bool
    peers: Peers | None = None  # without --cgroup: egress's own cgroups in the pod
    ready_file: Path | None = None  # exists while it serves (a pod's startupProbe)


def run(args: argparse.Namespace) -> int:
    """`egressd sidecar`: serve until SIGTERM/SIGINT; 0 then."""
    started = time.monotonic()
    if os.geteuid() != 0:
        raise SandboxError("egressd sidecar needs root (nft, NFLOG, SO_MARK and the cgroup)")
    leave_realtime("egressd sidecar")
    oom.shelter("egressd sidecar")
    cfg = _config(args)
    try:
        lock = _lock(cfg.state)
    except SandboxError:
        if cfg.peers is not None:
            cfg.peers.close()
        raise
    if cfg.ready_file is not None:
        with contextlib.suppress(FileNotFoundError):
            cfg.ready_file.unlink()  # an earlier run's: not ready until this one serves
    try:
        with Journal.open(cfg.state) as journal:
            sandbox_id, resumed = _sandbox_id(journal, args.id, cfg.cgroup)
            _check_mark()
            netns.loopback_up(None)  # already up in every runtime's netns; ours listens there
            _check_port()
            nft = NftHandle.open(None)
            try:
                how = _enforce(nft, cfg)
                sb = sbx.Sandbox(sandbox_id, cfg.policy, NO_NET, f"/proc/{os.getpid()}/ns/net",
                                 "", None, cfg.cgroup, nft)  # fmt: skip
                return asyncio.run(_serve(sb, cfg, journal, resumed, how, started))
            finally:
                nft.close()
                if cfg.peers is not None:
                    cfg.peers.close()
    finally:
        lock.close()


def _config(args: argparse.Namespace) -> Config:
    try:
        data = Path(args.policy).read_bytes()
    except OSError as exc:
        raise SandboxError(f"--policy {args.policy}: {exc.strerror}") from None
    policy, _ = parse_policy(data, args.policy)
    if args.upstream:
        upstreams = [parse_upstream(args.upstream)]
    else:
        upstreams = resolve_upstreams(policy.dns.upstreams)
    if not upstreams:
        raise UpstreamError("the policy names no upstream and --upstream was not given")
    if any(ip == c.RESOLVER4 and port == 53 for ip, port in upstreams):
        raise UpstreamError(f"upstream {c.RESOLVER4}:53 is the sidecar itself; name the real one")
    peers = None
    if args.cgroup is None:
        cgroup, peers = _found_cgroup(args)
    else:
        if args.peers is not None:
            raise SandboxError("--peers is for a sidecar without --cgroup (it finds the cgroup)")
        try:
            cgroup = Cgroup.attach_existing(args.cgroup, args.freezer)
        except SandboxError as exc:
            if find_mounts().v2 is None:
                raise SandboxError(f"{exc}: {NO_CGROUPFS}") from None
            raise
        _check_outside(cgroup)
    hint = f" --state-dir {args.state_dir}" if args.state_dir else ""
    ready = Path(args.ready_file) if getattr(args, "ready_file", None) else None
    return Config(policy, data, upstreams, cgroup, state_dir(args.state_dir), hint,
                  args.remove_on_exit, peers, ready)  # fmt: skip


def _found_cgroup(args: argparse.Namespace) -> tuple[Cgroup, Peers]:
    """No --cgroup (a pod, where the workload's container id is known only to the
    runtime): the cgroup its processes in this netns run in, found when a violation needs
    it, never this sidecar's, its observer's (--peers) or the pod's pause process's."""
    if args.freezer is not None:
        raise SandboxError("--freezer needs --cgroup (the v2 directory it mirrors)")
    if find_mounts().v2 is None:
        raise SandboxError(NO_CGROUPFS)
    try:
        peers = Peers(args.peers, "sidecar")
        peers.exclusions()
    except (OSError, NoCgroup) as exc:
        raise SandboxError(f"--peers {args.peers}: {exc}") from None
    if any("/.." in path for path in peers.exclusions()):
        raise SandboxError(
            "the sidecar runs in a cgroup namespace of its own: give it the host's"
            " (a privileged container gets it under containerd and CRI-O)"
        )
    cgroup = Cgroup.in_netns(f"/proc/{os.getpid()}/ns/net")
    cgroup.exclude = peers.exclusions
    cgroup.skip_init = True
    return cgroup, peers


# -- checks: each fails before anything is changed ---------------------------------------


def _check_outside(cgroup: Cgroup) -> None:
    """Inside the cgroup it freezes, the sidecar would freeze itself in mid-freeze."""
    mounts = find_mounts()
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        mine: str | None
        theirs: str | None
        if controllers == "":
            mine, theirs = mounts.v2, cgroup.v2_path
        elif "freezer" in controllers.split(","):
            mine, theirs = mounts.freezer, cgroup.freezer_path
        else:
            continue
        if mine is None or theirs is None:
            continue
        own, target = os.path.realpath(mine + path), os.path.realpath(theirs)
        if own == target or own.startswith(target + os.sep):
            raise SandboxError(
                f"egressd sidecar runs inside {theirs}, the cgroup it would freeze: "
                "run it beside the workload, in a cgroup of its own"
            )


def _lock(state: Path) -> IO[bytes]:
    """One sidecar per netns: an flock on a file named by the netns, in the state dir,
    which the workload cannot reach (an abstract socket name, as before, any process in
    the netns could take first and keep every sidecar out). The kernel drops the lock when
    this process ends, however it ends."""
    try:
        state.mkdir(mode=0o750, parents=True, exist_ok=True)
        path = state / f"sidecar-netns-{os.stat('/proc/self/ns/net').st_ino}.lock"
        handle = open(path, "ab")  # noqa: SIM115  (held open: the lock lives with it)
    except OSError as exc:
        raise SandboxError(f"cannot take the sidecar lock in {state}: {exc.strerror}") from None
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise SandboxError(f"another egressd sidecar serves this netns ({path})") from None
    return handle


def _sandbox_id(journal: Journal, wanted: str | None, cgroup: Cgroup) -> tuple[str, bool]:
    """(id, whether the journal already holds it): a restart with the same --id and
    --cgroup continues the sandbox's record; another cgroup's id is refused."""
    if wanted is None:  # not one the journal holds (an ended sandbox's)
        return sbx.draw_id(lambda drawn: journal.sandbox(drawn) is not None), False
    if not SANDBOX_ID.match(wanted):
        raise SandboxError(f"sandbox id {wanted!r}: use 1-32 of a-z 0-9 _ - (first a-z0-9)")
    row = journal.sandbox(wanted)
    if row is None:
        return wanted, False
    if cgroup.bound and row.get("cgroup") != cgroup.v2_path:
        raise SandboxError(f"sandbox id {wanted!r} is already in use (cgroup {row['cgroup']})")
    return wanted, True


def _check_mark() -> None:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        set_mark(probe, c.SIDECAR_MARK)
    except OSError as exc:
        raise SandboxError(f"cannot set SO_MARK ({exc.strerror}): needs CAP_NET_ADMIN") from None
    finally:
        probe.close()


def _check_port() -> None:
    """Something listening on 127.0.0.53:53 (egressd attached here) would make the resolver
    fail after the rules were replaced under it: find out first."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((c.RESOLVER4, 53))  # EADDRINUSE only if another socket listens there
    except OSError as exc:
        raise SandboxError(
            f"{c.RESOLVER4}:53 in this netns: {exc.strerror} (does egressd serve it already?)"
        ) from None
    finally:
        probe.close()


# -- rules --------------------------------------------------------------------------------

KEPT = "replaced, learned addresses kept (same policy)"  # what _enforce says of a restart


def _enforce(nft: NftHandle, cfg: Config) -> str:
    """Load the ruleset, or replace a previous sidecar's in one transaction; says which."""
    template = read_template("sandbox.nft")
    sidecar = Sidecar(tuple(cfg.upstreams), os.geteuid())
    text = render_sandbox(template, cfg.policy, sidecar)
    digest = hashlib.sha256(cfg.policy_bytes + b"\0" + template.encode()).hexdigest()
    marker = f"add counter inet {c.TABLE} sidecar_{digest[:16]}\n"
    if cfg.policy.connect.check_names:  # kept when the sidecar ends, as the table is
        queue_rules.install(None, render_queue_rules(), check=True)
    if not nft.table_exists("inet", c.TABLE):
        nft.load(text + marker)
        return "loaded"
    try:
        nft.counter("inet", c.TABLE, f"sidecar_{digest[:16]}")
    except DatapathError:
        # Learned under another policy (or by another egress): out, with the old rules.
        nft.load(f"delete table inet {c.TABLE}\n" + text + marker)
        return "replaced, learned addresses dropped (another policy)"
    nft.load(reload_rules(template, cfg.policy, sidecar))
    return KEPT


# -- serving -----------------------------------------------------------------------------


async def _serve(
    sb: sbx.Sandbox, cfg: Config, journal: Journal, resumed: bool, how: str, started: float
) -> int:
    stop = _stop_on_signals()  # from here on a SIGTERM ends it the orderly way
    pid = os.getpid()
    state = SandboxState.FROZEN if sb.cgroup.is_frozen() else SandboxState.RUNNING
    if resumed:
        journal.set_sandbox_state(sb.id, state, netns=sb.netns, inline_pid=pid, owner_pid=pid,
                                  policy=sb.policy.name)  # fmt: skip
    else:
        journal.record_sandbox(sb.id, sb.policy.name, netns=sb.netns, cgroup=sb.cgroup.v2_path,
                               state=state, inline_pid=pid, owner_pid=pid,
                               freezer=sb.cgroup.freezer_path)  # fmt: skip
    if not sb.cgroup.bound:  # found later: the journal follows, for resume and kill
        sb.cgroup.on_bind = lambda cg: _record_cgroup(journal, sb.id, cg)
    session = resolver = None
    collector = Collector(asyncio.get_running_loop())
    try:
        session, resolver = wiring.make(
            sb, journal, cfg.review_hint, cfg.upstreams, None, mark=c.SIDECAR_MARK
        )
        if how == KEPT:
            # The kernel keeps what the last sidecar's answers allowed, and the workload
            # may hold those answers: no answer shortens them, and a cached address
            # still connects under an allowed name (Bindings.inherit).
            resolver.seed_expiry()
        await resolver.start()
        # Start-up's objects frozen, and from now on what lives, every second; short
        # automatic collections only (egress/collect.py).
        collector.start()
    except BaseException:
        collector.close()
        await wiring.stop(session, None)
        if cfg.remove_on_exit or how == "loaded":  # nothing of ours stays behind
            _remove_rules(sb)
        with contextlib.suppress(EgressError):
            journal.set_sandbox_state(sb.id, SandboxState.EXITED)
        raise
    try:
        ups = ", ".join(f"{h}:{p}" for h, p in cfg.upstreams)
        ms = (time.monotonic() - started) * 1e3
        if cfg.ready_file is not None:  # whole, before the line: whoever saw either may go
            tmp = _pending(cfg.ready_file)
            tmp.write_text(f"{sb.id}\n")
            os.replace(tmp, cfg.ready_file)
        print(f"egressd sidecar: serving {sb.id} (policy {sb.policy.name}; rules {how}; "
              f"upstream {ups}) in {ms:.1f} ms", flush=True)  # fmt: skip
        await stop.wait()
    finally:
        collector.close()
        if cfg.ready_file is not None:
            for path in (cfg.ready_file, _pending(cfg.ready_file)):
                with contextlib.suppress(OSError):
                    path.unlink()
        await wiring.stop(session, resolver)
        _leave(sb, journal, remove=cfg.remove_on_exit)
    return 0


def _pending(ready_file: Path) -> Path:
    """Where the ready file is written whole before it takes its name."""
    return ready_file.with_name(ready_file.name + ".tmp")


def _record_cgroup(journal: Journal, sandbox_id: str, cgroup: Cgroup) -> None:
    try:
        journal.update_sandbox(sandbox_id, cgroup=cgroup.v2_path, freezer=cgroup.freezer_path)
    except EgressError as exc:  # the freeze goes on; egressctl resume would not find it
        print(f"egressd sidecar: could not journal the cgroup found: {exc}", file=sys.stderr)


def _leave(sb: sbx.Sandbox, journal: Journal, remove: bool) -> None:
    """Stopped: the rules stay and keep enforcing, unless asked to remove them."""
    if not remove:
        print(f"egressd sidecar: stopped serving {sb.id}; its rules stay in force "
              "(no DNS, no new flows)", file=sys.stderr)  # fmt: skip
        return
    _remove_rules(sb)
    with contextlib.suppress(EgressError):
        journal.set_sandbox_state(sb.id, SandboxState.EXITED)
    print(f"egressd sidecar: stopped serving {sb.id}; table inet {c.TABLE} and its NFQUEUE "
          "rule removed", file=sys.stderr)  # fmt: skip


def _remove_rules(sb: sbx.Sandbox) -> None:
    sb.nft.delete_table("inet", c.TABLE)
    queue_rules.remove(None, render_queue_rules())


def _stop_on_signals() -> asyncio.Event:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
