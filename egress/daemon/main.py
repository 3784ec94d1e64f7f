"""egressd entry point: the daemon (`egressd`) and its observer layer (`egressd observer`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import grp
import os
import resource
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from egress import __version__
from egress.collect import Collector
from egress.daemon.lag import LoopLag
from egress.errors import EgressError, SandboxError
from egress.kernel import nft, oom
from egress.kernel.netns_cgroup import enter_host_cgroupns
from egress.kernel.sched import leave_realtime, raise_session_group
from egress.observer.supervisor import Supervisor
from egress.store import claims, rundir, uids
from egress.store.follow import Follower, event_json
from egress.store.journal import Journal
from egress.store.paths import EGRESS_GROUP, egress_gid, private_dir, run_dir, state_dir

from . import handoff, sidecar
from .api import make_app, make_metrics_app
from .figures import KernelFigures
from .registry import Registry

FMT = argparse.RawDescriptionHelpFormatter
NICE = -10  # see _raise_priority
OPEN_FILES = 1 << 20  # sandboxes x (8 + up to MAX_IN_FLIGHT upstream sockets)
DEFAULT_SOCKET = str(run_dir() / "egressd.sock")
SERVE_EPILOG = """\
examples:
  egressd                                   # /run/egress/egressd.sock, root only
  egressd --group egress                    # members of group egress may call the API
  egressd --socket /tmp/e.sock --run-dir /tmp/e-run --state-dir /tmp/e-state
  curl --unix-socket /run/egress/egressd.sock http://egressd/v1/sandboxes
  egressctl sandbox create --policy policies/python-dev.yaml

  egressd --replace                         # restart or upgrade without losing a query

SIGTERM (or Ctrl-C) stops serving; every sandbox's nft rules stay in the kernel, so
enforcement never lapses, and the next egressd adopts the sandboxes in --run-dir.
Queries sent while no egressd runs wait in the resolver sockets' queues only as long as
a socket lives: to restart under load, start the new one with --replace instead. It
takes the running egressd's sockets over (SCM_RIGHTS), queued queries and all; the old
one answers what it already sent upstream and exits.
Run `egressd observer` beside it (its own process, its own unit) for the second layer.
"""
OBSERVER_EPILOG = """\
examples:
  egressd observer
  egressd observer --run-dir /tmp/e-run --state-dir /tmp/e-state

