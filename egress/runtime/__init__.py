"""The I/O shells: thin layers that carry out what the pure core decides.

    netns.py        network namespaces, veth pairs, addresses, routes (pyroute2, setns)
    nft.py          one libnftables handle per namespace: atomic loads, sets, counters
    nft_worker.py   libnftables in a child process, for egressd's many descriptors
    nft_netlink.py  the resolver's set-element adds/deletes as one raw nf_tables batch
    nflog.py        NFLOG listeners: the kernel's drop and DNS evidence, per namespace
    cgroup.py       cgroup v2 (and v1 freezer) per sandbox: join, freeze, thaw, kill
    claims.py       which sandbox holds which address block (a lock, a file each)
    sandbox.py      create/destroy one sandbox from a plan and rendered rulesets
    uplink.py       the uplink namespace's shared forwarding/NAT table
    workload.py     start the user's command inside it, unprivileged
    dns_server.py   the resolver's asyncio shell around egress.resolver's core
    upstream.py     upstream addresses and a pool of fresh per-query sockets
    tcp_front.py    the resolver's TCP side: capped accepts, framed queries
    journal.py      the violation journal (SQLite, WAL, fsync per record)
    enforcer.py     one layer's journal-then-freeze-then-attribute sequence
    attribution.py  which process is behind a violation
    observer.py     the observer layer (observer_process.py forks it from `run`)
    session.py      the inline layer's live loop in `egressctl run`
    runner.py       `egressctl run`: one sandbox, its two layers and its report
    lab/            a self-contained "internet" in namespaces for tests and the demo

Third-party and OS errors are translated here, once, into egress.errors.
"""
