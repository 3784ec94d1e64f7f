"""egressd: the host-wide daemon, serving many sandboxes from one process.

    orchestrator ─HTTP over /run/egress/egressd.sock─▶ api ─▶ registry
    registry ─ create: sandbox.lifecycle (netns, veth, cgroup) ┐
             ─ attach: sandbox.attach (foreign netns+cgroup)   ┴▶ inline.wiring per sandbox
             ─ adopt: sandbox.adopt (what an earlier egressd left, by store.rundir)
    set-policy ─▶ inline.swap: one nft transaction (rules + stale elements out)
    run dir (/run/egress/daemon/ID.json) ─▶ adoption by the next egressd, `egressd observer`
    handoff.py: --replace and SIGHUP pass every socket to the successor (SCM_RIGHTS)
    /metrics ◀─ resolver cores, sessions (metrics.py), nft counters and sets asked of
             the figures worker process (figures.py ─▶ kernel.figures_worker)
    egress.collect: what lives frozen out of the garbage collector's walks (a sandbox
             made, every second); one full collection once the sandboxes settle
    lag.py: how late the loop runs what is due (every 10 ms), for /metrics
    sidecar: one sandbox from inside its netns ─▶ the same inline wiring, upstream
             sockets marked (SO_MARK) for the one rule that lets them out

The inline layer is ``egress.inline``'s, the same as `egressctl run`'s; `egressd observer`
runs ``egress.observer.supervisor``. Only the daemon's wiring, API and restarts are here.
"""
