"""What the resolver core costs per query, compiled by mypyc and as Python sources.

The core's part of a query, with no sockets (the shell's sends, the kernel's set update
and the upstream's time are not in it), on ``bench_deployed``'s policy:

- replay: a repeated UDP query answered from ``ResolverCore.replay`` (a cache hit);
- miss: ``on_query`` for a new name under a rule (parse, judge, forward; the tunnel
  score too where ``can_defer`` does not clear it), then ``on_upstream_reply`` (parse,
  filter, cache, set plan) and ``on_allowed``: the core's part of the answer's path;
- settle: what the shell asks of the core after it has sent (``ResolverCore.settle``:
  the tunnel scoring of a query sent first, an answer's rcode), off that path.

Each run twice: back to back (warm), and with 0.5 ms idle before each query (cold: the
sequential miss run of ``bench_deployed`` waits on the upstream that long, and a core
that slept runs its code from cold caches). Three builds, each in its own process: all
compiled; the resolver's modules as sources, the tunnel scorer still compiled (as before
the resolver was compiled); everything as sources (``EGRESS_NATIVE=0``). Best of 5
rounds for warm, medians for cold. Asserts nothing.

    .venv/bin/python bench/bench_core.py
"""

from __future__ import annotations

import json
import os
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

NAMES, ROUNDS, IDLE_S = 1_000, 5, 0.0005


def answer(forwarded: bytes, ip: str) -> bytes:
    """The upstream's answer to ``forwarded``: its question, one A record (TTL 60)."""
    qid = forwarded[:2]
    question = forwarded[12 : forwarded.index(b"\0", 12) + 5]
    header = qid + struct.pack("!HHHHH", 0x8180, 1, 1, 0, 0)
    record = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4) + bytes(map(int, ip.split(".")))
    return header + question + record


def measure(resolver_compiled: bool) -> dict[str, object]:
    if not resolver_compiled:  # before egress.resolver is first imported, which activates
        from egress.native import Native

        activate = Native.activate
        Native.activate = lambda self, path: (  # type: ignore[method-assign]
            self.package != "egress.resolver" and activate(self, path)
        )
    import bench_deployed
    import bench_dns

    from egress.inline.server import make_core
    from egress.policy import parse_policy
    from egress.resolver.actions import AllowThenReply, Forward
    from egress.resolver.native import NATIVE

    policy, _ = parse_policy(bench_deployed.POLICY, "bench")
    names = bench_dns.anyip_names(1, NAMES * (ROUNDS + 1))
    from egress.tunnel.native import NATIVE as TUNNEL

    out: dict[str, object] = {"in_use": f"resolver {NATIVE.in_use()}, tunnel {TUNNEL.in_use()}"}

    settled = [0.0]  # the time of the last miss's settles (off the answer's path)

    def miss(core: object, name: str, i: int) -> float:
        """The core's time for one miss on the answer's path; the bytes in are made
        outside it, and its settles (as the shell calls them, after the send and after
        the answer) are timed apart, into ``settled``."""
        asked = bench_dns.dns_query(i & 0xFFFF, name)
        ip = name.split(".", 1)[0][3:].replace("-", ".")
        start = time.perf_counter()
        [fwd] = core.on_query(asked, "c", False, time.time())  # type: ignore[attr-defined]
        assert isinstance(fwd, Forward)
        paused = time.perf_counter()
        assert core.settle(time.time()) == []  # type: ignore[attr-defined]
        first = time.perf_counter() - paused
        reply = answer(fwd.data, ip)  # the upstream's part
        resumed = time.perf_counter()
        acts = core.on_upstream_reply(fwd.token, reply, time.time())  # type: ignore[attr-defined]
        [allow] = acts
        assert isinstance(allow, AllowThenReply)
        core.on_allowed(allow.token, len(allow.adds), time.time())  # type: ignore[attr-defined]
        end = time.perf_counter()
        assert core.settle(time.time()) == []  # type: ignore[attr-defined]
        settled[0] = first + time.perf_counter() - end
        return end - resumed + paused - start

    core = make_core(policy, 1)
    hit = bench_dns.dns_query(7, "allowed.lab.test")
    [fwd] = core.on_query(hit, "c", False, time.time())  # the hit's answer, cached
    acts = core.on_upstream_reply(fwd.token, answer(fwd.data, "198.19.0.1"), time.time())
    core.on_allowed(acts[0].token, len(acts[0].adds), time.time())
    core.on_query(hit, "c", False, time.time())  # a cache hit: replayable from now on
    assert core.replay(hit, time.time()) is not None
    best = float("inf")
    now = time.time()  # the shell reads the clock once per batch of datagrams
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(20_000):
            core.replay(hit, now)
        best = min(best, (time.perf_counter() - start) / 20_000)
    out["replay warm"] = best
    cold = []
    for _ in range(2_000):
        time.sleep(IDLE_S)
        now = time.time()
        start = time.perf_counter()
        core.replay(hit, now)
        cold.append(time.perf_counter() - start)
    out["replay cold"] = statistics.median(cold)

    best = best_settle = float("inf")
    for r in range(ROUNDS):
        spent = settling = 0.0
        for i, name in enumerate(names[r * NAMES : (r + 1) * NAMES]):
            spent += miss(core, name, i)
            settling += settled[0]
        best = min(best, spent / NAMES)
        best_settle = min(best_settle, settling / NAMES)
    out["miss warm"] = best
    out["settle warm"] = best_settle
    cold, cold_settle = [], []
    for i, name in enumerate(names[ROUNDS * NAMES :]):
        time.sleep(IDLE_S)
        cold.append(miss(core, name, i))
        cold_settle.append(settled[0])
    out["miss cold"] = statistics.median(cold)
    out["settle cold"] = statistics.median(cold_settle)
    return out


def child(native: str, resolver: str = "1") -> dict[str, object]:
    env = {**os.environ, "EGRESS_NATIVE": native}
    done = subprocess.run([sys.executable, __file__, "--child", resolver], env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    result: dict[str, object] = json.loads(done.stdout)
    return result


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(measure(sys.argv[2] == "1")))
        return
    runs = [child("1"), child("1", "0"), child("0")]
    print(
        "the resolver core per query, us: all compiled / resolver as sources (tunnel "
        "compiled) / all sources"
    )
    for label, r in zip(("all compiled", "resolver as sources", "all sources"), runs, strict=True):
        print(f"  {label}: {r['in_use']}")
    for key in ("replay warm", "replay cold", "miss warm", "miss cold", "settle warm",
                "settle cold"):  # fmt: skip
        a, b, c = (float(str(r[key])) * 1e6 for r in runs)
        print(f"  {key:<12} {a:7.2f} / {b:7.2f} / {c:7.2f}   {b / a:4.1f}x / {c / a:4.1f}x")


if __name__ == "__main__":
    main()
