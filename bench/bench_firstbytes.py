"""What binding connections to names costs: time to first byte, packets queued, throughput.

Time to first byte is measured in one `egressctl run` whose policy checks flows to port
80 (``connect.check_names: [80]``) and allows port 8080 unchecked; the lab's web server
serves both. The workload resolves allowed.lab.test, then opens 2N connections one after
another, alternating port 80 (checked) and 8080 (not) in ABBA order (so neither is
always first after a pause), sends one HTTP request on each and times its
send to the first byte of the answer: the check holds that request's segment until it
has read the Host header, so this is where it adds time. Both halves share the sandbox,
the processes, the server and the moment, so the difference is the check's alone, not
the drift between two runs. ``--rounds`` repeats it in fresh sandboxes and prints each
round's figures and the spread.

Then two runs of the same workload, one with the check on and one with it off:
- fetches short (1 KB) and long (1 MB) bodies, N each: the run's report counts the
  segments the kernel handed to the inline layer (``first_bytes_packets``), per flow;
- downloads 1 GB (10 x 100 MB) on one connection per 100 MB, for the throughput.

Last, uploads: a plain-HTTP flow is read request by request, so each of its segments
with data goes to the inline layer (a download's are bare ACKs, which stay in the
kernel). One run POSTs 100 MB bodies to a sink server in the lab (SINK, an AnyIP
address), alternating the checked port and the unchecked one in ABBA order, and prints
both rates and the segments queued.

Prints figures and the on/off differences; asserts nothing. Needs root.

    .venv/bin/python bench/bench_firstbytes.py [-n 400] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from egress.lab import Lab

ROOT = Path(__file__).resolve().parents[1]
NAME = "allowed.lab.test"
CHECKED_PORT, UNCHECKED_PORT = 80, 8080  # the ttfb run checks the first only
SINK, SINK_NAME = "198.19.7.8", "ip-198-19-7-8.any.lab.test"  # AnyIP in the lab
UPLOAD = 100_000_000  # bytes per POST

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {{name: bench-firstbytes}}
spec:
  dns:
    upstreams: ["198.51.100.53"]
    allow: [{name}, {sink}]
  connect: {{ports: [80, 443, 8080], check_names: {checks}}}
"""

