"""`egressctl render` output and the uplink table load in a real nft, for every shipped
policy (the rendered text must pass `nft -c -f`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from egress.kernel import netns
from tests.support.netns import unique

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("require_root")]

POLICIES = sorted(Path(__file__).resolve().parents[2].joinpath("policies").glob("*.yaml"))


@pytest.fixture(scope="module")
def scratch() -> str:
    name = unique("render")
    netns.create_netns(name)
    try:
        yield name
    finally:
        netns.remove_netns(name)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_rendered_ruleset_passes_nft_check(policy: Path, scratch: str) -> None:
    done = subprocess.run([sys.executable, "-m", "egress.cli.main", "render", str(policy)],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert "table inet egress" in done.stdout and "define RESOLVER4" in done.stdout
    check = subprocess.run(["ip", "netns", "exec", scratch, "nft", "-c", "-f", "-"],
                           input=done.stdout, capture_output=True, text=True)  # fmt: skip
    assert check.returncode == 0, check.stderr


def test_uplink_table_passes_nft_check(scratch: str) -> None:
    from egress.datapath.render import render_uplink
    from egress.store.paths import read_template

    text = render_uplink(read_template("uplink.nft"), "eth0")
    check = subprocess.run(["ip", "netns", "exec", scratch, "nft", "-c", "-f", "-"],
                           input=text, capture_output=True, text=True)  # fmt: skip
    assert check.returncode == 0, check.stderr


def test_a_broken_template_is_caught(scratch: str) -> None:
    """The check above can fail: a template with a typo does not pass nft -c."""
    from egress.datapath.render import render_sandbox
    from egress.policy import load_policy
    from egress.store.paths import read_template

    text = render_sandbox(read_template("sandbox.nft"), load_policy(str(POLICIES[0])))
    broken = text.replace("policy drop", "policy dorp")
    check = subprocess.run(["ip", "netns", "exec", scratch, "nft", "-c", "-f", "-"],
                           input=broken, capture_output=True, text=True)  # fmt: skip
    assert check.returncode != 0


@pytest.mark.parametrize("checks", ["[80, 443]", "false"])
def test_the_first_bytes_chain_with_and_without_checks_passes_nft_check(
    scratch: str, checks: str
) -> None:
    from egress.datapath.render import render_sandbox
    from egress.policy import parse_policy
    from egress.store.paths import read_template

    text = (
        POLICIES[0].read_text().replace("  connect:\n", f"  connect:\n    check_names: {checks}\n")
    )
    policy, _ = parse_policy(text, "p.yaml")
    ruleset = render_sandbox(read_template("sandbox.nft"), policy)
    assert ("meta mark set $QUEUE_MARK" in ruleset) is (checks != "false")
    check = subprocess.run(["ip", "netns", "exec", scratch, "nft", "-c", "-f", "-"],
                           input=ruleset, capture_output=True, text=True)  # fmt: skip
    assert check.returncode == 0, check.stderr
