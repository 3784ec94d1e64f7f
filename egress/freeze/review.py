"""A person's resume of a frozen sandbox, as `egressctl resume` and egressd's API take it.

Journal.resume journals the decision, thaws and looks again under the journal's write lock
(a freeze journaled in between is made again); this module gives it the cgroup's writes,
waits for the thaw, and says in one way, for both, why a sandbox stays frozen.
"""

from __future__ import annotations

import time

from egress.errors import Conflict, JournalError, SandboxError
from egress.kernel.cgroup import Cgroup
from egress.store.journal import FROZEN_AGAIN, STILL_PENDING, Journal

THAW_S = 2.0  # the kernel reports a thaw in well under a millisecond


class StillFrozen(Conflict):
    """The resume is journaled, and the sandbox stays frozen (egressctl exits 1; egressd
    answers 409): another freeze of it waits for a decision, or is about to."""


def resume(journal: Journal, cgroup: Cgroup, sandbox_id: str, uid: int, note: str) -> None:
    """Journal ``uid``'s resume of ``sandbox_id``, thaw it and wait until the kernel says
    so; StillFrozen, saying why and what to do, where it stays frozen."""
    failed: list[SandboxError] = []

    def freeze_again() -> None:  # under the journal's lock: asked, not waited for
        try:
            cgroup.ask_freeze()
        except SandboxError as exc:
            failed.append(exc)

    see = f"egressctl journal --sandbox {sandbox_id}"
    try:
        why = journal.resume(sandbox_id, uid, time.time(), lambda: cgroup.thaw(wait=False),
                             freeze_again, note)  # fmt: skip
    except JournalError as exc:
        if not failed:
            raise  # nothing thawed; or the look refused, and it was frozen again (fail closed)
        why = str(exc)  # nor could it be frozen again: both are said
    if failed:
        raise SandboxError(f"sandbox {sandbox_id}: resumed, but it could not be frozen again "
                           f"for a freeze that may have come meanwhile ({why}): {failed[0]} "
                           f"({see})")  # fmt: skip
    if why == STILL_PENDING:
        raise StillFrozen(f"sandbox {sandbox_id}: resume journaled, but it stays frozen: {why}. "
                          f"Once it is, `{see}` shows it; if no freeze is open there, resume "
                          "again")  # fmt: skip
    if why == FROZEN_AGAIN:
        raise StillFrozen(f"sandbox {sandbox_id}: resume journaled, but it stays frozen: {why}, "
                          f"and waits for a decision of its own ({see})")  # fmt: skip
    try:
        cgroup.wait_thawed(THAW_S)
    except SandboxError:
        if journal.freeze_held(sandbox_id):
            raise StillFrozen(f"sandbox {sandbox_id}: resumed, then frozen again by a newer "
                              f"violation ({see})") from None  # fmt: skip
        raise
