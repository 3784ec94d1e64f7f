"""One egressd serving many sandboxes: memory, create rate and DNS latency as N grows.

Starts a throwaway lab and an egressd of its own (temp socket, run dir and journal), then
grows the number of sandboxes it serves, through the API, to each of --steps (default
1, 250, 500, 1,000). At each step it prints:

- RSS: VmRSS of egressd (and of its child processes, if it has any), and its open fds;
- create: latency of each sequential ``POST /v1/sandboxes`` that brought N up to this
  step (p50/p95) and the sequential rate; then a burst of --burst creates made by as many
  threads at once (creates/s; deleted again at once);
- DNS with every sandbox active: each sandbox asks its own resolver (127.0.0.53 in its
  netns) --qps times a second for --seconds, all at once, one query in flight each, from
  this process (a socket per sandbox, opened in its netns). --miss-share of the queries
  are names never asked before (``ip-198-19-A-B.any.lab.test``: forwarded to the lab's
  DNS, answered with a new address, set insert included), the rest are four names primed
  in every sandbox (cache hits). p50/p99 of each kind; "direct": new names asked of the
  lab's DNS straight from the uplink netns meanwhile (at the rate of one sandbox's
  misses), what a miss costs without egressd; queries that got no answer within 2 s
  ("lost") and answers other than NOERROR with an address ("bad"). Under the row, the
  same latencies to when the kernel queued each answer on the client's socket
  (SO_TIMESTAMPNS): what is left once this client's own lateness in reading is taken
  out, so a tail there is egress's (and the machine's), not the client's;
- freezes under that load: --freezes sandboxes (spread over them and over the load) each
  send one datagram their policy blocks, from their netns; the time from the send to the
  kernel's confirmation of the freeze, as the journal holds it (both layers, the earlier
  one's); each is resumed through the API afterwards (--freezes 0 for DNS figures
  comparable with runs before 2026-12-04, which froze nothing meanwhile);
- with --scrape S, GET /metrics every S seconds during the load, as a Prometheus scraper
  would (curl, a process of its own): how long each scrape took, and what it costs the
  DNS figures in the row above (compare a run without);
- egressd's CPU during the DNS load (its nft and figures workers included; percent of
  one CPU), and the observer layer's (`egressd observer`, started beside it;
  --no-observer leaves it out: all its processes) and its PSS. "direct" rising with N
  says the machine itself (this client, the lab's DNS, both layers on 2 vCPUs) is
  saturated, not egressd alone;
  "host busy%" says it outright: the share of all CPUs busy during the load (/proc/stat);
  under the row, egressd's loop thread as the scheduler counts it (schedstat): time on a
  CPU, time runnable but waiting for one (every answer queued behind it waits that too),
  and how often its CPU was taken while it had work (involuntary context switches);
- under the row, the median of each create step egressd timed (the sandbox JSON's
  create_ms) over that step's sequential creates.

After the last step, the same load on dnsmasq ``--nftset`` instead, one in each
sandbox (on 127.0.0.54, beside egressd's resolver, which idles meanwhile; it writes its
answers' addresses into sets of the sandbox's table): the same machine, sandboxes and
client with a C resolver in egressd's place, for the targets' dnsmasq figures
(--no-dnsmasq leaves it out). Then, with no DNS load: egressd's CPU with no sandbox
frozen, then with --frozen-idle of them (500) frozen at once, as a node's may wait hours
for a person, once each review has started (what its looks for a thaw cost); then issue
17's targets for egressd beside what that step measured, and dnsmasq's where it has it.
If a create fails, the figures up to there are printed with the error, and the bench
stops growing.
Everything it made is removed on the way out, Ctrl-C included. Prints figures, asserts
nothing. Needs root.

    .venv/bin/python bench/bench_egressd.py [--steps 1,250,500,1000] [--seconds 5] [--qps 5]
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import os
import random
import re
import resource
import secrets
import select
import shlex
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.support

import bench_dns  # bench/, beside this file
import figures

from egress.cli.client import Client
from egress.errors import DaemonError, EgressError
from egress.kernel.cgroup import Cgroup
from egress.kernel.netns import in_netns
from egress.kernel.nft import NftHandle
from egress.lab import Lab
from egress.store.journal import Journal
from tests.support.egressd import Egressd
from tests.support.labs import lab_name

POLICY = """\
apiVersion: egress/v1
kind: Policy
metadata: {{name: bench-{i}}}
spec:
  dns:
    upstreams: ["198.51.100.53"]
    allow: [allowed.lab.test, www.allowed.lab.test, a1.cdn.lab.test, a2.cdn.lab.test,
            "*.any.lab.test"]
  connect: {{ports: [80, 443, 8081]}}
  tunnel: {{zones: [{{zone: lab.test, exempt: true}}]}}
"""
HITS = ["allowed.lab.test", "www.allowed.lab.test", "a1.cdn.lab.test", "a2.cdn.lab.test"]
RESOLVER = ("127.0.0.53", 53)
PEER = ("127.0.0.54", 53)  # dnsmasq's, beside egressd's resolver in each sandbox
LAB_DNS = ("198.51.100.53", 53)
BLOCKED = ("203.0.113.99", 9)  # no policy here allows it: a blocked_connect, frozen
TIMEOUT_S = 2.0
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux's; Python 3.11 lacks the name
STAMP = struct.Struct("@qq")  # the struct timespec it comes in


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


# -- egressd ---------------------------------------------------------------------------------


def create(daemon: Egressd, i: int, uplink: str) -> dict[str, Any]:
    return daemon.create(POLICY.format(i=i), uplink)


def memory(daemon: Egressd) -> tuple[float, float, int]:
    """(egressd's VmRSS, its children's, its open fds); MB, MB, count."""
    own = vm_rss(daemon.pid)
    kids = sum(vm_rss(pid) for pid in children(daemon.pid))
    return own, kids, len(os.listdir(f"/proc/{daemon.pid}/fd"))


def vm_rss(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def pss(pids: list[int]) -> float:
    """The processes' proportional set size, MB: pages shared by forked children counted
    once over all of them (a sum of their VmRSS counts each shared page in each)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
    return total / 1024


