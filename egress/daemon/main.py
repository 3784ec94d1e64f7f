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
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from egress import __version__
from egress.errors import EgressError, SandboxError
from egress.runtime.journal import Journal, state_dir
from egress.runtime.paths import run_dir

from . import rundir
from .api import make_app
from .observers import Supervisor
from .registry import Registry

FMT = argparse.RawDescriptionHelpFormatter
FD_SETSIZE = 1024
DEFAULT_SOCKET = str(run_dir() / "egressd.sock")
SERVE_EPILOG = """\
examples:
  egressd                                   # /run/egress/egressd.sock, root only
  egressd --group egress                    # members of group egress may call the API
  egressd --socket /tmp/e.sock --run-dir /tmp/e-run --state-dir /tmp/e-state
  curl --unix-socket /run/egress/egressd.sock http://egressd/v1/sandboxes
  egressctl sandbox create --policy policies/python-dev.yaml

SIGTERM (or Ctrl-C) stops serving; every sandbox's nft rules stay in the kernel, so
enforcement never lapses, and the next egressd adopts the sandboxes in --run-dir.
Run `egressd observer` beside it (its own process, its own unit) for the second layer.
"""
OBSERVER_EPILOG = """\
examples:
  egressd observer
  egressd observer --run-dir /tmp/e-run --state-dir /tmp/e-state

Watches every sandbox egressd created (one forked observer per sandbox, restarted on a
policy swap). Sandboxes egressd attached to are not watched by this layer.
"""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", metavar="DIR", default=str(rundir.default_run_dir()),
                   help="where served sandboxes are recorded (default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        help="journal directory (default: $EGRESS_STATE_DIR or /var/lib/egress)",
    )


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="egressd",
        formatter_class=FMT,
        description=(
            "Serve many egress sandboxes from one process, with an HTTP API on a unix "
            "socket (never TCP). `egressd observer --help` for the observer layer."
        ),
        epilog=SERVE_EPILOG,
    )
    p.add_argument("--version", action="version", version=f"egressd {__version__}")
    p.add_argument("--socket", metavar="PATH", default=DEFAULT_SOCKET,
                   help="the API socket (default: %(default)s), mode 0660, owner root")  # fmt: skip
    p.add_argument("--group", metavar="G", help="group owning the socket (default: root's)")
    p.add_argument(
        "--no-adopt",
        action="store_true",
        help="do not serve the sandboxes an earlier egressd left in --run-dir",
    )
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
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    try:
        if args_in[:1] == ["observer"]:
            args = observer_parser().parse_args(args_in[1:])
            sup = Supervisor(Path(args.run_dir), state_dir(args.state_dir))
            return sup.run()
        args = serve_parser().parse_args(args_in)
        gid = _group(args.group)
        return asyncio.run(serve(args, gid))
    except EgressError as exc:
        print(f"egressd: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


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
    _cap_open_files()
    state = state_dir(args.state_dir)
    journal = Journal.open(state)
    hint = f" --state-dir {args.state_dir}" if args.state_dir else ""
    registry = Registry(journal, Path(args.run_dir), review_hint=hint)
    runner: web.AppRunner | None = None
    try:
        if not args.no_adopt:
            for problem in await registry.adopt():
                print(f"egressd: {problem}", file=sys.stderr)
        runner = web.AppRunner(make_app(registry), handle_signals=False)
        await runner.setup()
        await _bind(runner, args.socket, gid)
        print(f"egressd: serving {len(registry.served)} sandboxes on {args.socket}", flush=True)
        await _until_signalled()
    finally:
        if runner is not None:
            await runner.cleanup()
        await registry.close()
        with contextlib.suppress(FileNotFoundError):
            if runner is not None:
                os.unlink(args.socket)
        journal.close()
    return 0


def _cap_open_files() -> None:
    """Keep every descriptor below FD_SETSIZE (1024).

    libnftables (nftables 1.0.6, src/mnl.c) waits for the kernel with select(): a handle
    whose socket is fd 1024 or above aborts the whole process ("bit out of range 0 -
    FD_SETSIZE"), taking every sandbox's resolver down. Each served sandbox holds about
    nine descriptors, so with this cap a create past ~110 sandboxes fails cleanly (EMFILE,
    undone, an error to its caller) instead.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft > FD_SETSIZE:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FD_SETSIZE, hard))


async def _bind(runner: web.AppRunner, path: str, gid: int) -> None:
    """Listen on ``path`` (0660, root:gid); refuse if another egressd answers there."""
    Path(path).parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale: its egressd is gone
        else:
            raise SandboxError(f"{path}: another egressd is listening there")
        finally:
            probe.close()
    old = os.umask(0o117)  # never a moment when others may connect
    try:
        await web.UnixSite(runner, path).start()
    finally:
        os.umask(old)
    os.chown(path, 0, gid)
    os.chmod(path, 0o660)


async def _until_signalled() -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


if __name__ == "__main__":
    sys.exit(main())
