"""What a workload's child does to its priority before exec (sandbox/workload.py), run in a
forked child as ``spawn`` runs it. The end-to-end attacks, from inside a sandbox, are in
privileged/test_sandbox.py and privileged/test_daemon.py; on a host whose root can't raise
RLIMIT_RTPRIO (this VM's can't) the limits are 0 already, so here the calls are recorded."""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Callable

from egress.kernel import oom
from egress.sandbox import workload


def _in_child(act: Callable[[], bytes]) -> bytes:
    """What ``act`` returns, run in a forked child (as ``spawn``'s child runs)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: reports through the pipe, never returns
        code = 1
        try:
            os.close(r)
            os.write(w, act())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return data


def _limits_after_no_priority() -> dict[str, object]:
    def act() -> bytes:
        calls: list[list[object]] = []
        real = resource.setrlimit

        def recording(which: int, limits: tuple[int, int]) -> None:
            calls.append([which, list(limits)])
            real(which, limits)

        resource.setrlimit = recording  # type: ignore[assignment]
        workload.no_priority_above_normal()
        out = {"calls": calls, "rtprio": resource.getrlimit(resource.RLIMIT_RTPRIO),
               "nice": resource.getrlimit(resource.RLIMIT_NICE)}  # fmt: skip
        return json.dumps(out).encode()

    return dict(json.loads(_in_child(act)))


def test_the_workload_can_raise_neither_limit_again() -> None:
    seen = _limits_after_no_priority()
    assert seen["calls"] == [[resource.RLIMIT_RTPRIO, [0, 0]], [resource.RLIMIT_NICE, [0, 0]]]
    assert seen["rtprio"] == [0, 0] and seen["nice"] == [0, 0]


def _oom_score_after_unshelter(inherited: int) -> int:
    def act() -> bytes:
        with open(oom.SELF, "w") as f:
            f.write(str(inherited))
        oom.unshelter()
        with open(oom.SELF) as f:
            return f.read().strip().encode()

    return int(_in_child(act))


def test_the_workload_starts_at_an_oom_score_of_at_least_zero() -> None:
    """Below 0 (what egress's sheltered layers have, and their children inherit) it goes
    to 0; above, it stays where the operator put it."""
    assert _oom_score_after_unshelter(300) == 300
    assert _oom_score_after_unshelter(0) == 0
    if _lowers():  # a process without CAP_SYS_RESOURCE can't get below 0 to begin with
        assert _oom_score_after_unshelter(-999) == 0


def _lowers() -> bool:
    """This process may lower its OOM score (CAP_SYS_RESOURCE): tried in a child."""
    pid = os.fork()
    if pid == 0:
        try:
            with open(oom.SELF, "w") as f:
                f.write("-1")
            os._exit(0)
        except OSError:
            os._exit(1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
