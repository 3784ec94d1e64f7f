"""A token bucket: how many queries one sandbox may have answered, now.

    policy dns.rate_limit {qps, burst} ─▶ TokenBucket(rate=qps, burst=burst)
    shell: take(now, n) before it handles up to n queries ─▶ g <= n granted, one per query

The bucket holds up to ``burst`` tokens and gains ``rate`` per second; each query spends
one. A sandbox that asks in bursts (an install resolving a few hundred names at once)
spends its saved tokens; one that floods gets ``rate`` answers a second and the rest are
dropped by the shell, cheaply, so the flood does not slow its neighbours down.

Sans-I/O like the rest of ``egress.resolver``: no clock of its own, ``now`` comes in
(a monotonic clock: a wall-clock step back must not mint tokens). ``take`` grants several
tokens at once, so the shell asks once per batch of datagrams, not once per datagram.
"""

from __future__ import annotations


class TokenBucket:
    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got {rate} and {burst}")
        self.rate = float(rate)  # tokens gained per second
        self.burst = float(burst)  # most tokens held at once
        self.tokens = self.burst  # a new sandbox starts with a full burst
        self.stamp = now  # when ``tokens`` was last brought up to date

    def take(self, now: float, want: int = 1) -> int:
        """Refill up to ``now``, then spend up to ``want`` whole tokens; how many were."""
        if now > self.stamp:  # a clock that stood still or stepped back mints nothing
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
        granted = min(want, int(self.tokens))
        self.tokens -= granted
        return granted

    def wait(self) -> float:
        """Seconds from the last ``take`` until a whole token is there again."""
        return max(0.0, (1.0 - self.tokens) / self.rate)

    def configure(self, rate: float, burst: float) -> None:
        """A new rate (a policy swap): saved tokens stay, up to the new burst.

        The time since the bucket was last used earns at the new rate: the shell notices a
        swap at the next query, not when it happened, and the new policy is the one that
        says what that quiet time was worth (never more than its burst).
        """
        if rate <= 0 or burst < 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got {rate} and {burst}")
        self.rate = float(rate)
        self.burst = float(burst)
        self.tokens = min(self.tokens, self.burst)
