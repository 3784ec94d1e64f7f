"""Where a freeze's confirmation is waited for when egressd's loop asked it
(``Enforcer.begin``, from the inline layer's session) and must not wait itself."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class ThreadEach(Executor):
    """A thread each (one a sandbox at a time, Enforcer._confirming; at most an intent
    slot each), so that a workload slow to stop is confirmed, and v1 asked again
    (Cgroup._wait), while its session's journal writer may still be committing, and no
    other sandbox's confirmation waits behind it."""

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future: Future[T] = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # the future's reader raises it
                    future.set_exception(exc)

        threading.Thread(target=run, name="egress-confirm", daemon=True).start()
        return future


CONFIRMER = ThreadEach()
