"""`egressctl run`'s command: its exit status awaited on the loop, and the signals the
terminal sends egressctl passed on to it (it has a session of its own)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

from egress.errors import EgressError
from egress.inline.session import Session

FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH)
TERMINAL = (signal.SIGINT, signal.SIGQUIT)


async def wait_for_exit(pid: int, session: Session, signal_to: int | None = None) -> int:
    """The command's exit status (128+N if killed by signal N), forwarding signals to
    ``signal_to`` (the sandbox's PID 1), else to ``pid``."""
    loop = asyncio.get_running_loop()
    pidfd = os.pidfd_open(pid)
    done = loop.create_future()

    def exited() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(pidfd, exited)
    _install_signals(loop, pid if signal_to is None else signal_to, session)
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


def _install_signals(loop: asyncio.AbstractEventLoop, pid: int, session: Session) -> None:
    interrupts = [0]

    def forward(sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def terminal(sig: signal.Signals) -> None:
        interrupts[0] += 1
        if interrupts[0] > 1 or session.sb.cgroup.is_frozen():
            # A second Ctrl-C, or one while frozen (a frozen task can't take it): end it
            # all, journaled like any other kill.
            with contextlib.suppress(EgressError, OSError):
                session.kill(f"{sig.name} at egressctl run")
            return
        # The command has its own session (no controlling terminal: it can't inject
        # input into ours or take it over), so the terminal's signals reach it only
        # through us.
        forward(sig)
        print(
            f"egressctl: {sig.name} passed to the command; again to kill the sandbox",
            file=sys.stderr,
            flush=True,
        )

    for sig in FORWARDED:
        loop.add_signal_handler(sig, forward, sig)
    for sig in TERMINAL:
        loop.add_signal_handler(sig, terminal, sig)
