"""Violation packet -> cgroup frozen (kernel confirms), per layer alone and both.

A workload in a lab sandbox sends one blocked UDP datagram each time the bench writes a
byte to its stdin; the bench then waits until the journal shows the freeze confirmed,
resumes the sandbox, and goes again. Latency = confirmation time - the moment the bench
asked for the packet (so it includes a pipe wake-up of ~0.05 ms).

``--spinners N``: the workload first starts N processes that each call setsid and spin,
the attack on the layers' share of the CPUs where the kernel weighs tasks by session
(autogroups); a sandbox's tasks join its cpu cgroup where there is one (kernel/cgroup.py),
so all of them weigh as one.

    .venv/bin/python bench/bench_freeze.py [-n 200] [--spinners 0]

Also prints journal write throughput (violations committed per second).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from egress.datapath import constants as c
from egress.datapath.addressing import Pools
from egress.datapath.evidence import drop_class, drop_violation
from egress.freeze import review
from egress.freeze.enforcer import Enforcer
from egress.kernel.cgroup import Cgroup
from egress.kernel.nflog import NflogListener
from egress.lab import Lab
from egress.policy import parse_policy
from egress.sandbox import lifecycle as sbx
from egress.store.journal import Journal

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: bench-freeze}
spec:
  dns: {upstreams: ["198.51.100.53"], allow: []}
  violations: {blocked_connect: freeze}
"""
WORKLOAD = (
    "import os,socket,sys,time\n"
    "for _ in range(int(sys.argv[1])):\n"  # --spinners
    "    if os.fork() == 0:\n"
    "        os.setsid()\n"
    "        while True: pass\n"
    "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
    "print('ready', flush=True)\n"
    "port=1000\n"
    "while sys.stdin.buffer.read(1):\n"
    "    port+=1\n"  # a new flow each time: a layer freezes once per flow
    "    t=time.time()\n"  # the moment of the violation, as the workload saw it
    "    try: s.sendto(b'x',('203.0.113.99',port))\n"
    "    except OSError: pass\n"
    "    print(repr(t), flush=True)\n"
)


def join(procs: list[str]) -> None:
    for path in procs:
        with open(path, "w") as f:
            f.write(str(os.getpid()))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def inline_process(sandbox_id: str, netns: str, state: str, ready: Any, stop: Any) -> None:
    """The inline layer's NFLOG reader and Enforcer, in a process of its own (as in
    `egressctl run`), so the bench's own polling does not share its interpreter."""
    import select

    policy, _ = parse_policy(POLICY, "<bench>")
    enforcer = Enforcer(sandbox_id, policy, "inline", Journal.open(state), Cgroup.open(sandbox_id))
    listener = NflogListener.open(netns, c.INLINE_GROUP)
    poll = select.poll()
    poll.register(listener.fileno(), select.POLLIN)
    ready.set()
    while not stop.is_set():
        if poll.poll(50):
            for e in listener.read_events():
                cls = drop_class(e.prefix)
                if cls:
                    v = drop_violation(policy, cls, e.flow, e.uid, e.timestamp, "inline")
                    enforcer.handle(v)
    listener.close()


