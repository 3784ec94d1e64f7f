"""DNS-tunnel detection end to end: real iodine and dns2tcp against `egressctl run`.

Each case is a fresh sandbox in a throwaway lab, the tunnel server in the lab's internet
netns and the client as root inside the sandbox (netns and cgroup), exactly as
tests/privileged/test_tunnel.py runs them (helpers: tests/support/tunnels.py). Per case:

- queries / bytes: queries for the tunnel zone the lab DNS server received, and their
  subdomain text (left of t.lab.test / d.lab.test), before the freeze was requested
  ("total": all of them, after included; the budget is 2,048 B);
- detect: client started -> freeze requested (journal), in ms;
- latency: freeze requested -> cgroup confirmed frozen (journal), in ms;
- layer and rule: who froze first and the limit that was crossed;
- data: what crossed the tunnel (iodine: TCP connects the prober on iodined's side made to
  the agent through it; dns2tcp: connections and bytes the sink received).

Rows: iodine for every query type x downstream encoding (one attempt, as the tests run
it); iodine A and CNAME again as a persistent attacker that restarts iodine whenever it
gives up ("loop"); dns2tcp TXT and KEY; adaptive channels of tests/support/channels.py
as the sandbox's own workload at 100 names/s (word lists, joined words, counter, base36
chunks; "data" is the payload the receiver decodes from what reached the lab server,
budget 1 KB); with --slow, the tests' two slow exfiltration shapes and base36 chunks at
one name a second under a 10 min slow window limited to 512 B (a few minutes). No
assertions: figures only.

    .venv/bin/python bench/bench_tunnel_e2e.py [--repeat N] [--only REGEX] [--slow]
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.support

from egress.lab import Lab
from tests.support import channels
from tests.support import tunnels as tn

HEADER = (
    "case",
    "frozen",
    "layer",
    "queries",
    "bytes",
    "total q/B",
    "detect ms",
    "latency ms",
    "data",
    "rule",
)
_RULE = re.compile(r"suspected under [^:]+: (.*?) \(\d")


def cases(slow: bool) -> list[tuple[str, Callable[[Lab], tn.Outcome]]]:
    out: list[tuple[str, Callable[[Lab], tn.Outcome]]] = []
    for t in tn.IODINE_TYPES:
        for o in tn.IODINE_ENCODINGS:
            out.append((f"iodine {t}/{o}", partial(tn.run_iodine, qtype=t, encoding=o)))
    for t in ("A", "CNAME"):
        loop = partial(tn.run_iodine, qtype=t, encoding="base32", loop=True, timeout=30)
        out.append((f"iodine {t}/base32 loop", loop))
    for t in ("TXT", "KEY"):
        out.append((f"dns2tcp {t}", partial(tn.run_dns2tcp, qtype=t)))
    names = [c.name for c in channels.all_channels()]
    for name in FAST_CHANNELS:
        out.append((f"channel {name}", partial(channel, index=names.index(name), rate=100)))
    if slow:
        for shape in tn.SLOW:
            out.append((f"exfil {shape.name}", partial(tn.run_exfil, shape=shape)))
        out.append(
            (
                "channel base36 12, 1/s, slow window",
                partial(
                    channel,
                    index=names.index("base36 12"),
                    rate=1,
                    cap=2048,
                    tunnel=tn.SLOW_WINDOW_TUNNEL,
                    timeout=180,
                ),
            )
        )
    return out


FAST_CHANNELS = (
    "words 16x8",
    "words 256x4",
    "joined words 64: 3x2",
    "decimal counter",
    "base36 12",
)


def channel(
    lab: Lab,
    index: int,
    rate: float,
    cap: int = 8192,
    tunnel: str = tn.DETECT,
    timeout: float = 120.0,
) -> tn.Outcome:
    """A channel run as an Outcome row, its "data" the payload decoded at the lab server."""
    run = tn.run_channel(lab, index, rate, cap, tunnel, timeout)
    run.outcome.data = [f"{run.decoded} B decoded"]
    return run.outcome


def rule(out: tn.Outcome) -> str:
    if out.trigger is None:
        classes = sorted({v["class"] for v in out.violations})
        return f"(not frozen; violations: {', '.join(classes) or 'none'})"
    found = _RULE.search(out.trigger["detail"])
    return found.group(1) if found else f"{out.trigger['class']}: {out.trigger['detail'][:60]}"


def row(name: str, out: tn.Outcome) -> tuple[str, ...]:
    f = out.freeze
    detect = f"{out.detect_s * 1000:.0f}" if out.detect_s is not None else "-"
    latency = f"{f['latency_ms']:.1f}" if f and f.get("latency_ms") is not None else "-"
    if out.tool == "channel":
        data = out.data[0]
    else:
        data = "none" if not out.data else f"{len(out.data)} ({out.data[-1]})"
    return (
        name,
        "yes" if out.frozen else "NO",
        f["layer"] if f else "-",
        str(out.queries_before),
        str(out.bytes_before),
        f"{len(out.queries)}/{out.bytes}",
        detect,
        latency,
        data,
        rule(out),
    )


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    head = "  ".join(c.ljust(w) for c, w in zip(HEADER, widths, strict=True))
    return "\n".join([head, "  ".join("-" * w for w in widths), *lines])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=1, help="runs per case (default 1)")
    ap.add_argument("--only", help="run the cases whose name matches this regex")
    ap.add_argument("--slow", action="store_true", help="add the slow exfiltration shapes")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_tunnel_e2e needs root (network namespaces, cgroups)", file=sys.stderr)
        return 2
    chosen = [(n, f) for n, f in cases(args.slow) if not args.only or re.search(args.only, n)]
    state = tempfile.mkdtemp(prefix="egress-bench-state-")
    os.environ["EGRESS_STATE_DIR"] = state
    rows: list[tuple[str, ...]] = []
    bytes_by_case: dict[str, list[int]] = {}
    lab = Lab.up(name=f"eglb{secrets.token_hex(2)}")
    try:
        for name, run in chosen:
            for _ in range(args.repeat):
                out = run(lab)
                rows.append(row(name, out))
                bytes_by_case.setdefault(name, []).append(out.bytes_before)
                print(f"  {rows[-1][0]}: frozen={rows[-1][1]} bytes={rows[-1][4]}", flush=True)
    finally:
        lab.down()
        shutil.rmtree(state, ignore_errors=True)
    print()
    print(table(rows))
    frozen = [r for r in rows if r[1] == "yes"]
    if frozen:
        worst = max(frozen, key=lambda r: int(r[4]))
        med = statistics.median(int(r[4]) for r in frozen)
        print(
            f"\nfrozen: {len(frozen)} of {len(rows)} runs; subdomain bytes before the freeze: "
            f"median {med:.0f}, worst {worst[4]} ({worst[0]}); budget {tn.BUDGET}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
