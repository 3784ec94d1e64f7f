"""Render nft-templates/*.nft into the ruleset text for one sandbox.

Templates hold ``{{name}}`` slots that this module fills with blocks it builds from the
policy; nft's own ``define``/``$VAR`` carry the scalar values, so a rendered file with
placeholder values still passes ``nft -c -f`` and shows the reader which values vary.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass

from egress.datapath import constants as c
from egress.errors import DatapathError
from egress.model import Action, CidrRule, Mode, Policy, PortRange, ViolationClass

_SLOT = re.compile(r"\{\{(\w+)\}\}")


@dataclass(frozen=True)
class Define:
    name: str
    value: str
    note: str  # why the value is what it is, shown as a comment

    def line(self) -> str:
        return f"define {self.name} = {self.value}\t# {self.note}"


def fill(template: str, slots: Mapping[str, str]) -> str:
    """Replace every ``{{slot}}``; a slot the caller did not provide is a bug, not a blank."""

    def sub(m: re.Match[str]) -> str:
        try:
            return slots[m.group(1)]
        except KeyError:
            raise DatapathError(f"template slot {{{{{m.group(1)}}}}} has no value") from None

    return _SLOT.sub(sub, template)


def sandbox_defines() -> list[Define]:
    return [
        Define("RESOLVER4", c.RESOLVER4, "the sandbox's resolver, on its own loopback"),
    ]


@dataclass(frozen=True)
class Sidecar:
    """`egressd sidecar`: the resolver runs in the sandbox netns itself, as ``uid``, and
    asks these upstreams (IP, port) from sockets carrying ``c.SIDECAR_MARK``."""

    upstreams: tuple[tuple[str, int], ...]
    uid: int


def render_sandbox(template: str, policy: Policy, sidecar: Sidecar | None = None) -> str:
    """The sandbox netns ruleset for ``policy`` (identical for every sandbox of it).

    With ``sidecar``, one more block accepts the sidecar's own upstream queries; without
    it the slot is empty and the text is what it always was.
    """
    audit = policy.mode is Mode.AUDIT
    defines = sandbox_defines()
    if sidecar is not None:
        defines.append(Define("SIDECAR_MARK", hex(c.SIDECAR_MARK), "egressd sidecar's SO_MARK"))
    checks = policy.connect.check_names
    if checks:
        defines += _check_defines(checks)
    return fill(
        template,
        {
            "mode_note": _mode_note(policy),
            "defines": "\n".join(d.line() for d in defines),
            "sidecar_upstream": "" if sidecar is None else _sidecar_rules(sidecar),
            "first_bytes_chain": _first_bytes_chain(bool(checks)),
            "answer_copy": _answer_copy() if checks else "",
            "first_bytes_verdicts": _first_bytes_verdicts() if checks else "",
            "needs_check": _needs_check() if checks else "",
            "static_rules": _static_rules(policy.connect.allow, audit),
            "audit_connects": _audit_connects() if audit else "",
            "verdict": _verdict(audit),
            "connect_verdict": _verdict(audit, _holds_connects(policy)),
            "held_rules": _held_rules() if not audit and _holds_connects(policy) else "",
            # nft takes no variables in limit and log statements, so these are written out.
            "inline_group": str(c.INLINE_GROUP),
            "observer_group": str(c.OBSERVER_GROUP),
            "log_limit": f"limit rate {c.LOG_RATE} burst {c.LOG_BURST} packets",
            # mode: audit learns from every blocked flow (an address no answer named, a
            # port outside its rule): the inline layer's copy is not rate-limited there.
            "inline_connect_limit": ""
            if audit
            else f"limit rate {c.LOG_RATE} burst {c.LOG_BURST} packets ",
        },
    )


def _sidecar_rules(sidecar: Sidecar) -> str:
    """The sidecar's exception, right after the resolver's rule and before
    ``ct state established``: every packet to an upstream's DNS port must carry the mark
    and the sidecar's uid, or it is foreign DNS. Conntrack alone would not do: the
    workload shares the netns, can see which source port the sidecar just closed
    (/proc/net/udp), bind it and ride the flow's conntrack entry. Answers need no rule:
    they come in, and this table hooks only output."""
    if not sidecar.upstreams:
        raise DatapathError("a sidecar ruleset needs at least one upstream")
    if not 0 <= sidecar.uid < 2**32:
        raise DatapathError(f"sidecar uid {sidecar.uid} is out of range")
    lines = [
        "",
        "\t\t# egressd sidecar: its own upstream DNS queries, and nothing else. Only a socket",
        "\t\t# with this mark (SO_MARK: CAP_NET_ADMIN or CAP_NET_RAW, which the workload lacks)",
        "\t\t# of the sidecar's uid matches; any other UDP packet to that port is foreign DNS,",
        "\t\t# also on an established flow (the workload could reuse a port the sidecar closed).",
    ]
    head = f"\t\tmeta mark $SIDECAR_MARK meta skuid {sidecar.uid}"
    for host, port in dict.fromkeys(sidecar.upstreams):  # in order, once each
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            raise DatapathError(f"sidecar upstream {host!r} is not an IP address") from None
        if not 0 < port < 65536:
            raise DatapathError(f"sidecar upstream port {port} is out of range")
        family = "ip" if address.version == 4 else "ip6"
        to = f"{family} daddr {address}"
        lines.append(f"{head} {to} meta l4proto {{ tcp, udp }} th dport {port} accept")
        # UDP only: a TCP flow can't be joined by another socket, and the kernel answers
        # for the sidecar's closed TCP sockets (TIME_WAIT) with no uid on the packet.
        lines.append(f"\t\t{to} udp dport {port} counter name dropped goto foreign_dns")
    return "\n".join(lines)


def _check_defines(ports: tuple[int, ...]) -> list[Define]:
    return [
        Define("CHECK_PORTS", "{ " + ", ".join(map(str, ports)) + " }",
               "connect.check_names: TCP ports whose flows are bound to names"),
        Define("CT_NEEDS_CHECK", hex(c.CT_NEEDS_CHECK), "conntrack mark: first request unread"),
        Define("CT_CHECKED", hex(c.CT_CHECKED), "conntrack mark: first request judged, passed"),
        Define("CT_READING", hex(c.CT_READING), "conntrack mark: plain HTTP, each request read"),
        Define("QUEUE_MARK", hex(c.QUEUE_MARK), "packet mark: to the inline layer's NFQUEUE"),
        Define("READ_QUEUE_MARK", hex(c.READ_QUEUE_MARK), "packet mark: queued as a read flow's"),
        Define("CHECKED_MARK", hex(c.CHECKED_MARK), "packet mark: the inline layer passed it"),
        Define("READ_MARK", hex(c.READ_MARK), "packet mark: passed, and its flow is read on"),
        Define("REFUSED_MARK", hex(c.REFUSED_MARK), "packet mark: the inline layer refused it"),
    ]  # fmt: skip


# The observer's copy of a queued segment, batched as its DNS copies are (observer.layer
# BATCH: 256, or the kernel's next tick). The inline layer holds the segment and judges it
# first; the observer is the second judge, and its copy is flushed at once with any drop
# (whose log rule has queue-threshold 1, see sandbox.nft), in order. Handed over at once
# instead, the copy woke the observer to race the inline layer, the server and the client
# for the sandbox's CPUs just when the flow waited: on 2 vCPUs that added about 0.1 ms to
# each checked flow's first byte (bench/bench_firstbytes.py, p50 0.21 -> 0.06-0.15 ms).
_SEGMENT_COPY = f'log group {c.OBSERVER_GROUP} prefix "{c.FIRST_BYTES_LOG_PREFIX}"'
_READ_COPY = f'log group {c.OBSERVER_GROUP} prefix "{c.READ_LOG_PREFIX}"'
# Segments with no data stay in the kernel: the IP length is the headers' alone. nft has
# no arithmetic, so each TCP header length (data offset 5-15 words) gets its own rule
# (a set of `ip length . tcp doff` would be shorter, but nft 1.0.6 cannot list it).
_BARE = "\n".join(
    [f"\t\tip hdrlength 5 tcp doff {d} ip length {20 + 4 * d} accept" for d in range(5, 16)]
    + [f"\t\tip6 nexthdr tcp tcp doff {d} ip6 length {4 * d} accept" for d in range(5, 16)]
)


# The template's chains. Loading it again over a table declares them again, which adds
# their rules to the old ones: a reload flushes them first.
CHAINS = (
    "first_bytes", "read_on", "output", "violation", "foreign_dns", "spoofed_source",
    "blocked_connect",
)  # fmt: skip
# The chains an older egress's table may lack (the flush of a missing one fails).
NEWER_CHAINS = (
    f"add chain inet {c.TABLE} first_bytes "
    "{ type filter hook output priority mangle - 10; policy accept; }",
    f"add chain inet {c.TABLE} spoofed_source",
    f"add chain inet {c.TABLE} read_on",
)
# The newest of them: a table without it was loaded by an egress that reads only a flow's
# first request, and an adopter loads this one's rules into it (lifecycle.renew_rules).
NEWEST_CHAIN = "read_on"


def reload_rules(template: str, policy: Policy, sidecar: Sidecar | None = None) -> str:
    """One transaction that replaces a loaded table's rules with ``policy``'s, keeping its
    sets, their elements and its counters (declared again, they stay as they are)."""
    lines = [*NEWER_CHAINS, *(f"flush chain inet {c.TABLE} {chain}" for chain in CHAINS)]
    return "\n".join(lines) + "\n" + render_sandbox(template, policy, sidecar)


_RESYN = "\n".join(
    f"\t\ttcp flags & (syn | ack) == syn {family} daddr . meta l4proto . th dport @{name} "
    "tcp dport $CHECK_PORTS ct mark set $CT_NEEDS_CHECK"
    for family, name in (("ip", c.ALLOW4), ("ip6", c.ALLOW6))
)


def _first_bytes_chain(checks: bool) -> str:
    """Between conntrack (-200) and iptables-nft's mangle OUTPUT (-150), whose NFQUEUE
    rule queues what this chain marks: a checked flow's segments with data, until the
    inline layer has judged its first request. Always there, empty without checks, so
    that a policy swap flushes and refills it like the other chains."""
    if not checks:
        return """
	# (connect.check_names is off: no flow is held for its first bytes)
	counter syn_data {
	}
	chain first_bytes {
		type filter hook output priority mangle - 10; policy accept;
	}
	chain read_on {
	}"""
    return f"""
	# Connections bound to names: a flow marked CT_NEEDS_CHECK (below, in output) has its
	# first segments with data marked for the inline layer's NFQUEUE, which holds them until
	# the TLS SNI or HTTP Host they carry is judged, and copied to the observer.
	counter syn_data {{
	}}
	chain first_bytes {{
		type filter hook output priority mangle - 10; policy accept;
		meta l4proto != tcp accept
		# Every SYN to a checked destination starts unchecked, also when conntrack takes it
		# for an old entry's (a closed connection it keeps a while, a server's reset): the
		# connection it opens is new to the server, and its bytes are read.
{_RESYN}
		tcp flags & syn == 0 ct mark != {{ $CT_NEEDS_CHECK, $CT_READING }} accept
{_BARE}
		# Data in a SYN (TCP Fast Open) would reach the server before any check: dropped, and
		# the client's kernel sends the SYN again without it.
		tcp flags & syn == syn counter name syn_data drop
		ct mark $CT_READING goto read_on
		{_SEGMENT_COPY} meta mark set $QUEUE_MARK
	}}

	# A plain-HTTP flow whose first request passed: each later segment with data is held
	# too, so that every request it carries is read (the queue's rules mark it
	# READ_QUEUE_MARK as they queue it), and copied to the observer as such.
	chain read_on {{
		{_READ_COPY} meta mark set $QUEUE_MARK
	}}"""


def _answer_copy() -> str:
    """The observer binds names to addresses from its own copy of the answers."""
    return (
        "\n\t\t# The resolver's answers, copied to the observer: it binds names to addresses"
        "\n\t\t# from them on its own, to judge a flow's first bytes as the inline layer does."
        '\n\t\toif "lo" ip saddr $RESOLVER4 meta l4proto { tcp, udp } th sport 53 '
        f'log group {c.OBSERVER_GROUP} prefix "{c.ANSWER_LOG_PREFIX}" accept'
    )


def _first_bytes_verdicts() -> str:
    """What the inline layer said of a queued segment: before ``ct state established``,
    which would accept it whatever it carries."""
    return (
        "\n\t\t# Still marked for the queue: re-run by the inline layer (a probe) and its flow"
        "\n\t\t# is checked by now, so the queue's rule let it by; or never queued (no NFQUEUE"
        "\n\t\t# rule): dropped. The others carry the inline layer's verdict."
        "\n\t\tmeta mark $QUEUE_MARK ct mark $CT_CHECKED accept"
        "\n\t\tmeta mark $QUEUE_MARK counter name dropped drop"
        "\n\t\tmeta mark $READ_QUEUE_MARK counter name dropped drop"
        "\n\t\tmeta mark $REFUSED_MARK reject with tcp reset"
        "\n\t\tmeta mark $CHECKED_MARK ct mark set $CT_CHECKED accept"
        "\n\t\tmeta mark $READ_MARK ct mark set $CT_READING accept"
    )


def _needs_check() -> str:
    return (
        "\n\t\t# On connect.check_names' ports a new flow is held at its first data (first_bytes);"
        "\n\t\t# a flow conntrack picked up midway (no SYN) was never read: dropped."
        "\n\t\tip daddr . meta l4proto . th dport @allow4 tcp dport $CHECK_PORTS "
        "tcp flags & (syn | ack) != syn drop"
        "\n\t\tip6 daddr . meta l4proto . th dport @allow6 tcp dport $CHECK_PORTS "
        "tcp flags & (syn | ack) != syn drop"
        "\n\t\tip daddr . meta l4proto . th dport @allow4 tcp dport $CHECK_PORTS "
        "ct mark set $CT_NEEDS_CHECK accept"
        "\n\t\tip6 daddr . meta l4proto . th dport @allow6 tcp dport $CHECK_PORTS "
        "ct mark set $CT_NEEDS_CHECK accept"
    )


def queue_rules() -> tuple[tuple[str, ...], ...]:
    """The iptables-nft rules (after ``-t mangle -A OUTPUT``, in this order), for IPv4 and
    IPv6 alike, that hand what ``first_bytes`` marked to the inline layer's NFQUEUE. No
    ``--queue-bypass``: with no listener the kernel drops the segment (fail closed).

    Each asks conntrack at the moment it queues, and so does a segment the inline layer
    re-runs (NF_REPEAT): one marked before its flow's first request passed comes back as
    what its flow is by then. Checked (TLS): not queued again, it goes by. Read request by
    request (plain HTTP): queued as READ_QUEUE_MARK, a later segment of that connection.
    Unchecked: queued as QUEUE_MARK, a new connection's on the same ports."""
    comment = ("-m", "comment", "--comment", c.FIRST_BYTES_LOG_PREFIX)
    queue = ("-j", "NFQUEUE", "--queue-num", str(c.FIRST_BYTES_QUEUE))
    return (
        ("-m", "mark", "--mark", hex(c.QUEUE_MARK),
         "-m", "connmark", "--mark", hex(c.CT_NEEDS_CHECK), *comment, *queue),
        ("-m", "mark", "--mark", hex(c.QUEUE_MARK),
         "-m", "connmark", "--mark", hex(c.CT_READING), *comment,
         "-j", "MARK", "--set-mark", hex(c.READ_QUEUE_MARK)),
        ("-m", "mark", "--mark", hex(c.READ_QUEUE_MARK),
         "-m", "connmark", "--mark", hex(c.CT_READING), *comment, *queue),
    )  # fmt: skip