def measure(
    mode: str, n: int, lab: Lab, state: Path, spinners: int = 0
) -> tuple[list[float], list[float]]:
    """Per freeze, ms to the kernel's confirmation from the bench's byte and from the
    workload's send (the time it read just before it)."""
    policy, _ = parse_policy(POLICY, "<bench>")
    sb = sbx.create(policy, Pools.parse(None), lab.uplink_netns)
    journal = Journal.open(state)
    journal.record_sandbox(sb.id, policy.name, netns=sb.netns)
    stops: list[tuple[Any, Any]] = []
    observer = None
    rounds: list[tuple[int, float]] = []  # (freeze id, when the violation was asked for)
    sent: list[tuple[int, float]] = []  # (freeze id, when the workload sent it)
    try:
        if mode in ("inline", "both"):
            ctx = multiprocessing.get_context("spawn")  # no SQLite state across a fork
            ready, stop_evt = ctx.Event(), ctx.Event()
            inline = ctx.Process(
                target=inline_process, args=(sb.id, sb.netns, str(state), ready, stop_evt)
            )
            inline.start()
            ready.wait(30)
            stops.append((inline, stop_evt))
        if mode in ("observer", "both"):
            pfile = state / f"{sb.id}.yaml"
            pfile.write_text(POLICY)
            observer = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "egress.cli.main",
                    "observe",
                    "--sandbox",
                    sb.id,
                    "--netns",
                    sb.netns,
                    "--policy",
                    str(pfile),
                    "--state-dir",
                    str(state),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert observer.stdout is not None and observer.stdout.readline().strip() == "ready"
        procs = sb.cgroup.procs_files
        work = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                sb.netns,
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "/usr/bin/python3",
                "-c",
                WORKLOAD,
                str(spinners),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            preexec_fn=lambda: join(procs),
        )
        assert work.stdout is not None
        work.stdout.readline()  # "ready": python has started inside the sandbox
        assert work.stdin is not None
        paced = Paced()
        for _ in range(n):
            paced.wait()
            before = newest_freeze(journal, sb.id)
            t0 = time.time()
            work.stdin.write(b"x")
            work.stdin.flush()
            rounds.append((await_confirmed_freeze(journal, sb.id, before), t0))
            if mode == "both":  # resume only once both layers have seen it
                await_two_sightings(journal, sb.id)
            review.resume(journal, sb.cgroup, sb.id, 0, "bench")  # as egressctl resume
            line = work.stdout.readline()  # its send's time; then it waits for the next byte
            try:
                sent.append((rounds[-1][0], float(line)))
            except ValueError:
                raise RuntimeError(f"the workload lost its round: {line!r}") from None
        work.stdin.close()
        sb.cgroup.kill()
        work.wait()
    finally:
        for proc, evt in stops:
            evt.set()
            proc.join(10)
        if observer:
            observer.terminate()
            observer.wait()
        journal.close()
        sb.destroy()
    return confirmed_ms(state, rounds), confirmed_ms(state, sent)


class Paced:
    """Rounds no faster than half the rate the ruleset logs drops at (c.LOG_RATE, burst
    c.LOG_BURST): a round takes ~2 ms now, and past the burst the log would skip drops,
    which the inline layer then never sees (the observer finds them in the counter)."""

    def __init__(self) -> None:
        per_s = int(c.LOG_RATE.split("/")[0])
        self.gap = 2.0 / per_s
        self.next = 0.0

    def wait(self) -> None:
        now = time.monotonic()
        if now < self.next:
            time.sleep(self.next - now)
        self.next = max(now, self.next) + self.gap


def durable_write_ms(directory: Path, n: int) -> list[float]:
    """The disk's part of a freeze: a layer's intent is one write of a 4 KiB block
    already written, to a file opened O_DSYNC (store/intents.py), before it freezes.
    The same write here, ``n`` times, paced as the freeze rounds are (an idle disk's
    first flush costs more: on the dev VM ~0.1 ms back to back, ~0.45 after 20 ms)."""
    path = directory / f"durable-write-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DSYNC | os.O_CLOEXEC, 0o600)
    try:
        block = bytes(4096)
        os.pwrite(fd, block, 0)  # allocated and on disk: later writes flush no metadata
        paced = Paced()
        took = []
        for i in range(n):
            paced.wait()
            start = time.perf_counter()
            os.pwrite(fd, i.to_bytes(8, "little") + block[8:], 0)
            took.append((time.perf_counter() - start) * 1000)
        return took
    finally:
        os.close(fd)
        path.unlink()


def newest_freeze(journal: Journal, sandbox_id: str) -> int:
    """The id of the sandbox's newest freeze (0: none yet): what a round waits to pass."""
    rows = journal.freezes(sandbox_id, limit=1)
    return int(rows[0]["id"]) if rows else 0


def await_confirmed_freeze(journal: Journal, sandbox_id: str, before: int) -> int:
    """Until the journal holds a freeze newer than ``before`` (newest_freeze's id),
    confirmed by the kernel; returns its id. It looks once a millisecond, with a one-row
    read, so the bench does not take the CPUs the path it measures needs (on 2 vCPUs a
    0.2 ms loop reading every freeze row added ~0.3 ms to the p50 it printed)."""
    deadline = time.monotonic() + 5
    while True:
        if time.monotonic() > deadline:
            raise RuntimeError("no confirmed freeze within 5 s")
        rows = journal.freezes(sandbox_id, limit=1)
        if rows and int(rows[0]["id"]) > before and rows[0].get("confirmed_at"):
            return int(rows[0]["id"])
        time.sleep(0.001)


