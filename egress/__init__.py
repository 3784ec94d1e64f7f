"""egress: network egress control for AI-agent sandboxes.

Flow (see ../shared/DESIGN.md)::

    policies/*.yaml -> egress.policy (parse, validate, compile) -> Matcher + nft render context
    egress.datapath renders the sandbox's nftables ruleset; egress.runtime creates the
    netns, veth, cgroup and loads it; egress.resolver decides every DNS query; egress.tunnel
    scores names; egress.cli / egress.daemon wire it together.

Layers import downwards only: entry points -> runtime shells -> pure core -> model/errors.
"""

__version__ = "0.1.0"