def cpu_ticks(pids: list[int]) -> dict[int, int]:
    """utime + stime of each process, in clock ticks."""
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[pid] = int(fields[11]) + int(fields[12])
    return out


def cpu_percent(before: dict[int, int], after: dict[int, int], pids: list[int], dt: float) -> float:
    """Percent of one CPU the ``pids`` used over ``dt`` seconds, from two ``cpu_ticks``."""
    used = sum(after[p] - before[p] for p in pids if p in after and p in before)
    return 100 * used / os.sysconf("SC_CLK_TCK") / dt


def loop_sched(pid: int) -> tuple[float, float, int] | None:
    """``pid``'s main thread, the one that runs egressd's loop, as the scheduler counts
    it: (seconds on a CPU, seconds runnable but waiting for one, involuntary context
    switches: its CPU taken while it had work, e.g. by a task its answer woke); None if
    the kernel did not say."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        ran, waited, _ = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
        status = Path(f"/proc/{pid}/task/{pid}/status").read_text()
        [taken] = [ln for ln in status.splitlines() if ln.startswith("nonvoluntary_ctxt")]
        return int(ran) / 1e9, int(waited) / 1e9, int(taken.split(":")[1])
    return None


def host_ticks() -> tuple[int, int]:
    """(busy, all) clock ticks of every CPU since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def children(pid: int) -> list[int]:
    """Every descendant of pid."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in os.listdir(f"/proc/{parent}/task"):
            with contextlib.suppress(OSError):
                found = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
                todo.extend(int(x) for x in found)
                out.extend(int(x) for x in found)
    return out


# -- DNS load ---------------------------------------------------------------------------------


def dns_query(qid: int, name: str) -> bytes:
    q = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + q + struct.pack("!HH", 1, 1)


def fresh_names() -> Iterator[str]:
    """AnyIP names never asked before: each one is a miss and a new set element."""
    for a, b in itertools.product(range(256), range(1, 255)):
        yield f"ip-198-19-{a}-{b}.any.lab.test"


def udp_in(netns: str) -> socket.socket:
    """An unconnected UDP socket in ``netns``: what the sandbox's ruleset judges."""
    with in_netns(netns):
        return socket.socket(socket.AF_INET, socket.SOCK_DGRAM)


def resolver_socket(netns: str, server: tuple[str, int] = RESOLVER) -> socket.socket:
    with in_netns(netns):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect(server)
    s.setblocking(False)
    return s


@dataclass
class Load:
    hit_ms: list[float] = field(default_factory=list)
    miss_ms: list[float] = field(default_factory=list)
    direct_ms: list[float] = field(default_factory=list)  # new names, to the lab's DNS
    # The same, to the kernel's timestamp of each answer's arrival (SO_TIMESTAMPNS).
    stamped: dict[str, list[float]] = field(
        default_factory=lambda: {"hit": [], "miss": [], "direct": []}
    )
    lost: int = 0
    lost_kinds: dict[str, int] = field(default_factory=dict)  # hit, miss, direct: how many
    bad: int = 0  # answered, but not NOERROR with an answer
    probes_sent: list[float] = field(default_factory=list)  # wall time of each probe's send

    @property
    def answered(self) -> int:
        return len(self.hit_ms) + len(self.miss_ms)


def ask(sock: socket.socket, name: str) -> tuple[float, bytes] | None:
    """One query and its answer, waiting up to TIMEOUT_S (priming, one at a time)."""
    qid = secrets.randbits(16)
    start = time.perf_counter()
    sock.settimeout(TIMEOUT_S)
    try:
        sock.send(dns_query(qid, name))
        while True:
            sock.settimeout(max(start + TIMEOUT_S - time.perf_counter(), 0.001))
            data = sock.recv(4096)
            if data[:2] == struct.pack("!H", qid):  # else a late answer to an earlier query
                return (time.perf_counter() - start) * 1000, data
    except TimeoutError:
        return None
    finally:
        sock.setblocking(False)


def prime(socks: list[socket.socket]) -> None:
    for s in socks:
        for name in HITS:
            ask(s, name)


@dataclass
class Asker:
    """One sandbox's client (or the direct one): one query in flight at most."""

    index: int
    sock: socket.socket
    period: float
    miss_share: float
    direct: bool
    due: float  # when its current (or next) query is due
    qid: int = -1  # the query in flight, -1: none
    seq: int = 0  # how many it sent: what its deadlines are keyed by (a qid may repeat)
    sent: float = 0.0
    sent_wall: float = 0.0  # the same moment on the kernel's timestamps' clock
    miss: bool = False


