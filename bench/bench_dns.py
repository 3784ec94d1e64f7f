"""The filtering resolver against dnsmasq 2.90 + --nftset, in lab sandboxes. Needs root.

Two figures (DESIGN.md: the answer waits for the kernel's set, so both matter):

1. Throughput on cache hits: ``dnsperf -c 4 -T 1 -q 50 -l 10`` run INSIDE a sandbox netns
   (``ip netns exec``) against 127.0.0.53, with a query file of allowed names, primed first.
   Ours is a ResolverServer in its own process (as ``egressctl run`` would serve it), on the
   standard asyncio loop and on uvloop when that is installed; dnsmasq runs in a second
   sandbox made from the same policy (same ruleset, same per-packet DNS log rule), with
   ``--nftset`` into timeout sets of that sandbox's ``inet egress`` table. Target: ours
   >= 0.7 x dnsmasq.
2. Latency on cache misses, set update included: sequential queries for unique AnyIP names
   (``ip-198-19-A-B.any.lab.test``: every answer is a new address, so every answer is a set
   insert), against the same client asking the lab DNS directly, alternating query by query,
   from where each resolver asks it (ours: the uplink netns; dnsmasq: its sandbox netns,
   through the veth). "added" is the difference of the percentiles.
   Target: ours adds p50 <= 0.4 ms, p99 <= 1.5 ms.

Run: ``.venv/bin/python bench/bench_dns.py [--seconds 10] [--misses 3000]``. Prints figures,
asserts nothing. Everything it makes (a lab, two sandboxes, processes, a temp dir) is
removed on the way out, on failure too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: bench-dns}
spec:
  dns:
    upstreams: ["198.51.100.53"]
    rate_limit: {qps: 1000000, burst: 1000000}  # the resolver's own speed, limiter on
    allow:
      - allowed.lab.test
      - www.allowed.lab.test
      - "*.cdn.lab.test"
      - "*.wild.lab.test"
      - "*.any.lab.test"
  connect:
    ports: [80, 443, 8081]
"""
LAB_DNS = "198.51.100.53"
RESOLVER = "127.0.0.53"
DNSPERF = ["dnsperf", "-c", "4", "-T", "1", "-q", "50"]
HIT_NAMES = [
    *(f"{n} {t}" for n in ("allowed.lab.test", "www.allowed.lab.test") for t in ("A", "AAAA")),
    "a1.cdn.lab.test A",
    "a2.cdn.lab.test A",
    "a3.cdn.lab.test A",
    "a3.cdn.lab.test AAAA",
    *(f"w{i}.wild.lab.test {t}" for i in range(40) for t in ("A", "AAAA")),
]


# -- the resolver process ------------------------------------------------------------------


def serve(netns: str, uplink: str, policy_file: str, loop_kind: str, score: str) -> None:
    """Child process: one ResolverServer for the sandbox, until SIGTERM; stats on stdout."""
    from egress.inline.server import ResolverServer
    from egress.kernel.nft import NftHandle
    from egress.policy import load_policy
    from egress.resolver.core import ResolverCore

    policy = load_policy(policy_file)
    scorer = make_scorer(policy) if score == "score" else None
    core = ResolverCore(policy, 1, secrets.randbits, scorer=scorer)  # type: ignore[arg-type]
    nft = NftHandle.open(netns)
    server = ResolverServer(
        core=core,
        upstreams=[(LAB_DNS, 53)],
        nft=nft,
        on_violation=lambda v: None,
        listen_netns=netns,
        upstream_netns=uplink,
    )

    async def main() -> None:
        await server.start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        print("READY", flush=True)
        await stop.wait()
        await server.close()

    if loop_kind == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())
    stats = {
        **core.stats,
        "internal_errors": server.internal_errors,
        "last_internal_error": server.last_internal_error,
        "set_updates": server.sets.updates,
        "set_failures": server.sets.failures + server.sets.slow,
    }
    print(json.dumps(stats), flush=True)


class Child:
    """A process we started; stopped by its own PID only."""

    def __init__(self, argv: list[str], ready: str | None = None) -> None:
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True
        )
        if ready is not None:
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()
            if line.strip() != ready:
                self.stop()
                raise RuntimeError(f"{argv[:4]}... did not start: {line!r}")

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out or ""


def _stats(out: str) -> dict[str, object]:
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    return dict(json.loads(lines[-1])) if lines else {}


# -- clients -------------------------------------------------------------------------------


