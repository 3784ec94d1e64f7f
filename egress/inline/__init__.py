"""Layer 1, the inline layer: the resolver's shell and the NFLOG reader of one sandbox.

    workload ─DNS─▶ server.ResolverServer (127.0.0.53 in the sandbox netns)
        ─▶ egress.resolver.ResolverCore: deny ─▶ Report ─▶ session.Session ─▶ Enforcer
                                         allow ─▶ upstream.py (sockets in the uplink netns)
        ─▶ AllowThenReply: the set elements through nft_sets, the kernel's ack, then the reply
    kernel NFLOG (inline group) ─▶ session.Session ─▶ Enforcer (journal, freeze)
    tcp_front.py  the resolver's TCP side: capped accepts, framed queries
    swap.py       a live policy swap (rules, learned elements, core) in one transaction
    wiring.py     the one wiring `egressctl run`, egressd and the sidecar all use

It shares nothing with ``egress.observer`` but the pure core and the adapters below (an
import-linter contract checks it), so either layer can die and the other still freezes.
"""
