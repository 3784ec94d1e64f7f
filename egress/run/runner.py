"""`egressctl run`: one sandbox, served in-process, for the life of one command.

    journal ─▶ create sandbox ─▶ observer process (its own NFLOG group) ─▶ resolver + inline
    NFLOG ─▶ spawn CMD ─▶ wait ─▶ stop observer ─▶ teardown ─▶ report

Teardown runs on every path out, Ctrl-C included, unless ``keep`` is set. The sandbox is
created and destroyed outside the event loop: both block, and pyroute2's synchronous API
(teardown's) runs an event loop of its own.
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
from typing import Any

from egress.collect import Collector
from egress.datapath import constants as c
from egress.datapath.addressing import Pools
from egress.errors import EgressError, SandboxError, Stopped, UsageError
from egress.inline import wiring
from egress.inline.server import ResolverServer
from egress.inline.session import Session
from egress.inline.upstream import parse_upstream, resolve_upstreams
from egress.model import Limits, Policy, ReviewAction, SandboxState
from egress.observer.process import ObserverProcess
from egress.policy.limitsspec import format_size
from egress.run.command import wait_for_exit
from egress.sandbox import lifecycle as sbx
from egress.sandbox import view, workload
from egress.sandbox.view import Identity
from egress.store import claims, uids
from egress.store.journal import Journal
from egress.store.paths import default_state_dir


@dataclass
class RunOptions:
    argv: Sequence[str]
    policy_path: str = ""
    uplink_netns: str | None = None
    pools: Pools = field(default_factory=lambda: Pools.parse(None))
    user: str | None = None
    report: str | None = None
    keep: bool = False
    upstream: str | None = None  # --upstream IP[:PORT], instead of the policy's upstreams
    state_dir: str | None = None
    decision_timeout: float | None = None
    workdir: str | None = None  # default: the current directory; checked by the caller
    binds: Sequence[view.Bind] = ()  # --ro-bind / --bind
    env: Sequence[str] = ()  # --env and --env-file items, NAME or NAME=VALUE
    uid_range: str | None = None  # --uid-range; default $EGRESS_UID_RANGE or uids' default
    policy_sha256: str | None = None  # of the policy file's bytes, as egressctl read them


@dataclass
class RunResult:
    sandbox: str
    exit_code: int = 1
    counters: dict[str, int] = field(default_factory=dict)
    timings_ms: dict[str, float] = field(default_factory=dict)
    kept: bool = False
    session: Session | None = None
    journaled: list[dict[str, Any]] = field(default_factory=list)
    outcome: str | None = None
    frozen: bool = False
    freeze_latency_ms: float | None = None
    workdir: str = ""
    env_names: list[str] = field(default_factory=list)

    def to_json(self, policy: Policy, opts: RunOptions, who: Identity) -> dict[str, object]:
        return {
            "sandbox": self.sandbox,
            "policy": policy.name,
            "mode": policy.mode.value,
            "command": list(opts.argv),
            "user": who.name,
            "uid": who.uid,
            "workdir": self.workdir,
            "env": self.env_names,  # names only: values may be secrets
            "exit_code": self.exit_code,
            "frozen": self.frozen,
            "outcome": self.outcome,
            "freeze_latency_ms": self.freeze_latency_ms,
            "kept": self.kept,
            "violations": self._violations(),
            "counters": self.counters,
            "timings_ms": self.timings_ms,
        }

    def _violations(self) -> list[dict[str, Any]]:
        """The journal's records (both layers, deduplicated), else what inline saw."""
        if self.journaled:
            return self.journaled
        seen = self.session.state.violations if self.session else []
        return [v.to_json() for v in seen]


