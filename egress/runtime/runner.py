"""`egressctl run`: one sandbox, served in-process, for the life of one command.

    create sandbox ─▶ NFLOG (inline group) ─▶ spawn CMD ─▶ wait (pidfd) ─▶ teardown ─▶ report

The loop reads the kernel's drop evidence while the command runs and forwards signals to
it. Teardown runs on every path out, Ctrl-C included, unless ``keep`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from egress.datapath import constants as c
from egress.datapath.addressing import Pools
from egress.datapath.evidence import drop_class, drop_violation
from egress.errors import EgressError, SandboxError
from egress.model import Policy, Violation
from egress.resolver.core import ResolverCore
from egress.runtime import sandbox as sbx
from egress.runtime import workload
from egress.runtime.dns_server import ResolverServer, parse_upstream, resolve_upstreams
from egress.runtime.nflog import NflogEvent, NflogListener

# Signals a user sends to "the command"; SIGINT/SIGQUIT come from the terminal to the whole
# foreground process group already, so they are forwarded only when they did not.
FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH)
TERMINAL = (signal.SIGINT, signal.SIGQUIT)


@dataclass
class RunOptions:
    argv: Sequence[str]
    uplink_netns: str | None = None
    pools: Pools = field(default_factory=lambda: Pools.parse(None))
    user: str | None = None
    report: str | None = None
    keep: bool = False
    upstream: str | None = None  # --upstream IP[:PORT], instead of the policy's upstreams


@dataclass
class RunResult:
    sandbox: str
    exit_code: int
    violations: list[Violation] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    timings_ms: dict[str, float] = field(default_factory=dict)
    kept: bool = False

    def to_json(self, policy: Policy, opts: RunOptions, user: str) -> dict[str, object]:
        return {
            "sandbox": self.sandbox,
            "policy": policy.name,
            "mode": policy.mode.value,
            "command": list(opts.argv),
            "user": user,
            "exit_code": self.exit_code,
            "frozen": False,
            "kept": self.kept,
            "violations": [v.to_json() for v in self.violations],
            "counters": self.counters,
            "timings_ms": self.timings_ms,
        }


def run(policy: Policy, opts: RunOptions) -> int:
    """Run the command in a new sandbox; returns its exit status."""
    if os.geteuid() != 0:
        raise SandboxError("egressctl run needs root (it creates a network namespace); use sudo")
    user = workload.resolve_user(opts.user)
    # Created and destroyed outside the event loop: pyroute2's synchronous API runs its own.
    sb = sbx.create(policy, opts.pools, opts.uplink_netns)
    result = RunResult(sb.id, exit_code=1, kept=opts.keep)
    result.timings_ms["create"] = round(sb.created_s * 1000, 2)
    try:
        asyncio.run(_serve(sb, opts, user, result))
    finally:
        _collect_counters(sb, result)
        _finish(sb, opts, result)
        if opts.report:
            _write_report(opts.report, result.to_json(policy, opts, user.name))
    return result.exit_code


def _finish(sb: sbx.Sandbox, opts: RunOptions, result: RunResult) -> None:
    if opts.keep:
        print(f"egressctl: kept sandbox {sb.id} (netns {sb.netns})", file=sys.stderr)
        return
    start = time.monotonic()
    sb.destroy()
    result.timings_ms["teardown"] = round((time.monotonic() - start) * 1000, 2)


def _write_report(path: str, data: dict[str, object]) -> None:
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, target)
    except OSError as exc:
        raise EgressError(f"--report {path}: {exc.strerror}") from None


class _Session:
    """The live part of a run: evidence in, signals out."""

    def __init__(self, sb: sbx.Sandbox, result: RunResult) -> None:
        self.sb = sb
        self.result = result
        self.listener = NflogListener.open(sb.netns, c.INLINE_GROUP)

    def on_nflog(self) -> None:
        for event in self.listener.read_events():
            self.record(event)

    def record(self, event: NflogEvent) -> None:
        cls = drop_class(event.prefix)
        if cls is None:
            return
        v = drop_violation(self.sb.policy, cls, event.flow, event.uid, event.timestamp, "inline")
        self.result.violations.append(v)

    def close(self) -> None:
        self.on_nflog()  # evidence that arrived while the command was exiting
        self.result.counters["nflog_overruns"] = self.listener.overruns
        self.listener.close()


def _resolver(sb: sbx.Sandbox, opts: RunOptions, result: RunResult) -> ResolverServer:
    upstreams = resolve_upstreams(sb.policy.dns.upstreams)
    if opts.upstream:
        upstreams = [parse_upstream(opts.upstream)]
    core = ResolverCore(sb.policy, len(upstreams), secrets.randbits)
    return ResolverServer(
        core, upstreams, sb.nft, result.violations.append, sb.netns, opts.uplink_netns
    )


async def _serve(sb: sbx.Sandbox, opts: RunOptions, user: workload.User, result: RunResult) -> None:
    loop = asyncio.get_running_loop()
    session = _Session(sb, result)
    loop.add_reader(session.listener.fileno(), session.on_nflog)
    resolver = _resolver(sb, opts, result)
    await resolver.start()
    try:
        procs = [p for p in (sb.cgroup.procs_file_v2, sb.cgroup.procs_file_v1) if p]
        proc = workload.spawn(sb.netns, user, opts.argv, procs)
        result.exit_code = await _wait(loop, proc.pid, sb)
        proc.returncode = result.exit_code  # reaped by _wait; keep Popen from reaping again
    finally:
        await resolver.close()
        loop.remove_reader(session.listener.fileno())
        session.close()
        _resolver_counters(resolver, result)


async def _wait(loop: asyncio.AbstractEventLoop, pid: int, sb: sbx.Sandbox) -> int:
    pidfd = os.pidfd_open(pid)
    done = loop.create_future()

    def exited() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(pidfd, exited)
    _install_signals(loop, pid, sb)
    try:
        await done
        _, status = os.waitpid(pid, 0)
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        for sig in FORWARDED + TERMINAL:
            loop.remove_signal_handler(sig)
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code  # killed by signal N: the shell's 128+N


def _install_signals(loop: asyncio.AbstractEventLoop, pid: int, sb: sbx.Sandbox) -> None:
    state = {"interrupts": 0}

    def forward(sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def terminal(sig: signal.Signals) -> None:
        state["interrupts"] += 1
        if state["interrupts"] > 1:
            # A second Ctrl-C: the command did not stop; end everything in the sandbox.
            with contextlib.suppress(EgressError, OSError):
                sb.cgroup.kill()
            return
        if not _from_terminal():
            forward(sig)

    for sig in FORWARDED:
        loop.add_signal_handler(sig, forward, sig)
    for sig in TERMINAL:
        loop.add_signal_handler(sig, terminal, sig)


def _from_terminal() -> bool:
    """Did the terminal deliver this to the command too (we are its foreground group)?"""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):
        return False


def _resolver_counters(resolver: ResolverServer, result: RunResult) -> None:
    stats = resolver.core.stats
    result.counters.update({f"dns_{k}": v for k, v in stats.items()})
    result.counters["set_updates"] = resolver.sets.updates
    result.counters["set_update_failures"] = resolver.sets.failures + resolver.sets.slow
    result.counters["resolver_internal_errors"] = resolver.internal_errors


def _collect_counters(sb: sbx.Sandbox, result: RunResult) -> None:
    try:
        packets, nbytes = sb.nft.counter("inet", c.TABLE, "dropped")
        dns_packets, _ = sb.nft.counter("inet", c.TABLE, "dns_queries")
    except EgressError:
        return
    result.counters.update(
        dropped_packets=packets,
        dropped_bytes=nbytes,
        dns_packets=dns_packets,
        violations=len(result.violations),
    )
