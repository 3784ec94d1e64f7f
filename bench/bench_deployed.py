"""`egressctl run` as deployed, against dnsmasq 2.90 ``--nftset`` in the same run.

Issue 17's figures for one sandbox, with everything a user runs turned on: the inline
layer (resolver, set writer, NFLOG session, first-bytes queue), the observer in its own
process reading its copy of every DNS packet and answer, and the sandbox's ruleset. The
workload is what `egressctl run` starts (its uid, PID namespace and view). The peer is
dnsmasq in a second sandbox of the same policy (same ruleset, so the same per-packet DNS
log rule), writing its answers' addresses into timeout sets (bench_dns.start_dnsmasq).

1. Cache hits: ``dnsperf -c 4 -T 1 -q 50 -l SECONDS`` (a 1 s run first primes the cache);
   ours as the workload of ``egressctl run``, dnsmasq's from inside its sandbox netns,
   taking turns for --rounds rounds, so a change in the machine's load between them
   weighs on both; each side's qps is its queries over its time in all rounds.
   Target: ours >= 1.0 x dnsmasq.
2. Added cache-miss latency, set update included: sequential unique AnyIP names (every
   answer a new address, so a set insert), each timed by a client inside the sandbox,
   and the same name kind asked of the lab DNS directly from where each resolver asks
   it (ours: the uplink netns; dnsmasq: its sandbox netns), the four kinds of question
   in turn (ours, its direct one, dnsmasq, its direct one). "added" is the difference of
   the percentiles. Target: ours <= dnsmasq's, p50 and p99.
3. Violation to frozen: the workload sends one blocked datagram per byte the bench writes
   to its stdin; the time until the kernel confirmed the freeze, as the journal holds it
   (the earlier of both layers' confirmations, read after the run), so it includes a pipe
   wake-up and the workload's send. dnsmasq has nothing like it.
   Target: p50 <= 0.5 ms, p99 <= 2 ms. Beside it: the part from the workload's send (its
   clock read just before it, so without the wake-up), the part after the first layer read
   the violation (the journal's latency_ms: the layers' own work, the durable write and
   the freeze), and the part no code of ours can take out: a layer's intent (the
   violation, durable before the freeze) is one O_DSYNC write of a 4 KiB block; the same
   write alone, in the same directory, paced alike.

Prints each figure next to its target and dnsmasq's; asserts nothing. Needs root.

    .venv/bin/python bench/bench_deployed.py [--seconds 10] [--rounds 3] [--misses 1500] [-n 200]

``--misses 0`` and ``-n 0`` leave those parts out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import bench_dns as bd
import bench_freeze as bf
import figures

# bench_dns's policy (the same names and rate limit), as `egressctl run` is given it, and:
POLICY = (
    bd.POLICY.replace("bench-dns", "bench-deployed")
    + """\
  tunnel:
    # the miss run's unique names in seconds are tunnel-shaped by design
    zones: [{zone: lab.test, scale: 1000}]
  violations: {blocked_connect: freeze}
"""
)

# One stdlib client, the workload of the miss and freeze runs (no egress import: it runs
# as the sandbox's own uid in its own view of the host).
CLIENT = r"""
import secrets, socket, struct, sys, time
mode = sys.argv[1]
if mode == "miss":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3.0)
    print("ready", flush=True)
    for line in sys.stdin:
        name = line.strip()
        qid = secrets.randbits(16)
        q = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
        data = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + q + b"\0\1\0\1"
        t0 = time.perf_counter()
        s.sendto(data, ("127.0.0.53", 53))
        reply = s.recv(4096)
        ms = (time.perf_counter() - t0) * 1000
        ok = struct.unpack_from("!H", reply)[0] == qid
        print(f"{ms:.4f} {reply[3] & 15 if ok else 99}", flush=True)
else:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    print("ready", flush=True)
    port = 1000
    while sys.stdin.buffer.read(1):
        port += 1  # a new flow each time: a layer freezes once per flow
        t = time.time()  # the violation's moment, as the workload saw it
        try:
            s.sendto(b"x", ("203.0.113.99", port))
        except OSError:
            pass
        print(repr(t), flush=True)
