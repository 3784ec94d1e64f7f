"""The I/O shells: thin layers that carry out what the pure core decides.

    netns.py    network namespaces, veth pairs, addresses, routes (pyroute2, setns)
    nft.py      one libnftables handle per namespace: atomic loads, set elements, counters
    nflog.py    NFLOG listeners: the kernel's drop and DNS evidence, per namespace
    cgroup.py   cgroup v2 (and v1 freezer) per sandbox: join, freeze, thaw, kill
    claims.py   which sandbox holds which address block (a lock and one file per sandbox)
    sandbox.py  create/destroy one sandbox from a SandboxNet plan and rendered rulesets
    workload.py start the user's command inside it, unprivileged
    runner.py   `egressctl run`: one sandbox, its NFLOG evidence and its report
    lab/        a self-contained "internet" in namespaces for tests and the demo

Third-party and OS errors are translated here, once, into egress.errors.
"""
