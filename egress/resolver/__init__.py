"""The filtering resolver, sans I/O: bytes and ``now`` in, actions out (core.py).

Its part of the flow (DESIGN.md)::

    query ─ ratelimit.TokenBucket (per sandbox, spec.dns.rate_limit): over it? ─▶ dropped
        │ (within it)
        ▼
    query bytes ─ core.replay: the same bytes answered from a cache entry alive? ─▶ reply bytes
        │ (no)
        ▼ wire.parse_query (header + question by hand) ─▶ cache hit? ─▶ Reply (cache.render)
        ▼ miss: judge.judge (matcher + tunnel scorer) ─ denied ─▶ Report + NXDOMAIN/REFUSED,
        │       never forwarded (the observer layer calls the same judge)
        ▼ allowed ─▶ Forward (our ID, lowercased name, our EDNS)
    upstream bytes ─ message.parse (message_dnslib for rare types) ─▶ answer.filter_answer
        (CNAME chain, types, rebinding; re-decided under the policy in force now)
        ─▶ message.build ─▶ AllowThenReply (the adds planned by datapath's ExpiryBook)
    core.on_allowed(token, acked, late) ─▶ the replies (cached), or SERVFAIL (+ Revoke)

The shells (egress.inline.server, egressd) perform the actions: send, forward, add
the set elements and wait for the kernel's ack, journal the reports.

The modules are also compiled by mypyc (``native``), and the compiled ones are imported
when they were built from exactly these sources.
"""

from egress.resolver.native import NATIVE

NATIVE.activate(__path__)  # before any module of the package: the compiled ones, if fresh
