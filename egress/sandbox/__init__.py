"""Sandbox plumbing: the netns, veth, uplink and cgroup one workload lives in.

    plan (egress.datapath.addressing) ─▶ lifecycle.create: claim an address block, netns,
        veth into the uplink netns, routes, cgroup, the rendered ruleset (one nft load)
    attach.py    a netns and cgroup another runtime made (containers, pods)
    adopt.py     a sandbox an earlier egressd created, from its record and claim
    uplink.py    the uplink namespace's shared forwarding/NAT table
    workload.py  the user's command inside it: unprivileged, its cgroup joined before exec

Every step registers its undo, so a failure half-way, or ``destroy``, removes exactly
what was made.
"""
