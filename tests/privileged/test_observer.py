"""The observer layer's process (egress/observer/layer.py) on a real sandbox, driven
tick by tick from the test: what it must not take for a violation, and when it must not act.
"""

from __future__ import annotations

import contextlib
import ipaddress
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from egress.datapath.addressing import Pools
from egress.kernel.netns import in_netns
from egress.kernel.nft import NftHandle
from egress.lab import Lab
from egress.observer.layer import COUNTER_S
from egress.policy import parse_policy
from egress.sandbox import lifecycle as sandbox
from egress.sandbox.lifecycle import Sandbox

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

POLICY = """
apiVersion: egress/v1
kind: Policy
metadata: {{name: observed}}
spec:
  dns:
    upstreams: ["{dns}"]
    allow: [allowed.lab.test]
  violations: {{blocked_connect: freeze}}
"""


@pytest.fixture
def box(lab: Lab) -> Iterator[Sandbox]:
    policy, _ = parse_policy(POLICY.format(dns=lab.dns4), "observed.yaml")
    sb = sandbox.create(policy, Pools.parse(None), lab.uplink_netns)
    try:
        yield sb
    finally:
        sb.destroy()


def test_a_new_observer_does_not_count_earlier_drops_as_missed(box: Sandbox, lab: Lab) -> None:
    """An observer (re)started on a sandbox that has dropped packets before (a policy
    swap restarts egressd's) must not take the drop counter's past for drops its log
    missed: that froze sandboxes on every swap."""
    from egress.store.journal import Journal

    with sender(box) as s:  # dropped by the sandbox's rules (and counted), before any observer
        for _ in range(3):
            with contextlib.suppress(PermissionError):  # the rules' drop, as EPERM
                s.sendto(b"x", ("192.0.2.7", 9))
    with NftHandle.open(box.netns) as nft:
        assert nft.counter("inet", "egress", "dropped")[0] == 3
    with observing(box) as (observer, state):
        for _ in range(3):  # what its ticks do: the counter, a tick apart, against its log
            observer._drain()
            time.sleep(COUNTER_S)
            observer._check_counter()
        assert not box.cgroup.is_frozen()
        with Journal.open(state) as journal:
            assert journal.violations(box.id) == []


