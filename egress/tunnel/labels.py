"""Query name -> (subdomain labels, registered domain).

A tunnel can only carry data in the labels its operator's nameserver gets to see, that is
left of a registered domain it controls. The registered domain comes from the Public Suffix
List (``publicsuffixlist`` ships the list in the wheel and never fetches it at run time). The
private section counts too: ``bucket.s3.amazonaws.com`` is its own zone, because the bucket
label goes to AWS's nameservers, not to whoever named the bucket.

Names arrive as ``str``: either raw (one character per byte, latin-1 style) or in DNS
presentation form with ``\\DDD`` and ``\\X`` escapes. Both give the same labels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Final

from publicsuffixlist import PublicSuffixList

_CACHE: Final = 1024  # split results memoised: benign traffic repeats a few hundred names


@dataclass(frozen=True, slots=True)
class SplitName:
    labels: tuple[str, ...]  # subdomain labels as sent (case kept), left to right
    zone: str  # registered domain, lowercase; the whole name when it is a public suffix

    @property
    def subdomain(self) -> str:
        return ".".join(self.labels)

    @property
    def sub_len(self) -> int:
        """Bytes of subdomain text on the wire, dots included (escapes decoded)."""
        return sum(len(label) for label in self.labels) + max(0, len(self.labels) - 1)


@functools.cache
def _psl() -> PublicSuffixList:
    # Loaded on first use (about 25 ms) from the file inside the package: no network I/O.
    return PublicSuffixList()


def load() -> None:
    """Load the Public Suffix List and its suffix set now (~50 ms, 2.5 MB, once per
    process) rather than at the first name split: for a process that forks workers
    which all split names (``egressd observer``'s shards share the pages then)."""
    _reach()


# \DDD escapes by their three digits: the byte, as a character (values above 255 wrap).
_DDD: Final = {f"{i:03d}": chr(i & 0xFF) for i in range(1000)}


def _unescape(label: str) -> str:
    """``label`` with its escapes decoded: ``\\DDD`` (a byte, decimal), ``\\X`` (the
    character X); a lone backslash at the very end is kept. (Split at the backslashes, so
    string methods in C find them; a 120-escape base128 label takes 5 us compiled.)"""
    pieces = label.split("\\")
    out = [pieces[0]]
    i, n = 1, len(pieces)
    while i < n:
        piece = pieces[i]
        i += 1
        if not piece:  # the backslash itself was escaped: the next piece is plain text
            out.append("\\")
            if i < n:
                out.append(pieces[i])
                i += 1
            continue
        char = _DDD.get(piece if len(piece) == 3 else piece[:3])  # base128: mostly 3
        if char is None:
            out.append(piece)  # "\\X": X, then the rest as it is
        else:
            out.append(char if len(piece) == 3 else char + piece[3:])
    return "".join(out)


def unescape_labels(name: str) -> list[str]:
    """Split a name into labels, decoding presentation-form escapes when there are any."""
    if "\\" not in name:
        name = name[:-1] if name.endswith(".") else name
        return name.split(".") if name else []
    # Split at every dot, then glue back the pieces whose dot was escaped (a piece ending
    # in an odd number of backslashes): string methods in C, not a loop per character.
    labels: list[str] = []
    carry: str | None = None
    for piece in name.split("."):
        if carry is not None:
            piece = carry + "." + piece
        if (len(piece) - len(piece.rstrip("\\"))) % 2:
            carry = piece
            continue
        carry = None
        labels.append(piece)
    if carry is not None:
        labels.append(carry)
    elif len(labels) > 1 and not labels[-1]:
        labels.pop()  # the root's dot
    return [_unescape(label) if "\\" in label else label for label in labels]


_LDH: Final = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")


def name_from_labels(labels: tuple[bytes, ...]) -> str:
    """Presentation form of wire labels, bytes outside LDH/underscore as ``\\DDD``."""
    return ".".join(
        "".join(chr(b) if b in _LDH else f"\\{b:03d}" for b in label) for label in labels
    )


@functools.lru_cache(maxsize=_CACHE)
def split_name(name: str) -> SplitName:
    """Subdomain labels and registered domain of ``name``."""
    labels = unescape_labels(name)
    # PSL rules are lowercase LDH; a label holding a raw dot must not shift the split.
    lowered = [label.lower().replace(".", "_") for label in labels if label]
    if not lowered:
        return SplitName((), "")
    zone = registered_domain(lowered)
    keep = len(labels) - (zone.count(".") + 1)
    return SplitName(tuple(labels[: max(0, keep)]), zone)


@functools.cache
def _reach() -> frozenset[str] | None:
    """Every suffix of every PSL rule ("amazonaws.com" for "s3.dualstack.(...).amazonaws.com",
    "ck" for "*.ck"): a name's suffix outside this set cannot be extended into a match. About
    12,000 strings, 1 MB, once per process. None if the library no longer keeps its rules
    where this looks for them: every name then takes the library's own full lookup."""
    rules = getattr(_psl(), "_publicsuffix", None)
    if not isinstance(rules, frozenset):
        return None
    reach: set[str] = set()
    for rule in rules:
        body = rule[1:] if rule[:1] == "!" else rule[2:] if rule[:2] == "*." else rule
        parts = body.split(".")
        reach.update(".".join(parts[i:]) for i in range(len(parts)))
    return frozenset(reach)


@functools.lru_cache(maxsize=_CACHE)
def _public_labels(suffix: str) -> int:
    """Labels of the public suffix of a name that ends in ``suffix``, as the library counts
    them. Asked with a label to the left that no rule can hold (a NUL byte): that changes
    the count only where a wildcard matches the whole name, and such a name is a public
    suffix either way."""
    public = _psl().publicsuffix(f"\x00.{suffix}")
    return public.count(".") + 1 if public else 0


def registered_domain(lowered: list[str]) -> str:
    """What ``PublicSuffixList.privatesuffix`` says for the name of these (lowercase, non-
    empty) labels, or the whole name when it is a public suffix itself.

    The library tries every suffix up to 8 labels deep, longest first. Walking from the
    right instead, the first suffix that no rule ends in (``_reach``) ends the search: no
    rule can match past it, so the answer depends on that suffix alone, memoised.
    """
    reach = _reach()
    if reach is None:
        whole = ".".join(lowered)
        return _psl().privatesuffix(whole) or whole
    n = len(lowered)
    depth, suffix = 1, lowered[-1]
    while depth < n and suffix in reach:
        depth += 1
        suffix = f"{lowered[-depth]}.{suffix}"
    public = _public_labels(suffix)
    if not public or n < public + 1:
        return ".".join(lowered)
    return ".".join(lowered[-(public + 1) :])


def split_under(name: str, zone: str) -> SplitName:
    """Subdomain labels of ``name`` below ``zone`` (a suffix of it, lowercase)."""
    labels = unescape_labels(name)
    keep = len(labels) - (zone.count(".") + 1)
    return SplitName(tuple(labels[: max(0, keep)]), zone)


SPECIAL_USE_TLDS: Final = frozenset(
    {"local", "localhost", "invalid", "test", "internal", "alt", "example", "arpa"}
)


def under_no_real_tld(name: str) -> bool:
    """True for a name whose top-level domain is neither in the Public Suffix List nor a
    special-use one (RFC 6761/8375/9476): nothing on the public internet answers there.

    iodine's A and CNAME modes send their downstream data as CNAME targets such as
    ``hkzaugs0juqae4aa.dh``: a CNAME pointing there is data, not a redirect.
    """
    labels = [label for label in name.lower().rstrip(".").split(".") if label]
    if not labels or labels[-1] in SPECIAL_USE_TLDS:
        return False
    return _psl().publicsuffix(name.lower().rstrip("."), accept_unknown=False) is None
