"""Sandbox create-to-ready and teardown times, and how creation grows with sandboxes alive.

"Ready" is what `egressctl run` waits for before it starts the command's datapath: netns,
veth, addresses, routes, the sandbox and uplink nft rulesets (one atomic load each) and
the cgroup. "With isolation" adds what the workload's own identity and view cost before
the command can start: a uid of its own (the claim's /proc scan), its $HOME, passwd,
group and hosts, and the idmapped working directory. Then the start itself, `/bin/true`
from fork to exit through nsenter, bubblewrap, setpriv and tini, next to the netns-only
start egress used before (`ip netns exec` + setpriv), measured in the same run. Runs
against a throwaway lab uplink; prints figures, asserts nothing.

    .venv/bin/python bench/bench_sandbox.py [-n 50] [--max 100]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time

from egress.datapath.addressing import Pools
from egress.lab import Lab
from egress.policy import load_policy
from egress.sandbox import lifecycle as sbx
from egress.sandbox import view, workload
from egress.store import uids


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def line(label: str, xs: list[float]) -> str:
    return f"  {label:<34} median {statistics.median(xs):7.2f} ms   p95 {pct(xs, 0.95):7.2f} ms"


def create_teardown(n: int, uplink: str) -> tuple[list[float], list[float]]:
    policy = load_policy("policies/python-dev.yaml")
    creates, teardowns = [], []
    for _ in range(n):
        sb = sbx.create(policy, Pools.parse(None), uplink)
        creates.append(sb.created_s * 1000)
        t0 = time.perf_counter()
        sb.destroy()
        teardowns.append((time.perf_counter() - t0) * 1000)
    return creates, teardowns


def isolated(n: int, uplink: str) -> tuple[list[float], list[float], list[float]]:
    """(create-to-ready with isolation, bwrap start to exit, netns-only start to exit)."""
    policy = load_policy("policies/python-dev.yaml")
    ids = uids.parse_range(None)
    ready, start, plain = [], [], []
    with tempfile.TemporaryDirectory(prefix="egress-bench-") as work:
        for _ in range(n):
            t0 = time.perf_counter()
            sb = sbx.create(policy, Pools.parse(None), uplink, ids)
            assert sb.uid is not None
            who = workload.allocated_user(sb.id, sb.uid)
            the_view = view.prepare(sb.id, sb.netns, who, work, [])
            ready.append((time.perf_counter() - t0) * 1000)
            procs = sb.cgroup.procs_files
            try:
                env = workload.build_env(who, {}, os.environ)
                t0 = time.perf_counter()
                w = workload.spawn(sb.id, sb.netns, who, ["/bin/true"], the_view, env, procs)
                w.popen.wait()
                start.append((time.perf_counter() - t0) * 1000)
                argv = ["ip", "netns", "exec", sb.netns, "setpriv", f"--reuid={sb.uid}",
                        f"--regid={sb.uid}", "--clear-groups", "--bounding-set=-all",
                        "--no-new-privs", "--", "/bin/true"]  # fmt: skip
                t0 = time.perf_counter()
                join = functools.partial(workload.join_cgroups, procs)
                subprocess.run(argv, check=True, preexec_fn=join)
                plain.append((time.perf_counter() - t0) * 1000)
            finally:
                the_view.close()
                sb.destroy()
    return ready, start, plain


def growth(max_alive: int, uplink: str, probes: int = 10) -> list[tuple[int, list[float]]]:
    """Create time for a new sandbox while k others are alive, k = 0 .. max_alive."""
    policy = load_policy("policies/python-dev.yaml")
    alive: list[sbx.Sandbox] = []
    out = []
    try:
        for k in sorted({0, 1, 10, 25, 50, max_alive}):
            while len(alive) < k:
                alive.append(sbx.create(policy, Pools.parse(None), uplink))
            times = []
            for _ in range(probes):
                sb = sbx.create(policy, Pools.parse(None), uplink)
                times.append(sb.created_s * 1000)
                sb.destroy()
            out.append((k, times))
    finally:
        for sb in alive:
            sb.destroy()
    return out


def egressctl_run(n: int, uplink: str) -> list[float]:
    """Whole `egressctl run -- /bin/true`: sandbox, observer process, resolver, teardown."""
    times = []
    argv = [
        sys.executable,
        "-m",
        "egress.cli.main",
        "run",
        "--workdir",
        "/tmp",
        "--policy",
        "policies/python-dev.yaml",
        "--uplink-netns",
        uplink,
        "--state-dir",
        "/tmp/egress-bench-state",
        "--",
        "/bin/true",
    ]
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True)
        times.append((time.perf_counter() - t0) * 1000)
    subprocess.run(["rm", "-rf", "/tmp/egress-bench-state"], check=True)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("-n", type=int, default=50, help="sandboxes per figure (50)")
    ap.add_argument("--max", type=int, default=100, help="most sandboxes alive at once (100)")
    args = ap.parse_args()
    lab = Lab.up(name="egbs")
    try:
        creates, teardowns = create_teardown(args.n, lab.uplink_netns)
        print(f"sandbox lifecycle over {args.n} (policy python-dev, uplink {lab.uplink_netns})")
        print(line("create-to-ready", creates))
        print(line("teardown", teardowns))
        ready, start, plain = isolated(args.n, lab.uplink_netns)
        print(line("create-to-ready with isolation", ready))
        print(line("start /bin/true: bwrap+tini", start))
        print(line("start /bin/true: netns only (before)", plain))
        print(f"  isolation adds {statistics.median(ready) - statistics.median(creates):.2f} ms "
              f"to create-to-ready and {statistics.median(start) - statistics.median(plain):.2f} "
              "ms to the start (medians)")  # fmt: skip
        # The first sandbox of an uplink loads its table and turns its forwarding on, the
        # last one undoes both: with one other sandbox alive (egressd's steady state),
        # neither is in the figures.
        holder = sbx.create(load_policy("policies/python-dev.yaml"), Pools.parse(None),
                            lab.uplink_netns)  # fmt: skip
        try:
            creates1, _ = create_teardown(args.n, lab.uplink_netns)
            ready1, _, _ = isolated(args.n, lab.uplink_netns)
        finally:
            holder.destroy()
        print("with one other sandbox alive on the uplink:")
        print(line("create-to-ready", creates1))
        print(line("create-to-ready with isolation", ready1))
        print("create time with k sandboxes already alive (10 new ones each):")
        for k, times in growth(args.max, lab.uplink_netns):
            print(line(f"k = {k}", times))
        runs = egressctl_run(10, lab.uplink_netns)
        print(line("egressctl run -- /bin/true (whole)", runs))
    finally:
        lab.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
