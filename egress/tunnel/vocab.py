"""What a new name tells its zone's nameserver: its length as an adaptive code, in bits.

Per-label text and randomness (``features``) miss what a fixed vocabulary carries: eight
ordinary words from a 16-word list, re-ordered per name, are 32 bits a name with no new
label and nothing random in sight. So each new name is also priced as an adaptive
compressor would price it, given the names its zone has already sent:

- symbols, each in its own context: the number of labels; each label, by its position
  counted from the zone (the label nearest the zone is position 0; the eighth and
  beyond share one); the record type;
- a symbol's price is ``log2((n + d) / c)``: PPM's method C over the ``n`` symbols of
  ``d`` kinds that context has seen, ``c`` of them this one. A symbol the zone has not
  seen pays the escape, ``log2((n + d) / d)``, then its price in the sandbox-wide table
  (the same contexts, counting a symbol once per zone that uses it, so ``www``/``api``/
  ``cdn`` are cheap in any zone), and if that has not seen it either, its spelling:
  alphabet and length, then ``len x log2(alphabet)`` (``label_bits``), or for a
  hyphenated label of up to 16 parts its parts as symbols of their own, whichever is
  cheaper.

That is the length of a code a receiver could decode, so no encoding of data in the
choice, order, number or combination of labels or types can carry more than it
charges, whatever words, counters or chunks it uses (a long-tail label the table has no
room for is priced as new: too much, never too little). An exact repeat of a name adds
nothing, and a repeat of a name with a new record type only the type's price.

``Vocab`` is the fixed-size table: ``slots`` symbols as 15-bit tags with 15-bit counts, in
buckets of four (one 60-bit integer of tags and one of counts per bucket), the least
counted of a symbol's bucket evicted when it is full, and ``n``/``d`` per context. Hash
seeds are per process (Python's string hashing), so a workload cannot pick labels that
collide with a frequent one; types and label counts are small integers, whose hashes are
themselves, and the table folds their low bits into the tag, so that two of them meet
only by chance, as labels do. Hashes are cut to 62 bits first: what mypyc (``native``)
keeps as a machine integer, so the compiled table does no big-integer arithmetic.
"""

from __future__ import annotations

import math
from array import array
from typing import Final

from egress.tunnel.entropy import alphabet_size
from egress.tunnel.window import M62

POSITIONS: Final = 8  # label positions with a context of their own; further out share the last
COUNT: Final = POSITIONS  # context: the number of labels
TYPE: Final = COUNT + 1  # context: the record type
ZONE: Final = COUNT + 2  # context (sandbox table only): which zone
TOKEN: Final = COUNT + 3  # context: the parts of a hyphenated label ("us", "east", "1")
CONTEXTS: Final = COUNT + 4
PROBES: Final = 4  # slots per bucket
TAG_BITS: Final = 15
MAX_COUNT: Final = (1 << TAG_BITS) - 1  # also the tag mask
ZONE_SLOTS: Final = 512  # per zone: 2 KiB
SANDBOX_SLOTS: Final = 4096  # per sandbox: 16 KiB

# Spelling a label nobody has seen: which alphabet (a few bits), how long (up to 63), then
# each character. (A fixed English letter-pair model instead saved 6% over the labels of
# the benign corpus: not worth a table.) Types: the usual ones are a handful of choices,
# the rest a 16-bit number.
CLASS_BITS: Final = 3.0
LENGTH_BITS: Final = 6.0
COUNT_BITS: Final = 5.0  # a label count never seen (up to 127 labels)
TOKENS_BITS: Final = 4.0  # how many hyphen-separated parts a label spelled by its parts has
MAX_TOKENS: Final = 16  # what TOKENS_BITS can say: a label of more parts is spelled whole
COMMON_TYPES: Final = frozenset({1, 2, 5, 6, 12, 15, 16, 28, 33, 35, 64, 65, 257})
COMMON_TYPE_BITS: Final = 4.0
OTHER_TYPE_BITS: Final = 16.0
_LOG2: Final = [0.0] + [math.log2(k) for k in range(1, 129)]
_LOG2F: Final = math.log2
_CTX_SALT: Final = [(0x9E3779B97F4A7C15 * (c + 1)) & M62 for c in range(CONTEXTS)]
_MIX: Final = 0x5BD1E995  # odd, below 2**31
_LOW30: Final = (1 << 30) - 1


def label_bits(label: str, k: int = 0) -> float:
    """Bits to spell ``label`` from nothing: its alphabet, its length, its characters.
    ``k``: its alphabet size (``entropy.alphabet_size``), if known."""
    if not label:
        return CLASS_BITS
    return CLASS_BITS + LENGTH_BITS + len(label) * _LOG2[k or alphabet_size(label)]


def type_bits(qtype: int) -> float:
    return COMMON_TYPE_BITS if qtype in COMMON_TYPES else OTHER_TYPE_BITS


