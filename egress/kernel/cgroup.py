"""The sandbox's cgroup: where a violation freezes the workload, and kill reaps it.

A freeze is only as good as its confirmation, so ``freeze()`` waits until the kernel
says the tasks are stopped (cgroup.events ``frozen 1``, or the v1 freezer's FROZEN)
instead of trusting the write. Where a v1 freezer hierarchy exists next to cgroup v2
(hybrid systems) the workload is placed in both and both are frozen: either alone keeps
it stopped, so a bug or race in one does not let it run.

Two kernel facts shape the code (measured on kernel 6.18, see the tests):
- A task frozen by v1 never enters the v2 freezer trap, so v2 keeps saying ``frozen 0``
  while v1 holds it. Confirmation therefore accepts whichever requested hierarchy reports
  frozen first.
- A v1-frozen task ignores SIGKILL until thawed; a v2-frozen one dies at once.

Where the v1 cpu controller is mounted (hybrid hosts), a sandbox egress made has a twin
there too, under one parent for all of them (``cpu_path``): the workload's tasks leave
the root task group, where the kernel weighs tasks by session (autogroups) and a
workload that starts a session per busy process would multiply its share of the CPUs
past the layers that must freeze it. All sandboxes' workloads weigh as one session.

A sandbox egress made also has its limits (``model.Limits``: tasks, memory) where those
controllers are: twins in the v1 pids and memory hierarchies on hybrid hosts, its own
cgroup's pids.max and memory.max on cgroup v2 (``set_limits``). A fork or memory bomb
then fails or is OOM-killed inside the sandbox, instead of starving the host and the
layers that must freeze it.

Mount points are read from /proc/self/mountinfo, never assumed (cgroup_mounts.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Collection

from egress.errors import SandboxError
from egress.kernel.cgroup_mounts import CgroupMounts, find_mounts, parse_mountinfo
from egress.model import Limits

__all__ = ["Cgroup", "CgroupMounts", "find_mounts", "parse_mountinfo"]

# The v1 freezer has no change notification, and the kernel rate-limits cgroup.events
# notifications (one per ~10 ms, CGROUP_FILE_NOTIFY_MIN_INTV), so a freeze right after a
# thaw would wake us late. Waits therefore also re-read, backing off from 0.1 to 1 ms.
_POLL_FIRST = 0.0001
_POLL_MAX = 0.001
# How long a freeze re-reads cgroup.events (yielding the CPU) before it asks v1 too.
_V2_SPIN = 0.0003
# When a freeze still FREEZING in v1 with v2 asked too asks v1 again (see _wait): after
# 0.5 ms, then at twice the last wait, at most every 8 ms (each ask walks every task).
_V1_KICK_FIRST = 0.0005
_V1_KICK_MAX = 0.008
# How long a move into a cpu twin made at adoption looks again for processes the last
# look missed (forks; see _move_into) before it says which are still outside.
_MOVE_BUDGET_S = 0.5


def _check_name(name: str) -> str:
    parts = name.split("/")
    if not name or any(p in ("", ".", "..") for p in parts):
        raise SandboxError(f"invalid cgroup name {name!r}")
    return name


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        raise SandboxError(f"cannot read {path}: {exc.strerror}") from exc


def _write(path: str, value: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as exc:
        raise SandboxError(f"cannot write {value!r} to {path}: {exc.strerror}") from exc


def _events(text: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in text.splitlines() if " " in line)


class Cgroup:
    """One sandbox cgroup in the v2 hierarchy, mirrored in the v1 freezer if present (and
    in the v1 cpu, pids and memory controllers, where present, for one egress made)."""

    def __init__(
        self, v2_path: str, freezer_path: str | None, ours: bool = False,
        cpu_path: str | None = None, pids_path: str | None = None,
        memory_path: str | None = None,
    ) -> None:  # fmt: skip
        self.v2_path = v2_path  # "" while unbound (``in_netns``)
        self.freezer_path = freezer_path
        # Membership only: never frozen or read. Not for a runtime's cgroups (attached):
        # their tasks are placed, and weighed, by that runtime.
        self.cpu_path = cpu_path
        # Membership and limits (``set_limits``), for one egress made; never frozen.
        self.pids_path = pids_path
        self.memory_path = memory_path
        self.ours = ours  # under egress's own parent: the last one out removes the parent
        self.notes: list[str] = []  # what ``create`` could not do of a default limit
        self.netns: str | None = None  # unbound: the netns whose processes say which
        self.netns_label: str | None = None  # its name in messages, if ``netns`` is an fd's
        self.on_bind: Callable[[Cgroup], object] | None = None  # e.g. record it in the journal
        self.unbound_reason = ""  # why the last bind found none
        # Unbound, in a pod: the cgroups of egress's own processes there (a sidecar's),
        # left out of the search, and whether the PID namespace's init is the pod's pause.
        self.exclude: Callable[[], Collection[str]] | None = None
        self.skip_init = False
        self.nobody = False  # ... because no process runs in the netns (nothing to act on)
        self._lock = threading.Lock()  # one discovery at a time (freeze, kill, API threads)

    # ---- construction -------------------------------------------------------------

    @classmethod
    def _paths(cls, name: str, parent: str) -> list[str | None]:
        """<v2>/<parent>/<name>, and its v1 freezer, cpu, pids and memory twins (in that
        order) where those are mounted."""
        mounts = find_mounts()
        if mounts.v2 is None:
            raise SandboxError("no cgroup2 filesystem is mounted")
        rel = os.path.join(_check_name(parent), _check_name(name))
        v1 = (mounts.freezer, mounts.cpu, mounts.pids, mounts.memory)
        return [os.path.join(mounts.v2, rel)] + [os.path.join(m, rel) if m else None for m in v1]

    @classmethod
    def create(cls, name: str, parent: str = "egress", limits: Limits | None = None) -> Cgroup:
        """Make <v2>/<parent>/<name> (and its v1 twins), with ``limits`` set before any
        process joins (``notes``: a default the host can't hold) and the parent's caps
        for all sandboxes together (``_cap_parent``); SandboxError if it exists, or if a
        limit cannot be set."""
        paths = cls._paths(name, parent)
        made: list[str] = []
        try:
            for path in dict.fromkeys(p for p in paths if p):  # once: a hierarchy may be shared
                _mkdir(path)
                made.append(path)
            v2, freezer, cpu, pids, memory = paths
            assert v2 is not None  # _paths makes it
            cgroup = cls(v2, freezer, ours=True, cpu_path=cpu, pids_path=pids,
                         memory_path=memory)  # fmt: skip
            if limits is not None:
                _cap_parent(os.path.dirname(pids or v2), os.path.dirname(memory or v2))
                cgroup.notes = cgroup.set_limits(limits, fresh=True)
        except BaseException:  # a Ctrl-C too: the caller has no undo for it yet
            for path in reversed(made):
                _rmdir(path)
            for path in dict.fromkeys(p for p in paths if p):  # the parents it may have made
                _rmdir_parent(path)
            raise
        return cgroup

    @classmethod
    def open(cls, name: str, parent: str = "egress") -> Cgroup:
        v2, *twins = cls._paths(name, parent)
        assert v2 is not None  # _paths makes it
        if not os.path.isdir(v2):
            raise SandboxError(f"no cgroup {v2}")
        freezer, cpu, pids, memory = (t if t and os.path.isdir(t) else None for t in twins)
        return cls(v2, freezer, ours=True, cpu_path=cpu, pids_path=pids, memory_path=memory)

    # ---- limits -------------------------------------------------------------------

    def set_limits(self, limits: Limits, fresh: bool = False) -> list[str]:
        """Write ``limits`` where this sandbox's tasks are counted: its v1 pids and memory
        twins, else its own cgroup's files in v2 (the controller turned on for its parent
        when a limit needs it). Returns what a default limit could not be held by (no
        such controller here), for the caller to say. SandboxError, with the limits put
        back as they were, if a limit the policy names has no controller here or the
        kernel refuses one; a memory limit below what the sandbox uses now is refused
        before anything is written (lowering it would reclaim, or OOM-kill on cgroup v2,
        inside the write, on the caller's thread). ``fresh``: just made, empty and
        unlimited (``create``, which removes it on failure): nothing to read first."""
        before = Limits(pids=None, memory=None) if fresh else self.limits()
        notes = []
        try:
            for kind in ("pids", "memory"):
                value = getattr(limits, kind)
                now = getattr(before, kind)
                if value is None and now is None:
                    continue  # no limit to lift
                # Memory lowered (or limited anew) in a cgroup with tasks: checked first.
                check = kind == "memory" and not fresh and value is not None
                check = check and (now is None or value < now)
                note = self._set_limit(kind, value, kind in limits.explicit, check)
                if note:
                    notes.append(note)
        except BaseException:
            if fresh:
                raise
            for kind in ("pids", "memory"):
                with contextlib.suppress(SandboxError):
                    self._set_limit(kind, getattr(before, kind), False)
            raise
        return notes

    def _set_limit(
        self, kind: str, value: int | None, explicit: bool, check_use: bool = False
    ) -> str | None:
        if check_use and value is not None:
            used = self._memory_used()
            if used is not None and used > value:
                raise SandboxError(
                    f"spec.limits.memory {value} is below what the sandbox uses now ({used}"
                    " bytes, page cache and swap included): set it higher, or free memory"
                    " in the sandbox first"
                )
        twin = self.pids_path if kind == "pids" else self.memory_path
        if twin and kind == "pids":
            _write(os.path.join(twin, "pids.max"), _v2_value(value))
            return None
        if twin:
            _v1_memory(twin, value)
            return None
        path = os.path.join(self.v2_path, f"{kind}.max")
        if not os.path.exists(path):
            if value is None:
                return None  # nothing to lift
            if not _enable_v2(self.v2_path, kind):
                where = os.path.dirname(self.v2_path)
                if explicit:
                    raise SandboxError(
                        f"spec.limits.{kind}: this host has no {kind} cgroup controller for"
                        f" {where} (no v1 hierarchy, none enabled in cgroup v2): enable it,"
                        f" or set {kind}: max"
                    )
                return (f"no {kind} cgroup controller for {where}: the default"
                        f" spec.limits.{kind} ({value}) is not held")  # fmt: skip
        swap = os.path.join(self.v2_path, "memory.swap.max")
        if kind == "memory" and value is not None and os.path.exists(swap):
            _write(swap, "0")  # first: lowering memory.max would push the rest to swap
        _write(path, _v2_value(value))
        if kind == "memory" and value is None and os.path.exists(swap):
            _write(swap, "max")
        return None

    def _memory_used(self) -> int | None:
        """RAM in use, and swap where the kernel counts it (the v1 memsw limit holds both)."""
        if self.memory_path:
            names = ("memory.usage_in_bytes", "memory.memsw.usage_in_bytes")
            found = [os.path.join(self.memory_path, n) for n in names]
            return max((int(_read(f)) for f in found if os.path.exists(f)), default=None)
        current = os.path.join(self.v2_path, "memory.current")
        return int(_read(current)) if os.path.exists(current) else None

    def limits(self) -> Limits:
        """The limits in force, read back from the kernel (None: none)."""
        pids_dir = self.pids_path or self.v2_path
        pids = _read_limit(os.path.join(pids_dir, "pids.max")) if pids_dir else None
        if self.memory_path:
            memory = _read_limit(os.path.join(self.memory_path, "memory.limit_in_bytes"))
        else:
            memory = _read_limit(os.path.join(self.v2_path, "memory.max")) if self.v2_path else None
        return Limits(pids=pids, memory=memory)

    def limit_hits(self) -> dict[str, int]:
        """How often its limits acted, as the kernel counts: forks refused at pids.max
        (``pids_refused``) and processes its OOM killer ended inside (``oom_kills``)."""
        hits = {}
        where = (
            ("pids_refused", self.pids_path or self.v2_path, "pids.events", "max"),
            ("oom_kills", self.memory_path, "memory.oom_control", "oom_kill"),
            ("oom_kills", self.v2_path, "memory.events", "oom_kill"),
        )
        for key, directory, name, field in where:
            if not directory or key in hits:
                continue
            try:
                with open(os.path.join(directory, name)) as f:
                    value = _events(f.read()).get(field)
            except OSError:
                continue
            if value is not None:
                hits[key] = int(value)
        return hits

    def adopt_twins(self, limits: Limits) -> list[str]:
        """A sandbox an earlier egressd made, now adopted: each v1 cpu, pids or memory
        twin it lacks (made before they existed) made, and every process of its v2
        cgroup moved into each twin, new or not (one started meanwhile by a client that
        knew of fewer twins would escape the limits for good), as a create would have
        placed them (see the module doc); then ``limits`` set. Nothing to do for
        another's cgroup. Returns what could not be done, for the caller to say: the
        sandbox is served all the same."""
        if not self.ours or not self.v2_path:
            return []
        mounts = find_mounts()
        if mounts.v2 is None:
            return []
        rel = os.path.relpath(self.v2_path, mounts.v2)
        problems = []
        for kind, mount in (("cpu", mounts.cpu), ("pids", mounts.pids), ("memory", mounts.memory)):
            if mount is not None:
                problems += self._adopt_twin(kind, os.path.join(mount, rel), rel)
        try:
            # An egress before the caps left its parent without them.
            parent = os.path.dirname
            _cap_parent(parent(self.pids_path or self.v2_path),
                        parent(self.memory_path or self.v2_path))  # fmt: skip
            problems += self.set_limits(limits)
        except SandboxError as exc:
            problems.append(f"limits not set: {exc}")
        return problems

    def _adopt_twin(self, kind: str, twin: str, rel: str) -> list[str]:
        # Made just now by another kind's step where one v1 hierarchy holds both.
        made = getattr(self, f"{kind}_path") is None and twin not in self._dirs()
        if made:
            try:
                _mkdir(twin)
            except SandboxError as exc:
                return [f"no {kind} twin: {exc}"]
        setattr(self, f"{kind}_path", twin)  # from here a later exec joins it
        try:
            return _move_into(twin, self.pids, lambda pid: _in_v2(pid, "/" + rel))
        except SandboxError as exc:
            if made and not os.path.isdir(self.v2_path):  # removed meanwhile (`egressctl gc`)
                setattr(self, f"{kind}_path", None)
                with contextlib.suppress(SandboxError):
                    _rmdir(twin)
                    _rmdir_parent(twin)
            return [f"{kind} twin {twin}: {exc}"]

    @classmethod
    def attach_existing(
        cls, v2_path: str, freezer_path: str | None = None, cpu_path: str | None = None,
        pids_path: str | None = None, memory_path: str | None = None,
    ) -> Cgroup:  # fmt: skip
        """Wrap a cgroup someone else made (a container runtime, systemd), or another
        process of egress (egressd's sandbox JSON: its v1 cpu, pids and memory twins,
        which a process started there joins too)."""
        if not os.path.isfile(os.path.join(v2_path, "cgroup.procs")):
            raise SandboxError(f"{v2_path} is not a cgroup v2 directory")
        if freezer_path is not None and not os.path.isfile(
            os.path.join(freezer_path, "freezer.state")
        ):
            raise SandboxError(f"{freezer_path} is not a v1 freezer cgroup")
        for kind, path, file in (("cpu", cpu_path, "cgroup.procs"), ("pids", pids_path, "pids.max"),
                                 ("memory", memory_path, "memory.limit_in_bytes")):  # fmt: skip
            if path is not None and not os.path.isfile(os.path.join(path, file)):
                raise SandboxError(f"{path} is not a v1 {kind} cgroup")
        return cls(v2_path, freezer_path, cpu_path=cpu_path, pids_path=pids_path,
                   memory_path=memory_path)  # fmt: skip

    @classmethod
    def in_netns(
        cls,
        netns_path: str,
        v2_path: str = "",
        freezer_path: str | None = None,
        label: str | None = None,
    ) -> Cgroup:
        """The cgroup of the processes that run in the netns (a CNI ADD comes before the
        container's first process): found when an act needs it (``bind``, from
        ``kernel.netns_cgroup``), and found again at each freeze (the Enforcer's
        ``bind(refresh=True)``) and kill, so it widens to cover
        every process there then (a pod's containers after its pause container). Read
        paths never look: until bound, nothing is frozen and there is nothing to list.
        ``label``: the netns's name in what it says, where ``netns_path`` is an fd's."""
        cgroup = cls(v2_path, freezer_path)
        cgroup.netns = netns_path
        cgroup.netns_label = label
        cgroup.unbound_reason = f"no process has run in netns {label or netns_path} yet"
        return cgroup

    @classmethod
    def attached(
        cls,
        netns_path: str,
        v2_path: str | None,
        freezer_path: str | None,
        found: bool = False,
        label: str | None = None,
    ) -> Cgroup:
        """An attached sandbox's cgroup, as its record has it: the runtime's, given as
        paths; or (no path yet, or ``found``: it was found from its processes) the one
        its processes run in (``in_netns``), bound to the recorded paths if any."""
        if not v2_path or found:
            return cls.in_netns(netns_path, v2_path or "", freezer_path, label)
        return cls.attach_existing(v2_path, freezer_path)

    @property
    def bound(self) -> bool:
        return bool(self.v2_path)

    def bind(self, refresh: bool = False) -> bool:
        """Bound, or bind it now from the processes in its netns (with ``refresh``, look
        again even if bound: they may have spread). False, the reason in
        ``unbound_reason``, while there is none to bind; an earlier binding is kept when
        a later look finds none."""
        if self.netns is None or (self.v2_path and not refresh):
            return bool(self.v2_path)
        from egress.kernel.netns_cgroup import NoCgroup, discover  # it reads mounts here

        with self._lock:
            try:
                exclude = self.exclude() if self.exclude is not None else ()
                v2, freezer = discover(self.netns, exclude, self.skip_init)
            except NoCgroup as exc:
                said = str(exc)
                self.unbound_reason = (
                    said.replace(self.netns, self.netns_label) if self.netns_label else said
                )
                self.nobody = exc.nobody
                return bool(self.v2_path)
            changed = v2 != self.v2_path or freezer != self.freezer_path
            self.freezer_path = freezer  # first: whoever sees the v2 path sees its twin
            self.v2_path = v2
        if changed and self.on_bind is not None:
            self.on_bind(self)
        return True

    def forget_netns(self) -> None:
        """Look for the cgroup no more (its netns's descriptor is about to close, and its
        number could name another netns then); what it bound stays."""
        with self._lock:
            self.netns = None

    def _bound(self) -> None:
        if not self.bind():
            raise SandboxError(f"no cgroup to act on: {self.unbound_reason}")

    # ---- membership ---------------------------------------------------------------

    @property
    def procs_file_v2(self) -> str:
        """Where a child writes its own pid to join before it execs the workload."""
        return os.path.join(self.v2_path, "cgroup.procs")

    @property
    def procs_file_v1(self) -> str | None:
        return os.path.join(self.freezer_path, "cgroup.procs") if self.freezer_path else None

    @property
    def procs_files(self) -> list[str]:
        """Every cgroup.procs a child writes its own pid to before it execs the workload."""
        return [os.path.join(d, "cgroup.procs") for d in self._dirs()]

    def add_pid(self, pid: int) -> None:
        self._bound()
        for d in self._dirs():
            _write(os.path.join(d, "cgroup.procs"), str(pid))

    def pids(self) -> list[int]:
        return _procs(self.v2_path) if self.v2_path else []

    def populated(self) -> bool:
        if not self.v2_path:
            return False
        return _events(_read(os.path.join(self.v2_path, "cgroup.events"))).get("populated") == "1"

    def empty(self) -> bool:
        """No process left in it, in either hierarchy (SandboxError if it is gone)."""
        return not self.populated() and not self._v1_pids()

    def _dirs(self) -> list[str]:
        twins = (self.freezer_path, self.cpu_path, self.pids_path, self.memory_path)
        return list(dict.fromkeys([self.v2_path] + [d for d in twins if d]))

    # ---- freezing -----------------------------------------------------------------

    def freeze(
        self, timeout: float = 2.0, v2: bool = True, v1: bool = True, asked: bool = False
    ) -> float:
        """Freeze and wait until the kernel confirms; returns the latency in seconds, up
        to the moment this call first read the cgroup frozen.

        Safe to call concurrently from several processes: every caller returns once the
        cgroup is frozen. v2/v1 select hierarchies (v1 is skipped where absent); every
        selected one is asked before this returns (with ``asked``, by ``freeze_soon``
        already, on these same paths: its confirmation is waited for, and asked again
        only if it does not come within the first attempt's share of ``timeout``).
        """
        self._bound()
        use_v1 = v1 and self.freezer_path is not None
        if not (v2 or use_v1):
            raise SandboxError("freeze: no freezer selected")
        start = time.monotonic()
        deadline = start + timeout
        # A thaw racing this freeze (a person resuming while a layer freezes again) can
        # undo the write; ask again, a few times, before giving up.
        for attempt in range(3):
            # With ``asked``, freeze_soon made the first attempt's ask already.
            if not (asked and attempt == 0):
                soon = self._ask(v2, use_v1)
                if soon is not None:
                    return soon - start
            step = start + timeout * (attempt + 1) / 3
            try:
                return self._wait(min(step, deadline), v2, use_v1, True, False) - start
            except SandboxError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def freeze_soon(self) -> float | None:
        """Ask every hierarchy to freeze, as ``freeze`` first does, and look for v2's
        confirmation only as long as that (_V2_SPIN): the latency in seconds if it came,
        None if not yet (``freeze`` then waits for it). For a caller that serves others
        meanwhile (egressd's loop): a workload slow to stop does not hold it."""
        self._bound()
        start = time.monotonic()
        soon = self._ask(True, self.freezer_path is not None)
        return None if soon is None else soon - start

    def _ask(self, v2: bool, v1: bool) -> float | None:
        """Ask the selected hierarchies to freeze: v2 first (a task v1 catches first never
        reaches the v2 trap, module doc), then a look for its confirmation
        (_v2_confirm_soon), then v1, asked all the same (either alone keeps it stopped).
        The moment (monotonic) v2 was seen frozen, if that look saw it."""
        soon = None
        if v2:
            _write(os.path.join(self.v2_path, "cgroup.freeze"), "1")
            soon = self._v2_confirm_soon()
        if v1:
            _write(self._state_path(), "FROZEN")
        return soon

    def let_go_of(self, v2_path: str, freezer_path: str | None) -> list[str]:
        """Thaw the own freeze of an earlier binding of the same processes, now that this
        one is frozen: one below it (a container's, within the pod's found once a second
        container joined the netns: the pod's freeze stops it all the same, a parent's
        stopping its children in both hierarchies) or above it (the pod's, once they
        are all in one container: what else it holds is not the netns's). Each
        hierarchy where it differs; nothing where the earlier binding's v2 cgroup lies
        elsewhere (not the same processes: left frozen, for a person to see). What it
        thawed."""
        old, new = v2_path.rstrip("/"), self.v2_path.rstrip("/")
        if not (old == new or old.startswith(new + "/") or new.startswith(old + "/")):
            return []
        thawed = []
        for path, ours, name, value in (
            (v2_path, self.v2_path, "cgroup.freeze", "0"),
            (freezer_path, self.freezer_path, "freezer.state", "THAWED"),
        ):
            if path and path != ours:
                _write(os.path.join(path, name), value)
                thawed.append(path)
        return thawed

    def _v2_confirm_soon(self) -> float | None:
        """When v2 reports frozen within _V2_SPIN of its write (a sleeping workload enters
        its trap in ~0.05 ms), that moment; None after. The v1 write costs ~0.1 ms of
        kernel time as the first frozen v1 cgroup flips the freezer's static key, so
        it comes after this look, not between the v2 write and its confirmation."""
        with _EventsWatch(self.v2_path) as watch:
            until = time.monotonic() + _V2_SPIN
            while True:
                now = time.monotonic()
                if watch.get("frozen") == "1":
                    return now
                if now > until:
                    return None
                os.sched_yield()  # the task to be frozen may need this CPU to get there

    def ask_freeze(self) -> None:
        """Ask every hierarchy to freeze and return, unconfirmed: for a caller that must
        not wait (one holding the journal's write lock, undoing a thaw of its own)."""
        self._bound()
        _write(os.path.join(self.v2_path, "cgroup.freeze"), "1")
        if self.freezer_path is not None:
            _write(self._state_path(), "FROZEN")

    def thaw(self, timeout: float = 2.0, wait: bool = True) -> None:
        """Thaw both hierarchies and (``wait``) wait until neither reports frozen."""
        if not self.v2_path:
            return  # never bound: nothing was ever frozen
        _write(os.path.join(self.v2_path, "cgroup.freeze"), "0")
        if self.freezer_path:
            _write(self._state_path(), "THAWED")
        if wait:
            self.wait_thawed(timeout)

    def wait_thawed(self, timeout: float = 2.0) -> None:
        """Wait, writing nothing, until neither hierarchy reports frozen (a thaw asked
        under the journal's lock: writing it again here could undo a freeze made since)."""
        if self.v2_path:
            self._wait(time.monotonic() + timeout, True, bool(self.freezer_path), False, True)

    def is_frozen(self) -> bool:
        """True when the workload cannot run: either hierarchy reports it frozen."""
        if not self.v2_path:
            return False
        return self.v2_frozen() or self.v1_state() == "FROZEN"

    def v2_frozen(self) -> bool:
        return _events(_read(os.path.join(self.v2_path, "cgroup.events"))).get("frozen") == "1"

    def v1_state(self) -> str | None:
        """THAWED, FREEZING or FROZEN; None without a v1 freezer."""
        return _read(self._state_path()).strip() if self.freezer_path else None

    def _state_path(self) -> str:
        assert self.freezer_path is not None
        return os.path.join(self.freezer_path, "freezer.state")

    def _wait(self, deadline: float, v2: bool, v1: bool, frozen: bool, need_all: bool) -> float:
        """Block until the selected hierarchies reach the state: woken by cgroup.events
        change notifications, and re-reading on a short backoff (see _POLL_FIRST).
        Returns the moment (monotonic) the state was seen."""
        want_v1 = "FROZEN" if frozen else "THAWED"
        with _EventsWatch(self.v2_path) as watch:
            delay = _POLL_FIRST
            kick = _V1_KICK_FIRST
            kick_at = time.monotonic() + kick
            while True:
                done = [watch.get("frozen") == ("1" if frozen else "0")] if v2 else []
                state = self.v1_state() if v1 else None
                if v1:
                    done.append(state == want_v1)
                now = time.monotonic()
                if all(done) if need_all else any(done):
                    return now
                remaining = deadline - now
                if remaining <= 0:
                    raise SandboxError(self._timeout_message(frozen))
                if frozen and v2 and state == "FREEZING" and now >= kick_at:
                    # Both asked, a task can sit in v2's trap, where v1's first ask found
                    # it awake and never looks again (get_signal tries to freeze once, on
                    # entry), while v1 froze others, which keeps them from v2's trap:
                    # neither would ever say frozen. Asked again, v1 freezes the sleeper
                    # in place. Measured, 40 freezes of 64 busy tasks: 4-23 took 667 ms
                    # (the next attempt's ask) before this, none over 9 ms with it.
                    _write(self._state_path(), "FROZEN")
                    kick = min(kick * 2, _V1_KICK_MAX)
                    kick_at = time.monotonic() + kick
                watch.wait(min(remaining, delay))
                delay = min(delay * 2, _POLL_MAX)

    def _timeout_message(self, frozen: bool) -> str:
        state = f"v2 frozen={int(self.v2_frozen())}, v1={self.v1_state()}"
        return f"cgroup {self.v2_path} did not {'freeze' if frozen else 'thaw'} in time ({state})"

    # ---- killing and removal ------------------------------------------------------

    def kill(self, timeout: float = 5.0) -> None:
        """SIGKILL everything in the cgroup and wait until it is empty.

        SIGKILL is queued (cgroup.kill) BEFORE the v1 freezer lets go: a v1-frozen task
        ignores SIGKILL while frozen, and on thaw it meets the pending signal before it
        can execute another user instruction. v2 freezing is left as is; it does not
        block SIGKILL.
        """
        if not self.bind(refresh=True):
            if self.nobody:
                return  # nothing runs in its netns: nothing to kill
            raise SandboxError(f"cannot kill: {self.unbound_reason}")
        if not os.path.isdir(self.v2_path):
            return  # already removed: nothing left to kill
        has_kill = os.path.exists(os.path.join(self.v2_path, "cgroup.kill"))
        if has_kill:
            _write(os.path.join(self.v2_path, "cgroup.kill"), "1")
        # Tasks only in the v1 twin (someone wrote just one cgroup.procs) and kernels
        # before 5.14 without cgroup.kill get a signal each.
        v1_pids, v2_pids = set(self._v1_pids()), set(self.pids())
        for pid in v1_pids - v2_pids if has_kill else v1_pids | v2_pids:
            _sigkill(pid)
        self._let_v1_go()
        self._wait_empty(time.monotonic() + timeout, resend=not has_kill)

    def _v1_pids(self) -> list[int]:
        """The v1 twin's tasks; none where it is gone (rmdir takes only an empty cgroup,
        and a removal may race a kill: `egressctl gc`, the other layer's teardown)."""
        if not self.freezer_path:
            return []
        try:
            return _procs(self.freezer_path)
        except SandboxError:
            if os.path.isdir(self.freezer_path):
                raise
            return []

    def _let_v1_go(self) -> None:
        """THAWED in the v1 twin, so that its tasks take their pending SIGKILL (a v1-frozen
        task never does); nothing to do where it is gone, as above."""
        if not self.freezer_path:
            return
        try:
            if self.v1_state() != "THAWED":
                _write(self._state_path(), "THAWED")
        except SandboxError:
            if os.path.isdir(self.freezer_path):
                raise

    def _wait_empty(self, deadline: float, resend: bool) -> None:
        with _EventsWatch(self.v2_path) as watch:
            while watch.get("populated") != "0" or self._v1_pids():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SandboxError(f"cgroup {self.v2_path} still has tasks after kill")
                for pid in self.pids() if resend else []:
                    _sigkill(pid)  # without cgroup.kill, forks can race the first round
                self._let_v1_go()  # a layer may have frozen it again meanwhile
                watch.wait(min(remaining, _POLL_MAX))

    def remove(self) -> None:
        """rmdir its directories (idempotent); SandboxError if tasks remain."""
        if not self.v2_path:
            return  # unbound: nothing of ours
        if os.path.isdir(self.v2_path) and not self.empty():
            raise SandboxError(f"cgroup {self.v2_path} still has processes; kill it first")
        for d in reversed(self._dirs()):
            _rmdir(d)
            if self.ours:
                _rmdir_parent(d)


# What v1's memory.limit_in_bytes reads when unlimited (PAGE_COUNTER_MAX pages, rounded);
# anything this large is no limit.
_V1_NO_LIMIT = 1 << 62


def _v2_value(limit: int | None) -> str:
    return "max" if limit is None else str(limit)


def _read_limit(path: str) -> int | None:
    """The limit in a pids.max, memory.max or v1 memory.limit_in_bytes file; None for no
    limit ("max", v1's huge number) or no such file (no such controller there)."""
    if not os.path.exists(path):
        return None
    text = _read(path).strip()
    return None if text == "max" or int(text) >= _V1_NO_LIMIT else int(text)


# All sandboxes together may hold at most this share of the host's tasks and memory:
# with each at its own limit, a few fork or /tmp bombs would still take the rest, and the
# host's OOM killer, not the sandboxes', would choose among the host's processes.
_PARENT_SHARE = (3, 4)


# The parents capped by this process, as (device, inode): the last sandbox's teardown
# removes a parent, and the next create makes a new one, which gets its caps again.
_capped: set[tuple[int, int]] = set()


def _cap_parent(pids_parent: str, memory_parent: str) -> None:
    """Cap egress's parent cgroup(s) at _PARENT_SHARE of the host's tasks (pid_max or
    threads-max, the lower) and of its RAM, where no cap is set yet: an operator's own
    value stays. Where a controller is not there, nothing is written. Once a parent:
    a create pays a stat for it, not reads of /proc."""
    try:
        seen = {(st.st_dev, st.st_ino) for st in map(os.stat, {pids_parent, memory_parent})}
    except OSError as exc:
        raise SandboxError(f"cannot look at {pids_parent}: {exc.strerror}") from None
    if seen <= _capped:
        return
    num, den = _PARENT_SHARE
    tasks = min(_host_number("/proc/sys/kernel/pid_max"),
                _host_number("/proc/sys/kernel/threads-max"))  # fmt: skip
    ram = _ram() * num // den
    caps = (
        (os.path.join(pids_parent, "pids.max"), tasks * num // den),
        (os.path.join(memory_parent, "memory.limit_in_bytes"), ram),  # v1
        (os.path.join(memory_parent, "memory.max"), ram),  # v2
    )
    for path, cap in caps:
        if os.path.exists(path) and _read_limit(path) is None:
            _write(path, str(cap))
    _capped.update(seen)


def _host_number(path: str) -> int:
    return int(_read(path))


def _ram() -> int:
    """The host's RAM in bytes (MemTotal)."""
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise SandboxError("/proc/meminfo has no MemTotal")


def _enable_v2(v2_path: str, controller: str) -> bool:
    """Turn ``controller`` on for the children of ``v2_path``'s parent, if the parent has
    it; whether ``v2_path`` has its files now."""
    parent = os.path.dirname(v2_path)
    try:
        if controller not in _read(os.path.join(parent, "cgroup.controllers")).split():
            return False
        _write(os.path.join(parent, "cgroup.subtree_control"), f"+{controller}")
    except SandboxError:
        return False
    return os.path.exists(os.path.join(v2_path, f"{controller}.max"))


def _v1_memory(path: str, limit: int | None) -> None:
    """memory.limit_in_bytes, and memory.memsw.limit_in_bytes (RAM and swap) where swap is
    accounted, to the same value. The kernel keeps memsw >= the limit at every step, so
    the one that moves towards it goes first."""
    value = str(limit) if limit is not None else "-1"
    ram = os.path.join(path, "memory.limit_in_bytes")
    both = os.path.join(path, "memory.memsw.limit_in_bytes")
    if not os.path.exists(both):
        _write(ram, value)
        return
    current = int(_read(ram))
    raising = limit is None or limit >= current
    for file in (both, ram) if raising else (ram, both):
        _write(file, value)


_FD_SETSIZE = 1024


class _EventsWatch:
    """cgroup.events opened once; ``wait`` sleeps until the kernel changes it."""

    def __init__(self, cgroup_dir: str) -> None:
        path = os.path.join(cgroup_dir, "cgroup.events")
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise SandboxError(f"cannot open {path}: {exc.strerror}") from exc

    def get(self, key: str) -> str | None:
        # Reading re-arms kernfs notification, so poll() wakes only for later changes.
        try:
            return _events(os.pread(self._fd, 4096, 0).decode()).get(key)
        except OSError as exc:  # the cgroup removed under us
            raise SandboxError(f"cannot read cgroup.events: {exc.strerror}") from exc

    def wait(self, seconds: float) -> None:
        # kernfs signals a change as POLLPRI, which select() reports as an exceptional
        # condition; select (unlike poll) takes sub-millisecond timeouts for the v1 backoff.
        # But select() can't take a descriptor of 1024 or above (egressd serving hundreds
        # of sandboxes holds thousands): poll then, its timeout rounded up to 1 ms.
        if self._fd < _FD_SETSIZE:
            select.select([], [], [self._fd], max(seconds, 0.0))
            return
        poller = select.poll()
        poller.register(self._fd, select.POLLPRI)
        poller.poll(max(seconds, 0.0) * 1000)

    def __enter__(self) -> _EventsWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)


def _procs(cgroup_dir: str) -> list[int]:
    return [int(p) for p in _read(os.path.join(cgroup_dir, "cgroup.procs")).split()]


def _move_into(
    cgroup_dir: str, pids: Callable[[], list[int]], belongs: Callable[[int], bool]
) -> list[str]:
    """Move every process ``pids`` lists into the v1 cgroup ``cgroup_dir``, looking again
    until none is left outside: a child forked before its parent moved shows up at the
    next look (one forked after inherits the new cgroup; the kernel moves a process and
    its threads atomically against forks). Each pid is checked to ``belong`` just before
    its move, so one that ended since the look and was reused by another process is
    left where it is (what is left is the microseconds between check and write). Returns
    the refusals, and what is still outside after _MOVE_BUDGET_S: a workload forking
    and exiting in a chain can outrun the looks."""
    procs = os.path.join(cgroup_dir, "cgroup.procs")
    refused: dict[int, str] = {}
    until = time.monotonic() + _MOVE_BUDGET_S
    while True:
        inside = set(_procs(cgroup_dir))
        left = [pid for pid in pids() if pid not in inside and pid not in refused]
        if not left or time.monotonic() >= until:
            break
        for pid in left:
            if not belongs(pid):
                continue  # ended since the look (its pid maybe reused): the next look says
            try:
                with open(procs, "w") as f:
                    f.write(str(pid))
            except ProcessLookupError:
                continue  # it ended meanwhile
            except OSError as exc:  # e.g. EINVAL: a real-time task, and no RT runtime there
                refused[pid] = exc.strerror or str(exc)
    problems = [f"pid {pid} not moved to {cgroup_dir}: {why}" for pid, why in refused.items()]
    if left:
        still = ", ".join(map(str, left[:10])) + (", ..." if len(left) > 10 else "")
        why = "a workload forking through the move"
        problems.append(f"pid {still} still outside {cgroup_dir} after {_MOVE_BUDGET_S:g} s "
                        f"of looks ({why})")  # fmt: skip
    return problems


def _in_v2(pid: int, rel: str) -> bool:
    """Process ``pid`` is in the v2 cgroup ``rel`` (a path under the mount)."""
    from egress.kernel.netns_cgroup import NoCgroup, cgroup_paths  # it imports this module

    try:
        return cgroup_paths(pid)[0] == rel
    except (OSError, NoCgroup):
        return False


def _sigkill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _mkdir(path: str) -> None:
    try:
        for attempt in range(3):
            try:  # the parent is there but for the first sandbox: one mkdir, not two
                os.mkdir(path)
                break
            except FileNotFoundError:
                if attempt == 2:  # the last sandbox's teardown took the parent meanwhile
                    raise
            # Not exist_ok: makedirs raises FileExistsError if the parent goes between
            # its mkdir and its look (a last sandbox's teardown, a failed create's
            # rollback), which the except below would take for this cgroup existing.
            with contextlib.suppress(FileExistsError):
                os.makedirs(os.path.dirname(path))
    except FileExistsError as exc:
        raise SandboxError(f"cgroup {path} already exists") from exc
    except OSError as exc:
        raise SandboxError(f"cannot create cgroup {path}: {exc.strerror}") from exc


def _rmdir_parent(path: str) -> None:
    """The parent of ``path`` (egress's, shared by every sandbox), removed if empty now:
    it goes with the last sandbox, and stays (busy, not empty) while others live."""
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(path))


def _rmdir(path: str) -> None:
    """rmdir, tolerating absence and briefly retrying EBUSY from tasks still exiting."""
    deadline = time.monotonic() + 0.5
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise SandboxError(f"cannot remove cgroup {path}: {exc.strerror}") from exc
            time.sleep(0.005)
