"""egressd: the host-wide daemon, serving many sandboxes from one process.

    orchestrator ─HTTP over /run/egress/egressd.sock─▶ api ─▶ registry
    registry ─ create: sandbox.create (netns, veth, cgroup) ┐
             ─ attach: runtime.attach (foreign netns+cgroup) ┴▶ Session + resolver per sandbox
    set-policy ─▶ swap: one nft transaction (rules + stale elements out) ─▶ core.set_policy
    run dir (/run/egress/daemon/ID.json) ─▶ adoption by the next egressd, `egressd observer`
    /metrics ◀─ resolver cores, sessions, nft counters and sets
    sidecar: one sandbox from inside its netns ─▶ same inline layer (inline.py), upstream
             sockets marked (SO_MARK) for the one rule that lets them out

The same inline layer as `egressctl run` (``runtime.session``, ``runtime.dns_server``);
only the wiring is here.
"""
