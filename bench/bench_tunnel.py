"""DNS-tunnel scorer: cost per query, detection delay per tool, false verdicts on real names.

Reads tests/data/benign_names.txt (corpus) and tests/data/tunnel_samples/*.txt (generated
iodine/dns2tcp/slow-channel streams and real captures). Prints:

- cost of ``observe_query`` per query, median and p99 (µs), on an ordinary zone's whole
  path (limits out of reach by value, so the sum over all zones runs too): the benign
  corpus replayed (repeats hit the memo caches, as real traffic does), each benign name
  once, unique short names, 8-word names and iodine's names (cold: every feature
  computed) as the resolver hands them to the scorer (lowercase; a name with bytes no
  hostname has is refused before scoring) and as sent (what ``egressctl check`` scores:
  both cases, escapes), each run once untimed (process-wide tables filled, as in a running
  resolver) and then measured 3 times (the p99 of each run, and their median); for the
  implementation in use (``egress.tunnel.native``: compiled or the sources) and, in a
  child process, the other one; and how often this machine interrupts a busy loop, which
  is what p99 figures on a VM include;
- detection delay for each sample stream: queries and bytes of subdomain text forwarded
  upstream before the verdict (budget 2,048 B; slow channels 4,096 B);
- false verdicts on the benign corpus at a realistic rate (one query every 2 s on average)
  and in bursts like a parallel ``pip install`` / ``npm install`` (150 and 400 names in 1 s),
  both corpora (tests/data/benign_names.txt and benign_extra.txt) in one sandbox, and the
  share of its queries ``can_defer`` clears (the resolver scores those after their send);
- the adaptive channels of tests/support/channels.py: payload bytes the receiver decodes
  from what was forwarded, fast (100 queries/s; budget 1 KB) and slow (one query every
  10 s, and every 10-60 s at random, for 2 h; budget 2 KB in either hour).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo root: tests.support.channels

from egress.model import TunnelSpec  # noqa: E402
from egress.resolver import wire  # noqa: E402
from egress.tunnel import TunnelScorer, TunnelVerdict, native  # noqa: E402
from egress.tunnel.features import name_features  # noqa: E402
from egress.tunnel.labels import split_name, unescape_labels  # noqa: E402
from egress.tunnel.zone import RULES  # noqa: E402
from tests.support import channel_replay as cr  # noqa: E402
from tests.support import channels as ch  # noqa: E402

DATA = ROOT / "tests" / "data"
TYPES = {"A": 1, "NS": 2, "CNAME": 5, "NULL": 10, "PTR": 12, "MX": 15, "TXT": 16, "KEY": 25}
TYPES |= {"AAAA": 28, "SRV": 33, "HTTPS": 65, "CAA": 257, "PRIVATE": 65399}


def read(path: Path) -> list[tuple[str, int]]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            parts = line.split()
            kind = parts[1] if len(parts) > 1 else "A"
            out.append((parts[0], int(kind) if kind.isdigit() else TYPES[kind]))
    return out


class Clock:
    now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def replay(queries: list[tuple[str, int]], gaps: list[float]) -> list[TunnelVerdict]:
    return replay_deferring(queries, gaps)[0]


def replay_deferring(
    queries: list[tuple[str, int]], gaps: list[float]
) -> tuple[list[TunnelVerdict], int, int]:
    """The verdicts, how many queries ``can_defer`` cleared (the resolver sends those
    before scoring them), and how many of those then made a verdict (the bound is sound:
    0, or it is a bug)."""
    clock = Clock()
    scorer = TunnelScorer(TunnelSpec(), clock)
    cleared = unsound = 0
    for (name, qtype), gap in zip(queries, gaps, strict=True):
        clock.now += gap
        deferred = scorer.can_defer(name, qtype)
        verdict = scorer.observe_query(name, qtype)
        cleared += deferred
        unsound += deferred and verdict is not None
        if verdict is None:
            scorer.observe_response(name, 0)
    return list(scorer.verdicts), cleared, unsound


# Every limit out of reach by its value, not by a zone's scale: each query takes the whole
# path of an ordinary zone (the sum over all zones included) and none the verdict shortcut.
NEVER = TunnelSpec(**{r.field: 10**12 for r in RULES})


def cost(queries: list[tuple[str, int]], cold: bool, reps: int = 1) -> tuple[float, float]:
    """Median and p99 (us) of ``observe_query`` over ``reps`` fresh scorers."""
    times = []
    timer = time.perf_counter_ns
    for _ in range(reps):
        clock = Clock()
        scorer = TunnelScorer(NEVER, clock)
        if cold:
            name_features.cache_clear()
            split_name.cache_clear()
        for name, qtype in queries:
            clock.now += 0.5
            start = timer()
            scorer.observe_query(name, qtype)
            times.append(timer() - start)
    times.sort()
    return statistics.median(times) / 1000, times[int(len(times) * 0.99)] / 1000


RUNS = 3  # each row is measured this many times: a tail figure moves with the machine


def as_resolved(name: str) -> str | None:
    """``name`` as the resolver hands it to the scorer (``resolver.judge``): its wire labels
    in the resolver's text form, lowercase; None for a name with bytes no hostname has,
    which the resolver refuses as a tunnel before any scoring (iodine's base128)."""
    text = wire.name_text([label.encode("latin-1") for label in unescape_labels(name)])
    return text if wire.is_hostname(text) else None


def cost_rows(benign: list[tuple[str, int]]) -> list[tuple[str, float, list[float]]]:
    """Per row: its label, the median of its runs' medians, and each run's p99."""
    rng = random.Random(1)
    short = [(f"{rng.getrandbits(40):x}.z{i % 50}.example.com", 1) for i in range(20_000)]
    iodine = [q for p in sorted((DATA / "tunnel_samples").glob("iodine_*.txt")) for q in read(p)]
    resolved = [(text, qtype) for name, qtype in iodine if (text := as_resolved(name))]
    words = ch.words(16, 8).queries(random.Random(2).randbytes(40_000), ["exfil-lab.com"])
    once = [(name, 1) for name in dict.fromkeys(name for name, _ in benign)]
    rows = []
    for label, queries, cold, reps in (
        ("benign corpus, replayed 5x", benign * 5, False, 1),
        (f"benign names, each once ({len(once):,})", once, True, 10),
        ("unique short names", short, True, 1),
        ("unique 8-word names", words, True, 1),
        (f"iodine names as resolved ({len(resolved)})", resolved, True, 30),
        (f"iodine names as sent ({len(iodine)})", iodine, True, 30),
    ):
        # Once untimed: a running resolver has its process-wide tables filled (expected
        # entropy per length and alphabet, the PSL's suffixes); what a new name costs
        # beyond that (each name's features, its zone's tables) is timed cold.
        cost(queries, cold)
        runs = [cost(queries, cold, reps) for _ in range(RUNS)]
        rows.append((label, statistics.median(m for m, _ in runs), [p for _, p in runs]))
    return rows


def interruptions(seconds: float = 1.0) -> tuple[float, float]:
    """(per second, median us) of the gaps > 3 us a busy loop sees: what the machine (timer
    ticks, the hypervisor) adds to any call that happens to be running then."""
    timer = time.perf_counter_ns
    gaps = []
    last = start = timer()
    while last - start < seconds * 1e9:
        now = timer()
        if now - last > 3000:
            gaps.append(now - last)
        last = now
    return len(gaps) / seconds, statistics.median(gaps) / 1000 if gaps else 0.0


def tail(p99s: list[float]) -> str:
    return f"{statistics.median(p99s):.1f}: " + "/".join(f"{p:.0f}" for p in p99s)


def print_costs(benign: list[tuple[str, int]]) -> None:
    here = native.in_use()
    # The peer: the same rows with the other implementation, in a child process.
    env = {**os.environ, "EGRESS_NATIVE": "0" if here.startswith("compiled") else "1"}
    child = subprocess.run(
        [sys.executable, __file__, "--cost-rows"], env=env, capture_output=True, text=True
    )
    peer = json.loads(child.stdout) if child.returncode == 0 else None
    ours = cost_rows(benign)
    rate, gap = interruptions()
    print(f"cost of observe_query per query (us), default limits path; this run: {here}")
    other = peer["in_use"] if peer else "no peer"
    print(f"  {'':<38} {'median':>7} {'p99 (median of 3 runs: each)':>29}   {other}: the same")
    for i, (label, median, p99s) in enumerate(ours):
        line = f"  {label:<38} {median:7.1f} {tail(p99s):>29}"
        if peer and peer["in_use"] != here:
            _, peer_median, peer_p99s = peer["rows"][i]
            line += f"   {peer_median:6.1f} {tail(peer_p99s)}"
        print(line)
    print(
        f"  machine: {rate:,.0f} interruptions/s, {gap:.0f} us each (median, busy loop): a call"
        f" longer than {0.01 / max(rate, 1.0) * 1e6:.0f} us is hit more than 1% of the time,"
        " and its p99 includes one"
    )


def print_delays() -> None:
    print("\ndetection delay            gap     queries   bytes before verdict   first rule")
    for path in sorted((DATA / "tunnel_samples").glob("*.txt")):
        queries = read(path)
        gap = 4.0 if path.name.startswith("slow") else 0.005
        verdicts, _, unsound = replay_deferring(queries, [gap] * len(queries))
        if unsound:
            print(f"  {path.stem:<24} UNSOUND: {unsound} queries cleared by can_defer crossed")
        if not verdicts:
            print(f"  {path.stem:<24} {gap:5g}s   NOT DETECTED in {len(queries)} queries")
            continue
        v = verdicts[0]
        budget = 4096 if path.name.startswith("slow") else 2048
        flag = "ok" if v.bytes_before < budget else "OVER BUDGET"
        print(
            f"  {path.stem:<24} {gap:5g}s {v.queries_before:6d} {v.bytes_before:10,d} B < "
            f"{budget:,} {flag:<3}  {v.reasons[0].rule}"
        )


def print_false_verdicts(benign: list[tuple[str, int]]) -> None:
    rng = random.Random(5)
    n = len(benign)
    print(f"\nbenign corpus: {n:,} queries, {len({q for q, _ in benign}):,} distinct names")
    runs = {
        "realistic rate (mean 2 s)": [rng.expovariate(0.5) for _ in benign],
        "bursts of 150 in 1 s": [20.0 if i % 150 == 0 else 1 / 150 for i in range(n)],
        "bursts of 400 in 1 s": [20.0 if i % 400 == 0 else 1 / 400 for i in range(n)],
        "all at once": [0.0] * n,
    }
    for label, gaps in runs.items():
        verdicts, cleared, unsound = replay_deferring(benign, gaps)
        bad = f"; UNSOUND: {unsound} cleared queries crossed" if unsound else ""
        print(f"  {label:<28} false verdicts {len(verdicts)} / {n:,} queries; scored after "
              f"the send (can_defer) {cleared / n:.0%}{bad}")  # fmt: skip


def print_channels() -> None:
    payload = random.Random(3).randbytes(32768)
    print("\nadaptive channels: payload bytes decoded by the receiver (budgets 1 KB; 2 KB/h)")
    print(f"  {'channel':<34} {'fast: decoded':>13} {'queries':>8}  {'slow: worst hour':>16}  rule")
    for channel in ch.all_channels():
        verdict, sent = cr.replay(channel, [0.01] * 20_000, payload)
        fast = cr.decoded(channel, sent)
        worst, rules = 0, []
        for pace in ("10", "10-60"):
            rng = random.Random(channel.name)
            gaps = [10.0 if pace == "10" else rng.uniform(10, 60) for _ in range(720)]
            slow_verdict, slow_sent = cr.replay(channel, gaps, payload)
            worst = max(worst, *cr.per_hour(channel, slow_sent))
            rules.append(slow_verdict.reasons[0].rule if slow_verdict else "none")
        fast_rule = verdict.reasons[0].rule if verdict else "NOT DETECTED"
        flag = "ok" if verdict and fast <= 1024 and worst <= 2048 else "OVER BUDGET"
        print(
            f"  {channel.name:<34} {fast:11,d} B {len(sent):8d}  {worst:14,d} B  "
            f"{flag}: {fast_rule}; slow {'/'.join(rules)}"
        )


def main() -> None:
    benign = read(DATA / "benign_names.txt") + read(DATA / "benign_extra.txt")
    if sys.argv[1:] == ["--cost-rows"]:  # the peer run of print_costs
        print(json.dumps({"in_use": native.in_use(), "rows": cost_rows(benign)}))
        return
    print_costs(benign)
    print_delays()
    print_false_verdicts(benign)
    print_channels()


if __name__ == "__main__":
    main()
