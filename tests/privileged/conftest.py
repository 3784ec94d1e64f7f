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

import functools
import os
import secrets
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from egress.lab import Lab


@functools.cache
def netns_unavailable() -> str | None:
    """Why this machine cannot run privileged tests, or None if it can."""
    if os.geteuid() != 0:
        return "needs root: privileged tests create network namespaces"
    probe = f"eglp{secrets.token_hex(3)}"
    try:
        done = subprocess.run(
            ["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run `ip netns add`: {exc}"
    if done.returncode != 0:
        return f"`ip netns add` fails here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=10)
    return None


def skip_unless_root() -> None:
    """Skip the calling test (or module, at import) unless netns can be created."""
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def require_root() -> None:
    """Request this (or ``usefixtures("require_root")``) to skip without root/netns."""
    skip_unless_root()


def lab_name() -> str:
    # Short: the lab's netns names derive from it, and humans read them in `ip netns`.
    return f"egl{secrets.token_hex(2)}"


@pytest.fixture(scope="module")
def lab(require_root: None) -> Iterator[Lab]:
    """A lab with the default zones, shared by the tests of one module."""
    the_lab = Lab.up(name=lab_name())
    try:
        yield the_lab
    finally:
        the_lab.down()


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