def dns_query(qid: int, name: str, qtype: int = 1) -> bytes:
    q = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\x00"
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + q + struct.pack("!HH", qtype, 1)


def udp_socket(netns: str) -> socket.socket:
    from egress.kernel.netns import in_netns

    with in_netns(netns):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3.0)
    return s


def ask(s: socket.socket, server: str, name: str, qtype: int = 1) -> tuple[float, int]:
    """(round trip in ms, rcode); raises on a timeout or a mismatched reply."""
    qid = secrets.randbits(16)
    data = dns_query(qid, name, qtype)
    t0 = time.perf_counter()
    s.sendto(data, (server, 53))
    reply = s.recv(4096)
    ms = (time.perf_counter() - t0) * 1000
    if struct.unpack_from("!H", reply)[0] != qid:
        raise RuntimeError(f"reply with the wrong ID for {name}")
    return ms, reply[3] & 0xF


def dnsperf(netns: str, query_file: Path, seconds: int) -> dict[str, float]:
    argv = ["ip", "netns", "exec", netns, *DNSPERF, "-l", str(seconds)]
    argv += ["-s", RESOLVER, "-d", str(query_file)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60)
    return parse_dnsperf(done.stdout, done.stderr)


def parse_dnsperf(text: str, stderr: str = "") -> dict[str, float]:
    """dnsperf's summary: qps, mean latency (ms), lost and completed queries."""
    out = {}
    for key, pattern in (
        ("qps", r"Queries per second:\s+([\d.]+)"),
        ("latency_ms", r"Average Latency \(s\):\s+([\d.]+)"),
        ("lost", r"Queries lost:\s+(\d+)"),
        ("completed", r"Queries completed:\s+(\d+)"),
    ):
        m = re.search(pattern, text)
        if m is None:
            raise RuntimeError(f"dnsperf output not understood:\n{text}\n{stderr}")
        out[key] = float(m.group(1))
    out["latency_ms"] *= 1000
    rcodes = re.search(r"Response codes:\s+(.*)", text)
    out_rc = rcodes.group(1) if rcodes else "?"
    if "NOERROR" not in out_rc or any(c in out_rc for c in ("SERVFAIL", "REFUSED", "NXDOMAIN")):
        print(f"   (response codes: {out_rc})")
    return out


def prime(netns: str, names: list[str]) -> None:
    s = udp_socket(netns)
    try:
        for line in names:
            name, qtype = line.split()
            _, rcode = ask(s, RESOLVER, name, 28 if qtype == "AAAA" else 1)
            if rcode != 0:
                raise RuntimeError(f"priming {line}: rcode {rcode}")
    finally:
        s.close()


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


def miss_latency(
    client_ns: str, server: str, direct_ns: str, names: list[str], direct_names: list[str]
) -> tuple[list[float], list[float]]:
    """Round trips through ``server`` and straight to the lab DNS, alternating, so both
    find the lab equally warm (its reply time doubles once it has slept ~0.5 ms)."""
    via, direct = udp_socket(client_ns), udp_socket(direct_ns)
    out: tuple[list[float], list[float]] = ([], [])
    try:
        for name, other in zip(names, direct_names, strict=True):
            for sock, target, n, into in ((via, server, name, out[0]),
                                          (direct, LAB_DNS, other, out[1])):  # fmt: skip
                ms, rcode = ask(sock, target, n)
                if rcode != 0:
                    raise RuntimeError(f"{n} via {target}: rcode {rcode}")
                into.append(ms)
    finally:
        via.close()
        direct.close()
    return out


def anyip_names(tag: int, count: int) -> list[str]:
    """Unique names under the AnyIP zone, each answered with its own address (tag < 10)."""
    assert count <= 25 * 250 and tag < 10
    return [f"ip-198-19-{tag * 25 + i // 250}-{i % 250 + 1}.any.lab.test" for i in range(count)]


# -- dnsmasq -------------------------------------------------------------------------------

DNSMASQ_SETS = """
add set inet egress dm4 { type ipv4_addr; flags timeout; timeout 10m; }
add set inet egress dm6 { type ipv6_addr; flags timeout; timeout 10m; }
insert rule inet egress output ip daddr 198.51.100.53 meta l4proto { tcp, udp } th dport 53 accept
"""


