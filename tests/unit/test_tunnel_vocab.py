"""The whole-name price table (egress.tunnel.vocab): prices, eviction, saturation, size."""

from __future__ import annotations

import math
import random

from egress.tunnel import vocab
from egress.tunnel.vocab import MAX_COUNT, TOKEN, Vocab, label_bits, spell


class Reference:
    """PPM method C per context with unbounded dicts: what ``Vocab`` must price while no
    bucket overflows."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, int], int] = {}
        self.n: dict[int, int] = {}
        self.d: dict[int, int] = {}

    def use(self, ctx: int, key: int) -> float:
        n, d = self.n.get(ctx, 0), self.d.get(ctx, 0)
        self.n[ctx] = n + 1
        c = self.counts.get((ctx, key), 0)
        self.counts[(ctx, key)] = c + 1
        if c:
            return max(0.0, math.log2((n + d) / c))
        self.d[ctx] = d + 1
        return -1.0 - (max(0.0, math.log2((n + d) / d)) if d else 0.0)


def test_prices_are_method_c_while_no_bucket_overflows() -> None:
    # Keys that differ in their low bits land in different buckets of one context (its
    # salt is an XOR), so two contexts put at most two symbols in a bucket.
    rng = random.Random(4)
    for _ in range(20):
        table, ref = Vocab(512), Reference()
        contexts = rng.sample(range(vocab.CONTEXTS), 2)
        for _ in range(2_000):
            ctx, key = rng.choice(contexts), rng.randrange(100)
            assert table.use(ctx, key) == ref.use(ctx, key)


def test_small_integer_keys_never_pass_for_one_another() -> None:
    # Record types and label counts are small ints, and hash(n) is n: every one of the
    # 65,536 types is a symbol of its own in a zone's table (which holds 512 of them), so
    # none is ever priced as one seen before (CAA was A's symbol when only the low bits
    # picked the slot and the tag was the salt's).
    for ctx in (vocab.TYPE, vocab.COUNT):
        table = Vocab(vocab.ZONE_SLOTS)
        assert all(table.use(ctx, key) < 0 for key in range(65_536))


def _same_bucket(j: int) -> int:
    return j << 50  # the same low bits (bucket), different high bits (tag)


def test_a_full_bucket_evicts_its_least_counted_symbol() -> None:
    table = Vocab(512)
    a, b, c, d, e = map(_same_bucket, range(1, 6))
    for key, times in ((a, 3), (b, 2), (c, 1), (d, 1)):
        for _ in range(times):
            table.use(0, key)
    assert table.use(0, e) < 0  # new: takes c's slot (count 1, first of the least)
    assert table.use(0, d) >= 0
    assert table.use(0, a) >= 0
    assert table.use(0, c) < 0  # evicted: new again


def test_counts_saturate_and_prices_stay_finite() -> None:
    table = Vocab(512)
    for _ in range(MAX_COUNT + 5000):
        price = table.use(1, 7)
    n = MAX_COUNT + 4999  # uses before the last
    assert price == math.log2((n + 1) / MAX_COUNT)


def test_a_table_costs_four_bytes_a_slot() -> None:
    for slots in (vocab.ZONE_SLOTS, vocab.SANDBOX_SLOTS):
        table = Vocab(slots)
        size = sum(len(a) * a.itemsize for a in (table._tags, table._counts))
        assert size == 4 * slots


def test_a_label_is_spelled_by_its_parts_only_as_far_as_their_count_can_be_said() -> None:
    sixteen = "-".join(f"p{i}" for i in range(16))
    zone, sandbox = Vocab(512), Vocab(512)
    by_parts = spell(zone, sandbox, sixteen)
    assert zone._n[TOKEN] == 16  # each part priced (and counted) as a symbol
    assert by_parts <= 1.0 + label_bits(sixteen)
    seventeen = sixteen + "-p16"
    zone, sandbox = Vocab(512), Vocab(512)
    assert spell(zone, sandbox, seventeen) == 1.0 + label_bits(seventeen)
    assert zone._n[TOKEN] == 0
