"""Sandbox plumbing: the netns, veth, uplink and cgroup one workload lives in.

    plan (egress.datapath.addressing) ─▶ lifecycle.create: claim an address block, netns,
        veth into the uplink netns, routes, cgroup, the rendered ruleset (one nft load)
    attach.py    a netns and cgroup another runtime made (containers, pods)
    adopt.py     a sandbox an earlier egressd created, from its record and claim
    uplink.py    the uplink namespace's shared forwarding/NAT table
    view.py      what the workload sees of the host: bubblewrap's allowlist, $HOME, idmapped
                 working directory and binds; removed (unmounted first) with the sandbox
    workload.py  the user's command inside it: its cgroup joined before exec, its own uid,
                 PID namespace (tini as PID 1) and view, an allowlisted environment

Every step registers its undo, so a failure half-way, or ``destroy``, removes exactly
what was made.
"""