def scrape_every(api_socket: str, every_s: float) -> subprocess.Popen[str]:
    """GET /metrics on egressd's API socket now and every ``every_s`` after each, as a
    Prometheus scraper would, from a process of its own (curl: not this one's GIL).
    Each line it writes: the HTTP status and the seconds the scrape took."""
    path = shlex.quote(api_socket)
    curl = f"curl -s -o /dev/null -w '%{{http_code}} %{{time_total}}\\n' --unix-socket {path}"
    loop = f"while :; do {curl} http://egressd/metrics; sleep {every_s}; done"
    return subprocess.Popen(["bash", "-c", loop], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip


def scrapes_made(scraper: subprocess.Popen[str]) -> list[float]:
    """Stop ``scraper`` (its process group: the shell and a curl still running, ours by
    its PID); the seconds each scrape that answered 200 took (one that did not: -1)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(scraper.pid, signal.SIGTERM)
    out, _ = scraper.communicate()
    return [float(t) if code == "200" else -1.0
            for code, _, t in (line.partition(" ") for line in out.splitlines())]  # fmt: skip


def dns_load(
    socks: list[socket.socket], rate: float, seconds: float, miss_share: float,
    fresh: Iterator[str], direct: socket.socket, probes: list[socket.socket] | None = None,
) -> tuple[Load, float]:  # fmt: skip
    """Every sandbox's client at ``rate`` (spread over the first second), and the direct
    one at ``rate * miss_share``, for ``seconds``: one epoll loop over all the sockets and
    two timer heaps, so the client costs a send and a recv per query (an asyncio task,
    timer and reader per query made this process what saturated the machine at 1,000).
    Each of ``probes`` (a socket in a sandbox's netns) sends one datagram its policy
    blocks, spread over the load: a freeze under load (``Load.probes_sent``)."""
    out = Load()
    start = time.perf_counter()
    end = start + seconds
    clients = [Asker(i, s, 1 / rate, miss_share, False, start + random.random() / rate)
               for i, s in enumerate(socks)]  # fmt: skip
    d_rate = rate * miss_share  # none without misses: nothing to compare them with
    if d_rate > 0:
        clients.append(Asker(len(clients), direct, 1 / d_rate, 1.0, True,
                              start + random.random() / d_rate))  # fmt: skip
    by_fd = {c.sock.fileno(): c for c in clients}
    for c in clients:
        c.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    room = socket.CMSG_SPACE(STAMP.size)
    sends = [(c.due, i) for i, c in enumerate(clients) if c.due < end]
    heapq.heapify(sends)
    deadlines: list[tuple[float, int, int]] = []  # (deadline, client, its seq)
    probes = probes or []
    probe_at = [start + (j + 0.5) * seconds / len(probes) for j in range(len(probes))]
    ep = select.epoll()
    try:
        for fd in by_fd:
            ep.register(fd, select.EPOLLIN)
        in_flight = 0
        while sends or in_flight:
            now = time.perf_counter()
            if len(out.probes_sent) < len(probes) and probe_at[len(out.probes_sent)] <= now:
                out.probes_sent.append(time.time())
                with contextlib.suppress(OSError):  # EPERM: the ruleset dropped it, as meant
                    probes[len(out.probes_sent) - 1].sendto(b"x", BLOCKED)
            while sends and sends[0][0] <= now:
                _, i = heapq.heappop(sends)
                c = clients[i]
                c.miss = c.direct or random.random() < c.miss_share
                c.qid = secrets.randbits(16)
                c.seq += 1
                c.sent = time.perf_counter()
                c.sent_wall = time.time()
                with contextlib.suppress(OSError):  # unsent: lost at its deadline
                    c.sock.send(dns_query(c.qid, next(fresh) if c.miss else random.choice(HITS)))
                heapq.heappush(deadlines, (c.sent + TIMEOUT_S, i, c.seq))
                in_flight += 1
            while deadlines and deadlines[0][0] <= now:
                _, i, seq = heapq.heappop(deadlines)
                c = clients[i]
                if c.qid >= 0 and c.seq == seq:  # unanswered: lost, and the next one is due
                    out.lost += 1
                    kind = "direct" if c.direct else "miss" if c.miss else "hit"
                    out.lost_kinds[kind] = out.lost_kinds.get(kind, 0) + 1
                    in_flight -= 1
                    c.qid = -1
                    _next(c, now, end, sends)
            wake = min(sends[0][0] if sends else end, deadlines[0][0] if deadlines else end,
                       *probe_at[len(out.probes_sent) : len(out.probes_sent) + 1])  # fmt: skip
            for fd, _ in ep.poll(max(wake - time.perf_counter(), 0.0)):
                c = by_fd[fd]
                got = time.perf_counter()
                while True:
                    try:
                        data, ancillary, _, _ = c.sock.recvmsg(4096, room)
                    except OSError:  # drained (or an ICMP error): wait for more
                        break
                    if c.qid < 0 or data[:2] != struct.pack("!H", c.qid):
                        continue  # a late answer to an earlier query
                    ms = (got - c.sent) * 1000
                    if data[3] & 0xF != 0 or data[6:8] == b"\0\0":
                        out.bad += 1
                    kind = "direct" if c.direct else "miss" if c.miss else "hit"
                    (out.direct_ms if c.direct else out.miss_ms if c.miss else out.hit_ms).append(
                        ms
                    )
                    for level, kind_, cdata in ancillary:
                        if level == socket.SOL_SOCKET and kind_ == SO_TIMESTAMPNS:
                            sec, ns = STAMP.unpack_from(cdata)
                            out.stamped[kind].append((sec + ns / 1e9 - c.sent_wall) * 1000)
                    in_flight -= 1
                    c.qid = -1
                    _next(c, got, end, sends)
    finally:
        ep.close()
    return out, time.perf_counter() - start


def _next(c: Asker, now: float, end: float, sends: list[tuple[float, int]]) -> None:
    """Its next query: a period after the last was due, or now if that has passed."""
    c.due += c.period
    if c.due < end:
        heapq.heappush(sends, (max(c.due, now), c.index))


# -- the bench --------------------------------------------------------------------------------


@dataclass
class Step:
    n: int
    rss: tuple[float, float, int]
    create_ms: list[float]
    seq_rate: float
    burst_rate: float | str
    burst_delete_rate: float | str
    load: Load
    qps: float
    observer_cpu: float | None = None  # percent of one CPU during the DNS load
    observer_pss: float | None = None  # MB, supervisor and children
    egressd_cpu: float = 0.0  # percent of one CPU during the DNS load, its worker included
    # egressd's own timing of those creates (the sandbox JSON's create_ms): median by step
    create_steps: dict[str, float] = field(default_factory=dict)
    host_busy: float = 0.0  # percent of all CPUs busy during the DNS load, everyone's work
    freeze_ms: list[float] = field(default_factory=list)  # probe sent -> frozen, confirmed
    # Each layer's own part, ms from the probe's send: (when it decided to freeze, before
    # its durable record; when it read the cgroup frozen), one pair per freeze
    freeze_layers: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    scrape_s: list[float] = field(default_factory=list)  # each GET /metrics during the load
    # egressd's loop thread during the DNS load, per second of it: (s on a CPU, s waiting
    # for one, involuntary context switches)
    sched: tuple[float, float, float] | None = None


@dataclass
class Peer:
    """dnsmasq ``--nftset`` in every sandbox, under the load the last step put on egressd."""

    n: int
    load: Load
    qps: float
    cpu: float  # percent of one CPU, all its processes
    host_busy: float
    pss: float  # MB, all its processes, after the load
    version: str  # "dnsmasq 2.90", from dnsmasq --version


class Bench:
    def __init__(self, daemon: Egressd, uplink: str, args: argparse.Namespace) -> None:
        self.daemon = daemon
        self.observer: subprocess.Popen[bytes] | None = None
        self.uplink = uplink
        self.args = args
        self.boxes: list[dict[str, Any]] = []
        self.socks: list[socket.socket] = []
        self.fresh = fresh_names()
        self.failed: str | None = None
        self.counter = itertools.count()
        self.grown_from = 0  # the first of the boxes the last grow made

    def grow(self, n: int) -> tuple[list[float], float]:
        """Sequential creates up to n sandboxes: (latency of each in ms, creates/s); then
        a socket to each new one's resolver, and its hit names primed."""
        times: list[float] = []
        old = self.grown_from = len(self.boxes)
        start = time.perf_counter()
        while len(self.boxes) < n:
            t0 = time.perf_counter()
            try:
                self.boxes.append(create(self.daemon, next(self.counter), self.uplink))
            except DaemonError as exc:
                self.failed = f"create #{len(self.boxes) + 1} failed: {exc} ({exc.status})"
                break
            times.append((time.perf_counter() - t0) * 1000)
        wall = time.perf_counter() - start
        new = [resolver_socket(box["netns"]) for box in self.boxes[old:]]
        self.socks.extend(new)
        prime(new)
        return times, (len(times) / wall if times else 0.0)

    def burst(self, k: int) -> tuple[float | str, float | str]:
        """k creates from k threads at once, then k deletes likewise: (creates/s, deletes/s)."""
        made: list[str] = []

        def one(i: int) -> None:
            made.append(create(self.daemon, i, self.uplink)["id"])

        with ThreadPoolExecutor(k) as pool:
            start = time.perf_counter()
            futures = [pool.submit(one, next(self.counter)) for _ in range(k)]
            errors = [f.exception() for f in futures if f.exception() is not None]
            create_wall = time.perf_counter() - start
            start = time.perf_counter()
            list(pool.map(self.daemon.delete, made))
            delete_wall = time.perf_counter() - start
        if errors:
            return f"{len(errors)}/{k} failed: {errors[0]}", f"{len(made)} deleted"
        return k / create_wall, k / delete_wall

    def measure(self, seq: tuple[list[float], float]) -> Step:
        a = self.args
        rss = memory(self.daemon)
        burst, burst_del = self.burst(a.burst) if a.burst and not self.failed else ("-", "-")
        direct = resolver_socket(self.uplink, LAB_DNS)
        watched = self.observer_pids()
        served = [self.daemon.pid, *children(self.daemon.pid)]
        before, t0 = cpu_ticks(watched + served), time.monotonic()
        host_before = host_ticks()
        sched_before = loop_sched(self.daemon.pid)
        k = min(a.freezes, len(self.boxes))
        probed = self.boxes[:: len(self.boxes) // k][:k] if k > 0 else []
        probes: list[socket.socket] = []
        scraper = None
        try:
            probes.extend(udp_in(box["netns"]) for box in probed)
            if a.scrape:
                scraper = scrape_every(self.daemon.socket, a.scrape)
            load, wall = dns_load(self.socks, a.qps, a.seconds, a.miss_share, self.fresh, direct,
                                  probes)  # fmt: skip
        finally:
            direct.close()
            for p in probes:
                p.close()
            scrape_s = scrapes_made(scraper) if scraper is not None else []
        after, dt = cpu_ticks(watched + served), time.monotonic() - t0
        sched_after = loop_sched(self.daemon.pid)
        sched = None
        if sched_before is not None and sched_after is not None:
            ran, waited, taken = (b - a for a, b in zip(sched_before, sched_after, strict=True))
            sched = (ran / dt, waited / dt, taken / dt)
        busy, total = (b - a for a, b in zip(host_before, host_ticks(), strict=True))
        host_busy = 100 * busy / total if total else 0.0

        def cpu(pids: list[int]) -> float:
            return cpu_percent(before, after, pids, dt)

        obs_cpu = obs_pss = None
        if self.observer is not None:
            obs_cpu, obs_pss = cpu(watched), pss(self.observer_pids())
        freeze_ms, freeze_layers = self.frozen_after([b["id"] for b in probed], load.probes_sent)
        return Step(len(self.boxes), rss, seq[0], seq[1], burst, burst_del, load,
                    load.answered / wall, obs_cpu, obs_pss, cpu(served),
                    self.create_steps(), host_busy, freeze_ms, freeze_layers, scrape_s,
                    sched)  # fmt: skip

    def frozen_after(
        self, ids: list[str], sent: list[float]
    ) -> tuple[list[float], dict[str, list[tuple[float, float]]]]:
        """ms from each probe's send to its sandbox's freeze, as the kernel confirmed it
        and the journal holds it (the earlier layer's), and each layer's own (decided,
        confirmed); then each is resumed through the API, once both layers have
        confirmed (a later round may probe it again)."""
        journal = Journal.open(self.daemon.state)
        out = []
        layers: dict[str, list[tuple[float, float]]] = {}
        try:
            for sid, t0 in zip(ids, sent, strict=False):
                deadline = time.monotonic() + 5
                while True:
                    rows = [f for f in journal.freezes(sid, limit=1) if f["requested_at"] >= t0]
                    asks = rows[0]["requested_by"] if rows else []
                    if (
                        rows
                        and len(asks) >= (2 if self.observer else 1)
                        and all("confirmed_at" in a for a in asks)
                    ):
                        out.append((rows[0]["confirmed_at"] - t0) * 1000)
                        for a in asks:
                            layers.setdefault(a["layer"], []).append(
                                ((a["at"] - t0) * 1000, (a["confirmed_at"] - t0) * 1000)
                            )
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"sandbox {sid}: no confirmed freeze within 5 s")
                    time.sleep(0.01)
                self.daemon.client.call("POST", f"/v1/sandboxes/{sid}/resume", {"note": "bench"})
        finally:
            journal.close()
        return out, layers

    def idle_cpu(self, seconds: float) -> tuple[float, float | None]:
        """egressd's CPU % over ``seconds`` (its workers too), and its loop thread's ms
        on a CPU a second (None if the kernel did not say)."""
        served = [self.daemon.pid, *children(self.daemon.pid)]
        before, sched_before, t0 = cpu_ticks(served), loop_sched(self.daemon.pid), time.monotonic()
        time.sleep(seconds)
        after, sched_after, dt = (
            cpu_ticks(served),
            loop_sched(self.daemon.pid),
            time.monotonic() - t0,
        )
        loop_ms = None
        if sched_before is not None and sched_after is not None:
            loop_ms = (sched_after[0] - sched_before[0]) / dt * 1000
        return cpu_percent(before, after, served, dt), loop_ms

    def frozen_idle(
        self, k: int, seconds: float
    ) -> tuple[int, tuple[float, float | None], tuple[float, float | None]]:
        """No DNS load: egressd's CPU (``idle_cpu``) with no sandbox frozen, then with
        ``k`` of them (spread over them) frozen, as a node's may wait hours for a person,
        once each one's review has started and its looks for a thaw have backed off;
        then each is resumed through the API. (How many froze, before, while frozen.)"""
        base = self.idle_cpu(seconds)
        boxes = self.boxes[:: max(1, len(self.boxes) // k)][:k]
        cgroups = [Cgroup.attach_existing(b["cgroup"], b["freezer"]) for b in boxes]
        said = len(self.daemon.stderr())  # the --freezes probes' blocks came before
        try:
            for box in boxes:
                # EPERM: dropped, as it should be.
                with contextlib.closing(udp_in(box["netns"])) as sock, contextlib.suppress(OSError):
                    sock.sendto(b"x", BLOCKED)
            blocks = [f"egress: sandbox {b['id']} is FROZEN" for b in boxes]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                since = self.daemon.stderr()[said:]
                if all(cg.is_frozen() for cg in cgroups) and all(b in since for b in blocks):
                    break
                time.sleep(0.2)
            frozen = sum(cg.is_frozen() for cg in cgroups)
            time.sleep(2)  # each review's looks back off: a second apart from 1.55 s on
            busy = self.idle_cpu(seconds)
        finally:
            for box, cg in zip(boxes, cgroups, strict=True):
                try:
                    if cg.is_frozen():
                        self.daemon.client.call(
                            "POST", f"/v1/sandboxes/{box['id']}/resume", {"note": "bench"}
                        )
                except (DaemonError, EgressError) as exc:
                    print(f"  could not resume {box['id']}: {exc}", file=sys.stderr)
        return frozen, base, busy

    def dnsmasq_peer(self, workdir: Path) -> Peer:
        """The same DNS load on dnsmasq ``--nftset``, one in each sandbox (on PEER, beside
        egressd's resolver, which idles meanwhile, as does the observer layer: its copy
        rule names egressd's address), writing its answers' addresses into sets of the
        sandbox's table (bench_dns.DNSMASQ_SETS): the same machine, sandboxes and client
        with a C resolver in egressd's place. Not the same in all: no freezes or scrapes
        during it (dnsmasq has neither), and its questions upstream leave from the
        sandbox (its veth, the uplink's forwarding and NAT), egressd's from the uplink
        netns. DNSMASQ_SETS (two sets, and a rule that lets the sandbox reach the lab's
        DNS) stays until the sandboxes are deleted at the end; nothing runs in them."""
        a = self.args
        procs: list[subprocess.Popen[bytes]] = []
        socks: list[socket.socket] = []
        direct = None
        try:
            for i, box in enumerate(self.boxes):
                with NftHandle.open(box["netns"]) as nft:
                    nft.load(bench_dns.DNSMASQ_SETS)
                log = workdir / f"dnsmasq-{i}.log"
                # A cache for one sandbox's names (its default, 150, would do as well).
                argv = bench_dns.dnsmasq_argv(box["netns"], log, PEER[0], cache=1000)
                procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                              stdout=subprocess.DEVNULL))  # fmt: skip
            socks = [resolver_socket(box["netns"], PEER) for box in self.boxes]
            for i, (box, proc) in enumerate(zip(self.boxes, procs, strict=True)):
                log = workdir / f"dnsmasq-{i}.log"
                bench_dns.await_dnsmasq(proc, box["netns"], PEER[0], log, f" in sandbox #{i}")
            prime(socks)
            direct = resolver_socket(self.uplink, LAB_DNS)
            pids = [p.pid for p in procs]
            before, t0, host_before = cpu_ticks(pids), time.monotonic(), host_ticks()
            load, wall = dns_load(socks, a.qps, a.seconds, a.miss_share, self.fresh, direct)
            after, dt = cpu_ticks(pids), time.monotonic() - t0
            busy, total = (b - a for a, b in zip(host_before, host_ticks(), strict=True))
            cpu = cpu_percent(before, after, pids, dt)
            host_busy = 100 * busy / total if total else 0.0
            said = subprocess.run(["dnsmasq", "--version"], capture_output=True, text=True)
            found = re.search(r"version (\S+)", said.stdout)
            version = f"dnsmasq {found.group(1) if found else '(version unknown)'}"
            return Peer(len(socks), load, load.answered / wall, cpu, host_busy, pss(pids), version)
        finally:
            for sock in socks:
                sock.close()
            if direct is not None:
                direct.close()
            for p in procs:  # ours, by their PIDs
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    def create_steps(self) -> dict[str, float]:
        """Median ms of each create step egressd timed, over this step's sequential creates."""
        timed = [box.get("create_ms") or {} for box in self.boxes[self.grown_from :]]
        names = list(dict.fromkeys(k for t in timed for k in t))
        return {k: statistics.median(t[k] for t in timed if k in t) for k in names}

    def observer_pids(self) -> list[int]:
        if self.observer is None:
            return []
        return [self.observer.pid, *children(self.observer.pid)]

    def await_observers(self, timeout: float = 120.0) -> None:
        """Until the observer layer watches every sandbox (a child each, or its own)."""
        if self.observer is None:
            return
        deadline = time.monotonic() + timeout
        ids = {box["id"] for box in self.boxes}
        journal = Journal.open(self.daemon.state)
        try:
            while time.monotonic() < deadline:
                rows = {r["id"]: r for r in journal.sandboxes()}
                if all((rows.get(i) or {}).get("observer_pid") for i in ids):
                    return
                time.sleep(0.2)
        finally:
            journal.close()
        raise RuntimeError(f"the observer layer did not watch all {len(ids)} sandboxes")

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.socks.clear()

    def delete_all(self, threads: int = 4) -> tuple[int, float]:
        """Delete every sandbox our egressd serves; (how many, deletes/s)."""
        api: Client = self.daemon.client
        with contextlib.suppress(DaemonError):
            ids = [r["id"] for r in api.call("GET", "/v1/sandboxes")]
            start = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda sid: _quietly(self.daemon.delete, sid), ids))
            return len(ids), len(ids) / max(time.perf_counter() - start, 1e-9)
        return 0, 0.0


