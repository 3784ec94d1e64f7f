"""egress.kernel.cgroup against the kernel: freeze really stops the workload, kill reaps.

The workload is a child that writes one byte to a pipe every millisecond: "stopped" means
the pipe stays silent, which the test observes without sleeping blindly.
"""

from __future__ import annotations

import contextlib
import os
import select
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from egress.errors import SandboxError
from egress.freeze.enforcer import Enforcer, FreezeEvent
from egress.kernel import cgroup as cg_mod
from egress.kernel.cgroup import Cgroup, find_mounts, parse_mountinfo
from egress.model import Action, Flow, Limits, Policy, Violation, ViolationClass
from egress.policy import parse_policy
from egress.sandbox.lifecycle import _remove_cgroup
from egress.sandbox.workload import join_cgroups
from egress.store import intents
from egress.store.journal import Journal
from tests.support import SYSTEM_PYTHON
from tests.support.probes import wait_until

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.usefixtures("require_root"),
]

PARENT = f"egress-test-{os.getpid()}"
TICKER = "import os, time\nwhile True:\n    os.write(1, b'.')\n    time.sleep(0.001)\n"
HAS_V1 = find_mounts().freezer is not None
RACE_POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: race}
spec:
  dns: {upstreams: ["198.51.100.53"], allow: []}
  violations: {blocked_connect: freeze}
"""
needs_v1 = pytest.mark.skipif(not HAS_V1, reason="no v1 freezer hierarchy on this machine")


@pytest.fixture(scope="module", autouse=True)
def parent_dirs() -> Iterator[None]:
    yield
    mounts = find_mounts()
    for root in (mounts.v2, mounts.freezer, mounts.cpu, mounts.pids, mounts.memory):
        if root is not None:
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(os.path.join(root, PARENT))


@pytest.fixture
def make_cgroup() -> Iterator[Callable[[], Cgroup]]:
    made: list[Cgroup] = []

    def make() -> Cgroup:
        made.append(Cgroup.create(f"cg{len(made)}", parent=PARENT))
        return made[-1]

    yield make
    for cg in made:
        cg.kill()
        cg.remove()


@pytest.fixture
def ticker() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", TICKER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        yield proc
    finally:
        # A v1-frozen task ignores SIGKILL: thaw it first or wait() would hang forever.
        _thaw_v1(proc.pid)
        proc.kill()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


@pytest.fixture
def cg(make_cgroup: Callable[[], Cgroup], ticker: subprocess.Popen[bytes]) -> Cgroup:
    """A cgroup with the ticker in it."""
    made = make_cgroup()
    made.add_pid(ticker.pid)
    return made


def _thaw_v1(pid: int) -> None:
    freezer = find_mounts().freezer
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if freezer is not None and "freezer" in controllers.split(",") and path != "/":
            with open(os.path.join(freezer, path.lstrip("/"), "freezer.state"), "w") as f:
                f.write("THAWED")


def drain(proc: subprocess.Popen[bytes]) -> int:
    assert proc.stdout is not None
    total = 0
    while True:
        try:
            chunk = os.read(proc.stdout.fileno(), 65536)
        except BlockingIOError:
            return total
        if not chunk:
            return total
        total += len(chunk)


def ticks_within(proc: subprocess.Popen[bytes], seconds: float) -> bool:
    """True as soon as the child writes again; False if silent for `seconds`."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], seconds)
    return bool(ready)


def assert_stopped(proc: subprocess.Popen[bytes]) -> None:
    drain(proc)  # bytes written before the freeze was confirmed
    assert not ticks_within(proc, 0.2), "workload still runs while frozen"


def test_mounts_are_discovered() -> None:
    mounts = find_mounts()
    assert mounts.v2 is not None
    assert os.path.isfile(os.path.join(mounts.v2, "cgroup.procs"))
    if mounts.freezer is not None:
        # the root of a v1 hierarchy has no freezer.state: it cannot be frozen
        assert os.path.isfile(os.path.join(mounts.freezer, "freezer.self_freezing")) or (
            os.path.isfile(os.path.join(mounts.freezer, "cgroup.procs"))
        )


