"""The uplink side: forwarding and NAT for every sandbox behind one uplink namespace.

One shared table (nft-templates/uplink.nft) serves all sandboxes of an uplink: a new
sandbox adds nothing to it, so creating the hundredth costs what the first did. The first
sandbox loads it and the last one removes it, both under the claims lock, so a sandbox
being created never finds the table half-removed.
"""

from __future__ import annotations

from egress.datapath import constants as c
from egress.datapath.render import render_uplink
from egress.errors import SandboxError
from egress.kernel import netns
from egress.kernel.nft import NftHandle
from egress.store import claims
from egress.store.paths import read_template


def attach(uplink: str | None) -> None:
    """Make sure the uplink forwards and masquerades sandbox traffic."""
    uplink_if = netns.default_route_ifname(uplink)
    if uplink_if is None:
        where = f"uplink netns {uplink!r}" if uplink else "the host"
        raise SandboxError(f"{where} has no default route: the sandbox's traffic can't leave")
    netns.set_sysctl(uplink, "net.ipv4.ip_forward", 1)
    netns.set_sysctl(uplink, "net.ipv6.conf.all.forwarding", 1)
    text = render_uplink(read_template("uplink.nft"), uplink_if)
    with claims.locked(), NftHandle.open(uplink) as handle:
        if not handle.table_exists("inet", c.UPLINK_TABLE):
            handle.load(text)


def detach(uplink: str | None, sandbox_id: str) -> None:
    """Give up the sandbox's address claim; remove the shared table if no other live
    sandbox uses this uplink. Both under the claims lock: of sandboxes ending at once,
    the last one sees no other claim and takes the table along."""
    with claims.locked():
        claims.release(sandbox_id)
        if uplink is not None and not netns.netns_exists(uplink):
            return
        others = [
            other
            for other in claims.load_all()
            if other.id != sandbox_id
            and other.uplink_netns == uplink
            and not claims.is_stale(other)
        ]
        if others:
            return
        with NftHandle.open(uplink) as handle:
            handle.delete_table("inet", c.UPLINK_TABLE)
