"""Privileged-test fixtures: a root/netns check, and a throwaway lab per test module.

Each module gets its own lab with a random short name (``egl`` + 4 hex digits), so test
modules never share DNS state or query logs, and two test runs on one machine do not
collide. The lab is torn down after the module whether its tests passed or not.

Use::

    pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

    def test_something(lab):          # module-scoped, see egress.lab.Lab
        lab.run(["dig", f"@{lab.dns4}", "allowed.lab.test", "+short"])

    def test_custom_zones(make_lab):  # function-scoped, any number of labs
        lab = make_lab(zones="my-zones.yaml")
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import pytest

from egress.lab import Lab
from tests.support.labs import lab_name, running_lab
from tests.support.netns import netns_unavailable


@pytest.fixture(scope="session")
def require_root() -> None:
    """Request this (or ``usefixtures("require_root")``) to skip without root/netns."""
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def lab(require_root: None) -> Iterator[Lab]:
    """A lab with the default zones, shared by the tests of one module."""
    with running_lab() as the_lab:
        yield the_lab


@pytest.fixture
def make_lab(require_root: None) -> Iterator[Callable[..., Lab]]:
    """``make_lab(zones=PATH)`` -> a fresh Lab, torn down after the test."""
    made: list[Lab] = []

    def factory(zones: str | Path | None = None, name: str | None = None) -> Lab:
        made.append(Lab.up(name=name or lab_name(), zones=zones))
        return made[-1]

    try:
        yield factory
    finally:
        errors = []
        for one in reversed(made):
            try:
                one.down()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


@pytest.fixture(autouse=True)
def host_namespace_left_alone(host_had_uplink_table: bool | None) -> Iterator[None]:
    """No test makes the host's own namespace an uplink (forwarding and NAT on its real
    interface): every sandbox a test makes leaves through a lab's uplink netns, which has
    no route out. egress's uplink table still there when a test ends fails that test (one
    a module's fixtures leave, the session's check). If the host had one already (egress
    in real use here), a test's cannot be told apart."""
    if host_had_uplink_table is None:  # no root here: the tests skip
        yield
        return
    before = _host_has_uplink_table()
    yield
    if not before and _host_has_uplink_table():
        pytest.fail("this test made the host's own namespace an uplink (nft table "
                    "inet egress_uplink is there now): give its sandboxes a lab's "
                    "uplink netns")  # fmt: skip


@pytest.fixture(scope="session")
def host_had_uplink_table() -> Iterator[bool | None]:
    """Whether the host had egress's uplink table when the tests began (None: no root)."""
    if netns_unavailable():
        yield None
        return
    before = _host_has_uplink_table()
    yield before
    if not before and _host_has_uplink_table():
        pytest.fail("the privileged tests left the host's own namespace an uplink (nft "
                    "table inet egress_uplink)")  # fmt: skip


def _host_has_uplink_table() -> bool:
    listed = subprocess.run(["nft", "list", "tables", "inet"], capture_output=True,
                            text=True, check=True, timeout=30)  # fmt: skip
    return "table inet egress_uplink" in listed.stdout.splitlines()


@pytest.fixture(scope="session", autouse=True)
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every egress command the tests run journals here, never in /var/lib/egress."""
    path = tmp_path_factory.mktemp("egress-state")
    old = os.environ.get("EGRESS_STATE_DIR")
    os.environ["EGRESS_STATE_DIR"] = str(path)
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("EGRESS_STATE_DIR", None)
        else:
            os.environ["EGRESS_STATE_DIR"] = old


@pytest.fixture(scope="session", autouse=True)
def teardown_on_sigterm() -> Iterator[None]:
    """A cancelled run (a CI runner sends SIGTERM) tears down as an interrupted one does:
    pytest turns KeyboardInterrupt into teardown of every fixture set up, so its labs,
    netns, cgroups and processes go; SIGTERM's default would leave them all. A process
    forked from this one (it inherits the handler) still ends as SIGTERM ends it."""
    main = os.getpid()

    def interrupted(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != main:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
