"""Scheduling policy: egress's processes run under the normal scheduler, never real-time;
egressd's session weighs as egressd does, where the kernel schedules by session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REALTIME = (os.SCHED_FIFO, os.SCHED_RR)


def leave_realtime(who: str) -> None:
    """Back to the normal scheduler if started real-time (``chrt -f``, systemd's
    ``CPUSchedulingPolicy=fifo`` or ``rr``), and say so. Called before any thread or
    child starts, which then inherit it (a policy is per thread).

    What a freeze and a set update wait on runs at normal priority: each task of the
    cgroup being frozen must get a CPU to stop, and the kernel's own work (workqueues,
    softirq processing) runs in threads of normal priority. A busy real-time egressd
    keeps them off its CPU: at 1,000 sandboxes and 5,000 queries/s on 2 vCPUs, under
    SCHED_FIFO 10, freezes during the load were not confirmed within 5 s (2 runs of 2; at
    nice -10 every freeze of 3 runs was, p99 9-15 ms), and an egressd whose load had
    stopped was found 15 minutes later still busy in a set update, the host at 100%
    system time. Started by ``egressctl run``, a workload would inherit it too.

    A reset-on-fork flag is cleared if this process may (it would also reset egressd's
    nice -10 in every thread and child it starts), else kept."""
    found = None
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError as exc:
        print(f"{who}: cannot read its threads' scheduling ({exc.strerror})", file=sys.stderr)
        return
    for tid in tasks:
        try:
            policy = os.sched_getscheduler(int(tid))
            base = policy & ~os.SCHED_RESET_ON_FORK
            if base in REALTIME:
                _to_normal(int(tid), policy & os.SCHED_RESET_ON_FORK)
                found = base
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
        except OSError as exc:
            print(f"{who}: stays real-time ({exc.strerror}): its freezes may go unconfirmed "
                  "(drop chrt or CPUSchedulingPolicy)", file=sys.stderr, flush=True)  # fmt: skip
            return
    if found is not None:
        name = "SCHED_FIFO" if found == os.SCHED_FIFO else "SCHED_RR"
        print(f"{who}: started {name}, now SCHED_OTHER: real-time keeps from a CPU what its "
              "freezes wait on (drop chrt or CPUSchedulingPolicy)", file=sys.stderr,
              flush=True)  # fmt: skip


def _to_normal(tid: int, reset_on_fork: int) -> None:
    try:
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    except PermissionError:
        if not reset_on_fork:
            raise
        # Only a process with CAP_SYS_NICE may clear the flag.
        os.sched_setscheduler(tid, os.SCHED_OTHER | reset_on_fork, os.sched_param(0))


AUTOGROUPS = Path("/proc/sys/kernel/sched_autogroup_enabled")
AUTOGROUP = Path("/proc/self/autogroup")


def autogroups_on() -> bool:
    """Whether this kernel schedules tasks by session (autogroups)."""
    try:
        return AUTOGROUPS.read_text().strip() == "1"
    except OSError:
        return False  # built without them


def session_nice(pid: int | None = None) -> int:
    """The nice of ``pid``'s session (its autogroup), this process's by default; OSError,
    ValueError or IndexError where the kernel keeps none for it."""
    path = AUTOGROUP if pid is None else Path(f"/proc/{pid}/autogroup")
    return int(path.read_text().split()[-1])  # "/autogroup-12 nice 0"


def raise_session_group(who: str, nice: int) -> bool:
    """Give this process's session the same ``nice`` as the process, where the kernel
    schedules by session: with autogroups on (Debian's default) and no cgroup CPU
    controller over it, a process's nice weighs only against its own session's; against
    every other session's tasks (a sandbox's workload, any service: systemd starts each
    in a session of its own) its session weighs as nice 0. At 1,000 sandboxes and 5,000
    queries/s, egressd's loop thread had its CPU taken 759 times a second while it had
    work, and waited 187 ms a second for one; with its session at -10, 237 times and
    106 ms (bench/bench_egressd.py).

    Only when this process leads its session (a service, ``setsid``): started from a
    shell, the session is the shell's, and raising it would raise everything run there.
    Where a cgroup CPU controller is over it, the kernel weighs its cgroup instead (the
    unit's CPUWeight=). True when its session is at ``nice`` now, or favoured more."""
    if not autogroups_on() or os.getsid(0) != os.getpid():
        return False
    try:
        if session_nice() <= nice:
            return True
    except (OSError, ValueError, IndexError):
        return False  # no group of its own here (init's)
    try:
        AUTOGROUP.write_text(str(nice))
    except OSError as exc:  # no CAP_SYS_NICE (a user namespace)
        print(f"{who}: its session stays at its nice ({exc.strerror}): under load, other "
              "sessions' tasks take its CPU as often as it gets it", file=sys.stderr,
              flush=True)  # fmt: skip
        return False
    return True
