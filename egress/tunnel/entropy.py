"""How random one label looks: entropy normalised by length and alphabet, and word-likeness.

Raw Shannon entropy is capped by length: a 16-character hex label cannot exceed 4 bits per
symbol and an 8-character word of distinct letters reaches log2(8) = 3 like any random
string. So the empirical entropy is divided by the EXPECTED empirical entropy of a uniformly
random string of the same length over the same alphabet (exact binomial sum, memoised per
(length, alphabet)). Random text then scores ~1.0 at any length; repetitive text (iodine's
fragment-size probes) scores far below.

Entropy alone cannot tell "pythonhosted" from "x3kq9zvbt2mw" at DNS lengths, so letter
labels also get a word-likeness test: the share of adjacent letter pairs among the 170
most common English bigrams (letter-pair counts of Debian's license texts, covering 90% of
pairs there). Words score ~0.8, random letters ~0.25.
"""

from __future__ import annotations

import functools
import math
from typing import Final, NamedTuple

_BIGRAMS = """
ab ac ad ag ai al am an ap ar as at au be bi bl bo bs bu ca ce ch ci ck cl co cp ct cu da de
di do ea ec ed ee el em en eo ep er es et ev ex fi fo fr ft fu ge gh gr ha he hi ho hp ht ia
ib ic id ie if ig il im in io ir is it iv ke la le li ll lo ls lu ma me mi mo mp ms mu na nc
nd ne ng ni no ns nt nu ny oc od of ol om on oo op or os ot ou ov ow pa pe pi pl po pp pr pt
pu py qu ra rc re ri rm ro rr rs rt ry se sh si so sp ss st su ta te th ti to tr ts tt tw ty
ub ud ul um un ur us ut ve vi wa wi xa yo yr
"""
COMMON_BIGRAMS: Final = frozenset(_BIGRAMS.split())


MIN_LEN: Final = 8  # below this a label carries too little to judge (and too little to matter)