def dnsmasq_argv(netns: str, log: Path, listen: str = RESOLVER, cache: int = 10000) -> list[str]:
    """dnsmasq on ``listen`` in the sandbox netns, forwarding to the lab DNS, writing the
    answers' addresses into timeout sets of the same ``inet egress`` table (dnsmasq cannot
    write ``ip . proto . port`` elements, so the sets hold addresses only: DNSMASQ_SETS,
    which also lets it reach the lab DNS)."""
    return ["ip", "netns", "exec", netns, "dnsmasq", "--keep-in-foreground",
            "--conf-file=/dev/null", "--no-resolv", "--no-hosts", "--no-poll",
            f"--listen-address={listen}", "--bind-interfaces", "--port=53",
            f"--server={LAB_DNS}", f"--cache-size={cache}", "--dns-forward-max=1000",
            "--nftset=/lab.test/4#inet#egress#dm4,6#inet#egress#dm6",
            "--user=root", "--pid-file=", f"--log-facility={log}"]  # fmt: skip


def start_dnsmasq(netns: str, workdir: Path) -> Child:
    """dnsmasq on 127.0.0.53 in the sandbox netns (``dnsmasq_argv``), once it answers."""
    log = workdir / "dnsmasq.log"
    child = Child(dnsmasq_argv(netns, log))
    try:
        await_dnsmasq(child.proc, netns, RESOLVER, log)
    except RuntimeError:
        child.stop()
        raise
    return child


def await_dnsmasq(
    proc: subprocess.Popen[Any], netns: str, listen: str, log: Path, where: str = ""
) -> None:
    """Until the dnsmasq ``proc`` answers on ``listen`` in ``netns`` (10 s), or say why it
    did not (``where``: which one, for the message)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dnsmasq{where} exited: {log.read_text() if log.exists() else ''}")
        try:
            s = udp_socket(netns)
            s.settimeout(0.2)
            try:
                ask(s, listen, "allowed.lab.test")
                return
            finally:
                s.close()
        except OSError:
            time.sleep(0.05)
    said = log.read_text().strip()[-400:] if log.exists() else ""
    raise RuntimeError(f"dnsmasq{where} did not answer within 10 s" + (f": {said}" if said else ""))


# -- orchestration -------------------------------------------------------------------------


@contextlib.contextmanager
def lab_and_sandboxes(policy_file: Path) -> Iterator[tuple[object, object, object]]:
    from egress.datapath.addressing import Pools
    from egress.lab import Lab
    from egress.policy import load_policy
    from egress.sandbox import lifecycle as sandbox

    lab = Lab.up(name=f"eglb{secrets.token_hex(2)}")
    made = []
    try:
        policy = load_policy(str(policy_file))
        for _ in range(2):
            made.append(sandbox.create(policy, Pools.parse(None), lab.uplink_netns))
        yield lab, made[0], made[1]
    finally:
        for sb in made:
            with contextlib.suppress(Exception):
                sb.destroy()
        lab.down()


def make_scorer(policy: object) -> object | None:
    """egress.tunnel's scorer when there is one, its lab.test limits raised 1000x: the
    miss run's 3,000 unique names in seconds are tunnel-shaped by design."""
    try:
        from egress.model import TunnelZoneOverride
        from egress.tunnel import TunnelScorer
    except ImportError:
        return None
    override = TunnelZoneOverride("lab.test", limit_scale=1000.0)
    spec = dataclasses.replace(policy.tunnel, zones=(override,))  # type: ignore[attr-defined]
    return TunnelScorer(spec, time.time)


def tunnel_note() -> str:
    try:
        from egress.tunnel import TunnelScorer  # noqa: F401
    except ImportError as exc:
        return f"egress.tunnel.TunnelScorer is not importable ({exc}): no tunnel scoring"
    return (
        "tunnel scoring on: TunnelScorer sees every forwarded query (lab.test limits x1000); "
        "cache hits skip it by design"
    )


def throughput(sb_ns: str, qfile: Path, seconds: int, label: str) -> dict[str, float]:
    prime(sb_ns, HIT_NAMES)
    r = dnsperf(sb_ns, qfile, seconds)
    show_run(label, r)
    return r


def show_run(label: str, r: dict[str, float]) -> None:
    """One dnsperf run's line."""
    print(f"  {label:<28} {r['qps']:>10,.0f} qps   mean latency {r['latency_ms']:.3f} ms   "
          f"lost {r['lost']:.0f}")  # fmt: skip


def load_policy_text(text: str) -> object:
    from egress.policy import parse_policy

    return parse_policy(text, "bench.yaml")[0]


