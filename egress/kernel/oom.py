"""The host's OOM killer: egress's layers are the last it picks, and a workload cannot
make itself so.

Without ``spec.limits.memory`` a workload that takes the host's memory leaves the choice of
what to kill to the kernel, which picks the largest process: at a thousand sandboxes that
is egressd. Killing either layer is a ``layer_loss``; killing both leaves the sandboxes to
the kernel's rules alone (default deny holds, but nothing answers DNS or freezes).
"""

from __future__ import annotations

import os
import sys

SELF = "/proc/self/oom_score_adj"
# As dockerd and containerd take; -1000 (never) is left to an operator who means it.
LAYER_SCORE = -999


def shelter(who: str, say: bool = True) -> None:
    """Lower this process's oom_score_adj to LAYER_SCORE, unless it is lower already; its
    threads and children (the nft worker, the observer's shards) inherit it. Called
    before any of them starts. The kernel allows it only with CAP_SYS_RESOURCE (a VM's or
    container's root may lack it): then go on, and say so if ``say`` (a daemon, once at
    its start; not each ``egressctl run``, where the sandboxes' parent cgroup's memory
    cap keeps their own bombs' OOM kills among them anyway)."""
    try:
        with open(SELF) as f:
            current = int(f.read())
        if current <= LAYER_SCORE:
            return
        with open(SELF, "w") as f:
            f.write(str(LAYER_SCORE))
    except (OSError, ValueError) as exc:
        if not say:
            return
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        print(f"{who}: its oom_score_adj stays as it was ({why}): when the host runs out of "
              "memory its OOM killer may pick it (run it with CAP_SYS_RESOURCE, or "
              f"OOMScoreAdjust={LAYER_SCORE} in its unit)",
              file=sys.stderr, flush=True)  # fmt: skip


def unshelter() -> None:
    """In a workload's child, still root, between fork and exec (plain syscalls only): its
    oom_score_adj to 0 if it inherited less. Written by root with CAP_SYS_RESOURCE it is
    also the least the workload may set itself later (the kernel's oom_score_adj_min)."""
    fd = os.open(SELF, os.O_RDWR)
    try:
        current = int(os.read(fd, 16))
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, str(max(current, 0)).encode())
    finally:
        os.close(fd)