def _mode_note(policy: Policy) -> str:
    if policy.mode is Mode.AUDIT:
        return f"policy {policy.name!r} (mode: audit): violations are logged, then accepted."
    return f"policy {policy.name!r} (mode: enforce): violations are logged, then rejected."


def _holds_connects(policy: Policy) -> bool:
    """When a blocked connect freezes the sandbox, its SYN is dropped, not reset: the
    connect stays pending, so the frozen process is caught inside it and its socket can
    still be found (a reset closes it before the freeze lands)."""
    return policy.action(ViolationClass.BLOCKED_CONNECT) is Action.FREEZE


def _held_rules() -> str:
    """A held connect's later SYNs: reset, before the violation chain. Not a new
    violation (the first SYN was logged, journaled and froze the sandbox), so neither
    logged nor counted as a drop."""
    return (
        "\t\tip daddr . tcp dport . tcp sport @held4 reject with tcp reset\n"
        "\t\tip6 daddr . tcp dport . tcp sport @held6 reject with tcp reset"
    )


def _verdict(audit: bool, hold_tcp: bool = False) -> str:
    if audit:
        return "\t\taccept"
    if hold_tcp:  # held once: the flow goes in held4/held6, and its SYN is dropped
        return (
            "\t\tmeta nfproto ipv4 meta l4proto tcp "
            "update @held4 { ip daddr . tcp dport . tcp sport } drop\n"
            "\t\tmeta nfproto ipv6 meta l4proto tcp "
            "update @held6 { ip6 daddr . tcp dport . tcp sport } drop\n"
            "\t\treject with icmpx admin-prohibited"
        )
    # A reset or an ICMP error makes a connect fail at once instead of timing out.
    return "\t\tmeta l4proto tcp reject with tcp reset\n\t\treject with icmpx admin-prohibited"


