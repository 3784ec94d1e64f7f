"""The lab's zone files and answers, without sockets or root.

Zone-file errors must name file:line:col and the problem (tests and demos write zone
files by hand); the answer logic must behave like a real authoritative server, because the
resolver under test is only as well tested as the server it talks to is realistic.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from dnslib import EDNS0, QTYPE, DNSRecord

from egress.lab import (
    DEFAULT_ZONES_FILE,
    ZoneFileError,
    dnsmsg,
    load_zones,
    parse_zones,
    topology,
)
from egress.lab.authority import answer, encode
from egress.lab.querylog import entry, read_query_log
from egress.lab.zones import Relay, Zone, ZoneSet, parse_hostport

ZONES = load_zones(DEFAULT_ZONES_FILE)


def ask(name: str, qtype: str = "A", zones: ZoneSet = ZONES, edns: int | None = None) -> DNSRecord:
    request = DNSRecord.question(name, qtype)
    if edns is not None:
        request.add_ar(EDNS0(udp_len=edns))
    return DNSRecord.parse(encode(answer(zones, request), request, udp=True))


def rdatas(reply: DNSRecord) -> list[str]:
    return [str(rr.rdata) for rr in reply.rr]


# -- the default zone file ------------------------------------------------------------------


def test_default_zone_file_ships_inside_the_package() -> None:
    assert DEFAULT_ZONES_FILE.parent == Path(topology.__file__).parent
    assert [z.origin for z in ZONES.zones] == ["lab.test.", "evil.test."]
    assert {r.zone for r in ZONES.relays} == {"t.lab.test.", "d.lab.test."}


def test_rebinding_targets_are_not_lab_server_addresses() -> None:
    served = {topology.DNS4, topology.DNS6, *topology.HTTP4, *topology.HTTP6}
    assert rdatas(ask("allowed.lab.test"))[0] in served
    for name, qtype in [("meta", "A"), ("loop", "A"), ("ten", "A"), ("ll6", "AAAA")]:
        (value,) = rdatas(ask(f"{name}.lab.test", qtype))
        assert value not in served
    assert rdatas(ask("mapped.lab.test", "AAAA")) == ["::ffff:7f00:1"]  # dnslib's spelling


# -- answers --------------------------------------------------------------------------------


def test_positive_answer_is_authoritative_without_recursion() -> None:
    reply = ask("allowed.lab.test", "AAAA")
    assert rdatas(reply) == ["2001:db8:80::10"]
    assert (reply.header.aa, reply.header.ra, reply.header.rcode) == (1, 0, 0)


def test_owner_name_keeps_the_askers_case() -> None:
    assert str(ask("AlLoWeD.lab.test").rr[0].rname) == "AlLoWeD.lab.test."


def test_cname_chain_across_zones_and_to_nowhere() -> None:
    chain = ask("alias-chain.lab.test")
    assert rdatas(chain) == ["alias-ok.lab.test.", "allowed.lab.test.", "203.0.113.10"]
    evil = ask("alias-evil.lab.test")
    assert rdatas(evil) == ["allowed.lab.test.evil.test.", "198.51.100.11"]
    dangling = ask("alias-dangling.lab.test")
    assert dangling.header.rcode == 3 and len(dangling.rr) == 1 and dangling.auth


def test_cname_query_returns_only_the_cname() -> None:
    assert rdatas(ask("alias-ok.lab.test", "CNAME")) == ["allowed.lab.test."]


def test_nxdomain_and_nodata_carry_the_soa_with_the_negative_ttl() -> None:
    for name, qtype, rcode in [("nope.lab.test", "A", 3), ("allowed.lab.test", "MX", 0)]:
        reply = ask(name, qtype)
        assert reply.header.rcode == rcode and not reply.rr
        (soa,) = reply.auth
        assert soa.rtype == QTYPE.SOA and str(soa.rname) == "lab.test." and soa.ttl == 60


def test_empty_non_terminal_is_nodata_not_nxdomain() -> None:
    assert ask("wild.lab.test").header.rcode == 0
    assert ask("_tcp.lab.test", "SRV").header.rcode == 0


def test_outside_every_zone_is_refused_without_aa() -> None:
    reply = ask("example.com")
    assert reply.header.rcode == 5 and reply.header.aa == 0 and not reply.auth


def test_wildcard_synthesises_at_any_depth_but_not_over_real_names() -> None:
    assert rdatas(ask("a.b.c.wild.lab.test")) == ["203.0.113.12"]
    assert str(ask("x.wild.lab.test").rr[0].rname) == "x.wild.lab.test."
    zones = parse_zones(
        "zones:\n  - zone: w.test\n    records:\n"
        '      "*": {A: 203.0.113.12}\n'
        "      real: {A: 203.0.113.13}\n"
        "      a.deep: {A: 203.0.113.14}\n"
    )
    assert rdatas(ask("real.w.test", zones=zones)) == ["203.0.113.13"]
    assert rdatas(ask("other.w.test", zones=zones)) == ["203.0.113.12"]
    # deep.w.test exists (empty non-terminal): the wildcard does not apply below it.
    assert ask("b.deep.w.test", zones=zones).header.rcode == 3


def test_big_answer_truncates_without_edns_and_fits_with_it() -> None:
    truncated = ask("big.lab.test")
    assert truncated.header.tc == 1 and not truncated.rr and truncated.q.qname == "big.lab.test."
    full = ask("big.lab.test", edns=1232)
    assert full.header.tc == 0 and len(full.rr) == 40
    request = DNSRecord.question("big.lab.test", "TXT")
    over_tcp = DNSRecord.parse(encode(answer(ZONES, request), request, udp=False))
    assert len(over_tcp.rr) == 4 and len(over_tcp.pack()) > 512


def test_per_record_ttl_delay_and_types() -> None:
    assert ask("short-ttl.lab.test").rr[0].ttl == 2
    request = DNSRecord.question("slow.lab.test")
    assert answer(ZONES, request).delay == 3
    assert answer(ZONES, DNSRecord.question("allowed.lab.test")).delay == 0
    assert rdatas(ask("mx.lab.test", "MX")) == ["10 mail.lab.test."]
    assert "alpn=h2,http/1.1" in rdatas(ask("https.lab.test", "HTTPS"))[0]
    assert rdatas(ask("_http._tcp.lab.test", "SRV")) == ["0 5 80 allowed.lab.test."]
    assert rdatas(ask("mixed.lab.test")) == ["203.0.113.10", "10.1.2.3"]


def test_apex_has_soa_and_ns() -> None:
    assert rdatas(ask("lab.test", "NS")) == ["ns.lab.test."]
    assert ask("lab.test", "SOA").rr[0].rtype == QTYPE.SOA


def test_relay_zones_route_by_longest_suffix() -> None:
    assert isinstance(ZONES.route("x.y.t.lab.test."), Relay)
    assert isinstance(ZONES.route("t.lab.test."), Relay)
    assert isinstance(ZONES.route("xt.lab.test."), Zone)
    assert ZONES.route("lab.test.example.") is None


def test_opcode_other_than_query_is_notimp() -> None:
    request = DNSRecord.question("allowed.lab.test")
    request.header.opcode = 2
    assert answer(ZONES, request).reply.header.rcode == 4


# -- zone file errors -----------------------------------------------------------------------


def one_zone(records: str, extra: str = "") -> str:
    return f"zones:\n  - zone: x.test\n{extra}    records:\n{records}"


@pytest.mark.parametrize(
    ("text", "where", "message"),
    [
        ("", ":", "empty zone file"),
        ("zones: [\n", ":2:1", "not valid YAML"),
        ("zonez: []\n", ":1:1", "unknown key 'zonez'"),
        ("zones: []\n", ":1:8", "non-empty list"),
        ("zones:\n  - ttl: 3\n", ":2:5", "needs 'zone:' or 'relay:'"),
        (one_zone("      a: {A: 300.1.1.1}\n"), ":4:14", "A value '300.1.1.1': not an IPv4"),
        (one_zone("      a: {AAAA: 203.0.113.1}\n"), ":4:17", "not an IPv6 address"),
        (one_zone("      a: {A: [1.2.3.4, nope]}\n"), ":4:24", "'nope': not an IPv4"),
        (one_zone("      a: {A: []}\n"), ":4:14", "empty list"),
        (one_zone("      a: {A: }\n"), ":4:13", "missing value"),
        (one_zone("      a: {A: 1.2.3.4}\n      a: {A: 1.2.3.5}\n"), ":5:7", "duplicate key 'a'"),
        (one_zone("      a: {CNAME: b.x.test, A: 1.2.3.4}\n"), ":4:10", "only record"),
        (one_zone("      a: {CNAME: [b.x.test, c.x.test]}\n"), ":4:10", "only record"),
        (one_zone("      a: {BOGUS: 1}\n"), ":4:11", "unknown key or record type 'BOGUS'"),
        (one_zone("      a: {A: 1.2.3.4, ttl: -1}\n"), ":4:28", "out of range"),
        (one_zone("      a: {A: 1.2.3.4, ttl: soon}\n"), ":4:28", "'soon' is not an integer"),
        (one_zone("      a: {A: 1.2.3.4, delay: 99}\n"), ":4:30", "out of range 0..60"),
        (
            one_zone("      a: {MX: nonsense}\n"),
            ":4:15",
            "bad MX value 'nonsense' (missing fields)",
        ),
        (one_zone("      a: {ttl: 5}\n"), ":4:10", "no records"),
        (one_zone("      a.y.test.: {A: 1.2.3.4}\n"), ":4:7", "not inside zone x.test."),
        (one_zone("      bad_label!: {A: 1.2.3.4}\n"), ":4:7", "bad label 'bad_label!'"),
        (one_zone("      a.*: {A: 1.2.3.4}\n"), ":4:7", "bad label '*'"),
        (one_zone("      a: {CNAME: 'has space.x.test'}\n"), ":4:18", "bad label 'has space'"),
        (
            one_zone("      a: {A: 1.2.3.4}\n", "    soa: {minimum: x}\n"),
            ":3:20",
            "'x' is not an integer",
        ),
        (one_zone("      a: {A: 1.2.3.4}\n", "    colour: red\n"), ":3:5", "unknown key 'colour'"),
        ("zones:\n  - relay: {zone: t.x.test}\n", ":2:12", "missing 'to:'"),
        (
            "zones:\n  - relay: {zone: t.test, to: 'host:53'}\n",
            ":2:31",
            "'host' is not an IP address",
        ),
        ("zones:\n  - relay: {zone: t.test, to: '127.0.0.1'}\n", ":2:31", "has no port"),
        ("zones:\n  - relay: {zone: t.test, to: '1.2.3.4:0'}\n", ":2:31", "'0' is not a port"),
        ("zones:\n  - relay: {zone: t.test, to: '1.2.3.4:²'}\n", ":2:31", "'²' is not a port"),
        (
            "zones:\n  - relay: {zone: t.test, to: '1.2.3.4:" + "9" * 4301 + "'}\n",
            ":2:31",
            "is not a port",
        ),
        ("zones:\n  - relay: {zone: t.test, to: '1.2.3.4:5'}\n    ttl: 3\n", ":2:5", "only"),
        (
            "zones:\n  - zone: x.test\n  - relay: {zone: X.test., to: '[::1]:53'}\n",
            ":3:5",
            "zone x.test. is defined twice",
        ),
        (
            one_zone("      a.t: {A: 1.2.3.4}\n")
            + "  - relay: {zone: t.x.test, to: '127.0.0.1:5353'}\n",
            "",
            "record a.t.x.test. in zone x.test. is hidden by relay t.x.test.",
        ),
    ],
)
def test_bad_zone_files_get_precise_errors(text: str, where: str, message: str) -> None:
    with pytest.raises(ZoneFileError) as caught:
        parse_zones(text, "z.yaml")
    assert str(caught.value).startswith(f"z.yaml{where}"), str(caught.value)
    assert message in str(caught.value)


def test_unreadable_zone_file(tmp_path: Path) -> None:
    with pytest.raises(ZoneFileError, match="cannot read zone file"):
        load_zones(tmp_path / "missing.yaml")


def test_good_small_zone_file_with_every_feature(tmp_path: Path) -> None:
    path = tmp_path / "z.yaml"
    path.write_text(
        "zones:\n"
        "  - zone: Example.Test.\n"
        "    ttl: 30\n"
        "    soa: {mname: ns1.example.test, rname: me.example.test, serial: 7, minimum: 10}\n"
        "    records:\n"
        "      '@': {A: 203.0.113.10, TXT: [one, two]}\n"
        "      www.example.test.: {CNAME: example.test, ttl: 5}\n"
        "      '*.any': {AAAA: '2001:db8:80::10', delay: 0.5}\n"
        "      t: {TXT: " + "x" * 300 + "}\n"
        "  - relay: {zone: tun.example.test, to: '[2001:db8::1]:5300'}\n"
    )
    zones = load_zones(path)
    (zone,) = zones.zones
    assert zone.origin == "example.test." and zone.negative_ttl == 10
    assert zones.relays == (Relay("tun.example.test.", "2001:db8::1", 5300),)
    assert rdatas(ask("www.example.test", zones=zones)) == ["example.test.", "203.0.113.10"]
    assert ask("www.example.test", zones=zones).rr[0].ttl == 5
    assert answer(zones, DNSRecord.question("q.any.example.test", "AAAA")).delay == 0.5
    long_txt = ask("t.example.test", "TXT", zones=zones).rr[0].rdata.data
    assert [len(s) for s in long_txt] == [255, 45]
    assert ask("nothing.example.test", zones=zones).auth[0].ttl == 10  # min(ttl 30, minimum 10)


def test_parse_hostport() -> None:
    assert parse_hostport("127.0.0.1:53") == ("127.0.0.1", "53")
    assert parse_hostport("[::1]:5353") == ("::1", "5353")
    assert parse_hostport("::1")[0] == ""
    assert parse_hostport("1.2.3.4:99999")[0] == ""


# -- raw packets and the query log --------------------------------------------------------


def raw_query(labels: list[bytes], qtype: int = 1, ident: int = 0x1234) -> bytes:
    name = b"".join(bytes([len(x)]) + x for x in labels) + b"\x00"
    return struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 0) + name + struct.pack("!HH", qtype, 1)


def test_raw_question_keeps_exact_bytes() -> None:
    label = bytes(range(0x80, 0x80 + 63))
    question = dnsmsg.parse_question(raw_query([label, b"T", b"Lab", b"Test"], qtype=65399))
    assert question is not None
    assert question.labels == (label, b"T", b"Lab", b"Test")
    assert question.name == label.decode("latin-1") + ".T.Lab.Test"
    assert question.key.endswith(".t.lab.test.") and question.qtype == 65399


@pytest.mark.parametrize(
    "packet",
    [
        b"",
        b"short",
        struct.pack("!HHHHHH", 1, 0x0100, 0, 0, 0, 0),  # no question
        struct.pack("!HHHHHH", 1, 0x0100, 1, 0, 0, 0) + b"\x05ab",  # label overruns
        struct.pack("!HHHHHH", 1, 0x0100, 1, 0, 0, 0) + b"\xc0\x0c\x00\x01\x00\x01",  # loop
        struct.pack("!HHHHHH", 1, 0x0100, 1, 0, 0, 0) + b"\x40abc\x00\x00\x01\x00\x01",
        struct.pack("!HHHHHH", 1, 0x0100, 1, 0, 0, 0) + b"\x01a\x00\x00\x01",  # no qclass
    ],
)
def test_raw_question_rejects_malformed_packets(packet: bytes) -> None:
    assert dnsmsg.parse_question(packet) is None


def test_compressed_question_name_is_followed() -> None:
    head = struct.pack("!HHHHHH", 9, 0x0100, 1, 0, 0, 0)
    # Name at offset 12: "a" then a pointer to "lab.test" placed after the question.
    body = b"\x01a\xc0\x14" + struct.pack("!HH", 1, 1) + b"\x03lab\x04test\x00"
    question = dnsmsg.parse_question(head + body)
    assert question is not None and question.name == "a.lab.test" and question.end == 20


def test_error_reply_is_built_from_the_raw_header() -> None:
    packet = raw_query([b"\xff\xfe", b"lab", b"test"], ident=0xBEEF)
    question = dnsmsg.parse_question(packet)
    reply = dnsmsg.error_reply(packet, dnsmsg.RCODE_FORMERR, question)
    assert reply is not None
    ident, flags, qd, an, ns, ar = struct.unpack_from("!HHHHHH", reply)
    assert (ident, flags & 0x8000, flags & 0x0100, flags & 0xF, qd) == (0xBEEF, 0x8000, 0x100, 1, 1)
    assert (an, ns, ar) == (0, 0, 0) and reply[12:] == packet[12:]
    assert dnsmsg.error_reply(b"\x00\x01", dnsmsg.RCODE_FORMERR) is None


def test_query_log_entry_and_reader(tmp_path: Path) -> None:
    packet = raw_query([b"MiXeD", b"lab", b"test"], qtype=28)
    record = entry(packet, "udp", ("198.18.0.1", 4242), dnsmsg.parse_question(packet))
    assert record["qname"] == "MiXeD.lab.test" and record["qtype"] == "AAAA"
    assert (record["src"], record["sport"], record["bytes"]) == ("198.18.0.1", 4242, len(packet))
    garbage = entry(b"xx", "tcp", ("2001:db8:ffff::1", 1, 0, 0), None)
    assert garbage["qname"] is None and garbage["qtype"] is None
    log = tmp_path / "q.jsonl"
    log.write_text('{"qname": "a"}\n{"qname": "b"}\n{"qna')  # a half-written last line
    assert [q["qname"] for q in read_query_log(log)] == ["a", "b"]
    assert read_query_log(tmp_path / "none.jsonl") == []


# -- topology plan ------------------------------------------------------------------------


def test_topology_commands_use_only_documentation_ranges() -> None:
    text = "\n".join(topology.uplink_commands() + topology.inet_commands())
    assert "10." not in text and "192.168." not in text and "172." not in text
    assert text.count("nodad") == 2 + 1 + len(topology.HTTP6)
    assert "forwarding" not in text and "default" not in "\n".join(topology.inet_commands())


@pytest.mark.parametrize("name", ["", "-x", "UPPER", "a" * 17, "sp ace", "a/b"])
def test_bad_lab_names(name: str) -> None:
    with pytest.raises(Exception, match="bad lab name"):
        topology.validate_name(name)