def _quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except DaemonError as exc:
        print(f"  (cleanup: {exc})", file=sys.stderr)


def show_header(args: argparse.Namespace) -> None:
    print(f"egressd: sandboxes created through the API; DNS: {args.qps:g} qps per sandbox "
          f"for {args.seconds:g} s, all at once, {args.miss_share:.0%} new names (misses), "
          f"the rest 4 primed names (hits); burst: {args.burst} creates from "
          f"{args.burst} threads")  # fmt: skip
    print(
        f"{'N':>4} {'RSS MB':>7} {'+kids':>6} {'fds':>5} {'MB/sbx':>7} "
        f"{'create p50/p95 ms':>18} {'seq/s':>6} {'burst/s':>8} {'del/s':>6} "
        f"{'hit p50/p99 ms':>15} {'miss p50/p99 ms':>16} {'direct p50/p99':>15} "
        f"{'qps':>6} {'lost':>5} {'bad':>4} {'CPU%':>5} {'obs CPU%':>8} {'obs PSS MB':>10} "
        f"{'host busy%':>10}"
    )


def show(step: Step, first: Step | None) -> None:
    own, kids, fds = step.rss
    per = "-"
    if first is not None and step.n > first.n:
        per = f"{(own + kids - first.rss[0] - first.rss[1]) / (step.n - first.n):.2f}"
    cm = step.create_ms
    create = f"{statistics.median(cm):.1f}/{pct(cm, 0.95):.1f}" if cm else "-"

    def rate(x: float | str) -> str:
        return f"{x:.1f}" if isinstance(x, float) else "-"

    ld = step.load
    hit = f"{pct(ld.hit_ms, 0.5):.2f}/{pct(ld.hit_ms, 0.99):.2f}"
    miss = f"{pct(ld.miss_ms, 0.5):.2f}/{pct(ld.miss_ms, 0.99):.2f}"
    direct = f"{pct(ld.direct_ms, 0.5):.2f}/{pct(ld.direct_ms, 0.99):.2f}"
    print(
        f"{step.n:>4} {own:>7.1f} {kids:>6.1f} {fds:>5} {per:>7} {create:>18} "
        f"{step.seq_rate:>6.1f} {rate(step.burst_rate):>8} {rate(step.burst_delete_rate):>6} "
        f"{hit:>15} {miss:>16} {direct:>15} {step.qps:>6.0f} {ld.lost:>5} {ld.bad:>4} "
        f"{step.egressd_cpu:>5.0f} {_num(step.observer_cpu, 0):>8} "
        f"{_num(step.observer_pss, 1):>10} {step.host_busy:>10.0f}",
        flush=True,
    )
    for x in (step.burst_rate, step.burst_delete_rate):
        if isinstance(x, str) and x != "-":
            print(f"      burst: {x}")
    if any(ld.stamped.values()):
        parts = ", ".join(
            f"{k} {pct(v, 0.5):.2f}/{pct(v, 0.99):.2f}" for k, v in ld.stamped.items()
        )
        print(f"      the same to each answer's arrival (kernel timestamp), p50/p99 ms: {parts}")
    if step.sched is not None:
        ran, waited, taken = step.sched
        print(f"      egressd's loop thread during the load, per second: {ran * 1000:.0f} ms on "
              f"a CPU, {waited * 1000:.0f} ms runnable but waiting for one, its CPU taken "
              f"{taken:,.0f} times while it had work")  # fmt: skip
    if ld.lost:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(ld.lost_kinds.items()))
        print(f"      lost (no answer within {TIMEOUT_S:g} s): {kinds}")
    if step.freeze_ms:
        fm = step.freeze_ms
        print(f"      a blocked datagram -> frozen (journal: kernel-confirmed), during the load, "
              f"n={len(fm)}: p50 {pct(fm, 0.5):.2f} ms, p99 {pct(fm, 0.99):.2f} ms, "
              f"max {max(fm):.2f} ms")  # fmt: skip
        for layer, pairs in sorted(step.freeze_layers.items()):
            decided, confirmed = [p[0] for p in pairs], [p[1] for p in pairs]
            print(f"        {layer}: decided p50 {pct(decided, 0.5):.2f} / p99 "
                  f"{pct(decided, 0.99):.2f} ms, read it frozen p50 {pct(confirmed, 0.5):.2f} "
                  f"/ p99 {pct(confirmed, 0.99):.2f} ms")  # fmt: skip
    if step.scrape_s:
        ss = [s for s in step.scrape_s if s >= 0]
        failed = len(step.scrape_s) - len(ss)
        took = f"p50 {pct(ss, 0.5):.2f} s, max {max(ss):.2f} s" if ss else "none answered"
        print(f"      GET /metrics during the load, n={len(step.scrape_s)}: {took}"
              + (f"; {failed} not answered 200" if failed else ""))  # fmt: skip
    if step.create_steps:
        parts = " ".join(f"{k} {v:.1f}" for k, v in step.create_steps.items() if k != "total")
        print(f"      create inside egressd, median ms: {step.create_steps['total']:.1f} = {parts}")


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def show_targets(step: Step, peer: Peer | None) -> None:
    """Issue 17's targets for egressd, against the last step (they are set at 1,000
    sandboxes and 5,000 qps in all), and dnsmasq's where it has the same figure (the
    peer's, unless --no-dnsmasq)."""
    own, kids, _ = step.rss
    ld = step.load
    pl = peer.load if peer is not None else None
    rows = [
        ("RSS, egressd and workers", "<= 400 MB", f"{own + kids:.0f} MB", own + kids <= 400,
         f"PSS {peer.pss:.0f} MB" if peer else ""),
        ("create p50", "<= 25 ms", f"{statistics.median(step.create_ms):.1f} ms"
         if step.create_ms else "-", bool(step.create_ms)
         and statistics.median(step.create_ms) <= 25, ""),
        ("cache hits p99", "<= 1 ms", f"{pct(ld.hit_ms, 0.99):.2f} ms",
         pct(ld.hit_ms, 0.99) <= 1, f"{pct(pl.hit_ms, 0.99):.2f} ms" if pl else ""),
        ("cache misses p99", "<= 3 ms", f"{pct(ld.miss_ms, 0.99):.2f} ms",
         pct(ld.miss_ms, 0.99) <= 3, f"{pct(pl.miss_ms, 0.99):.2f} ms" if pl else ""),
        ("lost", "0", str(ld.lost), ld.lost == 0, str(pl.lost) if pl else ""),
    ]  # fmt: skip
    if step.observer_cpu is not None:
        rows.append(("observer layer CPU", "< 100% (one core)", f"{step.observer_cpu:.0f}%",
                     step.observer_cpu < 100, ""))  # fmt: skip
    if step.freeze_ms:
        p99 = pct(step.freeze_ms, 0.99)
        rows.append((f"freeze p99 under load (n={len(step.freeze_ms)})", "<= 5 ms",
                     f"{p99:.2f} ms", p99 <= 5, ""))  # fmt: skip
    print(f"targets (issue 17: 1,000 sandboxes, 5,000 qps; measured at {step.n} sandboxes, "
          f"{step.qps:.0f} qps):")  # fmt: skip
    for what, target, got, met, theirs in rows:
        beside = f"   dnsmasq x{peer.n}: {theirs}" if peer is not None and theirs else ""
        print(f"  {what:<26} target {target:<18} measured {got:<10} "
              f"{'MET' if met else 'not met':<8}{beside}")  # fmt: skip
        if theirs and peer is not None:
            theirs = f"{theirs} (one dnsmasq in each sandbox, {peer.qps:,.0f} qps, no freezes)"
        figures.record("bench_egressd", f"egressd at {step.n} sandboxes, {step.qps:,.0f} qps: "
                       f"{what}", got, target, met, theirs)  # fmt: skip


