"""Scheduling as the tests see it: the threads under a process and their policies."""

from __future__ import annotations

import os
from contextlib import suppress
from pathlib import Path


def tasks_under(pid: int) -> tuple[list[int], list[int]]:
    """(every thread of ``pid`` and of its descendants, the descendants' pids); what
    ends meanwhile is left out."""
    threads: list[int] = []
    children: list[int] = []
    with suppress(FileNotFoundError, ProcessLookupError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            threads.append(int(tid))
            with suppress(FileNotFoundError):
                for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split():
                    more_threads, more_children = tasks_under(int(child))
                    threads += more_threads
                    children += [int(child), *more_children]
    return threads, children


def policies(threads: list[int]) -> set[int]:
    """Their scheduling policies, a reset-on-fork flag left out (of those still there)."""
    out = set()
    for tid in threads:
        with suppress(ProcessLookupError):
            out.add(os.sched_getscheduler(tid) & ~os.SCHED_RESET_ON_FORK)
    return out
