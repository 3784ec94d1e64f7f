"""Fixed-size building blocks for the scorer's state: sliding-window sums, seen-sets and
what evicted zones sent.

Each has a size fixed at construction, whatever the traffic, which is what bounds the
scorer's memory per sandbox:

- ``Ring``: a sliding window as ``buckets`` time buckets of ``width`` float metrics (float32,
  in one array), with running totals so a query costs O(width), not O(buckets).
- ``Seen``: "was this subdomain already counted?" as two generations of a blocked Bloom
  filter of ``words`` 64-bit words each (a zone's: ``SEEN_WORDS``, 1 KiB): a hash sets 5
  of the 62 bits used of one word, so a lookup reads one word per generation (0.6% false
  positives at the fullest, where a 3-hash filter of the same size has 0.4%, for 3-6
  reads). A generation retires after 4 inserts a word (one per 16 bits), so a zone's
  remembers the last 512-1024 of them: 2 + k for a new name with k labels the zone had
  not seen (the name, the name with its type, each new label), 1 for a new type of a
  known name; so 256-512 names whose labels are all known, 100-200 with three new labels
  each. An attacker's name that collides (about 1% at the fullest, over both) is merely
  undercounted. The scorer's sandbox-wide one (``scorer``) is 32 times larger.
- ``Spent``: the name information each zone evicted from the scorer's table had sent in
  each window, one zone a cell of ``SPENT_CELLS``, by the zone's hash.
"""

from __future__ import annotations

import math
from array import array
from typing import Final

SEEN_WORDS: Final = 128  # a zone's, per generation: 1 KiB
SEEN_PER_WORD: Final = 4  # inserts a word per generation: false-positive rate <= 0.6% each
_WORD_BITS: Final = 62  # bits used of each word: an int below 2**62 is a machine one compiled
M62: Final = (1 << 62) - 1  # hashes are cut to this: a machine integer when compiled
SPENT_CELLS: Final = 4096  # 96 KiB
_SPENT_BITS: Final = 12  # log2(SPENT_CELLS)
_SPENT_MASK: Final = SPENT_CELLS - 1
_U16: Final = 0xFFFF
_U32: Final = 0xFFFFFFFF


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
    __slots__ = ("_count", "_mask", "_new", "_old", "_rotate", "_shift")

    def __init__(self, words: int = SEEN_WORDS) -> None:
        if words < SEEN_WORDS or words & (words - 1):
            raise ValueError(f"Seen: {words} words; a power of two >= {SEEN_WORDS}")
        self._new = array("q", bytes(8 * words))
        self._old: array[int] | None = None
        self._count = 0
        self._rotate = SEEN_PER_WORD * words
        self._mask = words - 1
        # The word is the hash's low bits, the 5 bits set in it come from above them:
        # 128 words keep the bits from 7 on; each doubling moves them up one.
        self._shift = words.bit_length() - SEEN_WORDS.bit_length()

    def has(self, h: int) -> bool:
        """True if hash ``h`` was recorded (as far as the filter knows); records nothing."""
        word, bits = self._place(h)
        old = self._old
        return self._new[word] & bits == bits or (old is not None and old[word] & bits == bits)

    def add(self, h: int) -> bool:
        """Record hash ``h``; True if it was not seen before (as far as the filter knows)."""
        word, bits = self._place(h)
        new, old = self._new, self._old
        now = new[word]
        if now & bits == bits or (old is not None and old[word] & bits == bits):
            return False
        self._insert(word, bits)
        return True

    def keep(self, h: int) -> bool:
        """True if hash ``h`` was recorded; one found only in the older generation is
        recorded again in the newer, so what is still in use outlives a rotation. Records
        nothing new."""
        word, bits = self._place(h)
        if self._new[word] & bits == bits:
            return True
        old = self._old
        if old is None or old[word] & bits != bits:
            return False
        self._insert(word, bits)
        return True

    def note(self, h: int) -> None:
        """Record hash ``h`` in the newer generation, unless it is there already: what
        ``keep`` keeps, and what it did not find."""
        word, bits = self._place(h)
        if self._new[word] & bits != bits:
            self._insert(word, bits)

    def _place(self, h: int) -> tuple[int, int]:
        """The word hash ``h`` lives in (its low bits), and the 5 bits it sets there."""
        return h & self._mask, _bits(h >> self._shift)

    def _insert(self, word: int, bits: int) -> None:
        new = self._new
        new[word] |= bits
        self._count += 1
        if self._count >= self._rotate:
            self._old, self._new, self._count = new, array("q", bytes(8 * len(new))), 0