# COMMON_BIGRAMS as a table: 1 at (first - 'a') * 26 + (second - 'a').
_PAIR_TABLE: Final = bytes(
    [1 if chr(97 + i // 26) + chr(97 + i % 26) in COMMON_BIGRAMS else 0 for i in range(26 * 26)]
)
# Character classes (``LabelStats.classes``)
LOWER: Final = 1
UPPER: Final = 2
LETTER: Final = LOWER | UPPER
DIGIT: Final = 4
NON_HEX: Final = 8  # a letter after f
OTHER: Final = 16  # ASCII outside LDH and underscore
WIDE: Final = 32  # outside ASCII
# What a symbol's next occurrence adds to sum(c log2 c): (c+1) log2(c+1) - c log2(c).
_STEP: Final = [(c + 1) * math.log2(c + 1) - (c * math.log2(c) if c else 0.0) for c in range(256)]


@functools.lru_cache(maxsize=4096)  # (n <= 255) x (six alphabets): bounded
def expected_entropy(n: int, k: int) -> float:
    """E[H] in bits of the symbol histogram of ``n`` uniform draws from ``k`` symbols."""
    if n <= 1:
        return 0.0
    # Each symbol's count is Binomial(n, 1/k); E[H] = -k * sum_x P(x) (x/n) log2(x/n).
    logp, logq = math.log(1.0 / k), math.log(1.0 - 1.0 / k)
    total = 0.0
    for x in range(1, n + 1):
        logpmf = math.lgamma(n + 1) - math.lgamma(x + 1) - math.lgamma(n - x + 1)
        pmf = math.exp(logpmf + x * logp + (n - x) * logq)
        total -= pmf * (x / n) * math.log2(x / n)
    return k * total


def alphabet_size(text: str) -> int:
    """The smallest usual encoding alphabet that holds the characters of ``text``."""
    if not text.isascii():
        return 128  # iodine's base128 / raw bytes
    if text.isalnum():  # ASCII letters and digits: most labels
        return _alnum_alphabet(text)
    # '-' and '_' belong to every hostname alphabet: what is left decides, without a regex.
    core = text.replace("-", "").replace("_", "")
    if not core:
        return 26
    return _alnum_alphabet(core) if core.isalnum() else 64  # 64: base64 with '+', '/', '='


def _alnum_alphabet(text: str) -> int:
    """``alphabet_size`` of ASCII letters and digits."""
    if not text.isupper() and not text.islower() and not text.isdigit():
        return 64  # both cases
    if text.isalpha():
        return 26
    if text.isdigit():
        return 10
    return 36 if text.lower().strip("0123456789abcdef") else 16


class LabelStats(NamedTuple):
    bits: float  # Shannon entropy, bits per symbol, of the characters as sent
    flips: int  # adjacent letters of different case
    pairs: int  # adjacent letter pairs (case-folded)
    common: int  # of those, common English bigrams
    other: int  # characters outside LDH and underscore
    classes: int  # the character classes present: LOWER | UPPER | DIGIT | ...


def label_stats(text: str) -> LabelStats:
    """Entropy, case flips, letter pairs, non-hostname characters and character classes of
    ``text``, in one pass over its characters.

    A loop over characters. Compiled (``native``) it is C: 2.7 us for 63 characters,
    where Counter's counting loop, the letter-pair loop and regexes for flips and other
    bytes took 8.1 together. From the sources it takes 13 us, more than the counting and
    pair loops alone (what most long labels needed before): the sources are the fallback."""
    counts = [0] * 256  # per character (one per byte in a name); wider ones in ``wide``
    wide: dict[int, int] = {}
    step = _STEP
    total = 0.0  # sum of c log2 c over the characters' counts, one occurrence at a time
    flips = pairs = common = other = classes = 0
    prev = -1  # the previous character's letter index, -1 after a non-letter
    prev_upper = False
    table = _PAIR_TABLE
    for ch in text:
        o = ord(ch)
        if o < 256:
            c = counts[o]
            counts[o] = c + 1
        else:
            c = wide.get(o, 0)
            wide[o] = c + 1
        total += step[c] if c < 256 else (c + 1) * math.log2(c + 1) - c * math.log2(c)
        if 97 <= o <= 122:
            letter, upper = o - 97, False
            classes |= LOWER if letter < 6 else LOWER | NON_HEX
        elif 65 <= o <= 90:
            letter, upper = o - 65, True
            classes |= UPPER if letter < 6 else UPPER | NON_HEX
        else:
            if 48 <= o <= 57:
                classes |= DIGIT
            elif o != 45 and o != 95:  # '-', '_'
                other += 1
                classes |= OTHER if o < 128 else WIDE
            prev = -1
            continue
        if prev >= 0:
            pairs += 1
            common += table[prev * 26 + letter]
            flips += upper != prev_upper
        prev, prev_upper = letter, upper
    n = len(text)
    bits = math.log2(n) - total / n if n >= 2 else 0.0
    return LabelStats(bits, flips, pairs, common, other, classes)


def folded_alphabet(classes: int) -> int:
    """``alphabet_size`` of a text case-folded, from its ``LabelStats.classes`` (for text
    of single-byte characters)."""
    if classes & WIDE:
        return 128
    if classes & OTHER:
        return 64
    if not classes & DIGIT:
        return 26
    if not classes & LETTER:
        return 10
    return 36 if classes & NON_HEX else 16


def entropy_bits(text: str) -> float:
    """Shannon entropy in bits per symbol of the characters of ``text``."""
    return label_stats(text).bits


def normalised_entropy(text: str, k: int | None = None) -> float:
    """Empirical entropy / expected entropy of a random string of this length and alphabet."""
    if len(text) < 2:
        return 0.0
    return entropy_bits(text) / expected_entropy(len(text), k or alphabet_size(text))


def word_likeness(text: str) -> float:
    """Share of adjacent letter pairs that are common English bigrams (0.0 below 4 pairs)."""
    return _likeness(label_stats(text))


def _likeness(stats: LabelStats) -> float:
    return stats.common / stats.pairs if stats.pairs >= 4 else 0.0


def _clamp(x: float) -> float:
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


def randomness(label: str, k: int = 0, stats: LabelStats | None = None) -> tuple[float, int]:
    """(randomness 0..1, alphabet size) of one label; ``k``: its alphabet, if known;
    ``stats``: its ``label_stats``, if known."""
    n = len(label)
    k = k or alphabet_size(label)
    if n < MIN_LEN:
        return 0.0, k
    stats = stats or label_stats(label)
    r = (stats.bits / expected_entropy(n, k) - 0.80) / 0.15
    if r <= 0.0:
        return 0.0, k
    r = 1.0 if r > 1.0 else r
    if k not in (10, 16):
        # Words and word-built names ("pkg-containers") are not payload.
        r *= _clamp((0.6 - _likeness(stats)) / 0.3)
    # Short labels: entropy is a weak witness, so trust it in proportion to length.
    return (r * ((n - 4) / 12) if n < 16 else r), k
