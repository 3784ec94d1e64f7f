"""The datapath core: policy -> nftables text and set-update plans, with no I/O.

    Policy ──render_sandbox()──▶ nft text for the sandbox netns (nft-templates/sandbox.nft)
    SandboxNet ──render_uplink()──▶ nft text for the uplink netns (nft-templates/uplink.nft)
    DNS answer IPs + rule ──elements.plan_update()──▶ "ip . proto . port" for allow4/allow6
        ──ExpiryBook.plan_adds()──▶ one add per set and timeout (no answer shortens another)
    pool ──addressing.Pools──▶ the sandbox's v4/v6 link networks (first_free index)
    NFLOG messages ──nflog_wire.walk()──▶ each copy's prefix and payload (compiled by mypyc,
        ``native``, when built from these sources); the observer's repeats end there
    NFLOG payload ──packet.parse_ip_packet()──▶ Packet; evidence.drop_violation()
    a new flow's first client bytes ──firstbytes.judge()──▶ FirstBytes: the TLS SNI or
        HTTP Host it asks for, or why it names no one hostname (invariant 10's input)
    a plain-HTTP flow's later bytes ──httpstream.RequestStream.feed()──▶ each request
        head, judged as the first, its body framed as the server frames it

The kernel adapters load the text in one atomic transaction (kernel.nft); the resolver's
adds go over egress's own netlink socket (kernel.nft_sets, libnftables as the fallback);
the templates themselves are read by the caller.
"""

from egress.datapath.native import NATIVE

NATIVE.activate(__path__)  # before any module of the package: the compiled ones, if fresh
