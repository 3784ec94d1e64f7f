"""Frozen dataclasses shared by every layer: the compiled form of a policy.

Nothing here parses or does I/O; ``egress.policy`` builds these from YAML and the
other layers only read them.
"""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass, field

from egress.errors import Location

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class Mode(enum.Enum):
    ENFORCE = "enforce"
    AUDIT = "audit"


class Layer(enum.StrEnum):
    """The two freeze layers (DESIGN.md invariant 4): who saw a violation."""

    INLINE = "inline"  # the resolver and its NFLOG reader
    OBSERVER = "observer"  # the separate process that trusts nothing the inline says


class SandboxState(enum.StrEnum):
    """A sandbox's state in the journal's sandboxes table."""

    RUNNING = "running"
    FROZEN = "frozen"
    EXITED = "exited"


class SandboxKind(enum.StrEnum):
    """Who made a served sandbox's netns and cgroup."""

    CREATED = "created"  # egress: netns, veth, cgroup, address claim
    ATTACHED = "attached"  # another runtime (a container, a pod); egress adds rules only


class ReviewAction(enum.StrEnum):
    """What a person (or the decision timeout) decides for a frozen sandbox."""

    RESUME = "resume"
    KILL = "kill"


class Action(enum.Enum):
    """What happens on a violation of a class."""

    FREEZE = "freeze"
    BLOCK = "block"
    LOG = "log"


class ViolationClass(enum.Enum):
    BLOCKED_CONNECT = "blocked_connect"
    DENIED_NAME = "denied_name"
    DENIED_TYPE = "denied_type"
    TUNNEL = "tunnel"
    FOREIGN_DNS = "foreign_dns"
    REBINDING = "rebinding"
    LAYER_LOSS = "layer_loss"
    # A checked TCP flow's first bytes (TLS SNI, HTTP Host) named no name that put its
    # address into this sandbox's sets, or could not be read (resolver.flows).
    NAME_MISMATCH = "name_mismatch"
    # A packet from an address that is not the sandbox's own (an IPv6 socket may bind any):
    # always dropped, in audit mode too; the action says whether it freezes.
    SPOOFED_SOURCE = "spoofed_source"


DEFAULT_ACTIONS: dict[ViolationClass, Action] = {
    ViolationClass.BLOCKED_CONNECT: Action.FREEZE,
    ViolationClass.DENIED_NAME: Action.BLOCK,
    ViolationClass.DENIED_TYPE: Action.BLOCK,
    ViolationClass.TUNNEL: Action.FREEZE,
    ViolationClass.FOREIGN_DNS: Action.FREEZE,
    ViolationClass.REBINDING: Action.BLOCK,
    ViolationClass.LAYER_LOSS: Action.FREEZE,
    ViolationClass.NAME_MISMATCH: Action.FREEZE,
    ViolationClass.SPOOFED_SOURCE: Action.FREEZE,
}


class PatternKind(enum.Enum):
    EXACT = "exact"  # pypi.org
    ONE = "one"  # *.pythonhosted.org: exactly one more label
    MANY = "many"  # **.githubusercontent.com: one or more labels


