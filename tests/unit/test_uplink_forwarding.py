"""Issue 12, item 9: what egress turns on in an uplink namespace, and what it puts back.

The decisions are pure (``plan``, ``restore_plan``); ``attach``/``detach`` run here against
a fake namespace (a dict of sysctls, a fake nft handle), so the kernel-without-
force_forwarding case is tested on any kernel. The real thing: privileged/test_forwarding.py.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from egress.datapath.render import PLACEHOLDER_UPLINK, render_uplink
from egress.sandbox import uplink
from egress.sandbox.uplink import ON, V4_ALL, V6_ALL, Plan, Saved, Seen, plan, restore_plan
from egress.store import claims, paths
from egress.store.paths import read_template

UP = "inet0"


@pytest.mark.parametrize(
    ("seen", "expected"),
    [
        # the usual host: forwards nothing; egress opens both families there, guarded
        (Seen(ipv4="0", ipv6_all="0", ipv6_force="0"), Plan(open4=True, open6=True, ipv6=True)),
        # a router or docker host: forwards already, egress changes nothing there
        (Seen(ipv4="1", ipv6_all="1", ipv6_force="0"), Plan(open4=False, open6=False, ipv6=True)),
        (Seen(ipv4="1", ipv6_all="0", ipv6_force="1"), Plan(open4=False, open6=False, ipv6=True)),
        # a kernel before 6.17: no per-interface IPv6 forwarding; the global one stays off
        (Seen(ipv4="0", ipv6_all="0", ipv6_force=None), Plan(open4=True, open6=False, ipv6=False)),
        # ... unless the namespace forwards IPv6 by its own choice already
        (Seen(ipv4="0", ipv6_all="1", ipv6_force=None), Plan(open4=True, open6=False, ipv6=True)),
        # no IPv6 in this kernel at all
        (Seen(ipv4="0", ipv6_all=None, ipv6_force=None), Plan(open4=True, open6=False, ipv6=False)),
    ],
)
def test_plan_opens_only_what_is_closed(seen: Seen, expected: Plan) -> None:
    assert plan(seen) == expected


def saved(**before: str) -> Saved:
    return Saved(
        netns_inode=1,
        ifname=UP,
        before={f"net/ipv4/conf/{UP}/forwarding": "0", **before},
        namespace={V4_ALL: "0", V6_ALL: "0"},
    )


def test_restore_puts_back_what_egress_set() -> None:
    v6 = f"net/ipv6/conf/{UP}/force_forwarding"
    record = saved(**{v6: "0"})
    now = {f"net/ipv4/conf/{UP}/forwarding": ON, v6: ON, V4_ALL: "0", V6_ALL: "0"}
    assert restore_plan(record, now) == {f"net/ipv4/conf/{UP}/forwarding": "0", v6: "0"}


def test_restore_leaves_what_others_changed_since() -> None:
    key = f"net/ipv4/conf/{UP}/forwarding"
    record = saved()
    # someone turned it off again: nothing to do
    assert restore_plan(record, {key: "0", V4_ALL: "0"}) == {}
    # the link is gone
    assert restore_plan(record, {key: None, V4_ALL: "0"}) == {}
    # the host turned forwarding on for the whole namespace since (docker started): its
    # choice set every interface, this one included, and stands
    assert restore_plan(record, {key: ON, V4_ALL: ON}) == {}


def test_guards_render_per_family() -> None:
    template = read_template("uplink.nft")
    both = render_uplink(template, UP)
    assert "\t\tiifname $UPLINK_IF drop\n" in both
    four = render_uplink(template, UP, guard4=True, guard6=False)
    assert "meta nfproto ipv4 iifname $UPLINK_IF drop" in four
    none = render_uplink(template, UP, guard4=False, guard6=False)
    assert "iifname $UPLINK_IF drop" not in none
    # `egressctl render` shows the guarded table (the default) with a placeholder device
    assert "iifname $UPLINK_IF drop" in render_uplink(template, PLACEHOLDER_UPLINK)


# ---- attach and detach against a fake namespace -----------------------------------------


class FakeHandle:
    def __init__(self, ns: FakeNetns) -> None:
        self.ns = ns

    def __enter__(self) -> FakeHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    # No nft call while a Sysctls session has the thread in the uplink: a worker
    # started again from there would run every later command in that netns.
    def table_exists(self, family: str, table: str) -> bool:
        assert not self.ns.inside
        return self.ns.table is not None

    def load(self, text: str) -> None:
        assert not self.ns.inside
        self.ns.table = text

    def delete_table(self, family: str, table: str) -> None:
        assert not self.ns.inside
        self.ns.table = None


class FakeNetns:
    """One uplink namespace: its sysctls (a key absent: the kernel has no such knob)."""

    def __init__(self, sysctls: dict[str, str]) -> None:
        self.sysctls = sysctls
        self.writes: list[tuple[str, str]] = []
        self.table: str | None = None
        self.inside = False

    @contextmanager
    def session(self, netns: str | None) -> Iterator[FakeNetns]:
        self.inside = True  # netns.sysctls(): the namespace's Sysctls
        try:
            yield self
        finally:
            self.inside = False

    def find(self, key: str) -> str | None:
        return self.sysctls.get(key)

    def get(self, key: str) -> str:
        return self.sysctls[key]

    def set(self, key: str, value: str | int) -> None:
        assert key in self.sysctls, key
        self.sysctls[key] = str(value)
        self.writes.append((key, str(value)))


def namespace(force_forwarding: bool, ipv4: str = "0") -> dict[str, str]:
    out = {V4_ALL: "0", "net/ipv4/conf/default/forwarding": "0", V6_ALL: "0",
           "net/ipv6/conf/default/forwarding": "0"}  # fmt: skip
    for ifname in ("lo", UP, "eg-a", "eg-b"):
        out[f"net/ipv4/conf/{ifname}/forwarding"] = ipv4 if ifname == UP else "0"
        out[f"net/ipv6/conf/{ifname}/forwarding"] = "0"
        if force_forwarding:
            out[f"net/ipv6/conf/{ifname}/force_forwarding"] = "0"
    return out


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    @contextmanager
    def make(sysctls: dict[str, str]) -> Iterator[FakeNetns]:
        ns = FakeNetns(sysctls)
        monkeypatch.setattr(uplink.netns, "sysctls", ns.session)
        monkeypatch.setattr(uplink.netns, "netns_inode", lambda netns: 42)
        monkeypatch.setattr(uplink.netns, "netns_exists", lambda netns: True)
        monkeypatch.setattr(uplink.netns, "default_route_ifname", lambda netns: UP)
        monkeypatch.setattr(uplink.NftHandle, "open", lambda netns: FakeHandle(ns))
        monkeypatch.setattr(uplink, "_handle", lambda netns: FakeHandle(ns))
        monkeypatch.setenv("EGRESS_RUN_DIR", str(tmp_path))
        monkeypatch.setattr(uplink, "_warned", set())
        yield ns

    yield make


def claim_for(sandbox_id: str) -> None:
    claims.save(claims.Claim(id=sandbox_id, index=0, netns=f"egress-{sandbox_id}",
                             host_if=f"eg-{sandbox_id}", uplink_netns="up",
                             owner_pid=os.getpid()))  # fmt: skip


def test_without_force_forwarding_ipv6_is_left_alone_with_one_warning(
    fake: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    with fake(namespace(force_forwarding=False)) as ns:
        claims.sandboxes_dir().mkdir(parents=True, exist_ok=True)
        claim_for("a")
        claim_for("b")
        uplink.attach("up", "eg-a")
        uplink.attach("up", "eg-b")
        # IPv4 on the device and the veths; nothing namespace-wide, nothing of IPv6
        assert ns.writes == [(f"net/ipv4/conf/{UP}/forwarding", "1"),
                             ("net/ipv4/conf/eg-a/forwarding", "1"),
                             ("net/ipv4/conf/eg-b/forwarding", "1")]  # fmt: skip
        assert "\t\tiifname $UPLINK_IF drop" not in (ns.table or "")
        assert "meta nfproto ipv4 iifname $UPLINK_IF drop" in (ns.table or "")
        err = capsys.readouterr().err
        assert err.count("get no IPv6") == 1, err
        assert os.uname().release in err and "6.17" in err and "force_forwarding" in err
        uplink.detach("up", "a")
        uplink.detach("up", "b")
        assert ns.sysctls == namespace(force_forwarding=False) | {
            "net/ipv4/conf/eg-a/forwarding": "1",  # the veths' ends go with the veths
            "net/ipv4/conf/eg-b/forwarding": "1",
        }


def test_with_force_forwarding_both_families_open_and_close(
    fake: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    with fake(namespace(force_forwarding=True)) as ns:
        uplink.attach("up", "eg-a")
        assert ns.sysctls[f"net/ipv6/conf/{UP}/force_forwarding"] == ON
        assert ns.sysctls["net/ipv6/conf/eg-a/force_forwarding"] == ON
        assert "\t\tiifname $UPLINK_IF drop" in (ns.table or "")
        assert uplink.saved_path("up").exists()
        uplink.detach("up", "no-claim")
        assert ns.table is None and not uplink.saved_path("up").exists()
        assert ns.sysctls[f"net/ipv6/conf/{UP}/force_forwarding"] == "0"
        assert ns.sysctls[f"net/ipv4/conf/{UP}/forwarding"] == "0"
        assert not {key for key, _ in ns.writes} & {V4_ALL, V6_ALL}
        assert "IPv6" not in capsys.readouterr().err


def test_a_host_that_forwards_already_is_not_changed_or_guarded(fake: Any) -> None:
    with fake(namespace(force_forwarding=True, ipv4="1") | {V6_ALL: "1"}) as ns:
        uplink.attach("up", "eg-a")
        uplink.detach("up", "no-claim")
        assert [key for key, _ in ns.writes if "eg-" not in key] == []
    assert "no guard" in render_uplink(read_template("uplink.nft"), UP, guard4=False,
                                       guard6=False)  # fmt: skip


def test_values_saved_before_a_crash_are_the_ones_put_back(fake: Any) -> None:
    """egress died with forwarding on: the next first-in must not take that 1 for the
    host's own value (the table went, say, with a reboot of nft, the file stayed)."""
    with fake(namespace(force_forwarding=True)) as ns:
        uplink.attach("up", "eg-a")
        ns.table = None  # crash, and the table is gone
        uplink.attach("up", "eg-a")  # first in again
        assert "\t\tiifname $UPLINK_IF drop" in (ns.table or "")  # still guarded
        uplink.detach("up", "no-claim")
        assert ns.sysctls[f"net/ipv4/conf/{UP}/forwarding"] == "0"
        assert ns.sysctls[f"net/ipv6/conf/{UP}/force_forwarding"] == "0"


