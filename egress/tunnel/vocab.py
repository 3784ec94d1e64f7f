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
  hyphenated label its parts as symbols of their own, whichever is cheaper.

That is the length of a code a receiver could decode, so no encoding of data in the
choice, order, number or combination of labels or types can carry more than it
charges, whatever words, counters or chunks it uses (a long-tail label the table has no
room for is priced as new: too much, never too little). An exact repeat of a name adds
nothing, and a repeat of a name with a new record type only the type's price.

``Vocab`` is the fixed-size table: ``slots`` symbols as 16-bit tags with 16-bit counts,
four probes per symbol, the least counted of the four evicted when full, and ``n``/``d``
per context. Hash seeds are per process (Python's string hashing), so a workload cannot
pick labels that collide with a frequent one.
"""

from __future__ import annotations

import math
from array import array

from egress.tunnel.entropy import alphabet_size

POSITIONS = 8  # label positions with a context of their own; further out share the last
COUNT = POSITIONS  # context: the number of labels
TYPE = COUNT + 1  # context: the record type
ZONE = COUNT + 2  # context (sandbox table only): which zone
TOKEN = COUNT + 3  # context: the parts of a hyphenated label ("us", "east", "1")
CONTEXTS = COUNT + 4
PROBES = 4
MAX_COUNT = 65535
ZONE_SLOTS = 512  # per zone: 2 KiB
SANDBOX_SLOTS = 4096  # per sandbox: 16 KiB

# Spelling a label nobody has seen: which alphabet (a few bits), how long (up to 63), then
# each character. (A fixed English letter-pair model instead saved 6% over the labels of
# the benign corpus: not worth a table.) Types: the usual ones are a handful of choices,
# the rest a 16-bit number.
CLASS_BITS = 3.0
LENGTH_BITS = 6.0
COUNT_BITS = 5.0  # a label count never seen (up to 127 labels)
TOKENS_BITS = 4.0  # how many hyphen-separated parts a label spelled by its parts has
COMMON_TYPES = frozenset({1, 2, 5, 6, 12, 15, 16, 28, 33, 35, 64, 65, 257})
COMMON_TYPE_BITS = 4.0
OTHER_TYPE_BITS = 16.0
_LOG2 = [0.0] + [math.log2(k) for k in range(1, 129)]
_LOG2F = math.log2
_CTX_SALT = [(0x9E3779B97F4A7C15 * (c + 1)) & 0xFFFFFFFFFFFFFFFF for c in range(CONTEXTS)]


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
        self._mask = slots - 1  # slots: a power of two
        self._tags = array("H", bytes(2 * slots))  # 0: empty
        self._counts = array("H", bytes(2 * slots))
        self._n = array("d", bytes(8 * CONTEXTS))
        self._d = array("d", bytes(8 * CONTEXTS))

    def use(self, ctx: int, key: int) -> float:
        """Price symbol ``key`` in ``ctx`` and count it, in one pass over its four slots.

        A symbol this table knows costs ``log2((n + d) / c)``, returned as is (>= 0). A new
        one takes an empty slot of its four, or the least counted one's, and the result is
        ``-1 - escape``: the caller adds the escape, ``log2((n + d) / d)``, and prices the
        symbol elsewhere. Both prices use the counts from before this symbol."""
        h = (key ^ _CTX_SALT[ctx]) & 0xFFFFFFFFFFFFFFFF
        tag = (h >> 48) or 1
        tags, counts, mask = self._tags, self._counts, self._mask
        n, d = self._n[ctx], self._d[ctx]
        self._n[ctx] = n + 1
        victim, low = -1, MAX_COUNT + 1
        for i in range(PROBES):
            slot = (h + i) & mask
            t = tags[slot]
            if t == tag:
                c = counts[slot]
                if c < MAX_COUNT:
                    counts[slot] = c + 1
                x = (n + d) / c
                return _LOG2F(x) if x > 1.0 else 0.0
            c = counts[slot] if t else 0
            if c < low:
                victim, low = slot, c
        tags[victim], counts[victim] = tag, 1
        self._d[ctx] = d + 1
        x = (n + d) / d if d else 1.0
        return -1.0 - (_LOG2F(x) if x > 1.0 else 0.0)


def new_name_bits(
    zone: Vocab, sandbox: Vocab, parts: tuple[str, ...], alphabets: tuple[int, ...], qtype: int
) -> float:
    """Price of a name the zone has not seen: its label count, its labels by position
    from the zone (``alphabets``: each label's alphabet size, for spelling), its type."""
    bits = _symbol(zone, sandbox, COUNT, len(parts), COUNT_BITS)
    last = len(parts) - 1
    zone_use, sandbox_use = zone.use, sandbox.use
    for i, label in enumerate(parts):  # ``_symbol`` inlined: this loop is the hot path
        ctx = last - i if last - i < POSITIONS else POSITIONS - 1
        key = hash(label)
        price = zone_use(ctx, key)
        if price < 0:
            price = -1.0 - price  # the zone's escape
            known = sandbox_use(ctx, key)
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
    by_parts = TOKENS_BITS + sum(
        _symbol(zone, sandbox, TOKEN, hash(p), label_bits(p)) for p in label.split("-")
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
