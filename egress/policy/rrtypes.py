"""DNS record type names and numbers, and which types are only good for carrying data.

Names come from dnslib's ``QTYPE`` table, plus the generic ``TYPEnnn`` spelling of
RFC 3597 so a policy can name any type, even one dnslib has never heard of.

"Data-only" types have no use for an ordinary client that wants to reach a host: NULL,
ANY, the zone transfers and the private-use range hold whatever bytes their owner likes,
which makes them the favourite carrier of DNS tunnels. A policy may still allow them,
but only by naming them in a rule (never through the default list), and with a warning.
"""

from __future__ import annotations

import difflib
import re

from dnslib import QTYPE

_FORWARD: dict[int, str] = dict(QTYPE.forward)
_REVERSE: dict[str, int] = dict(QTYPE.reverse)
_GENERIC = re.compile(r"TYPE([0-9]{1,5})")

PRIVATE_USE = range(65280, 65535)  # RFC 6895: 65280-65534
DATA_ONLY_TYPES: frozenset[int] = frozenset({10, 251, 252, 255, *PRIVATE_USE})

# Pseudo-records live in the additional section or describe transactions; nobody queries
# for them, so a policy that names one has made a mistake.
PSEUDO_TYPES: frozenset[int] = frozenset({41, 249, 250})  # OPT, TKEY, TSIG


def type_number(name: str) -> int:
    """Number of the record type ``name`` (case-insensitive; ``TYPE65280`` works too).

    Raises ValueError with a message fit for a user: ``unknown record type 'TXTT'``.
    """
    upper = name.upper()
    generic = _GENERIC.fullmatch(upper)
    if generic is not None:
        number = int(generic.group(1))
        if not 1 <= number <= 65535:
            raise ValueError(f"record type '{name}' is out of range: TYPE1 to TYPE65535")
        return number
    number_or_none = _REVERSE.get(upper)
    if number_or_none is None:
        raise ValueError(f"unknown record type '{name}'{_suggest(upper)}")
    return number_or_none


def type_name(number: int) -> str:
    """Mnemonic of a record type number, or ``TYPEnnn`` when it has none."""
    return _FORWARD.get(number, f"TYPE{number}")


def is_data_only(number: int) -> bool:
    """True for types that carry arbitrary data and nothing a connecting client needs."""
    return number in DATA_ONLY_TYPES


def is_pseudo(number: int) -> bool:
    """True for pseudo-records (OPT, TKEY, TSIG) that are never the subject of a query."""
    return number in PSEUDO_TYPES


def names_of(numbers: frozenset[int] | set[int]) -> str:
    """``A, AAAA, CNAME`` for a set of numbers, sorted by name (stable in messages)."""
    return ", ".join(sorted(type_name(n) for n in numbers)) or "none"


def _suggest(upper: str) -> str:
    close = difflib.get_close_matches(upper, _REVERSE, n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""
