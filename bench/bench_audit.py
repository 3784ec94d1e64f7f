"""What mode: audit's record costs in the journal: a simulated day of two workloads.

The inline layer's AuditLog (egress.resolver.audit) is fed what a day brings and flushed
to a real journal every 5 s of simulated time, exactly as the Session does (the same
``Journal.record_audit``, one fsync'd transaction per flush that has news):

- an agent: 2 queries a second over 300 names (A and AAAA), 1 new flow a second over
  150 destinations;
- a tunnel: 50 queries a second, every name new (iodine-like), for the whole day.

Prints the journal's size after the day (after a WAL checkpoint), the rows, the time a
flush takes, and what one row per query would have cost. Needs no root.

    .venv/bin/python bench/bench_audit.py [--hours 24]
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from egress.resolver.audit import AuditLog
from egress.store.journal import Journal

FLUSH_S = 5.0
ROW_BYTES = 120  # what one journal row per query would take (name, type, verdict, times)


def simulate(
    name: str, hours: float, qps: float, feed: Callable[[AuditLog, int, float], None]
) -> None:
    with tempfile.TemporaryDirectory(prefix="egress-bench-audit-") as tmp:
        journal = Journal.open(tmp)
        journal.record_sandbox("sim", "audit-all")
        log = AuditLog()
        seconds = int(hours * 3600)
        flushes: list[float] = []
        queries = 0
        t0 = 1_796_083_200.0
        for second in range(seconds):
            now = t0 + second
            n = int(qps) + (1 if random.random() < qps - int(qps) else 0)
            for _ in range(n):
                feed(log, queries, now)
                queries += 1
            if second % int(FLUSH_S) == 0:
                batch = log.take()
                if not batch.is_empty():
                    started = time.perf_counter()
                    journal.record_audit("sim", batch)
                    flushes.append((time.perf_counter() - started) * 1000)
        batch = log.take()
        if not batch.is_empty():
            journal.record_audit("sim", batch)
        journal.close()
        db = Path(tmp) / "journal.db"
        conn = sqlite3.connect(db)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        names = conn.execute("SELECT COUNT(*) FROM audit_names").fetchone()[0]
        connects = conn.execute("SELECT COUNT(*) FROM audit_connects").fetchone()[0]
        over = conn.execute("SELECT names, connects FROM audit_overflow").fetchall()
        conn.close()
        size = db.stat().st_size
        naive = queries * ROW_BYTES
        print(f"{name}: {hours:g} h, {queries:,} queries, {len(flushes):,} flushes")
        print(f"  journal {size / 1024:,.0f} KiB ({names} name rows, {connects} connect rows,"
              f" over the cap: {over[0] if over else (0, 0)})")  # fmt: skip
        print(f"  flush p50 {statistics.median(flushes):.2f} ms,"
              f" p99 {statistics.quantiles(flushes, n=100)[98]:.2f} ms")  # fmt: skip
        print(f"  one row per query would be ~{naive / 2**20:,.0f} MiB ({naive / size:,.0f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=24.0)
    args = parser.parse_args()
    random.seed(1)
    names = [f"host{i}.example{i % 40}.com" for i in range(300)]

    def agent(log: AuditLog, i: int, now: float) -> None:
        name = names[random.randrange(len(names))]
        log.name(name, 1 if i % 2 else 28, "allowed", now)
        if i % 2:
            dest = random.randrange(150)
            log.connect(f"203.0.113.{dest % 250}", "tcp", 443 if dest % 3 else 80, "allowed",
                        (names[dest],), now)  # fmt: skip

    def tunnel(log: AuditLog, i: int, now: float) -> None:
        log.name(f"{random.getrandbits(200):050x}.t.tunnel-op.net", 10, "allowed", now)

    simulate("agent", args.hours, 2.0, agent)
    simulate("tunnel", args.hours, 50.0, tunnel)


if __name__ == "__main__":
    main()
