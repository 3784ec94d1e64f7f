"""Fixed values of every sandbox's datapath.

NFLOG groups and the resolver address are per network namespace, so every sandbox can use
the same ones: nothing here needs to be allocated.
"""

from __future__ import annotations

TABLE = "egress"  # inet table in the sandbox netns
# The sets the resolver fills with `ip . proto . port` elements learned from DNS answers.
ALLOW4 = "allow4"
ALLOW6 = "allow6"
ALLOW_SETS = (ALLOW4, ALLOW6)
# Flows whose connect froze the sandbox: their next SYN is reset once it is resumed.
HELD4 = "held4"
HELD6 = "held6"
RESOLVER4 = "127.0.0.53"  # the sandbox's resolver, on its own loopback
INLINE_GROUP = 100  # NFLOG group read by the inline layer
OBSERVER_GROUP = 101  # NFLOG group read by the observer layer
LOG_RATE = "200/second"
LOG_BURST = 100
SANDBOX_IF = "eth0"  # the sandbox's end of its veth
DNS_LOG_PREFIX = "egress dns"
DROP_LOG_PREFIX = "egress "  # followed by the violation class
UPLINK_TABLE = "egress_uplink"  # inet table shared by every sandbox of one uplink netns
SANDBOX_CT_MARK = 0x65677231  # "egr1": marks sandbox flows for the uplink's NAT hook
HOST_IF_PREFIX = "eg-"  # host ends of sandbox veths; the uplink table matches "eg-*"
# `egressd sidecar` lives in the sandbox's own netns, so its upstream DNS queries meet the
# sandbox's rules. It sets this packet mark (SO_MARK) on its upstream sockets and its
# ruleset accepts marked packets to exactly its upstreams. Setting SO_MARK needs
# CAP_NET_ADMIN or CAP_NET_RAW, which the workload must not have. "egsd".
SIDECAR_MARK = 0x65677364
