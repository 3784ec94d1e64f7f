"""Layer 1, the inline layer: the resolver's shell and the NFLOG reader of one sandbox.

    workload ─DNS─▶ server.ResolverServer (127.0.0.53 in the sandbox netns)
        ─▶ egress.resolver.core.ResolverCore, deciding by egress.resolver.judge:
           deny ─▶ Report ─▶ session.Session ─▶ Enforcer
           allow ─▶ upstream.py (sockets in the uplink netns)
        ─▶ AllowThenReply ─▶ sets.SetWriter (kernel.nft_sets, each add acked)
        ─▶ core.on_allowed ─▶ the reply, or SERVFAIL
    kernel NFLOG (inline group) ─▶ session.Session ─▶ Enforcer (journal, freeze)
    kernel NFQUEUE (a checked flow's first segments) ─▶ flowcheck.FlowCheck
        ─▶ egress.resolver.firstrequest against the core's bindings ─▶ pass (CHECKED)
           or name_mismatch ─▶ session.Session ─▶ Enforcer; dropped or reset
    tcp_front.py  the resolver's TCP side: capped accepts, framed queries
    swap.py       a live policy swap (rules, learned elements, core) in one transaction
    wiring.py     the one wiring `egressctl run`, egressd and the sidecar all use

It imports nothing of ``egress.observer`` (an import-linter contract checks it); the two
share only the packages below them (the judge, the freeze lever, the adapters), not a
process, socket or journal connection, so either layer can die and the other freezes.
"""
