"""`egressctl run`: one sandbox, its two layers and its report, with no daemon.

runner.run: plan ─▶ sandbox.lifecycle.create ─▶ observer.process (forked)
    ─▶ inline.wiring (resolver + session) ─▶ sandbox.workload (CMD, unprivileged)
    ─▶ wait: CMD exits, or a freeze waits for resume/kill ─▶ report ─▶ destroy
"""
