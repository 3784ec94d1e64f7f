"""The resolver core compiled by mypyc, used when a build matches the sources
(``egress.native``: how a build is made, checked and put first on the package's path).

Every query runs modules of this package: a repeat its replay, a cache miss most of
them (the query's parse and judgement, the answer's parse, filter, cache entry and
reply; the set plan is datapath's, and Python). ``bench/bench_core.py`` prints the gain:
a replay runs in less than half the time, a miss back to back in ~0.9 of it (the tunnel
scorer's price of a new name, compiled either way, is most of the rest), and a miss
after an idle wait no faster. A module that subclasses a library's class inside a
function cannot be compiled: dnslib's reader of the rare record types is
``message_dnslib``, outside this list.
"""

from __future__ import annotations

from pathlib import Path

from egress.native import Native

NATIVE = Native(
    "egress.resolver",
    Path(__file__).resolve().parent,
    (
        "actions",
        "answer",
        "audit",
        "bindings",
        "cache",
        "core",
        "firstrequest",
        "flows",
        "judge",
        "message",
        "ratelimit",
        "rebinding",
        "svcb",
        "wire",
    ),
)
