"""Fixed-size building blocks for per-zone state: sliding-window sums and a seen-set.

Both have a size fixed at construction, whatever the traffic, which is what bounds the
scorer's memory per sandbox:

- ``Ring``: a sliding window as ``buckets`` time buckets of ``width`` float metrics (float32,
  in one array), with running totals so a query costs O(width), not O(buckets).
- ``Seen``: "was this subdomain already counted?" as two generations of a blocked Bloom
  filter of ``SEEN_BITS`` bits each: a hash sets 5 of the 62 bits used of one word, so a
  lookup reads one word per generation (0.6% false positives at the fullest, where a
  3-hash filter of the same size has 0.4%, for 3-6 reads). A generation retires after
  ``SEEN_ROTATE`` inserts, so the set remembers the last 512-1024 of them: 2 + k for a
  new name with k labels the zone had not seen (the name, the name with its type, each
  new label), 1 for a new type of a known name; so 256-512 names whose labels are all
  known, 100-200 with three new labels each. An attacker's name that collides (about 1%
  at the fullest, over both) is merely undercounted.
"""

from __future__ import annotations

from array import array
from typing import Final

SEEN_BITS: Final = 8192  # per generation: 1 KiB, 128 words of 64 bits
SEEN_ROTATE: Final = 512  # inserts per generation: false-positive rate <= 0.6% per generation
_WORD_MASK: Final = SEEN_BITS // 64 - 1
_WORD_BITS: Final = 62  # bits used of each word: an int below 2**62 is a machine one compiled
M62: Final = (1 << 62) - 1  # hashes are cut to this: a machine integer when compiled


class Ring:
    """``current`` (the current bucket) and ``totals`` are public lists for the scorer's hot
    path: adding ``v`` to metric ``m`` is ``current[m] += v; totals[m] += v`` (what ``add``
    does), two list updates once compiled (``native``), where an array element is a call.
    The window's other buckets are ``cells``, float32, stored when the bucket is left."""

    __slots__ = (
        "_head",
        "_slot",
        "_span",
        "buckets",
        "cells",
        "current",
        "seconds",
        "totals",
        "width",
    )

    def __init__(self, seconds: float, buckets: int, width: int) -> None:
        self.seconds = seconds
        self.buckets = buckets
        self.width = width
        self._span = seconds / buckets
        self.cells = array("f", bytes(4 * buckets * width))  # float32: counts < 2**24 exact
        self.current = [0.0] * width
        self.totals = [0.0] * width
        self._head = 0  # index of the current bucket in ``cells`` (stale there until left)
        self._slot = -1  # absolute bucket number (now // span) of the current bucket

    def advance(self, now: float) -> None:
        """Retire buckets that fell out of the window. A clock going back changes nothing."""
        slot = int(now // self._span)
        steps = slot - self._slot
        if steps <= 0:
            return
        if self._slot < 0:
            pass  # fresh: all zeros already
        elif steps >= self.buckets:
            self._clear()
        else:
            cells, current, width = self.cells, self.current, self.width
            base = self._head * width
            for m in range(width):
                cells[base + m] = current[m]
                current[m] = 0.0
            for _ in range(steps):
                self._head = (self._head + 1) % self.buckets
                self._retire(self._head)
        self._slot = slot

    def totals_at(self, now: float) -> list[float]:
        """``totals`` as ``advance(now)`` would leave them, by the same float steps in the
        same order; the ring itself unchanged (``headroom``: a look ahead)."""
        steps = int(now // self._span) - self._slot
        if steps <= 0 or self._slot < 0:
            return list(self.totals)
        if steps >= self.buckets:
            return [0.0] * self.width
        totals = list(self.totals)
        cells, width, head = self.cells, self.width, self._head
        for _ in range(steps):
            head = (head + 1) % self.buckets
            base = head * width
            for m in range(width):
                totals[m] -= cells[base + m]
        return totals

    def add(self, metric: int, value: float) -> None:
        self.current[metric] += value
        self.totals[metric] += value

    def total(self, metric: int) -> float:
        return max(0.0, self.totals[metric])  # clamp float drift from add/subtract

    def _retire(self, index: int) -> None:
        base = index * self.width
        cells, totals = self.cells, self.totals
        for m in range(self.width):
            totals[m] -= cells[base + m]
            cells[base + m] = 0.0

    def _clear(self) -> None:
        self.cells[:] = array("f", bytes(4 * len(self.cells)))
        self.current[:] = [0.0] * self.width
        self.totals[:] = [0.0] * self.width


class Seen:
    __slots__ = ("_count", "_new", "_old")

    def __init__(self) -> None:
        self._new = array("q", bytes(SEEN_BITS // 8))
        self._old: array[int] | None = None
        self._count = 0

    def has(self, h: int) -> bool:
        """True if hash ``h`` was recorded (as far as the filter knows); records nothing."""
        word, bits = _place(h)
        old = self._old
        return self._new[word] & bits == bits or (old is not None and old[word] & bits == bits)

    def add(self, h: int) -> bool:
        """Record hash ``h``; True if it was not seen before (as far as the filter knows)."""
        word, bits = _place(h)
        new, old = self._new, self._old
        now = new[word]
        if now & bits == bits or (old is not None and old[word] & bits == bits):
            return False
        new[word] = now | bits
        self._count += 1
        if self._count >= SEEN_ROTATE:
            self._old, self._new, self._count = new, array("q", bytes(SEEN_BITS // 8)), 0
        return True


def _place(h: int) -> tuple[int, int]:
    """The word hash ``h`` lives in, and the 5 bits it sets there."""
    h &= M62  # a no-op for a hash cut already, and a machine-integer one compiled
    bits = (
        1 << (h >> 7 & 63) % _WORD_BITS
        | 1 << (h >> 13 & 63) % _WORD_BITS
        | 1 << (h >> 19 & 63) % _WORD_BITS
        | 1 << (h >> 25 & 63) % _WORD_BITS
        | 1 << (h >> 31 & 63) % _WORD_BITS
    )
    return h & _WORD_MASK, bits
