"""How long does Matcher.decide take on a 10,000-pattern policy?

Method: the policy is generated as YAML and loaded through parse_policy, like a real one
(a third each of exact, ``*.`` and ``**.`` patterns). For each workload we time batches
of BATCH calls with time.perf_counter_ns and divide by BATCH, which keeps the timer's
own cost and resolution out of the figure; median and p99 are over the batches.

- cold: every name in the run is unique, so the matcher's memo never helps (and, for
  hits, pays for inserting the name). This is the figure for a flood of new names.
- warm: the same few hundred names again and again, as a real workload looks.

Run: .venv/bin/python bench/bench_matcher.py
"""

from __future__ import annotations

import gc
import random
import statistics
import string
import time
from collections.abc import Callable

from egress.policy import Matcher, parse_policy

PATTERNS = 10_000
BATCH = 1_000
BATCHES = 200
WARM_NAMES = 250
TLDS = ("com", "net", "org", "io", "dev")


def label(rng: random.Random, size: int = 8) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(size))


def build(rng: random.Random) -> tuple[Matcher, dict[str, list[str]], float]:
    domains = [f"{label(rng)}.{rng.choice(TLDS)}" for _ in range(PATTERNS)]
    prefixes = ("", "*.", "**.")
    patterns = [prefixes[i % 3] + domain for i, domain in enumerate(domains)]
    text = "apiVersion: egress/v1\nkind: Policy\nmetadata: {name: bench}\nspec:\n  dns:\n"
    text += "    allow:\n" + "".join(f'      - "{p}"\n' for p in patterns)
    start = time.perf_counter()
    policy, _ = parse_policy(text, "<bench>")
    load_seconds = time.perf_counter() - start
    exact = domains[0::3]
    one, many = domains[1::3], domains[2::3]
    count = BATCH * BATCHES

    def hit_exact() -> str:
        # Random capitals make each spelling new to the memo; the rule found is the same.
        name = rng.choice(exact)
        return "".join(c.upper() if rng.random() < 0.3 else c for c in name)

    def hit_wildcard() -> str:
        if rng.random() < 0.5:
            return f"{label(rng, 6)}.{rng.choice(one)}"
        return f"{label(rng, 5)}.{label(rng, 4)}.{rng.choice(many)}"

    def miss() -> str:
        return f"{label(rng, 6)}.{label(rng, 7)}.{rng.choice(TLDS)}"

    makers: dict[str, Callable[[], str]] = {
        "hits-exact": hit_exact,
        "hits-wildcard": hit_wildcard,
        "misses": miss,
    }
    names = {kind: _unique(make, count) for kind, make in makers.items()}
    mixed = [name for group in zip(*names.values(), strict=True) for name in group][:count]
    names["mixed"] = mixed
    return Matcher(policy), names, load_seconds


def _unique(make: Callable[[], str], count: int) -> list[str]:
    seen: dict[str, None] = {}
    while len(seen) < count:
        seen[make()] = None
    return list(seen)


def per_call_ns(matcher: Matcher, names: list[str]) -> list[float]:
    decide = matcher.decide
    figures = []
    for start in range(0, len(names), BATCH):
        batch = names[start : start + BATCH]
        began = time.perf_counter_ns()
        for name in batch:
            decide(name, 1)
        figures.append((time.perf_counter_ns() - began) / len(batch))
    return figures


def report(title: str, figures: list[float]) -> None:
    ordered = sorted(figures)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    print(f"  {title:<24} median {statistics.median(figures):7.0f} ns   p99 {p99:7.0f} ns")


def main() -> None:
    rng = random.Random(20240601)
    matcher, names, load_seconds = build(rng)
    print(f"policy: {PATTERNS} patterns, parsed and validated in {load_seconds * 1000:.0f} ms")
    print(
        f"method: {BATCHES} batches x {BATCH} decide() calls, perf_counter_ns per batch / {BATCH}"
    )
    gc.collect()
    for kind, workload in names.items():
        print(kind)
        report("cold (unique names)", per_call_ns(Matcher(matcher.policy), workload))
        repeated = workload[:WARM_NAMES] * (len(workload) // WARM_NAMES)
        warm = Matcher(matcher.policy)
        per_call_ns(warm, repeated[:BATCH])  # fill the memo
        report(f"warm ({WARM_NAMES} names again)", per_call_ns(warm, repeated))


if __name__ == "__main__":
    main()