# Reads a request head and its Content-Length body, answers 200, closes; on both ports.
SINK_SERVER = r"""
import socket, sys, threading
def serve(conn):
    with conn:
        head = b""
        while b"\r\n\r\n" not in head:
            head += conn.recv(65536)
        head, _, body = head.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        left = length - len(body)
        while left > 0:
            left -= len(conn.recv(1 << 20))
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
def listen(port):
    srv = socket.create_server((sys.argv[1], port))
    while True:
        threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
for port in (80, 8080):
    threading.Thread(target=listen, args=(port,), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""

WORKLOAD = r"""
import json, socket, sys, time
mode, n, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ip = socket.gethostbyname(name)
def fetch(path, first_only=False, port=80):
    s = socket.create_connection((ip, port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t0 = time.perf_counter()
    s.sendall(b"GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (path, name.encode()))
    got = s.recv(65536)
    first = time.perf_counter() - t0
    total = len(got)
    while not first_only and got:
        got = s.recv(1 << 20)
        total += len(got)
    s.close()
    return first, total
if mode == "ttfb":  # port 80 (checked) and 8080 alternately, ABBA: [[80, 8080], ...]
    pairs = []
    for i in range(n):
        order = (80, 8080) if i % 2 == 0 else (8080, 80)
        got = {port: fetch(b"/", True, port)[0] for port in order}
        pairs.append([got[80], got[8080]])
    print(json.dumps(pairs))
elif mode == "sizes":
    for size in (1000, 1000000):
        for _ in range(n):
            fetch(b"/bytes/%d" % size)
    print(json.dumps([]))
elif mode == "bulk":
    t0 = time.perf_counter()
    total = sum(fetch(b"/bytes/%d" % 100_000_000)[1] for _ in range(n))
    print(json.dumps([total, time.perf_counter() - t0]))
elif mode == "upload":  # POSTs to the sink, ports 80 and 8080 alternately (ABBA)
    sink, size = socket.gethostbyname(sys.argv[4]), int(sys.argv[5])
    chunk = b"x" * (1 << 20)
    def post(port):
        s = socket.create_connection((sink, port))
        t0 = time.perf_counter()
        s.sendall(b"POST /up HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n"
                  % (sys.argv[4].encode(), size))
        left = size
        while left > 0:
            left -= s.send(chunk[:left])
        assert s.recv(100).startswith(b"HTTP/1.1 200")
        seconds = time.perf_counter() - t0
        s.close()
        return seconds
    times = {80: [], 8080: []}
    for i in range(n):
        for port in ((80, 8080) if i % 2 == 0 else (8080, 80)):
            times[port].append(post(port))
    print(json.dumps([times[80], times[8080]]))
"""


def run(
    lab: Lab, d: Path, checks: str, mode: str, n: int, *extra: str
) -> tuple[Any, dict[str, int]]:
    policy = d / f"policy-{checks}.yaml"
    policy.write_text(POLICY.format(name=NAME, sink=SINK_NAME, checks=checks))
    report = d / "report.json"
    argv = [sys.executable, "-m", "egress.cli.main", "run", "--policy", str(policy),
            "--uplink-netns", lab.uplink_netns, "--report", str(report), "--workdir",
            str(d / "work"), "--", "/usr/bin/python3", "w.py", mode, str(n), NAME,
            *extra]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(argv, capture_output=True, text=True, cwd=d / "work", env=env,
                          timeout=900)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"egressctl run ({checks}, {mode}) failed: {done.stderr[-2000:]}")
    counters = json.loads(report.read_text())["counters"]
    return json.loads(done.stdout.splitlines()[-1]), counters


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=400, help="connections per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="time-to-first-byte runs (default 3)")
    ap.add_argument("--gigabytes", type=int, default=1, help="bulk transfer size (default 1)")
    ap.add_argument("--uploads", type=int, default=5,
                    help="100 MB POSTs per port in the upload run (default 5)")  # fmt: skip
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_firstbytes needs root (network namespaces, cgroups)", file=sys.stderr)
        return 2
    state = tempfile.mkdtemp(prefix="egress-bench-state-")
    os.environ["EGRESS_STATE_DIR"] = state
    d = Path(tempfile.mkdtemp(prefix="egress-bench-fb-"))
    lab = Lab.up(name=f"eglb{secrets.token_hex(2)}")
    try:
        d.chmod(0o755)
        (d / "work").mkdir(mode=0o777)
        (d / "work").chmod(0o777)
        (d / "work" / "w.py").write_text(WORKLOAD)
        (d / "work" / "w.py").chmod(0o644)
        rounds = []  # per round: (checked ms, unchecked ms), the report's counters
        for _ in range(args.rounds):
            pairs, counters = run(lab, d, f"[{CHECKED_PORT}]", "ttfb", args.n)
            rounds.append(([p[0] * 1000 for p in pairs], [p[1] * 1000 for p in pairs], counters))
        packets = {}
        for checks in ("false", "true"):
            _, packets[checks] = run(lab, d, checks, "sizes", args.n)
        print(f"time to first byte, HTTP/1.1, {args.n} checked connections (port "
              f"{CHECKED_PORT}) and {args.n} unchecked ({UNCHECKED_PORT}) alternating in one "
              "sandbox, per round (ms):")  # fmt: skip
        added50, added99 = [], []
        for i, (on, off, counters) in enumerate(rounds, 1):
            added50.append(pct(on, 0.5) - pct(off, 0.5))
            added99.append(pct(on, 0.99) - pct(off, 0.99))
            print(f"  round {i}: check on p50 {pct(on, 0.5):6.3f} p99 {pct(on, 0.99):6.3f}; "
                  f"off p50 {pct(off, 0.5):6.3f} p99 {pct(off, 0.99):6.3f}; added p50 "
                  f"{added50[-1]:6.3f} p99 {added99[-1]:6.3f}  (queued "
                  f"{counters['first_bytes_packets']} for {args.n} checked flows)")  # fmt: skip
        on = [x for r in rounds for x in r[0]]
        off = [x for r in rounds for x in r[1]]
        print(f"  all rounds: added p50 {pct(on, 0.5) - pct(off, 0.5):6.3f}, p99 "
              f"{pct(on, 0.99) - pct(off, 0.99):6.3f} (target: p50 <= 0.2, p99 <= 1 ms); "
              f"per round p50 {min(added50):.3f}..{max(added50):.3f}, "
              f"p99 {min(added99):.3f}..{max(added99):.3f}")  # fmt: skip
        c = packets["true"]
        flows = 2 * args.n
        print(f"packets handed to the inline layer: {c['first_bytes_packets']} for {flows} flows "
              f"({c['first_bytes_packets'] / flows:.2f} per flow; {args.n} of 1 KB, "
              f"{args.n} of 1 MB); passed {c['flows_passed']}, refused {c['flows_refused']}; "
              f"with the check off: {packets['false'].get('first_bytes_packets', 0)}")  # fmt: skip
        rates = {}
        for checks in ("false", "true", "false", "true"):
            (total, seconds), _ = run(lab, d, checks, "bulk", 10 * args.gigabytes)
            rates.setdefault(checks, []).append(total / seconds / 1e6)
        print(f"throughput, {args.gigabytes} GB in 100 MB downloads (MB/s, two runs each):")
        for checks, label in (("false", "check off"), ("true", "check on")):
            print(f"  {label:<10} " + "  ".join(f"{r:7.1f}" for r in rates[checks]))
        ratio = statistics.mean(rates["true"]) / statistics.mean(rates["false"])
        print(f"  on/off     {ratio:.3f}")
        lab.spawn(["/usr/bin/python3", "-c", SINK_SERVER, SINK], role="sink")
        sink_log = Path(lab.run_dir) / "sink.log"
        deadline = time.monotonic() + 30
        while "ready" not in (sink_log.read_text() if sink_log.exists() else ""):
            if time.monotonic() > deadline:
                raise SystemExit("the sink server did not start: see " + str(sink_log))
            time.sleep(0.05)
        (checked, unchecked), c = run(lab, d, f"[{CHECKED_PORT}]", "upload", args.uploads,
                                      SINK_NAME, str(UPLOAD))  # fmt: skip
        on_rates = [UPLOAD / t / 1e6 for t in checked]
        off_rates = [UPLOAD / t / 1e6 for t in unchecked]
        print(f"uploads, {args.uploads} x {UPLOAD // 1_000_000} MB POSTs per port, alternating "
              "in one sandbox (MB/s):")  # fmt: skip
        print(f"  checked ({CHECKED_PORT})   " + "  ".join(f"{r:7.1f}" for r in on_rates))
        print(f"  unchecked ({UNCHECKED_PORT}) " + "  ".join(f"{r:7.1f}" for r in off_rates))
        print(f"  on/off median {statistics.median(on_rates) / statistics.median(off_rates):.3f}; "
              f"segments queued {c['first_bytes_packets']} "
              f"({c['first_bytes_packets'] / args.uploads:.0f} per checked upload)")  # fmt: skip
    finally:
        lab.down()
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