@dataclass(frozen=True)
class NamePattern:
    kind: PatternKind
    suffix: str  # lowercase ASCII (punycode), no trailing dot
    text: str  # as written in the policy

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class PortRange:
    first: int
    last: int

    def __str__(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


@dataclass(frozen=True)
class Ports:
    """Destination ports per transport; an empty tuple means none of that transport."""

    tcp: tuple[PortRange, ...] = ()
    udp: tuple[PortRange, ...] = ()

    def is_empty(self) -> bool:
        return not self.tcp and not self.udp

    def allows(self, proto: str, port: int) -> bool:
        """``port`` of ``proto`` (tcp, udp; anything else: none) is in these ranges."""
        ranges = self.tcp if proto == "tcp" else self.udp if proto == "udp" else ()
        return any(r.first <= port <= r.last for r in ranges)


@dataclass(frozen=True)
class DnsRule:
    """One entry of ``spec.dns.allow``."""

    index: int
    pattern: NamePattern
    types: frozenset[int]  # record type numbers this rule allows
    explicit_types: frozenset[int]  # types the rule itself named (not inherited defaults)
    ports: Ports  # where IPs learned through this rule may be reached
    where: Location
    # A TCP flow to an address this rule's answers gave, on one of connect.check_names'
    # ports, must ask for a name that answer named (TLS SNI, HTTP Host). False: this
    # rule's addresses are reached unread.
    check_names: bool = True

    def describe(self) -> str:
        return f"dns.allow[{self.index}] {self.pattern.text}"


@dataclass(frozen=True)
class CidrRule:
    """One entry of ``spec.connect.allow``: a static destination that needs no DNS."""

    index: int
    network: IPNetwork
    ports: Ports
    where: Location

    def describe(self) -> str:
        return f"connect.allow[{self.index}] {self.network}"


@dataclass(frozen=True)
class Upstream:
    """An upstream DNS server; ``system`` means the host's resolv.conf at start time."""

    host: str | None  # None for "system"
    port: int = 53

    @property
    def is_system(self) -> bool:
        return self.host is None

    def __str__(self) -> str:
        if self.host is None:
            return "system"
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"


class DeniedResponse(enum.Enum):
    NXDOMAIN = "nxdomain"
    REFUSED = "refused"


@dataclass(frozen=True)
class RateLimit:
    """Queries per sandbox its resolver answers: ``qps`` sustained, ``burst`` at once.

    The defaults leave any real workload alone: ``npm install`` or ``pip install`` of a
    large project resolves a few hundred names within a second or two, each asked as A
    and AAAA (and retried by stubs), so up to ~1,000 at once; no build tool keeps up 500
    a second. A flood above it still gets 500 answers a second, a fraction of one core
    (cache hits run at over 150,000 a second), and the rest costs one ``recvfrom`` each.
    """

    qps: int = 500  # tokens gained per second
    burst: int = 1000  # most tokens saved up


@dataclass(frozen=True)
class DnsSpec:
    upstreams: tuple[Upstream, ...]
    types: frozenset[int]
    ttl_min: int  # seconds
    ttl_max: int  # seconds
    rebinding_deny: bool
    rebinding_exempt: tuple[IPNetwork, ...]
    denied_response: DeniedResponse
    allow: tuple[DnsRule, ...]
    rate_limit: RateLimit = RateLimit()


DEFAULT_CHECK_PORTS = (80, 443)  # HTTP and HTTPS: the ports a CDN's names share


@dataclass(frozen=True)
class ConnectSpec:
    ports: Ports  # default ports for IPs learned from DNS
    allow: tuple[CidrRule, ...]
    # TCP ports on which a flow to a DNS-learned address is held until its first bytes
    # name a name that resolved to it (resolver.flows); empty: no flow is checked.
    check_names: tuple[int, ...] = DEFAULT_CHECK_PORTS


@dataclass(frozen=True)
class TunnelZoneOverride:
    """Per-zone tuning of the tunnel scorer; ``zone`` is a registered domain or a parent of one."""

    zone: str  # lowercase, no trailing dot: "mcafee.com" also covers "gti.mcafee.com"
    exempt: bool = False  # never score this zone (e.g. an AV vendor's DNS hash lookups)
    limit_scale: float = 1.0  # multiply every zone limit by this (raised limits: > 1)


# The most ``TunnelSpec.zone_free_bytes`` may be: what the scorer keeps of an evicted zone's
# use of it is whole bytes in 16 bits (``egress.tunnel.window.Spent``).
MAX_ZONE_FREE_BYTES = 65_535


@dataclass(frozen=True)
class TunnelSpec:
    """DNS-tunnel scorer thresholds (``egress.tunnel``); defaults catch iodine/dns2tcp early."""

    enabled: bool = True
    window_s: float = 30.0  # fast sliding window
    slow_window_s: float = 3600.0  # slow-channel window
    name_score: float = 3.0  # a query name scoring at least this is "tunnel-shaped"
    shaped_names: int = 3  # tunnel-shaped unique names per zone per window
    long_text_bytes: int = 768  # unique text of long names (label >= 40 or subdomain >= 64)
    info_bytes: int = 512  # information estimate of unique subdomain text per window
    text_bytes: int = 1536  # raw unique subdomain text per window
    data_type_names: int = 4  # unique names asked with data-only types (TXT counts 1/4)
    names: int = 256  # unique names (subdomains, case-folded) per zone per window
    name_info_bytes: int = 384  # information in new names, priced as an adaptive code
    slow_names: int = 512  # unique names per slow window
    slow_name_info_bytes: int = 2048  # information in new names per slow window (not
    # scaled by sandbox_scale for the sum: the slow budget is per sandbox)
    slow_info_bytes: int = 1024  # information estimate per slow window
    slow_text_bytes: int = 3072  # raw unique subdomain text per slow window
    nx_ratio: float = 0.5  # NXDOMAIN/REFUSED share that halves the information limits ...
    nx_min_responses: int = 16  # ... once the zone has had this many responses
    sandbox_scale: float = 2.0  # limits for the sum over all zones, relative to one zone's
    zone_free_bytes: int = 48  # a zone's name information per window the sum leaves out
    max_zones: int = 256  # zones tracked per sandbox (bounded memory)
    zones: tuple[TunnelZoneOverride, ...] = ()
    # The sandbox's resolver search list, where a container runtime gives it one: a name
    # asked again under one of them is scored as the name itself.
    search_domains: tuple[str, ...] = ()


# The fewest bytes ``Limits.memory`` may be: bubblewrap, tini and an interpreter start in
# about 10 MiB; below this a workload is killed before it runs a line.
MIN_MEMORY = 32 * 1024 * 1024


@dataclass(frozen=True)
class Limits:
    """What a sandbox egress makes may hold at once, enforced by its cgroup: a fork or
    memory bomb inside stays inside (the kernel refuses the fork; its OOM killer picks
    among the sandbox's processes) instead of taking the host, and the layers that must
    freeze it, down with it. None: no limit. A sandbox egress attaches to (a container,
    a pod) has its runtime's cgroup and limits; egress leaves those alone.

    2,048 tasks, podman's default, leaves a parallel build alone (``make -j``, cargo,
    npm and a JVM start a few hundred processes and threads); each task holds at least
    its kernel stack and task struct (~30 KiB), a process its page tables too, so a
    fork bomb at the limit costs the host some 60-250 MiB until it is frozen or killed.
    All sandboxes together get at most 3/4 of the host's tasks and memory (the parent
    cgroup's caps, ``kernel.cgroup``)."""

    pids: int | None = 2048  # processes and threads at once
    memory: int | None = None  # bytes of RAM (its private /tmp is RAM too) and swap
    # The keys the policy wrote: a default the host has no controller for is said and
    # left out; a limit the policy names is never silently dropped.
    explicit: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Policy:
    name: str
    source: str  # file the policy came from, or "<embedded>"
    mode: Mode
    dns: DnsSpec
    connect: ConnectSpec
    tunnel: TunnelSpec
    violations: dict[ViolationClass, Action] = field(hash=False)
    limits: Limits = Limits()
    # metadata.annotations: what other tools keep with a policy (egressctl import cilium
    # keeps the endpoint selector there, so export can give it back); egress reads none.
    annotations: tuple[tuple[str, str], ...] = ()

    def action(self, cls: ViolationClass) -> Action:
        return self.violations.get(cls, DEFAULT_ACTIONS[cls])


@dataclass(frozen=True)
class Flow:
    """A packet's 5-tuple (ICMP: ports are the type and code)."""

    proto: str  # tcp | udp | icmp | icmpv6 | a protocol number
    src: str
    dst: str
    sport: int | None = None
    dport: int | None = None

    def __str__(self) -> str:
        if self.proto.startswith("icmp"):
            return f"{self.proto} type {self.sport} code {self.dport} {self.src} -> {self.dst}"
        if self.sport is None or self.dport is None:
            return f"{self.proto} {self.src} -> {self.dst}"
        return (
            f"{self.proto} {_hostport(self.src, self.sport)} -> {_hostport(self.dst, self.dport)}"
        )


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, kw_only=True)
class Violation:
    """One thing a sandbox tried that its policy does not allow, with its evidence."""

    cls: ViolationClass
    layer: str  # a Layer
    rule: str  # the rule that decided, or why none did
    detail: str  # what happened, for a person
    at: float  # unix time the layer saw it
    action: Action
    flow: Flow | None = None
    uid: int | None = None
    qname: str | None = None
    qtype: str | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "class": self.cls.value,
            "layer": self.layer,
            "rule": self.rule,
            "detail": self.detail,
            "at": self.at,
            "action": self.action.value,
        }
        if self.flow is not None:
            f = self.flow
            out["flow"] = {
                "proto": f.proto, "src": f.src, "sport": f.sport, "dst": f.dst, "dport": f.dport,
            }  # fmt: skip
        for key in ("uid", "qname", "qtype"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Violation:
        """``to_json``'s inverse (a freeze intent read back, store/intents.py); KeyError,
        TypeError or ValueError when ``data`` is not one."""
        f = data.get("flow")
        flow = None
        if isinstance(f, dict):
            sport, dport = _opt_int(f.get("sport")), _opt_int(f.get("dport"))
            flow = Flow(str(f["proto"]), str(f["src"]), str(f["dst"]), sport, dport)
        return cls(
            cls=ViolationClass(data["class"]),
            layer=str(data["layer"]),
            rule=str(data["rule"]),
            detail=str(data["detail"]),
            at=float(data["at"]),  # type: ignore[arg-type]
            action=Action(data["action"]),
            flow=flow,
            uid=_opt_int(data.get("uid")),
            qname=None if data.get("qname") is None else str(data["qname"]),
            qtype=None if data.get("qtype") is None else str(data["qtype"]),
        )


def _opt_int(value: object) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int):
        raise TypeError(f"expected an integer, not {value!r}")
    return value