def show_peer(peer: Peer) -> None:
    ld = peer.load

    def pair(xs: list[float]) -> str:
        return f"{pct(xs, 0.5):.2f}/{pct(xs, 0.99):.2f}"

    print(f"      {peer.version} --nftset in each of the {peer.n} sandboxes instead "
          f"({PEER[0]}; egressd idle beside it; no freezes; its questions upstream leave "
          f"from the sandbox), the same load: hit p50/p99 {pair(ld.hit_ms)} ms, miss "
          f"{pair(ld.miss_ms)} ms, direct {pair(ld.direct_ms)} ms, {peer.qps:,.0f} qps, lost "
          f"{ld.lost}, bad {ld.bad}; dnsmasq {peer.cpu:.0f}% of a CPU, PSS {peer.pss:.0f} MB; "
          f"host busy {peer.host_busy:.0f}%")  # fmt: skip
    if any(ld.stamped.values()):
        parts = ", ".join(f"{k} {pair(v)}" for k, v in ld.stamped.items())
        print(f"        to each answer's arrival (kernel timestamp), p50/p99 ms: {parts}")


def show_frozen_idle(
    n: int, k: int, base: tuple[float, float | None], busy: tuple[float, float | None]
) -> None:
    def loop(ms: float | None) -> str:
        return f", its loop thread {ms:.0f} ms on a CPU a second" if ms is not None else ""

    print(f"no DNS load, {n} sandboxes: none frozen: egressd {base[0]:.1f}% of a CPU"
          f"{loop(base[1])}; {k} frozen, awaiting review: {busy[0]:.1f}%"
          f"{loop(busy[1])}")  # fmt: skip


