"""What a workload runs to take the host's tasks: fork until refused, stopping itself at
256 (a test must fail, not take the machine, on a build without limits)."""

from __future__ import annotations

FORK_BOMB = """if 1:
    import os, signal, time
    kids, why = [], None
    while len(kids) < 256:
        try:
            pid = os.fork()
        except OSError as exc:
            why = exc.errno
            break
        if pid == 0:
            time.sleep(120)
            os._exit(0)
        kids.append(pid)
    for pid in kids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    print(len(kids), why)
"""


def forked(stdout: str) -> tuple[int, int | None]:
    """What FORK_BOMB printed: how many it forked, and the errno that stopped it."""
    count, why = stdout.split()
    return int(count), None if why == "None" else int(why)