"""

TARGETS = {
    "hits": "ours >= 1.0 x dnsmasq",
    "miss": "ours <= dnsmasq, p50 and p99",
    "freeze": "p50 <= 0.5 ms, p99 <= 2 ms",
}


class Deployed:
    """One `egressctl run` of the workload ``argv``, its stdin and stdout ours."""

    def __init__(self, lab: object, work: Path, state: Path, argv: list[str]) -> None:
        policy = state / "policy.yaml"  # the operator's copy: outside the workdir
        policy.write_text(POLICY)
        self.log = state / f"egressctl-{time.monotonic_ns()}.log"
        cmd = [sys.executable, "-m", "egress.cli.main", "run", "--policy", str(policy),
               "--uplink-netns", lab.uplink_netns,  # type: ignore[attr-defined]
               "--state-dir", str(state), "--workdir", str(work), "--", *argv]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "SUDO_USER"}
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
        with self.log.open("w") as err:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env
            )

    def line(self) -> str:
        assert self.proc.stdout is not None
        got = self.proc.stdout.readline().decode()
        if not got:
            raise RuntimeError(f"egressctl run ended early:\n{self.log.read_text()[-2000:]}")
        return got.strip()

    def write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def finish(self, timeout: float = 60) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        try:
            out = self.proc.stdout.read().decode()
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # ours, by its PID; its observer then removes the sandbox
            self.proc.wait()
            raise
        return out


def hits(lab: object, work: Path, state: Path, seconds: int) -> dict[str, float]:
    dnsperf = " ".join(bd.DNSPERF) + " -s 127.0.0.53 -d queries.txt"
    script = f"{dnsperf} -l 1 >/dev/null && {dnsperf} -l {seconds}"
    run = Deployed(lab, work, state, ["/bin/sh", "-c", script])
    out = run.finish(timeout=seconds + 120)
    if run.proc.returncode != 0:
        log = run.log.read_text()[-2000:]
        raise RuntimeError(f"dnsperf under egressctl run: rc {run.proc.returncode}\n{out}\n{log}")
    return bd.parse_dnsperf(out)


def misses(lab: object, work: Path, state: Path, dm_ns: str, n: int) -> list[list[float]]:
    """Round trips of n unique names each: through `egressctl run`, straight to the lab
    DNS from the uplink netns, through dnsmasq, straight to it from dnsmasq's netns."""
    run = Deployed(lab, work, state, ["/usr/bin/python3", "client.py", "miss"])
    out: list[list[float]] = [[], [], [], []]
    socks = []
    try:
        if run.line() != "ready":
            raise RuntimeError("the miss client did not start")
        uplink = lab.uplink_netns  # type: ignore[attr-defined]
        socks = [bd.udp_socket(uplink), bd.udp_socket(dm_ns), bd.udp_socket(dm_ns)]
        asks = ((socks[0], bd.LAB_DNS, "asked directly"), (socks[1], bd.RESOLVER, "dnsmasq"),
                (socks[2], bd.LAB_DNS, "asked directly from dnsmasq's netns"))  # fmt: skip
        for names in zip(*(bd.anyip_names(tag, n) for tag in range(4)), strict=True):
            run.write(f"{names[0]}\n".encode())
            ms, rcode = run.line().split()
            if rcode != "0":
                raise RuntimeError(f"{names[0]} under egressctl run: rcode {rcode}")
            out[0].append(float(ms))
            for (sock, server, how), name, into in zip(asks, names[1:], out[1:], strict=True):
                ms_other, rc = bd.ask(sock, server, name)
                if rc != 0:
                    raise RuntimeError(f"{name} {how}: rcode {rc}")
                into.append(ms_other)
    finally:
        for sock in socks:
            sock.close()
        run.finish()
    return out


def freezes(
    lab: object, work: Path, state: Path, n: int
) -> tuple[list[float], list[float], list[float]]:
    """Per freeze: ms from the bench's byte to the kernel's confirmation, from the
    workload's send (its clock read just before it) to it, and from the first layer's
    read of the violation to it (the journal's latency_ms)."""
    from egress.freeze import review
    from egress.kernel.cgroup import Cgroup
    from egress.store.journal import Journal

    run = Deployed(lab, work, state, ["/usr/bin/python3", "client.py", "freeze"])
    rounds: list[tuple[int, float]] = []
    sent: list[tuple[int, float]] = []
    journal = Journal.open(state)
    try:
        if run.line() != "ready":
            raise RuntimeError("the freeze client did not start")
        running = [r for r in journal.sandboxes() if r["state"] == "running"]
        sandbox_id = str(running[-1]["id"])
        cgroup = Cgroup.open(sandbox_id)
        paced = bf.Paced()
        for _ in range(n):
            paced.wait()
            before = bf.newest_freeze(journal, sandbox_id)
            t0 = time.time()
            run.write(b"x")
            rounds.append((bf.await_confirmed_freeze(journal, sandbox_id, before), t0))
            bf.await_two_sightings(journal, sandbox_id)  # then resume, as a person would
            review.resume(journal, cgroup, sandbox_id, 0, "bench")  # as egressctl resume
            try:
                sent.append((rounds[-1][0], float(run.line())))
            except ValueError:
                raise RuntimeError("the freeze client lost its round") from None
    except BaseException:
        # a frozen sandbox waits for a decision: end it, or `egressctl run` never returns
        for row in journal.sandboxes():
            if row["state"] == "running":
                journal.record_decision(str(row["id"]), "kill", 0, time.time(), "bench failed")
                with contextlib.suppress(Exception):
                    Cgroup.open(str(row["id"])).kill()
        raise
    finally:
        journal.close()
        run.finish()
    return bf.confirmed_ms(state, rounds), bf.confirmed_ms(state, sent), bf.own_ms(state, rounds)