def run(args: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="egress-bench-egressd-"))
    lab: Lab | None = None
    daemon: Egressd | None = None
    bench: Bench | None = None
    try:
        lab = Lab.up(name=lab_name("egbd"))
        # Its own session: a Ctrl-C at the terminal reaches only us, so the sandboxes can
        # still be deleted through its API.
        daemon = Egressd(workdir, own_session=True)
        daemon.start()
        bench = Bench(daemon, lab.uplink_netns, args)
        if args.observer:
            bench.observer = daemon.observer(to_file=True)
        show_header(args)
        first: Step | None = None
        step = None
        for n in args.steps:
            seq = bench.grow(n)
            bench.await_observers()
            if seq[0] or first is None:
                step = bench.measure(seq)
                first = first or step
                show(step, first)
            if bench.failed:
                print(f"  stopped growing at {len(bench.boxes)} sandboxes: {bench.failed}")
                print(f"  egressd stderr (tail): {daemon.stderr()[-600:].strip()!r}")
                break
        peer = None
        if step is not None and args.dnsmasq and not bench.failed:
            try:
                peer = bench.dnsmasq_peer(workdir)
                show_peer(peer)
            except (EgressError, OSError, RuntimeError) as exc:  # the targets still print
                print(f"      dnsmasq in each sandbox: could not measure: {exc}")
        if step is not None and args.frozen_idle and not bench.failed:
            try:
                show_frozen_idle(len(bench.boxes), *bench.frozen_idle(
                    min(args.frozen_idle, len(bench.boxes)), 5.0))  # fmt: skip
            except (EgressError, OSError) as exc:  # the targets below still print
                print(f"no DNS load, sandboxes frozen: could not measure: {exc}")
        if step is not None:
            show_targets(step, peer)
    except KeyboardInterrupt:
        print("\ninterrupted; cleaning up", file=sys.stderr)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # cleanup runs to its end
        if bench is not None:
            bench.close()
            count, rate = bench.delete_all()
            if count:
                print(f"deleted {count} sandboxes through the API, {rate:.1f}/s (4 threads)")
            if bench.observer is not None:  # ours, by its PID
                bench.observer.terminate()
                try:
                    bench.observer.wait(30)
                except subprocess.TimeoutExpired:
                    bench.observer.kill()
                    bench.observer.wait()
        if daemon is not None:
            # Also what our egressd left in the kernel: e.g. a create still running when
            # Ctrl-C came, which the list above missed.
            for problem in daemon.cleanup():
                print(f"  cleanup: {problem}", file=sys.stderr)
        if lab is not None:
            lab.down()
        shutil.rmtree(workdir, ignore_errors=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", default="1,250,500,1000",
                    help="numbers of sandboxes to measure at (%(default)s)")  # fmt: skip
    ap.add_argument("--seconds", type=float, default=5.0, help="DNS load per step (5)")
    ap.add_argument("--qps", type=float, default=5.0,
                    help="queries/s per sandbox (5: 5,000 in all at 1,000)")  # fmt: skip
    ap.add_argument("--miss-share", type=float, default=0.2, help="share of new names (0.2)")
    ap.add_argument("--burst", type=int, default=8, help="concurrent creates per step (8)")
    ap.add_argument("--frozen-idle", type=int, default=500,
                    help="after the last step, this many sandboxes frozen at once, no DNS "
                         "load: egressd's CPU while they await review (500; 0: skip)")  # fmt: skip
    ap.add_argument(
        "--freezes",
        type=int,
        default=50,
        help="sandboxes frozen for a blocked datagram during each load (50)",
    )
    ap.add_argument("--scrape", type=float, default=0.0, metavar="SECONDS",
                    help="GET /metrics every SECONDS during each load, as a scraper would "
                         "(default 0: none)")  # fmt: skip
    ap.add_argument("--no-dnsmasq", dest="dnsmasq", action="store_false",
                    help="leave out dnsmasq --nftset in each sandbox under the last step's "
                         "load (default: measured, for the targets' dnsmasq figures)")  # fmt: skip
    ap.add_argument("--no-observer", dest="observer", action="store_false",
                    help="egressd alone, without `egressd observer` (default: both layers, "
                         "as deployed)")  # fmt: skip
    args = ap.parse_args()
    args.steps = sorted({int(x) for x in args.steps.split(",")})
    if os.geteuid() != 0:
        print("bench_egressd: needs root (it creates network namespaces); skipped")
        return 0
    # Two sockets a sandbox here (egressd's resolver's, dnsmasq's): past 1,024 at 1,000.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
