"""The scorer's modules compiled by mypyc, used when a build matches the sources
(``egress.native``: how a build is made, checked and put first on the package's path).

Scoring a new name runs a few hundred bytecodes per label (tables, windows, Bloom
filters, label statistics); mypyc compiles the same typed modules to C, which makes
scoring a new name 3-4.5x cheaper (``bench/bench_tunnel.py`` prints both). The modules
are written for it: Final constants, hashes cut to 62 bits, lists where an array would
be indexed through a call, methods called as such.
"""

from __future__ import annotations

from pathlib import Path

from egress.native import Native

# The hot path of a new name, and what it calls.
NATIVE = Native(
    "egress.tunnel",
    Path(__file__).resolve().parent,
    (
        "entropy",
        "features",
        "headroom",
        "labels",
        "overrides",
        "scorer",
        "verdict",
        "vocab",
        "window",
        "zone",
    ),
)


def in_use() -> str:
    """ "compiled (mypyc)" or "Python sources", as the scorer's modules were imported."""
    return NATIVE.in_use()
