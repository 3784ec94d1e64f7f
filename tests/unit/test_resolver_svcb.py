"""HTTPS/SVCB records as a sandbox gets them: no ECH, no address hints (resolver.svcb)."""

from __future__ import annotations

import struct

from dnslib import HTTPS, QTYPE, RR, A, DNSRecord
from dnslib.label import DNSBuffer
from hypothesis import given, settings
from hypothesis import strategies as st

from egress.model import PortRange, Ports
from egress.policy import parse_policy
from egress.policy.matcher import Matcher
from egress.resolver import message, message_dnslib, svcb
from egress.resolver.answer import filter_answer

WEB = Ports(tcp=(PortRange(80, 80), PortRange(443, 443)))
ALPN = (1, b"\x02h2\x08http/1.1")
PORT_443 = (3, struct.pack("!H", 443))
V4HINT = (4, bytes([203, 0, 113, 10]))
ECH = (5, bytes.fromhex("0045fe0d0041a500200020"))
V6HINT = (6, bytes(15) + b"\x01")


def rdata(priority: int, target: bytes, *params: tuple[int, bytes]) -> bytes:
    out = struct.pack("!H", priority) + target
    for key, value in params:
        out += struct.pack("!HH", key, len(value)) + value
    return out


def mandatory(*keys: int) -> tuple[int, bytes]:
    return 0, struct.pack(f"!{len(keys)}H", *keys)


def test_ech_and_address_hints_are_removed_and_the_rest_kept() -> None:
    full = rdata(1, b"\x00", ALPN, PORT_443, V4HINT, ECH, V6HINT)
    assert svcb.for_sandbox(full, WEB) == rdata(1, b"\x00", ALPN, PORT_443)


def test_a_record_that_needs_a_removed_key_goes_and_one_that_needs_others_stays() -> None:
    assert svcb.for_sandbox(rdata(1, b"\x00", mandatory(1, 5), ALPN, ECH), WEB) is None
    assert svcb.for_sandbox(rdata(1, b"\x00", mandatory(4), ALPN, V4HINT), WEB) is None
    kept = rdata(1, b"\x00", mandatory(1), ALPN)
    assert svcb.for_sandbox(rdata(1, b"\x00", mandatory(1), ALPN, ECH), WEB) == kept


def test_a_port_the_rule_does_not_allow_removes_the_record() -> None:
    alt = rdata(1, b"\x00", ALPN, (3, struct.pack("!H", 8443)))
    assert svcb.for_sandbox(alt, WEB) is None
    assert svcb.for_sandbox(alt, Ports(tcp=(PortRange(8000, 9000),))) == alt


def test_alias_mode_and_a_target_name_pass_as_they_are() -> None:
    alias = rdata(0, b"\x03cdn\x07example\x00")
    assert svcb.for_sandbox(alias, WEB) == alias
    service = rdata(2, b"\x03svc\x07example\x00", ALPN, ECH)
    assert svcb.for_sandbox(service, WEB) == rdata(2, b"\x03svc\x07example\x00", ALPN)


def test_records_that_do_not_parse_are_removed() -> None:
    good = rdata(1, b"\x00", ALPN, PORT_443)
    bad = [
        b"\x00",  # no target
        rdata(1, b"\x03abc"),  # target cut short
        rdata(1, b"\xc0\x0c", ALPN),  # a compressed target
        rdata(1, b"\x00", PORT_443, ALPN),  # keys out of order
        rdata(1, b"\x00", ALPN, ALPN),  # a key twice
        rdata(1, b"\x00", (0, b"\x00")),  # a mandatory list of odd length
        rdata(1, b"\x00", (3, b"\x01")),  # a port of one byte
        good[:-1],  # the last value cut short
        good + b"\x00",  # a trailing byte
    ]
    for data in bad:
        assert svcb.for_sandbox(data, WEB) is None, data.hex()


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_give_a_record_or_none(data: bytes) -> None:
    out = svcb.for_sandbox(data, WEB)
    assert out is None or svcb.for_sandbox(out, WEB) == out  # what is kept parses again


def test_the_hand_reader_reads_https_records_as_dnslib_does() -> None:
    msg = DNSRecord.question("svc.test", "HTTPS").reply()
    raw = rdata(1, b"\x00", ALPN, V4HINT, ECH)
    msg.add_answer(RR("svc.test", QTYPE.HTTPS, rdata=HTTPS.parse(DNSBuffer(raw), len(raw))))
    data = bytes(msg.pack())
    assert message.parse(data) == message_dnslib.from_dnslib(data)
    assert message.parse(data).answers[0].rdata == raw


POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {name: t}
spec:
  dns:
    allow:
      - name: svc.test
"""


def test_the_answer_filter_strips_https_records_and_keeps_their_addresses() -> None:
    policy, _ = parse_policy(POLICY, "t.yaml")
    matcher = Matcher(policy)
    msg = DNSRecord.question("svc.test", "HTTPS").reply()
    raw = rdata(1, b"\x00", ALPN, V4HINT, ECH, V6HINT)
    msg.add_answer(RR("svc.test", QTYPE.HTTPS, rdata=HTTPS.parse(DNSBuffer(raw), len(raw))))
    response = message.parse(bytes(msg.pack()))
    rule = matcher.rule_for("svc.test")
    assert rule is not None
    filtered = filter_answer(response, "svc.test", 65, rule, matcher, policy)
    assert [rr.rdata for rr in filtered.answers] == [rdata(1, b"\x00", ALPN)]
    assert filtered.ips == [] and filtered.findings == []
    # an A answer of the same name is untouched
    msg = DNSRecord.question("svc.test", "A").reply()
    msg.add_answer(RR("svc.test", QTYPE.A, rdata=A("203.0.113.10")))
    filtered = filter_answer(message.parse(bytes(msg.pack())), "svc.test", 1, rule, matcher, policy)
    assert [str(ip) for ip, _ in filtered.ips] == ["203.0.113.10"]
