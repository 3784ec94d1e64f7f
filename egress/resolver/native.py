"""The resolver core compiled by mypyc, used when a build matches the sources
(``egress.native``: how a build is made, checked and put first on the package's path).

Every query runs modules of this package: a repeat its replay, a cache miss every one
(the query's parse and judgement, the answer's parse, filter, cache entry, set plan and
reply). Compiled, a replay costs half what the sources cost (0.15-0.16 against 0.33 µs)
and a miss 1.1x less (64-72 against 74-78 µs, most of the rest the tunnel scorer, which
is compiled either way); ``bench/bench_core.py`` prints both. A module that subclasses a
library's class inside a function cannot be compiled: dnslib's reader of the rare record
types is ``message_dnslib``, outside this list.
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