def run(policy: Policy, opts: RunOptions) -> int:
    """Run the command in a new sandbox; returns its exit status."""
    if os.geteuid() != 0:
        raise SandboxError("egressctl run needs root (it creates a network namespace); use sudo")
    # Everything the user got wrong is found before anything is made.
    named = workload.named_user(opts.user) if opts.user is not None else None
    extra_env = workload.resolve_env(opts.env, os.environ)
    # Checked by egressctl (cli.workload_args) before the policy was read, and by
    # view.prepare again right before the command starts.
    workdir = os.path.realpath(opts.workdir or os.getcwd())
    uid_range = None
    if named is None:
        uid_range = uids.parse_range(opts.uid_range)
        uids.check_range(uid_range)
    else:
        workload.print_warning(workload.shared_user_warning(named))
    report_dir = _open_report_dir(opts.report) if opts.report else None
    plan = _Plan(named, uid_range, extra_env, workdir, report_dir)
    state = Path(opts.state_dir) if opts.state_dir else default_state_dir()
    _stop_on_signals()
    observer = ObserverProcess.fork(policy, state)  # before any SQLite connection exists
    try:
        journal = Journal.open(state)
    except BaseException:
        observer.stop(timeout=0)
        raise
    try:
        return _run(policy, opts, plan, journal, observer)
    finally:
        observer.stop()
        journal.close()
        if report_dir is not None:
            os.close(report_dir)


@dataclass(frozen=True)
class _Plan:
    """What run checked before making anything."""

    named: Identity | None  # --user, else None: a uid of the sandbox's own
    uid_range: range | None
    env: dict[str, str]
    workdir: str
    report_dir: int | None = None  # an fd of the report's directory


def _run(
    policy: Policy,
    opts: RunOptions,
    plan: _Plan,
    journal: Journal,
    observer: ObserverProcess,
) -> int:
    sb = sbx.create(
        policy,
        opts.pools,
        opts.uplink_netns,
        plan.uid_range,
        lambda sandbox_id: journal.sandbox(sandbox_id) is not None,
    )
    if plan.named is not None:
        who = plan.named
    else:
        assert sb.uid is not None
        who = workload.allocated_user(sb.id, sb.uid)
    result = RunResult(sb.id, kept=opts.keep, workdir=plan.workdir, env_names=sorted(plan.env))
    result.timings_ms["create"] = round(sb.created_s * 1000, 2)
    result.timings_ms.update({f"create_{k}": v for k, v in sb.create_steps_ms.items()})
    try:
        journal.record_sandbox(
            sb.id,
            policy.name,
            netns=sb.netns,
            cgroup=sb.cgroup.v2_path,
            inline_pid=os.getpid(),
            owner_pid=os.getpid(),
            policy_sha256=opts.policy_sha256,
            uid=who.uid,
        )
        observer.begin(sb.id, sb.netns)
        journal.set_sandbox_state(sb.id, SandboxState.RUNNING, observer_pid=observer.pid)
        asyncio.run(_serve(sb, opts, who, plan, journal, observer, result))
    finally:
        _shield_teardown()
        # Each step on its own: one failing must not skip the teardown or the report.
        with contextlib.suppress(Exception):
            observer.stop()
        with contextlib.suppress(Exception):
            _collect(sb, journal, result)
        try:
            _finish(sb, opts, result)
        finally:
            if not opts.keep:
                with contextlib.suppress(EgressError):
                    journal.set_sandbox_state(sb.id, SandboxState.EXITED)
            if opts.report and plan.report_dir is not None:
                _write_report(opts.report, plan.report_dir, result.to_json(policy, opts, who))
    return result.exit_code


# -- signals outside the event loop -----------------------------------------------------

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _stop_on_signals() -> None:
    """Until the event loop forwards signals to the command, a SIGTERM or SIGHUP must
    still tear down what was made, not kill egressctl where it stands."""

    def stop(signum: int, _frame: object) -> None:
        raise Stopped(f"stopped by {signal.Signals(signum).name}; the sandbox was removed")

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)


