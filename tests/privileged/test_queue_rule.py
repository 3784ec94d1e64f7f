"""The NFQUEUE rule of queue_rule.py: made by iptables-nft in the first fresh netns of a
process, copied (egress.kernel.nft_copy) into the next ones. A copy must be the same rule
to iptables-nft and to the kernel: listed alike, found by ``-C``, removed by ``remove``,
and queueing (here: dropping, nobody listens on the queue) what it should."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator

import pytest

from egress.datapath import constants as c
from egress.datapath.render import queue_rules as render_queue_rules
from egress.kernel import netns, nft_copy
from egress.kernel import queue_rule as queue_rules
from egress.kernel.nft import NftHandle
from tests.support.netns import scratch_netns

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

RULES = render_queue_rules()
KEY = tuple(tuple(rule) for rule in RULES)
# What the sandbox's table does before the queue rules: the flow needs its check (or is
# read request by request), the segment is one to hold.
MARKS = """
table inet t {{
    chain out {{
        type filter hook output priority -170; policy accept;  # after conntrack (-200)
        udp dport 9999 ct mark set {ct} meta mark set {mark}
    }}
}}
"""


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    monkeypatch.setattr(queue_rules, "_copies", {})  # this process's first install first
    with scratch_netns("q1") as a, scratch_netns("q2") as b:
        yield [a, b]


def listing(ns: str) -> str:
    return "".join(
        subprocess.run(["ip", "netns", "exec", ns, tool, "-t", "mangle", "-S"],
                       capture_output=True, text=True, check=True, timeout=30).stdout
        for tool in ("iptables-nft", "ip6tables-nft")
    )  # fmt: skip


def arrives(ns: str) -> bool:
    """Does a UDP datagram to port 9999 on loopback reach its socket?"""
    netns.loopback_up(ns)
    with netns.in_netns(ns):
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with rx, tx:
        rx.bind(("127.0.0.1", 9999))
        rx.settimeout(1.0)  # a datagram on loopback arrives within the sendto, or never
        tx.sendto(b"x", ("127.0.0.1", 9999))
        try:
            return rx.recv(16) == b"x"
        except TimeoutError:
            return False


def test_the_second_netns_gets_a_copy_that_is_the_same_rule(
    fresh: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = fresh
    queue_rules.install(first, RULES)  # iptables-nft, then read back
    copy = queue_rules._copies[KEY]
    assert copy.count(nft_copy.NEWRULE) == 2 * len(RULES)  # per family

    def no_exec(*_: object) -> None:
        raise AssertionError("iptables-nft ran: the copy was refused")

    monkeypatch.setattr(queue_rules, "_exec_both", no_exec)
    queue_rules.install(second, RULES)  # the copy alone
    assert listing(second) == listing(first)
    assert "-A OUTPUT -m mark --mark 0x65677220 -m connmark --mark 0x65677210" in listing(second)
    for family in (4, 6):
        assert all(queue_rules._present(second, family, rule) for rule in RULES)
    # It queues: with nobody on the queue the held segment is dropped (no bypass), an
    # unchecked flow's and a read flow's alike; a checked flow's goes by.
    for ct, queued in ((c.CT_NEEDS_CHECK, True), (c.CT_READING, True), (c.CT_CHECKED, False)):
        with NftHandle.open(second) as nft:
            nft.load(MARKS.format(ct=ct, mark=c.QUEUE_MARK))
            assert arrives(second) is not queued, hex(ct)
            nft.delete_table("inet", "t")
            assert arrives(second)  # the control: unmarked, it is let through
    queue_rules.remove(second, RULES)
    tables = subprocess.run(
        ["ip", "netns", "exec", second, "nft", "list", "tables"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    assert "mangle" not in tables  # the copied tables went with the rule  # fmt: skip


def test_a_copy_the_kernel_refuses_falls_back_to_iptables_nft(fresh: list[str]) -> None:
    first, second = fresh
    queue_rules.install(first, RULES)
    key = KEY
    # A copy naming an expression no kernel has: the batch is refused as a whole.
    good = queue_rules._copies[key]
    queue_rules._copies[key] = nft_copy.Copy(
        tuple(
            (k, f, a.replace(b"NFQUEUE\0", b"NOSUCHQ\0")) if k == nft_copy.NEWRULE else (k, f, a)
            for k, f, a in good.objects
        )
    )
    queue_rules.install(second, RULES)
    assert listing(second) == listing(first)
    # Refused once, refused again: later creates run iptables-nft without trying it.
    assert queue_rules._copies[key] is queue_rules._EXEC_ONLY


def test_a_copy_is_kept_only_of_what_a_fresh_netns_got(fresh: list[str]) -> None:
    first, _ = fresh
    queue_rules.install(first, RULES)
    copy = queue_rules._copies[KEY]
    assert copy.plain()
    # A rule read short (its expressions lost) or an owned table is not iptables-nft's.
    short = nft_copy.Copy(tuple((k, f, b"") if k == nft_copy.NEWRULE else (k, f, a)
                                for k, f, a in copy.objects))  # fmt: skip
    assert not short.plain()
    owned_flags = b"\x08\x00\x02\x00\x00\x00\x00\x02"  # NFTA_TABLE_FLAGS = OWNER
    owned = nft_copy.Copy(tuple((k, f, a + owned_flags) if k == nft_copy.NEWTABLE else (k, f, a)
                                for k, f, a in copy.objects))  # fmt: skip
    assert not owned.plain()
