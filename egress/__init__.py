"""egress: network egress control for AI-agent sandboxes.

The packages read as the data flow (ARCHITECTURE.md has the whole map)::

    policy ─▶ Matcher + nft render context      tunnel: scoring names     (pure core:
    datapath: nft text, set-update plans        resolver: query -> actions  no I/O)
    kernel, store: the adapters (netlink, nft, NFLOG, cgroups; journal, claims, paths)
    sandbox: netns, veth, cgroup   freeze: journal-then-freeze, confirm, attribute
    inline (layer 1) ⟂ observer (layer 2): both judge every query with resolver.judge
    run: `egressctl run`   daemon: egressd   cli: egressctl   lab: the fake internet

Imports point downwards only; import-linter checks it (pyproject.toml).
"""

__version__ = "0.1.0"