Watches every sandbox egressd serves, created or attached, freezing the cgroup the run
dir's record names. One forked shard per CPU (--shards) watches its share of the
sandboxes in one loop (an observer each, restarted on a policy swap); a shard that dies
is started again.
"""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", metavar="DIR", default=str(rundir.records_dir()),
                   help="where served sandboxes are recorded (default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        help="journal directory (default: $EGRESS_STATE_DIR or /var/lib/egress)",
    )


LOG_POLL_S = 1.0


class JournalLog:
    """``--log-journal``: a thread following the journal (its own connection) and
    printing each new event as a JSON line. It starts after what the last minute
    journaled (a predecessor printed that), and prints all that is there when stopped."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="journal-log", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            with Journal.open(self.state) as journal:
                follower = Follower(journal)
                follower.skip_recent()
                while True:
                    stopping = self._stop.is_set()  # then one last poll
                    for event in follower.poll():
                        print(event_json(event), flush=True)
                    if stopping:
                        return
                    # Each poll re-reads the journal's last minute (two writers, events
                    # landing out of order): once a second, not --follow's four times.
                    self._stop.wait(LOG_POLL_S)
        except (EgressError, OSError) as exc:
            print(f"egressd: --log-journal stopped: {exc}", file=sys.stderr, flush=True)


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="egressd",
        usage="%(prog)s [options]\n       %(prog)s observer [options]\n"
        "       %(prog)s sidecar --policy FILE --cgroup DIR [options]",
        formatter_class=FMT,
        description=(
            "Serve many egress sandboxes from one process, with an HTTP API on a unix\n"
            "socket (never TCP).\n\n"
            "  egressd observer   the observer layer for them (its own process; --help)\n"
            "  egressd sidecar    one sandbox, served from inside its netns (--help)"
        ),
        epilog=SERVE_EPILOG,
    )
    p.add_argument("--version", action="version", version=f"egressd {__version__}")
    p.add_argument("--socket", metavar="PATH", default=DEFAULT_SOCKET,
                   help="the API socket (default: %(default)s), mode 0660, owner root")  # fmt: skip
    p.add_argument("--group", metavar="G", help="group owning the socket (default: root's); "
                   "with the socket in the run dir, egress")  # fmt: skip
    p.add_argument(
        "--replace",
        action="store_true",
        help="take over from the egressd running on --run-dir: it hands over its "
        "sockets (no query is lost), drains and exits; without one, start as usual",
    )
    p.add_argument(
        "--no-adopt",
        action="store_true",
        help="do not serve the sandboxes an earlier egressd left in --run-dir",
    )
    p.add_argument(
        "--metrics-address",
        metavar="HOST:PORT",
        help="also serve /metrics (only it, read-only, with no authentication: it lists "
        "every sandbox's id and counters) over TCP there, for Prometheus; the API stays on "
        "the unix socket",
    )
    p.add_argument(
        "--log-journal",
        action="store_true",
        help="print each new journal event (violations, freezes, decisions, sandboxes; "
        "both layers') to stdout as a JSON line, as `egressctl journal --follow --json` "
        "does: for a DaemonSet's log collector",
    )
    p.add_argument(
        "--uid-range", metavar="START-END",
        help="uids for created sandboxes' workloads (default: $EGRESS_UID_RANGE or "
        "2000000000-2000065535)",
    )  # fmt: skip
    _common(p)
    return p


def observer_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="egressd observer",
        formatter_class=FMT,
        description="The observer layer for every sandbox egressd serves (its own process).",
        epilog=OBSERVER_EPILOG,
    )
    _common(p)
    p.add_argument(
        "--shards", metavar="N", type=int, default=None,
        help="processes the sandboxes are shared among (default: one per CPU)",
    )  # fmt: skip
    return p