@pytest.mark.parametrize("then", ["gone", "another netns at its path"])
def test_a_sandbox_gone_ends_its_watch_asked_about_once_a_second(
    box: Sandbox, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """A shard ticks each of its observers ten times a second; which netns the sandbox's
    path pins is a stat() each, asked once a second. Gone, or another netns there (an
    attached sandbox's /proc/PID/ns/net, the PID reused), the watch ends at the next ask."""
    from egress.observer import layer

    asked: list[str] = []
    changed = False
    real = layer.netns_id

    def netns_id(netns: str) -> tuple[int, int] | None:
        asked.append(netns)
        now = real(netns)
        if not changed or now is None:
            return now
        return None if then == "gone" else (now[0], now[1] + 1)

    monkeypatch.setattr(layer, "netns_id", netns_id)
    with observing(box) as (observer, _):
        assert asked == [box.netns]  # which netns it opened in
        for _ in range(20):
            observer.tick()
        assert asked == [box.netns] and not observer.stopping  # checked just now
        time.sleep(layer.NETNS_S)
        for _ in range(20):
            observer.tick()
        assert asked == [box.netns] * 2 and not observer.stopping
        changed = True
        time.sleep(layer.NETNS_S)
        observer.tick()
        assert asked == [box.netns] * 3 and observer.stopping


@pytest.mark.parametrize("current", [True, False])
def test_an_observer_whose_policy_was_swapped_out_does_not_act(
    box: Sandbox, lab: Lab, current: bool
) -> None:
    """egressd restarts a sandbox's observer a moment after a live swap; meanwhile the
    old one must not freeze by the old policy (``current`` says whether it is still in
    force). The control run, still current, does freeze."""
    from egress.observer.layer import Observer, ObserverConfig
    from egress.store.journal import Journal

    state = Path(tempfile.mkdtemp(prefix="egt-obs-"))
    try:
        with Journal.open(state) as journal:
            journal.record_sandbox(box.id, box.policy.name, netns=box.netns)
        cfg = ObserverConfig(
            box.id, box.netns, box.policy, str(state), None, current=lambda: current
        )
        observer = Observer(cfg)
        try:
            with in_netns(box.netns):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            with s, contextlib.suppress(PermissionError):
                s.sendto(b"x", ("192.0.2.7", 9))  # dropped, logged to the observer's group
            deadline = time.monotonic() + 5
            while not observer.stopping and not box.cgroup.is_frozen():
                assert time.monotonic() < deadline, "the observer never acted nor stopped"
                observer._drain()
                time.sleep(0.01)
            assert box.cgroup.is_frozen() is current and observer.stopping is not current
        finally:
            observer.close()
            box.cgroup.thaw()
    finally:
        shutil.rmtree(state)


@contextlib.contextmanager
def observing(box: Sandbox) -> Iterator[tuple[Any, Path]]:
    """An observer of ``box`` driven by the test, its journal in a directory of its own;
    closed, the sandbox thawed and the directory removed afterwards."""
    from egress.observer.layer import Observer, ObserverConfig
    from egress.store.journal import Journal

    state = Path(tempfile.mkdtemp(prefix="egt-obs-"))
    try:
        with Journal.open(state) as journal:
            journal.record_sandbox(box.id, box.policy.name, netns=box.netns)
        observer = Observer(ObserverConfig(box.id, box.netns, box.policy, str(state), None))
        try:
            yield observer, state
        finally:
            observer.close()
            box.cgroup.thaw()
    finally:
        shutil.rmtree(state)


def sender(box: Sandbox) -> socket.socket:
    with in_netns(box.netns):
        return socket.socket(socket.AF_INET, socket.SOCK_DGRAM)


def _counter_violations(box: Sandbox, state: Path) -> list[str]:
    from egress.store.journal import Journal

    with Journal.open(state) as journal:
        rows = journal.violations(box.id, limit=10000)
    return [r["detail"] for r in rows if "beyond the log's rate limit" in r["detail"]]


def test_a_steady_stream_of_logged_drops_is_not_taken_for_a_flood(box: Sandbox) -> None:
    """Drops under the log's limit, one between each of the observer's wake-ups, each
    message still on its way when the counter is read: every one was logged, so none is
    "beyond the log's rate limit" (that read froze a resumed sandbox again, for nothing)."""
    with observing(box) as (observer, state), sender(box) as s:
        # 50 drops over ~4 counter readings: 12/s, under the log's 200/s
        for port in range(1000, 1050):
            with contextlib.suppress(PermissionError):
                s.sendto(b"x", ("192.0.2.7", port))
            observer._check_counter()  # counted, its message not read yet
            observer._drain()
            box.cgroup.thaw()  # each freezes; the stream goes on, as resumed
            time.sleep(COUNTER_S / 12)
        for _ in range(3):
            time.sleep(COUNTER_S)
            observer._drain()
            observer._check_counter()
        assert _counter_violations(box, state) == []


def test_drops_beyond_the_logs_rate_limit_are_found_in_the_counter(box: Sandbox) -> None:
    """A burst past the log's limit (burst 100): the messages stop, the counter does not.
    What the log never carried is a violation of its own, a tick later."""
    with observing(box) as (observer, state):
        with sender(box) as s:
            for port in range(1000, 1400):
                with contextlib.suppress(PermissionError):
                    s.sendto(b"x", ("192.0.2.7", port))
        deadline = time.monotonic() + 10
        while not _counter_violations(box, state):
            assert time.monotonic() < deadline, "the counter's evidence was never judged"
            observer._drain()
            observer._check_counter()
            time.sleep(0.01)
        (detail,) = _counter_violations(box, state)
        missed = int(detail.split()[0])
        assert 400 - 100 - 10 <= missed <= 400 - 100  # the burst passes, and ~200/s
        assert box.cgroup.is_frozen()


def _query(name: str, qid: int) -> bytes:
    qname = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return (
        qid.to_bytes(2, "big") + b"\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + qname + b"\0\1\0\1"
    )


@pytest.mark.parametrize("gso", [True, False])
def test_queries_sent_at_once_with_udp_gso_are_not_judged_by_the_first_alone(
    box: Sandbox, gso: bool
) -> None:
    """An allowed and a denied query of one size, sent with UDP_SEGMENT as one write: the
    output rule copies one packet, which parses as the allowed query, while the resolver's
    socket would receive both. The observer calls that copy a tunnel. Sent as two writes
    (the control), it judges each: one denied_name, no tunnel."""
    first, second = _query("allowed.lab.test", 1), _query("blocked.lab.test", 2)
    assert len(first) == len(second)
    with observing(box) as (observer, state):
        with sender(box) as s:
            if gso:
                s.setsockopt(socket.IPPROTO_UDP, 103, len(first))  # UDP_SEGMENT
                s.sendto(first + second, ("127.0.0.53", 53))
            else:
                s.sendto(first, ("127.0.0.53", 53))
                s.sendto(second, ("127.0.0.53", 53))
        from egress.store.journal import Journal

        deadline = time.monotonic() + 5
        while True:
            observer._drain()
            with Journal.open(state) as journal:
                classes = sorted(r["class"] for r in journal.violations(box.id))
            if classes or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert classes == (["tunnel"] if gso else ["denied_name"])


def test_an_observer_started_mid_flight_knows_what_the_allow_sets_hold(box: Sandbox) -> None:
    """An observer (re)started on a sandbox already in use (a policy swap restarts
    egressd's) reads the allow sets through its own nf_tables socket, not libnftables:
    each address there, v4 and v6, until its element's end (and a grace after), as
    ``nft list set`` shows them. A connection to one is not the observer's to judge."""
    from egress.datapath.elements import element_parts
    from egress.observer.answers import GRACE_S

    with NftHandle.open(box.netns) as nft:
        nft.add_elements("inet", "egress", "allow4", ["192.0.2.10 . tcp . 443"], timeout_s=30)
        nft.add_elements("inet", "egress", "allow4", ["192.0.2.11 . udp . 53"], timeout_s=90)
        nft.add_elements("inet", "egress", "allow6", ["2001:db8::10 . tcp . 443"], timeout_s=60)
        listed = nft.allowed_elements()
    began = time.time()
    with observing(box) as (observer, _):
        unknown = dict(observer.flows.unknown)
    ends: dict[Any, float] = {}
    for key, left in listed:
        parts = element_parts(key)
        assert parts is not None
        ends[parts[0]] = max(ends.get(parts[0], 0.0), began + left + GRACE_S)
    assert (
        set(unknown)
        == set(ends)
        >= {ipaddress.ip_address(a) for a in ("192.0.2.10", "192.0.2.11", "2001:db8::10")}
    )
    for address, end in ends.items():
        # nft lists whole seconds left; the socket, milliseconds
        assert end - 1.5 <= unknown[address] <= end + 1.5, (address, unknown[address], end)
