"""The per-sandbox DNS token bucket (egress.resolver.ratelimit) on a fake clock, and the
policy knob that sets it (spec.dns.rate_limit)."""

from __future__ import annotations

import pytest

from egress.model import RateLimit
from egress.policy import parse_policy
from egress.resolver.ratelimit import TokenBucket

HEAD = "apiVersion: egress/v1\nkind: Policy\nmetadata: {name: t}\nspec:\n"


def test_a_full_burst_then_the_sustained_rate() -> None:
    bucket = TokenBucket(rate=50, burst=100, now=1000.0)
    assert bucket.take(1000.0, 64) == 64
    assert bucket.take(1000.0, 64) == 36  # the burst is spent
    assert bucket.take(1000.0) == 0
    assert bucket.take(1000.1, 64) == 5  # 0.1 s at 50/s
    granted = sum(bucket.take(1000.1 + i / 1000, 64) for i in range(1, 10_001))
    assert granted == 500  # ten seconds more: 50 a second, whatever the batch size


def test_wait_says_when_the_next_whole_token_is_due() -> None:
    bucket = TokenBucket(rate=4, burst=2, now=0.0)
    assert bucket.wait() == 0.0
    assert bucket.take(0.0, 2) == 2
    assert bucket.wait() == 0.25
    assert bucket.take(0.125, 1) == 0  # half a token
    assert bucket.wait() == 0.125
    assert bucket.take(0.25, 1) == 1


def test_a_quiet_spell_refills_up_to_the_burst_only() -> None:
    bucket = TokenBucket(rate=50, burst=100, now=0.0)
    assert bucket.take(0.0, 1000) == 100
    assert bucket.take(3600.0, 1000) == 100


def test_a_clock_that_steps_back_mints_nothing() -> None:
    bucket = TokenBucket(rate=16, burst=10, now=50.0)
    assert bucket.take(50.0, 10) == 10
    assert bucket.take(10.0, 10) == 0
    assert bucket.take(50.25, 10) == 4  # counted from 50.0, not from 10.0


def test_configure_keeps_saved_tokens_up_to_the_new_burst() -> None:
    bucket = TokenBucket(rate=1024, burst=1000, now=0.0)
    assert bucket.take(0.0, 990) == 990
    bucket.configure(rate=8, burst=5)  # 10 saved: 5 kept
    assert bucket.take(0.0, 64) == 5
    assert bucket.take(0.25, 64) == 2  # a quarter second at the new rate
    bucket.configure(rate=8, burst=500)
    assert bucket.take(0.25, 64) == 0  # a bigger bucket is not a refill


def test_the_quiet_time_before_a_swap_is_noticed_earns_at_the_new_rate() -> None:
    bucket = TokenBucket(rate=1, burst=3, now=0.0)
    assert bucket.take(0.0, 64) == 3
    bucket.configure(rate=1000, burst=1000)
    assert bucket.take(0.5, 1000) == 500
    bucket.configure(rate=1, burst=1000)
    assert bucket.take(1.5, 1000) == 1


@pytest.mark.parametrize(("rate", "burst"), [(0, 10), (-1, 10), (10, 0), (10, 0.5)])
def test_a_bucket_that_could_never_grant_is_refused(rate: float, burst: float) -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate, burst, 0.0)
    with pytest.raises(ValueError):
        TokenBucket(10, 10, 0.0).configure(rate, burst)


def test_policy_knob_and_its_defaults() -> None:
    policy, warnings = parse_policy(HEAD + "  dns: {allow: []}\n", "t.yaml")
    assert policy.dns.rate_limit == RateLimit(qps=500, burst=1000) and warnings == []
    text = HEAD + "  dns: {rate_limit: {qps: 50}, allow: []}\n"
    assert parse_policy(text, "t.yaml")[0].dns.rate_limit == RateLimit(qps=50, burst=1000)
    text = HEAD + "  dns: {rate_limit: {qps: 2000, burst: 100}, allow: []}\n"
    assert parse_policy(text, "t.yaml")[0].dns.rate_limit == RateLimit(qps=2000, burst=100)