def confirmed_ms(state: Path, rounds: list[tuple[int, float]]) -> list[float]:
    """For each (freeze id, t0) round, ms from t0 (when the violation was asked for) to
    the kernel's confirmation as journaled. Read once the layers have stopped: the
    journal keeps the earliest of both layers' confirmations, and the layer that froze
    first may journal its confirmation after the other's."""
    with Journal.open(state) as journal:
        got = {int(f["id"]): f["confirmed_at"] for f in journal.freezes(limit=1_000_000)}
    return [float((got[fid] - t0) * 1000) for fid, t0 in rounds]


def own_ms(state: Path, rounds: list[tuple[int, float]]) -> list[float]:
    """For each round's freeze, the journal's ``latency_ms``: from the moment the first
    layer read the violation (its ``at``) to the kernel's confirmation. What the bench's
    figure holds before it (the pipe's wake-up of the workload, its send, the kernel's
    copy to the layers and their wake-up) is the difference."""
    with Journal.open(state) as journal:
        got = {int(f["id"]): f["latency_ms"] for f in journal.freezes(limit=1_000_000)}
    return [float(got[fid]) for fid, _ in rounds]


def await_two_sightings(journal: Journal, sandbox_id: str) -> None:
    """Until both layers have seen the newest violation and each one that asked for the
    freeze has confirmed it (a resume before the second one's freeze lands would have
    that layer thaw it again, as it must, overlapping the next round)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        newest = journal.violations(sandbox_id, limit=1)
        freeze = journal.freezes(sandbox_id, limit=1)
        if (
            newest
            and len(newest[0]["detected_by"]) >= 2
            and freeze
            and all("confirmed_at" in ask for ask in freeze[0]["requested_by"])
        ):
            return
        time.sleep(0.0005)
    raise RuntimeError("the second layer did not see and freeze within 5 s")


def journal_throughput(state: Path, n: int = 2000) -> float:
    from egress.model import Action, Violation, ViolationClass

    j = Journal.open(state / "tp")
    j.record_sandbox("tp", "tp")
    start = time.perf_counter()
    for i in range(n):
        j.record_violation(
            "tp",
            Violation(
                cls=ViolationClass.BLOCKED_CONNECT,
                layer="inline",
                rule="r",
                detail=f"d{i}",
                at=time.time(),
                action=Action.BLOCK,
            ),
        )
    rate = n / (time.perf_counter() - start)
    j.close()
    return rate


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--modes", default="inline,observer,both", help="comma-separated layers")
    ap.add_argument(
        "--spinners",
        type=int,
        default=0,
        help="busy processes the workload starts, each in a session of its own",
    )
    args = ap.parse_args()
    state = Path(tempfile.mkdtemp(prefix="egress-bench-freeze-"))
    lab = Lab.up(name="egbf")
    try:
        busy = f", the workload spinning in {args.spinners} sessions" if args.spinners else ""
        print(f"violation packet -> cgroup frozen (kernel confirms), n={args.n} each{busy}")
        for mode in args.modes.split(","):
            lat, from_send = measure(mode, args.n, lab, state, args.spinners)
            p50, p99 = statistics.median(lat), pct(lat, 0.99)
            print(f"  {mode:<9} p50 {p50:6.2f} ms   p99 {p99:6.2f} ms   max {max(lat):6.2f} ms"
                  f"   (from the workload's send: p50 {statistics.median(from_send):.2f} ms, "
                  f"p99 {pct(from_send, 0.99):.2f} ms)")  # fmt: skip
        disk = durable_write_ms(state, args.n)
        print(f"  the disk alone: a durable 4 KiB write (O_DSYNC), paced alike: p50 "
              f"{statistics.median(disk):.2f} ms   p99 {pct(disk, 0.99):.2f} ms")  # fmt: skip
        rate = journal_throughput(state)
        print(f"journal write throughput: {rate:,.0f} violations/s (one fsync per commit)")
    finally:
        lab.down()
        shutil.rmtree(state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
