"""Per-query features and score: what one name looks like, before any window sees it.

The score adds points for what encoders leave and real names lack; benign names top out
near 2, a tunnel's data query scores 4 or more:

- length of the subdomain (iodine and dns2tcp fill names to 190-254 bytes) and of its
  longest label (57-63 characters);
- randomness of long labels (normalised entropy x not-word-like, see ``entropy``);
- bytes outside LDH/underscore (base128, raw, dns2tcp's '+', '/', '=');
- case flips inside a label (base64/base128: clients send names lowercase);
- record types that only carry data (NULL, KEY, private 65280-65534; TXT a little).

``name_features`` (everything but the type) is memoised per name, since A, AAAA and
HTTPS lookups of one name are the common repeat; ``score_name`` adds the type.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import asdict, dataclass
from typing import Final, NamedTuple

from egress.tunnel import entropy
from egress.tunnel.labels import split_name, split_under

LONG_SUB: Final = 64  # a subdomain this long, or a label of LONG_LABEL, makes a "long name"
LONG_LABEL: Final = 40
FEATURE_CACHE: Final = 2048  # names
_LOG2: Final = [0.0] + [math.log2(k) for k in range(1, 129)]

# Types whose answers carry bytes but no address: tunnels' favourites, rare in real use.
DATA_TYPES: Final = {
    **{10: "NULL", 11: "WKS", 13: "HINFO", 14: "MINFO", 17: "RP", 19: "X25", 20: "ISDN"},
    **{21: "RT", 22: "NSAP", 24: "SIG", 25: "KEY", 249: "TKEY"},
}
TXT: Final = 16

_HEX_RUN: Final = re.compile(r"[0-9a-fA-F]+")
_B32_RUN: Final = re.compile(r"[a-z2-7]+|[A-Z2-7]+")
_B64_RUN: Final = re.compile(r"[A-Za-z0-9+/=_-]+")


def data_type_name(qtype: int) -> str | None:
    """The name of a data-only record type (TXT included), None for ordinary types."""
    if 65280 <= qtype <= 65534:
        return f"PRIVATE({qtype})"
    if qtype == TXT:
        return "TXT"
    return DATA_TYPES.get(qtype)


def type_points(qtype: int) -> float:
    if qtype == TXT:
        return 0.5
    return 1.5 if qtype in DATA_TYPES or 65280 <= qtype <= 65534 else 0.0


class NameFeatures(NamedTuple):
    """Everything about a name that does not depend on the record type. (A named tuple:
    built for every new name, and a frozen dataclass's ``__init__`` costs 3 us more.)"""

    name: str
    zone: str  # registered domain
    subdomain: str  # labels left of the zone, as sent
    labels: int
    sub_len: int  # bytes of subdomain text, dots included
    max_label: int
    randomness: float  # 0..1, of the most random long label
    non_hostname: int  # bytes outside LDH and underscore
    case_flips: int  # upper/lower switches in the label that has most
    info_bytes: float  # sum over labels of length x log2(alphabet) x randomness / 8
    parts: tuple[str, ...]  # the subdomain labels
    folded: str  # the subdomain, case-folded: what makes a name new or a repeat
    folded_parts: tuple[str, ...]
    part_alphabet: tuple[int, ...]  # alphabet size of each case-folded label
    part_info: tuple[float, ...]  # information estimate of each label
    base_score: float  # the sum of ``points``

    @property
    def long(self) -> bool:
        return self.sub_len >= LONG_SUB or self.max_label >= LONG_LABEL

    @property
    def points(self) -> tuple[tuple[float, str], ...]:
        """Score contributions, type aside, with the reason for each."""
        return tuple(
            _points(self.sub_len, self.max_label, self.randomness, self.non_hostname,
                    self.case_flips)
        )  # fmt: skip


def _points(
    sub_len: int, max_label: int, rand: float, non_hostname: int, flips: int, why: bool = True
) -> list[tuple[float, str]]:
    """Score contributions with their reasons; ``why`` False leaves the reasons empty, for
    the sum that every new name needs (formatting them is most of the cost)."""
    pts: list[tuple[float, str]] = []
    if sub_len >= LONG_SUB:
        pts.append((min(2.0, (sub_len - 48) / 48), f"subdomain {sub_len} B" if why else ""))
    if max_label >= LONG_LABEL:
        size = 1.5 if max_label >= 56 else 0.75
        pts.append((size, f"label of {max_label} chars" if why else ""))
    if rand >= 0.05:
        pts.append((1.5 * rand, f"random-looking label ({rand:.2f})" if why else ""))
    if non_hostname:
        pts.append((3.0, f"{non_hostname} non-hostname bytes" if why else ""))
    if flips >= 4:
        pts.append((1.5, f"mixed case ({flips} flips in a label)" if why else ""))
    return pts


def _labels(
    labels: tuple[str, ...], folded: tuple[str, ...], cased: bool
) -> tuple[tuple[int, ...], tuple[float, ...], float, int, int, int]:
    """(alphabet of each folded label, information estimate in bytes per label, randomness
    of the most random, case flips, bytes outside LDH/underscore, longest label).
    ``cased``: some label has an upper-case letter.

    Most labels are short lowercase words or ids: they get their alphabet (from string
    methods) and nothing else; the rest one pass over their characters (``label_stats``)."""
    count = len(labels)
    alphabets = [0] * count
    info = [0.0] * count
    best, flips, other, longest = 0.0, 0, 0, 0
    for i in range(count):
        label = labels[i]
        size = len(label)
        longest = max(longest, size)
        if size < entropy.MIN_LEN and not cased:
            k = alphabets[i] = entropy.alphabet_size(folded[i])
            if k < 64:  # only a folded alphabet of 64 or 128 holds a byte outside LDH
                continue
        stats = entropy.label_stats(label)  # flips only in a label with both cases
        k = alphabets[i] = entropy.folded_alphabet(stats.classes)
        flips = max(flips, stats.flips)
        other += stats.other
        if size >= entropy.MIN_LEN:
            # The label as sent: both cases make it base64-like (64), not its folded alphabet.
            if k < 64 and stats.classes & entropy.LETTER == entropy.LETTER:
                k = 64
            r, k = entropy.randomness(label, k, stats)
            info[i] = size * _LOG2[k] * r / 8
            best = max(best, r * min(1.0, size / 24))
    return tuple(alphabets), tuple(info), best, flips, other, longest


@functools.lru_cache(maxsize=FEATURE_CACHE)
def name_features(name: str, zone: str | None = None) -> NameFeatures:
    """``zone``: the zone to score under when it is not the registered domain (a policy
    override below it, ``tunnel.overrides``); its labels are not the subdomain's."""
    split = split_name(name) if zone is None else split_under(name, zone)
    labels = split.labels
    subdomain = ".".join(labels)
    lowered = subdomain.lower()
    folded = tuple([label.lower() for label in labels])
    alphabets, info, rand, flips, non_hostname, max_label = _labels(
        labels, folded, lowered != subdomain
    )
    sub_len = len(subdomain)
    return NameFeatures(
        name,
        split.zone,
        subdomain,
        len(labels),
        sub_len,
        max_label,
        rand,
        non_hostname,
        flips,
        sum(info, 0.0),
        labels,
        lowered,
        folded,
        alphabets,
        info,
        sum((p for p, _ in _points(sub_len, max_label, rand, non_hostname, flips, False)), 0.0),
    )


@dataclass(frozen=True, slots=True)
class NameScore:
    """Features and score of one query, as ``egressctl check`` prints them."""

    name: str
    qtype: int
    zone: str
    subdomain: str
    labels: int
    sub_len: int
    max_label: int
    alphabet: int  # symbols of the smallest usual encoding holding the subdomain text
    entropy: float  # bits per symbol of the subdomain text (dots removed)
    norm_entropy: float  # entropy / expected entropy of random text, same length and alphabet
    randomness: float
    hex_run: int  # longest runs of hex, RFC 4648 base32 and (mixed-case) base64 characters
    b32_run: int
    b64_run: int
    non_hostname: int
    case_flips: int
    data_type: str | None
    info_bytes: float
    score: float
    reasons: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    def describe(self) -> str:
        why = "; ".join(self.reasons) if self.reasons else "nothing unusual"
        return f"{self.name} score {self.score:.2f} (zone {self.zone or '-'}): {why}"


def _run(pattern: re.Pattern[str], text: str) -> int:
    return max(map(len, pattern.findall(text)), default=0)


def score_name(name: str, qtype: int = 1, zone: str | None = None) -> NameScore:
    """Features and score of one query name (pure; the type-free part is memoised)."""
    f = name_features(name, zone)
    pts = list(f.points)
    kind = data_type_name(qtype)
    if kind is not None and f.labels:
        pts.append((type_points(qtype), f"data-only type {kind}"))
    text = f.subdomain.replace(".", "")
    k = entropy.alphabet_size(text) if text else 0
    return NameScore(
        name=name,
        qtype=qtype,
        zone=f.zone,
        subdomain=f.subdomain,
        labels=f.labels,
        sub_len=f.sub_len,
        max_label=f.max_label,
        alphabet=k,
        entropy=entropy.entropy_bits(text),
        norm_entropy=entropy.normalised_entropy(text, k) if k else 0.0,
        randomness=f.randomness,
        hex_run=_run(_HEX_RUN, f.subdomain),
        b32_run=_run(_B32_RUN, f.subdomain),
        b64_run=_run(_B64_RUN, f.subdomain) if f.case_flips else 0,
        non_hostname=f.non_hostname,
        case_flips=f.case_flips,
        data_type=kind,
        info_bytes=f.info_bytes,
        score=round(sum((p for p, _ in pts), 0.0), 3),
        reasons=tuple(f"{why} +{p:.2f}" for p, why in pts),
    )
