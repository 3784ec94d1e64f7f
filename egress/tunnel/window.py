"""Fixed-size building blocks for per-zone state: sliding-window sums and a seen-set.

Both have a size fixed at construction, whatever the traffic, which is what bounds the
scorer's memory per sandbox:

- ``Ring``: a sliding window as ``buckets`` time buckets of ``width`` float metrics in one
  ``array('d')``, with running totals so a query costs O(width), not O(buckets).
- ``Seen``: "was this subdomain already counted?" as two generations of a 3-hash Bloom
  filter of ``SEEN_BITS`` bits each. A generation retires after ``SEEN_ROTATE`` inserts,
  so the set remembers the last 512-1024 distinct names of a zone; an attacker's name that
  collides (about 1% at the fullest) is merely undercounted.
"""

from __future__ import annotations

from array import array
from typing import Final

SEEN_BITS: Final = 8192  # per generation: 1 KiB
SEEN_ROTATE: Final = 512  # inserts per generation: false-positive rate <= 0.5% per generation
_MASK: Final = SEEN_BITS - 1
_M62: Final = (1 << 62) - 1


class Ring:
    """``cells``, ``base`` and ``totals`` are public for the scorer's hot path: adding
    ``v`` to metric ``m`` is ``cells[base + m] += v; totals[m] += v`` (what ``add`` does),
    which for the dozen metrics a new name touches saves a call each."""

    __slots__ = (
        "_head",
        "_slot",
        "_span",
        "base",
        "buckets",
        "cells",
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
        self.totals = array("d", bytes(8 * width))
        self._head = 0  # index of the current bucket
        self.base = 0  # its first cell: _head * width
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
            for _ in range(steps):
                self._head = (self._head + 1) % self.buckets
                self._retire(self._head)
        self.base = self._head * self.width
        self._slot = slot

    def add(self, metric: int, value: float) -> None:
        self.cells[self.base + metric] += value
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
        self.totals[:] = array("d", bytes(8 * self.width))


class Seen:
    __slots__ = ("_count", "_new", "_old")

    def __init__(self) -> None:
        self._new = bytearray(SEEN_BITS // 8)
        self._old: bytearray | None = None
        self._count = 0

    def add(self, h: int) -> bool:
        """Record hash ``h``; True if it was not seen before (as far as the filter knows)."""
        h &= _M62  # a machine integer when compiled (``native``), as it is cut here
        a, b, c = h & _MASK, (h >> 13) & _MASK, (h >> 26) & _MASK
        new, old = self._new, self._old
        if new[a >> 3] >> (a & 7) & new[b >> 3] >> (b & 7) & new[c >> 3] >> (c & 7) & 1:
            return False
        if (
            old is not None
            and old[a >> 3] >> (a & 7) & old[b >> 3] >> (b & 7) & old[c >> 3] >> (c & 7) & 1
        ):
            return False
        new[a >> 3] |= 1 << (a & 7)
        new[b >> 3] |= 1 << (b & 7)
        new[c >> 3] |= 1 << (c & 7)
        self._count += 1
        if self._count >= SEEN_ROTATE:
            self._old, self._new, self._count = self._new, bytearray(SEEN_BITS // 8), 0
        return True
