"""egressd: the host-wide daemon (serves many sandboxes from one process).

Not built yet: until it is, `egressd` says so and points at `egressctl run`, which serves
one sandbox with the same core.
"""