@contextlib.contextmanager
def dnsmasq_sandbox(lab: object, workdir: Path) -> Iterator[str]:
    from egress.datapath.addressing import Pools
    from egress.sandbox import lifecycle as sandbox

    sb = sandbox.create(
        bd.load_policy_text(POLICY),
        Pools.parse(None),
        lab.uplink_netns,  # type: ignore[attr-defined]
    )
    child = None
    try:
        sb.nft.load(bd.DNSMASQ_SETS)
        child = bd.start_dnsmasq(sb.netns, workdir)
        yield sb.netns
    finally:
        if child is not None:
            child.stop()
        sb.destroy()


def hit_rounds(
    lab: object, work: Path, state: Path, dm_ns: str, seconds: int, rounds: int
) -> tuple[dict[str, float], dict[str, float], list[float]]:
    """Ours and dnsmasq's cache-hit runs, taking turns (ours first in odd rounds, second in
    even ones: neither always gets the later moment): each side's runs as one, and the
    ratio of each round's."""
    pairs = []
    for r in range(rounds):
        got: dict[str, dict[str, float]] = {}
        for side in ("ours", "dnsmasq") if r % 2 == 0 else ("dnsmasq", "ours"):
            if side == "ours":
                got[side] = hits(lab, work, state, seconds)
                bd.show_run(f"egressctl run, round {r + 1}", got[side])
            else:
                got[side] = bd.throughput(dm_ns, work / "queries.txt", seconds,
                                          f"dnsmasq, round {r + 1}")  # fmt: skip
        pairs.append((got["ours"], got["dnsmasq"]))
    return (_overall([o for o, _ in pairs]), _overall([t for _, t in pairs]),
            [o["qps"] / t["qps"] for o, t in pairs])  # fmt: skip


def _overall(runs: list[dict[str, float]]) -> dict[str, float]:
    """dnsperf runs as one: their queries over their time."""
    done = sum(r["completed"] for r in runs)
    return {"qps": done / sum(r["completed"] / r["qps"] for r in runs), "completed": done}


def pct(xs: list[float], q: float) -> float:
    return bd.percentile(xs, q)