def _shield_teardown() -> None:
    """Teardown runs to the end: the signals that could cut it short are ignored now."""
    for sig in (*STOP_SIGNALS, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


# -- serving -----------------------------------------------------------------------------


def _upstreams(sb: sbx.Sandbox, opts: RunOptions) -> list[tuple[str, int]]:
    if opts.upstream:
        return [parse_upstream(opts.upstream)]
    return resolve_upstreams(sb.policy.dns.upstreams)


def _review_hint(opts: RunOptions) -> str:
    return f" --state-dir {opts.state_dir}" if opts.state_dir else ""


async def _serve(
    sb: sbx.Sandbox,
    opts: RunOptions,
    who: Identity,
    plan: _Plan,
    journal: Journal,
    observer: ObserverProcess,
    result: RunResult,
) -> None:
    loop = asyncio.get_running_loop()
    session, resolver = wiring.make(
        sb, journal, _review_hint(opts), _upstreams(sb, opts), opts.uplink_netns,
        decision_timeout=opts.decision_timeout, commits_off_loop=False,
    )  # fmt: skip
    result.session = session
    observer_fd = os.pidfd_open(observer.pid)

    def observer_gone() -> None:
        loop.remove_reader(observer_fd)
        session.observer_died()

    loop.add_reader(observer_fd, observer_gone)
    watcher: asyncio.Task[None] | None = None
    the_view: view.View | None = None
    collector = Collector(loop)
    try:
        await resolver.start()
        # What start-up made (the policy, the compiled matcher, imports) lives as long as
        # the run: out of the collector's sight, and what serving keeps (cache entries)
        # every second from now on, so a collection while a flow or query waits walks
        # only what was made since; short automatic collections only (egress/collect.py).
        collector.start()
        watcher = loop.create_task(session.watch_frozen())
        procs = sb.cgroup.procs_files
        the_view = view.prepare(sb.id, sb.netns, who, plan.workdir, opts.binds)
        env = workload.build_env(who, plan.env, os.environ)
        started = time.monotonic()
        proc = workload.spawn(sb.id, sb.netns, who, opts.argv, the_view, env, procs)
        result.timings_ms["spawn"] = round((time.monotonic() - started) * 1000, 2)
        result.exit_code = await wait_for_exit(proc.pid, session, signal_to=proc.init_pid)
        proc.popen.returncode = result.exit_code  # reaped already; keep Popen from it
    finally:
        collector.close()
        if the_view is not None:
            the_view.close()
        session.stopping = True
        if watcher is not None:
            watcher.cancel()
        with contextlib.suppress(ValueError, OSError):
            loop.remove_reader(observer_fd)
        os.close(observer_fd)
        await wiring.stop(session, resolver)
        _resolver_counters(resolver, result)


# -- the end -----------------------------------------------------------------------------


def _collect(sb: sbx.Sandbox, journal: Journal, result: RunResult) -> None:
    with contextlib.suppress(EgressError):
        hits = sb.cgroup.limit_hits()  # before teardown removes the cgroup
        result.counters.update(hits)
        said = _limits_said(sb.policy.limits, hits)
        if said:
            print(f"egressctl: {said}", file=sys.stderr)
    with contextlib.suppress(EgressError):
        packets, nbytes = sb.nft.counter("inet", c.TABLE, "dropped")
        dns_packets, _ = sb.nft.counter("inet", c.TABLE, "dns_queries")
        result.counters.update(
            dropped_packets=packets, dropped_bytes=nbytes, dns_packets=dns_packets
        )
    with contextlib.suppress(EgressError):
        rows = journal.violations(sb.id, limit=10_000)
        result.journaled = [_violation_json(r) for r in reversed(rows)]
        freezes = journal.freezes(sb.id, limit=10_000)
        result.frozen = bool(freezes)
        if freezes:
            first = freezes[-1]  # newest first: the last row is the first freeze
            result.freeze_latency_ms = first.get("latency_ms")
            decisions = journal.decisions(sb.id, limit=1)
            if decisions:
                result.outcome = {ReviewAction.RESUME: "resumed", ReviewAction.KILL: "killed"}[
                    decisions[0]["action"]
                ]
    if result.session:
        result.counters["violations"] = result.session.state.seen
        result.counters["violations_not_journaled"] = result.session.state.unjournaled
        result.counters["nflog_overruns"] = result.session.state.overruns
        flows = result.session.flows
        if flows is not None:  # connections bound to names (connect.check_names)
            result.counters["first_bytes_packets"] = flows.packets
            result.counters["flows_passed"] = flows.passed
            result.counters["flows_refused"] = flows.refused
            result.counters["first_bytes_errors"] = flows.errors + flows.listener.verdict_errors
            result.counters["first_bytes_overruns"] = flows.listener.overruns  # dropped: closed


def _limits_said(limits: Limits, hits: dict[str, int]) -> str:
    """Why a workload's fork failed or a process of it was killed, when its limits acted:
    both look like the workload's own fault from inside."""
    said = []
    refused, killed = hits.get("pids_refused", 0), hits.get("oom_kills", 0)
    if refused and limits.pids is not None:
        said.append(f"{refused} fork{'s' * (refused != 1)} refused at spec.limits.pids"
                    f" ({limits.pids})")  # fmt: skip
    if killed and limits.memory is not None:
        said.append(f"{killed} process{'es' * (killed != 1)} killed by the OOM killer"
                    f" (spec.limits.memory {format_size(limits.memory)})")  # fmt: skip
    return "the workload hit its limits: " + "; ".join(said) if said else ""


def _violation_json(row: dict[str, Any]) -> dict[str, Any]:
    out = {
        "class": row["class"],
        "layer": row["layer"],
        "rule": row["rule"],
        "detail": row["detail"],
        "at": row["at"],
        "action": row["action"],
    }
    evidence = row.get("evidence") or {}
    for key in ("flow", "uid", "qname", "qtype"):
        if evidence.get(key) is not None:
            out[key] = evidence[key]
    if row.get("process"):
        out["process"] = row["process"]
    out["detected_by"] = row.get("detected_by") or []
    out["id"] = row["id"]
    return out


def _resolver_counters(resolver: ResolverServer, result: RunResult) -> None:
    stats = resolver.core.stats
    result.counters.update({f"dns_{k}": v for k, v in stats.items()})
    result.counters["set_updates"] = resolver.sets.updates
    result.counters["set_update_failures"] = resolver.sets.failures + resolver.sets.slow
    result.counters["resolver_internal_errors"] = resolver.internal_errors
    result.counters["dns_rate_limited"] = resolver.rate_limited  # spec.dns.rate_limit


def _finish(sb: sbx.Sandbox, opts: RunOptions, result: RunResult) -> None:
    if opts.keep:
        claims.mark_kept(sb.id)  # `egressctl gc` leaves it alone unless it is named
        print(f"egressctl: kept sandbox {sb.id} (netns {sb.netns}); "
              f"`egressctl gc {sb.id}` removes it", file=sys.stderr)  # fmt: skip
        return
    start = time.monotonic()
    sb.destroy()
    result.timings_ms["teardown"] = round((time.monotonic() - start) * 1000, 2)


def _open_report_dir(path: str) -> int:
    """The report's directory, opened before the workload starts: the workload may write
    where the report goes, and must not swap the directory for a symlink meanwhile."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise UsageError(f"--report {path}: {directory}: {exc.strerror}") from None


def _write_report(path: str, dir_fd: int, data: dict[str, object]) -> None:
    """Written by root into a directory the workload's user may own, through the fd
    opened at the start: a fresh temp file (O_EXCL|O_NOFOLLOW, so no planted symlink
    is followed), then an atomic rename within that directory."""
    name = os.path.basename(path)
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=dir_fd)  # fmt: skip
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        raise EgressError(f"--report {path}: {exc.strerror}") from None