class Vocab:
    """Symbol counts per context in a fixed-size table (see the module docstring)."""

    __slots__ = ("_counts", "_d", "_mask", "_n", "_tags")

    def __init__(self, slots: int) -> None:
        self._mask = slots // PROBES - 1  # slots: a power of two
        self._tags = array("q", bytes(2 * slots))  # per bucket: four tags, 15 bits each
        self._counts = array("q", bytes(2 * slots))  # 0 in a bucket's tag: an empty slot
        self._n = [0.0] * CONTEXTS  # lists: what mypyc indexes without a call
        self._d = [0.0] * CONTEXTS

    def largest(self) -> float:
        """The largest n + d of any context: no price or escape here exceeds its log2."""
        nn, dd = self._n, self._d
        return max([nn[c] + dd[c] for c in range(CONTEXTS)])

    def use(self, ctx: int, key: int) -> float:
        """Price symbol ``key`` in ``ctx`` and count it, in one pass over its bucket.

        A symbol this table knows costs ``log2((n + d) / c)``, returned as is (>= 0). A new
        one takes an empty slot of its bucket, or the least counted one's, and the result is
        ``-1 - escape``: the caller adds the escape, ``log2((n + d) / d)``, and prices the
        symbol elsewhere. Both prices use the counts from before this symbol."""
        h = (key & M62) ^ _CTX_SALT[ctx]
        bucket = h & self._mask
        # The tag: the high bits, folded with a multiplicative hash of the low 30 (mod
        # 2**30, so all of them count). Small keys (a record type, a label count: hash(n)
        # is n) differ in their low bits only and would otherwise share one tag.
        mixed = ((h & _LOW30) * _MIX) & _LOW30  # below 2**61 before the mask
        tag = ((mixed >> (30 - TAG_BITS)) ^ (h >> (62 - TAG_BITS))) or 1
        tags, counts = self._tags[bucket], self._counts[bucket]
        nn, dd = self._n, self._d
        n, d = nn[ctx], dd[ctx]
        nn[ctx] = n + 1.0
        victim, low = 0, MAX_COUNT + 1
        for i in range(PROBES):
            shift = i * TAG_BITS
            t = tags >> shift & MAX_COUNT
            c = counts >> shift & MAX_COUNT
            if t == tag:
                if c < MAX_COUNT:
                    self._counts[bucket] = counts + (1 << shift)
                x = (n + d) / c
                return _LOG2F(x) if x > 1.0 else 0.0
            if c < low:  # an empty slot's count is 0
                victim, low = shift, c
        keep = ~(MAX_COUNT << victim)
        self._tags[bucket] = tags & keep | tag << victim
        self._counts[bucket] = counts & keep | 1 << victim
        dd[ctx] = d + 1.0
        x = (n + d) / d if d else 1.0
        return -1.0 - (_LOG2F(x) if x > 1.0 else 0.0)


def new_name_bits(
    zone: Vocab, sandbox: Vocab, parts: tuple[str, ...], alphabets: tuple[int, ...], qtype: int
) -> float:
    """Price of a name the zone has not seen: its label count, its labels by position
    from the zone (``alphabets``: each label's alphabet size, for spelling), its type."""
    bits = _symbol(zone, sandbox, COUNT, len(parts), COUNT_BITS)
    last = len(parts) - 1
    # ``_symbol`` inlined: this loop is the hot path. (Methods called as such: compiled, a
    # bound method kept in a variable would be called through Python's calling convention.)
    for i, label in enumerate(parts):
        ctx = last - i if last - i < POSITIONS else POSITIONS - 1
        key = hash(label) & M62  # cut once: ``use`` then does no big-integer arithmetic
        price = zone.use(ctx, key)
        if price < 0:
            price = -1.0 - price  # the zone's escape
            known = sandbox.use(ctx, key)
            if known >= 0:
                price += known
            else:
                price += -1.0 - known + spell(zone, sandbox, label, alphabets[i])
        bits += price
    return bits + type_price(zone, sandbox, qtype)


def spell(zone: Vocab, sandbox: Vocab, label: str, k: int = 0) -> float:
    """Bits for a label neither table knows (``k``: its alphabet size, if known): spelled,
    or (one bit says which) as its hyphen-separated parts, each a symbol of its own
    (``ap-southeast-4`` after ``ap-southeast-1``: two known parts and a digit)."""
    direct = label_bits(label, k)
    if "-" not in label:
        return direct
    if label.count("-") >= MAX_TOKENS:
        return 1.0 + direct  # more parts than TOKENS_BITS can say: spelled whole
    by_parts = TOKENS_BITS + sum(
        _symbol(zone, sandbox, TOKEN, hash(p) & M62, label_bits(p)) for p in label.split("-")
    )
    return 1.0 + min(direct, by_parts)


def type_price(zone: Vocab, sandbox: Vocab, qtype: int) -> float:
    """Price of the record type of a (name, type) pair the zone has not seen."""
    return _symbol(zone, sandbox, TYPE, qtype, type_bits(qtype))


def zone_price(sandbox: Vocab, zone_key: int) -> float:
    """Price of the choice of zone, over the sandbox: a payload spread over zones pays it."""
    bits = sandbox.use(ZONE, zone_key)
    return bits if bits >= 0 else -1.0 - bits


def _symbol(zone: Vocab, sandbox: Vocab, ctx: int, key: int, spelled: float) -> float:
    """Price and count one symbol: the zone's price; or its escape and the sandbox's price
    (the sandbox table counts a symbol once per zone that uses it: how many zones have it
    is what a zone's first use should pay); or both escapes and ``spelled``."""
    bits = zone.use(ctx, key)
    if bits >= 0:
        return bits
    escape = -1.0 - bits
    known = sandbox.use(ctx, key)
    if known >= 0:
        return escape + known
    return escape - 1.0 - known + spelled