def test_parse_mountinfo() -> None:
    text = (
        "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
        "37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer\n"
        "41 31 0:38 / /sys/fs/cgroup/uni\\040fied rw shared:9 - cgroup2 cgroup2 rw\n"
    )
    mounts = parse_mountinfo(text)
    assert mounts.v2 == "/sys/fs/cgroup/uni fied"
    assert mounts.freezer == "/sys/fs/cgroup/freezer"
    assert mounts.cpu is None
    hybrid = parse_mountinfo(text + (
        "34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset\n"
        "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
        "38 31 0:35 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids\n"
        "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    ))  # fmt: skip
    assert hybrid.cpu == "/sys/fs/cgroup/cpu,cpuacct" and hybrid.freezer == mounts.freezer
    assert (hybrid.pids, hybrid.memory) == ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/memory")
    assert mounts.pids is None and mounts.memory is None
    pure = parse_mountinfo("30 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n")
    assert pure.v2 == "/sys/fs/cgroup" and pure.freezer is None and pure.cpu is None
    shared = parse_mountinfo(text.replace("rw,freezer", "rw,freezer,pids,memory"))
    assert shared.freezer == shared.pids == shared.memory == "/sys/fs/cgroup/freezer"


def test_freeze_stops_thaw_resumes_kill_reaps_remove_cleans(
    cg: Cgroup, ticker: subprocess.Popen[bytes]
) -> None:
    assert cg.pids() == [ticker.pid]
    assert ticks_within(ticker, 2)
    latency = cg.freeze()
    assert 0 <= latency < 2
    assert cg.is_frozen()
    assert_stopped(ticker)
    cg.thaw()
    assert not cg.is_frozen()
    assert cg.v1_state() in (None, "THAWED")
    drain(ticker)
    assert ticks_within(ticker, 2)
    cg.freeze()
    cg.kill()
    assert ticker.wait(timeout=5) == -9
    assert cg.pids() == []
    cg.remove()
    assert not os.path.exists(cg.v2_path)
    assert cg.freezer_path is None or not os.path.exists(cg.freezer_path)
    assert cg.cpu_path is None or not os.path.exists(cg.cpu_path)
    cg.remove()  # idempotent
    cg.kill()  # nothing left: no error


def test_ask_freeze_freezes_without_waiting_for_it(
    cg: Cgroup, ticker: subprocess.Popen[bytes]
) -> None:
    """What a thaw under the journal's lock uses to undo itself: the writes alone."""
    assert ticks_within(ticker, 2)
    cg.ask_freeze()
    assert wait_until(cg.is_frozen, 5)  # polled to a deadline: the kernel's stop, not a guess
    assert_stopped(ticker)
    cg.thaw()


def test_a_freeze_already_asked_is_waited_for_not_asked_again(
    cg: Cgroup, ticker: subprocess.Popen[bytes]
) -> None:
    """``freeze(asked=True)`` (after freeze_soon, whose look was too short) writes nothing
    at first: it waits for the ask made. Given none, it asks only once the first
    attempt's share of its timeout is up; given one, it returns once that one lands."""
    started = time.monotonic()
    cg.freeze(timeout=0.6, asked=True)  # nothing asked before: the second attempt asks
    assert time.monotonic() - started >= 0.2
    assert_stopped(ticker)
    cg.thaw()
    assert ticks_within(ticker, 2)
    cg._v2_confirm_soon = lambda: None  # type: ignore[method-assign]  # never in time
    assert cg.freeze_soon() is None
    del cg._v2_confirm_soon
    started = time.monotonic()
    cg.freeze(timeout=6.0, asked=True)
    assert time.monotonic() - started < 2.0  # its ask landed: not the second attempt's
    assert_stopped(ticker)


def test_v2_freezer_alone_stops(cg: Cgroup, ticker: subprocess.Popen[bytes]) -> None:
    cg.freeze(v1=False)
    assert cg.v2_frozen()
    assert cg.v1_state() in (None, "THAWED")
    assert_stopped(ticker)
    cg.thaw()
    assert ticks_within(ticker, 2)


@needs_v1
def test_v1_freezer_alone_stops(cg: Cgroup, ticker: subprocess.Popen[bytes]) -> None:
    cg.freeze(v2=False)
    assert cg.v1_state() == "FROZEN"
    assert not cg.v2_frozen()
    assert_stopped(ticker)
    cg.thaw()
    drain(ticker)
    assert ticks_within(ticker, 2)


@needs_v1
def test_v1_frozen_task_never_reports_v2_frozen(cg: Cgroup) -> None:
    """Kernel fact the freeze order relies on; also exercises the timeout path."""
    cg.freeze(v2=False)
    with pytest.raises(SandboxError, match="did not freeze in time"):
        cg.freeze(v1=False, timeout=0.2)
    assert cg.is_frozen()  # still stopped by v1
    cg.thaw()
    assert not cg.is_frozen()


@needs_v1
def test_kill_reaps_a_v1_frozen_workload(cg: Cgroup, ticker: subprocess.Popen[bytes]) -> None:
    cg.freeze(v2=False)  # a v1-frozen task ignores SIGKILL until thawed
    cg.kill()
    assert ticker.wait(timeout=5) == -9
    assert cg.pids() == []


def test_freeze_asks_every_selected_hierarchy_before_it_returns(
    cg: Cgroup, ticker: subprocess.Popen[bytes]
) -> None:
    """v2 confirms first and v1 is asked after that moment: both are asked all the same."""
    assert ticks_within(ticker, 2)
    assert 0 <= cg.freeze() < 2
    with open(os.path.join(cg.v2_path, "cgroup.freeze")) as f:
        assert f.read().strip() == "1"
    if HAS_V1:
        assert cg.v1_state() in ("FREEZING", "FROZEN")
    assert_stopped(ticker)
    cg.thaw()
    assert ticks_within(ticker, 2)


@dataclass
class Race:
    """A sandbox "sb1" for the freeze races: its cgroup (the ticker in it), policy, and
    journal (in ``state``)."""

    cg: Cgroup
    policy: Policy
    journal: Journal
    state: Path


@pytest.fixture
def race(cg: Cgroup, tmp_path: Path) -> Iterator[Race]:
    policy, _ = parse_policy(RACE_POLICY, "<test>")
    state = tmp_path / "state"
    journal = Journal.open(state)
    try:
        journal.record_sandbox("sb1", policy.name)
        yield Race(cg, policy, journal, state)
    finally:
        cg.thaw()
        journal.close()


def race_violation(layer: str) -> Violation:
    flow = Flow("udp", "10.0.0.2", "203.0.113.99", 40000, 1001)
    return Violation(cls=ViolationClass.BLOCKED_CONNECT, layer=layer, rule="default deny",
                     detail="udp to 203.0.113.99:1001", at=time.time(), action=Action.FREEZE,
                     flow=flow)  # fmt: skip


def after_each_ask(cg: Cgroup, before: Callable[[], object], after: Callable[[], object]) -> None:
    """``before`` each freeze a layer asks of ``cg`` (``freeze``, or ``freeze_soon`` on
    the intent path), ``after`` once the kernel confirmed it (a freeze_soon whose look
    missed it is waited for here, then reported as missed: finish waits again, at once,
    with ``freeze(asked=True)``, which waits for that same ask: not a freeze asked again,
    so no ``before``; on a busy host the look misses, and it was counted as one)."""
    real_freeze, real_soon = cg.freeze, cg.freeze_soon
    # The missed look's ask, already waited for and ``after``-ed here: finish's wait for
    # that same ask must not run ``after`` again (a lock taken twice raised in SQLite).
    reported = [False]

    def hooked(*args: Any, **kwargs: Any) -> float:
        asked = bool(kwargs.get("asked"))
        if not asked:
            before()
        took = real_freeze(*args, **kwargs)
        if asked and reported[0]:
            reported[0] = False
        else:
            after()
        return took

    def hooked_soon() -> float | None:
        before()
        soon = real_soon()
        if soon is None:
            real_freeze(asked=True)
            reported[0] = True
        after()
        return soon

    cg.freeze = hooked  # type: ignore[method-assign]
    cg.freeze_soon = hooked_soon  # type: ignore[method-assign]


def resume_before_each_freeze(race: Race) -> None:
    """A person resumes the sandbox's open freeze just before each cgroup write lands."""
    resume = lambda: race.journal.record_decision("sb1", "resume", 0, time.time(), "a person")  # noqa: E731
    after_each_ask(race.cg, resume, lambda: None)


def test_a_layers_freeze_landing_after_a_resume_of_it_is_undone(
    race: Race, ticker: subprocess.Popen[bytes]
) -> None:
    """The race bench_deployed hung on: the other layer froze for the violation, a person
    resumed, and only then this layer's freeze (its record committed before the resume)
    reached the cgroup. It must not leave the sandbox frozen with nothing to decide."""
    journal = race.journal
    resume_before_each_freeze(race)
    # The path where the record is committed to SQLite before the freeze.
    enforcer = Enforcer("sb1", race.policy, "observer", journal, race.cg, intents=False)
    assert enforcer.handle(race_violation("observer")) is None
    assert not race.cg.is_frozen()
    assert ticks_within(ticker, 2)
    [freeze] = journal.freezes("sb1")
    assert freeze["decision_id"] is not None and freeze["confirmed_at"] is not None
    [ask] = freeze["requested_by"]
    assert ask["layer"] == "observer" and ask["thawed_at"] >= ask["confirmed_at"]
    assert journal.sandbox("sb1")["state"] == "running"  # type: ignore[index]


def test_the_intent_is_on_disk_before_the_freeze_and_in_sqlite_after(
    race: Race, ticker: subprocess.Popen[bytes]
) -> None:
    """Journal before act through the intent file: when the cgroup is asked to freeze, the
    violation is in this process's intent file on disk (read through a descriptor of
    its own), not yet in SQLite; once handle returns, SQLite holds it, frozen and
    confirmed, and the slot is free again."""
    journal, state = race.journal, race.state
    seen: list[tuple[list[dict[str, object]], int]] = []

    def looked_first() -> None:
        [path] = (state / intents.DIR).glob("*.log")
        found = [r for _, r in intents.records(path.read_bytes())]
        seen.append((found, len(journal.violations("sb1"))))

    after_each_ask(race.cg, looked_first, lambda: None)
    enforcer = Enforcer("sb1", race.policy, "observer", journal, race.cg)
    v = race_violation("observer")
    event = enforcer.handle(v)
    assert event is not None and race.cg.is_frozen()
    assert_stopped(ticker)
    [(found, in_sqlite)] = seen
    assert in_sqlite == 0
    assert [r["sandbox_id"] for r in found] == ["sb1"]
    assert Violation.from_json(found[0]["violation"]) == v  # type: ignore[arg-type]
    [row] = journal.violations("sb1")
    assert row["id"] == event.violation_id and row["key"] == str(v.flow)
    [freeze] = journal.freezes("sb1")
    assert freeze["first_violation"] == row["id"] and freeze["confirmed_at"] is not None
    assert journal.sandbox("sb1")["state"] == "frozen"  # type: ignore[index]
    journal.close()
    assert list((state / intents.DIR).iterdir()) == []  # all folded: the file went at close
    with Journal.open(state) as again:
        assert len(again.violations("sb1")) == 1 and len(again.freezes("sb1")) == 1


def test_a_freeze_begun_is_made_before_any_commit_and_finished_on_another_thread(
    race: Race, ticker: subprocess.Popen[bytes]
) -> None:
    """egressd's split (Enforcer.begin on its loop, finish on a writer thread): once begin
    returns, the freeze is asked and SQLite holds nothing yet; finish, on another thread,
    commits the violation and the kernel's confirmation (begin's, if its look saw it)."""
    journal = race.journal
    enforcer = Enforcer("sb1", race.policy, "observer", journal, race.cg)
    v = race_violation("observer")
    begun = enforcer.begin(v)
    assert begun is not None and begun.error is None
    with open(os.path.join(race.cg.v2_path, "cgroup.freeze")) as asked:
        assert asked.read().strip() == "1"
    assert wait_until(race.cg.is_frozen, 5)
    assert_stopped(ticker)
    assert journal.violations("sb1") == [] and journal.freezes("sb1") == []
    events: list[FreezeEvent | None] = []
    finisher = threading.Thread(target=lambda: events.append(enforcer.finish(v, begun)))
    finisher.start()
    finisher.join(timeout=30)
    [event] = events
    assert event is not None and race.cg.is_frozen()
    [freeze] = journal.freezes("sb1")
    assert freeze["confirmed_at"] is not None and freeze["confirmed_at"] >= begun.asked
    if begun.confirmed is not None:
        assert freeze["confirmed_at"] == pytest.approx(begun.confirmed, abs=1e-6)
    assert freeze["first_violation"] == event.violation_id


def test_a_freeze_begun_whose_confirmation_is_slow_is_waited_for_by_finish(
    race: Race, ticker: subprocess.Popen[bytes]
) -> None:
    """begin asks the freeze and looks for its confirmation only briefly (a workload slow
    to stop must not hold egressd's loop): without it, begin returns unconfirmed with the
    freeze asked, and finish waits for the kernel's confirmation, then journals it."""
    race.cg._v2_confirm_soon = lambda: None  # type: ignore[method-assign]  # never in time
    enforcer = Enforcer("sb1", race.policy, "observer", race.journal, race.cg)
    v = race_violation("observer")
    begun = enforcer.begin(v)
    assert begun is not None and begun.error is None and begun.confirmed is None
    assert begun.confirming is None  # no confirmer given: finish waits
    with open(os.path.join(race.cg.v2_path, "cgroup.freeze")) as asked:
        assert asked.read().strip() == "1"
    written: list[str] = []
    real_write = cg_mod._write
    cg_mod._write = lambda path, value: written.append(path) or real_write(path, value)  # type: ignore[assignment]
    try:
        event = enforcer.finish(v, begun)
    finally:
        cg_mod._write = real_write
    # Not asked again (v1 may be: Cgroup._wait's ask of a task still FREEZING in v1).
    assert not [w for w in written if w.endswith("cgroup.freeze")], written
    assert event is not None and race.cg.is_frozen()
    assert_stopped(ticker)
    [freeze] = race.journal.freezes("sb1")
    assert freeze["confirmed_at"] is not None and freeze["confirmed_at"] >= begun.asked


def test_a_freeze_begun_with_a_confirmer_is_confirmed_before_finish_runs(
    race: Race, ticker: subprocess.Popen[bytes]
) -> None:
    """egressd's loop hands the wait begin's look did not finish to a confirmer thread:
    the kernel's confirmation is read there while finish has not run (its writer may be
    committing something else for seconds), and finish journals that moment. A second
    flow's freeze asked while that wait is pending shares it: one wait a sandbox."""
    race.cg._v2_confirm_soon = lambda: None  # type: ignore[method-assign]  # never in time
    enforcer = Enforcer("sb1", race.policy, "observer", race.journal, race.cg)
    v, w = race_violation("observer"), newer_violation()
    held = threading.Event()
    with ThreadPoolExecutor(1) as confirmer:
        confirmer.submit(held.wait, 10)  # the one thread busy: the confirmation waits
        begun = enforcer.begin(v, confirmer)
        assert begun is not None and begun.confirmed is None and begun.confirming is not None
        second = enforcer.begin(w, confirmer)
        assert second is not None and second.confirming is begun.confirming
        held.set()
        confirmed = begun.confirming.result(timeout=10)
        assert race.cg.is_frozen() and race.journal.freezes("sb1") == []
        assert_stopped(ticker)
        time.sleep(0.05)  # finish comes later: the moment journaled is the confirmer's
        event = enforcer.finish(v, begun)
        assert enforcer.finish(w, second) is not None
    assert event is not None
    [freeze] = race.journal.freezes("sb1")  # one freeze, both flows' detections
    assert freeze["confirmed_at"] == pytest.approx(confirmed, abs=1e-6)
    assert begun.asked < confirmed < time.time() - 0.05


def test_let_go_of_thaws_an_earlier_binding_above_or_below_and_nothing_else(
    cg: Cgroup, make_cgroup: Callable[[], Cgroup], ticker: subprocess.Popen[bytes]
) -> None:
    """A binding found to hold an earlier one (a pod's cgroup and a container's inside):
    the inner one's own freeze is thawed, and the workload there stays stopped by the
    outer one's; the other way (narrowed to the container), the pod's own freeze is
    thawed and the container's holds. A cgroup elsewhere (a sibling) is left frozen."""
    made = [os.path.join(p, "inner") for p in (cg.v2_path, cg.freezer_path) if p]
    for path in made:
        os.mkdir(path)
    inner = Cgroup.attach_existing(made[0], made[1] if len(made) > 1 else None)
    sibling = make_cgroup()
    try:
        inner.add_pid(ticker.pid)
        inner.freeze()
        cg.freeze()
        sibling.freeze()
        assert cg.let_go_of(inner.v2_path, inner.freezer_path) == made
        with open(os.path.join(inner.v2_path, "cgroup.freeze")) as own:
            assert own.read().strip() == "0"
        if inner.freezer_path is not None:
            with open(os.path.join(inner.freezer_path, "freezer.self_freezing")) as own:
                assert own.read().strip() == "0"
        assert inner.is_frozen()
        assert_stopped(ticker)
        assert cg.let_go_of(sibling.v2_path, sibling.freezer_path) == []
        assert sibling.is_frozen()
        cg.thaw()
        assert ticks_within(ticker, 2)  # nothing of the inner freeze left standing
        # Narrowed: the pod's cgroup frozen before, the container's now.
        cg.freeze()
        inner.freeze()
        outer = [p for p in (cg.v2_path, cg.freezer_path) if p]
        assert inner.let_go_of(cg.v2_path, cg.freezer_path) == outer
        assert not (cg.v2_frozen() or cg.v1_state() == "FROZEN")
        assert_stopped(ticker)  # the container's own freeze
        inner.thaw()
        assert ticks_within(ticker, 2)
    finally:
        for frozen in (cg, inner, sibling):
            frozen.thaw(wait=False)
        cg.add_pid(ticker.pid)
        for path in reversed(made):
            os.rmdir(path)


def test_a_freeze_whose_ask_failed_is_made_on_the_binding_found_since(
    race: Race, make_cgroup: Callable[[], Cgroup], ticker: subprocess.Popen[bytes]
) -> None:
    """begin's ask of its binding fails (a container's cgroup gone with a restart, the
    workload's processes elsewhere now): finish looks for the cgroup again, as each new
    freeze does (found here by a stand-in for the netns's discovery), and freezes the
    one they are in: the sandbox is frozen, and the flow seen again is a sighting."""
    now_in = make_cgroup()
    now_in.add_pid(ticker.pid)
    cg = race.cg
    paths = (cg.v2_path, cg.freezer_path)

    def gone() -> float | None:
        raise SandboxError(f"{cg.v2_path}/cgroup.freeze: No such file or directory")

    def found_since(refresh: bool = False) -> bool:
        cg.v2_path, cg.freezer_path = now_in.v2_path, now_in.freezer_path
        return True

    cg.freeze_soon = gone  # type: ignore[method-assign]
    cg.bind = found_since  # type: ignore[method-assign]
    try:
        enforcer = Enforcer("sb1", race.policy, "observer", race.journal, cg)
        v = race_violation("observer")
        begun = enforcer.begin(v)
        assert begun is not None and isinstance(begun.error, SandboxError)
        event = enforcer.finish(v, begun)
        assert event is not None and now_in.is_frozen()
        assert_stopped(ticker)
        assert enforcer.seen_before(race_violation("observer"))
        [freeze] = race.journal.freezes("sb1")
        assert freeze["confirmed_at"] is not None
    finally:
        del cg.freeze_soon, cg.bind  # the class's again, for the fixtures' cleanup
        now_in.thaw()
        cg.v2_path, cg.freezer_path = paths


def test_a_freeze_failing_after_its_intent_is_committed_and_tried_again(
    race: Race, ticker: subprocess.Popen[bytes]
) -> None:
    """The cgroup write fails once the intent is durable: finish still commits the
    violation (the evidence stands), then raises; the same flow seen again is not a mere
    sighting of a freeze that never was: it freezes."""
    journal = race.journal
    tries: list[float] = []

    def fails_first() -> None:
        tries.append(time.time())
        if len(tries) == 1:
            raise SandboxError("cgroup.freeze: No such file or directory")

    after_each_ask(race.cg, fails_first, lambda: None)
    enforcer = Enforcer("sb1", race.policy, "observer", journal, race.cg)
    v = race_violation("observer")
    begun = enforcer.begin(v)
    assert begun is not None and isinstance(begun.error, SandboxError)
    with pytest.raises(SandboxError, match="No such file"):
        enforcer.finish(v, begun)
    [row] = journal.violations("sb1")
    assert row["class"] == "blocked_connect" and not race.cg.is_frozen()
    event = enforcer.handle(race_violation("observer"))  # the same flow, again
    assert event is not None and race.cg.is_frozen() and len(tries) == 2
    assert_stopped(ticker)


def test_a_freeze_from_an_intent_after_a_resume_of_the_violation_is_undone(
    race: Race, ticker: subprocess.Popen[bytes]
) -> None:
    """The race above on the intent path: the inline layer recorded the violation and its
    freeze, a person resumed it, and the observer, whose intent was written before the
    decision, froze after it. Its record finds the decision when it is folded in: its
    request joins that freeze, marked thawed, and the sandbox runs."""
    journal = race.journal
    vid, _, fid = journal.record_for_freeze("sb1", race_violation("inline"), 2.0, time.time())
    resume_before_each_freeze(race)
    enforcer = Enforcer("sb1", race.policy, "observer", journal, race.cg)
    assert enforcer.handle(race_violation("observer")) is None
    assert not race.cg.is_frozen()
    assert ticks_within(ticker, 2)
    [freeze] = journal.freezes("sb1")
    assert freeze["id"] == fid and freeze["decision_id"] is not None
    asks = {a["layer"]: a for a in freeze["requested_by"]}
    assert set(asks) == {"inline", "observer"}
    assert asks["observer"]["violation_id"] == vid
    assert asks["observer"]["thawed_at"] >= asks["observer"]["at"]
    [row] = journal.violations("sb1")
    assert {d["layer"] for d in row["detected_by"]} == {"inline", "observer"}
    assert journal.sandbox("sb1")["state"] == "running"  # type: ignore[index]


def newer_violation() -> Violation:
    """A violation of another flow than race_violation's: a freeze of its own."""
    return replace(race_violation("observer"), flow=Flow("tcp", "10.0.0.2", "203.0.113.98",
                   40001, 443), detail="tcp to 203.0.113.98:443")  # fmt: skip


class LateThaw:
    """The inline layer settling a freeze a person resumed (thaw_if_resumed, on a journal
    of its own, in a thread), whose look for open freezes and pending intents comes
    before the observer's intent is written, and whose thaw lands after the observer's
    freeze: ``run`` starts it and returns once it has looked; ``landed`` (called from the
    observer's freeze) lets its thaw land and waits for it and its commit."""

    def __init__(self, race: Race, resumed: int) -> None:
        self.journal = Journal.open(race.state)
        self.cg = race.cg
        self.resumed = resumed
        self.looked = threading.Event()
        self.froze = threading.Event()
        self.result: list[bool] = []
        self.thread = threading.Thread(target=self._settle)

    def _thaw(self) -> None:
        self.looked.set()
        assert self.froze.wait(30)
        self.cg.thaw(wait=False)

    def _settle(self) -> None:
        self.result.append(self.journal.thaw_if_resumed(self.resumed, "inline", self._thaw))

    def run(self) -> None:
        self.thread.start()
        assert self.looked.wait(30)

    def landed(self) -> None:
        self.froze.set()
        self.thread.join(30)
        assert not self.thread.is_alive()

    def close(self) -> None:
        self.froze.set()
        self.thread.join(30)
        self.journal.close()


@pytest.fixture
def late_thaw(race: Race) -> Iterator[LateThaw]:
    """A freeze of an older violation a person resumed, and the inline layer late for it."""
    _, _, resumed = race.journal.record_for_freeze("sb1", race_violation("inline"), 2.0,
                                                   time.time())  # fmt: skip
    assert resumed is not None
    race.journal.record_decision("sb1", "resume", 0, time.time(), "a person")
    late = LateThaw(race, resumed)
    try:
        yield late
    finally:
        late.close()


def test_a_freeze_from_an_intent_thawed_before_its_commit_is_made_again(
    race: Race, late_thaw: LateThaw, ticker: subprocess.Popen[bytes]
) -> None:
    """The observer froze for a new violation from its intent; the inline layer, settling
    an older freeze a person had resumed, had looked before that intent was written and
    found nothing open, and its thaw landed after the observer's freeze. Once its commit
    returns the observer looks again and freezes again: the sandbox never runs with a
    freeze open and confirmed."""
    journal, cg = race.journal, race.cg
    after_each_ask(cg, lambda: None, late_thaw.landed)
    late_thaw.run()
    event = Enforcer("sb1", race.policy, "observer", journal, cg).handle(newer_violation())
    assert late_thaw.result == [True]  # the thaw did come between the freeze and the commit
    assert event is not None
    assert cg.is_frozen()
    assert_stopped(ticker)
    new, _ = journal.freezes("sb1")
    assert new["decision_id"] is None and new["confirmed_at"] is not None
    assert journal.sandbox("sb1")["state"] == "frozen"  # type: ignore[index]


def test_a_freeze_thawed_before_sqlite_refused_its_commit_is_made_again_and_kept(
    race: Race, late_thaw: LateThaw, ticker: subprocess.Popen[bytes]
) -> None:
    """The same late thaw, and then SQLite refuses the observer's commit (its lock held
    past the busy timeout): the observer freezes again all the same, its record pinned in
    its intent file; a further late thaw finds it pending there and leaves the sandbox
    frozen; once SQLite takes the observer's next record, the pinned one is taken too,
    its freeze open there."""
    observer = Journal.open(race.state, busy_timeout_s=0.5)
    holder = sqlite3.connect(race.state / "journal.db", isolation_level=None, timeout=30)
    cg = race.cg

    def thawed_then_locked() -> None:
        if not holder.in_transaction:  # the first freeze, not the one made again
            late_thaw.landed()
            holder.execute("BEGIN IMMEDIATE")  # held past the observer's busy timeout

    try:
        after_each_ask(cg, lambda: None, thawed_then_locked)
        late_thaw.run()
        enforcer = Enforcer("sb1", race.policy, "observer", observer, cg)
        event = enforcer.handle(newer_violation())
        assert late_thaw.result == [True] and enforcer.journal_errors == 1
        assert event is not None and event.violation_id is None
        assert cg.is_frozen()
        assert_stopped(ticker)
        holder.execute("ROLLBACK")
        assert len(observer.violations("sb1")) == 1  # only the older one: pinned still
        again = late_thaw.journal.thaw_if_resumed(late_thaw.resumed, "inline", cg.thaw)
        assert not again and cg.is_frozen()
        # The observer's next violation, any: once the journal takes it, the pinned goes too.
        blocked = replace(race_violation("observer"), action=Action.BLOCK, detail="another")
        assert enforcer.handle(blocked) is None
        new, _ = observer.freezes("sb1")
        assert new["decision_id"] is None
        assert observer.sandbox("sb1")["state"] == "frozen"  # type: ignore[index]
        keys = {v["key"] for v in observer.violations("sb1")}  # the blocked one is the older
        assert keys == {str(race_violation("inline").flow), str(newer_violation().flow)}
    finally:
        holder.close()
        observer.close()


@dataclass
class Refused:
    """The observer's freeze of newer_violation, whose record SQLite refused: pinned in
    its intent file (``holder`` keeps the write lock until the test rolls it back)."""

    observer: Journal
    enforcer: Enforcer
    event: FreezeEvent
    holder: sqlite3.Connection


@contextlib.contextmanager
def refused_freeze(race: Race) -> Iterator[Refused]:
    observer = Journal.open(race.state, busy_timeout_s=0.5)
    holder = sqlite3.connect(race.state / "journal.db", isolation_level=None, timeout=30)
    cg = race.cg
    real_freeze, real_soon = cg.freeze, cg.freeze_soon
    lock = lambda: holder.execute("BEGIN IMMEDIATE")  # noqa: E731  # past its busy timeout

    try:
        after_each_ask(cg, lambda: None, lock)
        enforcer = Enforcer("sb1", race.policy, "observer", observer, cg)
        event = enforcer.handle(newer_violation())
        cg.freeze, cg.freeze_soon = real_freeze, real_soon  # type: ignore[method-assign]
        assert event is not None and event.violation_id is None
        assert enforcer.journal_errors == 1
        yield Refused(observer, enforcer, event, holder)
    finally:
        cg.freeze, cg.freeze_soon = real_freeze, real_soon  # type: ignore[method-assign]
        holder.close()
        observer.close()


def test_a_freeze_resumed_while_sqlite_refused_its_record_is_made_again_by_the_retry(
    race: Race, ticker: subprocess.Popen[bytes]
) -> None:
    """SQLite refused the observer's commit (its lock held past a 0.5 s busy timeout): the
    record is pinned in its intent file and SQLite shows no freeze. A thaw meanwhile
    that did not go through Journal.resume (a decision that closes nothing, then a
    thaw: an egressctl from before it, a person writing cgroup.freeze) must not outlast
    the retry the layer's tick makes: once it commits the record, its freeze is open in
    SQLite and the workload stopped again."""
    cg = race.cg
    with refused_freeze(race) as refused:
        observer, enforcer = refused.observer, refused.enforcer
        told: list[FreezeEvent] = []
        enforcer.on_journaled = told.append
        assert refused.event.freeze_id is None  # not journaled: no freeze id yet
        assert_stopped(ticker)
        assert enforcer.retry_pinned() == 0  # the lock still held: not waited for
        refused.holder.execute("ROLLBACK")
        assert observer.freezes("sb1") == []  # pinned: only the intent file has it
        race.journal.record_decision("sb1", "resume", 0, time.time(), "a person")
        cg.thaw()
        thawed_at = time.time()
        assert ticks_within(ticker, 2)
        retried(enforcer)
        assert wait_until(cg.is_frozen, 5)  # asked, not waited for (under the lock)
        assert_stopped(ticker)
        [freeze] = observer.freezes("sb1")
        assert freeze["decision_id"] is None
        assert observer.sandbox("sb1")["state"] == "frozen"  # type: ignore[index]
        assert enforcer.retry_pinned() == 0  # committed once
        # The confirmation journaled is the kernel's of the freeze made again (the workload
        # ran after the first one), and the process is the one the layer saw at the first.
        [ask] = freeze["requested_by"]
        assert freeze["confirmed_at"] == ask["confirmed_at"]
        assert thawed_at < freeze["confirmed_at"] < time.time()
        assert freeze["latency_ms"] > (thawed_at - ask["at"]) * 1000
        [violation] = observer.violations("sb1")
        assert violation["process"]["pid"] == ticker.pid
        assert refused.event.violation_id == violation["id"]
        # The event's ids filled in, and the layer told (its review compares freeze ids).
        assert refused.event.freeze_id == freeze["id"] and told == [refused.event]


def retried(enforcer: Enforcer) -> None:
    """Until the layer's tick commits its pinned record (once its wait after a refusal
    is up)."""
    deadline = time.monotonic() + 10
    while enforcer.retry_pinned() == 0:
        assert time.monotonic() < deadline, "the pinned record was not committed"
        time.sleep(0.01)


def egressctl_resume(race: Race, capfd: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`egressctl resume sb1` in this process (its cgroup found from the journal's
    paths): the exit status, and what it said."""
    from egress.cli.main import main

    race.journal.update_sandbox("sb1", cgroup=race.cg.v2_path, freezer=race.cg.freezer_path)
    capfd.readouterr()
    status = main(["resume", "sb1", "--state-dir", str(race.state), "--note", "a person"])
    out, err = capfd.readouterr()
    return status, out + err


@pytest.mark.parametrize("intents", [False, True], ids=["sqlite-first", "intent"])
def test_a_freeze_journaled_between_a_persons_resume_and_its_thaw_stands(
    race: Race,
    ticker: subprocess.Popen[bytes],
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    intents: bool,
) -> None:
    """`egressctl resume` journals the decision, then thaws. A layer's freeze for a newer
    violation, landed after that decision and before that thaw, would be undone by it:
    open in the journal (or about to be), the workload running. The resume looks again
    after its thaw, under the journal's lock, and freezes again. The layer's record is
    then committed (sqlite-first: before its freeze), or (intent) still in its intent
    file, committed only once the resume has returned."""
    enforcer = Enforcer("sb1", race.policy, "observer", race.journal, race.cg, intents=intents)
    assert enforcer.handle(race_violation("observer")) is not None
    assert_stopped(ticker)
    real_thaw, real_commit = Cgroup.thaw, race.journal.record_for_freeze
    froze, go = threading.Event(), threading.Event()
    layered: list[object] = []

    def commit_later(*args: Any, **kwargs: Any) -> Any:  # called once the freeze landed
        froze.set()
        assert go.wait(30)
        return real_commit(*args, **kwargs)

    def layer(cg: Cgroup, *args: Any, **kwargs: Any) -> None:
        if not layered:  # the person's thaw: the layer's freeze lands just before it
            if intents:
                race.journal.record_for_freeze = commit_later  # type: ignore[method-assign]
                threading.Thread(
                    target=lambda: layered.append(enforcer.handle(newer_violation()))
                ).start()
                assert froze.wait(30)
            else:
                go.set()
                layered.append(enforcer.handle(newer_violation()))
        real_thaw(cg, *args, **kwargs)

    monkeypatch.setattr(Cgroup, "thaw", layer)
    try:
        status, said = egressctl_resume(race, capfd)
    finally:
        monkeypatch.undo()
        go.set()
    assert wait_until(lambda: bool(layered), 30)
    [event] = layered
    assert event is not None  # the layer froze for it
    assert wait_until(race.cg.is_frozen, 5), "the newer freeze was undone"  # asked again
    assert_stopped(ticker)
    assert status == 1 and "waits for a decision" in said, said
    newer, older = race.journal.freezes("sb1")
    assert older["decision_id"] is not None and newer["decision_id"] is None
    assert newer["confirmed_at"] is not None
    assert race.journal.sandbox("sb1")["state"] == "frozen"  # type: ignore[index]


def test_a_persons_resume_leaves_a_freeze_whose_record_sqlite_refused_frozen(
    race: Race, ticker: subprocess.Popen[bytes], capfd: pytest.CaptureFixture[str]
) -> None:
    """The observer froze and SQLite refused its record (pinned in its intent file): the
    journal shows no freeze open. A person's `egressctl resume` meanwhile journals its
    decision and leaves the sandbox frozen, saying why; the layer's retry then opens the
    freeze for a person."""
    with refused_freeze(race) as refused:
        refused.holder.execute("ROLLBACK")
        assert refused.observer.freezes("sb1") == []
        status, said = egressctl_resume(race, capfd)
        assert race.cg.is_frozen(), "thawed while a freeze was pending"
        assert_stopped(ticker)
        assert status == 1 and "not journaled yet" in said, said
        retried(refused.enforcer)
        [freeze] = refused.observer.freezes("sb1")
        assert freeze["decision_id"] is None and race.cg.is_frozen()
        assert_stopped(ticker)


def test_a_persons_resume_thaws_and_the_workload_goes_on(
    race: Race, ticker: subprocess.Popen[bytes], capfd: pytest.CaptureFixture[str]
) -> None:
    enforcer = Enforcer("sb1", race.policy, "observer", race.journal, race.cg)
    assert enforcer.handle(race_violation("observer")) is not None
    assert_stopped(ticker)
    status, said = egressctl_resume(race, capfd)
    assert status == 0 and said == "sandbox sb1 resumed\n"
    assert not race.cg.is_frozen()
    assert ticks_within(ticker, 2)
    [freeze] = race.journal.freezes("sb1")
    [decision] = race.journal.decisions("sb1")
    assert freeze["decision_id"] == decision["id"] and decision["note"] == "a person"
    assert race.journal.sandbox("sb1")["state"] == "running"  # type: ignore[index]


def test_concurrent_freezers_both_return(cg: Cgroup, ticker: subprocess.Popen[bytes]) -> None:
    name = os.path.basename(cg.v2_path)
    code = (
        "import sys\nfrom egress.kernel.cgroup import Cgroup\n"
        f"print(Cgroup.open({name!r}, parent={PARENT!r}).freeze())\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)]
    procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE))
    errors: list[BaseException] = []

    def in_thread() -> None:
        try:
            cg.freeze()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=in_thread)
    t.start()
    outs = [p.communicate(timeout=20) for p in procs]
    t.join()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert not errors
    assert cg.is_frozen()
    assert_stopped(ticker)


def test_remove_with_processes_refuses_and_keeps_everything(
    cg: Cgroup, ticker: subprocess.Popen[bytes]
) -> None:
    with pytest.raises(SandboxError, match="still has processes"):
        cg.remove()
    assert os.path.isdir(cg.v2_path)
    assert cg.pids() == [ticker.pid]


@needs_v1
def test_a_sandbox_cgroup_is_removed_when_its_task_is_not_in_its_v2_procs(
    make_cgroup: Callable[[], Cgroup], ticker: subprocess.Popen[bytes]
) -> None:
    """The sandbox's removal kills by remove()'s own test (populated, or a task in the v1
    twin), not by the v2 procs list: a task that list no longer shows (one exiting after
    another teardown's kill: `egressctl kill` racing `gc`; or one only in the v1 twin, as
    here) made remove() refuse, "still has processes"."""
    cg = make_cgroup()
    assert cg.freezer_path is not None
    with open(os.path.join(cg.freezer_path, "cgroup.procs"), "w") as f:
        f.write(str(ticker.pid))
    assert cg.pids() == [] and not cg.empty()
    _remove_cgroup(cg)
    assert ticker.wait(timeout=5) == -9
    assert not os.path.exists(cg.v2_path) and not os.path.exists(cg.freezer_path)


def test_kill_after_a_removal_took_the_v1_twin_kills_what_is_left_in_v2(
    cg: Cgroup, ticker: subprocess.Popen[bytes]
) -> None:
    """`egressctl kill` racing `gc`: remove() takes the v1 twin first, so a kill can find
    it gone while its v2 cgroup still holds the workload. It read the twin's procs and
    wrote THAWED there, and failed ("No such file or directory") without waiting for the
    workload to go."""
    freezer = find_mounts().freezer
    assert cg.freezer_path is not None and freezer is not None
    with open(os.path.join(freezer, "cgroup.procs"), "w") as f:
        f.write(str(ticker.pid))  # out of the twin, as a task that left it
    os.rmdir(cg.freezer_path)  # what the racing removal did
    assert cg.pids() == [ticker.pid]
    cg.kill()
    assert ticker.wait(timeout=5) == -9
    assert cg.empty()


def test_create_existing_and_bad_names_raise(make_cgroup: Callable[[], Cgroup]) -> None:
    cg = make_cgroup()
    name = os.path.basename(cg.v2_path)
    with pytest.raises(SandboxError, match="already exists"):
        Cgroup.create(name, parent=PARENT)
    assert os.path.isdir(cg.v2_path)
    for bad in ("", "..", "a/../b", "."):
        with pytest.raises(SandboxError, match="invalid cgroup name"):
            Cgroup.create(bad, parent=PARENT)
    with pytest.raises(SandboxError, match="no cgroup"):
        Cgroup.open("never-made", parent=PARENT)


@needs_v1
def test_busy_tasks_are_frozen_at_the_first_ask_in_both_hierarchies(
    make_cgroup: Callable[[], Cgroup], monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 busy tasks, frozen and thawed 40 times: each freeze is confirmed without asking
    v2 again. Both asked, a task caught in v2's trap while v1 froze the others used to
    leave neither saying frozen until the next attempt asked again (667 ms later)."""
    cg = make_cgroup()
    asks: list[str] = []
    real_write = cg_mod._write

    def counting(path: str, value: str) -> None:
        if path.endswith("cgroup.freeze") and value == "1":
            asks.append(path)
        real_write(path, value)

    code = "import os\nfor _ in range(64):\n    if os.fork() == 0:\n        while True: pass\n"
    code += "import time\ntime.sleep(600)\n"
    files = cg.procs_files
    busy = subprocess.Popen([SYSTEM_PYTHON, "-c", code],
                            preexec_fn=lambda: [Path(f).write_text(str(os.getpid()))
                                                for f in files])  # fmt: skip
    try:
        assert wait_until(lambda: len(cg.pids()) == 65, 20)
        monkeypatch.setattr(cg_mod, "_write", counting)
        for round_ in range(40):
            asks.clear()
            cg.freeze(timeout=6.0)  # an attempt lasts 2 s: a busy CI host's turns fit in it
            assert cg.is_frozen() and len(asks) == 1, (round_, asks)
            cg.thaw()
    finally:
        monkeypatch.undo()
        cg.kill()
        busy.wait(timeout=10)


@pytest.mark.parametrize("failing_root", ["freezer", "cpu", "pids", "memory"])
def test_create_rolls_back_what_it_made_when_a_twin_fails(
    monkeypatch: pytest.MonkeyPatch, failing_root: str
) -> None:
    """A twin that can't be made leaves nothing: the directories made before it, and
    the parents the first sandbox made, are removed again."""
    mounts = find_mounts()
    root = getattr(mounts, failing_root)
    if root is None:
        pytest.skip(f"no v1 {failing_root} hierarchy on this machine")
    real_mkdir = cg_mod._mkdir

    def failing(path: str) -> None:
        if path.startswith(root + "/"):
            raise SandboxError("injected failure")
        real_mkdir(path)

    monkeypatch.setattr(cg_mod, "_mkdir", failing)
    with pytest.raises(SandboxError, match="injected"):
        Cgroup.create("rollback", parent=PARENT)
    for made in (mounts.v2, mounts.freezer, mounts.cpu, mounts.pids, mounts.memory):
        if made is not None:
            assert not os.path.exists(os.path.join(made, PARENT)), made


def test_create_rolls_back_when_a_limit_is_refused() -> None:
    """A limit the kernel refuses (here a pids.max it cannot parse) leaves nothing made."""
    mounts = find_mounts()
    with pytest.raises(SandboxError, match=r"pids\.max"):
        Cgroup.create("refused", parent=PARENT, limits=Limits(pids=-5))
    for made in (mounts.v2, mounts.freezer, mounts.cpu, mounts.pids, mounts.memory):
        if made is not None:
            assert not os.path.exists(os.path.join(made, PARENT)), made


@pytest.mark.parametrize("kind", ["cpu", "pids", "memory"])
def test_a_twin_made_at_adoption_takes_every_process_forks_included(
    make_cgroup: Callable[[], Cgroup], ticker: subprocess.Popen[bytes], kind: str
) -> None:
    """adopt_twins on a cgroup made before v1 twins: the twin is made and every process
    ends in it, one that appeared after the first look (a fork) at the next; the limits
    are set, and the parent's caps."""
    made = make_cgroup()
    twin = getattr(made, f"{kind}_path")
    if twin is None:
        pytest.skip(f"no v1 {kind} controller mounted on this machine")
    os.rmdir(twin)  # as an egressd from before the twins left it
    setattr(made, f"{kind}_path", None)
    made.add_pid(ticker.pid)
    real = made.pids
    # Where a fork before its parent's move lands: the v2 cgroup and the freezer, not the
    # twin (add_pid would join the twin too, once adopt_twins has named it).
    joins = [f for f in (made.procs_file_v2, made.procs_file_v1) if f]
    late: list[subprocess.Popen[bytes]] = []

    def in_twin() -> set[int]:
        return {int(p) for p in Path(twin, "cgroup.procs").read_text().split()}

    def join() -> None:
        for path in joins:
            with open(path, "w") as f:
                f.write("0")

    def pids() -> list[int]:
        looked = real()
        if not late and os.path.isdir(twin):  # one joins right after the twin's first look
            late.append(subprocess.Popen(["sleep", "60"], preexec_fn=join))
            assert wait_until(lambda: late[0].pid in real())
            assert late[0].pid not in in_twin()  # only a later look can move it
        return looked

    made.pids = pids  # type: ignore[method-assign]
    limits = Limits(pids=100, memory=256 << 20)
    try:
        assert made.adopt_twins(limits) == []
        assert getattr(made, f"{kind}_path") == twin
        assert set(real()) == {ticker.pid, late[0].pid} and in_twin() == set(real())
        assert made.limits() == limits
        assert made.pids_path is not None  # and its parent capped, as a create caps it
        assert Path(os.path.dirname(made.pids_path), "pids.max").read_text().strip() != "max"
        assert made.adopt_twins(limits) == []  # has them now: nothing more to do
    finally:
        for proc in late:
            proc.kill()
            proc.wait(timeout=10)


def test_a_move_into_a_twin_leaves_a_pid_no_longer_the_sandboxs_where_it_is(
    make_cgroup: Callable[[], Cgroup], ticker: subprocess.Popen[bytes]
) -> None:
    """A pid listed by the look but no longer the sandbox's when its turn comes (ended,
    and reused by a process of the host) is not moved, and is said to be outside."""
    made = make_cgroup()
    twin = made.cpu_path
    if twin is None:
        pytest.skip("no v1 cpu controller mounted on this machine")
    os.rmdir(twin)
    os.mkdir(twin)  # empty: the process below is in v2 and the freezer only
    made.cpu_path = None
    made.add_pid(ticker.pid)
    try:
        problems = cg_mod._move_into(twin, made.pids, lambda pid: False)
        assert len(problems) == 1 and f"pid {ticker.pid} still outside" in problems[0], problems
        assert Path(twin, "cgroup.procs").read_text() == ""
    finally:
        made.cpu_path = twin  # the fixture removes it


def test_a_twin_made_for_a_sandbox_removed_meanwhile_goes_too(
    make_cgroup: Callable[[], Cgroup],
) -> None:
    """`egressctl gc` removing the sandbox between the adopter's open and its move: the
    twin it just made is removed again, not left for nobody to find."""
    made = make_cgroup()
    twin = made.cpu_path
    if twin is None:
        pytest.skip("no v1 cpu controller mounted on this machine")
    os.rmdir(twin)
    made.cpu_path = None
    real = made.pids

    def gone() -> list[int]:
        for path in (made.v2_path, made.freezer_path):
            if path and os.path.isdir(path):  # at the first look (each twin looks)
                os.rmdir(path)
        return real()

    made.pids = gone  # type: ignore[method-assign]
    problems = made.adopt_twins(Limits())
    [cpu] = [p for p in problems if p.startswith("cpu twin")]
    assert "cannot read" in cpu, problems
    assert made.cpu_path is None and not os.path.exists(twin)


def test_attach_existing(ticker: subprocess.Popen[bytes]) -> None:
    v2 = os.path.join(str(find_mounts().v2), PARENT, "foreign")
    os.makedirs(v2)
    try:
        cg = Cgroup.attach_existing(v2)
        assert cg.freezer_path is None
        cg.add_pid(ticker.pid)
        cg.freeze()
        assert_stopped(ticker)
        cg.kill()
        assert ticker.wait(timeout=5) == -9
    finally:
        Cgroup(v2, None).kill()
        os.rmdir(v2)
    with pytest.raises(SandboxError, match="not a cgroup v2"):
        Cgroup.attach_existing("/tmp")


def test_freeze_latency_is_printed(cg: Cgroup, ticker: subprocess.Popen[bytes]) -> None:
    """Not a timed assertion: prints freeze latency for both, v2-only and v1-only."""
    modes = {"v2+v1": {}, "v2 only": {"v1": False}}
    if HAS_V1:
        modes["v1 only"] = {"v2": False}
    lines = []
    for label, kwargs in modes.items():
        lat = []
        for _ in range(100):
            drain(ticker)
            ticks_within(ticker, 1)  # the child runs again, so it is really thawed
            lat.append(cg.freeze(**kwargs) * 1000)
            cg.thaw()
        lat.sort()
        lines.append(
            f"{label}: median {statistics.median(lat):.3f} ms, p99 {lat[98]:.3f} ms,"
            f" max {lat[-1]:.3f} ms"
        )
    start = time.monotonic()
    cg.freeze()
    cg.kill()
    ticker.wait(timeout=5)
    lines.append(f"kill of a frozen cgroup until empty: {(time.monotonic() - start) * 1000:.2f} ms")
    print("\nfreeze latency (n=100): " + "; ".join(lines))


def test_freeze_with_descriptors_past_fd_setsize(
    make_cgroup: Callable[[], Cgroup], ticker: subprocess.Popen[bytes]
) -> None:
    """egressd serving hundreds of sandboxes holds thousands of descriptors: the freeze's
    wait on cgroup.events must work when that file opens as descriptor 1024 or above."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(4096, soft), max(4096, hard)))
    held: list[int] = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open("/dev/null", os.O_RDONLY))
        cg = make_cgroup()
        cg.add_pid(ticker.pid)
        assert ticks_within(ticker, 2)
        assert 0 <= cg.freeze() < 2
        assert_stopped(ticker)
        cg.thaw()
        assert ticks_within(ticker, 2)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _using(cgroup: Cgroup, mib: int) -> subprocess.Popen[bytes]:
    """A process in ``cgroup`` holding ``mib`` MiB it wrote after joining (charged there)."""
    code = f"import sys, time; x = b'1' * ({mib} << 20); print(1, flush=True); time.sleep(120)"
    proc = subprocess.Popen([SYSTEM_PYTHON, "-c", code], stdout=subprocess.PIPE,
                            preexec_fn=lambda: join_cgroups(cgroup.procs_files))  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == b"1\n"
    return proc


def test_a_memory_limit_below_what_the_sandbox_uses_is_refused_and_nothing_changes(
    make_cgroup: Callable[[], Cgroup],
) -> None:
    """Lowering memory under what is in use would reclaim, or OOM-kill on cgroup v2, inside
    the write (egressd's loop, a frozen sandbox): refused first. The pids limit written
    before it is put back."""
    made = make_cgroup()
    assert made.set_limits(Limits(pids=50, memory=256 << 20)) == []
    holder = _using(made, 32)
    try:
        with pytest.raises(SandboxError, match="below what the sandbox uses now"):
            made.set_limits(Limits(pids=20, memory=16 << 20))
        assert made.limits() == Limits(pids=50, memory=256 << 20)
        assert made.set_limits(Limits(pids=20, memory=128 << 20)) == []
        assert made.limits() == Limits(pids=20, memory=128 << 20)
    finally:
        holder.kill()
        holder.wait(timeout=10)
        assert holder.stdout is not None
        holder.stdout.close()


def test_a_default_limit_without_a_controller_is_said_and_a_named_one_refused(
    make_cgroup: Callable[[], Cgroup],
) -> None:
    """Where no pids controller holds the sandbox (here: its v1 twin taken out of view,
    and this host's cgroup v2 has none), the default is left out with a note; one the
    policy names is an error."""
    made = make_cgroup()
    twin, made.pids_path = made.pids_path, None
    if twin is None or os.path.exists(os.path.join(made.v2_path, "pids.max")):
        pytest.skip("pids is in cgroup v2 here: no host without the controller to play")
    try:
        [note] = made.set_limits(Limits())
        assert note.startswith("no pids cgroup controller for ") and "(2048)" in note
        with pytest.raises(SandboxError, match=r"spec\.limits\.pids: this host has no pids"):
            made.set_limits(Limits(pids=64, explicit=frozenset({"pids"})))
    finally:
        made.pids_path = twin  # the fixture removes it


def test_all_sandboxes_together_get_three_quarters_of_the_hosts_tasks_and_memory() -> None:
    """Each at its own limit, a few fork or /tmp bombs would still take the host: the
    parent of every sandbox gets 3/4 of the host's tasks and RAM, unless an operator
    set a cap there first, which stays."""
    mounts = find_mounts()
    tasks = min(int(Path("/proc/sys/kernel/pid_max").read_text()),
                int(Path("/proc/sys/kernel/threads-max").read_text()))  # fmt: skip
    ram = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
    made = Cgroup.create("capped", parent=PARENT, limits=Limits())
    try:
        pids = os.path.dirname(made.pids_path or made.v2_path)
        assert Path(pids, "pids.max").read_text().strip() == str(tasks * 3 // 4)
        if made.memory_path:
            limit = Path(os.path.dirname(made.memory_path), "memory.limit_in_bytes")
            assert int(limit.read_text()) == ram * 3 // 4 // 4096 * 4096  # whole pages
    finally:
        made.remove()
    if mounts.pids is None:
        return
    os.makedirs(os.path.join(mounts.pids, PARENT))
    Path(mounts.pids, PARENT, "pids.max").write_text("1000")
    made = Cgroup.create("capped", parent=PARENT, limits=Limits())
    try:
        assert Path(mounts.pids, PARENT, "pids.max").read_text().strip() == "1000"
    finally:
        made.remove()
