"""`make demo`'s job, `egressctl demo`, end to end: the README's first command must work.

It brings its own lab, so it needs no fixture; what it prints is its contract with a new
user: each step's verdict, the freeze and the kill.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.support.sandboxes import EGRESSCTL, env

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]


def test_the_demo_agent_is_allowed_refused_and_frozen_as_it_says() -> None:
    done = subprocess.run([*EGRESSCTL, "demo"], capture_output=True, text=True, env=env(),
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "ok  resolve allowed.lab.test and fetch it over HTTP" in out, out
    assert "no  resolve denied.lab.test: refused" in out, out
    assert (
        "no  ask allowed.lab.test's address for denied.lab.test (HTTP Host): refused "
        "(Connection reset by peer); the lab's web server never saw the request" in out
    ), out
    assert "no  resolve meta.lab.test" in out and "the answer was dropped" in out, out
    assert "frozen inside connect(), then killed" in out, out
    assert "its own) with no capabilities, in its own PID namespace" in out, out
    assert "outcome: killed, exit status 137" in out, out