def run(args: argparse.Namespace) -> None:
    from egress.lab import Lab

    tmp = Path(tempfile.mkdtemp(prefix="egress-bench-deployed-"))
    try:
        work, state = tmp / "work", tmp / "state"
        work.mkdir()
        state.mkdir(mode=0o750)
        tmp.chmod(0o755)
        work.chmod(0o755)
        (work / "queries.txt").write_text("\n".join(bd.HIT_NAMES) + "\n")
        (work / "client.py").write_text(CLIENT)
        lab = Lab.up(name=f"egdp{os.getpid() % 10000}")
        try:
            with dnsmasq_sandbox(lab, tmp) as dm_ns:
                print(f"egressctl run as deployed (both layers) vs dnsmasq 2.90 --nftset; "
                      f"load {os.getloadavg()[0]:.2f}")  # fmt: skip
                ours, theirs, each = hit_rounds(lab, work, state, dm_ns, args.seconds, args.rounds)
                ratio = ours["qps"] / theirs["qps"]
                print(f"cache hits ({' '.join(bd.DNSPERF)} -l {args.seconds}, {args.rounds} "
                      f"rounds each, taking turns):")  # fmt: skip
                mark = "MET" if ratio >= 1.0 else "not met"
                print(f"  egressctl run {ours['qps']:>9,.0f} qps   dnsmasq {theirs['qps']:>9,.0f}"
                      f" qps   ratio {ratio:.2f} (rounds {min(each):.2f}-{max(each):.2f})   "
                      f"target: {TARGETS['hits']}   {mark}")  # fmt: skip
                figures.record("bench_deployed", "`egressctl run` as deployed, cache hits "
                               f"(`{' '.join(bd.DNSPERF)} -l {args.seconds}`, {args.rounds} "
                               f"rounds each, taking turns)",
                               f"{ours['qps']:,.0f} qps ({ratio:.2f}x; rounds "
                               f"{min(each):.2f}-{max(each):.2f}x)", "ours >= 1.0x dnsmasq",
                               ratio >= 1.0, f"{theirs['qps']:,.0f} qps")  # fmt: skip
                if args.misses:
                    via, direct, dm_via, dm_direct = misses(lab, work, state, dm_ns, args.misses)
                    print(f"added cache-miss latency ({args.misses} sequential unique names, "
                          f"each a set insert):")  # fmt: skip
                    added = {}
                    for label, (a, b) in (("egressctl run", (via, direct)),
                                          ("dnsmasq", (dm_via, dm_direct))):  # fmt: skip
                        added[label] = (pct(a, 0.5) - pct(b, 0.5), pct(a, 0.99) - pct(b, 0.99))
                        a50, a99 = added[label]
                        print(f"  {label:<14} p50 {pct(a, 0.5):6.3f} ms  p99 {pct(a, 0.99):6.3f} ms"
                              f"   direct p50 {pct(b, 0.5):6.3f}  p99 {pct(b, 0.99):6.3f}   added "
                              f"p50 {a50:+6.3f}  p99 {a99:+6.3f} ms")  # fmt: skip
                    o, d = added["egressctl run"], added["dnsmasq"]
                    met = o[0] <= d[0] and o[1] <= d[1]
                    print(f"  ratio p50 {o[0] / d[0]:.2f}x  p99 {o[1] / d[1]:.2f}x   target: "
                          f"{TARGETS['miss']}   {'MET' if met else 'not met'}")  # fmt: skip
                    figures.record("bench_deployed", f"the same, latency a cache miss adds, set "
                                   f"update included ({args.misses} names), p50 / p99",
                                   f"+{o[0]:.3f} / +{o[1]:.3f} ms", "ours <= dnsmasq, p50 and p99",
                                   met, f"+{d[0]:.3f} / +{d[1]:.3f} ms")  # fmt: skip
            if args.n:
                lat, from_send, own = freezes(lab, work, state, args.n)
                p50, p99 = pct(lat, 0.5), pct(lat, 0.99)
                met = p50 <= 0.5 and p99 <= 2.0
                # What the journal's disk alone takes of it (invariant 5: durable first)
                disk = bf.durable_write_ms(state, args.n)
                d50, d99 = pct(disk, 0.5), pct(disk, 0.99)
                print(f"violation to frozen (n={args.n}, both layers, egressctl run):")
                print(f"  p50 {p50:.2f} ms  p99 {p99:.2f} ms  max {max(lat):.2f} ms   "
                      f"target: {TARGETS['freeze']}   {'MET' if met else 'not met'}   "
                      f"(dnsmasq: no such thing)")  # fmt: skip
                s50, s99 = pct(from_send, 0.5), pct(from_send, 0.99)
                print(f"  of which from the workload's send (its clock just before it): "
                      f"p50 {s50:.2f} ms  p99 {s99:.2f} ms")  # fmt: skip
                o50, o99 = pct(own, 0.5), pct(own, 0.99)
                print(f"  of which from a layer's read of the violation (the journal's "
                      f"latency_ms): p50 {o50:.2f} ms  p99 {o99:.2f} ms")  # fmt: skip
                print(f"  of which the disk: a durable 4 KiB write alone, paced alike, "
                      f"p50 {d50:.2f} ms  p99 {d99:.2f} ms")  # fmt: skip
                figures.record("bench_deployed", f"the same, violation to frozen, both layers "
                               f"(n={args.n}), p50 / p99", f"{p50:.2f} / {p99:.2f} ms",
                               "p50 <= 0.5 ms, p99 <= 2 ms", met,
                               f"dnsmasq: no such thing; from the workload's send: "
                               f"{s50:.2f} / {s99:.2f} ms; from a layer's read of the "
                               f"violation: {o50:.2f} / {o99:.2f} ms; "
                               f"the disk's durable write before it, alone: "
                               f"{d50:.2f} / {d99:.2f} ms")  # fmt: skip
        finally:
            lab.down()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"at least 1, not {n}")
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=10, help="dnsperf's run per round")
    parser.add_argument("--rounds", type=_positive, default=3, help="cache-hit rounds per side")
    parser.add_argument("--misses", type=int, default=1500, help="cache misses (0: none)")
    parser.add_argument("-n", type=int, default=200, help="freezes (0: none)")
    args = parser.parse_args()
    missing = bd.missing()
    if missing:
        print(f"bench_deployed: {missing}; skipped")
        return
    run(args)


if __name__ == "__main__":
    main()