def _bits(h: int) -> int:
    """The 5 bits hash ``h`` sets in its word."""
    h &= M62  # a no-op for a hash cut already, and a machine-integer one compiled
    return (
        1 << (h >> 7 & 63) % _WORD_BITS
        | 1 << (h >> 13 & 63) % _WORD_BITS
        | 1 << (h >> 19 & 63) % _WORD_BITS
        | 1 << (h >> 25 & 63) % _WORD_BITS
        | 1 << (h >> 31 & 63) % _WORD_BITS
    )


class Spent:
    """The name information each zone evicted had sent in the fast and the slow window,
    one zone a cell (``SPENT_CELLS`` of them, 24 bytes each), the cell its hash picks,
    which the zone evicted last takes. Each window keeps three buckets of half its
    length. What a zone's windows held at its eviction goes into the eviction's bucket
    and is kept until that whole bucket has left the window, whether the zone comes back
    or not: up to a window and a half after the eviction, where a zone that stayed in
    the table would have let it go as much as a window earlier. Amounts are whole bytes,
    rounded up. So a zone made again may be taken to have sent a little more, for
    longer, never less. A zone whose cell another zone's eviction took since is not
    known."""

    __slots__ = ("_fast", "_slow", "_tag")

    def __init__(self, fast_s: float, slow_s: float, now: float) -> None:
        self._tag = array("I", bytes(4 * SPENT_CELLS))  # the hash's 32 bits above the cell's
        self._fast = _Halves(fast_s, now)
        self._slow = _Halves(slow_s, now)

    def known(self, h: int, now: float) -> bool:
        """The zone of hash ``h`` was evicted within the last 1-1.5 slow windows (its
        bucket is still in the window; whatever it sent, 0 included)."""
        i = h & _SPENT_MASK
        return self._tag[i] == h >> _SPENT_BITS & _U32 and self._slow.live(i, now)

    def used(self, h: int, now: float) -> tuple[float, float]:
        """What the zone of hash ``h`` sent in the fast and the slow window before now
        (zeros: nothing known)."""
        if not self.known(h, now):
            return 0.0, 0.0
        i = h & _SPENT_MASK
        return self._fast.total(i, now), self._slow.total(i, now)

    def add(self, h: int, now: float, fast: float, slow: float) -> None:
        """The zone of hash ``h``, evicted now, sent ``fast`` and ``slow`` since it was
        last made (what the cell kept of it before stays, unless another zone has it)."""
        i = h & _SPENT_MASK
        tag = h >> _SPENT_BITS & _U32
        if self._tag[i] != tag:
            self._tag[i] = tag
            self._fast.clear(i)
            self._slow.clear(i)
        self._fast.add(i, now, fast)
        self._slow.add(i, now, slow)


class _Halves:
    """One window of every ``Spent`` cell: the amounts of its last three half-window
    buckets (what was sent in bucket k is in the window until bucket k + 3 begins) and
    the number of the newest (0: none)."""

    __slots__ = ("_middle", "_newest", "_oldest", "_slot", "_start", "_width")

    def __init__(self, window_s: float, now: float) -> None:
        self._width = window_s / 2
        self._start = now
        self._newest = array("H", bytes(2 * SPENT_CELLS))
        self._middle = array("H", bytes(2 * SPENT_CELLS))
        self._oldest = array("H", bytes(2 * SPENT_CELLS))
        self._slot = array("I", bytes(4 * SPENT_CELLS))

    def _number(self, now: float) -> int:
        """The bucket ``now`` falls in, from 1 (0 is a cell's "none")."""
        return 1 + min(_U32 - 1, int((now - self._start) // self._width))

    def live(self, i: int, now: float) -> bool:
        """The cell has a bucket still in the window (of any amount, 0 included)."""
        slot = self._slot[i]
        return slot != 0 and self._number(now) - slot <= 2

    def total(self, i: int, now: float) -> float:
        age = self._number(now) - self._slot[i]
        newest = self._newest[i] if age <= 2 else 0
        middle = self._middle[i] if age <= 1 else 0
        oldest = self._oldest[i] if age <= 0 else 0
        return float(newest + middle + oldest)

    def clear(self, i: int) -> None:
        self._newest[i] = self._middle[i] = self._oldest[i] = self._slot[i] = 0

    def add(self, i: int, now: float, amount: float) -> None:
        n = self._number(now)
        age = n - self._slot[i]
        newest = self._newest[i]
        if age >= 1:  # shift by ``age`` buckets: what moves past the oldest has left
            middle = self._middle[i]
            self._oldest[i] = middle if age == 1 else newest if age == 2 else 0
            self._middle[i] = newest if age == 1 else 0
            newest = 0
            self._slot[i] = n
        self._newest[i] = min(_U16, newest + math.ceil(amount))