def sidecar_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="egressd sidecar",
        formatter_class=FMT,
        description=(
            "Serve one sandbox from inside its own netns (beside the workload, as a "
            "container sharing its netns would): its DNS, its allowed sets, the inline "
            "freeze layer. Needs CAP_NET_ADMIN; the workload must have neither "
            "CAP_NET_ADMIN nor CAP_NET_RAW."
        ),
        epilog=sidecar.EPILOG,
    )
    p.add_argument("--policy", required=True, metavar="FILE", help="the sandbox's policy")
    p.add_argument("--cgroup", metavar="PATH",
                   help="the workload's cgroup v2 directory (frozen on a violation); without"
                        " it, the cgroup the workload's processes in this netns run in, found"
                        " when a violation needs it (a pod: see --peers)")  # fmt: skip
    p.add_argument("--freezer", metavar="PATH", help="its v1 freezer twin, if it has one")
    p.add_argument("--peers", metavar="DIR",
                   help="without --cgroup: a directory shared with egress's other containers"
                        " of the pod (the observer's), where each names its cgroup; those are"
                        " never the workload's")  # fmt: skip
    p.add_argument("--id", metavar="ID", help="the sandbox id in the journal (default: random)")
    p.add_argument("--upstream", metavar="IP[:PORT]",
                   help="ask this upstream instead of the policy's dns.upstreams")  # fmt: skip
    p.add_argument("--ready-file", metavar="PATH",
                   help="created once it serves, removed when it stops: what a pod's"
                        " startupProbe tests before the workload starts")  # fmt: skip
    p.add_argument(
        "--remove-on-exit",
        action="store_true",
        help="on SIGTERM/SIGINT delete table inet egress (default: leave it enforcing)",
    )
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        help="journal directory (default: $EGRESS_STATE_DIR or /var/lib/egress)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    try:
        if args_in[:1] == ["observer"]:
            args = observer_parser().parse_args(args_in[1:])
            _host_cgroupns("egressd observer")
            _raise_open_files()  # a few descriptors per sandbox watched
            _raise_priority("egressd observer")  # it judges and freezes too
            sup = Supervisor(Path(args.run_dir), state_dir(args.state_dir), args.shards)
            return sup.run()
        if args_in[:1] == ["sidecar"]:
            return sidecar.run(sidecar_parser().parse_args(args_in[1:]))
        # Until egressd is ready for it, a reload signal (systemd's ExecReload) must not
        # kill it: ignored here, handled once serving (and ignored across the re-exec).
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        args = serve_parser().parse_args(args_in)
        args.argv = [a for a in args_in if a != "--replace"]  # for a re-exec on SIGHUP
        gid = _group(args.group)
        _check_reach(args.socket, gid)
        _host_cgroupns("egressd")
        return asyncio.run(serve(args, gid))
    except EgressError as exc:
        print(f"egressd: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _host_cgroupns(who: str) -> None:
    """In a container of its own cgroup namespace (a DaemonSet's pod), see cgroups as the
    host does, or attached sandboxes' cgroups cannot be found (kernel.netns_cgroup).
    Here, before any thread starts: a namespace is per thread."""
    try:
        if enter_host_cgroupns():
            print(f"{who}: entered the host's cgroup namespace (PID 1's)", file=sys.stderr)
    except OSError as exc:
        print(f"{who}: stays in its own cgroup namespace ({exc.strerror}): sandboxes "
              "attached without a cgroup are blocked, not frozen", file=sys.stderr)  # fmt: skip


def _group(name: str | None) -> int:
    if name is None:
        return 0
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise SandboxError(f"--group {name}: no such group") from None


async def serve(args: argparse.Namespace, gid: int) -> int:
    if os.geteuid() != 0:
        raise SandboxError("egressd needs root (it makes namespaces, nft rules and cgroups)")
    _raise_open_files()
    _raise_priority("egressd")
    taken = handoff.inherited()  # this process, re-executed on SIGHUP (first: its env)
    nft.use_worker().start()
    claims.track()  # the claims directory's changes from inotify, not listed per create
    run_dir = Path(args.run_dir)
    try:
        rundir.prepare(run_dir)  # root's and group egress's only, as an older one may not be
    except OSError as exc:
        raise SandboxError(f"--run-dir {run_dir}: {exc.strerror}") from None
    if taken is None and args.replace:
        taken = handoff.take_over(run_dir)
    state = state_dir(args.state_dir)
    journal = Journal.open(state)
    hint = f" --state-dir {args.state_dir}" if args.state_dir else ""
    uid_range = uids.parse_range(args.uid_range)
    uids.check_range(uid_range)
    registry = Registry(journal, run_dir, review_hint=hint, uid_range=uid_range)
    collector = registry.collector = Collector(asyncio.get_running_loop())
    lag = registry.lag = LoopLag(asyncio.get_running_loop())
    figures = registry.figures = KernelFigures()
    with contextlib.suppress(EgressError):  # said at the first scrape, tried again there
        figures.start()  # now, while this process is small: a spawn forks it
    runner: web.AppRunner | None = None
    api: socket.socket | None = None
    giver: handoff.Giver | None = None
    api_file: int | None = None
    ended = "stop"
    metrics_runner: web.AppRunner | None = None
    logger = JournalLog(state) if args.log_journal else None
    try:
        if logger is not None:
            logger.start()
        if taken is not None or not args.no_adopt:
            handed = taken.sandboxes if taken is not None else None
            for problem in await registry.adopt(handed):
                print(f"egressd: {problem}", file=sys.stderr)
            if taken is not None:
                taken.sandboxes = {}  # the registry owns them now (served, or closed)
        runner = web.AppRunner(make_app(registry), handle_signals=False)
        await runner.setup()
        if taken is not None and taken.api is not None and _bound_to(taken.api, args.socket):
            api, taken.api = taken.api, None  # the same listening socket: no refused connect
        else:
            api = _listen(args.socket, gid)
        await web.SockSite(runner, api).start()
        if args.metrics_address:
            metrics_runner = await _serve_metrics(registry, args.metrics_address)
        giver = handoff.Giver(
            run_dir, registry.offers, lambda: api, registry.pause, registry.settled
        )
        # Listen before telling the old one we serve: its exit then finds our socket file
        # in place and leaves it (if it gave up on us meanwhile, it listens anew).
        giver.listen()
        if taken is not None:
            taken.serving()  # SandboxError if the old one gave up: it still serves the API
            how = "re-executed" if taken.old_pid == os.getpid() else "took over from egressd"
            print(f"egressd: {how} {taken.old_pid}", flush=True)
        with contextlib.suppress(OSError):  # the API socket file is ours to remove at exit
            api_file = os.stat(args.socket).st_ino
        print(f"egressd: serving {len(registry.served)} sandboxes on {args.socket}", flush=True)
        collector.start()  # start-up's objects frozen, and from now on (egress/collect.py)
        lag.start()
        ended = await _until_signalled(giver)
    finally:
        collector.close()  # no full collection in the middle of a shutdown or handover
        lag.close()
        if logger is not None:
            logger.stop()  # what was journaled until now is printed first
        if taken is not None:
            taken.close()  # whatever adoption did not use
        reload = None
        if ended == "reload":
            # Duplicates survive the shutdown below; exec passes them on.
            registry.pause(True)
            with contextlib.suppress(TimeoutError):  # a create half-done is not left out
                await asyncio.wait_for(registry.settled(), 10)
            api_copy = None if api is None else handoff.dup(api)
            reload = ([o.dup() for o in registry.offers()], api_copy)
        if giver is not None:
            giver.close()
        if runner is not None:
            await runner.cleanup()
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        figures.close()  # after the API's cleanup: no scrape can start another worker now
        if ended == "stop":
            print(f"egressd: stopping; {len(registry.served)} sandboxes keep their rules "
                  "in the kernel for the next egressd", file=sys.stderr, flush=True)  # fmt: skip
        await registry.close(handed_over=ended != "stop")
        if api_file is not None and ended == "stop":
            _unlink_if_ours(args.socket, api_file)
        if api is not None:
            api.close()
        journal.close()
    if reload is not None:
        print("egressd: SIGHUP: re-executing with every socket kept", file=sys.stderr, flush=True)
        nft.use_worker().close()  # the new image starts its own
        handoff.exec_self(args.argv, *reload)
    return 0


def _raise_priority(who: str) -> None:
    """Nice -10, unless it was started higher, for egressd and its observer layer alike:
    every sandbox's DNS waits on egressd, and every sandbox's second verdict on the
    observer. With two processes of one sandbox flooding both vCPUs of the test machine,
    another sandbox's p99 went to 7 times its p99 alone at nice 0, and to half of it at
    -10 (bench/bench_fairness.py); egressd used 6% of a CPU either way: the rest was
    waiting for its turn. The observer at nice 0 beside egressd at -10 got what egressd
    left: at 1,000 sandboxes and 4,700 queries/s on 2 vCPUs (bench/bench_egressd.py) it
    decided a blocked datagram 1.9 s after it was sent at the median and 3.9 s at p99
    (egressd: 0.07 and 0.22 s), a second layer a workload outruns; at -10, 1-9 and
    258-354 ms, and 0.7-0.8 and 86-92 ms once it judged repeats no more than once
    (Observer._drain). The price, where the CPUs are short: egressd's DNS tail, as the
    observer takes its turns (at 1,000, hits p99 283-352 ms against 226).

    Its session too, where the kernel schedules by session and it leads its own
    (kernel/sched.py, raise_session_group): else -10 counts only against its own
    processes. Real-time is not safe: see kernel/sched.py."""
    leave_realtime(who)
    oom.shelter(who)
    with contextlib.suppress(OSError):
        if os.getpriority(os.PRIO_PROCESS, 0) > NICE:
            os.setpriority(os.PRIO_PROCESS, 0, NICE)
    raise_session_group(who, NICE)


def _raise_open_files() -> None:
    """Room for thousands of sandboxes' descriptors (about eight each).

    Nothing in egressd select()s on a descriptor: libnftables, which does, runs in the
    nft worker process (kernel/nft_worker.py). The soft limit is often 1024; the
    daemon's unit sets LimitNOFILE too, this covers running it by hand.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES if hard == resource.RLIM_INFINITY else min(OPEN_FILES, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def _port_digits(port: str) -> bool:
    """ASCII digits, at most five: ``int`` takes '٣' and raises on '²' or 4,301 nines."""
    return len(port) <= 5 and port.isascii() and port.isdigit()


async def _serve_metrics(registry: Registry, address: str) -> web.AppRunner:
    host, sep, port = address.rpartition(":")
    if not sep or not _port_digits(port) or not 0 < int(port) < 65536:
        raise SandboxError(f"--metrics-address {address!r}: give HOST:PORT, e.g. 0.0.0.0:9469")
    runner = web.AppRunner(make_metrics_app(registry), handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host.strip("[]") or None, int(port)).start()
    except OSError as exc:
        await runner.cleanup()
        raise SandboxError(f"--metrics-address {address}: {exc.strerror}") from None
    return runner


def _listen(path: str, gid: int) -> socket.socket:
    """The API socket at ``path`` (0660, root:gid); refuse if another egressd answers."""
    try:
        _socket_dir(Path(path).parent)
    except OSError as exc:
        raise SandboxError(f"--socket {path}: {exc.strerror}") from None
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale: its egressd is gone
        else:
            raise SandboxError(
                f"{path}: another egressd is listening there (egressd --replace takes over)"
            )
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)  # never a moment when others may connect
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise SandboxError(f"--socket {path}: {exc.strerror}") from None
    finally:
        os.umask(old)
    os.chown(path, 0, gid)
    os.chmod(path, 0o660)
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _socket_dir(parent: Path) -> None:
    """In egress's run dir the socket's directory is egress's (0750, group egress or
    root); elsewhere it is the operator's, made 0755 if missing. Either way the socket's
    own mode decides who connects."""
    if parent.is_relative_to(run_dir()):
        private_dir(parent)
    else:
        parent.mkdir(mode=0o755, parents=True, exist_ok=True)


def _check_reach(socket_path: str, gid: int) -> None:
    """--group must be able to pass through the socket's directory to reach it."""
    if Path(socket_path).parent.is_relative_to(run_dir()) and gid not in (0, egress_gid()):
        raise SandboxError(
            f"--group {_group_name(gid)}: {socket_path} is in {run_dir()}, which only root "
            f"and group {EGRESS_GROUP} may enter (0750); use --group {EGRESS_GROUP} "
            f"(groupadd --system {EGRESS_GROUP} if it is missing) or a --socket elsewhere"
        )


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _bound_to(sock: socket.socket, path: str) -> bool:
    return bool(sock.getsockname() == path)


def _unlink_if_ours(path: str, inode: int) -> None:
    """Remove the socket file unless another egressd's took its place."""
    with contextlib.suppress(OSError):
        if os.stat(path).st_ino == inode:
            os.unlink(path)


async def _until_signalled(giver: handoff.Giver) -> str:
    """Why serving ended: "stop" (SIGTERM, SIGINT), "reload" (SIGHUP), or "handed"."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    reload = asyncio.Event()

    def hup() -> None:
        if giver.busy:  # two of us would serve the same sockets
            print("egressd: SIGHUP ignored: a handoff is under way", file=sys.stderr)
            return
        reload.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, hup)
    handed = giver.done
    waits = [asyncio.ensure_future(e.wait()) for e in (stop, reload, handed)]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    if handed.is_set():
        return "handed"
    return "reload" if reload.is_set() and not stop.is_set() else "stop"


if __name__ == "__main__":
    sys.exit(main())
