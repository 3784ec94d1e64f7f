"""The lever both layers pull: journal, then freeze, then confirm and attribute.

    Violation ─▶ enforcer.Enforcer.handle: action from the policy (log, block, freeze)
              ─▶ journal commit (durable first: invariant 5) ─▶ cgroup freeze
              ─▶ confirm frozen (journaled) ─▶ attribution: which process did it

Each layer has its own Enforcer, journal connection and cgroup handle: what makes the
layers independent is separate processes and writers, not separate rules.
"""
