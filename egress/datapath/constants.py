"""Fixed values of every sandbox's datapath.

NFLOG groups and the resolver address are per network namespace, so every sandbox can use
the same ones: nothing here needs to be allocated.
"""

from __future__ import annotations

NETNS_DIR = "/run/netns"  # where `ip netns` (and egress) pin a netns: it lives while its pin does
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
# mode: audit logs every new flow it lets through to the inline layer, for `egressctl learn`
# (no violation class starts with "connect", so drop_class ignores these).
CONNECT_PREFIX = "egress connect "
CONNECT_LEARNED_PREFIX = "egress connect learned"  # to a DNS-learned address
CONNECT_STATIC_PREFIX = "egress connect static"  # to a spec.connect.allow destination
UPLINK_TABLE = "egress_uplink"  # inet table shared by every sandbox of one uplink netns
SANDBOX_CT_MARK = 0x65677231  # "egr1": marks sandbox flows for the uplink's NAT hook
HOST_IF_PREFIX = "eg-"  # host ends of sandbox veths; the uplink table matches "eg-*"
# `egressd sidecar` lives in the sandbox's own netns, so its upstream DNS queries meet the
# sandbox's rules. It sets this packet mark (SO_MARK) on its upstream sockets and its
# ruleset accepts marked packets to exactly its upstreams. Setting SO_MARK needs
# CAP_NET_ADMIN or CAP_NET_RAW, which the workload must not have. "egsd".
SIDECAR_MARK = 0x65677364

# Connections bound to names (resolver.flows): a new TCP flow to a DNS-learned address on
# one of connect.check_names' ports gets conntrack mark CT_NEEDS_CHECK. Its first segments
# with data get packet mark QUEUE_MARK, and iptables-nft's NFQUEUE target (nft's own
# `queue` needs CONFIG_NFT_QUEUE, which many kernels lack) hands them to the inline
# layer on queue FIRST_BYTES_QUEUE, without bypass: nobody listening, they are dropped.
# The verdict re-marks each one: CHECKED_MARK (the flow's conntrack mark becomes
# CT_CHECKED, and its later packets stay in the kernel), READ_MARK (a plain-HTTP flow:
# its conntrack mark becomes CT_READING, and every later segment with data is queued
# too, so that each request is read), REFUSED_MARK (answered with a TCP reset) or 0 (a
# segment with no data, ahead of the flow's first request: the chain's usual rules then
# take it). A CT_READING flow's segments are marked QUEUE_MARK too; an iptables-nft rule
# turns that into READ_QUEUE_MARK as it queues them, from the conntrack mark it finds
# then, so the inline layer tells a later segment of a read connection from a new
# connection's on the same ports, also for a segment it re-runs (render.queue_rules).
# Exact values, never bits: SIDECAR_MARK shares the packet mark, and a bit test would
# match some of its bits. "egr" and a number, like SANDBOX_CT_MARK.
FIRST_BYTES_QUEUE = 100
CT_NEEDS_CHECK = 0x65677210
CT_CHECKED = 0x65677211
CT_READING = 0x65677212
QUEUE_MARK = 0x65677220
CHECKED_MARK = 0x65677221
REFUSED_MARK = 0x65677222
READ_QUEUE_MARK = 0x65677223
READ_MARK = 0x65677224
FIRST_BYTES_LOG_PREFIX = "egress first_bytes"  # the observer's copy of a queued segment
READ_LOG_PREFIX = "egress http_read"  # ... of a segment of a flow read request by request
ANSWER_LOG_PREFIX = "egress dns answer"  # the observer's copy of the resolver's answers
