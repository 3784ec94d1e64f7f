"""Lab zone files: a small YAML dialect compiled into lookup tables for the lab DNS server.

Why not RFC 1035 master files: the lab needs things master files cannot say (an answer
delay, a raw relay to a tunnel server) and tests write zone files inline, where YAML is
shorter. Parsing walks PyYAML's node graph instead of plain dicts so that every error
carries file:line:col (invariant 7: bad input gets a precise error).

Format::

    zones:
      - zone: lab.test              # the origin
        ttl: 300                    # default TTL of its records
        soa: {minimum: 60}          # optional; minimum is the negative TTL (RFC 2308)
        records:
          "@":       {NS: ns.lab.test}
          allowed:   {A: 203.0.113.10, AAAA: "2001:db8:80::10"}
          big:       {A: [203.0.113.100, 203.0.113.101]}
          short-ttl: {A: 203.0.113.11, ttl: 2}
          slow:      {A: 203.0.113.10, delay: 3}
          "*.wild":  {A: 203.0.113.12}
      - relay: {zone: t.lab.test, to: "127.0.0.1:5353"}

Owner names are relative to the zone ("@" is the apex) unless they end in ".". Names
inside rdata (CNAME, NS, PTR targets) are always absolute, trailing dot optional, because
``{CNAME: allowed.lab.test}`` silently meaning allowed.lab.test.lab.test is a classic trap.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from dnslib import AAAA, CNAME, NS, PTR, QTYPE, RR, SOA, TXT, A

from egress.errors import Location, ZoneFileError

DEFAULT_ZONES_FILE = Path(__file__).with_name("zones.yaml")

# Types whose rdata dnslib parses from zone-file text; A/AAAA/CNAME/NS/PTR/TXT are parsed
# here so their errors can say exactly what is wrong.
_TEXT_TYPES = ("MX", "SRV", "HTTPS", "CAA")
SUPPORTED_TYPES = ("A", "AAAA", "CNAME", "NS", "PTR", "TXT", *_TEXT_TYPES)
MAX_TTL = 2**31 - 1
MAX_DELAY = 60.0
_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")


def fqdn(name: str) -> str:
    """Lower-case ``name`` and give it the trailing dot every table key carries."""
    name = name.lower()
    return name if name.endswith(".") else name + "."


def is_under(name: str, origin: str) -> bool:
    """True when ``name`` equals ``origin`` or lies below it (both fqdn-normalised)."""
    return name == origin or name.endswith("." + origin)


def parent(name: str) -> str:
    """The name one label up; the root is its own parent."""
    _, _, rest = name.partition(".")
    return rest or "."


@dataclass(frozen=True)
class RRSet:
    """All records of one type at one name: they share a TTL."""

    rtype: int
    ttl: int
    rdatas: tuple[Any, ...]


@dataclass(frozen=True)
class Node:
    """One owner name. ``rrsets`` is empty for an empty non-terminal (it exists, no data)."""

    name: str
    rrsets: Mapping[int, RRSet] = field(default_factory=dict)
    delay: float = 0.0


@dataclass(frozen=True)
class Zone:
    """One authoritative zone: its SOA and every owner name in it."""

    origin: str
    soa: RRSet
    negative_ttl: int
    nodes: Mapping[str, Node]
    nonterminals: frozenset[str]

    def lookup(self, name: str) -> Node | None:
        """Find ``name`` (fqdn, lower case), synthesising from a wildcard (RFC 4592)."""
        node = self.nodes.get(name)
        if node is not None:
            return node
        if name in self.nonterminals:
            return Node(name)
        encloser = parent(name)
        while is_under(encloser, self.origin):
            if encloser in self.nodes or encloser in self.nonterminals:
                wild = self.nodes.get("*." + encloser)
                return Node(name, wild.rrsets, wild.delay) if wild else None
            encloser = parent(encloser)
        return None


@dataclass(frozen=True)
class Relay:
    """A zone handed, as raw bytes, to another DNS server (iodined, dns2tcpd)."""

    zone: str
    host: str
    port: int


@dataclass(frozen=True)
class ZoneSet:
    """Everything the lab DNS server answers for or relays."""

    zones: tuple[Zone, ...]
    relays: tuple[Relay, ...] = ()
    source: str = "<zones>"

    def route(self, name: str) -> Zone | Relay | None:
        """The zone or relay with the longest origin enclosing ``name`` (fqdn, lower)."""
        candidates: list[tuple[str, Zone | Relay]] = [(z.origin, z) for z in self.zones]
        candidates += [(r.zone, r) for r in self.relays]
        best: Zone | Relay | None = None
        best_len = -1
        for origin, item in candidates:
            if is_under(name, origin) and len(origin) > best_len:
                best, best_len = item, len(origin)
        return best


def load_zones(path: str | Path) -> ZoneSet:
    """Read and compile a zone file; every problem is a ``ZoneFileError``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ZoneFileError(Location(str(path)), f"cannot read zone file: {exc}") from exc
    return parse_zones(text, str(path))


