"""Layer 2, the observer: a separate process that trusts nothing the inline layer says.

    kernel NFLOG (observer group: a copy of every DNS query and of every drop)
        ─▶ layer.Observer: egress.resolver.judge on each query, drop evidence, the drop
           counter, the inline layer's pidfd ─▶ its own Enforcer ─▶ journal, freeze
    kernel NFLOG copies of the resolver's answers and of a checked flow's queued segments
        ─▶ flows.FlowWatch: its own bindings (answers.Answers, which sift.py hands most
           answers to directly), the same first-bytes judgment
    process.py     forks one Observer for `egressctl run`; if run dies, that Observer
                   removes the sandbox once nothing runs in it (`egressctl kill`)
    supervisor.py  `egressd observer`: one forked Observer per sandbox egressd serves

    sift.py        the copies it deals with itself, before events: repeats of allowed
                   queries (replays.py), answers by their bytes (answers.py); compiled by
                   mypyc (native.py) when a build matches the sources

It imports nothing of ``egress.inline`` (an import-linter contract checks it).
"""

from egress.observer.native import NATIVE

NATIVE.activate(__path__)  # before any module of the package: the compiled ones, if fresh