def test_the_table_stays_while_another_live_sandbox_uses_the_uplink(
    fake: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``detach`` keeps the uplink set up while any other live sandbox uses it (its owner
    runs, or its netns is still there: one kept across an egressd restart), and the last
    one out takes it down: its own claim, another uplink's and a stale one (owner gone,
    netns gone) keep nothing."""
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid nobody has: pids come back only after pid_max more
    monkeypatch.setattr(paths, "NETNS_DIR", str(tmp_path / "netns"))
    (tmp_path / "netns").mkdir()
    (tmp_path / "netns" / "egress-test-e").touch()
    with fake(namespace(force_forwarding=True)) as ns:
        claims.sandboxes_dir().mkdir(parents=True, exist_ok=True)
        for sandbox_id, up, owner in (("a", "up", os.getpid()), ("b", "other", os.getpid()),
                                      ("c", "up", gone.pid), ("d", "up", os.getpid()),
                                      ("e", "up", gone.pid)):  # fmt: skip
            claims.save(claims.Claim(id=sandbox_id, index=0, netns=f"egress-test-{sandbox_id}",
                                     host_if=f"eg-{sandbox_id}", uplink_netns=up,
                                     owner_pid=owner))  # fmt: skip
        uplink.attach("up", "eg-a")
        uplink.detach("up", "a")  # d and e are still there
        uplink.detach("up", "d")  # e: its owner is gone, its netns is not
        assert ns.table is not None and uplink.saved_path("up").exists()
        claims.save(claims.Claim(id="f", index=0, netns="egress-test-f", host_if="eg-f",
                                 uplink_netns="up", owner_pid=os.getpid()))  # fmt: skip
        uplink.detach("up", "e")  # f: no netns yet, its owner runs
        assert ns.table is not None and uplink.saved_path("up").exists()
        assert ns.sysctls[f"net/ipv4/conf/{UP}/forwarding"] == ON
        uplink.detach("up", "f")  # b: another uplink; c: stale
        assert ns.table is None and not uplink.saved_path("up").exists()
        assert ns.sysctls[f"net/ipv4/conf/{UP}/forwarding"] == "0"
        assert sorted(c.id for c in claims.each()) == ["b", "c"]  # b: the other uplink's; c: gc's