def show_latency(label: str, ms: list[float], base: list[float]) -> None:
    p50, p99 = percentile(ms, 0.5), percentile(ms, 0.99)
    b50, b99 = percentile(base, 0.5), percentile(base, 0.99)
    print(f"  {label:<28} p50 {p50:6.3f} ms  p99 {p99:6.3f} ms   direct p50 {b50:6.3f} "
          f"p99 {b99:6.3f}   added p50 {p50 - b50:+6.3f} ms  p99 {p99 - b99:+6.3f} ms")  # fmt: skip


def run(args: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="egress-bench-dns-"))
    children: list[Child] = []
    try:
        policy_file = workdir / "policy.yaml"
        policy_file.write_text(POLICY)
        qfile = workdir / "queries.txt"
        qfile.write_text("\n".join(HIT_NAMES) + "\n")
        with lab_and_sandboxes(policy_file) as (lab, ours_sb, dm_sb):
            uplink = lab.uplink_netns  # type: ignore[attr-defined]
            ours_ns, dm_ns = ours_sb.netns, dm_sb.netns  # type: ignore[attr-defined]
            dm_sb.nft.load(DNSMASQ_SETS)  # type: ignore[attr-defined]
            print(f"bench_dns: {tunnel_note()}")
            # (label, loop, tunnel scorer, dnsperf too): hits never reach the scorer
            variants = [("asyncio", "asyncio", True, True)]
            if _has_uvloop():
                variants.append(("uvloop", "uvloop", True, True))
            if make_scorer(load_policy_text(POLICY)) is not None:
                variants.append(("asyncio, no scorer", "asyncio", False, False))
            me = [sys.executable, os.path.abspath(__file__), "--serve"]
            results: dict[str, dict[str, float]] = {}
            misses: dict[str, list[float]] = {}
            direct: dict[str, list[float]] = {}
            print(f"cache hits: {' '.join(DNSPERF)} -l {args.seconds}, "
                  f"{len(HIT_NAMES)} allowed names, inside the sandbox netns")  # fmt: skip
            for i, (label, kind, scored, hits) in enumerate(variants):
                score = "score" if scored else "noscore"
                argv = [*me, ours_ns, uplink, str(policy_file), kind, score]
                child = Child(argv, ready="READY")
                children.append(child)
                try:
                    if hits:
                        results[label] = throughput(
                            ours_ns, qfile, args.seconds, f"egress ({label})"
                        )
                    misses[label], direct[label] = miss_latency(
                        ours_ns, RESOLVER, uplink, anyip_names(2 * i, args.misses),
                        anyip_names(2 * i + 1, args.misses))  # fmt: skip
                finally:
                    children.remove(child)
                    stats = _stats(child.stop())
                print(f"    server ({label}): {json.dumps(stats)}")
            dm = start_dnsmasq(dm_ns, workdir)
            children.append(dm)
            results["dnsmasq"] = throughput(dm_ns, qfile, args.seconds, "dnsmasq 2.90 --nftset")
            misses["dnsmasq"], direct["dnsmasq"] = miss_latency(
                dm_ns, RESOLVER, dm_ns, anyip_names(8, args.misses), anyip_names(9, args.misses)
            )
            dm4 = dm_sb.nft.list_set("inet", "egress", "dm4")  # type: ignore[attr-defined]
            print(f"    dnsmasq nftset dm4 holds {len(dm4)} elements")
            dnsmasq_qps = results["dnsmasq"]["qps"]
            for label, result in results.items():
                if label != "dnsmasq":
                    ratio = result["qps"] / dnsmasq_qps
                    print(f"  ratio egress ({label}) / dnsmasq: {ratio:.2f}  (target >= 0.70)")
            print(f"cache misses: {args.misses} sequential unique AnyIP names, each a set insert")
            for label, _, _, _ in variants:
                show_latency(f"egress ({label})", misses[label], direct[label])
            show_latency("dnsmasq --nftset", misses["dnsmasq"], direct["dnsmasq"])
            print("  (target: egress adds p50 <= 0.4 ms, p99 <= 1.5 ms)")
    finally:
        for child in children:
            child.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(*sys.argv[2:7])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--misses", type=int, default=3000)
    args = parser.parse_args()
    lacking = missing()
    if lacking:
        print(f"bench_dns: {lacking}; skipped")
        return
    run(args)


def missing() -> str | None:
    """What this machine lacks for a run against dnsmasq (None: nothing)."""
    if os.geteuid() != 0:
        return "needs root (it creates network namespaces)"
    if shutil.which("dnsperf") is None or shutil.which("dnsmasq") is None:
        return "needs dnsperf and dnsmasq (Debian packages)"
    return None


if __name__ == "__main__":
    main()
