"""One layer's hand on the freeze lever: journal, then act, then confirm.

Both layers (the inline resolver/NFLOG reader and the separate observer process) own an
Enforcer for the same sandbox. For each violation it makes the record durable first
(journal before act: in its process's intent file, store/intents.py, or where there is
none, committed to SQLite), freezes the cgroup if the policy's action says so, waits for
the kernel to report it frozen, commits the intent's record to SQLite, journals the
confirmation, and then, with the sandbox still, reads which process did it. The intent
and the freeze's ask may run on the thread that decided (``begin``: egressd's loop, which
must wait neither for SQLite nor for a workload slow to stop) and the rest on another
(``finish``: its journal writer). Two layers acting on one violation make one freeze
and two detections; a layer whose freeze reaches the cgroup after a person resumed
that freeze thaws it again (``Journal.thaw_if_resumed``), so no freeze stands with
nothing left to decide.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field, replace
from typing import TypeVar

from egress.errors import EgressError, JournalError, SandboxError
from egress.freeze.attribution import attribute
from egress.kernel.cgroup import Cgroup
from egress.model import Action, Mode, Policy, Violation
from egress.store.intents import Intent
from egress.store.journal import Journal, Retried
from egress.store.journal_schema import violation_key

_T = TypeVar("_T")
DEDUP_WINDOW_S = 2.0  # two layers' sightings of one packet fall well within this
RETRY_S = 1.0  # after SQLite refused a retry of the records it refused before


@dataclass(frozen=True)
class Begun:
    """What ``Enforcer.begin`` did for a freeze-worthy violation, for ``finish`` to commit:
    its intent durable, then the cgroup (``paths``: the binding then) asked to freeze,
    and confirmed at ``confirmed``; or not yet, and ``confirming`` waits for it (or,
    without one, ``finish`` does); or the ask failed with ``error`` (raised by
    ``finish`` once the record is committed)."""

    violation: Violation
    key: str
    intent: Intent
    asked: float
    confirmed: float | None
    error: Exception | None = None
    paths: tuple[str, str | None] = ("", None)
    confirming: Future[float] | None = None


def _confirmed_at(cgroup: Cgroup) -> float:
    """When the kernel confirmed the freeze ``freeze_soon`` asked of ``cgroup``."""
    at = time.time()
    return at + cgroup.freeze(asked=True)


@dataclass
class FreezeEvent:
    """What a layer did about one freeze-worthy violation."""

    violation: Violation
    violation_id: int | None
    latency_ms: float  # detection -> the kernel reports the cgroup frozen
    process: dict[str, object] = field(default_factory=dict)
    # The journal's freeze it joined: one per freeze, every layer's request in it, until
    # a decision closes it (a person's, or the decision timeout's kill). None while not
    # journaled (SQLite refused its record): the retry fills it in on this event.
    freeze_id: int | None = None


class Enforcer:
    def __init__(
        self,
        sandbox_id: str,
        policy: Policy,
        layer: str,
        journal: Journal,
        cgroup: Cgroup,
        on_freeze: Callable[[FreezeEvent], None] | None = None,
        *,
        intents: bool = True,
    ) -> None:
        """``intents``: freeze once the record is durable in this process's intent file
        (store/intents.py); False: once SQLite has committed it (both paths are kept:
        the second is where no intent file can be made, or no slot is free)."""
        self.sandbox_id = sandbox_id
        self.policy = policy
        self.layer = layer
        self.journal = journal
        self.cgroup = cgroup
        self.on_freeze = on_freeze
        # Told when a freeze's record SQLite had refused is committed by the retry, its
        # event's ids filled in (the inline layer's review compares freeze ids).
        self.on_journaled: Callable[[FreezeEvent], None] | None = None
        self.freezes: list[FreezeEvent] = []
        self.frozen_keys: set[str] = set()
        self.journal_errors = 0
        self.intents = intents
        self._retry_at = 0.0  # monotonic: retry_pinned waits until then after a refusal
        # What a freeze whose record SQLite refused knew (when the kernel confirmed it,
        # who did it), by violation key: journaled once the retry commits the record.
        self._unjournaled: dict[str, tuple[float, FreezeEvent]] = {}
        # Held by handle and the retry: the inline layer retries on its writer thread,
        # and a retry between a refusal and _unjournaled's entry would lose the entry.
        self._acting = threading.RLock()
        # The confirmation begin handed to a confirmer, and the binding it waits on.
        self._pending: tuple[tuple[str, str | None], Future[float]] | None = None
        try:
            if intents:
                journal.open_intents()  # a freeze then waits for no SQLite commit
        except JournalError as exc:
            self.intents = False  # begin does nothing then: finish does it all
            print(f"egress {layer}: {exc}; freezes commit to SQLite first", file=sys.stderr)

    def wants_freeze(self, v: Violation) -> bool:
        return self.policy.mode is Mode.ENFORCE and v.action is Action.FREEZE

    def handle(self, v: Violation) -> FreezeEvent | None:
        """Journal ``v`` and act on it; returns the freeze it caused, if any. Then, if the
        journal took what this did, ``retry_pinned``."""
        return self.finish(v, self.begin(v))

    def begin(self, v: Violation, confirmer: Executor | None = None) -> Begun | None:
        """The part of ``handle`` that waits for no lock and no slow workload: for a
        freeze-worthy violation, with a cgroup bound and an intent slot free, the intent's
        write (one O_DSYNC block), the freeze's ask, and a look for the kernel's
        confirmation as short as ``Cgroup.freeze_soon``'s; if that did not see it, the
        wait for it is handed to ``confirmer`` (it starts now, whatever ``finish`` waits
        behind), or else left to ``finish``. None where it did nothing (no freeze
        wanted, this flow froze it already, no cgroup bound yet, no intent written):
        ``finish`` does it all then. The cgroup is not looked for again here (a walk of
        /proc, and in the sidecar a journal commit of what it found): ``finish`` does,
        and freezes what it finds. Every violation given here must then be given to
        ``finish``, in the order decided, on one thread."""
        if not (self.intents and self.wants_freeze(v)):
            return None
        key = violation_key(v)
        if self.seen_before(v) or not self.cgroup.bound:
            return None
        paths = (self.cgroup.v2_path, self.cgroup.freezer_path)
        asked = time.time()
        intent = self._try(
            lambda: self.journal.write_intent(self.sandbox_id, v, DEDUP_WINDOW_S, asked)
        )
        if intent is None:
            return None
        try:
            at = time.time()
            soon = self.cgroup.freeze_soon()
        except Exception as exc:  # the intent is durable: finish commits it, then raises
            return Begun(v, key, intent, asked, None, exc, paths)
        confirmed = None if soon is None else at + soon
        confirming = None
        if confirmed is None and confirmer is not None:
            confirming = self._confirming(paths, confirmer)
        # Now, not at the commit: a repeat of this flow decided before finish ran is a
        # sighting, journaled by finish after this one's record (the order given).
        self.frozen_keys.add(key)
        return Begun(v, key, intent, asked, confirmed, None, paths, confirming)

    def _confirming(
        self, paths: tuple[str, str | None], confirmer: Executor
    ) -> Future[float] | None:
        """The wait for the kernel's confirmation of the freeze asked of ``paths``, on
        ``confirmer``: one at a time for the sandbox (an ask of the same binding while
        one waits is confirmed by the same moment); None where none could start (a
        thread refused: finish waits then)."""
        pending = self._pending
        if pending is not None and pending[0] == paths and not pending[1].done():
            return pending[1]
        try:
            future = confirmer.submit(_confirmed_at, Cgroup(*paths))
        except RuntimeError as exc:
            print(f"egress {self.layer}: sandbox {self.sandbox_id}: {exc}; its freeze is "
                  "confirmed after its commit", file=sys.stderr)  # fmt: skip
            return None
        self._pending = (paths, future)
        return future

    def seen_before(self, v: Violation) -> bool:
        """``v`` repeats a flow that froze the sandbox already: a sighting to journal."""
        return violation_key(v) in self.frozen_keys

    def finish(self, v: Violation, begun: Begun | None) -> FreezeEvent | None:
        """The rest of ``handle`` for ``v``, after ``begin`` returned ``begun``: the SQLite
        commits and the attribution; all of it where ``begun`` is None."""
        with self._acting:
            errors = self.journal_errors
            event = self._handle(v) if begun is None else self._fold(begun)
            if self.journal_errors == errors:
                self.retry_pinned()
            return event

    def retry_pinned(self) -> int:
        """Commit this sandbox's records SQLite refused before (pinned in the intent file,
        Journal.commit_pinned), if there are any and the write lock is free; how many it
        committed. Called after each violation the journal takes, where that was handled,
        and on the layer's tick (a frozen sandbox makes no more violations): the inline
        layer's on its journal writer thread, as the journal's own lock may be held there
        as long as SQLite's busy timeout. Each commit
        opens a freeze, so the cgroup is frozen again if something thawed it meanwhile
        (a person's resume found no freeze open); one that joins a freeze a person
        resumed already is settled as the layer's own commit would have been. After a
        refusal, the next try waits RETRY_S (one line on stderr each, not ten a second).
        Not while this layer finishes a violation of the sandbox in another thread (the
        inline layer's loop, in `egressctl run`): that one retries once it is done."""
        if not self.journal.has_pinned(self.sandbox_id):  # the usual case: no lock, no read
            return 0
        if time.monotonic() < self._retry_at or not self._acting.acquire(blocking=False):
            return 0
        try:  # held while it commits (busy timeout 0) and takes what the layer knew
            errors = self.journal_errors
            refroze: list[bool] = []  # what each _freeze_if_thawed did
            thawed = lambda: refroze.append(self._freeze_if_thawed())  # noqa: E731
            commit = lambda: self.journal.commit_pinned(False, self.sandbox_id, thawed)  # noqa: E731
            committed = self._try(commit) or []
            if self.journal_errors != errors:
                self._retry_at = time.monotonic() + RETRY_S
            knew = [self._unjournaled.pop(violation_key(r.violation), None) for r in committed]
        finally:
            self._acting.release()
        again = self._confirm_refreeze() if any(refroze) else None
        for retried, known in zip(committed, knew, strict=True):
            self._journal_what_it_knew(retried, known, again)
            if retried.freeze_id is None:  # it joined a freeze a person had resumed
                self._settle_joined(retried.violation_id)
        return len(committed)

    def _confirm_refreeze(self) -> float | None:
        """When the kernel confirms the freeze _freeze_if_thawed asked (under the lock,
        unconfirmed); None where it can't be told."""
        try:
            at = time.time()
            return at + self.cgroup.freeze()
        except SandboxError as exc:
            print(f"egress {self.layer}: sandbox {self.sandbox_id}: {exc}", file=sys.stderr)
            return None

    def _journal_what_it_knew(
        self,
        retried: Retried,
        known: tuple[float, FreezeEvent] | None,
        refrozen: float | None,
    ) -> None:
        """A retried record's freeze as the layer saw it when SQLite refused the record
        (``known``): the kernel's confirmation (on the freeze it opened) and the process.
        Where the retry froze again (something had thawed it meanwhile), that freeze's
        confirmation (``refrozen``) is the one that stands."""
        fid, vid = retried.freeze_id, retried.violation_id
        confirmed = refrozen if refrozen is not None else known[0] if known else None
        if fid is not None and confirmed is not None:
            latency_ms = (confirmed - retried.violation.at) * 1000
            self._try(lambda: self.journal.confirm_freeze(fid, confirmed, latency_ms, self.layer))
        if known is not None:
            event = known[1]
            if event.process:
                self._try(lambda: self.journal.attach_process(vid, event.process))
            event.violation_id, event.freeze_id = vid, fid
            if self.on_journaled is not None:
                self.on_journaled(event)

    def _settle_joined(self, violation_id: int) -> None:
        """As _fold does for a commit that joined a resumed freeze: thawed again, if
        nothing else of the sandbox is open (Journal.thaw_if_resumed)."""
        decided = self._try(lambda: self.journal.decided_freeze(violation_id))
        if decided is not None:
            self._resumed_before_it_landed(decided)

    def release_pinned(self) -> None:
        """The layer stops watching this sandbox (deleted, or handed on) while the process
        goes on: commit its refused records now, without freezing again, rather than
        leave them to the process's end, each holding a slot of its intent file."""
        with self._acting:
            for retried in (
                self._try(lambda: self.journal.commit_pinned(False, self.sandbox_id)) or []
            ):
                known = self._unjournaled.pop(violation_key(retried.violation), None)
                self._journal_what_it_knew(retried, known, None)
            self._unjournaled.clear()  # kept aside, or pinned still: no retry of ours comes

    def _freeze_if_thawed(self) -> bool:
        """Under the journal's write lock: asked, not waited for; True when it asked. A
        cgroup that can't be read or written (its sandbox being removed) leaves the
        commit as it is."""
        try:
            if self.cgroup.is_frozen():
                return False
        except SandboxError as exc:
            print(f"egress {self.layer}: sandbox {self.sandbox_id}: {exc}; not frozen again",
                  file=sys.stderr)  # fmt: skip
            return False
        print(f"egress {self.layer}: sandbox {self.sandbox_id} was thawed while its "
              "freeze was not yet journaled: frozen again", file=sys.stderr)  # fmt: skip
        self._freeze_again()
        return True

    def _handle(self, v: Violation) -> FreezeEvent | None:
        if not self.wants_freeze(v):
            self._try(lambda: self.journal.record_or_detect(self.sandbox_id, v, DEDUP_WINDOW_S))
            return None
        key = violation_key(v)
        if key in self.frozen_keys:
            # The same flow again (a SYN retransmit, a retried query): it already froze the
            # sandbox once, and a person has seen it or is about to. Journal the sighting.
            self._try(lambda: self.journal.record_or_detect(self.sandbox_id, v, DEDUP_WINDOW_S))
            return None
        if not self.cgroup.bind(refresh=True):
            # Attached without a cgroup (a CNI ADD), and none qualifies now (looked for
            # again at each new freeze, so it covers every process there): the kernel
            # blocked it; the journal says it could not be frozen, and why.
            unfrozen = replace(
                v,
                action=Action.BLOCK,
                detail=f"{v.detail}; not frozen: {self.cgroup.unbound_reason}",
            )
            self._try(
                lambda: self.journal.record_or_detect(self.sandbox_id, unfrozen, DEDUP_WINDOW_S)
            )
            return None
        begun = self.begin(v)  # bound now: through the intent file, if a slot is free
        if begun is not None:
            return self._fold(begun, looked=True)
        asked = time.time()
        # Journal before act (no intent written): the violation and the freeze request,
        # in one durable commit.
        recorded = self._try(
            lambda: self.journal.record_for_freeze(self.sandbox_id, v, DEDUP_WINDOW_S, asked)
        )
        if recorded is not None and recorded[2] is None:
            return None  # the other layer froze for it and a person has already decided
        # A journal that can't write must not stop the freeze (fail closed).
        vid, fid = (recorded[0], recorded[2]) if recorded is not None else (None, None)
        event = self.freeze(v, vid, fid)
        self.frozen_keys.add(key)  # only once it froze: a failed freeze is tried again
        return event

    def _fold(self, begun: Begun, looked: bool = False) -> FreezeEvent | None:
        """Journal before act through the intent file (store/intents.py): ``begin`` asked
        the freeze once the record was durable there; now (its confirmation waited for
        first, if begin did not read it) commit it to SQLite as the other path does
        before its freeze (an intent SQLite refuses is committed later, Journal). No read
        came before the freeze, so a late sighting of a violation whose freeze a person
        has resumed freezes for the commit's length, then thaws again. ``looked``: the
        cgroup was just looked for (bind(refresh=True)) before ``begin``."""
        v, key = begun.violation, begun.key
        error, confirmed = begun.error, begun.confirmed
        try:
            # Processes found from its netns may have spread since begin's binding, or
            # its cgroup gone with them (looked for again at each new freeze): what is
            # found now is frozen, first, whatever became of begin's ask.
            if not looked:
                self.cgroup.bind(refresh=True)
            if (self.cgroup.v2_path, self.cgroup.freezer_path) != begun.paths:
                at = time.time()
                confirmed, error = at + self.cgroup.freeze(), None
                if begun.confirming is not None:  # settled first: it may ask again
                    wait([begun.confirming])
                self._let_go(begun.paths)
            elif error is None:
                if confirmed is None and begun.confirming is not None:
                    confirmed = begun.confirming.result()
                if confirmed is None:  # confirmed, however long it takes
                    at = time.time()
                    confirmed = at + self.cgroup.freeze(asked=True)
        except Exception as exc:
            error = exc
        if error is None:
            self.frozen_keys.add(key)  # begin's, or the binding found since
        elif begun.error is None:
            self.frozen_keys.discard(key)  # not frozen: the flow seen again tries again
        recorded = self._try(
            lambda: self.journal.record_for_freeze(
                self.sandbox_id, v, DEDUP_WINDOW_S, begun.asked, begun.intent
            )
        )
        if error is not None:
            raise error
        assert confirmed is not None  # what the freeze's ask or its wait read
        vid, fid = (recorded[0], recorded[2]) if recorded is not None else (None, None)
        if recorded is not None and fid is None:
            # The other layer froze for it and a person resumed that freeze before this
            # one landed: thaw again, as _resumed_before_it_landed does.
            decided = self._try(lambda: self.journal.decided_freeze(recorded[0]))
            if decided is not None:
                self._resumed_before_it_landed(decided)
            return None
        if not self.cgroup.is_frozen():
            # Thawed between this freeze and its commit, or its refusal: the other layer
            # settling a resumed freeze (thaw_if_resumed) looked for open freezes and
            # pending intents before this intent was written, and thawed after this
            # freeze. That layer looks again after its thaw and freezes again; this is
            # the same mend from this side, for a thaw that came before this look.
            at = time.time()
            confirmed = at + self.cgroup.freeze()
        event = self._frozen(v, vid, fid, confirmed)
        if recorded is None and event is not None and self.journal.has_pinned(self.sandbox_id):
            self._unjournaled[key] = (confirmed, event)  # for the retry (retry_pinned)
        return event

    def _let_go(self, paths: tuple[str, str | None]) -> None:
        """The binding begin froze (``paths``), now that the one found since is frozen:
        where it lies below or above that one, its own freeze is thawed
        (Cgroup.let_go_of), as a person's resume thaws only the binding and would leave
        it standing with nothing to decide; elsewhere it stays frozen, for a person to
        see."""
        try:
            self.cgroup.let_go_of(*paths)
        except SandboxError as exc:
            print(f"egress {self.layer}: sandbox {self.sandbox_id}: could not thaw "
                  f"{paths[0]}, bound before {self.cgroup.v2_path}: {exc}",
                  file=sys.stderr)  # fmt: skip

    def freeze(self, v: Violation, vid: int | None, fid: int | None) -> FreezeEvent | None:
        asked = time.time()
        # When this call first read it frozen (v1 may still be asked after that moment).
        return self._frozen(v, vid, fid, asked + self.cgroup.freeze())

    def _frozen(
        self, v: Violation, vid: int | None, fid: int | None, confirmed: float
    ) -> FreezeEvent | None:
        """The cgroup read frozen at ``confirmed``: journal that, then who did it."""
        latency_ms = (confirmed - v.at) * 1000
        if fid is not None:
            self._try(lambda: self.journal.confirm_freeze(fid, confirmed, latency_ms, self.layer))
            if self._resumed_before_it_landed(fid):
                return None  # a person had resumed it already: the other layer's freeze
        process = attribute(v, self.cgroup.pids())
        if vid is not None:
            self._try(lambda: self.journal.attach_process(vid, process))
        event = FreezeEvent(v, vid, latency_ms, process, fid)
        self.freezes.append(event)
        if self.on_freeze is not None:
            self.on_freeze(event)
        return event

    def _resumed_before_it_landed(self, fid: int) -> bool:
        """Thawed again: a person resumed this freeze before this layer's write reached
        the cgroup (Journal.thaw_if_resumed). A thaw that fails leaves it frozen, and
        reviewed as any freeze is."""
        try:
            return self.journal.thaw_if_resumed(
                fid, self.layer, lambda: self.cgroup.thaw(wait=False), self._freeze_again
            )
        except JournalError as exc:
            self.journal_errors += 1
            print(f"egress {self.layer}: journal: {exc}", file=sys.stderr)
        except SandboxError as exc:
            print(f"egress {self.layer}: could not thaw a freeze already resumed: {exc}",
                  file=sys.stderr)  # fmt: skip
        return False

    def _freeze_again(self) -> None:
        """A thaw undid a freeze another layer made from an intent (thaw_if_resumed), or
        one whose record was pinned (retry_pinned): asked again, not waited for, as the
        journal's write lock is held."""
        try:
            self.cgroup.ask_freeze()
        except SandboxError as exc:
            print(f"egress {self.layer}: could not freeze again after a thaw: {exc}",
                  file=sys.stderr)  # fmt: skip

    def _try(self, call: Callable[[], _T]) -> _T | None:
        try:
            return call()
        except EgressError as exc:
            self.journal_errors += 1
            print(f"egress {self.layer}: journal: {exc}", file=sys.stderr)
            return None