def _audit_connects() -> str:
    """mode: audit: each new flow to a learned address is logged for `egressctl learn`
    (no verdict here: the rules below still decide). Not rate-limited: a limit that ran
    out would make a learned policy miss a destination, and only a flow's first packet
    gets here (established ones were accepted above)."""
    log = f'log group {c.INLINE_GROUP} prefix "{c.CONNECT_LEARNED_PREFIX}"'
    return (
        "\n\t\t# mode: audit: every new flow to a learned address, for egressctl learn.\n"
        f"\t\tct state new ip daddr . meta l4proto . th dport @allow4 {log}\n"
        f"\t\tct state new ip6 daddr . meta l4proto . th dport @allow6 {log}"
    )


def _static_rules(rules: tuple[CidrRule, ...], audit: bool = False) -> str:
    lines: list[str] = []
    for rule in rules:
        lines.extend(_cidr_lines(rule, audit))
    if not lines:
        return "\t\t# (none)"
    return "\n".join(lines)


def _cidr_lines(rule: CidrRule, audit: bool = False) -> list[str]:
    family = "ip" if rule.network.version == 4 else "ip6"
    head = f"\t\t{family} daddr {rule.network}"
    note = f"  # {rule.describe()} ({rule.where})"
    # audit: logged (a flow's first packet only: established ones were accepted above)
    log = f'log group {c.INLINE_GROUP} prefix "{c.CONNECT_STATIC_PREFIX}" ' if audit else ""
    out = []
    for proto, ranges in (("tcp", rule.ports.tcp), ("udp", rule.ports.udp)):
        if ranges:
            out.append(f"{head} {proto} dport {port_set(ranges)} {log}accept{note}")
    return out


