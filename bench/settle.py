"""Wait until this machine is quiet, before a benchmark: the CPUs at least 90% idle over a
whole second, two seconds in a row (at most --max seconds). The benchmarks time things on
2 vCPUs, and what the one before left running (a container runtime's teardown, a kernel
still removing a thousand namespaces) would show in the next one's figures. It reads
CPU time, not the load average, which lags a minute behind. Prints how long it waited;
``make bench`` runs it before each bench.

    .venv/bin/python bench/settle.py [--max 90]
"""

from __future__ import annotations

import argparse
import time


def busy_share(seconds: float = 1.0) -> float:
    """The share of all CPUs' time that was busy over ``seconds`` (/proc/stat)."""

    def ticks() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        idle = values[3] + values[4]  # idle, iowait
        return sum(values) - idle, sum(values)

    busy0, total0 = ticks()
    time.sleep(seconds)
    busy1, total1 = ticks()
    return (busy1 - busy0) / max(1, total1 - total0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max", type=float, default=90.0, help="seconds to wait at most")
    args = parser.parse_args()
    start = time.monotonic()
    quiet = 0
    share = 1.0
    while quiet < 2 and time.monotonic() - start < args.max:
        share = busy_share()
        quiet = quiet + 1 if share <= 0.10 else 0
    waited = time.monotonic() - start
    state = "quiet" if quiet >= 2 else f"still {share:.0%} busy"
    print(f"settle: {state} after {waited:.0f} s")


if __name__ == "__main__":
    main()
