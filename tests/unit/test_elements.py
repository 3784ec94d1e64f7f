"""Set-element planning: ports per rule, TTL bounds, and timeouts that never shrink."""

from __future__ import annotations

import ipaddress
import struct

import pytest

from egress.datapath.elements import ExpiryBook, plan_update
from egress.kernel.nft_sets import _key
from egress.model import PortRange, Ports


def test_one_element_per_ip_and_port() -> None:
    ips = [ipaddress.ip_address("192.0.2.1"), ipaddress.ip_address("2001:db8::1")]
    update = plan_update(ips, Ports(tcp=(PortRange(443, 443),), udp=(PortRange(53, 53),)), 30)
    assert update.elements4 == ("192.0.2.1 . tcp . 443", "192.0.2.1 . udp . 53")
    assert update.elements6 == ("2001:db8::1 . tcp . 443", "2001:db8::1 . udp . 53")
    assert update.timeout_s == 30


def test_a_later_shorter_answer_does_not_shorten_an_element() -> None:
    book = ExpiryBook()
    e = ("192.0.2.1 . tcp . 443",)
    assert book.plan(e, 300, now=0.0) == {300: list(e)}
    book.record(list(e), 300, now=0.0)
    # 100 s later another name answers the same address with TTL 5: keep the 200 s left.
    assert book.plan(e, 5, now=100.0) == {200: list(e)}
    assert book.fresh(e, now=100.0) == []
    # After it has run out, a new answer's own timeout applies again.
    assert book.plan(e, 5, now=301.0) == {5: list(e)}
    assert book.fresh(e, now=301.0) == list(e)


def test_the_book_forgets_expired_entries_when_full() -> None:
    book = ExpiryBook(max_entries=10)
    for i in range(20):
        book.record([f"192.0.2.{i} . tcp . 443"], 1, now=float(i * 10))
    assert len(book) <= 10


@pytest.mark.parametrize(
    "ip", ["192.0.2.1", "0.0.0.0", "255.255.255.255", "2001:db8::1", "::ffff:192.0.2.1", "::"]
)
def test_the_netlink_writer_lays_an_element_out_as_nft_does(ip: str) -> None:
    """The key of ``IP . PROTO . PORT`` (plan_update's text): the address in network
    order, then the protocol and the port each in a 4-byte word."""
    want = ipaddress.ip_address(ip).packed + bytes((6, 0, 0, 0)) + struct.pack("!HH", 443, 0)
    assert _key(f"{ip} . tcp . 443") == want


@pytest.mark.parametrize(
    "ip", ["192.0.2", "192.0.2.256", "192.0.2.1.5", "2001:db8:::1", "example.org", ""]
)
def test_the_netlink_writer_refuses_what_is_not_an_address(ip: str) -> None:
    """ValueError: the set writer then hands the element to libnftables instead."""
    with pytest.raises(ValueError):
        _key(f"{ip} . udp . 53")