def parse_zones(text: str, source: str = "<zones>") -> ZoneSet:
    """Compile zone-file text; ``source`` names it in error messages."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = Location(source, mark.line + 1, mark.column + 1) if mark else Location(source)
        raise ZoneFileError(where, f"not valid YAML: {exc.problem or exc.context}") from exc
    except yaml.YAMLError as exc:
        raise ZoneFileError(Location(source), f"not valid YAML: {exc}") from exc
    if root is None:
        raise ZoneFileError(Location(source), "empty zone file: expected a 'zones:' list")
    return _Parser(source).zoneset(root)


class _Parser:
    """Walks the YAML node graph; every error points at the offending node."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, node: yaml.Node, message: str) -> ZoneFileError:
        mark = node.start_mark
        return ZoneFileError(Location(self.source, mark.line + 1, mark.column + 1), message)

    # -- generic node readers ------------------------------------------------------------

    def mapping(
        self, node: yaml.Node, what: str, allowed: tuple[str, ...] | None = None
    ) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, f"{what}: expected a mapping")
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode):
                raise self.fail(key, f"{what}: keys must be plain strings")
            if key.value in out:
                raise self.fail(key, f"{what}: duplicate key {key.value!r}")
            if allowed is not None and key.value not in allowed:
                raise self.fail(
                    key, f"{what}: unknown key {key.value!r} (allowed: {', '.join(allowed)})"
                )
            out[key.value] = (key, value)
        return out

    def scalar(self, node: yaml.Node, what: str) -> str:
        if not isinstance(node, yaml.ScalarNode):
            raise self.fail(node, f"{what}: expected a single value")
        if node.tag == "tag:yaml.org,2002:null":
            raise self.fail(node, f"{what}: missing value")
        return str(node.value)

    def scalars(self, node: yaml.Node, what: str) -> list[tuple[str, yaml.Node]]:
        if isinstance(node, yaml.SequenceNode):
            if not node.value:
                raise self.fail(node, f"{what}: empty list")
            return [(self.scalar(item, what), item) for item in node.value]
        return [(self.scalar(node, what), node)]

    def number(self, node: yaml.Node, what: str, hi: float, integer: bool) -> float:
        text = self.scalar(node, what)
        try:
            value = float(int(text)) if integer else float(text)
        except ValueError:
            kind = "an integer" if integer else "a number"
            raise self.fail(node, f"{what}: {text!r} is not {kind}") from None
        if not 0 <= value <= hi:
            raise self.fail(node, f"{what}: {text} is out of range 0..{hi:g}")
        return value

    def domain(self, node: yaml.Node, what: str, text: str | None = None) -> str:
        text = self.scalar(node, what) if text is None else text
        name = fqdn(text)
        labels = name[:-1].split(".")
        if name == "." or len(name) > 254:
            raise self.fail(node, f"{what}: {text!r} is not a usable domain name")
        for index, label in enumerate(labels):
            if label == "*" and index == 0 and what.startswith("record"):
                continue
            if not _LABEL.match(label):
                raise self.fail(node, f"{what}: bad label {label!r} in {text!r}")
        return name

    # -- the document ----------------------------------------------------------------------

    def zoneset(self, root: yaml.Node) -> ZoneSet:
        top = self.mapping(root, "zone file", ("zones",))
        if "zones" not in top:
            raise self.fail(root, "zone file: missing 'zones:' list")
        items = top["zones"][1]
        if not isinstance(items, yaml.SequenceNode) or not items.value:
            raise self.fail(items, "zones: expected a non-empty list of zone or relay entries")
        zones: list[Zone] = []
        relays: list[Relay] = []
        seen: set[str] = set()
        for item in items.value:
            entry = self.mapping(item, "zones entry", ("zone", "ttl", "soa", "records", "relay"))
            if "relay" in entry:
                if len(entry) != 1:
                    raise self.fail(item, "zones entry: a relay entry has only 'relay:'")
                relays.append(self.relay(entry["relay"][1]))
                origin = relays[-1].zone
            elif "zone" in entry:
                zones.append(self.zone(entry))
                origin = zones[-1].origin
            else:
                raise self.fail(item, "zones entry: needs 'zone:' or 'relay:'")
            if origin in seen:
                raise self.fail(item, f"zone {origin} is defined twice (as a zone or a relay)")
            seen.add(origin)
        self.check_hidden(zones, relays)
        return ZoneSet(tuple(zones), tuple(relays), self.source)

    def relay(self, node: yaml.Node) -> Relay:
        body = self.mapping(node, "relay", ("zone", "to"))
        for needed in ("zone", "to"):
            if needed not in body:
                raise self.fail(node, f"relay: missing '{needed}:'")
        zone = self.domain(body["zone"][1], "relay zone")
        to_node = body["to"][1]
        host, port = parse_hostport(self.scalar(to_node, "relay to"))
        if not host:
            raise self.fail(to_node, f"relay to: {port} (expected 'IP:PORT' or '[IPv6]:PORT')")
        return Relay(zone, host, int(port))

    def zone(self, entry: dict[str, tuple[yaml.Node, yaml.Node]]) -> Zone:
        origin = self.domain(entry["zone"][1], "zone")
        ttl = int(self.number(entry["ttl"][1], "ttl", MAX_TTL, True)) if "ttl" in entry else 300
        soa_node = entry["soa"][1] if "soa" in entry else None
        soa, negative_ttl = self.soa(soa_node, origin, ttl)
        nodes: dict[str, Node] = {}
        if "records" in entry:
            for key, body in self.mapping(entry["records"][1], f"zone {origin} records").values():
                node = self.record(key, body, origin, ttl)
                if node.name in nodes:
                    raise self.fail(key, f"record {key.value!r}: {node.name} is already defined")
                nodes[node.name] = node
        nodes[origin] = self.apex(nodes.get(origin), origin, soa)
        nonterminals = frozenset(
            anc for name in nodes for anc in _ancestors(name, origin) if anc not in nodes
        )
        return Zone(origin, soa, negative_ttl, nodes, nonterminals)

    def soa(self, node: yaml.Node | None, origin: str, ttl: int) -> tuple[RRSet, int]:
        fields = ("mname", "rname", "serial", "refresh", "retry", "expire", "minimum")
        body = self.mapping(node, "soa", fields) if node is not None else {}
        names = {"mname": "ns." + origin, "rname": "hostmaster." + origin}
        for key in ("mname", "rname"):
            if key in body:
                names[key] = self.domain(body[key][1], f"soa {key}")
        times = {"serial": 1, "refresh": 3600, "retry": 600, "expire": 86400, "minimum": 60}
        for key in times:
            if key in body:
                times[key] = int(self.number(body[key][1], f"soa {key}", 2**32 - 1, True))
        rdata = SOA(names["mname"], names["rname"], tuple(times.values()))
        # RFC 2308 section 5: negative answers are cached for min(SOA TTL, SOA minimum).
        return RRSet(QTYPE.SOA, ttl, (rdata,)), min(ttl, times["minimum"])

    def apex(self, node: Node | None, origin: str, soa: RRSet) -> Node:
        rrsets = dict(node.rrsets) if node else {}
        if QTYPE.CNAME in rrsets:
            raise ZoneFileError(Location(self.source), f"zone {origin}: CNAME at the apex")
        rrsets[QTYPE.SOA] = soa
        # Resolvers expect NS at the apex; default to the SOA's primary server.
        rrsets.setdefault(QTYPE.NS, RRSet(QTYPE.NS, soa.ttl, (NS(soa.rdatas[0].mname),)))
        return Node(origin, rrsets, node.delay if node else 0.0)

    def record(self, key: yaml.Node, body: yaml.Node, origin: str, ttl: int) -> Node:
        owner = self.owner(key, origin)
        what = f"record {key.value!r}"
        fields = self.mapping(body, what)
        if "ttl" in fields:
            ttl = int(self.number(fields.pop("ttl")[1], f"{what} ttl", MAX_TTL, True))
        delay = 0.0
        if "delay" in fields:
            delay = self.number(fields.pop("delay")[1], f"{what} delay", MAX_DELAY, False)
        rrsets: dict[int, RRSet] = {}
        for rtype_text, (type_key, value) in fields.items():
            rtype = rtype_text.upper()
            if rtype not in SUPPORTED_TYPES:
                raise self.fail(
                    type_key,
                    f"{what}: unknown key or record type {rtype_text!r} "
                    f"(types: {', '.join(SUPPORTED_TYPES)}; keys: ttl, delay)",
                )
            if getattr(QTYPE, rtype) in rrsets:
                raise self.fail(type_key, f"{what}: {rtype} given twice")
            values = self.scalars(value, f"{what} {rtype}")
            rdatas = tuple(self.rdata(rtype, text, node, what) for text, node in values)
            rrsets[getattr(QTYPE, rtype)] = RRSet(getattr(QTYPE, rtype), ttl, rdatas)
        if not rrsets:
            raise self.fail(body, f"{what}: no records (give at least one type, e.g. A: ...)")
        cname = rrsets.get(QTYPE.CNAME)
        if cname and (len(rrsets) > 1 or len(cname.rdatas) > 1):
            raise self.fail(body, f"{what}: a CNAME must be the only record at its name")
        return Node(owner, rrsets, delay)

    def owner(self, key: yaml.Node, origin: str) -> str:
        text = str(key.value)
        if text == "@":
            return origin
        if text.endswith("."):
            name = self.domain(key, f"record {text!r}", text)
            if not is_under(name, origin):
                raise self.fail(key, f"record {text!r}: not inside zone {origin}")
            return name
        return self.domain(key, f"record {text!r}", f"{text}.{origin}")

    def rdata(self, rtype: str, text: str, node: yaml.Node, what: str) -> Any:
        builder = _RDATA.get(rtype)
        if builder is not None:
            try:
                return builder(text)
            except ValueError as exc:
                raise self.fail(node, f"{what}: {rtype} value {text!r}: {exc}") from None
        if rtype in ("CNAME", "NS", "PTR"):
            target = self.domain(node, f"{what} {rtype}", text)
            return {"CNAME": CNAME, "NS": NS, "PTR": PTR}[rtype](target)
        try:
            return RR.fromZone(f". 0 IN {rtype} {text}")[0].rdata
        except IndexError:  # dnslib's way of saying "ran out of fields"
            raise self.fail(node, f"{what}: bad {rtype} value {text!r} (missing fields)") from None
        except Exception as exc:  # dnslib raises anything from ValueError to DNSError
            raise self.fail(node, f"{what}: bad {rtype} value {text!r} ({exc})") from None

    def check_hidden(self, zones: list[Zone], relays: list[Relay]) -> None:
        for relay in relays:
            for zone in zones:
                hidden = [n for n in zone.nodes if is_under(n, relay.zone)]
                if hidden:
                    raise ZoneFileError(
                        Location(self.source),
                        f"record {hidden[0]} in zone {zone.origin} is hidden by relay "
                        f"{relay.zone} (queries there go to {relay.host}:{relay.port})",
                    )


