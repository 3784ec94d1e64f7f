"""The datapath core: policy -> nftables text and set-update plans, with no I/O.

    Policy ──render_sandbox()──▶ nft text for the sandbox netns (nft-templates/sandbox.nft)
    SandboxNet ──render_uplink()──▶ nft text for the uplink netns (nft-templates/uplink.nft)
    DNS answer IPs + rule ──set_elements()──▶ "ip . proto . port" elements for allow4/allow6
    index in pool ──addressing.allocate()──▶ the sandbox's v4/v6 link networks

The kernel adapters load the text in one atomic transaction and send the elements through
an in-process libnftables handle; the templates themselves are read by the caller.
"""
