"""What journal-before-act costs: the fsync'd commit in front of every freeze.

Times ``Journal.record_violation`` (WAL, synchronous=FULL: each call returns only after
its commit is fsync'd) N times from one writer, then N per writer from two processes
writing the same journal at once. Prints median / p99 / max latency and throughput.
Uses a temporary directory (``--dir`` picks where: the figures are those of that
filesystem; on tmpfs fsync is free and they mean nothing) and removes it.

    python bench/bench_journal.py [-n 2000] [--dir /var/lib]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path

from egress.model import Action, Flow, Violation, ViolationClass
from egress.store.journal import Journal


def _violation(layer: str, i: int) -> Violation:
    flow = Flow("tcp", "10.0.0.2", "203.0.113.7", 40000 + i % 20000, 443)
    return Violation(
        cls=ViolationClass.BLOCKED_CONNECT,
        layer=layer,
        rule="no connect.allow rule matches",
        detail=f"tcp connect to 203.0.113.7:443 (#{i})",
        at=time.time(),
        action=Action.FREEZE,
        flow=flow,
    )


def _write(state: Path, layer: str, n: int) -> tuple[list[float], float]:
    """n record_violation calls: their latencies (ms) and the wall time (s)."""
    with Journal.open(state) as journal:
        return _timed(journal, layer, n)


def _timed(journal: Journal, layer: str, n: int) -> tuple[list[float], float]:
    ms = []
    start = time.perf_counter()
    for i in range(n):
        v = _violation(layer, i)
        t0 = time.perf_counter()
        journal.record_violation("bench", v)
        ms.append((time.perf_counter() - t0) * 1000)
    return ms, time.perf_counter() - start


def _child(state: Path, layer: str, n: int, go: Event, out: Connection) -> None:
    with Journal.open(state) as journal:
        out.send("ready")
        go.wait()
        out.send(_timed(journal, layer, n))


def _concurrent(state: Path, n: int, writers: int) -> tuple[list[list[float]], float]:
    ctx = mp.get_context("fork")
    go = ctx.Event()
    pipes = [ctx.Pipe(duplex=False) for _ in range(writers)]
    procs = [
        ctx.Process(target=_child, args=(state, f"w{k}", n, go, tx))
        for k, (_, tx) in enumerate(pipes)
    ]
    for p in procs:
        p.start()
    for rx, _ in pipes:
        assert rx.recv() == "ready"
    start = time.perf_counter()
    go.set()
    results = [rx.recv() for rx, _ in pipes]
    wall = time.perf_counter() - start
    for p in procs:
        p.join()
        assert p.exitcode == 0, f"writer exited {p.exitcode}"
    return [ms for ms, _ in results], wall


def _line(label: str, ms: list[float]) -> str:
    ms = sorted(ms)
    p99 = ms[max(0, round(len(ms) * 0.99) - 1)]
    return (
        f"{label:<34} median {statistics.median(ms):6.3f} ms   p99 {p99:7.3f} ms   "
        f"max {ms[-1]:7.3f} ms"
    )


def _fs_type(path: Path) -> str:
    best, kind = "", "?"
    with open("/proc/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            _, mnt, fstype, *_ = line.split()
            if str(path).startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, fstype
    return kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=2000, help="violations per writer")
    parser.add_argument("--dir", default=None, help="where to make the temporary state dir")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="egress-bench-journal-", dir=args.dir))
    try:
        run(tmp, args.n)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(tmp: Path, n: int) -> None:
    kind = _fs_type(tmp.resolve())
    print(
        f"journal in {tmp} ({kind}){'  WARNING: tmpfs, fsync is free' if kind == 'tmpfs' else ''}"
    )
    print(f"record_violation, WAL + synchronous=FULL, pid {os.getpid()}, n={n} per writer")
    single = tmp / "single"
    with Journal.open(single) as journal:
        journal.record_sandbox("bench", "bench")
    ms, wall = _write(single, "inline", n)
    print(_line("1 writer: commit latency", ms))
    print(f"{'1 writer: throughput':<34} {n / wall:8.0f} violations/s")
    shared = tmp / "shared"
    with Journal.open(shared) as journal:
        journal.record_sandbox("bench", "bench")
    per_writer, wall = _concurrent(shared, n, 2)
    for k, ms in enumerate(per_writer):
        print(_line(f"2 writers: writer {k} latency", ms))
    print(f"{'2 writers: throughput (total)':<34} {2 * n / wall:8.0f} violations/s")
    with Journal.open(shared) as journal:
        assert len(journal.violations(limit=4 * n)) == 2 * n, "rows lost"


if __name__ == "__main__":
    main()