def _ancestors(name: str, origin: str) -> list[str]:
    out = []
    while name != origin and is_under(name, origin):
        name = parent(name)
        out.append(name)
    return out


def _ipv4(text: str) -> Any:
    try:
        return A(list(ipaddress.IPv4Address(text).packed))
    except ipaddress.AddressValueError:
        raise ValueError("not an IPv4 address") from None


def _ipv6(text: str) -> Any:
    # Packed bytes, because dnslib's own parser rejects ::ffff:127.0.0.1 notation.
    try:
        return AAAA(list(ipaddress.IPv6Address(text).packed))
    except ipaddress.AddressValueError:
        raise ValueError("not an IPv6 address") from None


def _txt(text: str) -> Any:
    data = text.encode("utf-8")
    # A TXT character-string holds 255 bytes; longer text becomes several strings.
    return TXT([data[i : i + 255] for i in range(0, len(data), 255)] or [b""])


_RDATA: dict[str, Callable[[str], Any]] = {"A": _ipv4, "AAAA": _ipv6, "TXT": _txt}


def parse_hostport(text: str) -> tuple[str, str]:
    """Split 'IP:PORT' / '[IPv6]:PORT' into (ip, port); on error ('', reason)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        return "", f"{text!r} has no port"
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return "", f"{host!r} is not an IP address"
    if not (len(port) <= 5 and port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        return "", f"{port!r} is not a port"
    return str(addr), port
