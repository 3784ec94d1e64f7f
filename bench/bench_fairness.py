"""Fairness between sandboxes of one egressd: does one sandbox's DNS flood slow another's?

Issue 7 item 6: a sandbox flooding DNS is rate-limited per sandbox (``spec.dns.rate_limit``,
default 500 qps, burst 1,000) and does not raise another sandbox's p99 latency by more
than 2x. Needs root.

One egressd (its own socket, run dir and state dir in a temp dir) serves two sandboxes
made through its API from the same policy, on a lab. Clients run INSIDE the sandbox netns
against 127.0.0.53, on names primed into the cache (the cheapest query for the resolver,
so a flood is as fast as it gets):

- victim: ``dnsperf -c 1 -Q 200 -v`` (a modest, steady client); every reply's latency
  from ``-v``, p50/p99 over the run;
- flooder, started a second before the victim and running past it, either
  ``dnsperf -c 4 -q 100`` with no ``-Q`` (it waits for each answer, so drops slow it
  down), or ``--flood-procs`` raw senders that never wait (the real worst case).

Cases: (a) victim alone; (b) dnsperf flood and (c) raw flood under the default limit;
(d), (e) the same with the flooder's limit raised to 1,000,000 qps by a live policy swap
(what the limit buys). (a)-(c) run in turn for ``--rounds`` rounds, pooled. Printed:
p50/p99 of each, the ratios to (a), and the flooder's queries sent, answered and dropped
(its senders' counts and egressd's /metrics).

Run: ``.venv/bin/python bench/bench_fairness.py [--seconds 10] [--rounds 3]``. Prints
figures, asserts nothing. Everything it makes (lab, egressd and its sandboxes, client
processes, the temp dir) is removed on the way out, on failure too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from statistics import mean
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.support

from egress.cli.client import Client
from tests.support.egressd import Egressd, egressd
from tests.support.labs import running_lab

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {{name: {name}}}
spec:
  dns:
    upstreams: ["198.51.100.53"]{limit}
    allow:
      - allowed.lab.test
      - www.allowed.lab.test
      - "*.cdn.lab.test"
      - "*.wild.lab.test"
"""
UNLIMITED = "\n    rate_limit: {qps: 1000000, burst: 1000000}"
RESOLVER = "127.0.0.53"
NAMES = [
    *(f"{n} {t}" for n in ("allowed.lab.test", "www.allowed.lab.test") for t in ("A", "AAAA")),
    *(f"w{i}.wild.lab.test A" for i in range(20)),
]
VICTIM = ["dnsperf", "-c", "1", "-Q", "200", "-v", "-t", "2"]
FLOOD = ["dnsperf", "-c", "4", "-q", "100", "-t", "1"]
# dnsperf waits for every query it sent: a dropped one holds one of its -q slots for the
# -t timeout, so under the limit it slows itself down (so does resperf, at 65,536 lost).
# A flood that does not care about answers is this: each process sends the cached names
# in a loop on one connected socket as fast as it can, reading replies in between.
RAW_FLOOD = r"""
import socket, struct, sys, time
seconds, names = float(sys.argv[1]), sys.argv[2:]
def query(i, name, qtype):
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
    return struct.pack("!6H", i, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack("!HH", qtype, 1)
qs = [query(i, n, 28 if t == "AAAA" else 1) for i, nt in enumerate(names) for n, t in [nt.split()]]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect(("127.0.0.53", 53))
s.setblocking(False)
sent = answered = 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    for q in qs:
        try:
            s.send(q)
            sent += 1
        except OSError:
            pass
    while True:
        try:
            s.recv(4096)
            answered += 1
        except OSError:
            break
print(sent, answered)
"""


# -- egressd -------------------------------------------------------------------------------


def create(daemon: Egressd, name: str, uplink: str) -> dict[str, Any]:
    return daemon.create(POLICY.format(name=name, limit=""), uplink)


def set_policy(daemon: Egressd, sid: str, name: str, limit: str) -> None:
    text = POLICY.format(name=name, limit=limit)
    daemon.client.call("PUT", f"/v1/sandboxes/{sid}/policy", {"policy": text})


