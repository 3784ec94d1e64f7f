"""DNS exfiltration channels of the adaptive kind: data in the choice of ordinary things.

Each channel turns a payload into query names (and types) that look like hostnames: word
lists, counters, timestamps, short chunks, the number of labels, the record type, the
choice of sibling subzone or of zone. Every name carries a 16-bit sequence number, as a
real receiver needs one (UDP, retries), and ``payload_bits`` bits of the payload; the
sequence costs the sender information too, so the scorer may charge it.

``decode`` is the receiver: given the names that reached the attacker's nameserver, it
returns the payload bytes it recovered, which is what a leak budget counts.

Self-contained (standard library only): the end-to-end tests copy this file into the
sandbox's working directory, where the workload imports it.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass

SEQ_BITS = 16
# 256 ordinary words (the commonest of 4-8 letters in Debian's license texts).
WORDS = [
    "license",
    "this",
    "that",
    "work",
    "with",
    "library",
    "version",
    "under",
    "code",
    "software",
    "copy",
    "program",
    "such",
    "document",
    "terms",
    "free",
    "other",
    "your",
    "source",
    "public",
    "section",
    "from",
    "covered",
    "general",
    "must",
    "rights",
    "which",
    "notice",
    "means",
    "modified",
    "copies",
    "sections",
    "have",
    "these",
    "warranty",
    "provided",
    "form",
    "works",
    "each",
    "make",
    "patent",
    "cover",
    "modify",
    "object",
    "either",
    "title",
    "notices",
    "versions",
    "original",
    "does",
    "will",
    "without",
    "based",
    "include",
    "part",
    "only",
    "those",
    "also",
    "convey",
    "shall",
    "apply",
    "text",
    "used",
    "combined",
    "same",
    "above",
    "holder",
    "made",
    "licenses",
    "file",
    "user",
    "texts",
    "then",
    "party",
    "than",
    "when",
    "legal",
    "their",
    "some",
    "they",
    "parties",
    "purpose",
    "time",
    "programs",
    "material",
    "give",
    "copying",
    "whether",
    "received",
    "charge",
    "should",
    "them",
    "third",
    "product",
    "entitled",
    "granted",
    "more",
    "offer",
    "freedom",
    "been",
    "authors",
    "required",
    "number",
    "files",
    "name",
    "however",
    "verbatim",
    "contains",
    "preserve",
    "given",
    "except",
    "claims",
    "lesser",
    "whole",
    "medium",
    "later",
    "option",
    "applies",
    "damages",
    "page",
    "change",
    "front",
    "system",
    "entity",
    "package",
    "into",
    "data",
    "extent",
    "uses",
    "users",
    "there",
    "most",
    "certain",
    "author",
    "network",
    "making",
    "standard",
    "using",
    "control",
    "implied",
    "designed",
    "receive",
    "limited",
    "included",
    "least",
    "provide",
    "list",
    "thus",
    "initial",
    "subject",
    "publish",
    "show",
    "written",
    "stated",
    "where",
    "unless",
    "refers",
    "place",
    "back",
    "access",
    "what",
    "through",
    "example",
    "would",
    "being",
    "whose",
    "covers",
    "special",
    "linked",
    "further",
    "ordinary",
    "grant",
    "along",
    "licensed",
    "everyone",
    "after",
    "below",
    "within",
    "even",
    "choose",
    "complete",
    "titles",
    "history",
    "grants",
    "portion",
    "permit",
    "want",
    "machine",
    "previous",
    "need",
    "patents",
    "portions",
    "stating",
    "called",
    "future",
    "allowed",
    "directly",
    "opaque",
    "entire",
    "sure",
    "purposes",
    "cause",
    "writing",
    "royalty",
    "readable",
    "kind",
    "language",
    "itself",
    "prior",
    "related",
    "wish",
    "released",
    "suitable",
    "year",
    "separate",
    "exercise",
    "right",
    "intended",
    "case",
    "another",
    "follow",
    "full",
    "first",
    "problems",
    "choice",
    "defined",
    "claim",
    "format",
    "others",
    "present",
    "formats",
    "added",
    "single",
    "parts",
    "governed",
    "includes",
    "affirmer",
    "could",
    "physical",
    "thereof",
    "against",
    "cannot",
    "nothing",
    "names",
    "fitness",
    "computer",
    "printed",
    "cost",
    "linking",
    "order",
    "well",
    "addition",
    "https",
    "accept",
    "both",
    "revised",
]
TYPES = (1, 28, 15, 16, 33, 5, 2, 257)  # A AAAA MX TXT SRV CNAME NS CAA: 3 bits
B32 = "abcdefghijklmnopqrstuvwxyz234567"
B36 = string.digits + string.ascii_lowercase
TS_BASE = 1_764_547_200  # 2025-12-01: timestamps near "now"


@dataclass(frozen=True)
class Channel:
    """``encode(value)`` -> (labels left of the zone, qtype, zone index); ``decode`` back.
    ``value`` holds SEQ_BITS of sequence (high bits) and ``payload_bits`` of payload."""

    name: str
    bits: int  # per name, sequence included
    encode: Callable[[int], tuple[list[str], int, int]]
    decode: Callable[[list[str], int, int], int | None]
    zones: int = 1  # how many zones (or sibling subzones) it spreads over

    @property
    def payload_bits(self) -> int:
        return self.bits - SEQ_BITS

    def queries(self, payload: bytes, zones: list[str]) -> list[tuple[str, int]]:
        """The names (with types) that carry ``payload``, in order."""
        out = []
        for seq, chunk in enumerate(_chunks(payload, self.payload_bits)):
            labels, qtype, z = self.encode((seq % (1 << SEQ_BITS)) << self.payload_bits | chunk)
            out.append((".".join([*labels, zones[z]]), qtype))
        return out

    def decode_all(self, received: Iterable[tuple[str, int]], zones: list[str]) -> bytes:
        """The payload bytes a receiver recovers from the names it got (order free)."""
        chunks: dict[int, int] = {}
        for name, qtype in received:
            name = name.lower().rstrip(".")
            for z, zone in enumerate(zones):
                if name.endswith("." + zone):
                    labels = name[: -len(zone) - 1].split(".")
                    value = self.decode(labels, qtype, z)
                    if value is not None:
                        chunks.setdefault(value >> self.payload_bits, value)
                    break
        got = [chunks[s] & ((1 << self.payload_bits) - 1) for s in sorted(chunks)]
        return _join(got, self.payload_bits, len(got) * self.payload_bits // 8)


def _chunks(payload: bytes, bits: int) -> list[int]:
    n = int.from_bytes(payload, "big")
    total = len(payload) * 8
    count = -(-total // bits)
    n <<= count * bits - total
    mask = (1 << bits) - 1
    return [(n >> (bits * (count - 1 - i))) & mask for i in range(count)]


def _join(chunks: list[int], bits: int, size: int) -> bytes:
    n = 0
    for c in chunks:
        n = n << bits | c
    total = len(chunks) * bits
    return (n >> (total - size * 8)).to_bytes(size, "big") if size else b""


def _digits(value: int, base: int, count: int) -> list[int]:
    out = []
    for _ in range(count):
        value, d = divmod(value, base)
        out.append(d)
    return out[::-1]


def _undigits(digits: Iterable[int], base: int) -> int:
    n = 0
    for d in digits:
        n = n * base + d
    return n


# -- word lists ------------------------------------------------------------------------------


def words(vocab: int, count: int) -> Channel:
    """``count`` labels, one word each from the first ``vocab`` words."""
    vocab_words = WORDS[:vocab]
    index = {w: i for i, w in enumerate(vocab_words)}
    per = vocab.bit_length() - 1

    def enc(v: int) -> tuple[list[str], int, int]:
        return [vocab_words[d] for d in _digits(v, vocab, count)], 1, 0

    def dec(labels: list[str], qtype: int, z: int) -> int | None:
        if len(labels) != count or any(w not in index for w in labels):
            return None
        return _undigits((index[w] for w in labels), vocab)

    return Channel(f"words {vocab}x{count}", per * count, enc, dec)


def words_counted(vocab: int, low: int) -> Channel:
    """Word labels whose NUMBER carries 3 bits too: ``low``..``low+7`` labels."""
    per = vocab.bit_length() - 1
    vocab_words = WORDS[:vocab]
    index = {w: i for i, w in enumerate(vocab_words)}

    def enc(v: int) -> tuple[list[str], int, int]:
        extra, rest = v & 7, v >> 3
        n = low + extra
        return [vocab_words[d] for d in _digits(rest, vocab, n)], 1, 0

    def dec(labels: list[str], qtype: int, z: int) -> int | None:
        n = len(labels) - low
        if not 0 <= n < 8 or any(w not in index for w in labels):
            return None
        return _undigits((index[w] for w in labels), vocab) << 3 | n

    # the fewest labels carry the bits every name has
    return Channel(f"words {vocab}, {low}-{low + 7} labels", per * low + 3, enc, dec)


def joined(vocab: int, per_label: int, labels: int) -> Channel:
    """``labels`` labels of ``per_label`` words run together (``freecopywork``)."""
    vocab_words = WORDS[:vocab]
    index = {w: i for i, w in enumerate(vocab_words)}
    per = vocab.bit_length() - 1

    def enc(v: int) -> tuple[list[str], int, int]:
        ds = _digits(v, vocab, per_label * labels)
        parts = [ds[i : i + per_label] for i in range(0, len(ds), per_label)]
        return ["".join(vocab_words[d] for d in p) for p in parts], 1, 0

    def dec(got: list[str], qtype: int, z: int) -> int | None:
        if len(got) != labels:
            return None
        ds: list[int] = []
        for label in got:
            split = _split_words(label, index, per_label)
            if split is None:
                return None
            ds += split
        return _undigits(ds, vocab)

    return Channel(
        f"joined words {vocab}: {per_label}x{labels}", per * per_label * labels, enc, dec
    )


def _split_words(label: str, index: dict[str, int], count: int) -> list[int] | None:
    if count == 0:
        return [] if not label else None
    for cut in range(len(label), 0, -1):
        head = label[:cut]
        if head in index:
            rest = _split_words(label[cut:], index, count - 1)
            if rest is not None:
                return [index[head], *rest]
    return None


# -- numbers and short chunks ---------------------------------------------------------------


def counter() -> Channel:
    """A build counter and a 5-digit number: ``build-4711.30522``."""

    def enc(v: int) -> tuple[list[str], int, int]:
        return [f"build-{v >> 16}", f"{v & 0xFFFF:05d}"], 1, 0

    def dec(labels: list[str], qtype: int, z: int) -> int | None:
        if len(labels) != 2 or not labels[0].startswith("build-"):
            return None
        try:
            return int(labels[0][6:]) << 16 | int(labels[1])
        except ValueError:
            return None

    return Channel("decimal counter", 32, enc, dec)


def timestamp() -> Channel:
    """A unix timestamp near now: its low five digits are the payload (16 bits)."""

    def enc(v: int) -> tuple[list[str], int, int]:
        return [f"ts{TS_BASE + (v >> 16) * 100_000 + (v & 0xFFFF)}", "metrics"], 1, 0

    def dec(labels: list[str], qtype: int, z: int) -> int | None:
        if len(labels) != 2 or not labels[0].startswith("ts"):
            return None
        seq, low = divmod(int(labels[0][2:]) - TS_BASE, 100_000)
        return seq << 16 | low

    return Channel("timestamp", 32, enc, dec)


def chunk(alphabet: str, size: int, word: bool = False) -> Channel:
    """A ``size``-character chunk over ``alphabet`` (hex, base32, base36), alone or after
    a word that carries 4 bits (``cache-3fa9b2c1d0e4``)."""
    base = len(alphabet)
    bits = (base**size).bit_length() - 1
    lookup = {c: i for i, c in enumerate(alphabet)}
    extra = 4 if word else 0
    kind = {16: "hex", 32: "base32", 36: "base36"}[base]

    def enc(v: int) -> tuple[list[str], int, int]:
        text = "".join(alphabet[d] for d in _digits(v >> extra, base, size))
        if word:
            text = f"{WORDS[v & 15]}-{text}"
        return [text], 1, 0

    def dec(labels: list[str], qtype: int, z: int) -> int | None:
        if len(labels) != 1:
            return None
        text, low = labels[0], 0
        if word:
            head, _, text = text.partition("-")
            if head not in WORDS[:16]:
                return None
            low = WORDS.index(head)
        if len(text) != size or any(c not in lookup for c in text):
            return None
        return _undigits((lookup[c] for c in text), base) << extra | low

    name = f"{kind} {size}" + (" after a word" if word else "")
    return Channel(name, bits + extra, enc, dec)


# -- structure as the carrier ---------------------------------------------------------------


def label_count() -> Channel:
    """A sequence label and 1-16 filler labels: the number carries 4 bits."""

    def enc(v: int) -> tuple[list[str], int, int]:
        return [f"n{v >> 4}", *["www"] * ((v & 15) + 1)], 1, 0

    def dec(labels: list[str], qtype: int, z: int) -> int | None:
        if not labels or not labels[0].startswith("n") or set(labels[1:]) != {"www"}:
            return None
        return int(labels[0][1:]) << 4 | (len(labels) - 2)

    return Channel("label count", SEQ_BITS + 4, enc, dec)


def record_type() -> Channel:
    """A sequence label asked with one of 8 record types: the type carries 3 bits."""

    def enc(v: int) -> tuple[list[str], int, int]:
        return [f"host{v >> 3}"], TYPES[v & 7], 0

    def dec(labels: list[str], qtype: int, z: int) -> int | None:
        if len(labels) != 1 or not labels[0].startswith("host") or qtype not in TYPES:
            return None
        return int(labels[0][4:]) << 3 | TYPES.index(qtype)

    return Channel("record type", SEQ_BITS + 3, enc, dec)


def spread(zones: int, inner: Channel) -> Channel:
    """``inner``'s names spread over ``zones`` zones (or sibling subzones): the choice of
    zone carries log2(zones) bits more."""
    extra = zones.bit_length() - 1

    def enc(v: int) -> tuple[list[str], int, int]:
        labels, qtype, _ = inner.encode(v >> extra)
        return labels, qtype, v & (zones - 1)

    def dec(labels: list[str], qtype: int, z: int) -> int | None:
        value = inner.decode(labels, qtype, 0)
        return None if value is None else value << extra | z

    return Channel(f"{inner.name} over {zones} zones", inner.bits + extra, enc, dec, zones)


def all_channels() -> list[Channel]:
    """Every channel the scorer must catch (tests and bench)."""
    return [
        words(16, 8),
        words(4, 16),
        words(64, 6),
        words(256, 4),
        words_counted(16, 8),
        joined(64, 3, 2),
        joined(16, 4, 2),
        counter(),
        timestamp(),
        chunk(string.hexdigits[:16], 12),
        chunk(B32, 12),
        chunk(B36, 12),
        chunk(string.hexdigits[:16], 8, word=True),
        label_count(),
        record_type(),
        spread(16, chunk(string.hexdigits[:16], 8)),
        spread(4, words(16, 8)),
    ]