def port_set(ranges: tuple[PortRange, ...]) -> str:
    return "{ " + ", ".join(str(r) for r in ranges) + " }"


PLACEHOLDER_UPLINK = "<uplink-if>"


def render_uplink(
    template: str, uplink_if: str, *, guard4: bool = True, guard6: bool = True
) -> str:
    """The shared uplink table, forwarding and masquerading out of ``uplink_if``.

    ``guard4``/``guard6``: egress turned forwarding on for ``uplink_if`` itself (IPv4
    ``conf.IF.forwarding``, IPv6 ``conf.IF.force_forwarding``; it was off), so that replies
    reach the sandboxes; the guard keeps that from forwarding anything else that enters
    there. Without it (the host forwarded there already) the host's own routing stands.
    """
    defines = [
        Define("UPLINK_IF", f'"{uplink_if}"', "the uplink's default-route device"),
        Define("SANDBOX_MARK", hex(c.SANDBOX_CT_MARK), "conntrack mark of sandbox traffic"),
    ]
    # Table names can't be nft variables, so the name is written out.
    lines = "\n".join(d.line() for d in defines)
    return fill(
        template,
        {"defines": lines, "table": c.UPLINK_TABLE, "uplink_guard": _uplink_guard(guard4, guard6)},
    )


def _uplink_guard(guard4: bool, guard6: bool) -> str:
    if guard4 and guard6:
        match = ""
    elif guard4 or guard6:
        match = f"meta nfproto {'ipv4' if guard4 else 'ipv6'} "
    else:
        return "\t\t# (no guard: the host forwarded on $UPLINK_IF before egress came)"
    return f"\t\t{match}iifname $UPLINK_IF drop"