def metric(daemon: Egressd, name: str, sid: str) -> float:
    api: Client = daemon.client
    text = api.request("GET", "/metrics")[1]
    m = re.search(rf'^{name}{{sandbox="{sid}"}} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else float("nan")


@contextlib.contextmanager
def setup() -> Iterator[tuple[Egressd, dict[str, Any], dict[str, Any], Path]]:
    workdir = Path(tempfile.mkdtemp(prefix="egress-bench-fair-"))
    try:
        with running_lab(prefix="eglf") as lab, egressd(workdir / "state") as daemon:
            victim = create(daemon, "victim", lab.uplink_netns)
            flooder = create(daemon, "flooder", lab.uplink_netns)
            yield daemon, victim, flooder, workdir
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# -- dnsperf -------------------------------------------------------------------------------


def prime(netns: str, qfile: Path) -> None:
    argv = ["ip", "netns", "exec", netns, "dnsperf", "-s", RESOLVER, "-d", str(qfile),
            "-n", "1", "-c", "1", "-q", "1"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if "Queries lost:         0" not in done.stdout:
        raise RuntimeError(f"priming {netns} lost queries:\n{done.stdout}{done.stderr}")


class Flood:
    """The flooder's processes: one dnsperf, or ``procs`` raw senders."""

    def __init__(self, kind: str, netns: str, qfile: Path, seconds: float, procs: int) -> None:
        self.kind = kind
        if kind == "dnsperf":
            argvs = [[*FLOOD, "-s", RESOLVER, "-d", str(qfile), "-l", f"{seconds:g}"]]
        else:
            argvs = [[sys.executable, "-c", RAW_FLOOD, f"{seconds:g}", *NAMES]] * procs
        self.procs = [
            subprocess.Popen(
                ["ip", "netns", "exec", netns, *argv], stdout=subprocess.PIPE, text=True
            )
            for argv in argvs
        ]

    def finish(self, seconds: float) -> dict[str, float]:
        """Wait for every process to end by itself (at most ``seconds``); sent, answered."""
        outs = [stop(proc, seconds) for proc in self.procs]
        if self.kind == "dnsperf":
            return counts(outs[0])
        total = {"sent": 0.0, "completed": 0.0}
        for out in outs:
            sent, answered = out.split()[-2:]
            total["sent"] += float(sent)
            total["completed"] += float(answered)
        return total


def counts(text: str) -> dict[str, float]:
    out = {}
    for key, pattern in (("sent", r"Queries sent:\s+(\d+)"),
                         ("completed", r"Queries completed:\s+(\d+)"),
                         ("lost", r"Queries lost:\s+(\d+)"),
                         ("qps", r"Queries per second:\s+([\d.]+)")):  # fmt: skip
        m = re.search(pattern, text)
        if m is None:
            raise RuntimeError(f"dnsperf output not understood:\n{text}")
        out[key] = float(m.group(1))
    return out


def victim_run(netns: str, qfile: Path, seconds: int) -> tuple[list[float], dict[str, float]]:
    """Latencies (ms) of every reply the victim got, and dnsperf's counts."""
    argv = ["ip", "netns", "exec", netns, *VICTIM, "-s", RESOLVER, "-d", str(qfile),
            "-l", str(seconds)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60)
    # -v: "> NOERROR allowed.lab.test A 0.000154" per reply (latency in seconds)
    ms = [float(m.group(1)) * 1000 for m in re.finditer(r"^> \S+ .* ([\d.]+)$", done.stdout,
                                                         re.MULTILINE)]  # fmt: skip
    if not ms:
        raise RuntimeError(f"no latencies in dnsperf -v output:\n{done.stdout[-2000:]}")
    return ms, counts(done.stdout)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


def stop(proc: subprocess.Popen[str], grace: float) -> str:
    """Its output, once it has ended: by itself within ``grace`` seconds, else killed."""
    try:
        out, _ = proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()  # our own child, by its PID
        out, _ = proc.communicate()
    return out or ""


# -- the runs ------------------------------------------------------------------------------


def run_case(
    daemon: Egressd, victim: dict[str, Any], flooder: dict[str, Any], kind: str | None,
    qfile: Path, args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """The victim's latencies while the flooder floods (``kind``) or idles (None)."""
    dropped = metric(daemon, "egress_dns_rate_limited_total", flooder["id"])
    flood = None
    if kind is not None:
        flood = Flood(kind, flooder["netns"], qfile, args.seconds + 2, args.flood_procs)
    try:
        if flood is not None:
            time.sleep(1.0)  # the flood at full speed before the victim starts
        cpu, start = cpu_seconds(daemon.pid), time.monotonic()
        ms, vcounts = victim_run(victim["netns"], qfile, args.seconds)
        busy = (cpu_seconds(daemon.pid) - cpu) / (time.monotonic() - start)
    finally:
        flood_counts = flood.finish(30) if flood is not None else None
    out: dict[str, Any] = {"ms": ms, "victim": vcounts, "flood": flood_counts, "cpu": [busy]}
    out["dropped"] = metric(daemon, "egress_dns_rate_limited_total", flooder["id"]) - dropped
    out["seconds"] = args.seconds + 2
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one case as one: latencies together, counts summed."""
    out: dict[str, Any] = {"ms": [x for r in runs for x in r["ms"]]}
    out["victim"] = {"lost": sum(r["victim"]["lost"] for r in runs)}
    out["dropped"] = sum(r["dropped"] for r in runs)
    out["seconds"] = sum(r["seconds"] for r in runs)
    out["cpu"] = [x for r in runs for x in r["cpu"]]
    floods = [r["flood"] for r in runs if r["flood"] is not None]
    out["flood"] = None
    if floods:
        out["flood"] = {k: sum(f[k] for f in floods) for k in ("sent", "completed")}
    return out


def show(label: str, case: dict[str, Any], alone: dict[str, Any] | None) -> None:
    ms = case["ms"]
    p50, p99 = percentile(ms, 0.5), percentile(ms, 0.99)
    line = f"  {label:<40} p50 {p50:6.3f} ms  p99 {p99:6.3f} ms  ({len(ms)} replies"
    line += f", {case['victim']['lost']:.0f} lost; egressd CPU {mean(case['cpu']):.0%})"
    if alone is not None:
        a50, a99 = percentile(alone["ms"], 0.5), percentile(alone["ms"], 0.99)
        line += f"  ratio p50 {p50 / a50:4.2f}  p99 {p99 / a99:4.2f}"
    print(line)
    f = case["flood"]
    if f is not None:
        secs = case["seconds"]
        print(f"  {'':<40} flooder: sent {f['sent']:,.0f} ({f['sent'] / secs:,.0f}/s), "
              f"answered {f['completed']:,.0f} ({f['completed'] / secs:,.0f}/s), "
              f"dropped by the limit {case['dropped']:,.0f}")  # fmt: skip


def run(args: argparse.Namespace) -> None:
    with setup() as (daemon, victim, flooder, workdir):
        qfile = workdir / "queries.txt"
        qfile.write_text("\n".join(NAMES) + "\n")
        prime(victim["netns"], qfile)
        prime(flooder["netns"], qfile)
        print(f"bench_fairness: one egressd, two sandboxes, {len(NAMES)} cached names, "
              f"{os.cpu_count()} CPUs; victim {' '.join(VICTIM)} -l {args.seconds}; "
              f"flooder: {' '.join(FLOOD)} (no -Q), or {args.flood_procs} raw sender(s) "
              "that never wait for answers")  # fmt: skip
        # Rounds of (a), (b), (c) in turn, pooled: the machine's other load drifts, and
        # the ratio should compare like with like.
        cases = [("(a) victim alone", None)]
        cases += [(f"({c}) {kind} flood, default limit (500/s)", kind)
                  for c, kind in (("b", "dnsperf"), ("c", "raw"))]  # fmt: skip
        rounds = [
            [run_case(daemon, victim, flooder, kind, qfile, args) for _, kind in cases]
            for _ in range(args.rounds)
        ]
        results = [pool([r[i] for r in rounds]) for i in range(len(cases))]
        set_policy(daemon, flooder["id"], "flooder-unlimited", UNLIMITED)
        time.sleep(1.0)  # the stale backlog a raw flood leaves in the socket is read first
        for c, kind in (("d", "dnsperf"), ("e", "raw")):
            prime(flooder["netns"], qfile)  # a swap empties the cache
            cases.append((f"({c}) {kind} flood, limit 1,000,000/s", kind))
            results.append(run_case(daemon, victim, flooder, kind, qfile, args))
        print(f"victim latency: {args.rounds} round(s) of (a)-(c) pooled; (d), (e) once")
        for (label, _), result in zip(cases, results, strict=True):
            show(label, result, results[0] if result is not results[0] else None)
        print("  (target: with the default limit, p99 ratio <= 2)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--flood-procs", type=int, default=2, help="raw flood processes")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (a)-(c)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_fairness: needs root (it creates network namespaces); skipped")
        return
    if shutil.which("dnsperf") is None:
        print("bench_fairness: needs dnsperf (Debian package); skipped")
        return
    run(args)


if __name__ == "__main__":
    main()
