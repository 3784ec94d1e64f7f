"""Kernel adapters: the only code that talks to netlink, libnftables, NFLOG, NFQUEUE and
cgroupfs.

    netns.py       network namespaces, sysctls, link lookups and teardown (pyroute2, setns)
    rtnl.py        a sandbox's veth, addresses and routes as packed rtnetlink batches
    nft.py         one libnftables handle per namespace: atomic loads, sets, counters
    nft_worker.py  libnftables in a child process, for egressd's many descriptors
    nft_sets.py    the resolver's set-element adds/deletes as one raw nf_tables batch
    nft_figures.py a sandbox's set sizes and drop counter, read by raw nf_tables netlink
    figures_worker.py  those reads for egressd's /metrics, in a child process of their own
    nfnetlink.py   a raw NETLINK_NETFILTER socket bound to one resource: what the next share
    nflog.py       NFLOG listeners: the kernel's drop and DNS evidence, per namespace
    nfqueue.py     NFQUEUE listeners: packets held until a verdict (a flow's first bytes)
    conntrack.py   a netns's conntrack entries from sources not its own, deleted (ctnetlink)
    queue_rule.py  the iptables-nft NFQUEUE rule a sandbox netns needs for them
    nft_copy.py    tables another tool made in one netns, copied into the next as one batch
    cgroup.py      cgroup v2 (and the v1 freezer twin) per sandbox: join, freeze, thaw, kill
    idmap.py       idmapped bind mounts (open_tree, mount_setattr, move_mount)
    confine.py     the workload's seccomp filter (libseccomp) and Landlock domain
    sched.py       leaving real-time scheduling, which starves what a freeze waits on

They carry out what the layers above decide and know nothing of policies, resolvers or the
journal (an import-linter contract checks it). libnftables' and pyroute2's errors are
translated here, once, into ``egress.errors``; the raw netlink set writer (nft_sets.py)
raises OSError/ValueError on the hot path, which its one caller (inline.sets) handles.
"""
